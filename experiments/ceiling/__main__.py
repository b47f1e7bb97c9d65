"""`python -m experiments.ceiling`: the recipe's gold-evidence gain against indexes built from alignment labels
(experiments/ceiling/README.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.command import run_study


def parser() -> argparse.ArgumentParser:
    q = argparse.ArgumentParser(prog="python -m experiments.ceiling",
                                description="the recipe's gold-evidence gain against indexes built from alignment labels, "
                                           "a random-init first index and a frozen TF-IDF index, equal minutes each "
                                           "(single-process runs)")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock training minutes of each arm (0: report only)")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, curves.png, the sweep and one run "
                                                           "per arm (finished arms are kept: run it again to resume)")
    q.add_argument("--config", type=Path, default=None, help="base config (default experiments/configs/learning-2026-11-26.yaml)")
    q.add_argument("--arms", default=None, help="comma-separated: aligned_translations, recipe, recipe_random_index, "
                                                "recipe_tfidf_frozen, aligned_supervised")
    q.add_argument("--sweep-minutes", type=float, default=0.0,
                   help="first run the aligned_translations arm at each width for this many minutes and use the best "
                        "width")
    q.add_argument("--sizes", default=None, help="widths of the sweep (default d64,d128,d192)")
    q.add_argument("--size", default=None, help="use this width (d64, d128, d192) instead of the sweep's choice")
    q.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="applied to every arm")
    return q


def names(value: str | None) -> list[str] | None:
    """A comma-separated list (None when not given)."""
    return [n.strip() for n in value.split(",") if n.strip()] if value else None


def cmd_experiment_ceiling(args: argparse.Namespace) -> int:
    from experiments.ceiling.harness import run_ceiling

    report = run_ceiling(args.config, args.overrides, args.minutes, args.out, names(args.arms), args.sweep_minutes,
                         names(args.sizes), args.size, args.device)
    print(json.dumps({"size": report["size"], "headline_ratios": report["headline_ratios"], "targets": report["targets"],
                      "report": str(Path(args.out) / "report.json")}))
    return 0


if __name__ == "__main__":
    sys.exit(run_study(parser(), cmd_experiment_ceiling))
