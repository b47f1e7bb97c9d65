"""A run's train log at 10^4, 10^5 and 10^6 updates: peak memory and seconds of what reads and trims it, streamed
over the segmented log, against the whole log held as one list (summary, truncation) and the whole ledger held as
one dict (audit).

Synthetic logs, written once through `TrainLog.append` (so the segmented ones are rolled by the real writer, every
`SEGMENT_UPDATES` updates) into a temporary folder: 8 slots an update (8 ranks), batch ids in the batcher's order
(index version v serves updates [v*1000, (v+1)*1000); within a version, passes over 64 shards in a seeded order, 40
batches a shard, each id with a content digest), two objectives, 12 beta values, the index version and snapshot,
times one second apart, and a dead letter every 50,000 updates replayed 10 updates later (what the audit must tell
from a batch trained twice). The Redis side of the audit is what a run at that point holds, checkpointing every 500
updates: each rank's commit of each checkpoint interval (`CommitRecord`: how many batches it trained and their
`trained_digest`, computed from the interval's synthetic records) but the last, the dead letters and their replays.
The checkpoint holds the commits of its own last interval (`CheckpointState.commits`), which Redis has not got, as
when the driver died after the checkpoint and before the ranks committed it: the account takes that interval on
its awaiting path (`batches_awaiting_commit`, 4,000 slots).

Each measurement is a fresh Python process that imports marge, builds its inputs, and then runs one operation; its
memory is the rise of the process's peak resident set (`ru_maxrss`) over the operation, its time the operation's
wall seconds. Operations:

  * summary: the driver's summary fold (`summarize`: `RunFigures` and `RefreshCost` over one pass, one index build
    record per version);
  * audit: `marge audit`'s account (`services.ops.audit.account`: one pass over the log, one interval's commits
    at a time as the log reaches it, its replays' positions named by dead letters);
  * truncate: `TrainLog.truncate_after(last update - 5)`, what rank 0 does at every restart.

The named alternative of summary and truncate, at 10^4 and 10^5 updates: the log as one file (the layout before
segments), read into one list, and the code that took that list before (kept below, verbatim but for names: its
summary figures and refresh cost, its truncation that read and rewrote the whole file). Its summaries are checked
against the streamed ones (the same dicts), so the two compute the same thing.

The audit runs three ways over the segmented log, each checked to give the same result:
  * streaming: the account alone, without Redis. `commits(step)` computes an interval's commits from its 500
    synthetic records when the account asks for them, and nothing holds them after, so the memory figure is the
    account's own; its seconds include that computing (`commits_call_s`: the seconds spent inside `commits`;
    `commits_calls`: how many intervals it was asked for);
  * redis-records: what `marge audit` does, against a real redis-server the benchmark starts on loopback
    (`LocalRedis`, as the tests do), filled through the queue's own calls (`BatchQueue.commit` of each rank's record
    of each interval, `dead_letter`, `request_replay` and `offer` of the replays, each rank's `progress` through the
    checkpoint; the builders' `produced` counter set to the slots written, since the benchmark writes no other
    batches into the streams, which the account does not read): `QueueState.of` (counters, the ledger's checkpoint
    updates, dead letters) and, as the log reaches each interval, one HGETALL of its `RunKeys.ledger(step)`, all
    inside the measured operation;
  * redis-whole-dict, the named alternative: every interval's commits read into one dict up front (an HGETALL of
    each ledger hash, inside the measured operation), then the same account.
`redis_ledgers` gives, for each size, the ledger's Redis memory (MEMORY USAGE of its hashes, summed; its sorted set
of checkpoint updates and its hash of trained counts apart) and the size of the whole-dict arm's dict (tracemalloc).

    python benchmarks/train_log_scale.py --out benchmarks/results/train-log-scale-cpu-2core.json
    python benchmarks/train_log_scale.py --sizes 2000 10000 --whole-list-sizes 2000   # a quick check

About 1 KB an update: the 10^6 log is about 1 GB; the script checks the free disk first and leaves out a size that
does not fit (saying so). Sizes are multiples of the checkpoint interval. 9.5 minutes on a 2-core CPU (2026-11-29).
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
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

from marge.contracts.slots import BatchId, CommitRecord, Slots  # noqa: E402
from marge.contracts.train_log import SEGMENT_UPDATES, RunFigures, TrainLog, UpdateRecord, feed  # noqa: E402

SLOTS = Slots(world=8, grad_accum=1)
REINDEX_EVERY = 1000
SHARDS, BATCHES_PER_SHARD = 64, 40
CHECKPOINT_EVERY = 500
REPLAY_EVERY, REPLAY_AFTER, DEAD_LETTER_AT = 50_000, 10, 17
T0 = 1.7e9
BYTES_PER_UPDATE_GUESS = 1100
SIZES, WHOLE_LIST_SIZES = (10_000, 100_000, 1_000_000), (10_000, 100_000)
RUN_ID = "train-log-scale"
REDIS_URL_ENV = "TRAIN_LOG_SCALE_REDIS_URL"
"""How the driver tells a measurement process where its redis-server listens."""
REDIS_APPROACHES = ("redis-records", "redis-whole-dict")


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
    return SLOTS.slot(update, 3, 0) if update % REPLAY_EVERY == DEAD_LETTER_AT else None


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


def commits_of(step: int, records: Iterable[UpdateRecord]) -> dict[int, CommitRecord]:
    """Each rank's commit of the checkpoint interval ending at update `step`, whose records are `records`."""
    pairs: dict[int, list[tuple[int, str]]] = {rank: [] for rank in range(SLOTS.world)}
    for record in records:
        for slot, batch_id in record.trained_slots().items():
            pairs[SLOTS.rank_of(slot)].append((slot, str(batch_id)))
    return {rank: CommitRecord.of(step, step - CHECKPOINT_EVERY, p) for rank, p in pairs.items()}


