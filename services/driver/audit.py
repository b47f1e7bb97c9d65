"""`marge audit` and `marge queue`: what a run trained, checked against its checkpoint, ledger and logs.

The account of one run (the `marge.protocol` delivery rules), from the newest good checkpoint C:

    slots of updates 0..C-1   each trained (in the ledger's window, with the batch id train_log.jsonl gives
                              that slot; for an update whose batches left the window, in train_log.jsonl, as
                              many as the ledger's retired count of that update)
                              or dead-lettered (in the dead-letter stream with that slot)
                              (or in the checkpoint's record of its last interval, when the driver died
                              before the ranks recorded it in Redis: `batches_awaiting_commit`)
    lost                      such a slot in none of these
    trained twice             a batch id the ledger recorded for two slots (counted at commit), or that
                              train_log.jsonl shows in two updates up to C
    content changed           a batch position (version, pass, shard, n) that the ledger, train_log.jsonl or the
                              dead letters name with two content digests (`BatchId`): a builder made it again
                              with other content, so "the same batch" was not the same
    pending                   written into the streams, not yet covered by a checkpoint

The run's Redis is opened as the run left it: a `redis.url` from --redis-url or MARGE_REDIS_URL, else the
run's private server, started from its AOF for the audit (and stopped again) when it is not running.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from marge.checkpoint import newest_good_checkpoint, read_manifest
from marge.protocol import BatchId, BatchQueue
from services.driver.config import PipelineConfig, load_config, redis_url_from_environment
from services.driver.redis_server import LocalRedis, private_conf_dir
from marge.train_log import read_train_log


def run_config_of(run_dir: Path) -> PipelineConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --run must be the run.dir of a `marge pretrain` run")
    return load_config(path)


@contextlib.contextmanager
def run_queue(run_dir: Path, redis_url: str | None = None) -> Iterator[tuple[PipelineConfig, BatchQueue]]:
    """The run's config and its queue on the run's Redis (see the module docstring)."""
    cfg = run_config_of(run_dir)
    url = redis_url or redis_url_from_environment()
    if url:
        yield cfg, BatchQueue.connect(url, cfg.run.name, cfg.slots())
        return
    data_dir, conf_dir = Path(run_dir) / "redis", private_conf_dir(Path(run_dir))
    if not (conf_dir / "redis.conf").exists() and single_process_run(Path(run_dir)):
        raise ValueError(f"{run_dir} was trained in a single process (`marge experiment learning --single-process`: "
                         "its checkpoints are in checkpoints/, not ray_train/): it had no batch queue, so there is "
                         "nothing to audit; its train_log.jsonl lists the batches of every update")
    if not (conf_dir / "redis.conf").exists():
        raise FileNotFoundError(f"{conf_dir}/redis.conf not found: the run used an external Redis (set "
                                "MARGE_REDIS_URL_FILE or MARGE_REDIS_URL, or pass --redis-url), or its private "
                                "server ran as another user or with another "
                                "MARGE_STATE_DIR")
    server = LocalRedis.reopen(data_dir, conf_dir).start()
    try:
        yield cfg, BatchQueue.connect(server.url, cfg.run.name, cfg.slots())
    finally:
        if server.process is not None:  # started here for the audit; a server that a live driver owns stays
            server.stop()


def single_process_run(run_dir: Path) -> bool:
    """Whether `run_dir` is a single-process run's (checkpoints in checkpoints/, none under ray_train/)."""
    return (run_dir / "checkpoints").is_dir() and not (run_dir / "ray_train").exists()


