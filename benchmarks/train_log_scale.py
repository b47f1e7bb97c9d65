"""A run's train log at 10^4, 10^5 and 10^6 updates: peak memory and seconds of what reads and trims it, streamed
over the segmented log against the whole log held as one list.

Synthetic logs, written once through `TrainLog.append` (so the segmented ones are rolled by the real writer, every
`SEGMENT_UPDATES` updates) into a temporary folder: 8 slots an update (8 ranks), batch ids in the batcher's order
(index version v serves updates [v*1000, (v+1)*1000); within a version, passes over 64 shards in a seeded order, 40
batches a shard, each id with a content digest), two objectives, 12 beta values, the index version and snapshot,
times one second apart, and a dead letter every 50,000 updates replayed 10 updates later (what the audit must tell
from a batch trained twice). The Redis side of the audit is what a run at that point holds: a ledger window of the
last two checkpoint intervals (checkpoint every 500 updates: 8,000 entries), one retired count for every older
update, the dead letters, and the checkpoint's last interval (4,000 slots).

Each measurement is a fresh Python process that imports marge, builds its inputs, and then runs one operation; its
memory is the rise of the process's peak resident set (`ru_maxrss`) over the operation, its time the operation's
wall seconds. Operations:

  * summary: the driver's summary fold (`summarize`: `RunFigures` and `RefreshCost` over one pass, one index build
    record per version);
  * audit: `marge audit`'s account (`services.driver.audit.account`: one pass, its replays' positions named by dead letters);
  * truncate: `TrainLog.truncate_after(last update - 5)`, what rank 0 does at every restart.

The named alternative, at 10^4 and 10^5 updates: the log as one file (the layout before segments), read into one
list, and the code that took that list before (kept below, verbatim but for names: its summary figures and
refresh cost, its audit, its truncation that read and rewrote the whole file). Its results are checked against the
streamed ones (the same dicts), so the two compute the same thing.

The retired counts are handed to the streamed audit as a mapping computed on the fly, so its figure is the
account's own memory. The audit with Redis (`audit` of the approaches `redis-blocks` and `redis-whole-dict`, on the
segmented log) takes them from a real redis-server the benchmark starts on loopback (`LocalRedis`, as the tests
do), the ledger's retired hash filled with one field per update before the window (`RunKeys.ledger_retired`):
  * redis-blocks: what `marge audit` does (`QueueState.of`: `RetiredCounts`, an HMGET of RETIRED_BLOCK updates at a
    time as the log goes past), so its memory includes the retired counts as they come from Redis;
  * redis-whole-dict, the named alternative: the whole hash read into a dict (`BatchQueue.retired_by_update`, an
    HGETALL), inside the measured operation, then the same account.
Both give the result of the streamed audit (checked). `retired_dict_mib` is the dict's own size (tracemalloc).

    python benchmarks/train_log_scale.py --out benchmarks/results/train-log-scale-cpu-2core.json

About 1 KB an update: the 10^6 log is about 1 GB; the script checks the free disk first and leaves out a size that
does not fit (saying so). 16.5 minutes on a 2-core CPU that other jobs loaded (2026-11-27).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

from marge.contracts.slots import BatchId, Slots  # noqa: E402
from marge.contracts.train_log import SEGMENT_UPDATES, RunFigures, TrainLog, UpdateRecord, feed  # noqa: E402

SLOTS = Slots(world=8, grad_accum=1)
REINDEX_EVERY = 1000
SHARDS, BATCHES_PER_SHARD = 64, 40
CHECKPOINT_EVERY = 500
REPLAY_EVERY, REPLAY_AFTER = 50_000, 10
T0 = 1.7e9
BYTES_PER_UPDATE_GUESS = 1100
SIZES, WHOLE_LIST_SIZES = (10_000, 100_000, 1_000_000), (10_000, 100_000)
RUN_ID = "train-log-scale"
REDIS_URL_ENV = "TRAIN_LOG_SCALE_REDIS_URL"
"""How the driver tells a measurement process where its redis-server listens."""
REDIS_APPROACHES = ("redis-blocks", "redis-whole-dict")


# -- the synthetic run


@lru_cache(maxsize=4)
def shard_order(version: int, epoch: int) -> list[int]:
    return random.Random(f"{version}/{epoch}").sample(range(SHARDS), SHARDS)


def scheduled_id(slot: int) -> str:
    """The batcher's id of `slot`: the k-th batch of its version's sequence (services.batcher.schedule)."""
    version = SLOTS.step_of(slot) // REINDEX_EVERY
    k = slot - version * REINDEX_EVERY * SLOTS.per_step
    epoch, within = divmod(k, SHARDS * BATCHES_PER_SHARD)
    visit, number = divmod(within, BATCHES_PER_SHARD)
    content = hashlib.blake2b(f"{slot}".encode(), digest_size=6).hexdigest()
    return str(BatchId(version, epoch, shard_order(version, epoch)[visit], number, content))


def dead_lettered_slot(update: int) -> int | None:
    """Every REPLAY_EVERY updates, one slot is dead-lettered (and replayed REPLAY_AFTER updates later)."""
    return SLOTS.slot(update, 3, 0) if update % REPLAY_EVERY == 17 else None


def replay_into(update: int) -> tuple[int, str] | None:
    """(slot, batch id) of a replay this update trains."""
    original = update - REPLAY_AFTER
    dead = dead_lettered_slot(original) if original >= 0 else None
    return (SLOTS.slot(update, 5, 0), scheduled_id(dead)) if dead is not None else None


def synthetic_record(update: int) -> UpdateRecord:
    slots = [SLOTS.slot(update, rank, 0) for rank in range(SLOTS.world)]
    ids = [scheduled_id(n) for n in slots]
    replay = replay_into(update)
    if replay is not None:
        ids[slots.index(replay[0])] = replay[1]
    dead = dead_lettered_slot(update)
    version = update // REINDEX_EVERY
    loss = 8.0 / math.sqrt(1 + update / 100)
    return UpdateRecord(
        step=update + 1, loss=loss, lr=3e-4 * min(1.0, (update + 1) / 4000), grad_norm=1.0 + 0.1 * math.sin(update),
        batch_ids=ids, slots=slots, dead_lettered=[dead] if dead is not None else [],
        objectives={"marge": loss, "denoise": loss * 0.8}, beta=[0.9 + 0.01 * i for i in range(12)],
        index_versions=[version], snapshot_steps=[max(0, (version - 1) * REINDEX_EVERY)],
        staleness_max=update - max(0, (version - 1) * REINDEX_EVERY), step_seconds=0.9, tokens=120_000 + update % 97,
        target_tokens=40_000, tokens_per_s=133_000.0, target_tokens_per_s=44_000.0, wait_share=0.02,
        elapsed_s=float(update + 1), startup_wait_s=30.0, time=T0 + update + 1, mfu=0.41)


def builds(updates: int) -> list[dict]:
    """One index build record per version used, each taking 300 updates' time after its snapshot."""
    out = [{"version": 0, "snapshot_step": 0, "started_unix": T0 - 60, "finished_unix": T0 - 10, "seconds": 50.0}]
    for v in range(1, (updates - 1) // REINDEX_EVERY + 1):
        started = T0 + (v - 1) * REINDEX_EVERY + 1
        out.append({"version": v, "snapshot_step": (v - 1) * REINDEX_EVERY, "started_unix": started,
                    "finished_unix": started + 300, "seconds": 300.0, "indexer_workers": 2})
    return out


class RetiredCounts(Mapping):
    """The ledger's retired count of every update before the window, computed on the fly (see the module
    docstring): what `queue.retired_by_update()` returns, without holding it."""

    def __init__(self, window_start: int):
        self.window_start = window_start

    def __getitem__(self, update: int) -> int:
        if not 0 <= update < self.window_start:
            raise KeyError(update)
        return SLOTS.per_step - (dead_lettered_slot(update) is not None)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.window_start))

    def __len__(self) -> int:
        return self.window_start


