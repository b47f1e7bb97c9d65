"""Where the retrieval service may listen without a token: one rule for `marge serve` (uvicorn) and the Ray Serve
deployment (services/retrieval/ray_serve.py)."""

from __future__ import annotations

from marge.util.net import is_loopback


def check_bind(host: str, token: str | None, insecure: bool, token_hint: str, insecure_hint: str) -> None:
    """Refuse to listen beyond loopback without a bearer token (whoever reaches the address could search the index
    and read the corpus), unless the network is declared trusted (`insecure`). The hints say, in the caller's terms,
    how to give a token and how to declare the network trusted."""
    if not token and not is_loopback(host) and not insecure:
        raise ValueError(f"refusing to serve on {host} without a token: {token_hint} "
                         f"(or {insecure_hint} if the network is trusted)")
