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
    assert sc.COMMIT_REDIS_S_PER_RANK == records["commit_redis_s_per_rank"]
    assert sc.EXCHANGE_BYTES_PER_RANK == records["exchange_bytes_per_rank_part"]
    assert sc.LEDGER_BYTES_PER_RECORD == records["ledger_bytes_per_record"]
    # a commit's Redis work does not grow with the interval (16x the batches, about the same time), the per-batch
    # ledger's did
    commits = records["commit"]
    assert commits[-1]["records"]["redis_cpu_s"] < 3 * commits[0]["records"]["redis_cpu_s"]
    assert commits[-1]["per_batch"]["redis_cpu_s"] > 8 * commits[0]["per_batch"]["redis_cpu_s"]
    merge = json.loads((RESULTS / "serving-index-merge-cpu-2core.json").read_text())
    assert sc.SERVING_INDEX_PEAK_BYTES_PER_WORKER == merge["serving_index_peak_bytes_per_worker"]
    # the line the plan computes is the benchmark's line, from the same record class
    for row in records["train_log"]:
        assert sc.train_log_line_bytes(row["world"], 8, records["layout"]["builders"]) == row["line_bytes"]
    train = json.loads((RESULTS / "serving-index-train-cpu-2core.json").read_text())
    assert sc.SERVING_INDEX_TRAIN_COPIES == train["serving_index_train_copies"] and train["before_over_build"] > 1.5
    restore = json.loads((RESULTS / "restore-memory-cpu-2core.json").read_text())
    assert restore["batched_within_bound"] and restore["planned_bound_bytes"] == 2 * max(
        sc.RESTORE_BATCH_BYTES, sc.PART_BYTES)


@pytest.mark.parametrize("world, over", [(8, []), (512, []), (2048, ["checkpoint_exchange_bytes_per_rank"])])
def test_the_paper_config_at_a_world_names_what_is_over_budget(world: int, over: list[str]):
    cfg = load_config(REPO / "deploy/configs/paper.yaml", [f"trainer.num_workers={world}"])
    rates = Throughput(embed_flops_per_s=35e12, train_flops_per_s=9.1e12, source="test")
    plan = plan_capacity(cfg, cfg.model_config(), 100_000_000, 400, 26, rates)
    assert plan["over_budget_at_scale"] == over
    assert plan["redis_commit_s_per_checkpoint"] == pytest.approx(world * sc.COMMIT_REDIS_S_PER_RANK)
    assert plan["checkpoint_exchange_bytes_per_rank"] == world * sc.EXCHANGE_BYTES_PER_RANK
    assert plan["train_log_bytes_per_update"] <= 4096 and plan["redis_peak_bytes"] <= 1e9 or world > 512
    # a restore holds two 64 MiB batches a rank, 8 ranks a node: under one model's weights whatever the world
    assert plan["restore_host_bytes_per_node"] == 8 * 2 * (64 << 20) < 4 * plan["parameters"]
    assert plan["driver_read_bytes_at_start"] == plan["checkpoint_bytes"]
    # 100M documents: 40,000 lists, 1.56M training vectors of d 1024 (6.4 GB), about two of them held at once
    assert plan["serving_index_train_bytes"] == pytest.approx(sc.SERVING_INDEX_TRAIN_COPIES * 39 * 40_000 * 1024 * 4)
    assert plan["serving_index_train_bytes"] <= 16e9