def audit_inputs(updates: int, retired_as_dict: bool = False):
    from services.driver.audit import CheckpointState, QueueState

    window_start = max(0, updates - 2 * CHECKPOINT_EVERY)
    ledger = {}
    for update in range(window_start, updates):
        record = synthetic_record(update)
        for slot, batch_id in record.trained_slots().items():
            ledger[batch_id] = {"step": update, "slot": slot}
    retired = RetiredCounts(window_start)
    dead = [{"entry": f"{u}-0", "slot": dead_lettered_slot(u), "batch_id": scheduled_id(dead_lettered_slot(u)),
             "reason": "synthetic", "replayed_to_slot": SLOTS.slot(u + REPLAY_AFTER, 5, 0)}
            for u in range(updates) if dead_lettered_slot(u) is not None and u + REPLAY_AFTER < updates]
    last_interval = range(max(0, updates - CHECKPOINT_EVERY), updates)
    trained = [(n, b) for u in last_interval for n, b in synthetic_record(u).trained_slots().items()]
    counts = {"committed_step": updates, "pending": 0, "produced": updates * SLOTS.per_step, "trained_twice": 0}
    return (CheckpointState(updates, None, trained, []),
            QueueState(counts, ledger, dict(retired) if retired_as_dict else retired, dead))


