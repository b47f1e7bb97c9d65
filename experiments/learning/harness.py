"""`python -m experiments.learning`: does the retrieval loop learn? One command, one run, every comparison.

1. Baselines, measured in this run before training: held-out retrieval P@1 of the run's own initial
   (random) model at every encoder layer, 0 (the embeddings) to the last, keeping the best per
   language pair ("the best random-init representation"); the char n-gram TF-IDF baseline; the probe
   health of the initial model.
2. The real pipeline (indexer, batcher, Redis, DDP trainers) for N wall-clock minutes.
3. Held-out P@1 of every checkpoint, so P@1 can be followed over time, next to the baselines.
4. DIR/report.json and DIR/curves.png: loss, evidence gain, relevance cosines and spread of g, beta,
   index link precision, and P@1 over time.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from marge.contracts.train_log import read_train_log
from marge.eval.evaluation import read_pairs
from marge.model.checkpoint import checkpoint_order, complete_checkpoints, load_model_weights
from marge.model.restore import load_model
from services.driver.config import PipelineConfig, load_config, with_absolute_paths
from services.driver.learning_report import (
    FinalModel,
    RunAccount,
    assemble_report,
    build_run_probe,
    checkpoint_evaluation,
    heldout_pairs_path,
    measure_baselines,
)


def run_learning_experiment(cfg: PipelineConfig, minutes: float, out_dir: Path) -> dict:
    from services.driver.pipeline import ensure_corpus, run_pipeline, with_probes
    from services.trainer.init import ensure_initial_model

    started = time.time()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(out_dir / "run"), max_minutes=minutes))
    cfg = with_absolute_paths(cfg)
    corpus = ensure_corpus(cfg)
    cfg = with_probes(cfg, corpus)
    tokenizer = corpus.tokenizer()
    ensure_initial_model(cfg.model_config(vocab_size=tokenizer.vocab_size), cfg.paths(), corpus, cfg.run.seed)
    pairs = read_pairs(heldout_pairs_path(cfg), tokenizer.languages)
    probe = build_run_probe(cfg, tokenizer)

    # 1. baselines, same run, same data
    init_model = load_model_weights(cfg.paths().init_weights).eval()
    baselines = measure_baselines(init_model, tokenizer, pairs, probe)

    # 2. the real pipeline for N minutes
    summary = run_pipeline(cfg)

    # 3. P@1 of every checkpoint
    over_time = []
    checkpoints = complete_checkpoints(cfg.paths().checkpoints)
    model = None
    for path in checkpoints:
        model = load_model(path)
        over_time.append(checkpoint_evaluation(model, tokenizer, pairs, cfg.health.eval_layer, probe,
                                               checkpoint_order(path)[0]))
    run = RunAccount(read_train_log(Path(cfg.run.dir)), str(checkpoints[-1]) if checkpoints else None,
                     summary.get("index_builds", []), {k: v for k, v in summary.items() if k != "index_builds"},
                     minutes, time.time() - started)
    return assemble_report(baselines, over_time, FinalModel(model, tokenizer, pairs, cfg.health.eval_layer), run, cfg,
                           out_dir, extra={"mode": "pipeline"})


def main_experiment(config: Path | None, overrides: list[str], minutes: float, out: Path) -> dict:
    cfg = load_config(config, overrides)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return run_learning_experiment(cfg, minutes, out)
