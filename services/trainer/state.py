"""A trainer rank's durable state: resuming from the run's latest checkpoint and reporting new ones to Ray Train."""

from __future__ import annotations

import tempfile
from pathlib import Path

from marge.checkpoint import restore_training, save_checkpoint
from marge.protocol import BatchId


def resume(model, optimizer, scheduler, device) -> tuple[int, list[str], int]:
    """(step, consumed batch ids, target tokens seen) from Ray Train's latest checkpoint of this run, if any."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, [], 0
    with checkpoint.as_directory() as d:
        state = restore_training(Path(d), model, optimizer, scheduler, device)
    return int(state["step"]), list(state["consumed_batches"]), int(state["tokens_seen"])


def recent_batches(batch_ids: list[str], keep_versions: int = 3) -> list[str]:
    """Consumed ids of the newest index versions only: older versions are never produced again, so their
    ids cannot come back, and the list stays bounded over a long run."""
    def version(batch_id: str) -> int:
        parsed = BatchId.parse(batch_id)
        return -1 if parsed is None else parsed.version

    if not batch_ids:
        return batch_ids
    newest = max(version(b) for b in batch_ids)
    return [b for b in batch_ids if version(b) > newest - keep_versions or version(b) < 0]


def report_checkpoint(rank: int, step: int, model, optimizer, scheduler, tokenizer_dir: Path, consumed: list[str],
                      tokens_seen: int, metrics: dict) -> None:
    """All ranks call report (it is a barrier); rank 0 attaches the checkpoint folder."""
    import ray.train
    from ray.train import Checkpoint

    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="marge-ckpt-") as tmp:
            save_checkpoint(Path(tmp), model, optimizer, scheduler, step, tokenizer_dir,
                            {"consumed_batches": consumed, "tokens_seen": tokens_seen})
            ray.train.report({**metrics, "step": step}, checkpoint=Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"step-{step:08d}")
    else:
        ray.train.report({"step": step})
