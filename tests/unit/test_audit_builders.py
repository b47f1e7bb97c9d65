"""`marge audit`'s account (services.ops.audit.account) over the train log of a run with several batch builders
(`batcher.builders`): each builder's slots hold its own sequence, interleaved in slot order with the others'."""

from __future__ import annotations

import tracemalloc
from collections.abc import Collection, Sequence

import pytest
from train_log_inputs import builders_ids, builders_log, ledger_of

from marge.contracts.slots import BatchId, Slots
from services.ops.audit import CheckpointState, QueueState, account

REINDEX_EVERY = 100
EVERY = 20
"""Updates between checkpoints."""


def audit_of(log, slots: Slots, updates: int, dead_letters: Sequence[dict] = (), dropped: Collection[int] = (),
             passes: list | None = None, measure: bool = False) -> tuple[dict, int]:
    """The account up to update `updates`, the run checkpointed every EVERY updates and each rank's commits those of
    its lines (`ledger_of`: the dead-lettered and dropped slots are not in them), and its peak traced memory (bytes)
    when `measure`."""
    counts = {"committed_step": updates, "pending": 0, "produced": updates * slots.per_step}
    steps, commits = ledger_of(log.iter_records(), slots, EVERY, updates)
    state = QueueState(counts, steps, lambda s: commits.get(s, {}), list(dead_letters))

    def read_records():
        if passes is not None:
            passes.append(1)
        return log.iter_records(through_step=updates)

    if measure:
        tracemalloc.start()
    try:
        result = account(read_records, slots, CheckpointState(updates), state)
        peak = tracemalloc.get_traced_memory()[1] if measure else 0
    finally:
        if measure:
            tracemalloc.stop()
    return result, peak


def test_four_builders_audit_in_one_pass_and_the_same_memory_at_four_times_the_updates(tmp_path):
    """The builders' sequences interleave in slot order; each in its own order, the account remembers none of
    their ids, so four times the log costs no more memory and no second pass."""
    slots = Slots(world=8, grad_accum=1, builders=4)
    peaks, passes = {}, {}
    for updates in (300, 1200):
        log = builders_log(tmp_path / str(updates), slots, updates, builders_ids(slots, updates, REINDEX_EVERY))
        passes[updates] = []
        result, peaks[updates] = audit_of(log, slots, updates, passes=passes[updates], measure=True)
        assert result["ok"] and result["batches_trained"] == updates * slots.per_step
    assert peaks[1200] / peaks[300] < 1.2, f"peak traced memory (bytes) by updates {peaks}: it grows with the run"
    assert {u: len(p) for u, p in passes.items()} == {300: 1, 1200: 1}  # passes over the log


@pytest.mark.parametrize("builders", [2, 4])
def test_a_batch_lost_under_several_builders_is_found_in_one_pass(tmp_path, builders):
    slots = Slots(world=8, grad_accum=1, builders=builders)
    updates, lost = 240, 150 * 8 + 5  # rank 5's slot of update 150: no rank recorded it, nothing dead-lettered it
    log = builders_log(tmp_path, slots, updates, builders_ids(slots, updates, REINDEX_EVERY), dropped={lost})
    passes: list[int] = []
    result, _ = audit_of(log, slots, updates, dropped=[lost], passes=passes)
    assert not result["ok"] and (result["batches_lost"], result["lost_slots"]) == (1, [lost])
    assert result["trained_twice"] == 0 and result["content_changed"] == []
    assert len(passes) == 1


