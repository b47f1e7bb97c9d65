"""A trainer rank's durable state: resuming from the run's newest good checkpoint and reporting new ones."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from marge.contracts.slots import CommitRecord
from marge.model.checkpoint import CheckpointError, CheckpointWrite, WriteSettings, checkpoint_dir_name
from marge.model.lineage import (  # noqa: F401  # IO_RETRY_DELAYS_S, with_io_retries: importable from here too
    IO_RETRY_DELAYS_S,
    good_checkpoints,
    resume_candidates,
    with_io_retries,
)
from marge.model.restore import restore_training

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    step: int = 0
    tokens_seen: int = 0
    commits: tuple[tuple[int, CommitRecord], ...] = ()
    """(rank, record) of every rank of the saving group for the checkpoint's interval: committed again on resume (a
    commit the crash cut off, or a Redis restart lost, is made good)."""
    dead: tuple[tuple[int, dict, str], ...] = ()
    """(slot, stream fields, reason) of every rank's batches the interval left out: dead-lettered again on resume
    (once per slot), so a crash between the checkpoint and the dead letters loses none of them."""
    rng: dict | None = None
    """This rank's RNG state at the checkpoint: set last, once everything that draws at start-up is built."""


def ray_checkpoint_dir() -> str | None:
    """The folder of the checkpoint Ray Train restarts this group from (after a worker failure; a local copy of one
    on remote storage), or None. Only inside a Ray Train worker."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    import pyarrow.fs

    local = isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)
    return checkpoint.path if local else checkpoint.to_directory()  # remote storage: a local copy


def resume(model, optimizer, scheduler, device, rank: int, fallback: str | None, checkpoints: Path,
           group=None, ray_checkpoint: str | None = None) -> Resumed:
    """The checkpoint this rank continues from (update, target tokens seen, the batches it covers), restored
    into the arguments.

    Chosen by the driver's rule (`marge.model.lineage.good_checkpoints`: newest first, none a later trainer
    generation abandoned, I/O errors retried) among the run's storage `checkpoints`, `ray_checkpoint` (the one Ray
    Train restarts from after a worker failure, `ray_checkpoint_dir`) and `fallback` (the one the driver chose).
    Storage counts because Ray registers a checkpoint only after every rank's report reached its controller: a rank
    killed in between makes Ray restart from the one before, whose batches later ranks may already have committed.
    Rank 0 checks the manifest (the small files' sha256, every part there with its size; a format 1 checkpoint's
    every file) and broadcasts its choice; then every rank restores together (`restore_training`: a format 2
    checkpoint is read a 1/world share per rank, on `group`, the rest broadcast; each rank checks the sha256 of the
    tensors it read), and a checkpoint any rank fails to read sends every rank to rank 0's next choice. Every rank
    resumes from the same update (checked); each gets its own RNG back."""
    import torch
    import torch.distributed as dist

    extra = [ray_checkpoint, fallback]
    distributed = dist.is_available() and dist.is_initialized()
    choices = good_checkpoints(checkpoints, extra, parts=False) if rank == 0 else None
    mine = {} if rank == 0 else {c.key: c.path for c in resume_candidates(checkpoints, extra)}
    loaded = None
    while True:
        choice: list[tuple[tuple[int, int, int], str] | None] = [None]
        if choices is not None:
            candidate = next(choices, None)
            choice = [None if candidate is None else (candidate.key, str(candidate.path))]
        if distributed:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            break
        key, path = choice[0]
        if rank != 0:
            own = mine.get((key[0], key[1], key[2]))  # a broadcast may hand a tuple back as a list
            if own is None:  # completed since this rank looked (a replaced group's last write): look again
                mine = {c.key: c.path for c in resume_candidates(checkpoints, extra)}
                own = mine.get((key[0], key[1], key[2]))
            if own is None:
                raise RuntimeError(f"rank {rank} does not see the checkpoint {path} (update {key[0]}) that rank 0 "
                                   f"resumes from: every rank must see the same checkpoint storage ({checkpoints})")
            path = str(own)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: any rank's read error

        try:
            loaded = restore_training(Path(path), model, optimizer, scheduler, device, verify=False, group=group)
        except (CheckpointError, OSError, ValueError, KeyError, RuntimeError, CheckpointException) as e:
            log.warning("rank %d: checkpoint %s cannot be read (%s); trying an older one", rank, path, e)
            loaded = None
        if distributed:
            failed = torch.tensor([0 if loaded is not None else 1])
            dist.all_reduce(failed)  # a host decision on a host tensor (gloo)
            if int(failed):
                loaded = None
        if loaded is not None:
            break
    step = int(loaded["step"]) if loaded else 0
    if distributed:
        bounds = torch.tensor([step, -step])  # a host decision on a host tensor (gloo)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        if int(bounds[0]) != -int(bounds[1]):
            raise RuntimeError(f"trainer ranks resume from different updates ({-int(bounds[1])} .. {int(bounds[0])}): "
                               f"every rank must see the same checkpoint storage ({checkpoints})")
    if loaded is None:
        return Resumed()
    rng_by_rank = loaded.get("rng_by_rank") or []
    return Resumed(step, int(loaded["tokens_seen"]),
                   tuple((int(r), CommitRecord(step, int(since), int(t), str(d)))
                         for r, since, t, d in loaded.get("commits", ())),
                   tuple((int(n), dict(f), str(r)) for n, f, r in loaded.get("dead_since_previous", ())),
                   rng_by_rank[rank] if rank < len(rng_by_rank) else None)


@dataclass(frozen=True)
class IntervalRecords:
    """What rank 0 adds to a checkpoint about the interval it closes, gathered from every rank."""

    commits: list[tuple[int, int, int, str]]
    """Every rank's commit of the interval: (rank, first update, batches trained, their `trained_digest`)."""
    dead: list[tuple[int, dict, str]]
    """(slot, fields, reason) of the batches the ranks left out."""
    rng_by_rank: list
    tokens_seen: int


