"""The Grafana dashboard of a MARGE run, generated from the metrics the stages declare.

Every `StageMetrics` declaration in `services/` (`.gauge("marge_...", "description")`, `.counter(...)`,
`.histogram(...)`) becomes one panel in its stage's row, so the dashboard cannot fall behind the code (a test
regenerates it and compares). Panels select the run with the `run` variable and split by `worker` (an indexer
worker, `coordinator`, a trainer rank, the batcher):

    gauge      sum by (worker) (ray_NAME{run=~"$run"})
    counter    sum by (worker) (rate(ray_NAME_total{run=~"$run"}[1m]))        per second
    histogram  histogram_quantile(0.5 and 0.9, sum by (le) (rate(ray_NAME_bucket{run=~"$run"}[5m])))

Import `deploy/grafana/marge.json` into the Grafana that reads the cluster's Prometheus (Ray's own Grafana set-up:
https://docs.ray.io/en/latest/cluster/metrics.html). Regenerate with
`python deploy/grafana/dashboard.py --out deploy/grafana/marge.json`.
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = ("indexer", "batcher", "trainer")
KINDS = ("gauge", "counter", "histogram")
DATASOURCE = "${datasource}"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    description: str
    stage: str


def declared_metrics(services: Path = REPO / "services") -> list[Metric]:
    """Each metric a stage declares, once, in stage order then name order."""
    found: dict[str, Metric] = {}
    for stage in STAGES:
        for path in sorted((services / stage).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KINDS
                        and len(node.args) >= 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                        for a in node.args[:2])
                        and node.args[0].value.startswith("marge_")):
                    found.setdefault(node.args[0].value, Metric(node.args[0].value, node.func.attr,
                                                                node.args[1].value, stage))
    return sorted(found.values(), key=lambda m: (STAGES.index(m.stage), m.name))


def queries(metric: Metric) -> list[dict]:
    selector = '{run=~"$run"}'
    if metric.kind == "gauge":
        return [{"expr": f"sum by (worker) (ray_{metric.name}{selector})", "legendFormat": "{{worker}}"}]
    if metric.kind == "counter":
        return [{"expr": f"sum by (worker) (rate(ray_{metric.name}_total{selector}[1m]))",
                 "legendFormat": "{{worker}} /s"}]
    return [{"expr": f"histogram_quantile({q}, sum by (le) (rate(ray_{metric.name}_bucket{selector}[5m])))",
             "legendFormat": f"p{int(q * 100)}"} for q in (0.5, 0.9)]


def dashboard(metrics: list[Metric]) -> dict:
    panels, panel_id, y = [], 1, 0
    for stage in STAGES:
        panels.append({"type": "row", "title": f"{stage}", "id": panel_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        panel_id, y = panel_id + 1, y + 1
        for i, metric in enumerate(m for m in metrics if m.stage == stage):
            panels.append({
                "type": "timeseries", "id": panel_id, "title": metric.name, "description": metric.description,
                "datasource": DATASOURCE, "gridPos": {"h": 7, "w": 8, "x": 8 * (i % 3), "y": y + 7 * (i // 3)},
                "targets": [{"refId": chr(ord("A") + k), "datasource": DATASOURCE, **q}
                            for k, q in enumerate(queries(metric))]})
            panel_id += 1
        y += 7 * -(-sum(1 for m in metrics if m.stage == stage) // 3)
    return {
        "title": "MARGE pipeline", "uid": "marge-pipeline", "schemaVersion": 39, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["marge", "ray"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "run", "type": "query", "label": "run (run.name)", "datasource": DATASOURCE, "includeAll": True,
             "multi": True, "refresh": 2, "query": "label_values(ray_marge_trainer_step, run)"}]},
        "panels": panels,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the MARGE Grafana dashboard from the declared metrics")
    parser.add_argument("--out", type=Path, default=REPO / "deploy" / "grafana" / "marge.json")
    args = parser.parse_args(argv)
    metrics = declared_metrics()
    args.out.write_text(json.dumps(dashboard(metrics), indent=2) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(metrics)} metrics in {len(STAGES)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
