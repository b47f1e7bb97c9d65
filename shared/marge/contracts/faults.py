"""Faults on purpose, for the fault suite (tests/cluster/test_faults.py): the `faults:` section of a run's config.

Test-only switches, off (null) in every shipped config: they make a stage misbehave at a chosen slot or
update the way real faults do (a batch that cannot be trained, a loss that is not finite, a process that
dies in the middle of writing a checkpoint), so that the delivery guarantees are checked against the real
pipeline, never against a mock. Process kills (a trainer, the batcher, an indexer worker, Redis, the driver)
need no switch: the suite sends real signals.
"""

from __future__ import annotations

from dataclasses import dataclass

from marge.contracts.config import FieldError, at_least, one_of

COMMIT_WINDOW_POINTS = ("after_report", "after_barrier")
"""Where in a checkpoint's commit `faults.crash_in_commit_window` kills a rank."""


@dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    poison_slot: int | None = None
    """The batcher writes this slot's batch with a token id outside the vocabulary."""
    nan_loss_slot: int | None = None
    """The trainer's loss on this slot's batch is NaN."""
    crash_in_checkpoint_step: int | None = None
    """Trainer rank 0 dies (os._exit) halfway through writing the checkpoint of this update, once."""
    crash_in_commit_window: str | None = None
    """Trainer rank `crash_in_commit_window_rank` dies (os._exit), once, at this point of the checkpoint of update
    `crash_in_commit_window_step`: `after_report` (its report made, before the barrier that waits for rank 0's
    upload) or `after_barrier` (before its commit). Between its commit and its stream's trim there is no point:
    one Redis script does both."""
    crash_in_commit_window_step: int | None = None
    """The update whose checkpoint `crash_in_commit_window` is in."""
    crash_in_commit_window_rank: int = 0
    """The rank `crash_in_commit_window` kills."""
    slow_update_s: float | None = None
    """Every trainer rank waits this long after each update (the same batches, only slower): a run long enough for
    a test to fault it twice."""
    slow_index_shard_s: float | None = None
    """Every indexer worker waits this long before indexing each shard, and records each shard's start and end
    (version, shard, pid, node) in run.dir/faults/index-shards.jsonl: a build slow enough to be interrupted, and
    the record of which process indexed what, so a test can kill a node mid-build and see the build redone."""
    trace_collectives: str | None = None
    """Not a fault, a probe of the same kind: every trainer rank appends each collective it calls (its name, the
    devices of its tensors, the process group's backend and the rank's model device) to rank-<r>.jsonl in this
    folder, so a CPU test can check what a GPU run's collectives would carry."""

    def __post_init__(self) -> None:
        for name in ("poison_slot", "nan_loss_slot", "crash_in_checkpoint_step", "crash_in_commit_window_step"):
            if getattr(self, name) is not None:
                at_least(self, name, 0)
        at_least(self, "crash_in_commit_window_rank", 0)
        for name in ("slow_update_s", "slow_index_shard_s"):
            if getattr(self, name) is not None:
                at_least(self, name, 0)
        if self.crash_in_commit_window is not None:
            one_of(self, "crash_in_commit_window", COMMIT_WINDOW_POINTS)
            if self.crash_in_commit_window_step is None:
                raise FieldError("crash_in_commit_window_step", None, "the update whose checkpoint the crash is in")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.poison_slot, self.nan_loss_slot, self.crash_in_checkpoint_step,
                                           self.crash_in_commit_window, self.slow_update_s, self.slow_index_shard_s,
                                           self.trace_collectives))
