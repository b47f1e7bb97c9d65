"""The delivery protocol (`marge.contracts.protocol`) as a state machine, against a real redis-server: Hypothesis
interleaves batch builders offering (`SlotWriter.offer`, the builders' own loop body), trainer ranks reading and
training in lockstep, checkpoints and the ranks' commits one by one, poison batches dead-lettered and requeued,
trainer groups crashing at any point and resuming from the newest or an older checkpoint (Ray Train's restart, or
the driver's reset as a run starts), restarted builders, stragglers of replaced groups writing late, and the
redis-server killed and started again from its append-only file.

After every step: no commit that differs from one recorded before for its checkpoint and rank, and the trained
count the sum of the checkpoints' (no record counted twice). At the end of every example
the run is driven on: it must reach a further checkpoint within a bounded number of rounds (no schedule deadlocks
it: every wait is a poll here, and a poll that never succeeds is a failure), and `marge audit`'s account of the
surviving lineage must be clean (every slot trained once or dead-lettered, every interval adding up to its
ranks' commits).

CI runs `MARGE_PROTOCOL_EXAMPLES` examples (default 2,000, about 2 minutes on a 2-core CPU); the long run:

    MARGE_PROTOCOL_EXAMPLES=50000 python -m pytest -q tests/integration/test_delivery_state_machine.py
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from marge.contracts.batch import Batch
from marge.contracts.protocol import BatchQueue, Fenced
from marge.contracts.slots import CommitRecord, Slots
from marge.contracts.train_log import UpdateRecord
from services.batcher.writer import SlotWriter
from services.driver.redis_server import LocalRedis
from services.ops.audit import CheckpointState, QueueState, account

WORLD = 2
LOOKAHEAD = 2
"""Updates a builder may write ahead of the slowest rank."""
EXAMPLES = int(os.environ.get("MARGE_PROTOCOL_EXAMPLES", "2000"))
FINISH_ROUNDS = 60
"""Rounds (every builder offers once, the group tries an update) the end of an example may take to reach a further
checkpoint; a healthy queue needs a handful."""
RUN = "sm"

TOKENS = tuple(np.arange(4, 4 + n, dtype=np.int32) for n in (3, 2))


def batch(batch_id: str) -> Batch:
    return Batch(batch_id, 0, 0, np.array([0, 1], dtype=np.int64), ("en", "de"), TOKENS, np.array([0], dtype=np.int32),
                 np.array([1], dtype=np.int32), np.array([[0, 0]], dtype=np.int32), np.array([1.0], dtype=np.float32))


@dataclass
class Checkpoint:
    """A durable checkpoint as the ranks write it: its update, every rank's commit of its interval and the batches
    the interval left out (what a resumed rank commits and dead-letters again)."""

    step: int
    commits: dict[int, CommitRecord] = field(default_factory=dict)
    dead: list[tuple[int, dict, str]] = field(default_factory=list)


@dataclass
class Group:
    """A trainer group: one queue client per rank, joined to the group's generation."""

    queues: list[BatchQueue]
    step: int
    committed: dict[int, CommitRecord | None]
    """Each rank's last commit (committed again with its next)."""
    uncommitted: list[tuple[int, str]] = field(default_factory=list)
    uncommitted_dead: list[tuple[int, dict, str]] = field(default_factory=list)
    pending: dict[int, Checkpoint] = field(default_factory=dict)
    """Ranks that have not committed the newest checkpoint yet."""
    started_at: int = 0
    """The update it resumed from."""
    interval_start: int = 0
    """The update the next checkpoint's interval starts at."""


