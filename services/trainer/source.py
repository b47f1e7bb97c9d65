"""Where a trainer rank's batches come from: the run's Redis stream, or a list in memory (same loop, no queue)."""

from __future__ import annotations

import time
import uuid
from typing import Protocol

from marge.protocol import BatchQueue, Delivery
from services.trainer.job import TrainerJob


class BatchSource(Protocol):
    def next(self, step: int) -> Delivery | None:
        """The next batch to train at `step`; None when the run must stop (stop asked, time up, nothing left)."""

    def ack(self, deliveries: list[Delivery], step: int) -> None:
        """The batches were trained by the update that made `step`."""

    def publish(self, record: dict) -> None:
        """Rank 0's record of an update, for progress lines and the run's summary."""


class RedisSource:
    """The pipeline's feed: the run's Redis stream, read through the consumer group.

    A batch already in the ledger (a redelivery of one an earlier step trained) is skipped; one whose
    snapshot is more than `trainer.max_staleness` updates old is dead-lettered.
    """

    def __init__(self, job: TrainerJob, rank: int, consumed: list[str]):
        self.job, self.rank = job, rank
        self.queue = BatchQueue.connect(job.redis_url, job.paths.name, job.queue)
        self.queue.ensure_group()
        if rank == 0 and consumed:  # a fresh Redis (or a lost ledger) still learns what the checkpoint trained on
            self.queue.restore_ledger(consumed)
        self.consumer = f"rank{rank}-{uuid.uuid4().hex[:8]}"

    def next(self, step: int) -> Delivery | None:
        max_staleness = self.job.trainer.max_staleness
        while True:
            if self.queue.stop_requested() or (self.job.deadline_unix is not None and time.time() > self.job.deadline_unix):
                return None
            delivery = self.queue.get(self.consumer, block_ms=self.job.queue.block_ms)
            if delivery is None:
                continue
            if self.queue.already_trained(delivery.batch.batch_id):
                self.queue.skip(delivery, "already_trained")  # a redelivery of a batch whose step already happened
                continue
            staleness = step - delivery.batch.snapshot_step
            if max_staleness and staleness > max_staleness:
                self.queue.dead_letter(delivery.entry_id, delivery.fields,
                                       f"stale: {staleness} updates behind (max {max_staleness})")
                continue
            return delivery

    def ack(self, deliveries: list[Delivery], step: int) -> None:
        self.queue.ack(deliveries, step, self.rank)

    def publish(self, record: dict) -> None:
        self.queue.publish_step(record)


class MemorySource:
    """The in-process feed: a fixed list of batches for this rank (no Redis, no other stages)."""

    def __init__(self, batches: list):
        self.batches = iter(batches)

    def next(self, step: int) -> Delivery | None:
        batch = next(self.batches, None)
        return None if batch is None else Delivery(b"", batch, 1, {})

    def ack(self, deliveries: list[Delivery], step: int) -> None:
        pass

    def publish(self, record: dict) -> None:
        pass


def source_for(job: TrainerJob, rank: int, consumed: list[str]) -> BatchSource:
    if job.memory_batches is not None:
        return MemorySource(job.memory_batches[rank])
    return RedisSource(job, rank, consumed)
