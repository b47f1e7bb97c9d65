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
    from marge.index_store import latest_version

    newest = latest_version(run_dir / "index")
    if newest is not None and any(entry.get("index_file") is None for entry in newest.shards):
        raise ValueError(f"{run_dir} was trained single-process (`marge pretrain --single-process`): its index versions "
                         "hold link graphs but no FAISS index to serve. Serve a run of the pipeline (`marge pretrain` "
                         "without --single-process), whose index versions the service loads")


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from services.retrieval.app import create_app, is_loopback

    token = os.environ.get("MARGE_API_TOKEN")
    if args.token_file:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty: write the bearer token into it (e.g. "
                             "`python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`)")
    if not token and not is_loopback(args.host) and not args.insecure:
        raise ValueError(f"refusing to serve on {args.host} without a token: set MARGE_API_TOKEN or --token-file "
                         "(or pass --insecure if the network is trusted)")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both for HTTPS, or neither")
    for name, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"{name} {path} does not exist")
    corpus = args.corpus or run_config(Path(args.run))["data"]["corpus"]
    check_servable(Path(args.run))
    settings = ServeSettings(run_dir=Path(args.run), corpus_dir=Path(corpus), token=token or None, max_k=args.max_k,
                             max_query_chars=args.max_query_chars, max_body_bytes=args.max_body_bytes,
                             max_in_flight=args.max_in_flight, poll_s=args.poll_s, index_type=args.index_type,
                             flat_max_documents=args.flat_max_documents, hnsw_m=args.hnsw_m,
                             hnsw_ef_search=args.hnsw_ef_search, text_cache_mb=args.text_cache_mb,
                             verify_corpus=args.verify_corpus)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info",
                limit_concurrency=4 * args.max_in_flight,
                ssl_certfile=None if args.tls_cert is None else str(args.tls_cert),
                ssl_keyfile=None if args.tls_key is None else str(args.tls_key))
    return 0
