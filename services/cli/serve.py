"""`marge serve`: the retrieval service over a run's newest index."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from services.retrieval.settings import ServeSettings

SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeSettings)}


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="the retrieval service (FastAPI on uvicorn) over a run's newest index")
    p.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain` (its index/ is served)")
    p.add_argument("--corpus", default=None, help="prepared corpus (default: the run's data.corpus)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-file", default=None, help="file with the bearer token (or set MARGE_API_TOKEN)")
    p.add_argument("--max-k", type=int, default=SERVE_DEFAULTS["max_k"])
    p.add_argument("--max-query-chars", type=int, default=SERVE_DEFAULTS["max_query_chars"])
    p.add_argument("--max-body-bytes", type=int, default=SERVE_DEFAULTS["max_body_bytes"])
    p.add_argument("--max-in-flight", type=int, default=SERVE_DEFAULTS["max_in_flight"])
    p.add_argument("--poll-s", type=float, default=SERVE_DEFAULTS["poll_s"], help="how often to look for a newer index version")
    p.add_argument("--index-type", choices=["auto", "flat", "hnsw"], default=SERVE_DEFAULTS["index_type"],
                   help="exact search ('flat'), HNSW ('hnsw', its recall@10 against exact search is measured when a "
                        "version loads), or 'auto': flat up to --flat-max-documents, HNSW above")
    p.add_argument("--flat-max-documents", type=int, default=SERVE_DEFAULTS["flat_max_documents"])
    p.add_argument("--hnsw-m", type=int, default=SERVE_DEFAULTS["hnsw_m"])
    p.add_argument("--hnsw-ef-search", type=int, default=SERVE_DEFAULTS["hnsw_ef_search"])
    p.add_argument("--text-cache-mb", type=float, default=SERVE_DEFAULTS["text_cache_mb"],
                   help="memory for recently read corpus shards' text (hits are described from the Parquet shards)")
    p.add_argument("--full-corpus", action="store_true",
                   help="serve the newest serving index of the whole corpus (`marge index build`: RUN/serving) "
                        "instead of the run's newest training index version (which may hold a sample of the shards)")
    p.add_argument("--verify-corpus", action="store_true",
                   help="hash every corpus shard against its manifest at start (by default each shard's document "
                        "count is checked against the manifest, which reads no document text)")
    p.add_argument("--tls-cert", default=None, type=Path, help="serve HTTPS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", default=None, type=Path, help="the certificate's private key (PEM)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    p.set_defaults(func=cmd_serve)


def run_config(run_dir: Path) -> dict:
    """The resolved config a `marge pretrain` run saved in its directory."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --run must be a directory written by `marge pretrain`")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def check_servable(run_dir: Path) -> None:
    """A run whose newest index version has no FAISS files (a single-process run searches in torch and keeps only
    link graphs) cannot be served: said in one line before the server starts, not from inside it."""
    from marge.contracts.index_store import latest_version

    newest = latest_version(run_dir / "index")
    if newest is not None and any(entry.get("index_file") is None for entry in newest.shards):
        raise ValueError(f"{run_dir} was trained single-process (`marge pretrain --single-process`): its index versions "
                         "hold link graphs but no FAISS index to serve. Build a serving index of the whole corpus "
                         f"(`marge index build --run {run_dir}`) and serve it with --full-corpus")


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from services.retrieval.app import create_app
    from services.retrieval.exposure import check_bind

    token = os.environ.get("MARGE_API_TOKEN")
    if args.token_file:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty: write the bearer token into it (e.g. "
                             "`python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`)")
    check_bind(args.host, token, args.insecure, token_hint="set MARGE_API_TOKEN or --token-file",
               insecure_hint="pass --insecure")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both for HTTPS, or neither")
    for name, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"{name} {path} does not exist")
    corpus = args.corpus or run_config(Path(args.run))["data"]["corpus"]
    if not args.full_corpus:
        check_servable(Path(args.run))
    settings = ServeSettings(run_dir=Path(args.run), corpus_dir=Path(corpus), token=token or None, max_k=args.max_k,
                             max_query_chars=args.max_query_chars, max_body_bytes=args.max_body_bytes,
                             max_in_flight=args.max_in_flight, poll_s=args.poll_s, index_type=args.index_type,
                             flat_max_documents=args.flat_max_documents, hnsw_m=args.hnsw_m,
                             hnsw_ef_search=args.hnsw_ef_search, text_cache_mb=args.text_cache_mb,
                             verify_corpus=args.verify_corpus, full_corpus=args.full_corpus)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info",
                limit_concurrency=4 * args.max_in_flight,
                ssl_certfile=None if args.tls_cert is None else str(args.tls_cert),
                ssl_keyfile=None if args.tls_key is None else str(args.tls_key))
    return 0


