"""`marge plan`: the capacity model of the refresh loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.driver.config import load_config
from services.driver.plan import Throughput, embed_flops_per_document, plan_capacity

REPO = Path(__file__).resolve().parents[1]


def paper(*overrides: str):
    return load_config(REPO / "deploy/configs/paper.yaml", list(overrides))


def test_refresh_time_scales_with_the_pool_and_staleness_with_the_interval():
    rates = Throughput(embed_flops_per_s=100e12, train_flops_per_s=100e12, source="test")
    cfg = paper()
    model = cfg.model_config()
    base = plan_capacity(cfg, model, 10_000_000, 400, 26, rates)
    doubled = plan_capacity(paper("indexer.num_workers=16"), model, 10_000_000, 400, 26, rates)
    assert doubled["build_s"] == pytest.approx(base["build_s"] / 2)
    assert base["build_s_one_worker"] == pytest.approx(8 * base["build_s"])
    # the embedding dominates: documents x 2 x macs x relevance layers x tokens / rate
    embed_s = 10_000_000 * embed_flops_per_document(model, 400) / 100e12 / 8
    assert embed_s < base["build_s"] < 1.5 * embed_s
    assert base["refresh_interval_s"] == pytest.approx(10_000 * base["seconds_per_update"])
    s = base["staleness_updates"]
    assert s["min"] == pytest.approx(base["build_s"] / base["seconds_per_update"])
    assert s["max"] == pytest.approx(s["min"] + 10_000 + base["queue_depth_updates"])
    assert base["queue_depth_updates"] == 1024 / 64


def test_a_pool_too_small_is_reported_with_the_workers_it_needs():
    slow_indexer = Throughput(embed_flops_per_s=1e12, train_flops_per_s=100e12, source="test")
    cfg = paper("indexer.reindex_every=1000", "trainer.snapshot_every=1000")
    plan = plan_capacity(cfg, cfg.model_config(), 10_000_000, 400, 26, slow_indexer)
    assert not plan["keeps_up"]
    assert plan["indexer_workers_needed"] > 8
    enough = paper("indexer.reindex_every=1000", "trainer.snapshot_every=1000",
                   f"indexer.num_workers={plan['indexer_workers_needed']}")
    assert plan_capacity(enough, cfg.model_config(), 10_000_000, 400, 26, slow_indexer)["keeps_up"]
    assert plan["share_of_corpus_refreshable"] < 1
    # back-to-back builds: each index serves as many updates as the next one takes to build
    s = plan["staleness_updates"]
    assert s["max"] - s["min"] == pytest.approx(s["min"] + plan["queue_depth_updates"])


def test_cli_plan_needs_a_size_or_a_prepared_corpus(capsys):
    from services.driver.cli import main

    assert main(["plan", "--config", str(REPO / "deploy/configs/tiny.yaml"), "data.corpus=/nonexistent"]) == 2
    assert "give its size with --documents" in capsys.readouterr().err
    assert main(["plan", "--config", str(REPO / "deploy/configs/tiny.yaml"), "data.corpus=/nonexistent",
                 "--documents", "5000", "--document-tokens", "270", "--languages", "8"]) == 0
    out = capsys.readouterr().out
    assert "5,000 documents" in out and "refresh interval 30 updates" in out
