"""A small audited run the train-log tests share (with and without Redis), and the log of a run of several batch
builders."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Container, Iterable, Iterator

from marge.contracts.slots import BatchId, CommitRecord, Slots
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


def ledger_of(records: Iterable[UpdateRecord], slots: Slots, every: int, through: int
              ) -> tuple[list[int], dict[int, dict[int, CommitRecord]]]:
    """(checkpoint updates, update -> rank -> commit): what the ranks commit for a log whose run checkpoints every
    `every` updates up to update `through` (every rank commits each interval, its trained batches of the log's
    lines: none trained, a record of 0)."""
    steps = list(range(every, through + 1, every))
    pairs: dict[int, dict[int, list[tuple[int, str]]]] = {s: {r: [] for r in range(slots.world)} for s in steps}
    for record in records:
        update = record.step - 1
        step = (update // every + 1) * every
        if step in pairs:
            for n, batch_id in record.trained_slots().items():
                pairs[step][slots.rank_of(n)].append((n, str(batch_id)))
    return steps, {s: {r: CommitRecord.of(s, s - every, p) for r, p in by_rank.items()} for s, by_rank in pairs.items()}


def audited_run(tmp_path, updates: int = 16, edit=None) -> tuple[TrainLog, list[dict]]:
    """A run's log of `updates` updates in segments of 4; `edit(slot -> batch id, dead-lettered slots)` changes the
    run."""
    ids = dict(enumerate(scheduled_ids(updates * SLOTS.per_step)))
    dead: list[int] = []
    dead_letters = edit(ids, dead) if edit else []
    log = TrainLog.of_run(tmp_path, segment_updates=4)
    for update in range(updates):
        slots = [SLOTS.slot(update, rank, 0) for rank in range(SLOTS.world)]
        log.append(UpdateRecord(step=update + 1, loss=1.0, lr=1e-4, grad_norm=1.0, batch_ids=[ids[n] for n in slots],
                                slots=slots, dead_lettered=[n for n in slots if n in dead]))
    return log, dead_letters


# -- a run of several batch builders (`Slots.builders`): each builder's slots hold its own sequence


SHARDS = 16


def shard_batches(version: int, shard: int) -> int:
    """Batches of one shard: 3 to 8, so the builders' passes differ in length and drift apart, as real ones do."""
    return 3 + (5 * version + 7 * shard) % 6


def builder_sequence(builders: int, group: int, version: int) -> Iterator[str]:
    """Builder `group`'s batch ids of one index version, pass after pass: every `builders`-th shard of the pass's
    seeded shard order (`services.batcher.core.group_order`), numbers within a shard, each id with a digest."""
    for epoch in itertools.count():
        order = random.Random(f"{version}/{epoch}").sample(range(SHARDS), SHARDS)
        for shard in order[group::builders]:
            for n in range(shard_batches(version, shard)):
                digest = hashlib.blake2b(f"{version}/{epoch}/{shard}/{n}".encode(), digest_size=6).hexdigest()
                yield str(BatchId(version, epoch, shard, n, digest))


def builders_ids(slots: Slots, updates: int, reindex_every: int) -> Iterator[str]:
    """The batch id of every slot of `updates` updates, in slot order: builder g's k-th slot of a version holds the
    k-th batch of its sequence (`services.batcher.schedule`); version v serves updates [v*R, (v+1)*R)."""
    sequences: dict[int, Iterator[str]] = {}
    for update in range(updates):
        if update % reindex_every == 0:
            sequences = {g: builder_sequence(slots.builders, g, update // reindex_every) for g in range(slots.builders)}
        for n in range(update * slots.per_step, (update + 1) * slots.per_step):
            yield next(sequences[slots.group_of(n)])


def builders_log(path, slots: Slots, updates: int, ids: Iterable[str], dead: Container[int] = (),
                 dropped: Container[int] = ()) -> TrainLog:
    """The train log of `updates` updates whose slots hold `ids` (in slot order); `dead` slots dead-lettered,
    `dropped` slots missing from their update's record (no rank recorded them)."""
    log, ids = TrainLog.of_run(path, segment_updates=1000), iter(ids)
    for update in range(updates):
        slots_ = list(range(update * slots.per_step, (update + 1) * slots.per_step))
        batch_ids = [next(ids) for _ in slots_]
        kept = [i for i, n in enumerate(slots_) if n not in dropped]
        log.append(UpdateRecord(step=update + 1, loss=1.0, lr=1e-4, grad_norm=1.0,
                                batch_ids=[batch_ids[i] for i in kept], slots=[slots_[i] for i in kept],
                                dead_lettered=[slots_[i] for i in kept if slots_[i] in dead]))
    return log
