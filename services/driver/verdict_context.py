"""What the run's last line (`[g] ...`, `services.trainer.health.describe_g_health`) sets beside the initialisation
baseline: chance and char n-gram TF-IDF on the same held-out pairs, and whether a language is cut off from the
cross-lingual links of the newest index version (`services.driver.language_links`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def chance_p_at_1(pairs) -> float:
    """P@1 of a retriever that ranks at random, mean over directions: 1 / the candidates of each direction (a pair
    set's two directions have as many)."""
    return float(np.mean([1.0 / len(p.targets) for p in pairs if p.targets])) if pairs else 0.0


def add_verdict_context(health: dict, pairs, corpus, index_root: Path, indexer=None,
                        tfidf: dict[str, float] | None = None) -> dict:
    """`health` (from `g_health`) with `chance`, `tfidf_p_at_1` (`tfidf`: TF-IDF P@1 by direction measured on these
    pairs before, else measured here) and `languages_cut_off`; a cut-off language's warning is added to
    `warning`, which the run logs. Returns `health`."""
    from marge.eval.evaluation import evaluate_tfidf, mean_score
    from services.driver.language_links import index_language_warning

    health["chance"] = chance_p_at_1(pairs)
    health["tfidf_p_at_1"] = mean_score(tfidf if tfidf is not None else evaluate_tfidf(pairs))
    cut, warning = index_language_warning(index_root, corpus, indexer)
    health["languages_cut_off"] = cut
    if warning:
        health["warning"] = f"{health['warning']} {warning}" if health.get("warning") else warning
    return health
