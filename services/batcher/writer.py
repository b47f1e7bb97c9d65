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


def write_slots(queue: BatchQueue, batch_for: Callable[[int, int], Batch | None],
                replays_before: Callable[[int, dict[int, str]], int], lookahead_steps: int, stop: threading.Event,
                on_written: Callable[[Batch, int], None] = lambda batch, slot: None, group: int = 0,
                stall_s: float | None = None) -> None:
    """Write builder `group`'s slots from its cursor on until `stop` is set: a requeued batch if an operator asked
    for one (builder 0 only), else `batch_for(slot, requeued batches placed before it in its version)`. While the
    slot is `lookahead_steps` updates ahead of the slowest rank, it waits (polling the ranks' progress, not
    writing). `batch_for` gives None when it stopped waiting for an index version: stopped, or the cursor moved
    (then the position is read again). A wait for room longer than `stall_s` raises `Stalled`."""
    position = None
    while not stop.is_set():
        if position is None:
            position = queue.position(group)
        slot, request, placements = position
        if request is not None:  # an operator requeued a dead-lettered batch: it goes into this slot
            try:
                fields = queue.replay_fields(request)
            except ValueError:  # a reset dropped its dead letter since the position was read
                position = None
                continue
            log.info("batcher: writing requeued dead-letter entry %s into slot %d", request, slot)
            batch = None
        else:
            batch = batch_for(slot, replays_before(slot, placements))
            if batch is None:
                if stop.is_set():
                    return
                position = None  # it gave up waiting for an index version: the cursor moved
                continue
            fields = encode_batch(batch)
        # the same offer and wait for both: each checks the cursor and the placements it read, so a reset to an
        # older checkpoint while it waits sends it back to the slots the ranks now wait for
        while True:
            status, _ = queue.offer(slot, fields, lookahead_steps, replay_entry=request,
                                    placements_known=len(placements))
            if status != Offer.AHEAD:
                break
            if not queue.wait_for_room(slot, lookahead_steps, should_stop=stop.is_set, cursor_at=True,
                                       stall_s=stall_s):
                return  # (the cursor moved while it waited: the next offer says so, and the position is read again)
        if status == Offer.WRITTEN and batch is not None:
            on_written(batch, slot)
            if queue.slots is None:
                raise ValueError("a batch builder's queue needs the run's slot layout (BatchQueue.connect slots=)")
            position = (queue.slots.next_in_group(slot), None, placements)
        else:
            position = None  # moved, already written, or a requeued batch placed: read the position again
