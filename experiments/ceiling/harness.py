"""`python -m experiments.ceiling`: the recipe's held-out evidence gain against an index built from alignment labels.

Every arm is a single-process run (`services.driver.single_process`) of one base config (the learning recipe as
the study ran it, `experiments/configs/learning-2026-11-26.yaml`, which keeps self-evidence and the denoising-contrastive loss on g unless an arm
removes it), with the same model, data, probes and seed, for the same wall-clock minutes; only the index differs:

    aligned_translations  each document linked to its aligned translations (the corpus's paragraph ids) and to 2
                          random documents of its shard, built once: an index from labels. Not MARGE, and not a
                          ceiling either (it gives fewer, differently mixed links than the recipe's index)
    recipe                version 0 from char n-gram TF-IDF within each shard, then cos(g) + lambda * tfidf with
                          lambda annealed to 0 (the lexical bootstrap), rebuilt every `indexer.reindex_every`
    recipe_random_index   the recipe with version 0 from the random-init g, then g (its auxiliaries kept: not the
                          paper's loop, which `python -m experiments.mechanism` runs as its `paper` arm)
    recipe_tfidf_frozen   the recipe with a TF-IDF index built once and never rebuilt
    aligned_supervised    aligned_translations without the auxiliary loss on g: batches built from the labels,
                          self-evidence kept, f not detached (so it does not isolate beta * f: see
                          experiments/mechanism)

Each arm measures, every `trainer.snapshot_every` updates, the aligned probe: held-out paragraphs' loss with **gold**
aligned translations as evidence against their loss with another page's translations (evidence gain per token and
per character, with bootstrap intervals over targets, split into verbatim and other target tokens). g and the
index play no part in that figure. With every index version it records the share of cross-lingual links that join
aligned translations. R(t) = the arm's gain / the aligned_translations arm's at equal updates, with a paired
bootstrap interval over the probe's targets.

A size sweep comes first (`--sweep-minutes`): the aligned_translations arm at each model width for a few minutes,
and the width with the largest held-out gain at the end is used by every arm. Finished arms and sweep points are
kept: the command is resumable, and running it again on its folder runs only what is missing.

    DIR/sweep/<width>/      one single-process run per width (aligned_translations arm)
    DIR/arms/<arm>/         one single-process run per arm
    DIR/report.json         arms, ratio, targets, sweep (paths relative to DIR)
    DIR/curves.png
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marge.contracts.train_log import read_train_log
from marge.util.files import atomic_write_text
from services.driver.single_process import train_for_minutes, trained_minutes

log = logging.getLogger("marge.ceiling")

DEFAULT_CONFIG = Path("experiments/configs/learning-2026-11-26.yaml")
FROZEN = "indexer.reindex_every=1000000"  # one index version serves the whole run


@dataclass(frozen=True)
class Arm:
    name: str
    why: str
    overrides: tuple[str, ...]


ORACLE = ("indexer.links=aligned", "indexer.bootstrap=none", "indexer.lexical_weight=0", FROZEN)
ARMS = (
    Arm("aligned_translations", "aligned translations + 2 random in-shard distractors, built once: an index from "
        "labels, not MARGE", ORACLE),
    Arm("recipe", "the recipe: TF-IDF version 0, then cos(g) + lambda * tfidf, lambda annealed to 0", ()),
    Arm("recipe_random_index", "the recipe from a random-init g's index: version 0 from it, g after (self-evidence and "
        "the auxiliary loss kept)",
        ("indexer.bootstrap=none", "indexer.lexical_weight=0")),
    Arm("recipe_tfidf_frozen", "a char n-gram TF-IDF index built once, never rebuilt",
        ("indexer.links=tfidf", "indexer.bootstrap=none", "indexer.lexical_weight=0", FROZEN)),
    Arm("aligned_supervised", "aligned_translations without the auxiliary loss on g (batches from labels, "
        "self-evidence kept, f not detached)",
        (*ORACLE, "objectives.denoising_contrastive=null")),
)
ARM_NAMES = tuple(a.name for a in ARMS)

SIZES: dict[str, tuple[str, ...]] = {
    "d64": ("model.d_model=64", "model.encoder_ffn=256", "model.decoder_local_ffn=256", "model.decoder_ffn=512"),
    "d128": ("model.d_model=128", "model.encoder_ffn=512", "model.decoder_local_ffn=512", "model.decoder_ffn=1024"),
    "d192": ("model.d_model=192", "model.encoder_ffn=768", "model.decoder_local_ffn=768", "model.decoder_ffn=1536"),
}
"""Model widths of the sweep (`tiny`'s depth: 3 encoder layers, 1 local + 2 cross decoder layers, 4 heads)."""

SWEEP_SNAPSHOTS = "trainer.snapshot_every=100"
"""The sweep's short runs measure the probe more often than the arms."""

CHECKPOINT_UPDATES = (1000, 2000, 3000)
"""Updates at which the report states R(t) (and at the end of the shortest arm)."""


def arm_named(name: str) -> Arm:
    for arm in ARMS:
        if arm.name == name:
            return arm
    raise ValueError(f"unknown arm {name!r}; choose from {list(ARM_NAMES)}")


# ----------------------------------------------------------------------------------------------------
# Reading a run
# ----------------------------------------------------------------------------------------------------


def health_by_step(run_dir: Path) -> dict[int, dict]:
    """The health records of a single-process run (step 0: its baselines' initial health), by update."""
    out = {}
    baselines = run_dir.parent / "baselines.json"
    if baselines.exists():
        out[0] = json.loads(baselines.read_text(encoding="utf-8")).get("initial_health", {})
    for record in read_train_log(run_dir):
        if record.health:
            out[record.step] = record.health
    return out


def checkpoint_evals(out: Path) -> list[dict]:
    """Held-out P@1 (every pair, at the run's eval layer) of each checkpoint of a single-process run."""
    path = out / "checkpoint_evals.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def index_builds(run_dir: Path) -> list[dict]:
    path = run_dir / "index_builds.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summarize_arm(name: str, out: Path, report: dict) -> dict:
    """One arm of report.json (the layout the README documents)."""
    run_dir = out / "run"
    health = health_by_step(run_dir)
    records = read_train_log(run_dir)
    baselines = json.loads((out / "baselines.json").read_text(encoding="utf-8"))
    aligned = {s: h for s, h in health.items() if "aligned_evidence_gain" in h}
    trained_g = report["trained_by_layer"].get("g", report["p_at_1"]["trained"])
    return {
        "updates": report["pipeline"]["steps"],
        "minutes": round(trained_minutes(out), 2),
        "train_seconds": report["pipeline"]["train_seconds"],
        "target_tokens_per_s": report["pipeline"]["target_tokens_per_s"],
        "evidence_gain": {str(s): h["aligned_evidence_gain"] for s, h in sorted(aligned.items())},
        "evidence_gain_ci95": {str(s): h["aligned_evidence_gain_ci95"] for s, h in sorted(aligned.items())},
        "evidence_gain_per_char": {str(s): h["aligned_evidence_gain_per_char"] for s, h in sorted(aligned.items())},
        "evidence_gain_per_char_ci95": {str(s): h["aligned_evidence_gain_per_char_ci95"] for s, h in sorted(aligned.items())},
        "gain_verbatim_tokens": {str(s): h["aligned_gain_verbatim_tokens"] for s, h in sorted(aligned.items())},
        "gain_other_tokens": {str(s): h["aligned_gain_other_tokens"] for s, h in sorted(aligned.items())},
        "copy_gain": {str(s): h["aligned_copy_gain"] for s, h in sorted(aligned.items())},
        "page_probe_evidence_gain": {str(s): h["evidence_gain"] for s, h in sorted(health.items()) if "evidence_gain" in h},
        "g_spread": {str(s): h["g_spread"] for s, h in sorted(health.items()) if "g_spread" in h},
        "p_at_1_g_over_time": {str(e["step"]): e["p_at_1_mean"] for e in checkpoint_evals(out)},
        "p_at_1": {"trained": trained_g, "random_init": baselines.get("random_init_g", {}),
                   "best_random_init_layer": baselines["random_init"], "tfidf": baselines["tfidf"]},
        "parallel_link_precision": {str(b["version"]): b.get("crosslingual_parallel_precision") for b in index_builds(run_dir)},
        "same_page_link_precision": {str(b["version"]): b.get("crosslingual_link_precision") for b in index_builds(run_dir)},
        "link_sources": {str(b["version"]): b.get("link_sources") for b in index_builds(run_dir)},
        "lexical_weight": {str(b["version"]): b.get("lexical_weight") for b in index_builds(run_dir)},
        "beta": {str(s): h["beta"][0] for s, h in sorted(health.items()) if h.get("beta")},
        "loss": {str(r.step): r.loss for r in records if r.step % 250 == 0},
        "item_gains": {str(s): h["aligned_item_gains"] for s, h in sorted(aligned.items()) if "aligned_item_gains" in h},
    }


# ----------------------------------------------------------------------------------------------------
# The ratio and the targets
# ----------------------------------------------------------------------------------------------------


def paired_ratio(numerator: list[float], denominator: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """sum(numerator) / sum(denominator) over the same probe targets, with a paired bootstrap 95% interval."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(a), size=(resamples, len(a)))
    den = b[draws].sum(1)
    ratios = np.where(np.abs(den) > 1e-12, a[draws].sum(1) / np.where(np.abs(den) > 1e-12, den, 1.0), np.nan)
    finite = ratios[np.isfinite(ratios)]
    ci = [float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))] if len(finite) else [None, None]
    return {"ratio": float(a.sum() / b.sum()) if abs(b.sum()) > 1e-12 else None, "ci95": ci}


def ratios(arms: dict[str, dict], numerator: str, denominator: str = "aligned_translations") -> dict[str, dict]:
    """R(update) = arm `numerator`'s aligned evidence gain / `denominator`'s at every update both measured."""
    if numerator not in arms or denominator not in arms:
        return {}
    a, b = arms[numerator]["item_gains"], arms[denominator]["item_gains"]
    return {s: paired_ratio(a[s], b[s]) for s in sorted(set(a) & set(b), key=int) if int(s) > 0}


def at_or_before(series: dict[str, float], update: int):
    """The value of the last measurement at or before `update` (None if none)."""
    steps = [int(s) for s in series if int(s) <= update]
    return series[str(max(steps))] if steps else None


def latin_directions(results: dict[str, float]) -> dict[str, float]:
    latin = {"en", "de", "fr", "es", "it"}
    return {k: v for k, v in results.items() if set(k.split("->")) <= latin}


def judge_targets(arms: dict[str, dict], ratio_loop: dict, ratio_paper: dict) -> dict:
    """T0-T5 of the comparison as measured (True / False / None when the arm did not run)."""
    out: dict = {}
    if "aligned_translations" in arms:
        gains = arms["aligned_translations"]["evidence_gain"]
        final = gains[max(gains, key=int)] if gains else None
        out["T0_aligned_translations_gain_at_least_0.5"] = None if final is None else final >= 0.5
        out["T0_aligned_translations_final_gain"] = final
    later = {s: r for s, r in ratio_loop.items() if int(s) >= 2000 and r["ratio"] is not None}
    out["T1_recipe_ratio_at_least_0.5_from_2000"] = (all(r["ratio"] >= 0.5 for r in later.values()) if later else None)
    later = {s: r for s, r in ratio_paper.items() if int(s) >= 2000 and r["ratio"] is not None}
    out["T2_recipe_random_index_ratio_at_least_0.25_from_2000"] = (all(r["ratio"] >= 0.25 for r in later.values()) if later else None)
    if "recipe" in arms:
        precision = {int(v): p for v, p in arms["recipe"]["parallel_link_precision"].items() if p is not None}
        lexical = {int(v): w for v, w in arms["recipe"]["lexical_weight"].items()}
        handed = [v for v in sorted(precision) if v > 0 and not lexical.get(v)]
        start = precision.get(0)
        out["T3_precision_never_below_tfidf_after_handover"] = (
            all(precision[v] >= start for v in handed) if handed and start is not None else None)
        last = handed[-3:]
        out["T3_precision_rises_over_last_rebuilds"] = (
            all(precision[a] <= precision[b] for a, b in zip(last, last[1:])) if len(last) >= 2 else None)
        if "recipe_tfidf_frozen" in arms:
            loop_gain, frozen_gain = (arms[k]["evidence_gain"] for k in ("recipe", "recipe_tfidf_frozen"))
            common = sorted(set(loop_gain) & set(frozen_gain), key=int)
            out["T3_recipe_beats_recipe_tfidf_frozen_at_end"] = (loop_gain[common[-1]] > frozen_gain[common[-1]]) if common else None
        trained, init = (latin_directions(arms["recipe"]["p_at_1"][k]) for k in ("trained", "random_init"))
        out["T4_recipe_latin_p_at_1_mean"] = float(np.mean(list(trained.values()))) if trained else None
        out["T4_recipe_latin_p_at_1_at_least_0.30"] = (out["T4_recipe_latin_p_at_1_mean"] or 0) >= 0.30
        out["T4_recipe_above_random_init_every_direction"] = bool(trained) and all(trained[k] > init.get(k, 1) for k in trained)
    if "aligned_supervised" in arms:
        trained, init = (latin_directions(arms["aligned_supervised"]["p_at_1"][k]) for k in ("trained", "random_init"))
        en_pairs = {k: v for k, v in trained.items() if k.startswith("en->")}
        beta = arms["aligned_supervised"]["beta"]
        out["T5_aligned_supervised_directions_above_random_init"] = sum(v > init.get(k, 1) for k, v in en_pairs.items())
        out["T5_aligned_supervised_en_directions"] = len(en_pairs)
        out["T5_aligned_supervised_beta_first_last"] = [beta[min(beta, key=int)], beta[max(beta, key=int)]] if beta else None
        out["T5_aligned_supervised_g_beats_init_on_3_of_4_with_beta_rising"] = (
            out["T5_aligned_supervised_directions_above_random_init"] >= 3 and bool(beta)
            and beta[max(beta, key=int)] > beta[min(beta, key=int)])
    return out


# ----------------------------------------------------------------------------------------------------
# The size sweep
# ----------------------------------------------------------------------------------------------------


def run_sweep(config: Path, overrides: list[str], minutes: float, out: Path, sizes: list[str], device: str) -> dict:
    """The oracle arm at each width for `minutes`; the chosen width has the largest final aligned evidence gain."""
    points = {}
    for size in sizes:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {list(SIZES)}")
        run = out / "sweep" / size
        report = train_for_minutes(config, [*overrides, *SIZES[size], SWEEP_SNAPSHOTS, *ORACLE], minutes, run, device,
                                   label=f"sweep {size}")
        arm = summarize_arm("aligned_translations", run, report)
        gains = arm["evidence_gain"]
        final_step = max(gains, key=int) if gains else "0"
        points[size] = {"overrides": list(SIZES[size]), "parameters": parameters(run), "updates": arm["updates"],
                        "minutes": arm["minutes"], "evidence_gain": gains, "evidence_gain_per_char": arm["evidence_gain_per_char"],
                        "final_evidence_gain": gains.get(final_step), "final_update": int(final_step),
                        "final_evidence_gain_ci95": arm["evidence_gain_ci95"].get(final_step),
                        "gain_per_minute": (gains.get(final_step) or 0.0) / max(arm["minutes"], 1e-9)}
        log.info("sweep %s: %d updates, oracle gain %.4f at update %s", size, arm["updates"],
                 points[size]["final_evidence_gain"] or 0.0, final_step)
    chosen = max(points, key=lambda s: points[s]["final_evidence_gain"] or -1e9)
    return {"minutes_per_size": minutes, "points": points, "chosen": chosen,
            "rule": "largest held-out aligned evidence gain of the oracle arm after the same minutes"}


def parameters(run: Path) -> int | None:
    from marge.model.checkpoint import complete_checkpoints
    from marge.model.restore import load_model

    checkpoints = complete_checkpoints(run / "run" / "checkpoints")
    return sum(p.numel() for p in load_model(checkpoints[-1]).parameters()) if checkpoints else None


# ----------------------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------------------


def run_ceiling(config: Path | None, overrides: list[str], minutes: float, out_dir: Path, arms: list[str] | None = None,
                sweep_minutes: float = 0.0, sizes: list[str] | None = None, size: str | None = None,
                device: str = "auto") -> dict:
    """The sweep (when `sweep_minutes`), then every arm (or `arms`) for `minutes` each, then report.json and
    curves.png in `out_dir`."""
    started = time.time()
    config = Path(config or DEFAULT_CONFIG)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen_arms = [arm_named(a) for a in (arms or ARM_NAMES)]
    sweep = None
    sweep_path = out_dir / "sweep.json"
    if sweep_minutes:
        sweep = run_sweep(config, overrides, sweep_minutes, out_dir, sizes or list(SIZES), device)
        atomic_write_text(sweep_path, json.dumps(sweep, indent=2) + "\n")
    elif sweep_path.exists():
        sweep = json.loads(sweep_path.read_text(encoding="utf-8"))
    size = size or (sweep["chosen"] if sweep else None)
    size_overrides = list(SIZES[size]) if size else []
    summaries = {}
    for arm in chosen_arms:
        if not minutes:
            break
        log.info("arm %s (%s) for %.1f min", arm.name, arm.why, minutes)
        run = out_dir / "arms" / arm.name
        # the arm's own settings last: a common override cannot turn one arm into another
        report = train_for_minutes(config, [*size_overrides, *overrides, *arm.overrides], minutes, run, device,
                                   label=arm.name)
        summaries[arm.name] = summarize_arm(arm.name, run, report)
    # arms run by an earlier command on this folder count too
    for arm in ARMS:
        run = out_dir / "arms" / arm.name
        if arm.name not in summaries and (run / "report.json").exists():
            summaries[arm.name] = summarize_arm(arm.name, run, json.loads((run / "report.json").read_text(encoding="utf-8")))
    return write_report(out_dir, summaries, sweep, size, config, overrides, minutes, time.time() - started)


def write_report(out_dir: Path, summaries: dict[str, dict], sweep: dict | None, size: str | None, config: Path,
                 overrides: list[str], minutes: float, elapsed_s: float) -> dict:
    ratio_loop = ratios(summaries, "recipe")
    ratio_paper = ratios(summaries, "recipe_random_index")
    ratio_frozen = ratios(summaries, "recipe_tfidf_frozen")
    arms_out = {name: {k: v for k, v in arm.items() if k != "item_gains"} for name, arm in summaries.items()}
    for name, arm in arms_out.items():
        arm["why"] = arm_named(name).why
        arm["overrides"] = list(arm_named(name).overrides)
    headline = {}
    for name, series in (("recipe", ratio_loop), ("recipe_random_index", ratio_paper), ("recipe_tfidf_frozen", ratio_frozen)):
        if series:
            last = max(series, key=int)
            headline[name] = {str(u): at_or_before({s: r["ratio"] for s, r in series.items()}, u)
                              for u in (*(u for u in CHECKPOINT_UPDATES if u <= int(last)), int(last))}
    report = {
        "question": "How much does each arm's decoder gain from gold aligned translations as evidence, against the "
                    "arm whose index is built from the alignment labels, at equal updates?",
        "ratio_definition": "R(t) = aligned-probe evidence gain of the arm / of aligned_translations at update t (the same "
                            "held-out targets, so per token and per character it is the same number); ci95: paired "
                            "bootstrap over the probe's targets",
        "evidence_gain_definition": "aligned probe: held-out paragraphs' loss with an unrelated paragraph's "
                                    "translations minus with their own gold aligned translations (nats per target "
                                    "token, and per target character); g and the index play no part in it",
        "config": str(config), "size": size, "size_overrides": list(SIZES[size]) if size else [],
        "common_overrides": list(overrides),
        "minutes_per_arm": {name: arm["minutes"] for name, arm in summaries.items()},
        "arms": arms_out,
        "ratio": {s: r["ratio"] for s, r in ratio_loop.items()},
        "ratio_ci95": {s: r["ci95"] for s, r in ratio_loop.items()},
        "ratio_per_char": {s: r["ratio"] for s, r in ratio_loop.items()},
        "ratio_recipe_random_index": {s: r["ratio"] for s, r in ratio_paper.items()},
        "ratio_recipe_random_index_ci95": {s: r["ci95"] for s, r in ratio_paper.items()},
        "ratio_recipe_tfidf_frozen": {s: r["ratio"] for s, r in ratio_frozen.items()},
        "ratio_recipe_tfidf_frozen_ci95": {s: r["ci95"] for s, r in ratio_frozen.items()},
        "headline_ratios": headline,
        "targets": judge_targets(summaries, ratio_loop, ratio_paper),
        "sweep": sweep, "elapsed_s": round(elapsed_s, 1),
        "command": f"python -m experiments.ceiling --minutes {minutes:g} --out DIR"
                   + (f" --sweep-minutes {sweep['minutes_per_size']:g}" if sweep else "")
                   + (f" --size {size}" if size and not sweep else ""),
    }
    if summaries:
        report["curves"] = plot_ceiling(report, out_dir / "curves.png").name
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report


def plot_ceiling(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    colors = {"aligned_translations": "C0", "recipe": "C1", "recipe_random_index": "C2", "recipe_tfidf_frozen": "C3", "aligned_supervised": "C4"}
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))

    def xy(series: dict) -> tuple[list[int], list[float]]:
        keys = sorted((k for k in series if series[k] is not None), key=int)
        return [int(k) for k in keys], [series[k] for k in keys]

    ax = axes[0, 0]
    for name, arm in arms.items():
        x, y = xy(arm["evidence_gain"])
        ax.plot(x, y, "o-", color=colors.get(name), label=name, markersize=3)
        lo = [arm["evidence_gain_ci95"][str(s)][0] for s in x]
        hi = [arm["evidence_gain_ci95"][str(s)][1] for s in x]
        ax.fill_between(x, lo, hi, color=colors.get(name), alpha=0.15)
    ax.set_title("held-out gain from gold translations vs another page's (nats/token, 95% CI)")
    ax.set_xlabel("update")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    top = 1.5  # R can exceed 1 (an arm that learns faster than the oracle): the axis grows to show it
    for key, name in (("ratio", "recipe"), ("ratio_recipe_random_index", "recipe_random_index"), ("ratio_recipe_tfidf_frozen", "recipe_tfidf_frozen")):
        x, y = xy(report[key])
        if x:
            ci = report[f"{key}_ci95"]
            top = max(top, *(ci[str(s)][1] + 0.1 for s in x if ci[str(s)][1] is not None))
            ax.plot(x, y, "o-", color=colors[name], label=f"{name} / aligned_translations", markersize=3)
            ax.fill_between(x, [ci[str(s)][0] for s in x], [ci[str(s)][1] for s in x], color=colors[name], alpha=0.15)
    ax.axhline(0.5, color="k", linestyle=":", linewidth=1)
    ax.set_ylim(-0.5, top)
    ax.set_title("R(t): gain / aligned_translations' gain (paired 95% CI)")
    ax.set_xlabel("update")
    ax.legend(fontsize=8)

    ax = axes[0, 2]
    for name, arm in arms.items():
        x, y = xy(arm["gain_other_tokens"])
        ax.plot(x, y, "o-", color=colors.get(name), label=f"{name}: other tokens", markersize=3)
        x, y = xy(arm["gain_verbatim_tokens"])
        ax.plot(x, y, "x--", color=colors.get(name), label=f"{name}: verbatim tokens", markersize=3)
    ax.set_title("gain per target token: verbatim in the evidence (x) vs not (o)")
    ax.set_xlabel("update")
    ax.legend(fontsize=7)

    ax = axes[1, 0]
    for name, arm in arms.items():
        builds = arm["parallel_link_precision"]
        x = sorted((int(v) for v in builds if builds[v] is not None))
        ax.plot(x, [builds[str(v)] for v in x], "s-", color=colors.get(name), label=name, markersize=3)
    ax.set_title("index: cross-lingual links joining aligned translations")
    ax.set_xlabel("index version")
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    for name, arm in arms.items():
        x, y = xy(arm["p_at_1_g_over_time"])
        ax.plot(x, y, "o-", color=colors.get(name), label=name, markersize=3)
    any_arm = next(iter(arms.values()))
    init = any_arm["p_at_1"]["random_init"]
    if init:
        ax.axhline(float(np.mean(list(init.values()))), color="0.5", linestyle="--", label="g at init")
    ax.axhline(float(np.mean(list(any_arm["p_at_1"]["tfidf"].values()))), color="k", linestyle=":", label="TF-IDF")
    ax.set_title("held-out P@1 of g (mean over directions)")
    ax.set_xlabel("update")
    ax.legend(fontsize=8)

    ax = axes[1, 2]
    for name, arm in arms.items():
        x, y = xy(arm["beta"])
        ax.plot(x, y, "o-", color=colors.get(name), label=name, markersize=3)
    ax.set_title("beta")
    ax.set_xlabel("update")
    ax.legend(fontsize=8)
    minutes = sorted(set(report["minutes_per_arm"].values()))
    fig.suptitle(f"The recipe's gold-evidence gain against an index from labels: {' / '.join(f'{m:g}' for m in minutes)} "
                 "min per arm, one seed"
                 + (f", width {report['size']}" if report.get("size") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
