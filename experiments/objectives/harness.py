"""`python -m experiments.objectives`: MARGE, BART, VECO and a mixture, trained on the same data for the same minutes.

Each variant is a single-process learning run (`services.driver.single_process`: the pipeline's batcher and
trainer cores, and for MARGE its indexer, in one process) of the same base config (the learning recipe,
`deploy/configs/learning.yaml`: the demo corpus in 128-token chunks, the `tiny` depth, the same optimizer
and schedule) with only the `objectives:` section (and, for VECO, its own model) changed:

    marge        the learning recipe as it is: MARGE plus its measured deviations
    bart         BART alone: text infilling + sentence permutation, no index
    veco         VECO's CA-MLM on document halves (its monolingual rule), its own model, no index
    marge+bart   the MARGE recipe with BART denoising of MARGE's own targets in place of `self_evidence`:
                 the mixture chosen because denoising teaches the decoder to read its encoder from the
                 first update (what `self_evidence` was added for), with the paper's own objective kept

Every variant reports, side by side (DIR/report.json, DIR/comparison.png): parameters, updates, tokens/s,
each objective's final training loss, held-out cross-lingual retrieval P@1 at the best encoder layer of the
trained model (the whole sweep kept) next to its own random init's best layer and char n-gram TF-IDF, and,
for the models that generate (the encoder-decoder ones), zero-shot translation chrF on held-out pairs.
Finished variants are kept: running the command again on DIR runs only what is missing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marge.contracts.tokenizer import MargeTokenizer
from marge.contracts.train_log import UpdateRecord, read_train_log
from marge.eval.evaluation import mean_score, read_pairs
from marge.model.checkpoint import complete_checkpoints
from marge.model.generate import GenerationConfig, generate
from marge.model.restore import load_model
from marge.util.files import atomic_write_text
from services.driver.single_process import train_for_minutes

log = logging.getLogger("marge.objectives_experiment")

DEFAULT_CONFIG = Path("deploy/configs/learning.yaml")


@dataclass(frozen=True)
class Variant:
    name: str
    why: str
    overrides: tuple[str, ...]


MARGE_DEVIATIONS = "{marge: {attend_to: linked}, denoising_contrastive: {weight: 0.3, extra_documents: 64}"
VARIANTS = (
    Variant("marge", "the learning recipe: MARGE and its measured deviations", ()),
    Variant("bart", "BART alone (text infilling 0.3, Poisson(3) spans + sentence permutation)",
            ("objectives={bart: {weight: 1.0}}",)),
    Variant("veco", "VECO's CA-MLM on document halves, its own model at the same depth",
            ("objectives={veco: {weight: 1.0, pairs: halves}}", "model={preset: tiny, max_positions: 128}")),
    Variant("marge+bart", "MARGE with BART denoising of its targets in place of self_evidence",
            (f"objectives={MARGE_DEVIATIONS}, bart: {{weight: 1.0}}}}",)),
)


SAME_PROBE = ("health.eval_layer=0",)
"""Every variant's held-out P@1 read at the same place, the mean of the encoder's input embeddings (layer 0): VECO
has no relevance encoder g, so g's P@1 (the recipe's `eval_layer: g`) cannot be compared across variants."""


def variant_named(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; choose from {[v.name for v in VARIANTS]}")


def run_variant(variant: Variant, config: Path, extra_overrides: list[str], minutes: float, out: Path,
                device: str) -> dict:
    """The variant's single-process run for `minutes` (continued where an earlier command left it)."""
    return train_for_minutes(config, [*SAME_PROBE, *variant.overrides, *extra_overrides], minutes, out, device,
                             label=variant.name)


def chrf_zero_shot(model, tokenizer, pairs, per_direction: int, device: str) -> dict[str, float]:
    """chrF of greedy zero-shot translations (evidence = the source, the target language token forced) of the
    first `per_direction` held-out pairs of every direction to or from English."""
    import sacrebleu

    gen = GenerationConfig(beam=1, no_repeat_ngram=4, max_len_a=1.3, max_len_b=5)
    out = {}
    model = model.to(device).eval()
    for pair in pairs:
        if "en" not in (pair.src_lang, pair.tgt_lang):
            continue
        hypotheses = []
        for source in pair.sources[:per_direction]:
            ids = tokenizer.encode(source)[: model.cfg.max_positions - 2]
            with torch.no_grad():
                tokens = generate(model, [ids], tokenizer.lang_id(pair.tgt_lang), tokenizer.specials, gen, device)
            hypotheses.append(tokenizer.decode(tokens))
        references = pair.targets[: len(hypotheses)]
        out[f"{pair.src_lang}->{pair.tgt_lang}"] = float(sacrebleu.corpus_chrf(hypotheses, [references]).score)
    return out