# -- the named alternative: the whole log as one list, and the code that took it (before segments)


def whole_list_summary(records: list[UpdateRecord], history: list[dict]) -> dict:
    last = records[-1] if records else None
    return {"steps": last.step if last else 0, "index_versions": sorted({v for r in records for v in r.index_versions}),
            "loss_first": records[0].loss if records else None, "loss_last": last.loss if last else None,
            "tokens_per_s": last.tokens_per_s if last else 0.0,
            "staleness_max": max((r.staleness_max for r in records), default=0),
            "refresh": whole_list_refresh_cost(history, records)}


def whole_list_refresh_cost(builds: list[dict], records: list[UpdateRecord]) -> dict:
    from marge.eval.refresh import overlaps, union_seconds

    intervals = [(b["started_unix"], b["finished_unix"]) for b in builds]
    steps = [(r.time - r.step_seconds, r.time, r) for r in records if r.time > 0]
    first_use: dict[int, int] = {}
    trained_shards: dict[int, set[int]] = {}
    for r in records:
        for v in r.index_versions:
            first_use.setdefault(v, r.step)
        for batch_id in r.trained_slots().values():
            parsed = BatchId.parse(batch_id) if batch_id else None
            if parsed is not None:
                trained_shards.setdefault(parsed.version, set()).add(parsed.shard)
    per_version = []
    for b in builds:
        during = sum(1 for start, end, _ in steps if overlaps(start, end, [(b["started_unix"], b["finished_unix"])]))
        used = first_use.get(b["version"])
        per_version.append({"version": b["version"], "snapshot_step": b["snapshot_step"],
                            "build_seconds": b.get("seconds"), "indexer_workers": b.get("indexer_workers"),
                            "steps_during_build": during, "first_use_step": used,
                            "shards_embedded": b.get("shards_rebuilt"),
                            "shards_trained": len(trained_shards.get(b["version"], ())),
                            "staleness_at_first_use": None if used is None else used - b["snapshot_step"]})
    building = [r for start, end, r in steps if overlaps(start, end, intervals)]
    idle = [r for start, end, r in steps if not overlaps(start, end, intervals)]

    def tokens_per_s(rs: list[UpdateRecord]) -> float | None:
        seconds = sum(r.step_seconds for r in rs)
        return sum(r.tokens for r in rs) / seconds if rs and seconds > 0 else None

    wall = (steps[-1][1] - steps[0][0]) if steps else 0.0
    share = union_seconds(intervals, steps[0][0], steps[-1][1]) / wall if wall > 0 else None
    return {"per_version": per_version, "build_share": share,
            "steps_building": len(building), "steps_idle": len(idle),
            "tokens_per_s_building": tokens_per_s(building), "tokens_per_s_idle": tokens_per_s(idle)}


