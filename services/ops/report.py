"""What the retriever learned, as in the paper's Figure 2, and how training went.

* link matrix: for an index, the share of a target language's kept links that point into each evidence
  language (rows sum to 1), written as CSV and a PNG heat map;
* learning curves: loss and beta per step from the run's train log, and held-out retrieval P@1 of
  every snapshot (mean over language pairs), as PNG;
* refresh cost (`marge.eval.refresh`): build seconds, updates trained while building and staleness at first use
  per index version.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np

from marge.contracts.paths import INDEX, SNAPSHOTS
from marge.contracts.train_log import TrainLog
from marge.eval.curves import ema, plot_curves
from marge.eval.refresh import RefreshCost, read_builds
from marge.util.progress import track
from services.driver.language_links import cut_off_languages, describe_cut_off, language_link_balance

log = logging.getLogger(__name__)


def link_matrix(graph_target_langs: list[str], graph_evidence_langs: list[str],
                languages: list[str] | None = None) -> tuple[list[str], np.ndarray]:
    """Row = target language, column = evidence language, share of the row's links (a language with no
    link at all keeps an all-zero row: starvation stays visible)."""
    langs = sorted(set(languages or []) | set(graph_target_langs) | set(graph_evidence_langs))
    pos = {lang: i for i, lang in enumerate(langs)}
    counts = np.zeros((len(langs), len(langs)), dtype=np.float64)
    for t, e in zip(graph_target_langs, graph_evidence_langs):
        counts[pos[t], pos[e]] += 1
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    return langs, shares


def write_link_matrix(langs: list[str], shares: np.ndarray, out_dir: Path, title: str) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "link_matrix.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["target_lang", *langs])
        for lang, row in zip(langs, shares):
            writer.writerow([lang, *[f"{x:.4f}" for x in row]])
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(langs), 0.8 + 0.6 * len(langs)))
    image = ax.imshow(shares, cmap="viridis", vmin=0, vmax=max(0.01, float(shares.max())))
    ax.set_xticks(range(len(langs)), langs)
    ax.set_yticks(range(len(langs)), langs)
    ax.set_xlabel("language of the retrieved evidence")
    ax.set_ylabel("language of the target")
    for i in range(len(langs)):
        for j in range(len(langs)):
            ax.text(j, i, f"{100 * shares[i, j]:.0f}", ha="center", va="center",
                    color="white" if shares[i, j] < 0.6 * shares.max() else "black", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, label="share of the row's links")
    fig.tight_layout()
    png_path = out_dir / "link_matrix.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return {"csv": csv_path, "png": png_path}


def snapshot_curve(run_dir: Path, pairs_path: Path, corpus_dir: Path, max_snapshots: int) -> list[dict]:
    """Held-out retrieval P@1 of each snapshot's g, searched as the index searches it (`unit_relevance`)."""
    from marge.contracts.tokenizer import MargeTokenizer
    from marge.eval.evaluation import evaluate_model, mean_score, read_pairs
    from marge.model.snapshot import load_relevance_encoder, read_snapshot

    snapshots = sorted(p for p in (Path(run_dir) / SNAPSHOTS).glob("step-*") if (p / "manifest.json").exists())
    if len(snapshots) > max_snapshots:  # evenly spaced, always the first and the last
        keep = np.unique(np.linspace(0, len(snapshots) - 1, max_snapshots).round().astype(int))
        snapshots = [snapshots[i] for i in keep]
    tokenizer = MargeTokenizer.load(corpus_dir)
    pairs = read_pairs(pairs_path, tokenizer.languages)
    curve = []
    for path in track(snapshots, "P@1 of the snapshots", unit="snapshot"):
        info = read_snapshot(path)
        results = evaluate_model(load_relevance_encoder(info), tokenizer, pairs, layer="g")
        curve.append({"step": info.step, "p_at_1_mean": mean_score(results), "p_at_1": results})
    return curve