def interval_commits(step: int) -> dict[int, CommitRecord]:
    """`commits_of` the interval ending at `step`, its records made again (they are a function of the update)."""
    return commits_of(step, (synthetic_record(u) for u in range(step - CHECKPOINT_EVERY, step)))


def ledger_steps(updates: int) -> list[int]:
    """The checkpoints whose commits Redis holds at the checkpoint of update `updates`: all but that one."""
    return list(range(CHECKPOINT_EVERY, updates - CHECKPOINT_EVERY + 1, CHECKPOINT_EVERY))


def synthetic_dead_letters(updates: int) -> list[dict]:
    """The dead letters up to update `updates`, each with the slot its replay went to (None: not replayed yet)."""
    out = []
    for update in range(DEAD_LETTER_AT, updates, REPLAY_EVERY):
        slot = dead_lettered_slot(update)
        replayed = update + REPLAY_AFTER < updates
        out.append({"slot": slot, "batch_id": scheduled_id(slot),
                    "replayed_to_slot": SLOTS.slot(update + REPLAY_AFTER, 5, 0) if replayed else None})
    return out


def queue_counts(updates: int) -> dict[str, int]:
    """The counters the account reads, as the run's Redis holds them (`fill_ledger` checks it): rank 0 committed
    the interval before the checkpoint's own; the ranks' progress trimmed their streams."""
    return {"committed_step": max(0, updates - CHECKPOINT_EVERY), "pending": 0,
            "produced": updates * SLOTS.per_step, "trained_twice": 0, "commit_conflicts": 0}


def checkpoint_state(updates: int):
    from services.ops.audit import CheckpointState

    return CheckpointState(updates, None, interval_commits(updates), [])


def synthetic_queue(updates: int):
    """The queue's state without Redis; its `commits` computes an interval's when asked (`interval_commits`)."""
    from services.ops.audit import QueueState

    return QueueState(queue_counts(updates), ledger_steps(updates), interval_commits, synthetic_dead_letters(updates))


