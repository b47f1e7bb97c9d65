"""`python -m experiments.mechanism`: the study of what teaches g to retrieve.

    run       every arm on every seed to --updates (resumable), then the measures and the report
    run-one   one arm on one seed (what `run --jobs N` starts in each worker process)
    measure   the held-out measures of runs already trained (kept per checkpoint: a second call adds what is new)
    report    report.json and curves.png from the measured runs in --out
    tables    the report's tables in Markdown (what the study's README quotes)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    from experiments.mechanism.arms import ARM_NAMES

    p = argparse.ArgumentParser(prog="python -m experiments.mechanism", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_study_arguments(sub.add_parser("run", help="train every arm on every seed, measure, report"))
    q = sub.add_parser("run-one", help="one arm on one seed")
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--arm", required=True, choices=ARM_NAMES)
    q.add_argument("--seed", type=int, required=True)
    q.add_argument("--updates", type=int, required=True)
    q.add_argument("--config", type=Path, default=None)
    q.add_argument("--device", default="auto")
    q.add_argument("--measure", action="store_true", help="also measure the run once it is trained")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE")
    q = sub.add_parser("measure", help="held-out measures of the trained runs in --out")
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--device", default="auto")
    q = sub.add_parser("report", help="report.json and curves.png of the measured runs in --out")
    q.add_argument("--out", type=Path, required=True)
    q = sub.add_parser("tables", help="the tables of --out's report.json in Markdown")
    q.add_argument("--out", type=Path, required=True)
    return p


def add_study_arguments(q: argparse.ArgumentParser) -> None:
    from experiments.mechanism.arms import ARM_NAMES

    q.add_argument("--out", type=Path, required=True, help="folder of the study (finished runs are kept)")
    q.add_argument("--updates", type=int, default=1500, help="updates of every arm (equal updates, not minutes)")
    q.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (at least 3 for a CI)")
    q.add_argument("--arms", default=",".join(ARM_NAMES), help=f"comma-separated, from {', '.join(ARM_NAMES)}")
    q.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, each in its own process with cores/jobs threads (2 on a 2-core CPU "
                        "gives about 1.3x the throughput of 1 for the tiny model)")
    q.add_argument("--config", type=Path, default=None, help="base config (default experiments/configs/learning-2026-11-26.yaml)")
    q.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("--no-measure", action="store_true", help="train only")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="applied to every arm")


def run_from_args(args: argparse.Namespace) -> dict:
    from experiments.mechanism.harness import run_study

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    return run_study(args.config, arms, seeds, args.updates, args.out, args.jobs, args.device, tuple(args.overrides),
                     measure=not args.no_measure)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if args.command == "run-one":
        from experiments.mechanism.harness import main_run_one

        return main_run_one(args)
    if args.command == "tables":
        from experiments.mechanism.tables import print_tables

        print_tables(args.out)
        return 0
    if args.command == "run":
        report = run_from_args(args)
    elif args.command == "measure":
        from experiments.mechanism.measures import measure_study
        from experiments.mechanism.report import write_report

        measure_study(args.out, args.device)
        report = write_report(args.out)
    else:
        from experiments.mechanism.report import write_report

        report = write_report(args.out)
    print(json.dumps({"report": str(Path(args.out) / "report.json"), "contrasts": report.get("contrasts", {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
