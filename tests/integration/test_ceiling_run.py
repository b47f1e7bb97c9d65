"""`python -m experiments.ceiling`: the loop against its aligned oracle, arm by arm, and the ratio between them.

These need a server or take long; the quick tests of this subject are in tests/unit/test_ceiling.py (no server)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_ceiling_experiment_reports_each_arm_and_the_ratio_and_keeps_finished_arms(paragraph_corpus, few_pairs,
                                                                                      tmp_path):
    from experiments.ceiling.harness import run_ceiling

    short = [f"data.corpus={paragraph_corpus}", "data.max_chunk_tokens=64", "model.max_positions=64",
             "batcher.max_tokens=600", f"data.heldout_pairs={few_pairs}", "health.external_probes=true", "health.probe_size=4",
             "health.aligned_probe_size=8", "health.pairs_per_language=4", "health.max_tokens=64",
             "trainer.snapshot_every=2", "indexer.reindex_every=4", "indexer.lexical_until=6",
             "trainer.checkpoint_every=3", "trainer.warmup_steps=2", "trainer.total_steps=100",
             "objectives.self_evidence.until=4", "objectives.denoising_contrastive.extra_documents=8",
             "run.max_steps=8"]
    out = tmp_path / "ceiling"
    report = run_ceiling(None, short, 1.0, out, arms=["aligned_translations", "recipe"], device="cpu")

    assert set(report["arms"]) == {"aligned_translations", "recipe"}
    for name, a in report["arms"].items():
        assert a["updates"] == 8 and a["minutes"] == 1.0
        assert list(a["evidence_gain"]) == ["0", "2", "4", "6", "8"] == list(a["evidence_gain_per_char"])
        assert all(lo <= a["evidence_gain"][s] <= hi for s, (lo, hi) in a["evidence_gain_ci95"].items())
        for kind in ("trained", "random_init", "tfidf"):
            assert len(a["p_at_1"][kind]) == 8  # the 5 languages' directions, not the file's 14
        assert a["beta"]["0"] == 1.0
    oracle, loop = report["arms"]["aligned_translations"], report["arms"]["recipe"]
    assert list(oracle["parallel_link_precision"]) == ["0"] and oracle["link_sources"]["0"] == ["aligned"]
    # the bootstrap: TF-IDF, then cos(g) + lambda * tfidf (lambda = 4 x (1 - 4/6) at update 4), then g alone from update 6
    assert loop["link_sources"] == {"0": ["tfidf"], "1": ["hybrid"], "2": ["g"]}
    assert loop["lexical_weight"]["1"] == pytest.approx(4 / 3) and loop["lexical_weight"]["2"] == 0
    assert loop["parallel_link_precision"]["0"] > 0
    assert list(report["ratio"]) == ["2", "4", "6", "8"] == list(report["ratio_ci95"])
    assert report["ratio"] == report["ratio_per_char"]
    assert set(report["headline_ratios"]["recipe"]) == {"8"}
    assert (out / "curves.png").stat().st_size > 0
    saved = json.loads((out / "report.json").read_text())
    assert saved["arms"]["recipe"]["evidence_gain"] == loop["evidence_gain"]
    assert str(tmp_path) not in (out / "report.json").read_text()  # paths relative to the experiment folder

    log = (out / "arms" / "recipe" / "run" / "train_log.jsonl").read_text()
    again = run_ceiling(None, short, 1.0, out, arms=["recipe"], device="cpu")
    assert (out / "arms" / "recipe" / "run" / "train_log.jsonl").read_text() == log  # finished: kept, not retrained
    assert set(again["arms"]) == {"aligned_translations", "recipe"}  # arms of earlier commands on the folder count too