def begin_checkpoint(rank: int, step: int, model, optimizer, scheduler, records: IntervalRecords, job,
                     how: WriteSettings) -> CheckpointWrite:
    """Every rank starts writing its part of the checkpoint of update `step` into the run's checkpoint storage
    and returns to training (`CheckpointWrite`: a host copy of its share, then a thread). Rank 0 adds the rest:
    optimizer param groups, schedule and the interval's `records` (every rank's RNG and commit, the batches left
    out), then the manifest once every part is durable. The tokenizer saved with it is the run's corpus's.
    The folder is named by rank 0: a run resumed from an older checkpoint writes an update again into a new
    folder (`step-N-1`), never into the one it abandoned (Ray deletes old checkpoints by folder). The ranks write
    it under a staging name and rank 0 renames it into place with its manifest: storage never holds a `step-*`
    folder half written. `how`: its process group, and the group's trainer generation, recorded in the manifest (a
    checkpoint a replaced group finishes after its successor resumed from an older one is never resumed from)."""
    import torch.distributed as dist

    root = Path(job.paths.checkpoints)
    name: list[str | None] = [None]
    if rank == 0:
        own = checkpoint_dir_name(root, step)
        name = [own]
        shutil.rmtree(root / staging_name(own), ignore_errors=True)  # left by an attempt cut short
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    extra = {"commits": records.commits, "dead_since_previous": records.dead, "rng_by_rank": records.rng_by_rank,
             "tokens_seen": records.tokens_seen}
    folder = name[0]
    if folder is None:  # every rank has rank 0's name once the broadcast returns
        raise RuntimeError(f"rank {rank}: no checkpoint folder name from rank 0 for update {step}")
    return CheckpointWrite(root / folder, model, optimizer, scheduler, step, job.paths.corpus, extra,
                           dataclasses.replace(how, background=True, staging=root / staging_name(folder),
                                               before_manifest=crash_point(job, step) if rank == 0 else None))


def staging_name(name: str) -> str:
    """The folder a checkpoint is written in before rank 0 renames it to `name` (not a `step-*`: never listed)."""
    return f".{name}.staging"


def report_checkpoint(rank: int, write: CheckpointWrite, metrics: dict) -> None:
    """Wait for a checkpoint to be complete (every part durable, the manifest written), then report it to Ray
    Train: all ranks call report; rank 0 names the folder, already in place in Ray's storage (Ray copies nothing
    and registers it, for its restarts and its pruning). Ranks other than 0 may return before rank 0's report is
    done: the caller barriers after it."""
    import ray.train
    from ray.train import Checkpoint

    write.wait()
    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="marge-ckpt-") as empty:
            ray.train.report({**metrics, "step": write.step}, checkpoint=Checkpoint.from_directory(empty),
                             checkpoint_dir_name=write.directory.name)
    else:
        ray.train.report({"step": write.step})


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
