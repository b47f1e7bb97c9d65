"""`python -m experiments.finetune`: MARGE vs BART vs random init, fine-tuned with the same budget on the demo tasks
(experiments/finetune/README.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.command import run_study


def parser() -> argparse.ArgumentParser:
    q = argparse.ArgumentParser(prog="python -m experiments.finetune",
                                description="the demo tasks fine-tuned from each checkpoint and from random init, "
                                            "one recipe and budget, scored on test")
    q.add_argument("--checkpoint", action="append", required=True, metavar="NAME=PATH",
                   help="a starting point (repeatable), e.g. marge=runs/.../step-00000600; random init takes the "
                        "first one's shape and tokenizer")
    q.add_argument("--tasks", type=Path, default=Path("data/demo/tasks"), help="the task set (`marge prepare-tasks`)")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json (finished systems are kept)")
    q.add_argument("--work", type=Path, default=Path("runs/finetune"), help="where the fine-tuned models go")
    q.add_argument("--only", default=None, help="comma-separated tasks: translation, pawsx")
    q.add_argument("--steps", action="append", default=[], metavar="TASK=N", help="override a task's update budget")
    q.add_argument("--eval-limit", type=int, default=None, help="score only the first N test examples")
    q.add_argument("--seed", type=int, default=0)
    return q


def named_paths(values: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag} {value!r}: expected NAME=PATH")
        out[name] = Path(path)
    return out


def cmd_experiment_finetune(args: argparse.Namespace) -> int:
    from experiments.finetune.harness import run_finetune_experiment

    steps = {name: int(value) for name, value in (s.split("=", 1) for s in args.steps)}
    report = run_finetune_experiment(named_paths(args.checkpoint, "--checkpoint"), args.tasks, args.out, args.work,
                                     args.seed, args.only.split(",") if args.only else None, args.eval_limit, steps)
    table = [{"system": r["system"], "task": r["task"], "updates": r["updates"],
              **{k: round(v, 4) for k, v in r["test"].items() if k in ("accuracy", "macro_f1", "bleu", "chrf")},
              **({"zero_shot_accuracy_mean": round(r["zero_shot_accuracy_mean"], 4)}
                 if r.get("zero_shot_accuracy_mean") is not None else {})} for r in report["rows"]]
    print(json.dumps({"rows": table, "report": str(Path(args.out) / "report.json")}))
    return 0


if __name__ == "__main__":
    sys.exit(run_study(parser(), cmd_experiment_finetune))
