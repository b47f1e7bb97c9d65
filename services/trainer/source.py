"""Where a trainer rank's batches come from: its slots in the run's Redis streams, or a list in memory."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from marge.contracts.protocol import BatchQueue, Delivery, SlotGone, Stalled
from marge.contracts.slots import CommitRecord, Slots
from services.trainer.job import TrainerJob

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    def get(self, slot: int) -> Delivery | None:
        """The batch of `slot`, waiting for it; None when the run must stop (stop asked, time up, nothing left)."""

    def progress(self, step: int) -> None:
        """This rank has trained every update before `step`."""

    def commit(self, step: int, records: list[tuple[int, CommitRecord]]) -> None:
        """The checkpoint of update `step` is durable: `records` ((rank, record) of checkpoint intervals) count."""

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Keep a batch that could not be trained, with the reason."""

    def publish(self, record: dict) -> None:
        """Rank 0's record of an update, for progress lines."""

    def stopping(self) -> bool:
        """The run must stop at this step boundary (stop asked, time up), whatever batches are in hand."""

    def agree_with(self, step: int) -> None:
        """Rank 0, as a group starts: make the feed agree with the checkpoint of `step` the group resumed from."""

    def start_generation(self) -> int:
        """Rank 0, as a group starts, before any write: the group's generation (every older group's writes are
        refused from now on)."""

    def join_generation(self, generation: int) -> None:
        """Every rank: write as a member of `generation` (rank 0's `start_generation`)."""


class RedisSource:
    """The pipeline's feed: this rank's stream in the run's Redis, read slot by slot."""

    def __init__(self, job: TrainerJob, rank: int, resumed_step: int = 0):
        self.job, self.rank, self.resumed_step = job, rank, resumed_step
        self.slots = job.slots
        if job.redis_url_file is None:
            raise ValueError("a trainer fed from Redis needs the file of the run's Redis URL (TrainerJob.redis_url_file)")
        self.queue = BatchQueue.from_url_file(job.redis_url_file, job.paths.name, self.slots)

    def stopping(self) -> bool:
        return self.queue.stop_requested() or (self.job.deadline_unix is not None and time.time() > self.job.deadline_unix)

    WAIT_REPORT_S = 60.0
    """How often a rank waiting for a batch says so in its log."""

    def get(self, slot: int) -> Delivery | None:
        """The batch of `slot`, waiting for it (saying so every `WAIT_REPORT_S`); None when the run must stop.
        Raises `Stalled` after `queue.stall_s` without it."""
        started = reported = time.monotonic()
        while True:
            if self.stopping():
                return None
            waited = time.monotonic() - started
            if waited > self.job.queue.stall_s:
                raise Stalled(f"trainer rank {self.rank} waited {waited:.0f} s (queue.stall_s) for slot {slot} "
                              f"(update {slot // self.slots.per_step}): {self.where_the_queue_stands(slot)}. Check "
                              "the batch builders and the indexer (`marge status`, the Ray dashboard); raise "
                              "queue.stall_s if an index build takes longer than that on purpose")
            if time.monotonic() - reported > self.WAIT_REPORT_S:
                reported = time.monotonic()
                log.warning("rank %d has waited %.0f s for slot %d: %s", self.rank, waited, slot,
                            self.where_the_queue_stands(slot))
            try:
                delivery = self.queue.get(slot, block_ms=self.job.queue.block_ms)
            except SlotGone as gone:
                raise SlotGone(gone.slot, gone.rank, gone.later_slot, advice=(
                    f"This rank resumed from the checkpoint of update {self.resumed_step} and needs update "
                    f"{slot // self.slots.per_step}, which the queue no longer holds: the queue was not reset to "
                    "that checkpoint (a restart fell back to an older checkpoint than the one it was reset to). "
                    "Start the run again (`marge pretrain`, same config): the driver resets the queue to the "
                    "checkpoint it resumes from")) from None
            if delivery is not None:
                return delivery

    def where_the_queue_stands(self, slot: int) -> str:
        group = self.slots.group_of(slot)
        return (f"batch builder {group}, which writes it, is at slot {self.queue.next_slot(group)}; "
                f"{self.queue.describe_progress()}")

    def start_generation(self) -> int:
        return self.queue.start_generation()

    def join_generation(self, generation: int) -> None:
        self.queue.join_generation(generation)

    def agree_with(self, step: int) -> None:
        """A group restarted by Ray Train from the checkpoint of `step` needs the slots since `step` again, which
        the ranks' progress (and any commit after it) trimmed from the streams: the queue is reset to `step` (the
        later checkpoints' commit records go, the builders write the same batches into the same slots
        again), as the driver does when a run starts. Said in the log."""
        if self.queue.needs_reset(step):
            committed = self.queue.committed_step()
            log.warning("the trainer group resumed from the checkpoint of update %d (last commit: update %d): "
                        "resetting the queue to update %d; the builders write its slots again%s", step, committed,
                        step, f" (updates {step}-{committed - 1} are trained again, and counted once)"
                        if committed > step else "")
            self.queue.reset_from(step)

    def progress(self, step: int) -> None:
        self.queue.progress(self.rank, step)

    def commit(self, step: int, records: list[tuple[int, CommitRecord]]) -> None:
        self.queue.commit(self.rank, step, records)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self.queue.dead_letter(delivery.slot, delivery.fields, reason)

    def publish(self, record: dict) -> None:
        self.queue.publish_step(record)


class MemorySource:
    """The in-process feed: this rank's batches in slot order (no Redis, no other stages)."""

    def __init__(self, batches: list, slots: Slots, rank: int):
        self.by_slot = {}
        for k, batch in enumerate(batches):  # the k-th batch of this rank: update k // G, micro-step k % G
            self.by_slot[slots.slot(k // slots.grad_accum, rank, k % slots.grad_accum)] = batch
        self.dead: list[tuple[int, str]] = []

    def agree_with(self, step: int) -> None:
        pass

    def start_generation(self) -> int:
        return 0

    def join_generation(self, generation: int) -> None:
        pass

    def get(self, slot: int) -> Delivery | None:
        batch = self.by_slot.get(slot)
        return None if batch is None else Delivery(slot, batch, {})

    def progress(self, step: int) -> None:
        pass

    def commit(self, step: int, records: list[tuple[int, CommitRecord]]) -> None:
        pass

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self.dead.append((delivery.slot, reason))

    def publish(self, record: dict) -> None:
        pass

    def stopping(self) -> bool:
        return False


def source_for(job: TrainerJob, rank: int, resumed_step: int = 0) -> BatchSource:
    """This rank's feed; `resumed_step`: the checkpoint it resumed from (named when a slot it needs is gone)."""
    if job.memory_batches is not None:
        return MemorySource(job.memory_batches[rank], job.slots, rank)
    return RedisSource(job, rank, resumed_step)