def checkpoint_deliveries(checkpoint: Path | None) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(slot, batch id) trained and (slot, reason) left out in the checkpoint's last interval (its tensors are
    memory-mapped, not read)."""
    if checkpoint is None:
        return [], []
    import torch

    state = torch.load(Path(checkpoint) / "training_state.pt", map_location="cpu", weights_only=True, mmap=True)
    return ([(int(n), str(b)) for n, b in state.get("trained_since_previous", ())],
            [(int(n), str(r)) for n, _, r in state.get("dead_since_previous", ())])


def content_changed(batch_ids) -> list[dict]:
    """Positions named with more than one content digest among `batch_ids` (ids without a digest are skipped)."""
    contents: dict[str, set[str]] = {}
    for text in batch_ids:
        parsed = BatchId.parse(text) if text else None
        if parsed is not None and parsed.content:
            contents.setdefault(parsed.position, set()).add(parsed.content)
    return [{"position": p, "contents": sorted(c)} for p, c in sorted(contents.items()) if len(c) > 1]


def audit(cfg: PipelineConfig, queue: BatchQueue) -> dict:
    """The run's account (see the module docstring); `ok` is whether nothing was lost or trained twice."""
    slots = cfg.slots()
    checkpoint = newest_good_checkpoint(cfg.paths().checkpoints)
    step = int(read_manifest(checkpoint, verify=False)["step"]) if checkpoint else 0
    covered = step * slots.per_step
    counts = queue.counts()
    ledger = queue.ledger_entries()
    trained_slot = {entry["slot"]: batch_id for batch_id, entry in ledger.items() if entry["slot"] < covered}
    records = read_train_log(cfg.paths().run_dir, through_step=step)
    logged = {n: b for r in records for n, b in r.trained_slots().items()}
    # updates whose batches left the ledger's window: their slots are the train log's, as many as the ledger counted
    retired = {s: k for s, k in queue.retired_by_update().items() if s < step}
    from_log = {n: b for n, b in logged.items() if n not in trained_slot and slots.step_of(n) in retired}
    logged_per_update = Counter(slots.step_of(n) for n in from_log)
    retired_disagree = sorted(s for s in retired if logged_per_update[s] != retired[s])
    trained_slot.update(from_log)
    dead = queue.dead_letters()
    dead_slots = {d["slot"] for d in dead}
    # the checkpoint is the commit point: its last interval counts even if the driver died before the ranks
    # recorded it in Redis (the resumed run records it first thing)
    trained_in_checkpoint, dead_in_checkpoint = checkpoint_deliveries(checkpoint)
    awaiting = {n: b for n, b in trained_in_checkpoint if n not in trained_slot}
    awaiting_dead = {n for n, _ in dead_in_checkpoint if n not in dead_slots}
    trained_slot.update(awaiting)
    lost = [n for n in range(covered) if n not in trained_slot and n not in dead_slots and n not in awaiting_dead]

    logged_twice = [b for b, k in Counter(b for r in records for b in r.trained_slots().values()).items() if k > 1]
    disagree = sorted(n for n, b in logged.items() if n in trained_slot and trained_slot[n] != b)
    trained_twice = counts.get("trained_twice", 0) + len(logged_twice)
    changed = content_changed([*ledger, *(b for r in records for b in r.batch_ids), *(d["batch_id"] for d in dead)])
    return {
        "ok": not lost and trained_twice == 0 and not disagree and not retired_disagree and not changed,
        "steps": step, "checkpoint": str(checkpoint) if checkpoint else None,
        "committed_step": counts["committed_step"],
        "batches_produced": counts.get("produced", 0),
        "batches_trained": len(trained_slot),
        "batches_lost": len(lost), "lost_slots": lost[:100],
        "trained_twice": trained_twice, "trained_twice_ids": logged_twice[:100],
        "ledger_disagrees_with_train_log": disagree[:100],
        "content_changed": changed[:100],
        "batches_retired_from_ledger": sum(retired.values()),
        "retired_counts_disagree_with_train_log": retired_disagree[:100],
        "batches_pending": counts["pending"],
        "batches_awaiting_commit": len(awaiting) + len(awaiting_dead),
        "batches_dead_lettered": sum(1 for d in dead if d["replayed_to_slot"] is None) + len(awaiting_dead),
        "batches_replayed": sum(1 for d in dead if d["replayed_to_slot"] is not None),
        "train_log_updates": len(records),
    }
