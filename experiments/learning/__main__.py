"""`python -m experiments.learning`: does the retrieval loop learn? One run (the Ray pipeline, or `--single-process`), every
comparison (experiments/learning/README.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.command import run_study


def parser() -> argparse.ArgumentParser:
    q = argparse.ArgumentParser(prog="python -m experiments.learning",
                                description="run the pipeline N minutes and measure what it learned, next to baselines")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock minutes of training")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, curves.png and the run")
    q.add_argument("--config", type=Path, default=None,
                   help="pipeline config (default deploy/configs/learning.yaml, the recipe)")
    q.add_argument("--single-process", action="store_true",
                   help="indexer, batcher and trainer cores in this process: no Ray, Redis or FAISS (one GPU, debugging)")
    q.add_argument("--resume", action="store_true",
                   help="--single-process: continue the run in --out for --minutes more (its own config)")
    q.add_argument("--device", default="auto", help="--single-process: auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE")
    return q


def cmd_experiment_learning(args: argparse.Namespace) -> int:
    if args.single_process:
        from services.driver.single_process import run_single_process

        report = run_single_process(args.config, args.overrides, args.minutes, args.out, args.resume, args.device)
    else:
        if args.resume or args.device != "auto":
            raise ValueError("--resume and --device belong to --single-process runs (a pipeline run resumes from its "
                             "checkpoint when submitted again with the same run.name and run.dir)")
        from experiments.learning.harness import main_experiment

        report = main_experiment(args.config or Path("deploy/configs/learning.yaml"), args.overrides, args.minutes,
                                 args.out)
    keys = ("evidence_gain", "p_at_1_mean", "targets", "checkpoint", "curves")
    print(json.dumps({k: report[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(run_study(parser(), cmd_experiment_learning))
