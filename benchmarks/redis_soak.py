"""Redis soak: the pipeline's Redis memory over a long run, against `marge plan`'s prediction.

Runs the tiny recipe (`deploy/configs/tiny.yaml`: two DDP trainer ranks, the Ray indexer and batcher, its own
redis-server on loopback) for `--steps` updates and samples the server every `--every` seconds: INFO memory
(`used_memory_dataset`: the keys' memory, without Redis's own start-up overhead) and MEMORY USAGE of each of the
run's keys. It reports

  * the peak of the run's keys against `services.driver.plan.redis_footprint` for the same config (goal: within
    2x), both with the plan's own message-size estimate and with the mean message measured here;
  * whether memory is flat: the peak over the last third of the run against the peak over the middle third
    (after the first checkpoints; goal <= 1.1), and the growth per 1,000 updates;
  * the named alternative: a per-batch ledger that is never trimmed (one hash entry a trained batch), at this run's
    length and at the paper's 450k updates x 256 batches, priced at the 190 bytes an entry such a ledger measured
    (`PER_BATCH_ENTRY_BYTES`), against the commit records measured here;
  * the per-entry costs the plan's constants come from, and `marge audit`'s verdict on the run (nothing lost,
    nothing trained twice, every checkpoint interval adding up to its ranks' commits).

    python benchmarks/redis_soak.py --steps 2000 --out benchmarks/results/redis-soak-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench")

PAPER_UPDATES, PAPER_BATCHES_PER_UPDATE = 450_000, 256
PER_BATCH_ENTRY_BYTES = 199
"""One batch in a per-batch ledger (its hash field and sorted-set member), as this soak measured that layout on a
2-core CPU, 2026-11-26 (before commit records)."""


def key_bytes(r, key: str) -> int:
    return int(r.memory_usage(key, samples=0) or 0)


def sample(queue, world: int) -> dict:
    """One reading of the server: INFO memory and each of the run's keys."""
    r, keys = queue.r, queue.keys
    info = r.info("memory")
    streams = [keys.slots(rank) for rank in range(world)]
    ledger = [keys.ledger(step) for step in queue.committed_steps()] + [keys.ledger_steps, keys.ledger_trained]
    last = queue.last_step() or {}
    return {
        "time": time.time(), "step": int(last.get("step", 0)),
        "used_memory": int(info["used_memory"]), "used_memory_dataset": int(info["used_memory_dataset"]),
        "streams_bytes": sum(key_bytes(r, k) for k in streams), "stream_entries": sum(int(r.xlen(k)) for k in streams),
        "ledger_bytes": sum(key_bytes(r, k) for k in ledger),
        "ledger_records": sum(int(r.hlen(k)) for k in ledger[:-2]),
        "step_records_bytes": key_bytes(r, keys.steps) + key_bytes(r, keys.trainer_status),
        "step_records": int(r.llen(keys.steps)),
    }


