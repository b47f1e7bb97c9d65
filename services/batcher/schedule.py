"""Which batch each training slot holds: a pure function of the seed, the index versions and the slot number.

An update (step) s takes B = world size x grad_accum batches; slot n = s*B + rank*grad_accum + micro is one
rank's batch of one update. With `batcher.builders` G > 1, builder g writes the slots of its own group of
ranks and its sequences take every G-th shard of each pass (`marge.contracts.slots.Slots`); what follows holds
for each builder with "slot" read as the builder's own slots, numbered in order (`Slots.group_index`). Index version v is built from the snapshot of update v*R (R =
`indexer.reindex_every`) and serves the updates from `first_step(v)` on:

    version 0             updates 0 .. R+L-1          (the index of the initial model)
    version v >= 1        updates v*R+L .. (v+1)*R+L-1

L (`batcher.index_lag`, default R) is the indexer's head start: the updates trainers make while version v is
built. A version's batches are `epoch_batches` of its graph, pass after pass, in order; so the batch of slot
n is the k-th of its version's sequence, k = n - first_step(v)*B. A builder that resumes at the k-th batch passes
over the first k by whole shards (their batch counts, recorded on the run's storage as shards are planned:
`BatchCounts`), building only the batches from k on. Nothing depends on timing: a run killed
and resumed, or built by the single process instead of the pipeline, puts the same batch ids in the same
slots (given the same index versions). If a version is not built when its first update's batches are due,
the batcher waits for it and so do the trainers (the capacity plan says when that will happen).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from marge.contracts.batch import Batch
from marge.contracts.index_store import IndexVersion, read_version, version_dirname
from marge.contracts.slots import Slots, VersionPlan
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.core import BatchCounts, DocumentStore, Skip, corpus_epoch_batches, epoch_batches

log = logging.getLogger(__name__)


def wait_for_version(root: Path, number: int, stop: threading.Event, poll_s: float = 0.2,
                     give_up: Callable[[], bool] = lambda: False) -> IndexVersion | None:
    """Committed index version `number` under `root`, waiting for the indexer to commit it; None once `stop` is
    set or `give_up()` says the wait is moot (a builder whose cursor moved back). The batcher's and the single
    process's `load_version`."""
    path = Path(root) / version_dirname(number)
    logged = False
    while not (path / "manifest.json").exists():
        if not logged:
            log.info("waiting for index v%d (its batches are due)", number)
            logged = True
        if stop.wait(poll_s) or give_up():
            return None
    return read_version(path)


