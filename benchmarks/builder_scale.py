"""Batch builders: batches a second with 1..N builders side by side, and what a builder's resume costs.

Writes a synthetic corpus and index version in the real formats (`benchmarks/batcher_scale.py`'s
`write_synthetic`), then measures, each in fresh processes:

  builders   N processes side by side, builder g of N running one pass of `epoch_batches(group=g, builders=N)`
             over the streamed store (`shard_cache_mb=0`): the batches all of them build a second, against one
             builder's alone (N=1) in the same run. Each builder takes every N-th shard of the pass, so the N
             passes together are one builder's pass, in other batches.
  resume     the time to the first batch at position P of a version's sequence (a builder restarted deep inside
             a version), three ways: `built` (the named alternative, what a resume did before: every batch before
             P built and dropped), `planned` (shards before P planned for their batch counts, no batch built) and
             `counted` (their counts read from the run's batch_counts record, which a builder writes as it plans).

The builders' figure says how the work divides, on this machine's cores; a cluster gives each builder its own.

    python benchmarks/builder_scale.py --out benchmarks/results/builder-scale-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO), str(REPO / "benchmarks")]

from batcher_scale import write_synthetic  # noqa: E402

from marge.util.files import atomic_write_text  # noqa: E402

log = logging.getLogger("builder_scale")


def one_pass(corpus: Path, version: Path, group: int, builders: int, max_tokens: int) -> dict:
    """Builder `group` of `builders`: one pass, streamed; its batches and seconds."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import read_version
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore, epoch_batches

    index = read_version(version)
    store = DocumentStore(Corpus.open(corpus), 0.0)
    t0 = time.perf_counter()
    batches = sum(1 for _ in epoch_batches(index, store, BatcherConfig(max_tokens=max_tokens), epoch=0, group=group,
                                           builders=builders))
    return {"group": group, "batches": batches, "seconds": time.perf_counter() - t0, "shard_reads": store.reads}


def first_batch_at(corpus: Path, version: Path, position: int, how: str, counts_root: Path, max_tokens: int) -> dict:
    """Seconds to the batch at `position` of version 0's sequence for one builder, resumed `how`."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import read_version
    from marge.contracts.slots import Slots, VersionPlan
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore
    from services.batcher.schedule import BatchSchedule

    index = read_version(version)
    store = DocumentStore(Corpus.open(corpus), 0.0)
    schedule = BatchSchedule(store, BatcherConfig(max_tokens=max_tokens), 0, Slots(1, 1), VersionPlan(10**9, 0),
                             {0: index}.get, counts_root=counts_root if how == "counted" else None)
    t0 = time.perf_counter()
    if how == "built":  # the resume before batch counts: every earlier batch built, then dropped
        sequence = schedule.version_sequence(index)
        for _ in range(position):
            next(sequence)
        batch = next(sequence)
    else:
        batch = schedule.batch(position)
    return {"how": how, "seconds": time.perf_counter() - t0, "shard_reads": store.reads, "batch_id": batch.batch_id}


def child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"a measuring process failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    p.add_argument("--shards", type=int, default=8, help="shards in the synthetic index")
    p.add_argument("--shard-edges", type=int, default=200_000, help="edges per shard")
    p.add_argument("--links", type=int, default=8, help="evidence documents per target")
    p.add_argument("--max-tokens", type=int, default=2048, help="batcher.max_tokens")
    p.add_argument("--builders", type=int, nargs="+", default=[1, 2], help="builder counts to run side by side")
    p.add_argument("--resume-at", type=float, default=0.9, help="resume position, as a share of one pass")
    p.add_argument("--work", type=Path, default=None, help="where to write the synthetic data (default: a temp dir)")
    p.add_argument("--pass", dest="one_pass", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--resume", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_pass:
        corpus, version, group, builders, max_tokens = args.one_pass
        print(json.dumps(one_pass(Path(corpus), Path(version), int(group), int(builders), int(max_tokens))))
        return 0
    if args.resume:
        corpus, version, position, how, counts_root = args.resume
        print(json.dumps(first_batch_at(Path(corpus), Path(version), int(position), how, Path(counts_root),
                                        args.max_tokens)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    docs_per_shard = args.shard_edges // args.links
    results = {"command": "python benchmarks/builder_scale.py " + " ".join(sys.argv[1:]),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "index": {"shards": args.shards, "documents_per_shard": docs_per_shard,
                         "edges": args.shards * docs_per_shard * args.links},
               "max_tokens": args.max_tokens, "builders": {}, "resume": {}}
    work = Path(tempfile.mkdtemp(prefix="builder-scale-", dir=args.work))
    try:
        corpus, version = write_synthetic(work / "data", args.shards, docs_per_shard, args.links)
        common = [str(corpus), str(version)]
        for builders in args.builders:
            t0 = time.perf_counter()
            procs = [child("--pass", *common, str(g), str(builders), str(args.max_tokens)) for g in range(builders)]
            each = [result_of(proc) for proc in procs]
            wall = time.perf_counter() - t0
            total = sum(r["batches"] for r in each)
            results["builders"][str(builders)] = {"wall_seconds": wall, "batches": total,
                                                  "batches_per_s": total / wall, "each": each}
            log.info("%d builder(s): %d batches in %.1f s, %.0f/s", builders, total, wall, total / wall)
        one = results["builders"][str(min(args.builders))]
        for builders, r in results["builders"].items():
            r["over_one_builder"] = r["batches_per_s"] / one["batches_per_s"]
        position = int(args.resume_at * one["batches"])
        counts_root = work / "batch_counts"
        result_of(child("--resume", *common, str(position), "planned", str(counts_root)))  # warm the page cache
        result_of(child("--resume", *common, str(position), "counted", str(counts_root)))  # and write the counts
        for how in ("built", "planned", "counted"):
            results["resume"][how] = result_of(child("--resume", *common, str(position), how, str(counts_root)))
            log.info("resume at batch %d, %s: %s", position, how, results["resume"][how])
        ids = {r["batch_id"] for r in results["resume"].values()}
        if len(ids) != 1:
            raise RuntimeError(f"the three resumes gave different batches: {ids}")
        built = results["resume"]["built"]["seconds"]
        results["resume_position"] = position
        results["summary"] = {
            "batches_per_s_by_builders": {b: r["batches_per_s"] for b, r in results["builders"].items()},
            "speedup_over_one_builder": {b: r["over_one_builder"] for b, r in results["builders"].items()},
            "resume_seconds": {how: r["seconds"] for how, r in results["resume"].items()},
            "resume_built_over_counted": built / results["resume"]["counted"]["seconds"],
            "resume_built_over_planned": built / results["resume"]["planned"]["seconds"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results["summary"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
