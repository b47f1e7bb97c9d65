"""A small audited run the train-log tests share (with and without Redis)."""

from __future__ import annotations

from marge.contracts.slots import BatchId, Slots
from marge.contracts.train_log import TrainLog, UpdateRecord

SLOTS = Slots(world=2, grad_accum=1)


def scheduled_ids(count: int) -> list[str]:
    """Batch ids in the batcher's order: version, pass, shards in a seeded order, numbers within a shard."""
    ids = []
    for version in range(3):
        for epoch in range(2):
            for shard in (2, 0, 1):
                for n in range(3):
                    ids.append(str(BatchId(version, epoch, shard, n, f"{version}{epoch}{shard}{n}{'a' * 8}")))
    return ids[:count]


def audited_run(tmp_path, updates: int = 16, edit=None) -> tuple[TrainLog, list[dict]]:
    """A run's log of `updates` updates in segments of 4, every update retired from the ledger's window (so the log
    is the account's only source for its slots); `edit(slot -> batch id, dead-lettered slots)` changes the run."""
    ids = dict(enumerate(scheduled_ids(updates * SLOTS.per_step)))
    dead: list[int] = []
    dead_letters = edit(ids, dead) if edit else []
    log = TrainLog.of_run(tmp_path, segment_updates=4)
    for update in range(updates):
        slots = [SLOTS.slot(update, rank, 0) for rank in range(SLOTS.world)]
        log.append(UpdateRecord(step=update + 1, loss=1.0, lr=1e-4, grad_norm=1.0, batch_ids=[ids[n] for n in slots],
                                slots=slots, dead_lettered=[n for n in slots if n in dead]))
    return log, dead_letters
