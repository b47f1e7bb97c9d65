"""`python -m experiments.objectives`: MARGE, BART, VECO and a mixture on the same data for the same minutes
(experiments/objectives/README.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.command import run_study


def parser() -> argparse.ArgumentParser:
    q = argparse.ArgumentParser(prog="python -m experiments.objectives",
                                description="MARGE, BART, VECO and a mixture on the same data for the same minutes, "
                                              "side by side (single-process runs)")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock training minutes of each variant")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, comparison.png and one run per "
                                                           "variant (finished variants are kept on a second run)")
    q.add_argument("--config", type=Path, default=None, help="base config (default deploy/configs/learning.yaml)")
    q.add_argument("--only", default=None, help="comma-separated variants: marge, bart, veco, marge+bart")
    q.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("--chrf-pairs", type=int, default=8,
                   help="held-out pairs per direction (to/from en) translated for chrF (0: none)")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="applied to every variant")
    return q


def cmd_experiment_objectives(args: argparse.Namespace) -> int:
    from experiments.objectives.harness import run_objectives_experiment

    only = [name.strip() for name in args.only.split(",")] if args.only else None
    report = run_objectives_experiment(args.config, args.overrides, args.minutes, args.out, only, args.device,
                                       args.chrf_pairs)
    table = [{k: row[k] for k in ("variant", "parameters", "updates", "final_losses", "chrf_zero_shot_mean")}
             | {"p_at_1": round(row["p_at_1_best_layer"]["mean"], 4), "layer": row["p_at_1_best_layer"]["layer"]}
             for row in report["variants"]]
    print(json.dumps({"variants": table, "report": str(Path(args.out) / "report.json"), "plot": report["plot"]}))
    return 0


if __name__ == "__main__":
    sys.exit(run_study(parser(), cmd_experiment_objectives))