def soak(steps: int, every_s: float, workdir: Path, overrides: list[str]) -> dict:
    from marge.contracts.corpus import Corpus
    from marge.contracts.protocol import BatchQueue
    from services.driver.config import load_config
    from services.driver.pipeline import run_pipeline
    from services.driver.plan import redis_footprint
    from services.driver.redis_server import LocalRedis
    from services.ops.audit import audit

    server = LocalRedis(workdir / "redis", maxmemory="1gb").start()
    try:
        cfg = load_config(REPO / "deploy/configs/tiny.yaml",
                          ["run.name=redis-soak", f"run.dir={workdir / 'run'}", f"run.max_steps={steps}",
                           f"trainer.total_steps={max(steps, 4000)}", f"redis.url={server.url}",
                           "run.progress_every_s=60", *overrides])
        world = cfg.trainer.num_workers
        queue = BatchQueue.connect(server.url, cfg.run.name, cfg.slots())
        empty = int(queue.r.info("memory")["used_memory_dataset"])
        samples: list[dict] = []
        done = threading.Event()

        def sampler() -> None:
            while not done.wait(every_s):
                try:
                    samples.append(sample(queue, world))
                except Exception as e:  # a reading lost to a busy server is a gap, not a failed soak
                    log.warning("sample failed: %s", e)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        started = time.time()
        try:
            summary = run_pipeline(cfg)
        finally:
            done.set()
            thread.join()
        wall = time.time() - started
        samples.append(sample(queue, world))
        verdict = audit(cfg, queue)
    finally:
        server.stop()

    manifest = Corpus.open(cfg.data.corpus).manifest
    mean_doc_tokens = manifest["num_tokens"] / max(1, manifest["num_documents"])
    with_entries = [s for s in samples if s["stream_entries"]]
    stream_entry = max(s["streams_bytes"] / s["stream_entries"] for s in with_entries) if with_entries else None
    with_ledger = [s for s in samples if s["ledger_records"]]
    ledger_record = max(s["ledger_bytes"] / s["ledger_records"] for s in with_ledger) if with_ledger else None
    last_records = [s for s in samples if s["step_records"]]
    step_record = last_records[-1]["step_records_bytes"] / last_records[-1]["step_records"] if last_records else None
    peak = max(s["used_memory_dataset"] for s in samples) - empty
    thirds = [[s["used_memory_dataset"] - empty for s in samples if k * steps / 3 <= s["step"] < (k + 1) * steps / 3]
              for k in range(3)]
    middle, last = (max(thirds[1]) if thirds[1] else None), (max(thirds[2]) if thirds[2] else None)
    predicted = redis_footprint(cfg, mean_doc_tokens)
    predicted_measured_message = redis_footprint(cfg, mean_doc_tokens, message=stream_entry)
    per_step = cfg.slots().per_step
    return {
        "config": "deploy/configs/tiny.yaml", "overrides": overrides, "steps": steps, "wall_s": round(wall, 1),
        "batches_per_update": per_step, "checkpoint_every": cfg.trainer.checkpoint_every,
        "queue_max_depth": cfg.queue.max_depth,
        "updates_trained": summary.get("steps"),
        "samples": len(samples),
        "peak_run_bytes": peak,
        "predicted_peak_bytes": predicted["peak_bytes"], "predicted_parts": predicted["parts"],
        "predicted_over_measured": predicted["peak_bytes"] / max(peak, 1),
        "predicted_with_measured_message_bytes": predicted_measured_message["peak_bytes"],
        "flat": {"peak_middle_third_bytes": middle, "peak_last_third_bytes": last,
                 "last_over_middle": (last / middle) if middle and last else None},
        "per_entry_bytes": {"stream_entry_with_message": stream_entry, "ledger_record_with_keys": ledger_record,
                            "step_record": step_record, "plan_message_estimate": predicted["message_bytes"]},
        "alternative_untrimmed_ledger": {
            "what": "one hash entry per trained batch, never trimmed, at PER_BATCH_ENTRY_BYTES an entry",
            "bytes_at_this_run_end": PER_BATCH_ENTRY_BYTES * steps * per_step,
            "ledger_bytes_at_this_run_end": samples[-1]["ledger_bytes"],
            "bytes_at_paper_scale": PER_BATCH_ENTRY_BYTES * PAPER_UPDATES * PAPER_BATCHES_PER_UPDATE,
            "records_at_paper_scale": redis_footprint(cfg, mean_doc_tokens, steps=PAPER_UPDATES)["parts"]["ledger"],
        },
        "audit": {k: verdict[k] for k in ("ok", "steps", "batches_trained", "batches_lost", "trained_twice",
                                          "commits_disagree_with_train_log", "checkpoint_intervals")},
        "trace": [{k: s[k] for k in ("step", "used_memory_dataset", "streams_bytes", "ledger_bytes",
                                     "step_records_bytes", "stream_entries", "ledger_records")} for s in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="SECTION.KEY=VALUE for the tiny config")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="marge-redis-soak-") as tmp:
        result = soak(args.steps, args.every, Path(tmp), args.overrides)
    result["machine"] = f"{platform.machine()}, {__import__('os').cpu_count()} cores"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}, indent=1))
    ok = result["audit"]["ok"] and 0.5 <= result["predicted_over_measured"] <= 2.0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