def whole_list_account(records: list[UpdateRecord], checkpoint, queue) -> dict:
    from services.driver.audit import content_changed

    step, covered = checkpoint.step, checkpoint.step * SLOTS.per_step
    counts, ledger = queue.counts, queue.ledger
    trained_slot = {entry["slot"]: batch_id for batch_id, entry in ledger.items() if entry["slot"] < covered}
    logged = {n: b for r in records for n, b in r.trained_slots().items()}
    retired = {s: k for s, k in queue.retired_by_update.items() if s < step}
    from_log = {n: b for n, b in logged.items() if n not in trained_slot and SLOTS.step_of(n) in retired}
    logged_per_update = Counter(SLOTS.step_of(n) for n in from_log)
    retired_disagree = sorted(s for s in retired if logged_per_update[s] != retired[s])
    trained_slot.update(from_log)
    dead = queue.dead_letters
    dead_slots = {d["slot"] for d in dead}
    awaiting = {n: b for n, b in checkpoint.trained if n not in trained_slot}
    awaiting_dead = {n for n, _ in checkpoint.dead if n not in dead_slots}
    trained_slot.update(awaiting)
    lost = [n for n in range(covered) if n not in trained_slot and n not in dead_slots and n not in awaiting_dead]
    logged_twice = [b for b, k in Counter(b for r in records for b in r.trained_slots().values()).items() if k > 1]
    disagree = sorted(n for n, b in logged.items() if n in trained_slot and trained_slot[n] != b)
    trained_twice = counts.get("trained_twice", 0) + len(logged_twice)
    changed = content_changed([*ledger, *(b for r in records for b in r.batch_ids), *(d["batch_id"] for d in dead)])
    return {
        "ok": not lost and trained_twice == 0 and not disagree and not retired_disagree and not changed,
        "steps": step, "checkpoint": checkpoint.path, "committed_step": counts["committed_step"],
        "batches_produced": counts.get("produced", 0), "batches_trained": len(trained_slot),
        "batches_lost": len(lost), "lost_slots": lost[:100],
        "trained_twice": trained_twice, "trained_twice_ids": logged_twice[:100],
        "ledger_disagrees_with_train_log": disagree[:100], "content_changed": changed[:100],
        "batches_retired_from_ledger": sum(retired.values()),
        "retired_counts_disagree_with_train_log": retired_disagree[:100],
        "batches_pending": counts["pending"],
        "batches_awaiting_commit": len(awaiting) + len(awaiting_dead),
        "batches_dead_lettered": sum(1 for d in dead if d["replayed_to_slot"] is None) + len(awaiting_dead),
        "batches_replayed": sum(1 for d in dead if d["replayed_to_slot"] is not None),
        "train_log_updates": len(records),
    }


def whole_file_truncate_after(path: Path, step: int) -> None:
    from marge.util.files import atomic_write_text

    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))


# -- one measurement (a fresh process)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def measure(operation: str, approach: str, log_dir: Path, updates: int) -> dict:
    from marge.eval.refresh import RefreshCost
    from services.driver.audit import QueueState, account
    from services.driver.audit import RetiredCounts as RetiredInRedis

    history = builds(updates)
    log = TrainLog.of_run(log_dir)
    checkpoint, queue = audit_inputs(updates, retired_as_dict=approach == "whole-list") \
        if operation == "audit" else (None, None)
    if approach in REDIS_APPROACHES:
        from marge.contracts.protocol import BatchQueue

        redis_queue = BatchQueue.connect(os.environ[REDIS_URL_ENV], RUN_ID, SLOTS)
        redis_queue.r.ping()
        retired_fields = int(redis_queue.r.hlen(redis_queue.keys.ledger_retired))
        assert retired_fields == len(queue.retired_by_update), (retired_fields, len(queue.retired_by_update))
        queue.retired_by_update = {}  # the measured operation takes them from Redis
    before = peak_rss_mib()
    started = time.perf_counter()
    if operation == "summary" and approach == "streaming":
        figures, refresh = RunFigures(), RefreshCost(history)
        feed(log.iter_records(), figures, refresh)
        last = figures.last
        result = {"steps": last.step, "index_versions": sorted(figures.index_versions),
                  "loss_first": figures.first.loss, "loss_last": last.loss, "tokens_per_s": last.tokens_per_s,
                  "staleness_max": figures.staleness_max, "refresh": refresh.result()}
    elif operation == "summary":
        result = whole_list_summary(log.read(), history)
    elif operation == "audit" and approach == "streaming":
        result = account(lambda: log.iter_records(through_step=updates), SLOTS, checkpoint, queue)
    elif operation == "audit" and approach in REDIS_APPROACHES:
        retired = RetiredInRedis(redis_queue.r, redis_queue.keys.ledger_retired) if approach == "redis-blocks" \
            else redis_queue.retired_by_update()
        queue = QueueState(queue.counts, queue.ledger, retired, queue.dead_letters)
        result = account(lambda: log.iter_records(through_step=updates), SLOTS, checkpoint, queue)
    elif operation == "audit":
        result = whole_list_account(log.read(through_step=updates), checkpoint, queue)
    elif operation == "truncate" and approach == "streaming":
        log.truncate_after(updates - 5)
        result = {"kept": updates - 5}
    elif operation == "truncate":
        whole_file_truncate_after(log.path, updates - 5)
        result = {"kept": updates - 5}
    else:
        raise ValueError(f"unknown operation {operation!r} or approach {approach!r}")
    seconds = time.perf_counter() - started
    out = {"operation": operation, "approach": approach, "updates": updates, "seconds": round(seconds, 2),
           "peak_rss_rise_mib": round(max(0.0, peak_rss_mib() - before), 1), "result_digest": digest(result)}
    if approach in REDIS_APPROACHES:
        out["retired_fields_in_redis"] = retired_fields
    if operation == "audit":
        out["audit_ok"], out["trained_twice"] = result["ok"], result["trained_twice"]
        out["batches_replayed"], out["batches_trained"] = result["batches_replayed"], result["batches_trained"]
    if operation == "truncate":
        out["last_update_after"] = TrainLog.of_run(log_dir).read()[-1].step if approach == "whole-list" \
            else last_step(TrainLog.of_run(log_dir))
    return out


