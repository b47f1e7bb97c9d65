"""`marge prepare`, `marge prepare-tasks` and `marge info`: the corpus, the demo tasks, a model preset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from marge.contracts.tokenizer import DEFAULT_VOCAB_SIZE


def add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="raw documents -> sharded Parquet corpus + tokenizer")
    p.add_argument("inputs", nargs="+", type=Path, help=".jsonl/.jsonl.gz files or folders laid out as <root>/<lang>/...")
    p.add_argument("--out", type=Path, required=True, help="output folder (written atomically)")
    p.add_argument("--tokenizer", type=Path, default=None, help="reuse the tokenizer in this folder instead of training one")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"tokenizer vocabulary (default {DEFAULT_VOCAB_SIZE}, as data.vocab_size; the paper: 250k)")
    p.add_argument("--max-chunk-tokens", type=int, default=512, help="tokens per document chunk, specials included (paper: 512)")
    p.add_argument("--document-unit", choices=("chunk", "paragraph"), default="chunk",
                   help="chunk: paragraphs packed into documents of up to --max-chunk-tokens (the paper); paragraph: "
                        "every paragraph a document, cut at --max-chunk-tokens")
    p.add_argument("--min-document-tokens", type=int, default=1, help="drop documents with fewer text tokens")
    p.add_argument("--heldout-permille", type=int, default=0,
                   help="groups per 1000 held out of training for the runs' probes and P@1 (written to heldout/)")
    p.add_argument("--max-pairs-per-direction", type=int, default=1000,
                   help="held-out translation pairs kept per language pair (default 1000)")
    p.add_argument("--docs-per-shard", type=int, default=512, help="target chunks per shard (default 512)")
    p.add_argument("--num-shards", type=int, default=None, help="exact number of shards (overrides --docs-per-shard)")
    p.add_argument("--languages", default=None, help="keep only these comma-separated ISO 639-1 languages")
    p.add_argument("--no-lid", action="store_true", help="trust the language labels; skip language identification")
    p.add_argument("--lid-threshold", type=float, default=0.5,
                   help="language ID confidence above which a contradicting label is an error (default 0.5)")
    p.add_argument("--max-document-chars", type=int, default=1_000_000, help="longest accepted document")
    p.add_argument("--skip-bad-documents", action="store_true", help="drop (and count) bad documents instead of stopping")
    p.add_argument("--seed", type=int, default=0, help="seed of the shard assignment and of the tokenizer's sample")
    p.add_argument("--tokenizer-sample-lines", type=int, default=2_000_000,
                   help="lines the tokenizer is trained on, at most: an equal share per language, drawn at random "
                        "(default 2,000,000)")
    p.add_argument("--engine", choices=("auto", "local", "ray"), default="auto",
                   help="local: this process, the corpus in memory; ray: streamed through Ray Data (RAY_ADDRESS's "
                        "cluster, else a local Ray), memory bounded by a partition; auto: local up to 256 MiB of input")
    p.add_argument("--workers", type=int, default=None, help="Ray Data tasks per stage (default: the cluster's CPUs)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from services.prepare.options import PrepareOptions
    from services.prepare.run import prepare

    opts = PrepareOptions(
        inputs=args.inputs, out=args.out, tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size,
        max_chunk_tokens=args.max_chunk_tokens, document_unit=args.document_unit,
        min_document_tokens=args.min_document_tokens, docs_per_shard=args.docs_per_shard, num_shards=args.num_shards,
        heldout_permille=args.heldout_permille, max_pairs_per_direction=args.max_pairs_per_direction,
        languages=tuple(args.languages.split(",")) if args.languages else None, lid=not args.no_lid,
        lid_threshold=args.lid_threshold, max_document_chars=args.max_document_chars,
        on_bad_document="skip" if args.skip_bad_documents else "error", seed=args.seed, overwrite=args.overwrite,
        tokenizer_sample_lines=args.tokenizer_sample_lines, engine=args.engine, workers=args.workers)
    manifest = prepare(opts)
    summary = {k: manifest[k] for k in ("num_documents", "num_shards", "num_groups", "num_tokens", "languages")}
    if manifest.get("heldout"):
        summary["heldout"] = {k: manifest["heldout"][k] for k in ("groups", "documents", "pairs")}
    summary["engine"] = manifest["engine"]["name"]
    summary["out"] = str(args.out)
    print(json.dumps(summary))
    return 0


def add_prepare_tasks(sub) -> None:
    p = sub.add_parser("prepare-tasks", help="build the demo fine-tuning tasks (translation, PAWS-X-like pairs) from "
                                             "the bundled corpus")
    p.add_argument("--corpus", default="data/demo/libreoffice-help", help="the demo corpus folder")
    p.add_argument("--out", default="data/demo/tasks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_prepare_tasks)


def cmd_prepare_tasks(args: argparse.Namespace) -> int:
    from services.prepare.demo_tasks import DemoTasksOptions, build_demo_tasks

    info = build_demo_tasks(DemoTasksOptions(corpus=Path(args.corpus), out=Path(args.out), seed=args.seed,
                                             overwrite=args.overwrite))
    print(json.dumps({"out": str(args.out), "counts": info.get("counts")}))
    return 0


def add_info(sub) -> None:
    p = sub.add_parser("info", help="a model preset's configuration and parameter count")
    p.add_argument("--preset", required=True, help="tiny, base or paper")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a model field (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    import dataclasses

    from marge.contracts.config import parse_overrides
    from marge.model.architecture import MargeConfig, preset
    from marge.model.sizes import build_on_meta, count_parameters, parameter_breakdown

    overrides = dict(parse_overrides(args.set or [], form="key=value"))
    try:
        cfg = preset(args.preset, **overrides)
    except TypeError as e:  # an unknown field: name it with the ones there are
        known = sorted(f.name for f in dataclasses.fields(MargeConfig))
        raise ValueError(f"--set {', '.join(sorted(overrides))}: {e}; the fields are {known}") from None
    model = build_on_meta(cfg)
    info = {"preset": args.preset, "num_parameters": count_parameters(model),
            "parameters_by_part": parameter_breakdown(model), "config": cfg.to_dict()}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"preset {args.preset}: {info['num_parameters']:,} parameters ({info['num_parameters'] / 1e6:.1f}M)")
        for part, n in info["parameters_by_part"].items():
            print(f"  {part:<14} {n:>14,}")
        for key, value in info["config"].items():
            print(f"  {key} = {value}")
    return 0
