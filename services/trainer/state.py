"""A trainer rank's durable state: resuming from the run's newest good checkpoint and reporting new ones."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from marge.checkpoint import CheckpointError, restore_training, save_checkpoint
from marge.utils import atomic_write_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    step: int = 0
    tokens_seen: int = 0
    trained: tuple[tuple[int, str], ...] = ()
    """(slot, batch id) of every rank's batches the checkpoint's interval trained (committed again on resume)."""
    rng: dict | None = None
    """This rank's RNG state at the checkpoint: set last, once everything that draws at start-up is built."""


def resume(model, optimizer, scheduler, device, rank: int, fallback: str | None) -> Resumed:
    """The checkpoint this rank continues from (update, target tokens seen, the batches it covers), restored
    into the arguments.

    Ray Train's newest checkpoint of the run first (after a worker failure, the one it restarts from); if it is
    missing or does not verify, `fallback` (the newest good one the driver found); else a fresh start. Each rank
    gets its own RNG state back."""
    import ray.train

    candidates = []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        candidates.append(checkpoint)
    if fallback:
        candidates.append(fallback)
    for candidate in candidates:
        try:
            if isinstance(candidate, str):
                state = restore_training(Path(candidate), model, optimizer, scheduler, device)
            else:
                with candidate.as_directory() as d:
                    state = restore_training(Path(d), model, optimizer, scheduler, device)
        except CheckpointError as e:
            log.warning("rank %d: checkpoint %s cannot be used (%s); trying an older one", rank, candidate, e)
            continue
        rng_by_rank = state.get("rng_by_rank") or []
        return Resumed(int(state["step"]), int(state["tokens_seen"]),
                       tuple((int(n), str(b)) for n, b in state.get("trained_since_previous", ())),
                       rng_by_rank[rank] if rank < len(rng_by_rank) else None)
    return Resumed()


def truncate_log(path: Path, step: int) -> None:
    """Drop train_log.jsonl lines of updates after `step` (a crash left them; the resumed run writes them again)."""
    if not Path(path).exists():
        return
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError):  # a torn last line from a crash mid-write
            continue
    if len(kept) != len(lines):
        atomic_write_text(Path(path), "".join(line + "\n" for line in kept))


def report_checkpoint(rank: int, step: int, model, optimizer, scheduler, tokenizer_dir: Path,
                      trained: list[tuple[int, str]], rng_by_rank: list, tokens_seen: int, metrics: dict, job) -> None:
    """All ranks call report (it is a barrier that returns once the checkpoint is persisted); rank 0 attaches the
    checkpoint: weights, optimizer, schedule, update, every rank's RNG and the (slot, batch id) every rank
    trained since the previous checkpoint."""
    import ray.train
    from ray.train import Checkpoint

    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="marge-ckpt-") as tmp:
            crash = crash_point(job, step)
            save_checkpoint(Path(tmp), model, optimizer, scheduler, step, tokenizer_dir,
                            {"trained_since_previous": trained, "rng_by_rank": rng_by_rank, "tokens_seen": tokens_seen},
                            before_manifest=crash)
            ray.train.report({**metrics, "step": step}, checkpoint=Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"step-{step:08d}")
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
