"""The report of a learning run, in either host (the Ray pipeline or the single process): baselines measured
before training (the initial model's held-out P@1 at every encoder layer, char n-gram TF-IDF, the initial probe
health), held-out P@1 and evidence gain of every checkpoint, and DIR/report.json with DIR/curves.png."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marge.contracts.train_log import UpdateRecord
from marge.eval.curves import ema, plot_curves
from marge.eval.evaluation import evaluate_model, evaluate_tfidf, mean_score
from marge.model.embedding import has_relevance_encoder
from marge.util.files import atomic_write_text
from services.driver.config import PipelineConfig
from services.trainer.health import aligned_evidence_gain, build_probe, probe_health

log = logging.getLogger("marge.experiment")


def best_per_pair(by_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    keys = next(iter(by_layer.values())).keys()
    return {k: max(results[k] for results in by_layer.values()) for k in keys}


def measure_baselines(init_model, tokenizer, pairs, probe, device: str | torch.device = "cpu", aligned=None) -> dict:
    """What the run is compared with, measured before training: the initial (random) model's held-out P@1 at
    every encoder layer and the best of them per direction, char n-gram TF-IDF, and the initial probe health."""
    by_layer = {layer: evaluate_model(init_model, tokenizer, pairs, layer, device=str(device))
                for layer in range(0, len(init_model.encoder_layers) + 1)}
    best = best_per_pair(by_layer)
    by_g = evaluate_model(init_model, tokenizer, pairs, "g", device=str(device)) if has_relevance_encoder(init_model) else {}
    tfidf = evaluate_tfidf(pairs)
    health = probe_health(init_model, probe, tokenizer.specials, device) if probe else {}
    if aligned:
        health.update(aligned_evidence_gain(init_model, aligned, tokenizer.specials, device))
    log.info("baselines: random init best %.3f (by layer %s), TF-IDF %.3f, initial evidence gain %.3f",
             mean_score(best), {k: round(mean_score(v), 3) for k, v in by_layer.items()}, mean_score(tfidf),
             health.get("evidence_gain", float("nan")))
    return {"random_init_by_layer": {str(k): v for k, v in by_layer.items()}, "random_init": best,
            "random_init_g": by_g, "tfidf": tfidf, "initial_health": health}


def checkpoint_evaluation(model, tokenizer, pairs, eval_layer, probe, step: int,
                          device: str | torch.device = "cpu") -> dict:
    """Held-out P@1 (every pair) and the probe's evidence gain of one checkpoint: a point of P@1 over time."""
    results = evaluate_model(model, tokenizer, pairs, eval_layer, device=str(device))
    health = probe_health(model, probe, tokenizer.specials, device) if probe else {}
    log.info("checkpoint step %d: P@1 %.3f, evidence gain %s", step, mean_score(results), health.get("evidence_gain"))
    return {"step": step, "p_at_1_mean": mean_score(results), "p_at_1": results,
            "evidence_gain": health.get("evidence_gain")}


@dataclass(frozen=True)
class FinalModel:
    """The model a learning experiment ended with, and what it is measured on, layer by layer."""

    model: Any
    """The trained model (None: the run trained none, only its curves are reported)."""
    tokenizer: Any
    pairs: Any
    """The held-out pairs (`marge.eval.evaluation.read_pairs`)."""
    eval_layer: int | str | None
    device: str | torch.device = "cpu"


@dataclass(frozen=True)
class RunAccount:
    """What a learning experiment's run did: its updates, checkpoint, index builds, the pipeline's summary and time."""

    records: list[UpdateRecord]
    checkpoint: str | None
    index_builds: list[dict]
    pipeline: dict
    minutes: float
    """The training budget asked for."""
    elapsed_s: float