def last_step(log: TrainLog) -> int:
    last = None
    for last in log.iter_records():
        pass
    return last.step if last else 0


def retired_dict_mib(updates: int) -> float:
    """Memory of the dict `queue.retired_by_update()` returns at this point of the run (one entry per update)."""
    import tracemalloc

    tracemalloc.start()
    retired = dict(RetiredCounts(max(0, updates - 2 * CHECKPOINT_EVERY)))
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del retired
    return round(size / 2**20, 1)


# -- the driver of the whole benchmark


def write_log(log_dir: Path, updates: int, segment_updates: int) -> dict:
    started = time.perf_counter()
    log = TrainLog.of_run(log_dir, segment_updates=segment_updates)
    for update in range(updates):
        log.append(synthetic_record(update))
    size = sum(p.stat().st_size for p in log_dir.rglob("*.jsonl"))
    return {"updates": updates, "segment_updates": segment_updates, "segments": len(log.segments()),
            "bytes": size, "bytes_per_update": round(size / updates), "write_s": round(time.perf_counter() - started, 1)}


def fill_retired(url: str, updates: int) -> dict:
    """The run's ledger:retired hash in Redis at this point of the run: one field per update before the window."""
    from marge.contracts.protocol import BatchQueue

    queue = BatchQueue.connect(url, RUN_ID, SLOTS)
    key = queue.keys.ledger_retired
    queue.r.delete(key)
    started = time.perf_counter()
    counts = RetiredCounts(max(0, updates - 2 * CHECKPOINT_EVERY))
    for start in range(0, len(counts), 10_000):
        queue.r.hset(key, mapping={str(u): counts[u] for u in range(start, min(start + 10_000, len(counts)))})
    memory = queue.r.memory_usage(key) if len(counts) else 0
    return {"updates": updates, "retired_fields": int(queue.r.hlen(key)),
            "redis_hash_mib": round((memory or 0) / 2**20, 1), "fill_s": round(time.perf_counter() - started, 1)}


def run_measurement(operation: str, approach: str, log_dir: Path, updates: int, redis_url: str | None = None) -> dict:
    command = [sys.executable, __file__, "--measure", operation, approach, str(log_dir), str(updates)]
    env = {**os.environ, REDIS_URL_ENV: redis_url} if redis_url else None
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--whole-list-sizes", type=int, nargs="+", default=list(WHOLE_LIST_SIZES))
    parser.add_argument("--workdir", type=Path, help="where the logs go (default: a temporary folder, removed after)")
    parser.add_argument("--measure", nargs=4, metavar=("OPERATION", "APPROACH", "LOG_DIR", "UPDATES"),
                        help=argparse.SUPPRESS)  # one measurement, in the fresh process the driver starts
    args = parser.parse_args()
    if args.measure:
        operation, approach, log_dir, updates = args.measure
        print(json.dumps(measure(operation, approach, Path(log_dir), int(updates))))
        return
    from services.driver.redis_server import LocalRedis

    workdir = Path(tempfile.mkdtemp(prefix="train-log-scale-", dir=args.workdir))
    server = LocalRedis(workdir / "redis", maxmemory="2gb").start()  # on loopback, a free port, as the tests' fixture
    try:
        results = run(args, workdir, server.url)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


