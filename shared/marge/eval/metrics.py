"""Ray metrics of a stage, each tagged with the stage, the run and (for workers) the worker or rank.

    metrics = StageMetrics("indexer", run="tiny", worker="0")
    metrics.gauge("marge_index_version", "Newest committed index version")
    metrics.set("marge_index_version", 3)

They appear on the Ray dashboard's metrics page (and Prometheus) as `ray_<name>`. Ray is imported when a
stage builds its metrics, so code that never does (the single-process run) needs no Ray.
"""

from __future__ import annotations

from typing import Any


class StageMetrics:
    def __init__(self, stage: str, run: str, **tags: str):
        self.tags = {"stage": stage, "run": run, **tags}
        self.metrics: dict[str, Any] = {}

    def _add(self, kind: str, name: str, description: str, **kwargs: Any) -> None:
        from ray.util import metrics

        metric = getattr(metrics, kind)(name, description, tag_keys=tuple(self.tags), **kwargs)
        metric.set_default_tags(self.tags)
        self.metrics[name] = metric

    def gauge(self, name: str, description: str) -> None:
        self._add("Gauge", name, description)

    def counter(self, name: str, description: str) -> None:
        self._add("Counter", name, description)

    def histogram(self, name: str, description: str, boundaries: list[float]) -> None:
        self._add("Histogram", name, description, boundaries=boundaries)

    def set(self, name: str, value: float) -> None:
        self.metrics[name].set(value)

    def inc(self, name: str, value: float = 1.0) -> None:
        if value > 0:  # Ray's Counter refuses 0 (an update whose batches were all dead-lettered adds nothing)
            self.metrics[name].inc(value)

    def observe(self, name: str, value: float) -> None:
        self.metrics[name].observe(value)
