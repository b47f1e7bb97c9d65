"""What a checkpoint's per-batch records cost as the world grows: the measured unit costs `marge plan` scales to a
world of any size (`services.driver.scale_costs`).

At every durable checkpoint each rank commits its interval's (slot, batch id) pairs, and those of the interval
before (commits are idempotent), into the ledger in the run's Redis (`BatchQueue.commit`, one Lua script), and
before it every rank hands its pairs to every other (`all_gather_object` in services/trainer/rank.py) so that rank 0
can keep them in the checkpoint. Measured here with the real code:

    commit         one rank's steady-state commit (its previous interval seen again, this interval recorded, the one
                   before retired from the window) on a real redis-server, for intervals of `--intervals` batches:
                   Redis's own CPU per call (INFO commandstats, reset before it) and the client's wall time, and from
                   them the Redis microseconds per batch of an interval (the largest interval's)
    exchange       the pickled bytes of one rank's part as `all_gather_object` sends it ((slot, id) pairs, no dead
                   letters, its RNG state), per batch of the interval and fixed
    train log      the bytes of one train_log.jsonl line (`UpdateRecord.to_json`) for an update of world x 8 batches,
                   for worlds of 8 to 2,048, per batch

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

from marge.contracts.protocol import BatchQueue  # noqa: E402
from marge.contracts.slots import BatchId, Slots  # noqa: E402
from marge.contracts.train_log import UpdateRecord  # noqa: E402
from marge.model.checkpoint import rng_state  # noqa: E402
from services.driver.redis_server import LocalRedis  # noqa: E402

WORLD, GRAD_ACCUM = 64, 8
"""The layout the commit is measured in (a rank's commit touches its own slots only: the world enters through the
slot numbers' width)."""
LOG_WORLDS = (8, 64, 512, 2048)


def batch_id(version: int, shard: int, number: int) -> str:
    return str(BatchId(version, 0, shard, number, f"{(number * 2654435761) % (1 << 48):012x}"))


def rank_interval(slots: Slots, rank: int, first_step: int, steps: int) -> list[tuple[int, str]]:
    """(slot, batch id) of `rank`'s batches in updates first_step .. first_step + steps - 1."""
    return [(slots.slot(step, rank, micro), batch_id(12, 300 + step // 1000, slots.slot(step, rank, micro)))
            for step in range(first_step, first_step + steps) for micro in range(slots.grad_accum)]


def commit_arm(server: LocalRedis, interval_steps: int) -> dict:
    """Three checkpoints of rank 0; the third commit is the steady state measured."""
    slots = Slots(WORLD, GRAD_ACCUM)
    q = BatchQueue.connect(server.url, f"commit-{interval_steps}", slots)
    intervals = [rank_interval(slots, 0, k * interval_steps, interval_steps) for k in range(3)]
    q.commit(0, interval_steps, intervals[0])
    q.commit(0, 2 * interval_steps, intervals[0] + intervals[1])
    q.r.config_resetstat()
    started = time.perf_counter()
    doubles = q.commit(0, 3 * interval_steps, intervals[1] + intervals[2])
    wall = time.perf_counter() - started
    stats = q.r.info("commandstats")
    evals = [v for k, v in stats.items() if k in ("cmdstat_eval", "cmdstat_evalsha")]
    usec = sum(float(v["usec"]) for v in evals)
    assert not doubles and q.counts()["retired"] == interval_steps * GRAD_ACCUM
    batches = interval_steps * GRAD_ACCUM
    q.r.flushdb()
    return {"interval_updates": interval_steps, "interval_batches": batches, "pairs_sent": 2 * batches,
            "redis_cpu_s": usec / 1e6, "client_wall_s": wall, "redis_us_per_interval_batch": usec / batches}


def exchange(interval_steps: int) -> dict:
    slots = Slots(WORLD, GRAD_ACCUM)
    part = {"trained": rank_interval(slots, 0, 0, interval_steps), "dead": [], "rng": rng_state()}
    empty = {"trained": [], "dead": [], "rng": rng_state()}
    full, fixed = len(pickle.dumps(part)), len(pickle.dumps(empty))
    batches = interval_steps * GRAD_ACCUM
    return {"interval_batches": batches, "part_bytes": full, "fixed_bytes": fixed,
            "bytes_per_interval_batch": (full - fixed) / batches}


def train_log_line(world: int) -> dict:
    slots = Slots(world, GRAD_ACCUM)
    step = 100_000
    first = step * slots.per_step
    ids: list[str | None] = [batch_id(12, 300, n) for n in range(first, first + slots.per_step)]
    record = UpdateRecord(step=step + 1, loss=3.21, lr=1e-4, grad_norm=0.9, batch_ids=ids,
                          slots=list(range(first, first + slots.per_step)), beta=[1.0] * 12, index_versions=[12],
                          snapshot_steps=[99_000], objectives={"marge": 3.21}, tokens=slots.per_step * 4096,
                          target_tokens=slots.per_step * 2048)
    size = len(record.to_json()) + 1  # the newline
    return {"world": world, "batches": slots.per_step, "line_bytes": size, "bytes_per_batch": size / slots.per_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--intervals", type=int, nargs="+", default=[125, 500, 2000],
                   help="checkpoint intervals in updates (rank 0 commits interval x 8 batches)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp), appendfsync="no", maxmemory="4gb") as server:
        commits = [commit_arm(server, n) for n in args.intervals]
    for c in commits:
        print(f"commit of {c['pairs_sent']:6d} pairs ({c['interval_batches']} new): Redis {c['redis_cpu_s']:.3f} s, "
              f"client {c['client_wall_s']:.3f} s", flush=True)
    largest = max(commits, key=lambda c: c["interval_batches"])
    report = {
        "command": "python benchmarks/checkpoint_records_scale.py" + (f" --out {args.out}" if args.out else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.machine()},
        "layout": {"world": WORLD, "grad_accum": GRAD_ACCUM},
        "commit": commits,
        "redis_us_per_interval_batch": largest["redis_us_per_interval_batch"],
        "exchange": exchange(max(args.intervals)),
        "train_log": [train_log_line(w) for w in LOG_WORLDS],
    }
    report["exchange_bytes_per_interval_batch"] = report["exchange"]["bytes_per_interval_batch"]
    report["train_log_bytes_per_batch"] = report["train_log"][-1]["bytes_per_batch"]
    print(json.dumps({k: report[k] for k in ("redis_us_per_interval_batch", "exchange_bytes_per_interval_batch",
                                             "train_log_bytes_per_batch")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
