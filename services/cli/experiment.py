"""`marge experiment learning | objectives | ceiling | mechanism | finetune`: the studies, each run by its driver
module (imported when the command runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_experiment(sub) -> None:
    p = sub.add_parser("experiment", help="experiments: `learning` (does the retrieval loop learn?), `objectives` "
                                          "(MARGE vs BART vs VECO), `ceiling` (gold evidence against alignment-built "
                                          "indexes), `mechanism` (does reconstruction teach g through beta * f?), "
                                          "`finetune` (downstream tasks)")
    exp_sub = p.add_subparsers(dest="experiment", required=True)
    q = exp_sub.add_parser("learning", help="run the pipeline N minutes and measure what it learned, next to baselines")
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
    q.set_defaults(func=cmd_experiment_learning)
    q = exp_sub.add_parser("objectives", help="MARGE, BART, VECO and a mixture on the same data for the same minutes, "
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
    q.set_defaults(func=cmd_experiment_objectives)
    q = exp_sub.add_parser("ceiling", help="the recipe's gold-evidence gain against indexes built from alignment labels, "
                                           "a random-init first index and a frozen TF-IDF index, equal minutes each "
                                           "(single-process runs)")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock training minutes of each arm (0: report only)")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, curves.png, the sweep and one run "
                                                           "per arm (finished arms are kept: run it again to resume)")
    q.add_argument("--config", type=Path, default=None, help="base config (default deploy/configs/learning.yaml)")
    q.add_argument("--arms", default=None, help="comma-separated: aligned_translations, recipe, recipe_random_index, "
                                                "recipe_tfidf_frozen, aligned_supervised")
    q.add_argument("--sweep-minutes", type=float, default=0.0,
                   help="first run the aligned_translations arm at each width for this many minutes and use the best "
                        "width")
    q.add_argument("--sizes", default=None, help="widths of the sweep (default d64,d128,d192)")
    q.add_argument("--size", default=None, help="use this width (d64, d128, d192) instead of the sweep's choice")
    q.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="applied to every arm")
    q.set_defaults(func=cmd_experiment_ceiling)
    q = exp_sub.add_parser("mechanism", help="does reconstruction teach g to retrieve through beta * f? Arms that differ "
                                             "in one ingredient (f detached, the auxiliary loss, the index), several "
                                             "seeds each at equal updates, held-out measures with CIs "
                                             "(experiments/mechanism)")
    from experiments.mechanism.__main__ import add_study_arguments

    add_study_arguments(q)
    q.set_defaults(func=cmd_experiment_mechanism)
    q = exp_sub.add_parser("finetune", help="the demo tasks fine-tuned from each checkpoint and from random init, "
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
    q.set_defaults(func=cmd_experiment_finetune)


def cmd_experiment_learning(args: argparse.Namespace) -> int:
    if args.single_process:
        from experiments.learning.single_process import run_single_process

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


def cmd_experiment_mechanism(args: argparse.Namespace) -> int:
    from experiments.mechanism.__main__ import run_from_args

    report = run_from_args(args)
    print(json.dumps({"contrasts": {k: {f: v[f] for f in ("delta", "ci95", "ci95_seeds_t", "shown")}
                                    for k, v in report.get("contrasts", {}).items()},
                      "targets": report.get("targets"), "report": str(Path(args.out) / "report.json")}))
    return 0


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