class TimedCommits:
    """A `QueueState.commits` with the seconds spent in it and the intervals asked for."""

    def __init__(self, commits: Callable[[int], dict[int, CommitRecord]]):
        self.commits, self.seconds, self.calls = commits, 0.0, 0

    def __call__(self, step: int) -> dict[int, CommitRecord]:
        started = time.perf_counter()
        try:
            return self.commits(step)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


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
    from services.ops.audit import QueueState, account

    history = builds(updates)
    log = TrainLog.of_run(log_dir)
    checkpoint = checkpoint_state(updates) if operation == "audit" else None
    commits_timed = None
    if operation == "audit" and approach == "streaming":
        queue = synthetic_queue(updates)
        queue.commits = commits_timed = TimedCommits(queue.commits)
    if approach in REDIS_APPROACHES:
        from marge.contracts.protocol import BatchQueue

        redis_queue = BatchQueue.connect(os.environ[REDIS_URL_ENV], RUN_ID, SLOTS)
        checkpoints_in_redis = len(redis_queue.committed_steps())
        assert checkpoints_in_redis == len(ledger_steps(updates)), (checkpoints_in_redis, updates)
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
    elif operation == "audit" and approach == "redis-records":
        queue = QueueState.of(redis_queue)
        queue.commits = commits_timed = TimedCommits(queue.commits)
        result = account(lambda: log.iter_records(through_step=updates), SLOTS, checkpoint, queue)
    elif operation == "audit" and approach == "redis-whole-dict":
        steps = redis_queue.committed_steps()
        ledger = {step: redis_queue.commits(step) for step in steps}
        commits_timed = TimedCommits(ledger.__getitem__)
        queue = QueueState(redis_queue.counts(), steps, commits_timed, redis_queue.dead_letters())
        result = account(lambda: log.iter_records(through_step=updates), SLOTS, checkpoint, queue)
    elif operation == "truncate" and approach == "streaming":
        log.truncate_after(updates - 5)
        result = {"kept": updates - 5}
    elif operation == "truncate" and approach == "whole-list":
        whole_file_truncate_after(log.path, updates - 5)
        result = {"kept": updates - 5}
    else:
        raise ValueError(f"unknown operation {operation!r} or approach {approach!r}")
    seconds = time.perf_counter() - started
    out = {"operation": operation, "approach": approach, "updates": updates, "seconds": round(seconds, 2),
           "peak_rss_rise_mib": round(max(0.0, peak_rss_mib() - before), 1), "result_digest": digest(result)}
    if approach in REDIS_APPROACHES:
        out["checkpoints_in_redis"] = checkpoints_in_redis
    if operation == "audit":
        out["audit_ok"], out["trained_twice"] = result["ok"], result["trained_twice"]
        out["batches_lost"], out["commits_disagree"] = result["batches_lost"], len(
            result["commits_disagree_with_train_log"])
        out["batches_replayed"], out["batches_trained"] = result["batches_replayed"], result["batches_trained"]
        out["batches_awaiting_commit"] = result["batches_awaiting_commit"]
        out["checkpoint_intervals"] = result["checkpoint_intervals"]
        out["commits_calls"], out["commits_call_s"] = commits_timed.calls, round(commits_timed.seconds, 2)
    if operation == "truncate":
        out["last_update_after"] = TrainLog.of_run(log_dir).read()[-1].step if approach == "whole-list" \
            else last_step(TrainLog.of_run(log_dir))
    return out


def last_step(log: TrainLog) -> int:
    last = None
    for last in log.iter_records():
        pass
    return last.step if last else 0


# -- the driver of the whole benchmark


def write_log(log_dir: Path, updates: int, segment_updates: int) -> tuple[dict, dict[int, dict[int, CommitRecord]]]:
    """The log, and each checkpoint's commits (update -> rank -> its record), from the same records."""
    started = time.perf_counter()
    log = TrainLog.of_run(log_dir, segment_updates=segment_updates)
    ledger, interval = {}, []
    for update in range(updates):
        record = synthetic_record(update)
        log.append(record)
        interval.append(record)
        if (update + 1) % CHECKPOINT_EVERY == 0:
            ledger[update + 1], interval = commits_of(update + 1, interval), []
    size = sum(p.stat().st_size for p in log_dir.rglob("*.jsonl"))
    return ({"updates": updates, "segment_updates": segment_updates, "segments": len(log.segments()), "bytes": size,
             "bytes_per_update": round(size / updates), "write_s": round(time.perf_counter() - started, 1)}, ledger)


def batch_fields(batch_id: str) -> dict[bytes, bytes]:
    return {b"header": json.dumps({"batch_id": batch_id}).encode()}