def run(args, workdir: Path, redis_url: str) -> dict:
    needed = BYTES_PER_UPDATE_GUESS * (sum(args.sizes) + sum(args.whole_list_sizes))
    free = shutil.disk_usage(workdir).free
    sizes, left_out = [], []
    for size in sorted(args.sizes):  # the largest go first when the disk is short
        if BYTES_PER_UPDATE_GUESS * (sum(sizes) + size + sum(args.whole_list_sizes)) < free * 0.9:
            sizes.append(size)
        else:
            left_out.append({"updates": size, "why": f"{free / 2**30:.1f} GiB free, about "
                             f"{BYTES_PER_UPDATE_GUESS * size / 2**30:.1f} GiB needed"})
    print(f"{free / 2**30:.1f} GiB free for about {needed / 2**30:.1f} GiB of logs; sizes {sizes}", flush=True)
    logs, measurements, redis_hashes = [], [], []
    for size in sizes:
        for approach in ("streaming", "whole-list") if size in args.whole_list_sizes else ("streaming",):
            log_dir = workdir / f"{approach}-{size}"
            # the whole-list alternative reads the layout it was written for: one file
            written = write_log(log_dir, size, SEGMENT_UPDATES if approach == "streaming" else size + 1)
            logs.append({"approach": approach, **written})
            print(json.dumps(logs[-1]), flush=True)
            for operation in ("summary", "audit", "truncate"):  # truncation last: it cuts the log
                if operation == "truncate" and approach == "streaming":
                    redis_hashes.append(fill_retired(redis_url, size))
                    print(json.dumps(redis_hashes[-1]), flush=True)
                    for redis_approach in REDIS_APPROACHES:
                        measurements.append(run_measurement("audit", redis_approach, log_dir, size, redis_url))
                measurements.append(run_measurement(operation, approach, log_dir, size))
            shutil.rmtree(log_dir)
    same, same_redis = {}, {}
    for m in measurements:
        if m["approach"] != "streaming" and m["operation"] != "truncate":
            streamed = next(s for s in measurements if (s["operation"], s["updates"], s["approach"]) ==
                            (m["operation"], m["updates"], "streaming"))
            equal = streamed["result_digest"] == m["result_digest"]
            if m["approach"] == "whole-list":
                same[f"{m['operation']}@{m['updates']}"] = equal
            else:
                same_redis[f"{m['approach']}@{m['updates']}"] = equal
    audit_rss = {(m["approach"], m["updates"]): m["peak_rss_rise_mib"] for m in measurements
                 if m["operation"] == "audit" and m["approach"] in REDIS_APPROACHES}
    smallest, largest = min(sizes), max(sizes)
    ratio = {a: round(audit_rss[a, largest] / audit_rss[a, smallest], 2) if audit_rss.get((a, smallest)) else None
             for a in REDIS_APPROACHES} if len(sizes) > 1 else {}
    return {"machine": "2-core CPU", "python": platform.python_version(),
            "command": "python benchmarks/train_log_scale.py --out benchmarks/results/train-log-scale-cpu-2core.json",
            "segment_updates": SEGMENT_UPDATES, "slots_per_update": SLOTS.per_step,
            "sizes_left_out": left_out, "logs": logs, "measurements": measurements,
            "streamed_results_equal_whole_list_results": same,
            "redis_retired_hashes": redis_hashes,
            "redis_audit_results_equal_streamed_results": same_redis,
            f"redis_audit_rss_ratio_{largest}_over_{smallest}": ratio,
            "retired_dict_mib": {str(size): retired_dict_mib(size) for size in sizes}}


if __name__ == "__main__":
    main()
