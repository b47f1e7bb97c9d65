"""The retrieval service as a Ray Serve deployment (needs `pip install -e .[serve]`).

    from services.retrieval.ray_serve import serve_app
    serve_app(ServeSettings(run_dir=..., corpus_dir=..., token=...), host="127.0.0.1", port=8000)

Each replica loads the newest committed index and watches for newer versions, exactly like the
uvicorn service; Ray Serve adds replicas, routing and the dashboard's Serve tab. The bind rule is
`marge serve`'s (services/retrieval/exposure.py): loopback by default, and beyond loopback only with a
bearer token or `insecure=True`. `serve_app` applies it before Ray Serve starts (nothing is bound when it
refuses); `deployment`, for a Serve instance started elsewhere (`serve.start`, a Serve config), applies it in
each replica to the address Serve's HTTP proxies were configured with.
"""

from __future__ import annotations

from ray import serve

from services.retrieval.app import ServeSettings, create_app
from services.retrieval.exposure import check_bind

TOKEN_HINT = "give ServeSettings(token=...) a bearer token (e.g. from a file)"
INSECURE_HINT = "pass insecure=True"


def serve_host() -> str | None:
    """The address the running Ray Serve's HTTP proxies are configured to bind (`http_options.host`; None: no HTTP).

    Ray Serve has no public call for it; the controller's HTTP config is where `serve.start` and a Serve config put
    it."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # raises instead when no Serve controller runs
    return client.http_config.host


def deployment(settings: ServeSettings, num_replicas: int = 1, num_cpus: float = 0.5, insecure: bool = False):
    """The service as a Ray Serve application, to `serve.run`. Each replica refuses to start when Serve's HTTP host
    is beyond loopback and `settings` has no token (unless `insecure`)."""
    app = create_app(settings)

    @serve.deployment(name="marge-retrieval", num_replicas=num_replicas, ray_actor_options={"num_cpus": num_cpus})
    @serve.ingress(app)
    class Retrieval:
        def __init__(self):
            host = serve_host()
            if host is not None:
                check_bind(host, settings.token, insecure, TOKEN_HINT, INSECURE_HINT)
            app.state.holder.start()  # also run by the app's lifespan; starting twice is harmless

    return Retrieval.bind()  # type: ignore[attr-defined]  # @serve.deployment makes it a deployment; mypy applies no class decorator


def serve_app(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, insecure: bool = False,
              num_replicas: int = 1, num_cpus: float = 0.5, name: str = "marge-retrieval", route_prefix: str = "/"):
    """Start Ray Serve's HTTP proxy on `host`:`port` and run the service there, as `marge serve` runs it on uvicorn:
    the bind rule is checked first, so a refused bind starts nothing. Returns the application's handle."""
    check_bind(host, settings.token, insecure, TOKEN_HINT, INSECURE_HINT)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(deployment(settings, num_replicas, num_cpus, insecure), name=name, route_prefix=route_prefix)
