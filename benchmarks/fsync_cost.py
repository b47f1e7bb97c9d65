"""What `redis.appendfsync: always` costs the queue against `everysec`, in the same run on the same disk.

With `always`, redis-server writes and fsyncs its append-only file before it replies (one fsync per event-loop
pass, shared by every client served in it), so nothing it acknowledged is lost to a killed server or a machine
crash. With `everysec` it replies first and fsyncs once a second in the background; a machine crash loses up to
about two seconds of acknowledged writes (the write itself is postponed while a background fsync runs), which can
reissue a trainer generation (a straggler of the lost group is then not fenced) or lose a dead letter.

Each arm starts a private redis-server (`LocalRedis`) in a folder on the disk under test and measures the
protocol's own calls:

  offer     one batch of `--message-bytes` written by `BatchQueue.offer` (one script), `--offers` times, by
            `--writers` threads at once (the batch builders)
  commit    one rank's checkpoint commit (`BatchQueue.commit`): its record of an interval of `--pairs` batches and
            the previous interval's again, as the trainer commits
  generation  a trainer group's `start_generation` (one INCR)

    python benchmarks/fsync_cost.py --out benchmarks/results/fsync-cost-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

from marge.contracts.protocol import BatchQueue, entry_id  # noqa: E402
from marge.contracts.slots import CommitRecord, Slots  # noqa: E402
from services.driver.redis_server import LocalRedis  # noqa: E402

POLICIES = ("everysec", "always")


def offers(server: LocalRedis, writers: int, count: int, message: bytes) -> float:
    """Wall seconds per offer, `writers` builders writing their own slots at once."""
    slots = Slots(writers, 1, writers)
    queues = [BatchQueue.connect(server.url, "fsync", slots) for _ in range(writers)]
    fields = {b"v": b"2", b"header": b"{}", b"tokens": message, b"sha256": b"0"}

    def write(group: int) -> None:
        q = queues[group]
        for k in range(count // writers):
            slot = slots.first_slot_of_group(group, k)
            status, _ = q.offer(slot, fields, lookahead_steps=10**9)
            assert status == "written", status

    threads = [threading.Thread(target=write, args=(g,)) for g in range(writers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - started) / (count // writers * writers)


def commits(server: LocalRedis, count: int, pairs: int) -> list[float]:
    slots = Slots(1, pairs)
    q = BatchQueue.connect(server.url, "fsync-commit", slots)
    times = []
    previous: CommitRecord | None = None
    for step in range(1, count + 1):
        record = CommitRecord.of(step, step - 1, [(slots.slot(step - 1, 0, m), f"v0-e0-s{step}-{m}")
                                                  for m in range(pairs)])
        started = time.perf_counter()
        q.commit(0, step, ([(0, previous)] if previous else []) + [(0, record)])
        times.append(time.perf_counter() - started)
        previous = record
    return times


def generations(server: LocalRedis, count: int) -> list[float]:
    q = BatchQueue.connect(server.url, "fsync-generation", Slots(1, 1))
    times = []
    for _ in range(count):
        started = time.perf_counter()
        q.start_generation()
        times.append(time.perf_counter() - started)
    return times


def arm(policy: str, folder: Path, args) -> dict:
    with tempfile.TemporaryDirectory(dir=folder) as tmp, LocalRedis(Path(tmp), appendfsync=policy,
                                                                    maxmemory="4gb") as server:
        message = os.urandom(args.message_bytes)
        assert entry_id(0) == "1-0"
        offer_s = offers(server, args.writers, args.offers, message)
        commit_s = commits(server, args.commits, args.pairs)
        generation_s = generations(server, args.generations)
    return {"offer_ms": 1e3 * offer_s, "offers_per_s": 1 / offer_s,
            "commit_ms_median": 1e3 * statistics.median(commit_s),
            "generation_ms_median": 1e3 * statistics.median(generation_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the disk under test (default: TMPDIR)")
    parser.add_argument("--offers", type=int, default=2000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--message-bytes", type=int, default=64 * 1024)
    parser.add_argument("--commits", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--generations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="arms alternate, this many times each")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.gettempdir())
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for _ in range(args.repeats):
        for policy in POLICIES:
            runs[policy].append(arm(policy, folder, args))
    median = {p: {k: statistics.median(r[k] for r in runs[p]) for k in runs[p][0]} for p in POLICIES}
    summary = {"always_over_everysec": {k: round(median["always"][k] / median["everysec"][k], 2)
                                        for k in ("offer_ms", "commit_ms_median", "generation_ms_median")},
               "median": {p: {k: round(v, 3) for k, v in m.items()} for p, m in median.items()}}
    report = {"command": "python benchmarks/fsync_cost.py " + " ".join(sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.machine()},
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "dir")}, "runs": runs,
              "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
