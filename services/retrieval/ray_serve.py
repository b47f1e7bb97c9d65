"""The retrieval service as a Ray Serve deployment (needs `pip install -e .[serve]`).

    from services.retrieval.ray_serve import deployment
    serve.run(deployment(ServeSettings(run_dir=..., corpus_dir=...)), route_prefix="/")

Each replica loads the newest committed index and watches for newer versions, exactly like the
uvicorn service; Ray Serve adds replicas, routing and the dashboard's Serve tab.
"""

from __future__ import annotations

from ray import serve

from services.retrieval.app import ServeSettings, create_app


def deployment(settings: ServeSettings, num_replicas: int = 1, num_cpus: float = 0.5):
    app = create_app(settings)

    @serve.deployment(name="marge-retrieval", num_replicas=num_replicas, ray_actor_options={"num_cpus": num_cpus})
    @serve.ingress(app)
    class Retrieval:
        def __init__(self):
            app.state.holder.start()  # also run by the app's lifespan; starting twice is harmless

    return Retrieval.bind()  # type: ignore[attr-defined]  # @serve.deployment makes it a deployment; mypy applies no class decorator
