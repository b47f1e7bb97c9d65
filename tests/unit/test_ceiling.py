"""`python -m experiments.ceiling`: the loop against its aligned oracle, arm by arm, and the ratio between them.

The tests of this subject that need a server or take long are in tests/integration/test_ceiling_run.py."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.ceiling.harness import judge_targets, paired_ratio, ratios


def test_paired_ratio_is_the_ratio_of_sums_with_an_interval_around_it():
    rng = np.random.default_rng(0)
    oracle = rng.normal(1.0, 0.3, size=400)
    loop = 0.5 * oracle + rng.normal(0.0, 0.05, size=400)
    r = paired_ratio(loop.tolist(), oracle.tolist())
    assert r["ratio"] == pytest.approx(loop.sum() / oracle.sum())
    lo, hi = r["ci95"]
    assert lo < r["ratio"] < hi and 0.45 < lo and hi < 0.55  # paired: the shared noise cancels
    assert paired_ratio([1.0, 2.0], [0.0, 0.0])["ratio"] is None  # no oracle gain: no ratio


def test_ratios_pair_the_updates_both_arms_measured():
    arms = {"aligned_translations": {"item_gains": {"0": [0.0, 0.0], "250": [1.0, 1.0], "500": [2.0, 2.0]}},
            "recipe": {"item_gains": {"0": [0.0, 0.0], "250": [0.5, 0.5], "750": [1.0, 1.0]}}}
    assert {s: r["ratio"] for s, r in ratios(arms, "recipe").items()} == {"250": 0.5}
    assert ratios(arms, "recipe_random_index") == {}


def arm(gains: dict, precision: dict, lexical: dict, trained: dict, init: dict, beta: dict) -> dict:
    return {"evidence_gain": gains, "parallel_link_precision": precision, "lexical_weight": lexical,
            "p_at_1": {"trained": trained, "random_init": init}, "beta": beta}


def test_targets_are_judged_from_the_measurements():
    directions = ["en->de", "de->en", "en->fr", "fr->en", "en->es", "es->en", "en->it", "it->en"]
    high, low = dict.fromkeys(directions, 0.4), dict.fromkeys(directions, 0.1)
    arms = {
        "aligned_translations": arm({"0": 0.0, "3000": 0.6}, {}, {}, high, low, {"0": 1.0}),
        "recipe": arm({"0": 0.0, "3000": 0.4}, {"0": 0.5, "1": 0.45, "2": 0.5, "3": 0.55, "4": 0.6},
                    {"0": 0.0, "1": 1.0, "2": 0.0, "3": 0.0, "4": 0.0}, high, low, {"0": 1.0}),
        "recipe_tfidf_frozen": arm({"0": 0.0, "3000": 0.3}, {"0": 0.5}, {"0": 0.0}, low, low, {"0": 1.0}),
        "aligned_supervised": arm({"0": 0.0}, {}, {}, {**low, "en->de": 0.2, "en->fr": 0.2, "en->es": 0.2}, low,
                         {"0": 1.0, "500": 1.2}),
    }
    ratio = {"2000": {"ratio": 0.6}, "3000": {"ratio": 0.55}}
    t = judge_targets(arms, ratio, {"2000": {"ratio": 0.2}})
    assert t["T0_aligned_translations_gain_at_least_0.5"] and t["T0_aligned_translations_final_gain"] == 0.6
    assert t["T1_recipe_ratio_at_least_0.5_from_2000"] and not t["T2_recipe_random_index_ratio_at_least_0.25_from_2000"]
    # v1 (lambda 1, before the hand-over) may dip; v2-v4 (g alone) never fall below v0's TF-IDF and rise
    assert t["T3_precision_never_below_tfidf_after_handover"] and t["T3_precision_rises_over_last_rebuilds"]
    assert t["T3_recipe_beats_recipe_tfidf_frozen_at_end"]
    assert t["T4_recipe_latin_p_at_1_at_least_0.30"] and t["T4_recipe_above_random_init_every_direction"]
    assert t["T5_aligned_supervised_directions_above_random_init"] == 3 and t["T5_aligned_supervised_g_beats_init_on_3_of_4_with_beta_rising"]
    arms["recipe"]["parallel_link_precision"]["3"] = 0.4
    worse = judge_targets(arms, ratio, {})
    assert worse["T3_precision_never_below_tfidf_after_handover"] is False
    assert worse["T3_precision_rises_over_last_rebuilds"] is False and worse["T2_recipe_random_index_ratio_at_least_0.25_from_2000"] is None
