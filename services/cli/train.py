"""`marge pretrain`, `marge finetune`, `marge report`, `marge plan` and `marge config reference`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.finetune.options import FREEZE_HELP


def add_pretrain(sub) -> None:
    p = sub.add_parser("pretrain", help="run MARGE pre-training on Ray (indexer -> batcher -> Redis -> DDP trainers)")
    p.add_argument("--config", type=Path, default=Path("deploy/configs/tiny.yaml"),
                   help="pipeline config (default deploy/configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="config overrides, e.g. run.max_steps=200")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (the file, the overrides and every default) as YAML and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything that can be checked without starting Ray or Redis (config, resources, "
                        "resume, corpus, probes, model, capacity plan), print it as JSON and exit")
    p.add_argument("--single-process", action="store_true",
                   help="run the indexer, batcher and trainer cores in this process (no Ray, Redis or FAISS; exact "
                        "neighbours by a matrix product, batches in memory) to run.max_steps, in run.dir; run again "
                        "to resume. Needs held-out pairs (the corpus's held-out split or data.heldout_pairs): it "
                        "reports P@1 against the untrained model")
    p.add_argument("--device", default="auto", help="--single-process: auto (CUDA when present), cpu or cuda[:N]")
    p.add_argument("--reuse-folder", action="store_true",
                   help="run in a run.dir that holds the other mode's run (on Ray, or --single-process), over its "
                        "files; without it such a folder is refused")
    p.set_defaults(func=cmd_pretrain)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from services.driver.config import for_command_line_corpus, load_config

    cfg = for_command_line_corpus(load_config(args.config, args.overrides), args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_saved_dict(), sort_keys=False), end="", flush=True)
        return 0
    if args.dry_run:
        from services.driver.pipeline import dry_run

        print(json.dumps(dry_run(cfg, args.reuse_folder), indent=2, default=str), flush=True)
        return 0
    if args.single_process:
        from services.driver.single_process import pretrain_single_process

        report = pretrain_single_process(cfg, args.device, args.reuse_folder)
        print(json.dumps({key: report[key] for key in ("pipeline", "g_health", "checkpoint", "curves") if key in report}
                         | {"report": str(Path(cfg.run.dir).resolve() / "report.json")}, default=str), flush=True)
        return 0
    if args.device != "auto":
        raise ValueError("--device belongs to --single-process runs (a pipeline run places its stages with "
                         "trainer.use_gpu and indexer.use_gpu)")
    from services.driver.pipeline import run_pipeline

    summary = run_pipeline(cfg, args.reuse_folder)
    print(json.dumps(summary), flush=True)
    return 0


def add_finetune(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a checkpoint on a generation or classification task (JSONL)")
    p.add_argument("--task", required=True, choices=["generation", "classification"],
                   help="generation: {source, target, target_language}; classification: {text, text_pair?, label}")
    p.add_argument("--checkpoint", required=True, help="a pre-training checkpoint (`checkpoint` in marge pretrain's "
                                                       "summary) or a fine-tuned model folder")
    p.add_argument("--random-init", action="store_true", help="random weights of the checkpoint's shape (the baseline)")
    p.add_argument("--train", required=True, help="training JSONL")
    p.add_argument("--valid", default=None, help="validation JSONL: early stopping and the best model")
    p.add_argument("--out", required=True, help="the model folder to write (safetensors, configs, tokenizer, metrics)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, default=None, help="optimizer updates")
    budget.add_argument("--epochs", type=float, default=None, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=16, help="examples per update, over all workers")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default 6%% of the updates), then "
                                                                   "linear decay to 0")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--freeze", action="append", metavar="WHAT", help=FREEZE_HELP)
    p.add_argument("--eval-every", type=int, default=None, help="validate every N updates (default: 10 times a run)")
    p.add_argument("--metric", default=None, help="validation metric to stop on: chrf, bleu or loss (generation); "
                                                  "accuracy, macro_f1 or loss (classification)")
    p.add_argument("--patience", type=int, default=3, help="stop after N evaluations without improvement (0: never)")
    p.add_argument("--valid-limit", type=int, default=64, help="validate on the first N examples (0: all)")
    p.add_argument("--classifier-dropout", type=float, default=0.1)
    p.add_argument("--pair-input", default="both", choices=["both", "split"],
                   help="classification pairs: both (the paper's: the joined pair into encoder and decoder) or split "
                        "(text into the encoder, pair into the decoder, as MARGE pre-trains)")
    p.add_argument("--workers", type=int, default=1, help="DDP ranks on Ray Train (1: this process, no Ray)")
    p.add_argument("--address", default=None, help="Ray cluster for --workers > 1 (default: a local Ray)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_finetune)


def cmd_finetune(args: argparse.Namespace) -> int:
    from services.finetune.options import parse_freeze
    from services.finetune.run import FinetuneConfig, run_finetune

    embeddings, layers, local = parse_freeze(args.freeze)
    cfg = FinetuneConfig(
        task=args.task, train=args.train, valid=args.valid, out=args.out, checkpoint=args.checkpoint,
        random_init=args.random_init, steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, clip_norm=args.clip_norm,
        freeze_embeddings=embeddings, freeze_decoder_layers=layers,
        freeze_local_decoder_layers=local, eval_every=args.eval_every, metric=args.metric,
        patience=args.patience, valid_limit=args.valid_limit or None, classifier_dropout=args.classifier_dropout,
        pair_input=args.pair_input, workers=args.workers, ray_address=args.address, seed=args.seed,
        torch_threads=args.torch_threads, overwrite=args.overwrite)
    summary = run_finetune(cfg)
    best = summary.get("best")
    print(f"fine-tuned {summary['steps']} updates in {summary['seconds']:.0f} s -> {summary['out']}"
          + (f"; best validation {summary['metric']} {best[summary['metric']]:.4f} at update {best['step']}"
             if best else ""), file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("train_loss", "evaluations", "frozen_parameters")}),
          flush=True)
    return 0


def add_report(sub) -> None:
    p = sub.add_parser("report", help="link matrix (paper Fig. 2) and learning curves of a run")
    p.add_argument("--run", required=True, help="run directory of `marge pretrain`")
    p.add_argument("--out", required=True, help="folder for link_matrix.{csv,png}, curves.png, report.json")
    p.add_argument("--pairs", default=None, help="held-out pairs TSV for P@1 per snapshot (default: the run's)")
    p.add_argument("--checkpoint", default=None, help="build the link matrix from this checkpoint's own index")
    p.add_argument("--max-snapshots", type=int, default=8)
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from services.ops.report import make_report

    print(json.dumps(make_report(Path(args.run), Path(args.out), args.pairs, args.checkpoint, args.max_snapshots)))
    return 0


def add_config(sub) -> None:
    p = sub.add_parser("config", help="the configuration: `reference` prints every section and field")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    q = config_sub.add_parser("reference", help="every config key with its type, default, the paper's value and "
                                                "its documentation, as Markdown (docs/configuration.md)")
    q.add_argument("--out", default=None, help="write it here instead of printing it")
    q.set_defaults(func=cmd_config_reference)


def cmd_config_reference(args: argparse.Namespace) -> int:
    from services.ops.config_reference import reference

    text = reference()
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="capacity model: does the indexer pool keep up with the trainers?")
    p.add_argument("--config", type=Path, default=Path("deploy/configs/tiny.yaml"))
    p.add_argument("--measured", type=Path, default=None,
                   help="throughput measured by `marge plan --measure` (default: a quick matrix-product estimate)")
    p.add_argument("--measure", action="store_true",
                   help="measure one indexer and one trainer worker on this machine (needs the prepared corpus)")
    p.add_argument("--device", default="cpu", help="--measure: cpu or cuda")
    p.add_argument("--out", default=None, help="--measure: write the measurements here")
    p.add_argument("--documents", type=int, default=None, help="corpus size when it is not prepared here")
    p.add_argument("--document-tokens", type=float, default=400.0, help="mean tokens per document (with --documents)")
    p.add_argument("--languages", type=int, default=26, help="languages in the corpus (with --documents)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from services.driver.config import load_config
    from services.driver.plan import describe, measure_prepared, plan_run

    cfg = load_config(args.config, args.overrides)
    if args.measure:
        text = json.dumps(measure_prepared(cfg, args.device), indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(text)
        return 0
    plan = plan_run(cfg, args.documents, args.document_tokens, args.languages, args.measured)
    if args.json:
        print(json.dumps(plan))
    else:
        for line in describe(plan, cfg):
            print(line)
    return 0
