"""`marge plan`'s costs at scale: the unit costs are the committed benchmarks', and the figures say which costs a
world of ranks puts over budget (the paper's config at 8, 512 and 2,048 GPUs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.driver import scale_costs as sc
from services.driver.config import load_config
from services.driver.plan import Throughput, plan_capacity

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_the_unit_costs_are_the_committed_benchmarks():
    records = json.loads((RESULTS / "checkpoint-records-cpu-2core.json").read_text())
    assert sc.COMMIT_REDIS_US_PER_BATCH == pytest.approx(records["redis_us_per_interval_batch"], abs=0.01)
    assert sc.EXCHANGE_BYTES_PER_BATCH == pytest.approx(records["exchange_bytes_per_interval_batch"], abs=0.01)
    merge = json.loads((RESULTS / "serving-index-merge-cpu-2core.json").read_text())
    assert sc.SERVING_INDEX_PEAK_BYTES_PER_WORKER == merge["serving_index_peak_bytes_per_worker"]
    # the line the plan computes is the benchmark's line, from the same record class
    for row in records["train_log"]:
        assert sc.train_log_line_bytes(row["world"], 8) == pytest.approx(row["line_bytes"], rel=0.02)
    restore = json.loads((RESULTS / "restore-memory-cpu-2core.json").read_text())
    assert restore["batched_within_bound"] and restore["planned_bound_bytes"] == 2 * max(
        sc.RESTORE_BATCH_BYTES, sc.PART_BYTES)


@pytest.mark.parametrize("world, over", [
    (8, []),
    (512, ["redis_commit_s_per_checkpoint", "checkpoint_exchange_bytes_per_rank", "train_log_bytes_per_update",
           "redis_peak_bytes"]),
    (2048, ["redis_commit_s_per_checkpoint", "checkpoint_exchange_bytes_per_rank", "train_log_bytes_per_update",
            "redis_peak_bytes"]),
])
def test_the_paper_config_at_a_world_names_what_is_over_budget(world: int, over: list[str]):
    cfg = load_config(REPO / "deploy/configs/paper.yaml", [f"trainer.num_workers={world}"])
    rates = Throughput(embed_flops_per_s=35e12, train_flops_per_s=9.1e12, source="test")
    plan = plan_capacity(cfg, cfg.model_config(), 100_000_000, 400, 26, rates)
    assert plan["over_budget_at_scale"] == over
    batches = 2000 * 8  # paper.yaml: checkpoint_every 2,000, grad_accum 8
    assert plan["redis_commit_s_per_checkpoint"] == pytest.approx(world * batches * sc.COMMIT_REDIS_US_PER_BATCH / 1e6)
    assert plan["checkpoint_exchange_bytes_per_rank"] == pytest.approx(world * batches * sc.EXCHANGE_BYTES_PER_BATCH)
    # a restore holds two 64 MiB batches a rank, 8 ranks a node: under one model's weights whatever the world
    assert plan["restore_host_bytes_per_node"] == 8 * 2 * (64 << 20) < 4 * plan["parameters"]
    assert plan["driver_read_bytes_at_start"] == plan["checkpoint_bytes"]