def assemble_report(baselines: dict, over_time: list[dict], final_model: FinalModel, run: RunAccount,
                    cfg: PipelineConfig, out_dir: Path, extra: dict | None = None) -> dict:
    """report.json and curves.png of a learning experiment (either mode), from what the run measured."""
    random_best, tfidf = baselines["random_init"], baselines["tfidf"]
    final = over_time[-1] if over_time else {"p_at_1": {}, "evidence_gain": None, "step": 0}
    trained = final["p_at_1"]
    # the final model at every layer too, next to random init's: which representation learned what
    model, records, eval_layer = final_model.model, run.records, final_model.eval_layer
    trained_by_layer = {} if model is None else {
        str(layer): evaluate_model(model, final_model.tokenizer, final_model.pairs, layer, device=str(final_model.device))
        for layer in [*range(0, len(model.encoder_layers) + 1), *(["g"] if has_relevance_encoder(model) else [])]}
    health_records = ([{"step": 0, **baselines["initial_health"]}]
                      + [{"step": r.step, **r.health} for r in records if r.health])
    depth = len(model.encoder_layers) if model is not None else 5
    report = {
        "evidence_gain": final.get("evidence_gain"),
        "evidence_gain_definition": "probe loss with shuffled evidence minus loss with the true evidence, nats/token",
        "p_at_1": {"trained": trained, "random_init": random_best, "tfidf": tfidf},
        "p_at_1_mean": {"trained": mean_score(trained), "random_init": mean_score(random_best), "tfidf": mean_score(tfidf)},
        "random_init_by_layer": baselines["random_init_by_layer"],
        "trained_by_layer": trained_by_layer,
        "eval_layer": eval_layer if eval_layer is not None else min(5, depth),
        "checkpoint": run.checkpoint,
        "targets": {
            "evidence_gain_at_least_0.5": (final.get("evidence_gain") or 0) >= 0.5,
            "above_best_random_init_on_every_pair": bool(trained) and all(trained[k] > random_best[k] for k in trained),
            "pairs_above_random_init": sum(trained[k] > random_best[k] for k in trained),
            "above_tfidf_on_every_pair": bool(trained) and all(trained[k] > tfidf[k] for k in trained),
            "pairs_above_tfidf": sum(trained[k] > tfidf[k] for k in trained),
            "pairs": len(trained),
        },
        "p_at_1_over_time": over_time, "health": health_records,
        "index_builds": run.index_builds, "pipeline": run.pipeline,
        "minutes": run.minutes, "elapsed_s": round(run.elapsed_s, 1), **(extra or {}), "config": cfg.to_saved_dict(),
    }
    report["curves"] = str(plot_learning(report, records, out_dir / "curves.png"))
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report


def heldout_pairs_path(cfg: PipelineConfig) -> Path:
    path = cfg.health.pairs or cfg.data.heldout_pairs
    if not path:
        raise FileNotFoundError("this experiment measures held-out retrieval P@1 and has no held-out pairs: set "
                                "data.heldout_pairs (or health.pairs), or prepare the corpus with a held-out split "
                                "(data.heldout_permille, `marge prepare --heldout-permille N`)")
    if not Path(path).exists():
        raise FileNotFoundError(f"held-out pairs {path} not found: set data.heldout_pairs (or health.pairs)")
    return Path(path)


def build_run_probe(cfg: PipelineConfig, tokenizer):
    """The run's evidence-gain probe (None when health.documents is null)."""
    h = cfg.health
    return build_probe(Path(h.documents), tokenizer, h.probe_size, h.max_evidence, h.max_tokens,
                       seed=cfg.run.seed) if h.documents else None


def plot_learning(report: dict, records: list[UpdateRecord], path: Path) -> Path:
    steps = [r.step for r in records]
    losses = [r.loss for r in records]
    health = report["health"]
    hsteps = [h["step"] for h in health]
    over = report["p_at_1_over_time"]
    builds = report["index_builds"]
    panels: list[dict] = [
        {"title": "training loss (nats/token)", "ylabel": "loss",
         "series": [{"label": "per step", "x": steps, "y": losses, "color": "0.8"},
                    {"label": "EMA", "x": steps, "y": ema(losses, 0.05), "color": "C0"}]},
        {"title": "evidence gain on the probe (nats/token)", "ylabel": "gain",
         "series": [{"label": "probe", "x": hsteps, "y": [h.get("evidence_gain") for h in health], "style": "o-"},
                    {"label": "target 0.5", "hline": 0.5, "color": "C3"}]},
        {"title": "relevance cosines", "ylabel": "cosine",
         "series": [{"label": "f(target, true evidence)", "x": hsteps, "y": [h.get("relevance_cos_true") for h in health], "style": "o-"},
                    {"label": "f(target, other evidence)", "x": hsteps, "y": [h.get("relevance_cos_shuffled") for h in health], "style": "o-"},
                    {"label": "spread of g", "x": hsteps, "y": [h.get("g_spread") for h in health], "style": "x--"}]},
        {"title": "beta and index link precision", "ylabel": "value",
         "series": [{"label": "beta (mean)", "x": steps, "y": [float(np.mean(r.beta)) if r.beta else None for r in records]},
                    {"label": "x-lingual links within a page", "x": [b["snapshot_step"] for b in builds],
                     "y": [b.get("crosslingual_link_precision") for b in builds], "style": "s-"},
                    {"label": "x-lingual links to aligned translations", "x": [b["snapshot_step"] for b in builds],
                     "y": [b.get("crosslingual_parallel_precision") for b in builds], "style": "o-"}]},
        {"title": "held-out P@1 (mean over directions)", "ylabel": "P@1",
         "series": [{"label": "trained", "x": [o["step"] for o in over], "y": [o["p_at_1_mean"] for o in over], "style": "o-"},
                    {"label": "best random init", "hline": report["p_at_1_mean"]["random_init"], "color": "C1"},
                    {"label": "char n-gram TF-IDF", "hline": report["p_at_1_mean"]["tfidf"], "color": "C2"}]},
    ]
    return plot_curves(panels, path, f"learning experiment, {report['minutes']} min")
