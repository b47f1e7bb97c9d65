"""A trainer rank's durable state: resuming from the run's newest good checkpoint and reporting new ones."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from marge.checkpoint import (CheckpointError, checkpoint_dir_name, newest_good_checkpoint, read_manifest,
                              restore_training, save_checkpoint)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    step: int = 0
    tokens_seen: int = 0
    trained: tuple[tuple[int, str], ...] = ()
    """(slot, batch id) of every rank's batches the checkpoint's interval trained (committed again on resume)."""
    dead: tuple[tuple[int, dict, str], ...] = ()
    """(slot, stream fields, reason) of every rank's batches the interval left out: dead-lettered again on resume
    (once per slot), so a crash between the checkpoint and the dead letters loses none of them."""
    rng: dict | None = None
    """This rank's RNG state at the checkpoint: set last, once everything that draws at start-up is built."""


def resume(model, optimizer, scheduler, device, rank: int, fallback: str | None, checkpoints: Path) -> Resumed:
    """The checkpoint this rank continues from (update, target tokens seen, the batches it covers), restored
    into the arguments.

    The newest that verifies of: Ray Train's checkpoint (after a worker failure, the one it restarts from),
    `fallback` (the newest good one the driver found) and the newest good one in `checkpoints` (the run's
    storage). Storage counts because Ray registers a checkpoint only after every rank's report reached its
    controller: a rank killed in between makes Ray restart from the one before, whose batches later ranks
    may already have committed. Every rank must pick the same update (checked); each gets its own RNG back."""
    import ray.train
    import torch
    import torch.distributed as dist

    candidates: list[tuple[int, int, str]] = []  # (update, preference, path)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        import pyarrow.fs

        local = isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)
        ray_dir = checkpoint.path if local else checkpoint.to_directory()  # remote storage: a local copy
        candidates.append((checkpoint_step(ray_dir), 2, str(ray_dir)))
    for path, preference in ((fallback, 1), (newest_good_checkpoint(checkpoints), 0)):
        if path:
            candidates.append((checkpoint_step(path), preference, str(path)))
    loaded = None
    for _, _, path in sorted(candidates, reverse=True):  # newest first; of equal updates, Ray's
        try:
            loaded = restore_training(Path(path), model, optimizer, scheduler, device)
            break
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            log.warning("rank %d: checkpoint %s cannot be used (%s); trying an older one", rank, path, e)
    step = int(loaded["step"]) if loaded else 0
    if dist.is_available() and dist.is_initialized():
        bounds = torch.tensor([step, -step])  # a host decision on a host tensor (gloo)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        if int(bounds[0]) != -int(bounds[1]):
            raise RuntimeError(f"trainer ranks resume from different updates ({-int(bounds[1])} .. {int(bounds[0])}): "
                               f"every rank must see the same checkpoint storage ({checkpoints})")
    if loaded is None:
        return Resumed()
    rng_by_rank = loaded.get("rng_by_rank") or []
    return Resumed(step, int(loaded["tokens_seen"]),
                   tuple((int(n), str(b)) for n, b in loaded.get("trained_since_previous", ())),
                   tuple((int(n), dict(f), str(r)) for n, f, r in loaded.get("dead_since_previous", ())),
                   rng_by_rank[rank] if rank < len(rng_by_rank) else None)


def checkpoint_step(path) -> int:
    """The update a checkpoint folder holds (-1 when its manifest cannot be read: tried last)."""
    try:
        return int(read_manifest(Path(path), verify=False)["step"])
    except (CheckpointError, OSError, ValueError, KeyError):
        return -1


def report_checkpoint(rank: int, step: int, model, optimizer, scheduler, tokenizer_dir: Path,
                      trained: list[tuple[int, str]], dead: list[tuple[int, dict, str]], rng_by_rank: list,
                      tokens_seen: int, metrics: dict, job) -> None:
    """All ranks call report; rank 0 attaches the checkpoint: weights, optimizer, schedule, update, every rank's
    RNG, the (slot, batch id) every rank trained since the previous checkpoint and the (slot, fields, reason) of
    those it left out. Ranks other than 0 may return before rank 0's upload is done: the caller barriers after
    it. A run resumed from an older checkpoint writes an update again into a new folder (`step-N-1`): Ray deletes
    old checkpoints by folder, and the abandoned one it still lists must not take the new one with it."""
    import ray.train
    from ray.train import Checkpoint

    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="marge-ckpt-") as tmp:
            crash = crash_point(job, step)
            save_checkpoint(Path(tmp), model, optimizer, scheduler, step, tokenizer_dir,
                            {"trained_since_previous": trained, "dead_since_previous": dead, "rng_by_rank": rng_by_rank,
                             "tokens_seen": tokens_seen},
                            before_manifest=crash)
            ray.train.report({**metrics, "step": step}, checkpoint=Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=checkpoint_dir_name(job.paths.checkpoints, step))
    else:
        ray.train.report({"step": step})


def crash_point(job, step: int):
    """The test-only `faults.crash_in_checkpoint_step`: die once, with the checkpoint half written."""
    if job.faults.crash_in_checkpoint_step != step:
        return None
    marker = job.paths.run_dir / "faults" / f"crashed-in-checkpoint-{step}"
    if marker.exists():
        return None

    def die() -> None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("1")
        log.error("faults.crash_in_checkpoint_step: dying halfway through the checkpoint of update %d", step)
        os._exit(17)

    return die