class BatchSchedule:
    """The batch of each slot (see the module docstring).

    `load_version(v)` returns committed index version v, waiting for it if it is not built yet (or None
    when the caller must stop waiting). Batches requeued by an operator (`marge queue replay`) take slots of
    their own; the scheduled batches of that version then move one slot on (`replays_before`). `group`: the
    builder whose slots this schedule fills (`Slots.builders`); `counts_root`: where the builders keep each
    version's shard batch counts (None: a resume plans the shards it passes over).
    """

    def __init__(self, docs: DocumentStore, cfg: BatcherConfig, seed: int, slots: Slots, plan: VersionPlan,
                 load_version: Callable[[int], IndexVersion | None], shape: BatchShape = BatchShape(),
                 group: int = 0, counts_root: Path | None = None):
        self.docs, self.cfg, self.seed, self.slots, self.plan = docs, cfg, seed, slots, plan
        self.load_version, self.shape, self.group, self.counts_root = load_version, shape, group, counts_root
        if not 0 <= group < slots.builders:
            raise ValueError(f"builder {group} does not exist: the run has {slots.builders}")
        if shape.kind == "documents" and plan.reindex_every:
            raise ValueError("'documents' batches need no index: give them VersionPlan.without_index()")
        self._cursor: tuple[int, int, Iterator[Batch]] | None = None
        """(version, position of the next batch, the version's sequence there): consecutive slots cost one step."""

    def version_sequence(self, index: IndexVersion | None, start: int = 0) -> Iterator[Batch]:
        """Every batch of one version (None: the corpus without an index) from the `start`-th on: pass 0, pass 1,
        ... (each pass a new seeded order and new batch ids)."""
        skip, epoch = Skip(start), 0
        builders = self.slots.builders
        counts = (BatchCounts.for_version(self.counts_root, index, self.cfg, self.shape, self.seed, self.group, builders)
                  if index is not None and self.counts_root is not None else None)
        while True:
            produced, before = False, skip.remaining
            passes = (corpus_epoch_batches(self.docs, self.cfg, self.shape, epoch, self.seed, group=self.group,
                                           builders=builders, skip=skip) if index is None
                      else epoch_batches(index, self.docs, self.cfg, epoch, self.seed, shape=self.shape,
                                         group=self.group, builders=builders, skip=skip, counts=counts))
            for batch in passes:
                produced = True
                yield batch
            if not produced and skip.remaining == before:
                raise RuntimeError("the corpus yields no batch: no document fits batcher.max_tokens" if index is None
                                   else f"index v{index.version} yields no batch" + (
                                       f" for builder {self.group} of {builders}" if builders > 1 else "") +
                                   ": no document of its shards has a link")
            epoch += 1

    def first_slot_of_version(self, slot: int) -> int:
        """This builder's first slot of the version that serves `slot`."""
        return self.slots.first_slot_of_group(
            self.group, self.plan.first_step(self.plan.version_for_step(self.slots.step_of(slot))))

    def replays_before(self, slot: int, replay_slots) -> int:
        """Requeued batches written into this builder's slots of this slot's version before it (each pushes the
        schedule one slot on)."""
        first = self.first_slot_of_version(slot)
        return sum(1 for n in replay_slots if first <= n < slot and self.slots.group_of(n) == self.group)

    def batch(self, slot: int, replays_before: int = 0) -> Batch | None:
        """The scheduled batch of `slot` (one of this builder's); None when `load_version` gives up."""
        if self.slots.group_of(slot) != self.group:
            raise ValueError(f"slot {slot} belongs to builder {self.slots.group_of(slot)}, not {self.group}")
        version = self.plan.version_for_step(self.slots.step_of(slot))
        position = (self.slots.group_index(slot) - self.slots.group_index(self.first_slot_of_version(slot))
                    - replays_before)
        if self._cursor is None or self._cursor[:2] != (version, position):
            if self.shape.kind == "documents":
                sequence = self.version_sequence(None, position)
            else:
                index = self.load_version(version)
                if index is None:
                    return None
                if index.snapshot_step != self.plan.snapshot_step(version):
                    raise RuntimeError(f"index v{version} was built from snapshot {index.snapshot_step}, not "
                                       f"{self.plan.snapshot_step(version)}: it does not belong to this schedule")
                sequence = self.version_sequence(index, position)  # resuming: the first batches are not built
            self._cursor = (version, position, sequence)
        sequence = self._cursor[2]
        batch = next(sequence)
        self._cursor = (version, position + 1, sequence)
        return batch

    def batches(self, start: int) -> Iterator[tuple[int, Batch]]:
        """(slot, batch) of this builder's slots from slot `start` on, with no requeued batches; stops when
        `load_version` gives up."""
        slot = start
        while self.slots.group_of(slot) != self.group:  # the first of this builder's slots from `start` on
            slot += 1
        while (batch := self.batch(slot)) is not None:
            yield slot, batch
            slot = self.slots.next_in_group(slot)


class RunSchedule:
    """Every builder's schedule together: the batch of any slot of the run, for a host that trains every slot
    itself (the single process), so that it trains what the pipeline's builders would write."""

    def __init__(self, docs: DocumentStore, cfg: BatcherConfig, seed: int, slots: Slots, plan: VersionPlan,
                 load_version: Callable[[int], IndexVersion | None], shape: BatchShape = BatchShape(),
                 counts_root: Path | None = None):
        self.slots = slots
        self.builders = [BatchSchedule(docs, cfg, seed, slots, plan, load_version, shape, group, counts_root)
                         for group in range(slots.builders)]

    def batch(self, slot: int) -> Batch | None:
        return self.builders[self.slots.group_of(slot)].batch(slot)

    def batches(self, start: int) -> Iterator[tuple[int, Batch]]:
        """(slot, batch) from slot `start` on, every slot in order; stops when `load_version` gives up."""
        slot = start
        while (batch := self.batch(slot)) is not None:
            yield slot, batch
            slot += 1