def shard_starts(slots: Slots, ids: list[str]) -> tuple[int, int]:
    """(a, b), a < b, slots of two builders in the second half of the run whose batches are each the first of a
    shard, both of one version and pass. Each builder's shards of a pass are its own, so either batch in the
    other's slot is still in that builder's own order: only the other builders' shards tell it apart."""
    parsed = [BatchId.parse(i) for i in ids]
    for a in range(len(ids) // 2, len(ids)):
        for b in range(a + 1, len(ids)):
            if (parsed[b].version, parsed[b].epoch) != (parsed[a].version, parsed[a].epoch):
                break
            if parsed[a].number == parsed[b].number == 0 and slots.group_of(a) != slots.group_of(b):
                return a, b
    raise AssertionError("no two builders start a shard in one pass of this run")


@pytest.mark.parametrize("builders", [2, 4])
@pytest.mark.parametrize("copy", ["same builder", "into another builder's later slot",
                                  "into another builder's earlier slot"])
def test_a_batch_trained_twice_under_several_builders_is_found(tmp_path, builders, copy):
    slots = Slots(world=8, grad_accum=1, builders=builders)
    updates = 240
    ids = list(builders_ids(slots, updates, REINDEX_EVERY))
    if copy == "same builder":
        source, target = 30 * 8 + 1, 170 * 8 + 1  # rank 1's slots of updates 30 and 170 (another index version)
    else:
        a, b = shard_starts(slots, ids)
        source, target = (a, b) if copy == "into another builder's later slot" else (b, a)
    doubled = ids[target] = ids[source]
    log = builders_log(tmp_path, slots, updates, ids)
    result, _ = audit_of(log, slots, updates)
    assert not result["ok"] and result["trained_twice"] == 1 and result["trained_twice_ids"] == [doubled]
    assert result["batches_lost"] == 0 and result["content_changed"] == []


@pytest.mark.parametrize("builders", [2, 4])
def test_a_batch_rebuilt_with_other_content_in_another_builders_slot_is_found(tmp_path, builders):
    slots = Slots(world=8, grad_accum=1, builders=builders)
    updates = 240
    ids = list(builders_ids(slots, updates, REINDEX_EVERY))
    a, b = shard_starts(slots, ids)
    original = BatchId.parse(ids[a])
    ids[b] = str(BatchId(original.version, original.epoch, original.shard, original.number, "bbbbbbbbbbbb"))
    log = builders_log(tmp_path, slots, updates, ids)
    result, _ = audit_of(log, slots, updates)
    assert not result["ok"] and result["trained_twice"] == 0
    assert result["content_changed"] == [{"position": original.position,
                                          "contents": sorted([original.content, "bbbbbbbbbbbb"])}]


@pytest.mark.parametrize("builders", [2, 4])
def test_a_dead_letter_replayed_into_builder_0_is_trained_once_in_one_pass(tmp_path, builders):
    """`marge queue replay` has builder 0 write the batch into its next slot; its scheduled batches of that version
    then move one slot on (`services.batcher.schedule.BatchSchedule.replays_before`)."""
    slots = Slots(world=8, grad_accum=1, builders=builders)
    updates = 240
    ids = list(builders_ids(slots, updates, REINDEX_EVERY))
    dead, replayed = 120 * 8 + 7, 131 * 8  # the last rank's slot of update 120 (its builder is not 0); update 131
    assert slots.group_of(dead) != 0 and slots.group_of(replayed) == 0
    version_end = (replayed // slots.per_step // REINDEX_EVERY + 1) * REINDEX_EVERY * slots.per_step
    moved = [n for n in range(replayed, version_end) if slots.group_of(n) == 0]
    for n, batch_id in zip(moved, [ids[dead], *(ids[n] for n in moved)]):
        ids[n] = batch_id
    log = builders_log(tmp_path, slots, updates, ids, dead={dead})
    passes: list[int] = []
    result, _ = audit_of(log, slots, updates, passes=passes,
                         dead_letters=[{"slot": dead, "batch_id": ids[dead], "replayed_to_slot": replayed}])
    assert result["ok"] and (result["trained_twice"], result["batches_lost"]) == (0, 0)
    assert result["batches_replayed"] == 1 and result["batches_trained"] == updates * slots.per_step - 1
    assert len(passes) == 1
