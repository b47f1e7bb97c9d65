"""A batch builder's writing loop: its slots' batches into the queue, in slot order, one round trip per batch.

The loop keeps the cursor and the replay placements it last read, and `BatchQueue.offer` writes only if the
queue still agrees with them; when it does not (a resumed run moved the cursor back, a Redis restart lost the last
writes, an operator requeued a dead-lettered batch) the loop reads the queue's position again and carries on
from there. Which batch a slot holds is the schedule's (`services.batcher.schedule`), never the timing's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from marge.contracts.batch import Batch
from marge.contracts.protocol import BatchQueue, Offer, encode_batch

log = logging.getLogger(__name__)


class SlotWriter:
    """One batch builder's place in the queue, one offer at a time (`offer`): what `write_slots` loops over, and what
    a test drives step by step."""

    NO_BATCH = "no batch"
    """`batch_for` gave None (it stopped waiting for an index version), or a requeued batch's dead letter is gone."""

    def __init__(self, queue: BatchQueue, batch_for: Callable[[int, int], Batch | None],
                 replays_before: Callable[[int, dict[int, str]], int], lookahead_steps: int,
                 on_written: Callable[[Batch, int], None] = lambda batch, slot: None, group: int = 0):
        if queue.slots is None:
            raise ValueError("a batch builder's queue needs the run's slot layout (BatchQueue.connect slots=)")
        self.queue, self.slots, self.batch_for, self.replays_before = queue, queue.slots, batch_for, replays_before
        self.lookahead_steps, self.on_written, self.group = lookahead_steps, on_written, group
        self.position: tuple[int, str | None, dict[int, str]] | None = None
        """(cursor, oldest replay request, placements) as last read; None: read it again before the next offer."""
        self.offering: tuple[int, dict[bytes, bytes], Batch | None, str | None, dict[int, str]] | None = None
        """The entry being offered (slot, fields, batch or None for a requeued one, replay entry, placements known):
        kept while the slot is too far ahead of the ranks."""

    def offer(self) -> str:
        """Offer the next entry once: a requeued batch if an operator asked for one (builder 0 only), else
        `batch_for(slot, requeued batches placed before it in its version)`. Returns the `Offer` status (`ahead`:
        the same entry is offered again next time) or NO_BATCH."""
        if self.offering is None:
            if self.position is None:
                self.position = self.queue.position(self.group)
            slot, request, placements = self.position
            batch: Batch | None = None
            if request is not None:  # an operator requeued a dead-lettered batch: it goes into this slot
                try:
                    fields = self.queue.replay_fields(request)
                except ValueError:  # a reset dropped its dead letter since the position was read
                    self.position = None
                    return self.NO_BATCH
                log.info("batcher: writing requeued dead-letter entry %s into slot %d", request, slot)
            else:
                batch = self.batch_for(slot, self.replays_before(slot, placements))
                if batch is None:
                    self.position = None  # it gave up waiting for an index version: the cursor moved
                    return self.NO_BATCH
                fields = encode_batch(batch)
            self.offering = (slot, fields, batch, request, placements)
        slot, fields, batch, request, placements = self.offering
        # a requeued batch and a scheduled one are offered alike, against the cursor and the placements read, so a
        # reset to an older checkpoint sends the builder back to the slots the ranks now wait for
        status, _ = self.queue.offer(slot, fields, self.lookahead_steps, replay_entry=request,
                                     placements_known=len(placements))
        if status == Offer.AHEAD:
            return status
        self.offering = None
        if status == Offer.WRITTEN and batch is not None:
            self.on_written(batch, slot)
            self.position = (self.slots.next_in_group(slot), None, placements)
        else:
            self.position = None  # moved, already written, or a requeued batch placed: read the position again
        return status


def write_slots(queue: BatchQueue, batch_for: Callable[[int, int], Batch | None],
                replays_before: Callable[[int, dict[int, str]], int], lookahead_steps: int, stop: threading.Event,
                on_written: Callable[[Batch, int], None] = lambda batch, slot: None, group: int = 0,
                stall_s: float | None = None) -> None:
    """Write builder `group`'s slots from its cursor on until `stop` is set (`SlotWriter.offer`, repeated). While the
    slot is `lookahead_steps` updates ahead of the slowest rank, it waits (polling the ranks' progress, not
    writing), at most `stall_s` seconds (then `Stalled`). `batch_for` gives None when it stopped waiting for an
    index version: stopped, or the cursor moved (then the position is read again)."""
    writer = SlotWriter(queue, batch_for, replays_before, lookahead_steps, on_written, group)
    while not stop.is_set():
        status = writer.offer()
        if status == Offer.AHEAD and writer.offering is not None:
            # (the cursor moved while it waited: the next offer says so, and the position is read again)
            if not queue.wait_for_room(writer.offering[0], lookahead_steps, should_stop=stop.is_set, cursor_at=True,
                                       stall_s=stall_s):
                return
