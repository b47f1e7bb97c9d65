"""Objectives as plug-ins (services.trainer.objectives): what each needs from the stages, what it makes of a batch,
and the losses it adds. Pure CPU, the `tiny`-shaped models, the small demo corpus.

These need a server or take long; the quick tests of this subject are in tests/unit/test_objectives.py (no server)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from objective_inputs import VOCAB, objectives, toy_batch, toy_objectives

from marge.contracts.corpus import Corpus
from marge.model.veco import Veco, veco_preset
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.core import DocumentStore, epoch_batches
from services.trainer.step import reference_train

# --- settings: what each objective needs ------------------------------------------------------------


# --- the batcher: documents without an index, and the budget of a mixture ---------------------------


def test_mixture_budget_counts_the_bart_pass_on_each_target(small_corpus, small_index):
    docs = DocumentStore(Corpus.open(small_corpus))
    shape = BatchShape("retrieval", extra_target_passes=1)
    from marge.contracts.batch import encoder_cost

    for b in list(epoch_batches(small_index, docs, BatcherConfig(max_tokens=700), 0, shape=shape))[:30]:
        cost = (sum(shape.target_cost(len(b.doc_tokens[i])) for i in b.targets)
                + sum(encoder_cost(len(b.doc_tokens[i])) for i in b.evidence))
        assert cost <= 700
        assert cost > b.cost_tokens()  # the plain budget would have packed more


# --- what each objective makes of a batch -----------------------------------------------------------


# --- losses ------------------------------------------------------------------------------------------


def test_veco_objective_trains_its_own_model_and_its_loss_falls():
    rng = np.random.default_rng(5)
    torch.manual_seed(0)
    model = Veco(veco_preset("tiny", vocab_size=VOCAB, max_positions=64))
    cfg = objectives(veco={})
    from services.trainer.config import TrainerConfig

    batches = [[toy_batch(rng)] for _ in range(25)] * 4
    records = reference_train(model, batches, toy_objectives(cfg), TrainerConfig(lr=3e-3, warmup_steps=2), 100)
    assert records[0].beta == [] and set(records[0].objectives) == {"veco"}
    assert np.mean([r.loss for r in records[-10:]]) < np.mean([r.loss for r in records[:10]]) - 0.3  # measured 0.47


@pytest.mark.slow
def test_objectives_experiment_reports_the_variants_side_by_side_and_keeps_finished_ones(small_corpus, few_pairs,
                                                                                        tmp_path):
    from experiments.objectives.harness import run_objectives_experiment

    short = [f"data.corpus={small_corpus}", "data.max_chunk_tokens=128", "model.max_positions=128",
             "batcher.max_tokens=400", f"data.heldout_pairs={few_pairs}", "health.external_probes=true", "health.probe_size=4",
             "health.aligned_probe_size=8",
             "health.pairs_per_language=4", "trainer.snapshot_every=2", "indexer.reindex_every=4",
             "trainer.checkpoint_every=3", "trainer.warmup_steps=2", "trainer.total_steps=100", "run.max_steps=4"]
    out = tmp_path / "objectives"
    report = run_objectives_experiment(None, short, 1.0, out, only=["bart", "veco"], device="cpu", chrf_pairs=1)

    bart, veco = report["variants"]
    assert (bart["variant"], veco["variant"]) == ("bart", "veco")
    assert bart["updates"] == veco["updates"] == 4
    assert set(bart["final_losses"]) == {"bart"} and set(veco["final_losses"]) == {"veco"}
    assert bart["parameters"] != veco["parameters"]  # two model families
    assert bart["chrf_zero_shot"] and veco["chrf_zero_shot"] == {}  # VECO cannot generate
    for row in (bart, veco):
        assert 0 <= row["p_at_1_best_layer"]["mean"] <= 1 and 0 < row["tfidf_mean"] <= 1
        assert row["p_at_1_best_layer"]["mean"] == max(row["p_at_1_by_layer"].values())
    assert len(veco["p_at_1_by_layer"]) == 7  # embeddings + 6 layers, the sweep kept
    assert (out / "comparison.png").exists() and (out / "report.json").exists()
    again = run_objectives_experiment(None, short, 1.0, out, only=["bart"], device="cpu", chrf_pairs=1)
    assert again["variants"][0]["updates"] == 4  # finished: kept, not trained again
