"""The Redis batch queue against a real redis-server: slots, backpressure, commits, resets, dead letters
and replays, a Redis killed and restarted, an orphaned server adopted."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest
import redis

from marge.contracts.batch import Batch
from marge.contracts.protocol import BatchQueue, ProtocolError, decode_batch, encode_batch, entry_id, slot_of_entry
from marge.contracts.slots import BatchId, CommitRecord, Slots


def make_batch(i: int, rng=np.random.default_rng(0)) -> Batch:
    tokens = tuple(rng.integers(4, 500, size=n).astype(np.int32) for n in (5, 9, 3))
    return Batch(f"v0-e0-s0-{i}", 0, 0, np.array([10 * i, 10 * i + 1, 10 * i + 2], dtype=np.int64),
                 ("en", "de", "zh"), tokens, np.array([0], dtype=np.int32), np.array([1, 2], dtype=np.int32),
                 np.array([[0, 0], [0, 1]], dtype=np.int32), np.array([100.0, 100.0], dtype=np.float32))


def commit(q: BatchQueue, rank: int, step: int, pairs: list[tuple[int, str]], since: int = 0,
           previous: CommitRecord | None = None) -> list[str]:
    """Rank `rank`'s commit at the checkpoint of `step`: its record of `pairs` (updates `since` .. `step` - 1), after
    `previous` (its record of the interval before, committed again), as the trainer commits."""
    return q.commit(rank, step, ([(rank, previous)] if previous else []) + [(rank, CommitRecord.of(step, since, pairs))])


def fill(q: BatchQueue, slots: range, lookahead: int = 100) -> None:
    for n in slots:
        assert q.put(n, make_batch(n), lookahead)


def test_local_redis_is_private_persistent_and_never_evicts(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    config = client.config_get("*")
    assert config["appendonly"] == "yes" and config["maxmemory-policy"] == "noeviction"
    assert config["bind"] == "127.0.0.1" and config["protected-mode"] == "yes"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port).ping()


def test_each_rank_reads_its_slots_and_batches_count_only_when_committed(redis_server):
    q = BatchQueue.connect(redis_server.url, "t1", Slots(2, 1))
    fill(q, range(6))
    assert [q.get(n, block_ms=10).batch.batch_id for n in (0, 2, 4)] == [f"v0-e0-s0-{n}" for n in (0, 2, 4)]
    assert q.r.xlen(q.keys.slots(0)) == 3 and q.r.xlen(q.keys.slots(1)) == 3  # even slots rank 0, odd rank 1
    assert q.get(6, block_ms=10) is None  # not written yet
    assert q.counts()["pending"] == 6 and q.counts()["ledger"] == 0  # read is not trained
    # the checkpoint of update 2 is durable: each rank records its slots of updates 0-1 and trims below slot 4
    assert commit(q, 0, 2, [(0, "v0-e0-s0-0"), (2, "v0-e0-s0-2")]) == []
    assert commit(q, 1, 2, [(1, "v0-e0-s0-1"), (3, "v0-e0-s0-3")]) == []
    counts = q.counts()
    assert counts["trained"] == 4 and counts["ledger"] == 1 and counts["pending"] == 2 and counts["committed_step"] == 2
    assert q.commits(2) == {0: CommitRecord.of(2, 0, [(0, "v0-e0-s0-0"), (2, "v0-e0-s0-2")]),
                            1: CommitRecord.of(2, 0, [(1, "v0-e0-s0-1"), (3, "v0-e0-s0-3")])}
    assert q.get(4, block_ms=10) is not None and q.r.xlen(q.keys.slots(0)) == 1
    # committing the same record again (the next commit repeats the previous one) changes nothing
    assert commit(q, 0, 2, [(0, "v0-e0-s0-0"), (2, "v0-e0-s0-2")]) == []
    assert q.counts()["trained"] == 4 and q.counts().get("commit_conflicts", 0) == 0
    # another record for the same checkpoint and rank (the interval trained otherwise without a reset) is kept out
    # and counted
    assert commit(q, 0, 2, [(0, "v0-e0-s0-0"), (2, "v0-e0-s0-7")]) == ["2:0"]
    assert q.counts()["commit_conflicts"] == 1 and q.counts()["trained"] == 4


def test_a_slot_trimmed_away_is_an_error_at_once_and_an_unwritten_one_is_waited_for_without_spinning(redis_server,
                                                                                                        monkeypatch):
    """After a commit trims rank 0's stream below slot 4, slot 2 can never come (entries are written in slot order):
    reading it fails at once, naming the slot, instead of XREAD answering with slot 4 again and again (a rank
    resumed from an older checkpoint than the queue's spun at 22k reads a second). A slot not written yet is
    waited for in blocking reads: a few Redis calls a second."""
    import redis as redis_lib

    from marge.contracts.protocol import SlotGone

    q = BatchQueue.connect(redis_server.url, "t1g", Slots(2, 1))
    fill(q, range(6))
    commit(q, 0, 2, [(0, "v0-e0-s0-0"), (2, "v0-e0-s0-2")])
    t0 = time.monotonic()
    with pytest.raises(SlotGone, match="slot 2 is not in rank 0's stream and never will be.*holds slot 4"):
        q.get(2, block_ms=5000)
    assert time.monotonic() - t0 < 1.0
    calls = []
    real = redis_lib.Redis.execute_command

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis_lib.Redis, "execute_command", counted)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        assert q.get(6, block_ms=500) is None
    per_second = len(calls) / (time.monotonic() - t0)
    monkeypatch.undo()
    assert per_second <= 10, (per_second, calls[:10])


def own(rank: int, updates: range) -> list[tuple[int, str]]:
    """Rank `rank`'s (slot, batch id) in `updates` of a run of 2 ranks x 1 batch."""
    return [(n, f"v0-e0-s0-{n}") for n in range(2 * updates.start, 2 * updates.stop) if n % 2 == rank]


def train_through(q: BatchQueue, checkpoints: range, since: int) -> None:
    """Both ranks commit at each checkpoint (every 4 updates), each repeating its previous record."""
    for checkpoint in checkpoints:
        for rank in (0, 1):
            previous = CommitRecord.of(since, since - 4, own(rank, range(since - 4, since))) if since else None
            assert commit(q, rank, checkpoint, own(rank, range(since, checkpoint)), since, previous) == []
        since = checkpoint


def test_the_ledger_holds_one_record_a_rank_and_checkpoint_whatever_the_interval(redis_server):
    """A commit records a count and a digest for the rank's interval, not its batches: the ledger grows by one small
    record a rank and checkpoint, whatever the batches an interval holds."""
    q = BatchQueue.connect(redis_server.url, "t1w", Slots(2, 1))
    train_through(q, range(4, 21, 4), 0)
    assert q.committed_steps() == [4, 8, 12, 16, 20]
    assert q.commits(8) == {r: CommitRecord.of(8, 4, own(r, range(4, 8))) for r in (0, 1)}
    counts = q.counts()
    assert counts["trained"] == 40 and counts["ledger"] == 5 and counts.get("commit_conflicts", 0) == 0
    # a record stands for any number of batches: 100,000 of them take the same Redis memory as 4
    big = BatchQueue.connect(redis_server.url, "t1w-big", Slots(2, 1))
    commit(big, 0, 4, own(0, range(0, 4)))
    commit(big, 0, 8, [(n, f"v9-e0-s0-{n}") for n in range(8, 200_008, 2)], since=4)
    assert big.r.memory_usage(big.keys.ledger(8)) <= big.r.memory_usage(big.keys.ledger(4)) + 16  # the count's digits
    assert big.counts()["trained"] == 4 + 100_000
    # a commit repeated after a Redis restart lost nothing changes nothing
    commit(q, 0, 20, own(0, range(16, 20)), 16, CommitRecord.of(16, 12, own(0, range(12, 16))))
    assert q.counts()["trained"] == 40
    # a run resumed from an older checkpoint (update 8): the later checkpoints' records go
    q.reset_from(8)
    assert q.committed_steps() == [4, 8] and q.counts()["trained"] == 16 and q.commits(12) == {}


@pytest.mark.parametrize("newest,resume", [(16, 8), (16, 12), (12, 8), (16, 4)])
def test_a_run_resumed_from_an_older_checkpoint_counts_every_batch_once(redis_server, newest, resume):
    """Commits through update `newest` (checkpoints every 4 updates), then a resume from the checkpoint of `resume`:
    its ranks commit the checkpoint's record again and train on. The ledger ends where an uninterrupted run's does."""
    q = BatchQueue.connect(redis_server.url, f"t1r{newest}-{resume}", Slots(2, 1))
    train_through(q, range(4, newest + 1, 4), 0)
    q.reset_from(resume)
    for rank in (0, 1):  # what a resumed rank commits first: its checkpoint's record (a lost commit made good)
        assert q.commit(rank, resume, [(rank, CommitRecord.of(resume, resume - 4, own(rank, range(resume - 4,
                                                                                                    resume))))]) == []
    train_through(q, range(resume + 4, 21, 4), resume)
    assert q.committed_steps() == [4, 8, 12, 16, 20]
    counts = q.counts()
    assert counts["trained"] == 40 and counts["ledger"] == 5 and counts.get("commit_conflicts", 0) == 0, counts


def test_the_batcher_waits_for_the_slowest_rank_and_drops_nothing(redis_server):
    q = BatchQueue.connect(redis_server.url, "t2", Slots(2, 1))
    written = []

    def produce():
        for n in range(8):
            q.put(n, make_batch(n), lookahead_steps=2, poll_s=0.01)
            written.append(n)

    looks = []  # the producer's reads of the slowest rank: "it saw the change and still waits" is a count, not a time
    slowest = q.slowest_progress
    q.slowest_progress = lambda: looks.append(1) or slowest()

    def waits_at(expected: list[int]) -> None:
        """`written` reaches `expected` and stays there while the producer reads the ranks' progress 3 more times."""
        deadline = time.time() + 10
        while written != expected:
            assert time.time() < deadline and len(written) <= len(expected), (written, expected)
            time.sleep(0.01)
        seen = len(looks)
        while len(looks) < seen + 3:
            assert time.time() < deadline, "the producer stopped reading the ranks' progress"
            time.sleep(0.01)
        assert written == expected

    thread = threading.Thread(target=produce)
    thread.start()
    waits_at([0, 1, 2, 3])  # updates 0 and 1 written; update 2 waits for both ranks to pass update 0
    q.progress(0, 1)
    waits_at([0, 1, 2, 3])  # rank 1 is still at update 0
    q.progress(1, 1)
    waits_at([0, 1, 2, 3, 4, 5])
    q.progress(0, 3)
    q.progress(1, 3)
    thread.join(timeout=5)
    assert written == list(range(8)) and q.counts()["produced"] == 8 and q.next_slot() == 8


def test_a_slot_is_written_once(redis_server):
    q = BatchQueue.connect(redis_server.url, "t3", Slots(1, 1))
    q.put(0, make_batch(0), 10)
    q.put(0, make_batch(9), 10)  # a restarted batcher writing slot 0 again leaves the first write
    assert q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0" and q.r.xlen(q.keys.slots(0)) == 1
    assert q.next_slot() == 1


def test_a_write_the_client_retries_after_it_went_through_changes_nothing(redis_server):
    """redis-py retries a call whose reply a connection reset hid: the slot script must be a no-op the second
    time, also for a replay (its request is not popped twice, its placement not moved)."""
    q = BatchQueue.connect(redis_server.url, "t3b", Slots(1, 1))
    fill(q, range(3))
    delivery = q.get(1, block_ms=10)
    q.dead_letter(1, delivery.fields, "poison")
    [dead] = q.dead_letters()
    q.request_replay(dead["entry"])
    q.r.rpush(q.keys.replay_requests, "9-0")  # a second request behind it
    assert q.put_replay(3, dead["entry"], 10)
    assert q.put_replay(3, dead["entry"], 10)  # the retry
    assert q.r.lrange(q.keys.replay_requests, 0, -1) == [b"9-0"] and q.replay_placements() == {3: dead["entry"]}
    assert q.counts()["produced"] == 4 and q.next_slot() == 4


def test_an_undecodable_entry_is_delivered_with_the_reason(redis_server):
    q = BatchQueue.connect(redis_server.url, "t4", Slots(1, 1))
    q.r.xadd(q.keys.slots(0), {b"v": b"2", b"header": b"\x80\x04pickle", b"tokens": b"", b"sha256": b"x"},
             id=entry_id(0))
    delivery = q.get(0, block_ms=10)
    assert delivery.batch is None and "sha256" in delivery.problem


def test_a_batch_id_names_its_content_and_an_entry_with_other_content_is_refused(redis_server):
    batch = make_batch(3, np.random.default_rng(7))
    digest = batch.content_digest()
    assert digest == make_batch(3, np.random.default_rng(7)).content_digest()  # the same content, the same digest
    changed = dataclasses.replace(batch, edge_weights=np.array([100.0, 99.0], dtype=np.float32))
    assert changed.content_digest() != digest
    named = dataclasses.replace(batch, batch_id=str(dataclasses.replace(BatchId.of(batch), content=digest)))
    assert named.batch_id == f"v0-e0-s0-3-c{digest}" and BatchId.parse(named.batch_id).position == "v0-e0-s0-3"
    assert decode_batch(encode_batch(named)).batch_id == named.batch_id
    # the same id on other content (a builder that is not deterministic): the entry's own sha256 is intact, the id
    # is not its content's
    impostor = dataclasses.replace(changed, batch_id=named.batch_id)
    with pytest.raises(ProtocolError, match=f"holds content {changed.content_digest()}, not the {digest}"):
        decode_batch(encode_batch(impostor))
    q = BatchQueue.connect(redis_server.url, "t-content", Slots(1, 1))
    assert q.put(0, impostor, 10) and q.put(1, named, 10)
    refused, accepted = q.get(0, block_ms=10), q.get(1, block_ms=10)
    assert refused.batch is None and "not the" in refused.problem
    assert accepted.batch is not None and accepted.batch.batch_id == named.batch_id


def counting_round_trips(monkeypatch) -> list[int]:
    """Round trips to Redis made by the calling thread: one packed send each (a pipeline is one)."""
    me, sent = threading.get_ident(), [0]
    original = redis.connection.AbstractConnection.send_packed_command

    def send(self, command, check_health=True):
        if threading.get_ident() == me:
            sent[0] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    return sent


def test_the_batcher_writes_one_round_trip_per_batch(redis_server, monkeypatch):
    from services.batcher.writer import write_slots

    q = BatchQueue.connect(redis_server.url, "t3w", Slots(2, 1))
    q.next_slot()  # connected before counting
    sent = counting_round_trips(monkeypatch)
    written, stop = [], threading.Event()
    write_slots(q, lambda slot, _: make_batch(slot) if slot < 40 else stop.set(), lambda slot, placed: 0, 100,
                stop, lambda batch, slot: written.append(slot))
    assert written == list(range(40))
    assert sent[0] == 1 + 40  # where the queue stands, then one script per batch
    assert [q.get(n, block_ms=10).batch.batch_id for n in (0, 1, 39)] == ["v0-e0-s0-0", "v0-e0-s0-1", "v0-e0-s0-39"]


def test_builders_write_their_own_ranks_slots_side_by_side_each_once_behind_its_own_cursor(redis_server):
    """Three builders over five ranks x 2 micro-batches: each writes only its group's slots, in order, with one
    round trip a batch, while the others write theirs; a replay request is builder 0's alone; a reset moves
    every cursor back to its group's first slot of the update, and a builder restarted there writes nothing twice."""
    from services.batcher.writer import write_slots

    slots = Slots(world=5, grad_accum=2, builders=3)
    q = BatchQueue.connect(redis_server.url, "t-builders", slots)
    last = 4 * slots.per_step  # four updates
    written: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def run(group: int) -> None:
        stop = threading.Event()
        write_slots(q, lambda slot, _: make_batch(slot) if slot < last else stop.set(), lambda slot, placed: 0, 100,
                    stop, lambda batch, slot: written[group].append(slot), group)

    threads = [threading.Thread(target=run, args=(g,)) for g in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for group in range(3):
        assert written[group] == [n for n in range(last) if slots.group_of(n) == group]
        assert q.next_slot(group) == slots.first_slot_of_group(group, 4)
    assert sorted(n for w in written.values() for n in w) == list(range(last))
    assert q.counts()["produced"] == last and q.next_slot() == slots.first_slot_of_group(0, 4)
    for n in range(last):
        assert q.get(n, block_ms=10).batch.batch_id == f"v0-e0-s0-{n}"

    q.r.rpush(q.keys.replay_requests, "9-0")
    assert q.position(1) == (slots.first_slot_of_group(1, 4), None, {})  # other builders never see a request
    assert q.position(0)[1] == "9-0"
    q.r.delete(q.keys.replay_requests)
    q.reset_from(2)
    assert [q.next_slot(g) for g in range(3)] == [slots.first_slot_of_group(g, 2) for g in range(3)] == [20, 22, 26]
    for group in range(3):
        written[group].clear()
    run(1)  # a restarted builder from its cursor: slots of updates 2-3 again, the same batches
    assert written[1] == [n for n in range(20, last) if slots.group_of(n) == 1]
    assert q.get(23, block_ms=10).batch.batch_id == "v0-e0-s0-23"


def test_a_builder_waiting_far_ahead_follows_a_reset_to_an_older_checkpoint(redis_server):
    """A builder that waits for room far ahead of the ranks (it wrote up to the look-ahead) when a restarted trainer
    group resets the queue to an older checkpoint goes back and writes the slots the ranks now wait for, instead
    of waiting for progress that cannot come until it does."""
    from services.batcher.writer import write_slots

    q = BatchQueue.connect(redis_server.url, "t-reset-wait", Slots(1, 1))
    q.progress(0, 0)
    written: list[int] = []
    stop = threading.Event()
    thread = threading.Thread(target=write_slots, args=(q, lambda slot, _: make_batch(slot), lambda slot, placed: 0, 4,
                                                        stop, lambda batch, slot: written.append(slot)))
    thread.start()
    try:
        deadline = time.time() + 10
        while len(written) < 4:
            assert time.time() < deadline
            time.sleep(0.01)
        q.progress(0, 3)  # the ranks trained updates 0-2 (trimmed from the stream); the builder writes up to 6
        while len(written) < 7:
            assert time.time() < deadline
            time.sleep(0.01)
        q.reset_from(1)  # the group restarts from the checkpoint of update 1
        while q.r.xlen(q.keys.slots(0)) < 4:
            assert time.time() < deadline, "the builder did not go back to the reset cursor"
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert written[:7] == list(range(7)) and written[7:] == [1, 2, 3, 4]
    assert q.get(1, block_ms=10).batch.batch_id == "v0-e0-s0-1"


def test_a_builder_waiting_for_an_index_version_follows_a_reset_to_an_older_checkpoint(redis_server, tmp_path):
    """A builder waiting for the index version of a slot far ahead (built from a snapshot the ranks have not
    reached) when a restarted trainer group resets the queue gives up the wait (`wait_for_version`'s give_up, the
    actor's check of its cursor) and writes the slots the ranks now wait for."""
    from services.batcher.schedule import wait_for_version
    from services.batcher.writer import write_slots

    gave_up = []
    assert wait_for_version(tmp_path, 3, threading.Event(), poll_s=0.01,
                            give_up=lambda: gave_up.append(1) or len(gave_up) > 2) is None and len(gave_up) == 3
    q = BatchQueue.connect(redis_server.url, "t-version-wait", Slots(1, 1))
    q.progress(0, 0)
    written, waited, stop = [], [], threading.Event()

    def batch_for(slot: int, _):
        if slot == 3 and not waited:  # slot 3's index version is not built: wait while the cursor stays there
            waited.append(slot)
            return wait_for_version(tmp_path, 3, stop, poll_s=0.01, give_up=lambda: q.next_slot(0) != slot)
        return make_batch(slot) if slot < 5 else stop.set()

    thread = threading.Thread(target=write_slots, args=(q, batch_for, lambda slot, placed: 0, 100, stop,
                                                        lambda batch, slot: written.append(slot)))
    thread.start()
    deadline = time.time() + 10
    while not waited:
        assert time.time() < deadline
        time.sleep(0.01)
    q.reset_from(1)  # the group restarts from the checkpoint of update 1
    thread.join(timeout=10)
    assert not thread.is_alive() and written == [0, 1, 2, 1, 2, 3, 4]


def test_the_batcher_follows_a_moved_cursor_and_places_a_requested_replay(redis_server):
    from services.batcher.writer import write_slots

    q = BatchQueue.connect(redis_server.url, "t4w", Slots(1, 1))
    fill(q, range(3))
    q.dead_letter(1, q.get(1, block_ms=10).fields, "poison")
    q.request_replay(q.dead_letters()[0]["entry"])
    q.reset_from(2)  # the run resumes from update 2: the cursor is back at slot 2 for a batcher that wrote on
    schedule_positions, stop = [], threading.Event()

    def batch_for(slot: int, replays_before: int):
        schedule_positions.append((slot, replays_before))
        return make_batch(100 + slot - replays_before) if slot < 6 else stop.set()

    write_slots(q, batch_for, lambda slot, placed: sum(1 for n in placed if n < slot), 100, stop)
    assert q.replay_placements() == {2: q.dead_letters()[0]["entry"]}  # the requeued batch went first
    assert q.get(2, block_ms=10).batch.batch_id == "v0-e0-s0-1"
    # the schedule moved one slot on: slot 3 holds what slot 2 would have held
    assert schedule_positions == [(3, 1), (4, 1), (5, 1), (6, 1)]
    assert [q.get(n, block_ms=10).batch.batch_id for n in (3, 4, 5)] == [f"v0-e0-s0-{100 + n - 1}" for n in (3, 4, 5)]


def test_a_builder_waiting_to_place_a_requeued_batch_follows_a_reset_to_an_older_checkpoint(redis_server):
    """Builder 0 waiting for room to place a requeued dead-lettered batch when a restarted trainer group resets the
    queue goes back to the slots the ranks now wait for, as it does for a scheduled batch: the replay path offers
    against the cursor and placements it read, like the main path (else the ranks wait for ever)."""
    from services.batcher.writer import write_slots

    q = BatchQueue.connect(redis_server.url, "t-replay-reset", Slots(1, 1))
    q.progress(0, 2)
    stop = threading.Event()
    thread = threading.Thread(target=write_slots, args=(q, lambda slot, _: make_batch(slot),
                                                        lambda slot, placed: sum(1 for n in placed if n < slot), 1,
                                                        stop))
    thread.start()
    try:
        deadline = time.time() + 10
        while q.next_slot() < 3:  # slots 0-2 written; slot 3 waits for room
            assert time.time() < deadline
            time.sleep(0.01)
        for slot in (0, 1):
            q.dead_letter(slot, q.get(slot, block_ms=10).fields, "poison")
        first, second = (d["entry"] for d in q.dead_letters())
        q.request_replay(first)
        q.request_replay(second)
        q.progress(0, 3)  # room for slot 3: the first requeued batch goes there; the second waits for room at 4
        while q.replay_placements() != {3: first} or q.next_slot() != 4:
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        q.reset_from(2)  # the group restarts from the checkpoint of update 2: slot 3's placement is requested again
        got = q.get(2, block_ms=5000)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert got is not None, "the builder kept waiting for room at slot 4 after the reset: slot 2 was never written"
    assert got.batch.batch_id == "v0-e0-s0-0" and q.replay_placements() == {2: first}
    assert q.next_replay_request() == second


def test_a_replay_whose_request_a_reset_dropped_is_not_written(redis_server):
    """A requeued batch offered after a reset removed its request (its dead letter belonged to the discarded updates)
    is refused: the slot stays free for the batch the schedule puts there."""
    q = BatchQueue.connect(redis_server.url, "t-replay-gone", Slots(1, 1))
    fill(q, range(3))
    q.dead_letter(2, q.get(2, block_ms=10).fields, "poison")
    entry = q.dead_letters()[0]["entry"]
    q.request_replay(entry)
    fields = q.replay_fields(entry)
    q.r.lrem(q.keys.replay_requests, 0, entry)  # what a reset to update 2 does to the request
    status, _ = q.offer(3, fields, 10, replay_entry=entry)
    assert status == "replays" and q.get(3, block_ms=10) is None and q.replay_placements() == {}


def test_reset_from_rewinds_the_queue_to_a_checkpoint(redis_server):
    q = BatchQueue.connect(redis_server.url, "t5", Slots(2, 1))
    fill(q, range(10))
    commit(q, 0, 2, [(0, "v0-e0-s0-0"), (2, "v0-e0-s0-2")])
    commit(q, 1, 2, [(1, "v0-e0-s0-1"), (3, "v0-e0-s0-3")])
    commit(q, 0, 3, [(4, "v0-e0-s0-4")], since=2)  # rank 0 committed 3, rank 1 did not: resume from 2
    q.reset_from(2)
    counts = q.counts()
    assert q.next_slot() == 4 and counts["pending"] == 0 and counts["committed_step"] == 2
    assert q.committed_steps() == [2] and counts["trained"] == 4
    assert q.slowest_progress() == 2
    fill(q, range(4, 6))
    assert q.get(4, block_ms=10).batch.batch_id == "v0-e0-s0-4"


def queue_state(q: BatchQueue) -> dict:
    """Everything a resumed lineage's exactly-once depends on, without the times and entry ids a setup varies."""
    return {"counts": q.counts(), "ledger": {s: q.commits(s) for s in q.committed_steps()},
            "progress": [q.r.get(q.keys.progress(r)) for r in range(q.slots.world)], "slowest": q.slowest_progress(),
            "streams": [q.r.xlen(q.keys.slots(r)) for r in range(q.slots.world)],
            "dead": sorted((d["slot"], d["batch_id"], d["replayed_to_slot"], d["replay_requested"])
                           for d in q.dead_letters()),
            "trained_by_checkpoint": q.r.hgetall(q.keys.ledger_trained)}


def test_a_rank_0_that_dies_anywhere_inside_a_reset_leaves_the_queue_as_it_was_or_reset(redis_server, monkeypatch):
    """A reset is all or nothing: rank 0 killed after any number of its Redis round trips inside `reset_from` leaves
    a queue that the next group's rank 0 (`needs_reset`, `reset_from`) brings to exactly the state of an
    undisturbed reset: no record of the discarded checkpoints survives to be counted twice."""
    slots = Slots(2, 1)

    def setup() -> BatchQueue:
        q = BatchQueue(redis.Redis.from_url(redis_server.url), "t-reset-atomic", slots)
        q.r.flushall()
        fill(q, range(18))
        for step in (2, 4, 6, 8):  # a checkpoint every 2 updates
            for rank in (0, 1):
                commit(q, rank, step, [(n, f"v0-e0-s0-{n}") for n in range((step - 2) * 2, step * 2) if n % 2 == rank],
                       since=step - 2)
        for slot in (3, 9):  # the reset keeps the first dead letter and drops the second (slot 9 is trained again)
            q.dead_letter(slot, encode_batch(make_batch(slot)), "poison")
        for rank in (0, 1):
            q.progress(rank, 8)
        return q

    q = setup()
    assert q.committed_steps() == [2, 4, 6, 8]
    q.reset_from(2)
    expected = queue_state(q)
    assert list(expected["ledger"]) == [2] and expected["counts"]["trained"] == 4
    calls = {"n": 0, "die_at": 0}
    original_execute, original_pipeline = redis.Redis.execute_command, redis.client.Pipeline.execute

    def counted(real):
        def call(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == calls["die_at"]:
                raise redis.ConnectionError("rank 0 died here")
            return real(self, *args, **kwargs)
        return call

    for die_at in range(1, 40):
        q = setup()
        calls.update(n=0, die_at=die_at)
        with monkeypatch.context() as m:
            m.setattr(redis.Redis, "execute_command", counted(original_execute))
            m.setattr(redis.client.Pipeline, "execute", counted(original_pipeline))
            try:
                q.reset_from(2)
                finished = True
            except redis.ConnectionError:
                finished = False
        successor = BatchQueue(redis.Redis.from_url(redis_server.url), "t-reset-atomic", slots)
        if successor.needs_reset(2):
            successor.reset_from(2)
        assert queue_state(successor) == expected, f"rank 0 died at its round trip {die_at} inside the reset"
        if finished:
            break
    else:
        raise AssertionError("reset_from took more than 39 round trips")


def test_dead_letters_are_listed_and_requeued_into_the_next_slot(redis_server):
    q = BatchQueue.connect(redis_server.url, "t6", Slots(1, 1))
    fill(q, range(4))
    delivery = q.get(2, block_ms=10)
    assert q.dead_letter(2, delivery.fields, "update 2: non-finite loss (nan) on batch v0-e0-s0-2")
    assert not q.dead_letter(2, delivery.fields, "the same slot again (a resumed run)")  # once per slot
    [dead] = q.dead_letters()
    assert dead["slot"] == 2 and dead["batch_id"] == "v0-e0-s0-2" and "non-finite" in dead["reason"]
    assert dead["replayed_to_slot"] is None and q.counts()["dead_lettered"] == 1
    with pytest.raises(ValueError, match="no dead-lettered entry"):
        q.request_replay("1-0")
    q.request_replay(dead["entry"])
    with pytest.raises(ValueError, match="requeued already"):
        q.request_replay(dead["entry"])
    assert q.next_replay_request() == dead["entry"]
    assert q.put_replay(4, dead["entry"], 10)
    assert q.next_replay_request() is None and q.replay_placements() == {4: dead["entry"]}
    assert q.get(4, block_ms=10).batch.batch_id == "v0-e0-s0-2"
    assert q.dead_letters()[0]["replayed_to_slot"] == 4
    # a run resumed from before slot 4 forgets the placement and places the request again
    q.reset_from(3)
    assert q.replay_placements() == {} and q.next_replay_request() == dead["entry"]
    # a run resumed from before the dead slot trains it again: its dead letter belonged to the discarded updates
    q.reset_from(2)
    assert q.dead_letters() == [] and q.next_replay_request() is None and q.counts()["dead_lettered"] == 0
    fill(q, range(2, 4))
    assert q.dead_letter(2, q.get(2, block_ms=10).fields, "dead again in the resumed run")


def test_a_killed_redis_is_restarted_on_its_port_and_clients_carry_on(tmp_path, monkeypatch):
    from services.driver.redis_server import LocalRedis

    refused = []  # connection attempts the server's absence refused: the reader's retries, counted not timed
    connect = redis.connection.Connection._connect

    def counted_connect(self):
        try:
            return connect(self)
        except OSError:
            refused.append(1)
            raise

    monkeypatch.setattr(redis.connection.Connection, "_connect", counted_connect)
    server = LocalRedis(tmp_path / "redis").start()
    try:
        url, pid = server.url, server.pid
        q = BatchQueue.connect(url, "t7", Slots(1, 1))
        fill(q, range(3))
        # part of what is tested, not a wait for an event: with appendfsync everysec, what is older than a second is
        # on disk, so the SIGKILL below may lose nothing acknowledged
        time.sleep(1.2)
        os.kill(pid, signal.SIGKILL)
        server.process.wait()
        assert not server.alive()
        result = {}
        reader = threading.Thread(target=lambda: result.setdefault("batch", q.get(2, block_ms=10)))
        reader.start()  # retries while the server is down
        deadline = time.monotonic() + 30
        while len(refused) < 3:  # refused three times and still going: the client retries, it has not given up
            assert time.monotonic() < deadline and reader.is_alive(), (refused, result)
            time.sleep(0.01)
        assert reader.is_alive() and not result  # still retrying: nothing to read until the server is back
        server.restart()
        reader.join(timeout=30)
        assert server.url == url and server.pid != pid and server.alive()
        assert result["batch"].batch.batch_id == "v0-e0-s0-2" and q.next_slot() == 3
    finally:
        server.stop()


def test_an_orphaned_server_is_adopted_not_started_twice(tmp_path):
    from services.driver.redis_server import LocalRedis, pid_is_redis

    first = LocalRedis(tmp_path / "redis").start()
    orphan_pid = first.pid  # its driver "died": the server runs on, in its own session
    again = LocalRedis.reopen(tmp_path / "redis").start()
    try:
        assert again.adopted_pid == orphan_pid and again.process is None and again.url == first.url
        assert redis.Redis.from_url(again.url).ping()
    finally:
        again.stop()
    assert not pid_is_redis(orphan_pid)
    first.process.wait(timeout=5)  # reap it (it was this test's child)


def job_for(redis_server, run: str, world: int = 2, **queue):
    """What a trainer rank of `run` is given, as far as its feed reads it (the URL by its file, like the driver's)."""
    from types import SimpleNamespace

    from marge.contracts.protocol import write_url_file
    from marge.contracts.slots import QueueConfig, Slots

    url_file = write_url_file(redis_server.data_dir / f"{run}-url", redis_server.url)
    return SimpleNamespace(redis_url_file=str(url_file), paths=SimpleNamespace(name=run), deadline_unix=None,
                           trainer=SimpleNamespace(num_workers=world, grad_accum=1),
                           queue=QueueConfig(**{"block_ms": 10, **queue}), slots=Slots(world, 1))


def test_a_rank_waiting_for_a_batch_that_never_comes_stops_and_says_what_it_waited_for(redis_server, caplog):
    """No wait of a rank is for ever: after `queue.stall_s` it raises `Stalled`, naming the slot, the builder that
    writes it and where every rank stands; before that it says so in its log."""
    from marge.contracts.protocol import Stalled
    from services.trainer.source import RedisSource

    source = RedisSource(job_for(redis_server, "t-stall", stall_s=0.6), 1)
    source.WAIT_REPORT_S = 0.2
    fill(source.queue, range(2))
    source.queue.progress(0, 1)
    assert source.get(1) is not None
    with caplog.at_level("WARNING"), pytest.raises(Stalled, match=r"rank 1 waited \d+ s \(queue.stall_s\) for slot 3 "
                                                                  r"\(update 1\): batch builder 0, which writes it, is "
                                                                  r"at slot 2; rank 0 at update 1, rank 1 not reported"):
        source.get(3)
    assert "rank 1 has waited" in caplog.text


def test_a_builder_waiting_for_room_that_never_comes_stops_and_says_what_it_waited_for(redis_server):
    from marge.contracts.protocol import Stalled

    q = BatchQueue.connect(redis_server.url, "t-stall-room", Slots(2, 1))
    q.progress(0, 3)
    q.progress(1, 1)
    with pytest.raises(Stalled, match=r"batch builder 0 waited 0 s \(queue.stall_s\) for room to write slot 6 "
                                      r"\(update 3\): the slowest trainer rank is still at update 1 \(rank 0 at update "
                                      r"3, rank 1 at update 1\)"):
        q.wait_for_room(6, 2, poll_s=0.01, stall_s=0.2)


def test_a_group_resumed_below_the_last_commit_resets_the_queue_to_its_checkpoint(redis_server, caplog):
    """Rank 0 of a trainer group that resumed from an older checkpoint than the last commit (its newest could not be
    read) resets the queue to it and says so; at the committed update it changes nothing."""
    from services.trainer.source import RedisSource

    job = job_for(redis_server, "t1a")
    source = RedisSource(job, 0, resumed_step=2)
    q = source.queue
    fill(q, range(8))
    for rank in (0, 1):
        commit(q, rank, 2, [(n, f"v0-e0-s0-{n}") for n in range(4) if n % 2 == rank])
        commit(q, rank, 3, [(n, f"v0-e0-s0-{n}") for n in range(4, 6) if n % 2 == rank], since=2)
    assert q.committed_step() == 3
    source.agree_with(3)
    assert q.committed_step() == 3 and q.get(6, block_ms=10) is not None
    with caplog.at_level("WARNING"):
        source.agree_with(2)
    assert "resumed from the checkpoint of update 2 (last commit: update 3)" in caplog.text
    assert q.committed_step() == 2 and q.next_slot() == 4 and q.r.xlen(q.keys.slots(0)) == 0
    assert q.counts()["trained"] == 4  # updates 0-1; update 2 is trained again


def test_a_stream_holds_the_look_ahead_and_a_group_restarted_past_its_progress_resets_the_queue(redis_server, caplog):
    """A rank's progress drops its trained updates from its stream (the stream holds the look-ahead, not a
    checkpoint interval); a group that Ray Train restarts from the last commit after its ranks went past it finds
    those slots gone and resets the queue, so the builders write them again; a group starting where the ranks
    stand changes nothing."""
    from services.trainer.source import RedisSource

    job = job_for(redis_server, "t1p")
    source = RedisSource(job, 0)
    q = source.queue
    fill(q, range(8))
    for rank in (0, 1):
        commit(q, rank, 1, [(rank, f"v0-e0-s0-{rank}")])
    q.progress(0, 3)
    q.progress(1, 2)
    assert [slot_of_entry(e.decode()) for e, _ in q.r.xrange(q.keys.slots(0))] == [6]  # updates 0-2 dropped
    assert [slot_of_entry(e.decode()) for e, _ in q.r.xrange(q.keys.slots(1))] == [5, 7]
    assert q.pending() == 3 and not q.needs_reset(3) and q.needs_reset(1)
    with caplog.at_level("WARNING"):
        source.agree_with(1)  # restarted from the checkpoint of update 1, the last commit
    assert "resetting the queue to update 1" in caplog.text and "trained again" not in caplog.text
    assert q.next_slot() == 2 and q.pending() == 0 and q.counts()["trained"] == 2 and not q.needs_reset(1)


def test_a_stale_rank_that_wakes_after_its_replacement_started_can_write_nothing(redis_server, caplog):
    """Fencing: a rank of the old trainer group (a partitioned node) wakes after a new group started: its commit
    (which would trim its stream and record its interval), progress, dead letter and step record are refused and
    logged, and change nothing; the new group's writes go through."""
    from marge.contracts.protocol import Fenced
    from services.trainer.source import RedisSource

    job = job_for(redis_server, "t1f")
    stale, replacement = RedisSource(job, 0), RedisSource(job, 0)
    stale.join_generation(stale.start_generation())
    fill(stale.queue, range(8))
    stale.commit(1, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")]))])
    stale.progress(1)
    replacement.join_generation(replacement.start_generation())  # the new group starts; the old rank sleeps
    q = replacement.queue
    before = (q.counts(), q.r.xlen(q.keys.slots(0)), q.r.get(q.keys.progress(0)), q.r.llen(q.keys.steps))
    delivery = stale.get(2)
    with caplog.at_level("ERROR"):
        for write in (lambda: stale.commit(2, [(0, CommitRecord.of(2, 1, [(2, "v0-e0-s0-2")]))]),
                      lambda: stale.progress(2),
                      lambda: stale.dead_letter(delivery, "stale"), lambda: stale.publish({"step": 2})):
            with pytest.raises(Fenced, match="generation 1, but generation 2 has started"):
                write()
    assert caplog.text.count("write refused") == 4
    assert (q.counts(), q.r.xlen(q.keys.slots(0)), q.r.get(q.keys.progress(0)), q.r.llen(q.keys.steps)) == before
    replacement.commit(2, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")])),
                           (0, CommitRecord.of(2, 1, [(2, "v0-e0-s0-2")]))])
    replacement.progress(2)
    replacement.publish({"step": 2})
    assert q.counts()["trained"] == 2 and q.r.get(q.keys.progress(0)) == b"2" and q.last_step() == {"step": 2}
