"""Where the retrieval service may listen without a token: one rule for `marge serve` and the Ray Serve deployment
(the Ray Serve half on a real Ray is in tests/integration/test_ray_serve_bind.py)."""

from __future__ import annotations

import pytest


def test_a_bind_beyond_loopback_needs_a_token_unless_declared_trusted():
    from services.retrieval.exposure import check_bind

    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(host, None, insecure=False, token_hint="give a token", insecure_hint="pass insecure")
    for host in ("0.0.0.0", "::", "10.0.0.5", "127.example.com"):
        check_bind(host, "t0ken", insecure=False, token_hint="give a token", insecure_hint="pass insecure")
        check_bind(host, None, insecure=True, token_hint="give a token", insecure_hint="pass insecure")
        for token in (None, ""):
            with pytest.raises(ValueError, match=f"refusing to serve on {host} without a token: give a token "
                                                 r"\(or pass insecure if the network is trusted\)"):
                check_bind(host, token, insecure=False, token_hint="give a token", insecure_hint="pass insecure")