def add_index(sub) -> None:
    p = sub.add_parser("index", help="serving indexes of the whole corpus (`marge serve --full-corpus` serves them)")
    index_sub = p.add_subparsers(dest="index_command", required=True)
    q = index_sub.add_parser("build", help="embed every corpus document with a run's snapshot into a compressed "
                                           "FAISS index (IVF, 8-bit scalar or product quantisation) under RUN/serving")
    q.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain` (its snapshots/)")
    q.add_argument("--corpus", default=None, help="prepared corpus (default: the run's data.corpus)")
    q.add_argument("--snapshot-step", type=int, default=None, help="the snapshot to embed with (default: the newest)")
    q.add_argument("--codec", choices=("sq8", "pq"), default="sq8",
                   help="sq8: d bytes a document, recall close to exact; pq: d/4 bytes, lower recall")
    q.add_argument("--nlist", type=int, default=None, help="inverted lists (default about 4 x sqrt(documents))")
    q.add_argument("--target-recall", type=float, default=0.95,
                   help="recall@10 against exact search the chosen nprobe must reach (measured at build)")
    q.add_argument("--device", default="cpu", help="cpu or cuda, for embedding (with --engine ray: a GPU a task)")
    q.add_argument("--engine", choices=("auto", "local", "ray"), default="auto",
                   help="local: this process embeds every shard; ray: Ray tasks embed groups of shards in parallel "
                        "(the cluster at --address or RAY_ADDRESS, else a local Ray with --workers CPUs) and the parts "
                        "are merged into the same index; auto (default): ray when --address or RAY_ADDRESS names a "
                        "cluster, else local")
    q.add_argument("--workers", type=int, default=None,
                   help="Ray tasks at once (default: the cluster's CPUs; a local Ray's: this machine's cores)")
    q.add_argument("--address", default=None, help="the Ray cluster (HOST:PORT) for --engine ray/auto; the run folder "
                                                   "must be on storage every node reaches")
    q.set_defaults(func=cmd_index_build)


def index_engine(engine: str, address: str | None) -> str:
    """`marge index build --engine auto`: Ray where a cluster is named, this process otherwise."""
    import os

    if engine != "auto":
        return engine
    return "ray" if address or os.environ.get("RAY_ADDRESS") else "local"


def cmd_index_build(args: argparse.Namespace) -> int:
    import json

    from marge.contracts.corpus import Corpus
    from marge.model.snapshot import latest_snapshot, read_snapshot, snapshot_dirname
    from services.retrieval.serving_index import (
        BuildOptions,
        build_serving_index,
        build_serving_index_ray,
        ray_for_index_build,
        read_build,
    )

    corpus = Corpus.open(args.corpus or run_config(args.run)["data"]["corpus"], verify_checksums=False)
    if args.snapshot_step is None:
        snapshot = latest_snapshot(args.run / "snapshots")
        if snapshot is None:
            raise FileNotFoundError(f"{args.run / 'snapshots'} holds no snapshot: train first (`marge pretrain`)")
    else:
        snapshot = read_snapshot(args.run / "snapshots" / snapshot_dirname(args.snapshot_step))
    from services.cli import exit_cleanly_on_sigterm

    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be positive, got {args.workers}")
    exit_cleanly_on_sigterm()  # a SIGTERM runs the `finally` blocks: the scratch folders go, a local Ray stops
    opts = BuildOptions(codec=args.codec, nlist=args.nlist, target_recall=args.target_recall, device=args.device)
    if index_engine(args.engine, args.address) == "ray":
        with ray_for_index_build(args.address, args.workers) as workers:
            path = build_serving_index_ray(args.run, corpus, snapshot, opts, workers=workers)
    else:
        path = build_serving_index(args.run, corpus, snapshot, opts)
    manifest = read_build(path, verify=False)
    print(json.dumps({"path": str(path), **{k: manifest[k] for k in (
        "build", "snapshot_step", "factory", "nprobe", "documents", "recall_at_10", "index_bytes", "vector_bytes",
        "engine", "build_seconds")}}))
    return 0