def mean_tail(records: list[UpdateRecord], share: float = 0.1) -> dict[str, float]:
    """Each objective's mean loss over the last `share` of the updates (the end of the run, less noisy)."""
    tail = records[-max(1, int(len(records) * share)):]
    names = sorted({n for r in tail for n in r.objectives})
    return {n: float(np.mean([r.objectives[n] for r in tail if n in r.objectives])) for n in names}


def summarize_variant(variant: Variant, out: Path, report: dict, device: str, chrf_pairs: int) -> dict:
    """One row of the comparison, from the variant's report, train log and final checkpoint."""
    records = read_train_log(out / "run")
    checkpoint = complete_checkpoints(out / "run" / "checkpoints")[-1]
    model = load_model(checkpoint)
    tokenizer = MargeTokenizer.load(checkpoint)  # a checkpoint carries its tokenizer
    by_layer = {int(k): mean_score(v) for k, v in report["trained_by_layer"].items() if k.isdigit()}
    best_layer = max(by_layer, key=by_layer.get)
    random_by_layer = {int(k): mean_score(v) for k, v in report["random_init_by_layer"].items()}
    pairs = read_pairs(Path(report["config"]["data"]["heldout_pairs"]), tokenizer.languages)
    can_generate = hasattr(model, "decoder_layers")
    chrf = chrf_zero_shot(model, tokenizer, pairs, chrf_pairs, device) if can_generate and chrf_pairs else {}
    pipeline = report["pipeline"]
    return {
        "variant": variant.name, "why": variant.why, "overrides": list(variant.overrides),
        "parameters": sum(p.numel() for p in model.parameters()),
        "updates": pipeline["steps"], "train_seconds": pipeline["train_seconds"],
        "tokens_per_s": pipeline["tokens_per_s"], "target_tokens_per_s": pipeline["target_tokens_per_s"],
        "final_losses": mean_tail(records),
        "p_at_1_best_layer": {"layer": best_layer, "mean": by_layer[best_layer],
                              "by_direction": report["trained_by_layer"][str(best_layer)]},
        "p_at_1_by_layer": by_layer,
        "random_init_best_layer": {"layer": max(random_by_layer, key=random_by_layer.get),
                                   "mean": max(random_by_layer.values())},
        "random_init_by_layer": random_by_layer,
        "tfidf_mean": report["p_at_1_mean"]["tfidf"],
        "evidence_gain": report.get("evidence_gain"),
        "chrf_zero_shot": chrf, "chrf_zero_shot_mean": float(np.mean(list(chrf.values()))) if chrf else None,
        "run": str(out),
    }


def plot_comparison(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    x = np.arange(len(rows))
    axes[0].bar(x - 0.2, [r["p_at_1_best_layer"]["mean"] for r in rows], 0.4, label="trained (best layer)")
    axes[0].bar(x + 0.2, [r["random_init_best_layer"]["mean"] for r in rows], 0.4, label="random init (best layer)")
    axes[0].axhline(rows[0]["tfidf_mean"], color="k", linestyle="--", label="TF-IDF")
    axes[0].set_title("held-out cross-lingual P@1 (mean over directions)")
    axes[1].bar(x, [r["chrf_zero_shot_mean"] or 0 for r in rows])
    axes[1].set_title("zero-shot translation chrF (to/from en; VECO cannot generate)")
    axes[2].bar(x, [r["target_tokens_per_s"] for r in rows])
    axes[2].set_title("target tokens/s")
    for ax in axes:
        ax.set_xticks(x, names)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_objectives_experiment(config: Path | None, overrides: list[str], minutes: float, out_dir: Path,
                              only: list[str] | None = None, device: str = "auto", chrf_pairs: int = 8) -> dict:
    """Every variant (or `only` these) for `minutes` each, then the side-by-side report."""
    started = time.time()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = [variant_named(n) for n in only] if only else list(VARIANTS)
    eval_device = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    rows = []
    for variant in variants:
        log.info("variant %s (%s) for %.1f min", variant.name, variant.why, minutes)
        report = run_variant(variant, config or DEFAULT_CONFIG, overrides, minutes, out_dir / variant.name, device)
        rows.append(summarize_variant(variant, out_dir / variant.name, report, eval_device, chrf_pairs))
        log.info("%s: %s", variant.name, {k: rows[-1][k] for k in ("updates", "final_losses", "p_at_1_best_layer")})
    result = {"minutes_per_variant": minutes, "variants": rows, "elapsed_s": round(time.time() - started, 1),
              "command": f"python -m experiments.objectives --minutes {minutes:g} --out {out_dir}"}
    result["plot"] = str(plot_comparison(rows, out_dir / "comparison.png"))
    atomic_write_text(out_dir / "report.json", json.dumps(result, indent=2) + "\n")
    return result
