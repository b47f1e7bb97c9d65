"""`deploy/grafana/marge.json` is generated from the metrics the stages declare, and stays so."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("marge_dashboard", REPO / "deploy" / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_is_the_generated_one():
    gen = generator()
    committed = json.loads((REPO / "deploy" / "grafana" / "marge.json").read_text(encoding="utf-8"))
    assert committed == gen.dashboard(gen.declared_metrics()), \
        "regenerate: python deploy/grafana/dashboard.py --out deploy/grafana/marge.json"


def test_every_declared_metric_has_a_panel_with_the_name_prometheus_exports():
    # found independently of the generator: every first argument of a .gauge/.counter/.histogram declaration
    declared = {}
    for path in (REPO / "services").rglob("*.py"):
        for kind, name in re.findall(r'\.(gauge|counter|histogram)\(\s*"(marge_\w+)"', path.read_text(encoding="utf-8")):
            declared[name] = kind
    assert len(declared) >= 20
    panels = {p["title"]: p for p in json.loads((REPO / "deploy" / "grafana" / "marge.json").read_text())["panels"]
              if p["type"] == "timeseries"}
    assert set(panels) == set(declared)
    suffix = {"gauge": "", "counter": "_total", "histogram": "_bucket"}  # as Ray's Prometheus exporter names them
    for name, kind in declared.items():
        for target in panels[name]["targets"]:
            assert f"ray_{name}{suffix[kind]}{{run=~\"$run\"}}" in target["expr"], (name, target["expr"])
