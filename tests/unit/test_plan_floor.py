"""`marge plan` and the dry-run say what their time per update is: a floor when estimated from a matrix product, one
worker's measured step when measured (`marge plan --measure`)."""

from __future__ import annotations

from pathlib import Path

from services.driver.config import load_config
from services.driver.plan import (
    UPDATE_TIME_FLOOR,
    UPDATE_TIME_MEASURED,
    Throughput,
    describe,
    estimated_throughput,
    measure_throughput,
    plan_capacity,
)

REPO = Path(__file__).resolve().parents[2]


def test_an_estimated_update_time_is_called_a_floor_and_a_measured_one_says_what_it_leaves_out():
    cfg = load_config(REPO / "deploy/configs/own-corpus.yaml", [])
    model = cfg.model_config(vocab_size=4000)
    rates = Throughput(embed_flops_per_s=1e11, train_flops_per_s=1e11, source="estimated from a cpu matrix product")
    floor = plan_capacity(cfg, model, 1500, 150, 6, rates)
    assert floor["seconds_per_update_is"] == UPDATE_TIME_FLOOR and UPDATE_TIME_FLOOR.startswith("a floor, not a forecast")
    line = describe(floor, cfg)[1]
    assert line.startswith(f"one update: at least {floor['seconds_per_update']:.3g} s (a floor, not a forecast: "), line
    assert "`marge plan --measure --out FILE`" in line and "refresh interval 100 updates = at least " in line
    measured = plan_capacity(cfg, model, 1500, 150, 6, Throughput(1e11, 1e11, "measured on cpu (f.json)", measured=True))
    assert measured["seconds_per_update_is"] == UPDATE_TIME_MEASURED
    assert describe(measured, cfg)[1].startswith(f"one update: {measured['seconds_per_update']:.3g} s (one trainer "
                                                 "worker's measured training step on its own: ")


def test_the_floor_is_below_a_measured_training_step_on_this_machine(small_corpus):
    """What makes the estimate a floor: the matrix product's rate is above what the config's real training steps reach,
    so the estimated update time is below the measured one (several times, on a 2-core CPU)."""
    import torch

    from marge.contracts.corpus import Corpus

    cfg = load_config(REPO / "deploy/configs/own-corpus.yaml", [f"data.corpus={small_corpus}", "trainer.torch_threads=1",
                                                                "indexer.num_cpus_per_worker=1"])
    corpus = Corpus.open(small_corpus)
    model = cfg.model_config(vocab_size=corpus.tokenizer().vocab_size)
    measured = measure_throughput(cfg, corpus, torch.device("cpu"), steps=3)
    estimated = estimated_throughput(cfg)
    m = corpus.manifest
    size = (m["num_documents"], m["num_tokens"] / m["num_documents"], len(m["languages"]))
    floor = plan_capacity(cfg, model, *size, estimated)["seconds_per_update"]
    real = plan_capacity(cfg, model, *size, Throughput(measured["embed_flops_per_s"], measured["train_flops_per_s"],
                                                       "measured", measured=True))["seconds_per_update"]
    assert floor < real, (floor, real)
