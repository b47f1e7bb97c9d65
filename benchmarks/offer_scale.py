"""Redis CPU per offer against the world size: the batcher's one-script write of a batch (`BatchQueue.offer`) from 8 to
2,048 simulated trainer ranks, next to the named alternative in the same run.

An offer checks the backpressure (is the slot's update fewer than `lookahead` updates ahead of the slowest rank?)
and writes the batch, in one Lua script. How it finds the slowest rank decides how it scales:

  ranked (the queue's)     each rank's progress is also a member of one sorted set, and the script reads its first
                           member: O(log world)
  per-rank keys (before)   the script read every rank's progress key (the keys passed to the script, one per rank):
                           O(world), the layout this replaced, run here from its own copy of the script

For each world size the ranks report progress, then `--offers` batches of `--message-bytes` are offered (lookahead
wide enough that every offer writes). Redis's own CPU time per call comes from INFO commandstats (`cmdstat_eval`,
reset before each arm); the client's wall time per offer is reported beside it. Then the ceiling one Redis sets on
a writer, 1 / (CPU per offer), against what the trainers need at 0.3 s an update.

    python benchmarks/offer_scale.py --out benchmarks/results/offer-scale-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

from marge.contracts.protocol import BatchQueue, entry_id  # noqa: E402
from marge.contracts.slots import Slots  # noqa: E402
from services.driver.redis_server import LocalRedis  # noqa: E402

WORLDS = (8, 64, 256, 1024, 2048)
SECONDS_PER_UPDATE = 0.3
"""The paper-scale update the need is priced at (an assumed 0.3 s an update on GPUs)."""

PER_RANK_KEYS_OFFER = """
        local slot, per_step, lookahead, known = tonumber(ARGV[1]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
        local cursor = tonumber(redis.call('GET', KEYS[2]) or '0')
        if slot < cursor then return {'already', cursor} end
        local slowest = nil
        for i = 6, #KEYS do
            local p = tonumber(redis.call('GET', KEYS[i]) or '0')
            if slowest == nil or p < slowest then slowest = p end
        end
        if math.floor(slot / per_step) >= slowest + lookahead then return {'ahead', slowest} end
        if #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) > 0 then
            redis.call('SET', KEYS[2], slot + 1)
            return {'already', slot + 1}
        end
        redis.call('XADD', KEYS[1], ARGV[2], unpack(ARGV, 7))
        redis.call('SET', KEYS[2], slot + 1)
        redis.call('HINCRBY', KEYS[3], 'produced', 1)
        return {'written', slot + 1}"""
"""The offer before the ranked progress set, cut to the branch every offer here takes (no replays)."""


def per_rank_keys_offer(q: BatchQueue, slot: int, fields: dict[bytes, bytes], lookahead: int) -> tuple[str, int]:
    slots = q._slots()
    flat = [x for pair in {b"slot": str(slot).encode(), **fields}.items() for x in pair]
    progress = [q.keys.progress(r) for r in range(slots.world)]
    status, value = q.r.eval(PER_RANK_KEYS_OFFER, 5 + len(progress), q.keys.slots(slots.rank_of(slot)),
                             q.keys.next_slot, q.counters, q.keys.replay_requests, q.keys.replays, *progress,
                             slot, entry_id(slot), "", slots.per_step, lookahead, -1, *flat)
    return status.decode(), int(value)


def eval_cpu(r) -> tuple[int, float]:
    """(calls, microseconds) of EVAL since the last CONFIG RESETSTAT."""
    stats = r.info("commandstats").get("cmdstat_eval", {"calls": 0, "usec": 0})
    return int(stats["calls"]), float(stats["usec"])


def arm(server: LocalRedis, world: int, offers: int, message: bytes, ranked: bool) -> dict:
    q = BatchQueue.connect(server.url, f"offer-{'ranked' if ranked else 'keys'}-{world}", Slots(world, 1))
    for rank in range(world):  # every rank has reported: the slowest is at update 0
        q.progress(rank, 0)
    lookahead = offers // world + 2
    q.r.config_resetstat()
    started = time.perf_counter()
    for slot in range(offers):
        status = (q.offer(slot, {b"data": message}, lookahead) if ranked
                  else per_rank_keys_offer(q, slot, {b"data": message}, lookahead))[0]
        assert status == "written", status
    wall = time.perf_counter() - started
    calls, usec = eval_cpu(q.r)
    assert calls == offers, (calls, offers)
    for rank in range(world):
        q.r.delete(q.keys.slots(rank))  # keep the server's memory small for the next arm
    return {"redis_cpu_us_per_offer": usec / calls, "client_wall_us_per_offer": 1e6 * wall / offers,
            "redis_ceiling_offers_per_s": calls / (usec / 1e6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offers", type=int, default=4000)
    p.add_argument("--message-bytes", type=int, default=8400, help="a batch of 2,100 tokens at 4 bytes a token")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    message = bytes(range(256)) * (args.message_bytes // 256) + b"x" * (args.message_bytes % 256)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp), appendfsync="no", maxmemory="4gb") as server:
        for world in WORLDS:
            results[str(world)] = {"ranked": arm(server, world, args.offers, message, ranked=True),
                                   "per_rank_keys": arm(server, world, args.offers, message, ranked=False)}
            row = results[str(world)]
            print(f"world {world:5d}: Redis CPU per offer {row['ranked']['redis_cpu_us_per_offer']:6.1f} us ranked, "
                  f"{row['per_rank_keys']['redis_cpu_us_per_offer']:7.1f} us per-rank keys", flush=True)
    smallest, largest = results[str(WORLDS[0])], results[str(WORLDS[-1])]
    summary = {
        "cpu_per_offer_largest_over_smallest_world": {
            name: largest[name]["redis_cpu_us_per_offer"] / smallest[name]["redis_cpu_us_per_offer"]
            for name in ("ranked", "per_rank_keys")},
        "per_rank_keys_over_ranked_at_largest": largest["per_rank_keys"]["redis_cpu_us_per_offer"]
        / largest["ranked"]["redis_cpu_us_per_offer"],
        "batches_per_s_needed_at_0.3s_per_update": {str(w): w / SECONDS_PER_UPDATE for w in WORLDS},
    }
    report = {"command": "python benchmarks/offer_scale.py" + (f" --out {args.out}" if args.out else ""),
              "offers_per_arm": args.offers, "message_bytes": args.message_bytes,
              "machine": {"cpus": os.cpu_count(), "platform": platform.machine()}, "worlds": results, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
