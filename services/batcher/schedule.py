"""Which batch each training slot holds: a pure function of the seed, the index versions and the slot number.

An update (step) s takes B = world size x grad_accum batches; slot n = s*B + rank*grad_accum + micro is one
rank's batch of one update. Index version v is built from the snapshot of update v*R (R =
`indexer.reindex_every`) and serves the updates from `first_step(v)` on:

    version 0             updates 0 .. R+L-1          (the index of the initial model)
    version v >= 1        updates v*R+L .. (v+1)*R+L-1

L (`batcher.index_lag`, default R) is the indexer's head start: the updates trainers make while version v is
built. A version's batches are `epoch_batches` of its graph, pass after pass, in order; so the batch of slot
n is the k-th of its version's sequence, k = n - first_step(v)*B. Nothing depends on timing: a run killed
and resumed, or built by the single process instead of the pipeline, puts the same batch ids in the same
slots (given the same index versions). If a version is not built when its first update's batches are due,
the batcher waits for it and so do the trainers (the capacity plan says when that will happen).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from marge.batch import Batch
from marge.index_store import IndexVersion, read_version, version_dirname
from marge.protocol import Slots, VersionPlan
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.core import DocumentStore, corpus_epoch_batches, epoch_batches

log = logging.getLogger(__name__)


def wait_for_version(root: Path, number: int, stop: threading.Event, poll_s: float = 0.2) -> IndexVersion | None:
    """Committed index version `number` under `root`, waiting for the indexer to commit it; None once `stop` is
    set. The batcher's and the single process's `load_version`."""
    path = Path(root) / version_dirname(number)
    logged = False
    while not (path / "manifest.json").exists():
        if not logged:
            log.info("waiting for index v%d (its batches are due)", number)
            logged = True
        if stop.wait(poll_s):
            return None
    return read_version(path)


class BatchSchedule:
    """The batch of each slot (see the module docstring).

    `load_version(v)` returns committed index version v, waiting for it if it is not built yet (or None
    when the caller must stop waiting). Batches requeued by an operator (`marge queue replay`) take slots of
    their own; the scheduled batches of that version then move one slot on (`replays_before`).
    """

    def __init__(self, docs: DocumentStore, cfg: BatcherConfig, seed: int, slots: Slots, plan: VersionPlan,
                 load_version: Callable[[int], IndexVersion | None], shape: BatchShape = BatchShape()):
        self.docs, self.cfg, self.seed, self.slots, self.plan = docs, cfg, seed, slots, plan
        self.load_version, self.shape = load_version, shape
        if shape.kind == "documents" and plan.reindex_every:
            raise ValueError("'documents' batches need no index: give them VersionPlan.without_index()")
        self._cursor: tuple[int, int, Iterator[Batch]] | None = None
        """(version, position of the next batch, the version's sequence there): consecutive slots cost one step."""

    def version_sequence(self, index: IndexVersion | None) -> Iterator[Batch]:
        """Every batch of one version (None: the corpus without an index): pass 0, pass 1, ... (each pass a new
        seeded order and new batch ids)."""
        epoch = 0
        while True:
            produced = False
            passes = (corpus_epoch_batches(self.docs, self.cfg, self.shape, epoch, self.seed) if index is None
                      else epoch_batches(index, self.docs, self.cfg, epoch, self.seed, shape=self.shape))
            for batch in passes:
                produced = True
                yield batch
            if not produced:
                raise RuntimeError("the corpus yields no batch: no document fits batcher.max_tokens" if index is None
                                   else f"index v{index.version} yields no batch: no document has a link")
            epoch += 1

    def first_slot_of_version(self, slot: int) -> int:
        return self.plan.first_step(self.plan.version_for_step(self.slots.step_of(slot))) * self.slots.per_step

    def replays_before(self, slot: int, replay_slots) -> int:
        """Requeued batches written into this slot's version before it (each pushes the schedule one slot on)."""
        first = self.first_slot_of_version(slot)
        return sum(1 for n in replay_slots if first <= n < slot)

    def batch(self, slot: int, replays_before: int = 0) -> Batch | None:
        """The scheduled batch of `slot`; None when `load_version` gives up."""
        version = self.plan.version_for_step(self.slots.step_of(slot))
        position = slot - self.first_slot_of_version(slot) - replays_before
        if self._cursor is None or self._cursor[:2] != (version, position):
            if self.shape.kind == "documents":
                sequence = self.version_sequence(None)
            else:
                index = self.load_version(version)
                if index is None:
                    return None
                if index.snapshot_step != self.plan.snapshot_step(version):
                    raise RuntimeError(f"index v{version} was built from snapshot {index.snapshot_step}, not "
                                       f"{self.plan.snapshot_step(version)}: it does not belong to this schedule")
                sequence = self.version_sequence(index)
            for _ in range(position):  # resuming inside the version: its first batches went to earlier slots
                next(sequence)
            self._cursor = (version, position, sequence)
        sequence = self._cursor[2]
        batch = next(sequence)
        self._cursor = (version, position + 1, sequence)
        return batch

    def batches(self, start: int) -> Iterator[tuple[int, Batch]]:
        """(slot, batch) from slot `start` on, with no requeued batches; stops when `load_version` gives up."""
        slot = start
        while (batch := self.batch(slot)) is not None:
            yield slot, batch
            slot += 1
