"""`marge plan`: the capacity model of the refresh loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.driver.config import load_config
from services.driver.plan import Throughput, embed_flops_per_document, plan_capacity

REPO = Path(__file__).resolve().parents[2]


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
    # the embedding dominates: documents x 2 x macs x relevance layers x tokens / rate, over the version's sample
    # (paper.yaml: 128 of the 500 shards of 20,000 documents)
    assert (base["shards"], base["shards_per_build"], base["documents_per_build"]) == (500, 128, 2_560_000)
    embed_s = 2_560_000 * embed_flops_per_document(model, 400) / 100e12 / 8
    assert embed_s < base["build_s"] < 1.5 * embed_s
    assert base["refresh_interval_s"] == pytest.approx(10_000 * base["seconds_per_update"])
    # the schedule fixes the staleness: batches of version v are trained from L to L + R - 1 updates after its snapshot
    assert base["staleness_updates"] == {"min": 10_000, "mean": 10_000 + 9_999 / 2, "max": 19_999}
    lagged = plan_capacity(paper("batcher.index_lag=2000"), model, 10_000_000, 400, 26, rates)
    assert lagged["staleness_updates"]["max"] == 2000 + 9_999
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
    # the trainers wait for what the build takes beyond its head start of index_lag updates
    head_start = 1000 * plan["seconds_per_update"]
    assert plan["trainer_wait_per_refresh_s"] == pytest.approx(plan["build_s"] - head_start)
    assert 0 < plan["trainer_wait_share"] < 1


def test_cli_plan_needs_a_size_or_a_prepared_corpus(capsys):
    from services.cli import main

    assert main(["plan", "--config", str(REPO / "deploy/configs/tiny.yaml"), "data.corpus=/nonexistent"]) == 2
    assert "give its size with --documents" in capsys.readouterr().err
    assert main(["plan", "--config", str(REPO / "deploy/configs/tiny.yaml"), "data.corpus=/nonexistent",
                 "--documents", "5000", "--document-tokens", "270", "--languages", "8"]) == 0
    out = capsys.readouterr().out
    assert "5,000 documents" in out and "refresh interval 100 updates" in out


def test_the_gpu_configs_give_a_gpu_sized_update_and_the_plan_says_how_to_get_one():
    rates = Throughput(embed_flops_per_s=100e12, train_flops_per_s=100e12, source="test")
    for name, low, high in (("learning-gpu", 16_000, 64_000), ("base", 16_000, 64_000), ("paper", 8_000, 64_000)):
        cfg = load_config(REPO / f"deploy/configs/{name}.yaml")
        plan = plan_capacity(cfg, cfg.model_config(vocab_size=cfg.data.vocab_size), 1_000_000, 100, 5, rates)
        per_update = plan["target_tokens_per_update"] if name != "paper" else plan["target_tokens_per_worker_update"]
        assert low <= per_update <= high and plan["gpu_sized"], name
    one_k = paper("trainer.num_workers=64", "trainer.grad_accum=1")  # the paper's workers, one GPU each
    plan = plan_capacity(one_k, one_k.model_config(), 1_000_000, 100, 5, rates)
    assert not plan["gpu_sized"] and plan["target_tokens_per_worker_update"] < 1100
    assert plan["grad_accum_for_gpu"] == 8 and plan["target_tokens_per_update"] == pytest.approx(64 * 1050)
    from services.driver.plan import describe

    assert any("set trainer.grad_accum=8" in line for line in describe(plan, one_k))


def test_the_paper_scale_figures_builders_redis_restarts_and_shard_coverage():
    from marge.model.sizes import build_on_meta, count_parameters
    from services.driver.plan import BUILDER_BATCHES_PER_S, CHECKPOINT_BYTES_PER_PARAMETER

    rates = Throughput(embed_flops_per_s=35e12, train_flops_per_s=9e12, source="test")
    cfg = paper()
    model = cfg.model_config()
    plan = plan_capacity(cfg, model, 100_000_000, 400, 26, rates)
    assert plan["batches_per_s_needed"] == pytest.approx(64 / plan["seconds_per_update"])
    assert plan["batches_per_s_builders"] == BUILDER_BATCHES_PER_S and plan["builders_keep_up"]
    assert plan["redis_peak_bytes"] == plan["redis"]["peak_bytes"]
    parameters = count_parameters(build_on_meta(model))
    assert 0.95e9 < parameters < 0.98e9  # the paper's 963M
    whole = parameters * CHECKPOINT_BYTES_PER_PARAMETER  # sharded: a rank reads its share, no init weights
    assert plan["restart_read_bytes_per_rank"] == whole / 8 and plan["restart_read_bytes_all_ranks"] == 2 * whole
    # 46 versions of 128 of 5,000 shards: independent draws miss about 30%, a cycle of permutations none
    assert plan["index_versions"] == 46 and round(plan["shard_coverage_first_phase"], 2) == 0.70
    cycled = plan_capacity(paper("indexer.shard_sampling=cycle"), model, 100_000_000, 400, 26, rates)
    assert cycled["shard_coverage_first_phase"] > 0.99
    # a world 8x larger with the same accumulation: 8x the batches an update; the streams hold the look-ahead,
    # not a checkpoint interval, so Redis stays under 1 GB (the ledger's window is most of it)
    wide = plan_capacity(paper("trainer.num_workers=64"), model, 100_000_000, 400, 26, rates)
    assert wide["batches_per_s_needed"] == pytest.approx(8 * plan["batches_per_s_needed"])
    assert wide["redis_peak_bytes"] < 2**30 and wide["redis"]["parts"]["streams"] < 64 * 2**20
    # 512 batches an update at 0.3 s an update: 1,700 batches/s, which 4 builders give twice over
    fast = plan_capacity(paper("trainer.num_workers=64"), model, 100_000_000, 400, 26,
                         Throughput(embed_flops_per_s=35e12, train_flops_per_s=9e12 * wide["seconds_per_update"] / 0.3,
                                    source="test"))
    assert fast["batches_per_s_needed"] == pytest.approx(512 / 0.3) and not fast["builders_keep_up"]
    assert fast["batch_builders_needed"] == 4
    from services.driver.plan import describe

    assert any("batcher.builders=4 gives 2x the need" in line for line in describe(fast, paper("trainer.num_workers=64")))
    four = plan_capacity(paper("trainer.num_workers=64", "batcher.builders=4"), model, 100_000_000, 400, 26,
                         Throughput(embed_flops_per_s=35e12, train_flops_per_s=9e12 * wide["seconds_per_update"] / 0.3,
                                    source="test"))
    assert four["builders_keep_up"] and four["builders_headroom"] >= 2
