"""What a checkpoint's records cost as the world grows: the commit records (`CommitRecord`, one a rank and interval)
against the named alternative in the same run, the per-batch ledger they replaced (every rank's (slot, batch id)
pairs recorded, a window of two intervals, older ones retired into counts; its Lua script kept here). The figures
are the unit costs `marge plan` scales to a world of any size (`services.driver.scale_costs`).

    commit      one rank's steady-state commit on a real redis-server (appendfsync no): with records, its record of
                this interval and the previous one's again; per batch, its previous interval seen again, this
                interval recorded, the one before retired. Redis's own CPU per call (INFO commandstats, reset before
                it), for intervals of `--intervals` updates x 8 batches; and the ledger's bytes per record (MEMORY
                USAGE of a checkpoint's hash of `--world` records)
    exchange    the pickled bytes of one rank's part of the checkpoint's `all_gather_object` (services/trainer/
                rank.py): now a count and a digest, before its interval's (slot, id) pairs; plus its RNG state
    train log   one train_log.jsonl line (`UpdateRecord.to_json`) for an update of world x 8 batches, worlds 8 to
                2,048, the batch ids in runs of `--shard-batches` consecutive numbers of a shard's pass (how the
                batcher numbers them) over `--builders` builders' slot ranges

Batch ids are the batcher's shape (`BatchId`: version, pass, shard, number, 12-digit content digest).

    python benchmarks/checkpoint_records_scale.py --out benchmarks/results/checkpoint-records-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

from marge.contracts.protocol import FENCE, BatchQueue, entry_id  # noqa: E402
from marge.contracts.slots import BatchId, CommitRecord, Slots  # noqa: E402
from marge.model.checkpoint import rng_state  # noqa: E402
from services.driver.redis_server import LocalRedis  # noqa: E402
from services.driver.scale_costs import late_update_record  # noqa: E402

GRAD_ACCUM = 8
LOG_WORLDS = (8, 64, 512, 2048)

PER_BATCH_COMMIT = FENCE + """
    local ledger, window, retired, counters, retired_below = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[7]
    local per_step, n = tonumber(ARGV[3]), tonumber(ARGV[4])
    local below = tonumber(redis.call('HGET', retired_below, ARGV[1]) or '-1')
    local fresh, doubles, first = 0, {}, nil
    for i = 0, n - 1 do
        local slot, id = tonumber(ARGV[5 + 2 * i]), ARGV[6 + 2 * i]
        local seen = redis.call('HGET', ledger, id)
        if slot < below then
            -- retired before (a resumed rank commits its checkpoint's interval again): counted already
        elseif not seen then
            redis.call('HSET', ledger, id, cjson.encode({step = math.floor(slot / per_step), slot = slot}))
            redis.call('ZADD', window, slot, id)
            fresh = fresh + 1
        elseif cjson.decode(seen).slot ~= slot then
            doubles[#doubles + 1] = id
        end
        if first == nil or slot < first then first = slot end
    end
    local retiring = 0
    if first ~= nil then
        local old = redis.call('ZRANGEBYSCORE', window, '-inf', '(' .. first, 'WITHSCORES')
        for i = 1, #old, 2 do
            if redis.call('HDEL', ledger, old[i]) == 1 then
                redis.call('HINCRBY', retired, tostring(math.floor(tonumber(old[i + 1]) / per_step)), 1)
                retiring = retiring + 1
            end
        end
        redis.call('ZREMRANGEBYSCORE', window, '-inf', '(' .. first)
        if first > below then redis.call('HSET', retired_below, ARGV[1], first) end
    end
    redis.call('HINCRBY', counters, 'trained', fresh)
    redis.call('HINCRBY', counters, 'retired', retiring)
    if #doubles > 0 then redis.call('HINCRBY', counters, 'trained_twice', #doubles) end
    if ARGV[1] == '0' then redis.call('SET', KEYS[6], ARGV[2]) end
    redis.call('XTRIM', KEYS[5], 'MINID', ARGV[5 + 2 * n])
    return doubles"""

"""The per-batch commit this replaced (its keys: the ledger hash, the rank's window, the retired counts, the
counters, the rank's stream, `committed`, the retired-below marks)."""


def batch_id(shard: int, number: int) -> str:
    return str(BatchId(12, 0, shard, number, f"{(shard * 7919 + number * 2654435761) % (1 << 48):012x}"))


def rank_interval(slots: Slots, rank: int, first_step: int, steps: int) -> list[tuple[int, str]]:
    """(slot, batch id) of `rank`'s batches in updates first_step .. first_step + steps - 1."""
    return [(n, batch_id(300 + n // 1000, n)) for step in range(first_step, first_step + steps)
            for n in (slots.slot(step, rank, micro) for micro in range(slots.grad_accum))]


def redis_cpu_us(client) -> float:
    stats = client.info("commandstats")
    return sum(float(v["usec"]) for k, v in stats.items() if k in ("cmdstat_eval", "cmdstat_evalsha"))


def per_batch_commit(q: BatchQueue, rank: int, step: int, pairs: list[tuple[int, str]]) -> None:
    args = [x for slot, batch_id in pairs for x in (slot, batch_id)]
    prefix = q.keys.prefix
    keys = [f"{prefix}:ledger", f"{prefix}:ledger:slots:{rank}", f"{prefix}:ledger:retired", q.counters,
            q.keys.slots(rank), q.keys.committed, f"{prefix}:ledger:retired_below"]
    q._fenced_eval(PER_BATCH_COMMIT, keys, [rank, step, q.slots.per_step, len(pairs), *args,
                                            entry_id(step * q.slots.per_step)])


def commit_arm(server: LocalRedis, world: int, interval_steps: int) -> dict:
    """Three checkpoints of rank 0 each way; the third commit is the steady state measured."""
    slots = Slots(world, GRAD_ACCUM)
    out: dict = {"interval_updates": interval_steps, "interval_batches": interval_steps * GRAD_ACCUM}
    intervals = [rank_interval(slots, 0, k * interval_steps, interval_steps) for k in range(3)]
    records = [CommitRecord.of((k + 1) * interval_steps, k * interval_steps, pairs) for k, pairs in enumerate(intervals)]
    q = BatchQueue.connect(server.url, f"records-{interval_steps}", slots)
    q.commit(0, interval_steps, [(0, records[0])])
    q.commit(0, 2 * interval_steps, [(0, records[0]), (0, records[1])])
    q.r.config_resetstat()
    started = time.perf_counter()
    assert q.commit(0, 3 * interval_steps, [(0, records[1]), (0, records[2])]) == []
    out["records"] = {"redis_cpu_s": redis_cpu_us(q.r) / 1e6, "client_wall_s": time.perf_counter() - started}
    q.r.flushdb()
    q = BatchQueue.connect(server.url, f"per-batch-{interval_steps}", slots)
    per_batch_commit(q, 0, interval_steps, intervals[0])
    per_batch_commit(q, 0, 2 * interval_steps, intervals[0] + intervals[1])
    q.r.config_resetstat()
    started = time.perf_counter()
    per_batch_commit(q, 0, 3 * interval_steps, intervals[1] + intervals[2])
    out["per_batch"] = {"redis_cpu_s": redis_cpu_us(q.r) / 1e6, "client_wall_s": time.perf_counter() - started}
    q.r.flushdb()
    out["per_batch_over_records"] = out["per_batch"]["redis_cpu_s"] / out["records"]["redis_cpu_s"]
    return out


def ledger_bytes_per_record(server: LocalRedis, world: int) -> float:
    """MEMORY USAGE of one checkpoint's commits (`world` records) per record."""
    slots = Slots(world, GRAD_ACCUM)
    q = BatchQueue.connect(server.url, "ledger-bytes", slots)
    for rank in range(world):
        q.commit(rank, 2000, [(rank, CommitRecord.of(2000, 0, rank_interval(slots, rank, 0, 3)))])
    size = int(q.r.memory_usage(q.keys.ledger(2000), samples=0))
    q.r.flushdb()
    return size / world


def exchange(interval_steps: int) -> dict:
    slots = Slots(64, GRAD_ACCUM)
    pairs = rank_interval(slots, 0, 0, interval_steps)
    record = CommitRecord.of(interval_steps, 0, pairs)
    now = len(pickle.dumps({"commit": (record.trained, record.digest), "dead": [], "rng": rng_state()}))
    before = len(pickle.dumps({"trained": pairs, "dead": [], "rng": rng_state()}))
    empty = len(pickle.dumps({"trained": [], "dead": [], "rng": rng_state()}))
    return {"interval_batches": len(pairs), "record_part_bytes": now, "per_batch_part_bytes": before,
            "per_batch_bytes_per_interval_batch": (before - empty) / len(pairs)}


def train_log_line(world: int, shard_batches: int, builders: int) -> dict:
    """One line of a late update (`scale_costs.late_update_record`), compact and with its ids in full."""
    record = late_update_record(world, GRAD_ACCUM, builders, shard_batches)
    compact = len(record.to_json()) + 1
    full = len(json.dumps({**record.to_dict(), "slots": record.slots, "batch_ids": record.batch_ids})) + 1
    return {"world": world, "batches": len(record.slots), "line_bytes": compact, "line_bytes_ids_in_full": full}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--intervals", type=int, nargs="+", default=[125, 500, 2000],
                   help="checkpoint intervals in updates (rank 0 commits interval x 8 batches)")
    p.add_argument("--world", type=int, default=512, help="ranks the commit's slots and the ledger's hash are laid out for")
    p.add_argument("--shard-batches", type=int, default=500, help="batches of one shard's pass, for the log's runs")
    p.add_argument("--builders", type=int, default=4, help="batch builders, for the log's runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp), appendfsync="no", maxmemory="4gb") as server:
        commits = [commit_arm(server, args.world, n) for n in args.intervals]
        record_bytes = ledger_bytes_per_record(server, args.world)
    for c in commits:
        print(f"commit of an interval of {c['interval_batches']:6d} batches: Redis {c['records']['redis_cpu_s']:.5f} s "
              f"with records, {c['per_batch']['redis_cpu_s']:.3f} s per batch ({c['per_batch_over_records']:,.0f}x)",
              flush=True)
    largest = max(commits, key=lambda c: c["interval_batches"])
    report = {
        "command": "python benchmarks/checkpoint_records_scale.py" + (f" --out {args.out}" if args.out else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.machine()},
        "layout": {"world": args.world, "grad_accum": GRAD_ACCUM, "shard_batches": args.shard_batches,
                   "builders": args.builders},
        "commit": commits,
        "commit_redis_s_per_rank": max(c["records"]["redis_cpu_s"] for c in commits),
        "per_batch_commit_redis_us_per_interval_batch": 1e6 * largest["per_batch"]["redis_cpu_s"]
        / largest["interval_batches"],
        "ledger_bytes_per_record": record_bytes,
        "exchange": exchange(max(args.intervals)),
        "train_log": [train_log_line(w, args.shard_batches, min(args.builders, w)) for w in LOG_WORLDS],
    }
    report["exchange_bytes_per_rank_part"] = report["exchange"]["record_part_bytes"]
    print(json.dumps({k: report[k] for k in ("commit_redis_s_per_rank", "per_batch_commit_redis_us_per_interval_batch",
                                             "ledger_bytes_per_record", "exchange_bytes_per_rank_part")}, indent=1))
    print(json.dumps(report["train_log"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
