"""Batcher at scale: seconds and peak memory of one pass over an index graph of 1M to 10M edges.

The batcher builds a shard's batches from that shard's documents alone (links stay within a shard), so it can
read one shard at a time (`batcher.shard_cache_mb=0`) instead of holding the corpus. This benchmark writes a
synthetic corpus and index version in the real formats (Parquet shards, manifest, link graphs), then runs one
pass of `epoch_batches` over them in a fresh process per measurement, two ways in the same run:

  streamed      `shard_cache_mb=0`: the shard in use only
  whole corpus  a budget larger than the corpus: every shard stays once read (what the batcher did before it
                streamed shards, when it held every document from the start)

at graph sizes of 1M, 3M and 10M edges with the same shard size (so 10x the edges is 10x the shards). Goals
: the time per edge near-linear from 1M to 10M edges, and the streamed pass's memory bounded (not
growing with the corpus).

    python benchmarks/batcher_scale.py --out benchmarks/results/batcher-scale-cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

from marge.contracts.corpus import CORPUS_FORMAT, CORPUS_SCHEMA, CORPUS_SCHEMA_VERSION  # noqa: E402
from marge.contracts.index_store import commit_version, staging_dir, write_graph  # noqa: E402
from marge.util.files import atomic_write_text, sha256_file  # noqa: E402

log = logging.getLogger("batcher_scale")

LANGUAGES = ("en", "de", "fr", "es", "it", "ru", "zh", "ja")
VOCAB = 32000


def write_synthetic(root: Path, shards: int, docs_per_shard: int, links: int, seed: int = 0) -> tuple[Path, Path]:
    """A corpus of `shards` x `docs_per_shard` documents (20..128 tokens, 8 languages) and an index version whose
    graph gives every document `links` evidence documents in its own shard. Returns (corpus dir, version dir)."""
    corpus, index = root / "corpus", root / "index"
    (corpus / "shards").mkdir(parents=True)
    index.mkdir()
    staging = staging_dir(index, 0)
    staging.mkdir()
    rng = np.random.default_rng(seed)
    infos, entries = [], []
    for s in range(shards):
        ids = np.arange(s * docs_per_shard, (s + 1) * docs_per_shard, dtype=np.int64)
        lengths = rng.integers(20, 129, size=docs_per_shard).astype(np.int32)
        langs = np.array(LANGUAGES, dtype=object)[rng.integers(len(LANGUAGES), size=docs_per_shard)]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        flat = rng.integers(4, VOCAB, size=int(offsets[-1]), dtype=np.int32)
        keys = pa.array([f"synthetic-{d}#0" for d in ids.tolist()])
        table = pa.Table.from_arrays([
            pa.array(ids), keys, pa.array(np.full(docs_per_shard, s, np.int32)), keys, pa.array(langs.tolist()),
            pa.array(np.zeros(docs_per_shard, np.int32)), pa.array(np.ones(docs_per_shard, np.int32)),
            pa.array([""] * docs_per_shard), pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
            pa.array(lengths), pa.array(["synthetic"] * docs_per_shard),
            pa.array([[]] * docs_per_shard, type=CORPUS_SCHEMA.field("paragraph_ids").type)], schema=CORPUS_SCHEMA)
        file = f"shards/shard-{s:05d}.parquet"
        pq.write_table(table, corpus / file)
        infos.append({"shard": s, "file": file, "rows": docs_per_shard, "tokens": int(offsets[-1]),
                      "sha256": sha256_file(corpus / file)})
        rows = np.repeat(np.arange(docs_per_shard), links)
        other = rng.integers(0, docs_per_shard - 1, size=len(rows))
        other = other + (other >= rows)  # never a document itself
        cross = langs[rows] != langs[other]
        write_graph(staging / f"graph-{s:05d}.parquet", ids[rows], ids[other],
                    rng.random(len(rows)).astype(np.float32), cross)
        entries.append({"shard": s, "graph_file": f"graph-{s:05d}.parquet", "num_documents": docs_per_shard,
                        "num_edges": len(rows), "cross_lingual_edges": int(cross.sum())})
        log.info("wrote shard %d/%d", s + 1, shards)
    atomic_write_text(corpus / "manifest.json", json.dumps({
        "format": CORPUS_FORMAT, "schema_version": CORPUS_SCHEMA_VERSION, "shards": infos,
        "tokenizer": {"sha256": "synthetic", "vocab_size": VOCAB}, "languages": list(LANGUAGES),
        "num_documents": shards * docs_per_shard}) + "\n")
    version = commit_version(index, 0, 0, entries)
    return corpus, version.path


def measure(corpus: Path, version: Path, cache_mb: float, max_tokens: int) -> dict:
    """One pass of `epoch_batches` in this process: seconds, batches, and memory (peak RSS over the baseline)."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import read_version
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore, epoch_batches

    index = read_version(version)
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store = DocumentStore(Corpus.open(corpus), cache_mb)
    t0 = time.perf_counter()
    batches = targets = tokens = 0
    for batch in epoch_batches(index, store, BatcherConfig(max_tokens=max_tokens), epoch=0):
        batches += 1
        targets += batch.num_targets
        tokens += batch.cost_tokens()
    seconds = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "batches": batches, "targets": targets, "batch_tokens": tokens,
            "shard_reads": store.reads, "peak_rss_mb": peak_kb / 1024, "rss_over_baseline_mb": (peak_kb - baseline_kb) / 1024,
            "cached_mb_at_end": store.cached_bytes / 2**20}


