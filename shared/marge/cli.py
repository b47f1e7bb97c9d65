"""The `marge` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from marge.utils import setup_logging

log = logging.getLogger("marge")


def cmd_prepare(args: argparse.Namespace) -> int:
    from marge.prepare import PrepareOptions, prepare

    opts = PrepareOptions(
        inputs=args.inputs, out=args.out, tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size,
        max_chunk_tokens=args.max_chunk_tokens, docs_per_shard=args.docs_per_shard, num_shards=args.num_shards,
        languages=tuple(args.languages.split(",")) if args.languages else None, lid=not args.no_lid,
        lid_threshold=args.lid_threshold, max_document_chars=args.max_document_chars,
        on_bad_document="skip" if args.skip_bad_documents else "error", seed=args.seed, overwrite=args.overwrite)
    manifest = prepare(opts)
    summary = {k: manifest[k] for k in ("num_documents", "num_shards", "num_groups", "num_tokens", "languages")}
    summary["out"] = str(args.out)
    print(json.dumps(summary))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from marge.model import build_on_meta, count_parameters, parameter_breakdown, preset

    overrides = dict(parse_override(o) for o in args.set or [])
    cfg = preset(args.preset, **overrides)
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


def cmd_pretrain(args: argparse.Namespace) -> int:
    from marge.config import load_config
    from marge.driver.pipeline import run_pipeline

    cfg = load_config(args.config, args.overrides)
    summary = run_pipeline(cfg)
    print(json.dumps(summary), flush=True)
    return 0


def parse_override(text: str) -> tuple[str, object]:
    """'key=value' with value parsed as YAML (numbers, booleans, lists)."""
    import yaml

    if "=" not in text:
        raise SystemExit(f"override {text!r} must look like key=value")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marge", description="MARGE pre-training pipeline")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="raw documents -> sharded Parquet corpus + tokenizer")
    p.add_argument("inputs", nargs="+", type=Path, help=".jsonl/.jsonl.gz files or folders laid out as <root>/<lang>/...")
    p.add_argument("--out", type=Path, required=True, help="output folder (written atomically)")
    p.add_argument("--tokenizer", type=Path, default=None, help="reuse the tokenizer in this folder instead of training one")
    p.add_argument("--vocab-size", type=int, default=16000, help="tokenizer vocabulary (default 16000; the paper: 250k)")
    p.add_argument("--max-chunk-tokens", type=int, default=512, help="tokens per document chunk, specials included (paper: 512)")
    p.add_argument("--docs-per-shard", type=int, default=512, help="target chunks per shard (default 512)")
    p.add_argument("--num-shards", type=int, default=None, help="exact number of shards (overrides --docs-per-shard)")
    p.add_argument("--languages", default=None, help="keep only these comma-separated ISO 639-1 languages")
    p.add_argument("--no-lid", action="store_true", help="trust the language labels; skip language identification")
    p.add_argument("--lid-threshold", type=float, default=0.5,
                   help="language ID confidence above which a contradicting label is an error (default 0.5)")
    p.add_argument("--max-document-chars", type=int, default=1_000_000, help="longest accepted document")
    p.add_argument("--skip-bad-documents", action="store_true", help="drop (and count) bad documents instead of stopping")
    p.add_argument("--seed", type=int, default=0, help="seed of the shard assignment")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("pretrain", help="run MARGE pre-training on Ray (indexer -> batcher -> Redis -> DDP trainers)")
    p.add_argument("--config", type=Path, default=Path("deploy/configs/tiny.yaml"),
                   help="pipeline config (default deploy/configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="config overrides, e.g. run.max_steps=200")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("info", help="a model preset's configuration and parameter count")
    p.add_argument("--preset", required=True, help="tiny, base or paper")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a model field (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # bad input or configuration: one clear line, no traceback (set MARGE_LOG_LEVEL=DEBUG for it)
        log.debug("error details", exc_info=True)
        print(f"marge {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