class DeliveryMachine(RuleBasedStateMachine):
    server: LocalRedis

    def __init__(self):
        super().__init__()
        self.admin = redis.Redis.from_url(self.server.url)
        self.admin.flushall()
        self.poisoned: set[int] = set()
        self.records: list[UpdateRecord] = []
        """The surviving lineage's train log (rank 0's: cut back to the checkpoint a group resumes from)."""
        self.checkpoints = [Checkpoint(0)]
        self.stragglers: list[Group] = []
        self.slots: Slots | None = None

    # --- set-up ------------------------------------------------------------------------------------

    @rule(builders=st.sampled_from([1, 2]), grad_accum=st.sampled_from([1, 2]), redis_dies=st.integers(0, 9))
    @precondition(lambda self: self.slots is None)
    def start(self, builders, grad_accum, redis_dies):
        self.slots = Slots(WORLD, grad_accum, builders)
        self.redis_may_die = redis_dies == 0  # a restart costs a second or so: one example in ten has one
        self.writers = [self.writer(g) for g in range(builders)]
        BatchQueue(self.admin, RUN, self.slots).reset_from(0)  # the driver, as a run starts
        self.group = self.start_group(self.checkpoints[0])

    def writer(self, group: int) -> SlotWriter:
        slots = self.slots

        def batch_for(slot: int, replays_before: int) -> Batch:
            return batch(f"v0-e0-s{group}-{slots.group_index(slot) - replays_before}")

        return SlotWriter(self.queue(), batch_for, lambda slot, placed: sum(1 for n in placed if n < slot), LOOKAHEAD,
                          group=group)

    def queue(self) -> BatchQueue:
        return BatchQueue.connect(self.server.url, RUN, self.slots)

    def start_group(self, checkpoint: Checkpoint) -> Group:
        """What `services.trainer.rank` does as a group starts from `checkpoint`: rank 0 takes a new generation and
        makes the queue agree with the checkpoint; every rank reports its progress, dead-letters and commits the
        checkpoint's interval again."""
        queues = [self.queue() for _ in range(WORLD)]
        generation = queues[0].start_generation()
        for q in queues[1:]:
            q.join_generation(generation)
        step = checkpoint.step
        if queues[0].needs_reset(step):
            queues[0].reset_from(step)
        group = Group(queues, step, {r: checkpoint.commits.get(r) for r in range(WORLD)}, started_at=step,
                      interval_start=step)
        for rank, q in enumerate(queues):
            q.progress(rank, step)
        if step:
            for rank, q in enumerate(queues):
                for slot, fields, reason in checkpoint.dead:
                    if self.slots.rank_of(slot) == rank:
                        q.dead_letter(slot, fields, reason)
                q.commit(rank, step, [(r, c) for r, c in checkpoint.commits.items() if r % WORLD == rank])
        return group

    def started(self) -> bool:
        return self.slots is not None

    # --- builders ----------------------------------------------------------------------------------

    @rule(which=st.integers(0, 1), times=st.integers(1, 8))
    @precondition(started)
    def offer(self, which, times):
        """A builder offers `times` times (a batch per offer, unless it is too far ahead or must read its place)."""
        for _ in range(times):
            self.writers[which % len(self.writers)].offer()

    @rule(updates=st.integers(1, 4), poison=st.integers(0, 3))
    @precondition(started)
    def advance(self, updates, poison):
        """The run moves on by up to `updates` updates: the builders write what they may, the group trains."""
        for n in range(updates):
            self.run_round(poison if n == 0 else 1)

    def run_round(self, poison: int) -> bool:
        """The group tries an update, then every builder offers until it must wait (at most a look-ahead's worth):
        in a steady run the builders stand at the look-ahead's edge, where a requeue or a reset finds them."""
        trained = self.train_update(poison)
        for writer in self.writers:
            for _ in range((LOOKAHEAD + 1) * self.slots.per_step):
                if writer.offer() == "ahead":
                    break
        return trained

    @rule(which=st.integers(0, 1))
    @precondition(started)
    def restart_builder(self, which):
        """A batch builder's actor restarted: it reads its place from the queue again."""
        which %= len(self.writers)
        self.writers[which] = self.writer(which)

    # --- trainers ----------------------------------------------------------------------------------

    @rule(updates=st.integers(1, 3), poison=st.integers(0, 3))
    @precondition(started)
    def train(self, updates, poison):
        """The group trains up to `updates` updates, each as soon as every rank's batches of it are there (lockstep:
        DDP's all-reduce); with `poison` 0, one batch of the first cannot be trained and is left out (dead-lettered
        once a checkpoint covers it)."""
        for n in range(updates):
            if not self.train_update(poison if n == 0 else 1):
                return

    def train_update(self, poison: int) -> bool:
        g, slots = self.group, self.slots
        wanted = [slots.slot(g.step, r, m) for r in range(WORLD) for m in range(slots.grad_accum)]
        got = {}
        for slot in wanted:
            delivery = g.queues[slots.rank_of(slot)].get(slot, block_ms=None)  # SlotGone if the queue lost it
            if delivery is None:
                return False
            got[slot] = delivery
        bad = wanted[0] if poison == 0 else None
        for slot, d in got.items():
            if slot == bad:
                g.uncommitted_dead.append((slot, d.fields, f"update {g.step}: poison"))
            else:
                g.uncommitted.append((slot, d.batch.batch_id))
        g.step += 1
        for rank, q in enumerate(g.queues):
            q.progress(rank, g.step)
        self.records.append(UpdateRecord(g.step, 1.0, 1e-4, 1.0, [got[n].batch.batch_id for n in wanted], wanted,
                                         [bad] if bad is not None else []))
        return True

    @rule(committing=st.integers(0, WORLD))
    @precondition(lambda self: self.started() and not self.group.pending
                  and self.group.step > self.checkpoints[-1].step)
    def checkpoint(self, committing=0):
        """The checkpoint of the group's update is durable (it holds the interval's batches); each rank commits next,
        the first `committing` at once."""
        g = self.group
        commits = {r: CommitRecord.of(g.step, g.interval_start, [(n, b) for n, b in g.uncommitted
                                                                 if self.slots.rank_of(n) == r]) for r in range(WORLD)}
        saved = Checkpoint(g.step, commits, g.uncommitted_dead)
        g.interval_start = g.step
        self.checkpoints.append(saved)
        g.pending = {rank: saved for rank in range(WORLD)}
        g.uncommitted, g.uncommitted_dead = [], []
        for rank in range(committing):
            self.commit(rank)

    @rule(rank=st.integers(0, WORLD - 1))
    @precondition(lambda self: self.started() and self.group.pending)
    def commit(self, rank):
        g = self.group
        if rank not in g.pending:
            rank = min(g.pending)
        saved = g.pending.pop(rank)
        for slot, fields, reason in saved.dead:
            if self.slots.rank_of(slot) == rank:
                g.queues[rank].dead_letter(slot, fields, reason)
        previous = g.committed[rank]
        g.queues[rank].commit(rank, saved.step, ([(rank, previous)] if previous else []) + [(rank, saved.commits[rank])])
        g.committed[rank] = saved.commits[rank]

    @rule(older=st.integers(0, 2), by_driver=st.booleans())
    @precondition(lambda self: self.started() and self.group.step > self.group.started_at)  # it trained since
    def crash(self, older, by_driver):
        """The trainer group dies; a new one resumes from the newest checkpoint, or an older one when the newer are
        unreadable. Restarted by Ray Train, its rank 0 resets the queue if it must; restarted by the driver (a run
        started again), the driver resets it first and the builders restart. The old group lingers as a straggler."""
        self.stragglers = [self.group][-1:]
        resume = self.checkpoints[max(0, len(self.checkpoints) - 1 - older)]
        self.checkpoints = [c for c in self.checkpoints if c.step <= resume.step]
        self.records = [r for r in self.records if r.step <= resume.step]
        if by_driver:
            BatchQueue(self.admin, RUN, self.slots).reset_from(resume.step)
            self.writers = [self.writer(g) for g in range(len(self.writers))]
        self.group = self.start_group(resume)

    @rule()
    @precondition(lambda self: self.started() and self.stragglers)
    def straggler_writes(self):
        """A rank of a replaced group wakes and writes: every write is refused, and changes nothing."""
        stale = self.stragglers[0]
        before = self.snapshot()
        late = CommitRecord.of(stale.step + 1, stale.interval_start, stale.uncommitted)
        for write in (lambda: stale.queues[0].commit(0, stale.step + 1, [(0, late)]),
                      lambda: stale.queues[1].progress(1, stale.step + 1),
                      lambda: stale.queues[0].reset_from(max(0, stale.step - 1))):
            with pytest.raises(Fenced):
                write()
        assert self.snapshot() == before

    # --- operators and Redis -----------------------------------------------------------------------

    @rule(offers=st.integers(0, 2))
    @precondition(started)
    def requeue(self, offers):
        """An operator requeues a dead-lettered batch (`marge queue replay`); builder 0 then offers `offers` times."""
        q = self.group.queues[0]
        for dead in q.dead_letters():
            if dead["replayed_to_slot"] is None and not dead["replay_requested"]:
                q.request_replay(dead["entry"])
                break
        for _ in range(offers):
            self.writers[0].offer()

    @rule()
    @precondition(lambda self: self.started() and self.redis_may_die)
    def kill_redis(self):
        """redis-server killed (SIGKILL) and started again on its port from its append-only file: every client
        reconnects (`BatchQueue.connect` retries) and nothing acknowledged is lost."""
        before = self.snapshot()
        os.kill(self.server.pid, signal.SIGKILL)
        self.server.process.wait()
        self.server.restart()
        self.redis_may_die = False
        assert self.snapshot() == before

    # --- what must hold ------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {key.decode(): self.admin.dump(key) for key in sorted(self.admin.scan_iter(f"marge:{RUN}:*"))
                if not key.decode().endswith(":steps")}

    @invariant()
    def nothing_counted_twice(self):
        if not self.started():
            return
        keys = BatchQueue(self.admin, RUN, self.slots).keys  # one round trip: this runs after every step
        conflicts, trained, by_checkpoint = self.admin.pipeline(transaction=False).hget(
            keys.counters, "commit_conflicts").hget(keys.counters, "trained").hgetall(keys.ledger_trained).execute()
        assert int(conflicts or 0) == 0
        assert int(trained or 0) == sum(int(n) for n in by_checkpoint.values()), (trained, by_checkpoint)
        for step, n in by_checkpoint.items():
            assert 0 <= int(n) <= int(step) * self.slots.per_step, (step, n)

    def teardown(self):
        if not self.started():
            return
        g = self.group
        for rank in sorted(g.pending):
            self.commit(rank)
        target = g.step + 2
        for _ in range(FINISH_ROUNDS):
            if g.step >= target:
                break
            self.run_round(poison=1)
        assert g.step >= target, (f"the run is stuck at update {g.step}: {FINISH_ROUNDS} rounds of every builder "
                                  f"offering did not bring update {target} ({g.queues[0].describe_progress()}, "
                                  f"cursors {[g.queues[0].next_slot(b) for b in range(self.slots.builders)]})")
        self.checkpoint(committing=WORLD)
        newest = self.checkpoints[-1]
        records = [r for r in self.records if r.step <= newest.step]
        result = account(lambda: iter(records), self.slots, CheckpointState(newest.step, None, newest.commits, []),
                         QueueState.of(BatchQueue(self.admin, RUN, self.slots)))
        assert result["ok"] and result["batches_lost"] == 0 and result["trained_twice"] == 0, result
        trained = sum(len(r.trained_slots()) for r in records)
        assert result["batches_trained"] == trained, (result, trained)


@pytest.fixture(scope="module")
def machine_redis(tmp_path_factory):
    # appendfsync "no": redis-server still write()s each change to its append-only file before it replies (with no
    # background fsync to hold the write back), so a SIGKILL loses nothing acknowledged, as with "always"; the fsync
    # only matters to a machine crash, which no test here can stage, and would make each example ten times slower
    server = LocalRedis(tmp_path_factory.mktemp("state-machine-redis"), appendfsync="no").start()
    yield server
    server.stop()


def test_no_schedule_breaks_exactly_once(machine_redis):
    DeliveryMachine.server = machine_redis
    DeliveryMachine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=50, deadline=None, derandomize=EXAMPLES <= 2000,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], database=None)
    DeliveryMachine.TestCase().runTest()