def measure_in_child(corpus: Path, version: Path, cache_mb: float, max_tokens: int) -> dict:
    """`measure` in a fresh interpreter, so that each peak RSS is its own."""
    out = subprocess.run([sys.executable, __file__, "--measure", str(corpus), str(version), str(cache_mb),
                          str(max_tokens)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(sizes: dict) -> dict:
    """Ratios between graph sizes: time per edge (near-linear: about 1) and memory (bounded: the streamed pass's
    stops growing once a second shard has been read, while the whole corpus's grows with every shard)."""
    by_edges = [sizes[k] for k in sorted(sizes, key=int)]
    small, large = by_edges[0], by_edges[-1]
    variants = ("streamed", "whole_corpus")
    summary = {
        "time_per_edge_largest_over_smallest": {
            v: large[v]["seconds_per_100k_edges"] / small[v]["seconds_per_100k_edges"] for v in variants},
        "memory_largest_over_smallest": {
            v: large[v]["rss_over_baseline_mb"] / small[v]["rss_over_baseline_mb"] for v in variants},
        "streamed_over_whole_corpus_memory_at_largest": large["streamed"]["rss_over_baseline_mb"]
        / large["whole_corpus"]["rss_over_baseline_mb"],
        "streamed_over_whole_corpus_time_at_largest": large["streamed"]["seconds"] / large["whole_corpus"]["seconds"]}
    if len(by_edges) > 2:
        summary["memory_largest_over_second_largest"] = {
            v: large[v]["rss_over_baseline_mb"] / by_edges[-2][v]["rss_over_baseline_mb"] for v in variants}
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    p.add_argument("--edges", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000], help="graph sizes")
    p.add_argument("--shard-edges", type=int, default=1_000_000, help="edges per shard (the same at every size)")
    p.add_argument("--links", type=int, default=8, help="evidence documents per target")
    p.add_argument("--max-tokens", type=int, default=2048, help="batcher.max_tokens")
    p.add_argument("--work", type=Path, default=None, help="where to write the synthetic data (default: a temp dir)")
    p.add_argument("--measure", nargs=4, metavar=("CORPUS", "VERSION", "CACHE_MB", "MAX_TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        corpus, version, cache_mb, max_tokens = args.measure
        print(json.dumps(measure(Path(corpus), Path(version), float(cache_mb), int(max_tokens))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    docs_per_shard = args.shard_edges // args.links
    results = {"command": "python benchmarks/batcher_scale.py " + " ".join(sys.argv[1:]),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "shard": {"documents": docs_per_shard, "edges": docs_per_shard * args.links,
                         "tokens_per_document": "20..128 (uniform)"}, "max_tokens": args.max_tokens, "sizes": {}}
    work = Path(tempfile.mkdtemp(prefix="batcher-scale-", dir=args.work))
    try:
        for edges in args.edges:
            shards = max(1, edges // (docs_per_shard * args.links))
            t0 = time.perf_counter()
            corpus, version = write_synthetic(work / str(edges), shards, docs_per_shard, args.links)
            size = {"shards": shards, "edges": shards * docs_per_shard * args.links,
                    "documents": shards * docs_per_shard, "write_seconds": time.perf_counter() - t0}
            for name, cache_mb in (("streamed", 0.0), ("whole_corpus", 1e9)):
                size[name] = measure_in_child(corpus, version, cache_mb, args.max_tokens)
                size[name]["seconds_per_100k_edges"] = size[name]["seconds"] / (size["edges"] / 100_000)
                log.info("%d edges, %s: %s", edges, name, size[name])
            results["sizes"][str(edges)] = size
            shutil.rmtree(work / str(edges))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["summary"] = summarize(results["sizes"])
    print(json.dumps(results["summary"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