def make_report(run_dir: Path, out_dir: Path, pairs: str | None = None, checkpoint: str | None = None,
                max_snapshots: int = 8) -> dict:
    """Link matrix (CSV + PNG), learning curves (PNG) and their numbers (report.json) for a run."""
    import tempfile

    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import latest_version
    from services.driver.config import load_config

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = load_config(run_dir / "config.yaml")  # the run's own settings, every field of them
    corpus = Corpus.open(cfg.data.corpus)
    lang_of: dict[str, str] = {}
    for s in range(corpus.num_shards):
        table = corpus.read_table(s).select(["doc_id", "lang"])
        lang_of.update(zip(table.column("doc_id").to_pylist(), table.column("lang").to_pylist()))
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint:
            from marge.model.network import Marge, RelevanceEncoder
            from marge.model.restore import load_model
            from services.indexer.core import index_corpus

            model = load_model(Path(checkpoint))
            if not isinstance(model, Marge):
                raise ValueError(f"{checkpoint}: a {type(model).__name__} checkpoint; the index holds a MARGE model's g")
            encoder = RelevanceEncoder.from_model(model)
            index = index_corpus(corpus, encoder.eval(), corpus.tokenizer().specials, Path(tmp), 0, -1, cfg.indexer,
                                 seed=cfg.run.seed)
            source = f"index of checkpoint {checkpoint}"
        else:
            index = latest_version(run_dir / INDEX)
            if index is None:
                raise FileNotFoundError(f"{run_dir / 'index'} has no committed index; pass --checkpoint to build one")
            source = f"index v{index.version} (snapshot step {index.snapshot_step})"
        graph = index.read_graph()
        t_langs = [lang_of[d] for d in graph.column("target_id").to_pylist()]
        e_langs = [lang_of[d] for d in graph.column("evidence_id").to_pylist()]
    langs, shares = link_matrix(t_langs, e_langs, corpus.languages)
    pair_counts: dict[tuple[str, str], int] = {}
    for pair in zip(t_langs, e_langs):
        pair_counts[pair] = pair_counts.get(pair, 0) + 1
    balance = language_link_balance(pair_counts, corpus.manifest["languages"])
    cut = cut_off_languages(balance)
    lexical = not checkpoint and cfg.indexer.link_source(index.snapshot_step)[0] in ("tfidf", "hybrid")
    cut_off_warning = describe_cut_off(cut, source, lexical, cfg.indexer)
    if cut_off_warning:
        log.warning("%s", cut_off_warning)
    files = {k: str(v) for k, v in write_link_matrix(langs, shares, out_dir, f"retrieved links by language: {source}").items()}

    builds = read_builds(run_dir)
    cost = RefreshCost(builds)
    steps, losses, betas = [], [], []  # three numbers an update, the records themselves streamed past
    for record in TrainLog.of_run(run_dir).iter_records():
        cost.add(record)
        steps.append(record.step)
        losses.append(record.loss)
        betas.append(float(np.mean(record.beta)) if record.beta else None)  # a VECO model has no beta
    pairs_path = pairs or cfg.data.heldout_pairs or corpus.heldout_file("pairs")  # the corpus's own held-out split
    curve = snapshot_curve(run_dir, Path(pairs_path), Path(cfg.data.corpus), max_snapshots) if pairs_path else []
    panels = [
        {"title": "training loss (nats/token)", "ylabel": "loss",
         "series": [{"label": "per step", "x": steps, "y": losses, "style": "-", "color": "0.75"},
                    {"label": "EMA 0.1", "x": steps, "y": ema(losses), "style": "-", "color": "C0"}]},
        {"title": "relevance bias weight beta", "ylabel": "beta", "series": [{"label": "", "x": steps, "y": betas}]},
        {"title": "held-out retrieval P@1 of snapshots (mean over pairs)", "ylabel": "P@1",
         "series": [{"label": "snapshot g", "x": [c["step"] for c in curve], "y": [c["p_at_1_mean"] for c in curve],
                     "style": "o-"}]},
    ]
    refresh = cost.result()
    versions = refresh["per_version"]
    link_precision = [{"version": b["version"], "same_page": b.get("crosslingual_link_precision"),
                       "aligned": b.get("crosslingual_parallel_precision"), "link_sources": b.get("link_sources")}
                      for b in builds]
    if versions:  # runs with an index: what each refresh cost the trainers
        x = [v["version"] for v in versions]
        panels.append(
            {"title": "cross-lingual links joining ...", "ylabel": "share of links", "xlabel": "index version",
             "series": [{"label": "the same page", "x": [p["version"] for p in link_precision],
                         "y": [p["same_page"] for p in link_precision], "style": "s-"},
                        *([{"label": "aligned translations", "x": [p["version"] for p in link_precision],
                            "y": [p["aligned"] for p in link_precision], "style": "o-"}]
                          if any(p["aligned"] is not None for p in link_precision) else [])]})
        panels += [
            {"title": "index build seconds per version", "ylabel": "seconds", "xlabel": "index version",
             "series": [{"label": "", "x": x, "y": [v["build_seconds"] for v in versions], "style": "o-"}]},
            {"title": "updates while building / staleness at first use", "ylabel": "updates", "xlabel": "index version",
             "series": [{"label": "trained while building", "x": x, "y": [v["steps_during_build"] for v in versions],
                         "style": "o-"},
                        {"label": "staleness at first use", "x": x,
                         "y": [v["staleness_at_first_use"] for v in versions], "style": "s--"}]},
        ]
    files["curves"] = str(plot_curves(panels, out_dir / "curves.png", f"run {run_dir.name}"))
    report = {"source": source, "languages": langs, "link_matrix": shares.round(4).tolist(),
              "crosslingual_share": float(len([1 for a, b in zip(t_langs, e_langs) if a != b]) / max(1, len(t_langs))),
              "languages_without_links": [lang for lang, row in zip(langs, shares) if row.sum() == 0],
              "language_links": balance, "languages_cut_off": cut, "languages_cut_off_warning": cut_off_warning,
              "steps": steps[-1] if steps else 0, "loss_last": losses[-1] if losses else None,
              "snapshot_p_at_1": curve, "link_precision": link_precision, "refresh": refresh, "files": files}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
