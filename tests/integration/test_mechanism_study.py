"""What teaches g to retrieve (experiments/mechanism): the detach and freeze switches, the oracle with the loop's
budget, held-out data that training never saw, and statistics that do not call noise an effect.

These need a server or take long; the quick tests of this subject are in tests/unit/test_mechanism.py (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------
# The report's statistics
# ----------------------------------------------------------------------------------------------------


def fake_measures(p_hit: float, gain: float, seed: int, pages: int = 40, per_page: int = 6) -> dict:
    """measures.json of a run whose g hits with probability `p_hit` and whose retrieved evidence gains `gain`."""
    rng = np.random.default_rng(seed)
    groups = [f"page{i % pages}" for i in range(pages * per_page)]
    n = len(groups)

    def record(p: float, g: float) -> dict:
        none = rng.normal(30.0, 3.0, size=n)
        tokens = [10] * n
        nll = {"none": none.tolist(), "retrieved": (none - 10 * g + rng.normal(0, 1.0, size=n)).tolist(),
               "gold": (none - 10 * g).tolist(), "wrong_page": (none - 0.5).tolist()}
        hits = {d: (rng.random(n) < p).astype(int).tolist() for d in ("en->de", "de->en")}
        return {"nll_sum": nll, "tokens": tokens, "groups": groups, "p_at_1_hits": hits, "p_at_1": p, "beta": 1.0,
                "retrieved_links": {"crosslingual_parallel_precision": 0.5},
                "retrieved_g_links": {"crosslingual_parallel_precision": 0.2}}

    return {"version": 1, "pair_pages": {d: groups for d in ("en->de", "de->en")},
            "steps": {"0": record(0.1, 0.0), "500": record(p_hit, gain)}}


def write_fake_run(out, arm: str, seed: int, measures: dict, train_log: list[dict] | None = None,
                   beta_lr_scale: float = 1.0) -> None:
    folder = out / "runs" / arm / f"seed-{seed}"
    (folder / "run").mkdir(parents=True)
    (folder / "measures.json").write_text(json.dumps(measures))
    (folder / "config.yaml").write_text(f"trainer:\n  beta_lr_scale: {beta_lr_scale}\n")
    if train_log is not None:
        (folder / "run" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_log))
    (folder / "report.json").write_text(json.dumps({"pipeline": {"steps": 500, "train_seconds": 60.0}}))
    (folder / "baselines.json").write_text(json.dumps({"tfidf": {"en->de": 0.6, "de->en": 0.6}}))
    (folder / "run" / "index_builds.jsonl").write_text(json.dumps(
        {"version": 0, "snapshot_step": 0, "crosslingual_parallel_precision": 0.47, "lexical_weight": 0.0,
         "link_sources": ["tfidf"]}) + "\n")


def test_a_contrast_is_shown_only_when_seeds_and_pages_agree(tmp_path):
    from experiments.mechanism.report import write_report

    for seed in range(3):
        write_fake_run(tmp_path / "real", "loop", seed, fake_measures(0.35, 0.4, seed))
        write_fake_run(tmp_path / "real", "loop_detached", seed, fake_measures(0.15, 0.1, 100 + seed))
        write_fake_run(tmp_path / "null", "loop", seed, fake_measures(0.2, 0.2, seed))
        write_fake_run(tmp_path / "null", "loop_detached", seed, fake_measures(0.2, 0.2, 100 + seed))
    write_fake_run(tmp_path / "one", "loop", 0, fake_measures(0.35, 0.4, 0))
    write_fake_run(tmp_path / "one", "loop_detached", 0, fake_measures(0.15, 0.1, 100))

    real = write_report(tmp_path / "real")
    c = real["contrasts"]["beta_f_vs_detached_loop"]
    assert c["shown"] and c["ci95"][0] > 0 and c["ci95_seeds_t"][0] > 0 and c["delta"] == pytest.approx(0.2, abs=0.05)
    assert c["delta_retrieved_gain"]["mean"] == pytest.approx(0.3, abs=0.05)
    arm = real["arms"]["loop"]
    assert arm["seeds"] == [0, 1, 2] and arm["updates"] == 500 and arm["index"] == "loop" and not arm["detached_f"]
    assert set(arm["nll"]) == {"none", "retrieved", "gold", "wrong_page"}
    assert arm["gains"]["gold"]["mean"] == pytest.approx(0.4) and arm["gains_over_wrong_page"]["gold"]["mean"] == \
        pytest.approx(0.35)
    assert c["retrieved_nll_lower_by"]["mean"] == pytest.approx(0.3, abs=0.05)  # detached's retrieved NLL is higher
    assert arm["p_at_1_over_init"]["ci95"][0] > 0 and arm["aligned_link_precision"][0]["mean"] == 0.47
    assert real["targets"]["beta_f_trains_g_in_the_loop"] is True
    assert (tmp_path / "real" / "curves.png").exists()

    null = write_report(tmp_path / "null")["contrasts"]["beta_f_vs_detached_loop"]
    assert not null["shown"] and null["ci95"][0] < 0 < null["ci95"][1]
    one = write_report(tmp_path / "one")["contrasts"]["beta_f_vs_detached_loop"]
    assert not one["shown"] and one["ci95_seeds_t"] is None  # one seed is an anecdote, whatever its interval


@pytest.mark.slow
def test_the_study_trains_measures_and_reports_arms_at_equal_updates(paragraph_corpus, few_pairs, tmp_path):
    from experiments.mechanism.harness import run_study
    from experiments.mechanism.measures import measure_run
    from experiments.mechanism.report import write_report

    short = (f"data.corpus={paragraph_corpus}", "data.max_chunk_tokens=64", "model.max_positions=64",
             "batcher.max_tokens=600", f"data.heldout_pairs={few_pairs}", "health.external_probes=true", "health.probe_size=4",
             "health.pairs_per_language=4", "health.max_tokens=64", "trainer.warmup_steps=2",
             "trainer.total_steps=100", "indexer.reindex_every=4", "data.docs_per_shard=150",
             "trainer.snapshot_every=2", "trainer.checkpoint_every=2", "indexer.lexical_until=4", "batcher.index_lag=4")
    out = tmp_path / "study"
    run_study(None, ["loop", "loop_detached"], [0], 6, out, extra=short, measure=False, device="cpu")
    for arm in ("loop", "loop_detached"):
        folder = out / "runs" / arm / "seed-0"
        assert json.loads((folder / "report.json").read_text())["pipeline"]["steps"] == 6
        measures = measure_run(folder, "cpu", every=4, targets=24)
        assert sorted(measures["steps"], key=int) == ["0", "4", "6"]
        record = measures["steps"]["6"]
        assert set(record["nll_sum"]) == {"none", "retrieved", "retrieved_g", "gold", "wrong_page", "self_copy"}
        assert len(record["tokens"]) == len(record["nll_sum"]["none"]) == measures["heldout"]["targets"] > 0
        assert record["retrieved_links"]["links_per_target"] > 0
    # a second call measures nothing new; raising the updates resumes the runs
    assert measure_run(out / "runs" / "loop" / "seed-0", "cpu", every=4, targets=24)["steps"].keys() == \
        measures["steps"].keys()
    report = write_report(out)
    assert set(report["arms"]) == {"loop", "loop_detached"} and report["arms"]["loop"]["updates"] == 6
    assert report["contrasts"]["beta_f_vs_detached_loop"]["shown"] is False  # one seed shows nothing
    assert report["arms"]["loop_detached"]["detached_f"] is True
    config = (out / "runs" / "loop_detached" / "seed-0" / "config.yaml").read_text()
    assert "detach_relevance: true" in config and "self_evidence: null" in config
    # every snapshot logs how much of g's gradient came through f: some when attached, none when detached
    shares = report["arms"]["loop"]["f_gradient_share"]["f_gradient_share"]
    assert set(shares) == {"2", "4", "6"} and all(v["mean"] > 0 for v in shares.values())
    detached = report["arms"]["loop_detached"]["f_gradient_share"]["f_gradient_share"]
    assert all(v["mean"] == 0 for v in detached.values())
    assert set(report["arms"]["loop"]["beta_over_adam_max"]) == {"0-4", "4-6"}


def test_the_report_follows_beta_against_adams_limit_the_f_share_and_the_headroom(tmp_path):
    from experiments.mechanism.report import write_report

    lr = 1e-3
    for seed in range(3):
        measures = fake_measures(0.3, 0.2, seed)
        measures["steps"]["0"]["beta"], measures["steps"]["500"]["beta"] = 1.0, 1.0 + 0.8 * 500 * lr * 10
        train_log = [{"step": k, "lr": lr, "beta": [1.0],
                      "health": {"f_gradient_share": 0.01 * (seed + 1), "g_gradient_norm": 2.0} if k % 100 == 0 else None}
                     for k in range(1, 501)]
        write_fake_run(tmp_path, "loop", seed, measures, train_log, beta_lr_scale=10.0)
    arm = write_report(tmp_path)["arms"]["loop"]
    # beta rose by 0.8 of the most Adam allows at its own (10x) rate over updates 1-500
    assert arm["beta_over_adam_max"]["0-500"]["mean"] == pytest.approx(0.8)
    assert arm["f_gradient_share"]["f_gradient_share"]["500"]["mean"] == pytest.approx(0.02)
    assert arm["f_gradient_share"]["f_gradient_share"]["100"]["by_seed"] == [0.01, 0.02, 0.03]
    # headroom: NLL(retrieved) - NLL(gold) and NLL(wrong page) - NLL(retrieved), per measured update
    headroom = arm["headroom"]["500"]
    assert headroom["retrieved_minus_gold"]["mean"] == pytest.approx(0.0, abs=0.05)
    assert headroom["wrong_page_minus_retrieved"]["mean"] == pytest.approx(0.2 - 0.05, abs=0.02)  # per token
    assert set(arm["p_at_1_over_updates"]) == {"init", "0", "500"}
    assert arm["over_updates"]["500"]["p_at_1_over_init"]["mean"] == pytest.approx(0.2, abs=0.05)
