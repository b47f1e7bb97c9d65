"""The Ray Serve deployment of the retrieval service keeps `marge serve`'s bind rule, on a real Ray: loopback by
default, a bearer token beyond it (checked in constant time by the same FastAPI app), and a refused bind starts
nothing. No test here binds beyond loopback: the refusals happen before Ray Serve binds, or against a Serve instance
whose proxies are configured for 0.0.0.0 but not started."""

from __future__ import annotations

import inspect
import socket

import httpx
import pytest

from services.driver.redis_server import free_port

TOKEN = "ray-serve-token-0123456789"


def listening(port: int) -> bool:
    """Whether anything accepts connections on `port` (on loopback, which a 0.0.0.0 bind includes)."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def servable(small_corpus, tmp_path_factory):
    from test_service import build_run  # tests/integration/test_service.py: a snapshot and index version 0

    run = tmp_path_factory.mktemp("ray-serve") / "run"
    build_run(run, small_corpus, version=0, seed=0)
    return run, small_corpus


def test_marge_serve_and_the_ray_serve_deployment_apply_the_same_rule():
    """Both entry points call the one rule (a second copy could drift); the Ray Serve one is loopback by default."""
    from services.cli import serve as cli_serve
    from services.retrieval import ray_serve

    assert "check_bind(" in inspect.getsource(cli_serve.cmd_serve)
    assert "check_bind(" in inspect.getsource(ray_serve.serve_app)
    assert "check_bind(" in inspect.getsource(ray_serve.deployment)  # each replica checks what Serve binds
    assert inspect.signature(ray_serve.serve_app).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(ray_serve.serve_app).parameters["insecure"].default is False


def test_ray_serve_refuses_a_public_bind_without_a_token_before_binding_and_serves_loopback_with_one(ray_cluster,
                                                                                                     servable):
    from ray import serve
    from ray.serve.context import _get_global_client

    from services.retrieval.ray_serve import serve_app
    from services.retrieval.settings import ServeSettings

    run, corpus = servable
    port = free_port()
    open_settings = ServeSettings(run_dir=run, corpus_dir=corpus)
    with pytest.raises(ValueError, match=r"refusing to serve on 0\.0\.0\.0 without a token: give ServeSettings"):
        serve_app(open_settings, host="0.0.0.0", port=port)
    assert _get_global_client(raise_if_no_controller_running=False) is None  # Ray Serve was not started
    assert not listening(port)
    try:
        serve_app(ServeSettings(run_dir=run, corpus_dir=corpus, token=TOKEN), port=port)  # loopback by default
        base, body = f"http://127.0.0.1:{port}", {"query": "cells", "k": 3}
        assert httpx.post(f"{base}/v1/search", json=body, timeout=60).status_code == 401
        wrong = httpx.post(f"{base}/v1/search", json=body, headers={"Authorization": "Bearer wrong"}, timeout=60)
        assert wrong.status_code == 401
        right = httpx.post(f"{base}/v1/search", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert right.status_code == 200 and len(right.json()["results"]) == 3
    finally:
        serve.shutdown()


def test_a_replica_refuses_to_start_when_serve_was_configured_for_a_public_address_and_there_is_no_token(
        ray_cluster, servable):
    """A Serve instance started elsewhere (`serve.start`, a Serve config) with its HTTP host 0.0.0.0: the deployment
    without a token does not start, naming the address and what to do; the proxies are off here (nothing binds)."""
    from ray import serve

    from services.retrieval.ray_serve import deployment
    from services.retrieval.settings import ServeSettings

    run, corpus = servable
    port = free_port()
    serve.start(proxy_location="Disabled", http_options={"host": "0.0.0.0", "port": port})
    try:
        assert not listening(port)
        with pytest.raises(RuntimeError, match="Deploying application open failed"):
            serve.run(deployment(ServeSettings(run_dir=run, corpus_dir=corpus)), name="open", route_prefix="/")
        why = serve.status().applications["open"].deployments["marge-retrieval"].message
        assert "refusing to serve on 0.0.0.0 without a token: give ServeSettings(token=...)" in why, why
        assert "(or pass insecure=True if the network is trusted)" in why, why
    finally:
        serve.shutdown()