def fill_ledger(url: str, updates: int, ledger: dict[int, dict[int, CommitRecord]]) -> dict:
    """The run's queue in Redis at the checkpoint of update `updates` (see the module docstring), written through
    the queue's own calls; the ledger's Redis memory and the size of the dict the whole-dict arm reads it into."""
    import tracemalloc

    from marge.contracts.protocol import BatchQueue

    queue = BatchQueue.connect(url, RUN_ID, SLOTS)
    queue.r.flushdb()  # the benchmark's own server: one run's queue at a time
    started = time.perf_counter()
    dead_letters = synthetic_dead_letters(updates)
    for dead in dead_letters:
        assert queue.dead_letter(dead["slot"], batch_fields(dead["batch_id"]), "synthetic")
        if dead["replayed_to_slot"] is not None:
            entry = queue.dead_letters()[-1]["entry"]
            queue.request_replay(entry)
            status, _ = queue.offer(dead["replayed_to_slot"], batch_fields(dead["batch_id"]), updates,
                                    replay_entry=entry)
            assert status == "written", (status, dead)
    steps = ledger_steps(updates)
    for step in steps:
        for rank, record in ledger[step].items():
            assert queue.commit(rank, step, [(rank, record)]) == [], (step, rank)
    for rank in range(SLOTS.world):
        queue.progress(rank, updates)
    queue.r.hset(queue.counters, "produced", updates * SLOTS.per_step)
    fill_s = time.perf_counter() - started
    counts, expected = queue.counts(), queue_counts(updates)
    assert {k: counts.get(k, 0) for k in expected} == expected, (counts, expected)
    pipe = queue.r.pipeline(transaction=False)
    for step in steps:
        pipe.memory_usage(queue.keys.ledger(step), samples=0)
    hashes_bytes = sum(int(b) for b in pipe.execute())
    index_bytes = sum(int(queue.r.memory_usage(key, samples=0) or 0)
                      for key in (queue.keys.ledger_steps, queue.keys.ledger_trained))
    tracemalloc.start()
    whole = {step: queue.commits(step) for step in steps}
    whole_dict_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert whole == {step: ledger[step] for step in steps}  # what Redis gives back is what was committed
    return {"updates": updates, "checkpoints_in_redis": len(steps), "commits_in_redis": len(steps) * SLOTS.world,
            "dead_letters": len(dead_letters), "ledger_hashes_bytes": hashes_bytes,
            "ledger_hashes_mib": round(hashes_bytes / 2**20, 2), "ledger_index_bytes": index_bytes,
            "whole_dict_mib": round(whole_dict_bytes / 2**20, 2), "fill_s": round(fill_s, 1)}


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
    if any(size < CHECKPOINT_EVERY or size % CHECKPOINT_EVERY for size in args.sizes):
        parser.error(f"--sizes: multiples of the checkpoint interval ({CHECKPOINT_EVERY} updates)")
    if args.measure:
        operation, approach, log_dir, updates = args.measure
        print(json.dumps(measure(operation, approach, Path(log_dir), int(updates))))
        return
    from services.driver.redis_server import LocalRedis

    workdir = Path(tempfile.mkdtemp(prefix="train-log-scale-", dir=args.workdir))
    # on loopback, a free port, as the tests' fixture; nothing here needs its writes to reach the disk
    server = LocalRedis(workdir / "redis", appendfsync="no", maxmemory="2gb").start()
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
    logs, measurements, redis_ledgers = [], [], []
    for size in sizes:
        for approach in ("streaming", "whole-list") if size in args.whole_list_sizes else ("streaming",):
            log_dir = workdir / f"{approach}-{size}"
            # the whole-list alternative reads the layout it was written for: one file
            written, ledger = write_log(log_dir, size, SEGMENT_UPDATES if approach == "streaming" else size + 1)
            logs.append({"approach": approach, **written})
            print(json.dumps(logs[-1]), flush=True)
            operations = ("summary", "audit", "truncate") if approach == "streaming" else ("summary", "truncate")
            for operation in operations:  # truncation last: it cuts the log
                if operation == "truncate" and approach == "streaming":
                    redis_ledgers.append(fill_ledger(redis_url, size, ledger))
                    print(json.dumps(redis_ledgers[-1]), flush=True)
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
    audits = [m for m in measurements if m["operation"] == "audit"]
    audit_rss = {(m["approach"], m["updates"]): m["peak_rss_rise_mib"] for m in audits}
    smallest, largest = min(sizes), max(sizes)
    ratio = {a: round(audit_rss[a, largest] / audit_rss[a, smallest], 2) if audit_rss.get((a, smallest)) else None
             for a in REDIS_APPROACHES} if len(sizes) > 1 else {}
    return {"machine": "2-core CPU", "python": platform.python_version(),
            "command": shlex.join(["python", "benchmarks/train_log_scale.py", *sys.argv[1:]]),
            "segment_updates": SEGMENT_UPDATES, "slots_per_update": SLOTS.per_step,
            "checkpoint_every": CHECKPOINT_EVERY,
            "sizes_left_out": left_out, "logs": logs, "measurements": measurements,
            "streamed_results_equal_whole_list_results": same,
            "audits_ok": all(m["audit_ok"] for m in audits),
            "redis_ledgers": redis_ledgers,
            "redis_audit_results_equal_streamed_results": same_redis,
            f"redis_audit_rss_ratio_{largest}_over_{smallest}": ratio}

if __name__ == "__main__":
    main()
