"""Where every batch goes, as arithmetic and names: the queue's settings (`QueueConfig`), slots (one per rank and
micro-batch of each update, grouped by batch builder), index versions by update (`VersionPlan`), the Redis keys of a
run (`RunKeys`) and batch ids. The protocol that moves batches through these is `marge.contracts.protocol`."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from marge.contracts.batch import Batch
from marge.contracts.config import positive


@dataclass(frozen=True, kw_only=True)
class QueueConfig:
    """The queue's settings (the `queue:` section), read by the batcher (depth) and the trainers (waiting)."""

    max_depth: int = 32
    """Batches the batcher may write ahead of the slowest trainer rank (rounded up to whole updates)."""
    block_ms: int = 1000
    """How long a trainer's read waits for its next batch before it checks whether to stop."""
    stall_s: float = 3600.0
    """How long a trainer rank waits for one batch, or a batch builder for room ahead of the slowest rank, before it
    stops with an error naming what it waited for (`marge.contracts.protocol.Stalled`): a run that cannot move
    ends instead of hanging. Keep it above the longest pause of a healthy run (an index build the builders wait for,
    a checkpoint, an evaluation)."""

    def __post_init__(self) -> None:
        positive(self, "max_depth", "block_ms", "stall_s")


@dataclass(frozen=True)
class Slots:
    """The slot arithmetic of one run's trainers: world size x gradient accumulation batches per update, and which
    batch builder writes which slots.

    Builder (group) g of `builders` writes the slots of ranks [g*world//builders, (g+1)*world//builders), in slot
    order; its k-th slot is the k-th batch of its own sequence (`group_index`), so a builder needs nothing from
    another to know what its slots hold."""

    world: int
    grad_accum: int
    builders: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.builders <= self.world:
            raise ValueError(f"batch builders must be between 1 and the world size {self.world}, got {self.builders}")

    @property
    def per_step(self) -> int:
        return self.world * self.grad_accum

    def slot(self, step: int, rank: int, micro: int) -> int:
        return step * self.per_step + rank * self.grad_accum + micro

    def step_of(self, slot: int) -> int:
        return slot // self.per_step

    def rank_of(self, slot: int) -> int:
        return (slot % self.per_step) // self.grad_accum

    def group_ranks(self, group: int) -> range:
        """The ranks whose slots builder `group` writes."""
        return range(group * self.world // self.builders, (group + 1) * self.world // self.builders)

    def group_of_rank(self, rank: int) -> int:
        return ((rank + 1) * self.builders - 1) // self.world

    def group_of(self, slot: int) -> int:
        return self.group_of_rank(self.rank_of(slot))

    def group_per_step(self, group: int) -> int:
        """Slots of one update that builder `group` writes."""
        return len(self.group_ranks(group)) * self.grad_accum

    def first_slot_of_group(self, group: int, step: int) -> int:
        """Builder `group`'s first slot of update `step`."""
        return self.slot(step, self.group_ranks(group).start, 0)

    def next_in_group(self, slot: int) -> int:
        """The slot its builder writes after `slot`."""
        group = self.group_of(slot)
        following = slot + 1
        if following % self.per_step == 0 or self.rank_of(following) not in self.group_ranks(group):
            return self.first_slot_of_group(group, self.step_of(slot) + 1)
        return following

    def group_index(self, slot: int) -> int:
        """The position of `slot` in its builder's sequence of slots (0, 1, 2, ... over updates)."""
        group = self.group_of(slot)
        within = slot - self.first_slot_of_group(group, self.step_of(slot))
        return self.step_of(slot) * self.group_per_step(group) + within


@dataclass(frozen=True)
class VersionPlan:
    """Which index version serves which update (the batcher's schedule, services.batcher.schedule): version 0
    serves updates [0, R+L), version v >= 1 [v*R+L, (v+1)*R+L), and is built from the snapshot of update v*R."""

    reindex_every: int
    """0: a run without an index; version 0 (its corpus batches) serves every update."""
    lag: int

    @classmethod
    def without_index(cls) -> "VersionPlan":
        return cls(0, 0)

    def version_for_step(self, step: int) -> int:
        if self.reindex_every == 0 or step < self.reindex_every + self.lag:
            return 0
        return (step - self.lag) // self.reindex_every

    def first_step(self, version: int) -> int:
        return 0 if version == 0 else version * self.reindex_every + self.lag

    def snapshot_step(self, version: int) -> int:
        return version * self.reindex_every

    def builds_at(self, step: int) -> bool:
        """The snapshot of update `step` builds an index version (every `reindex_every` updates)."""
        return self.reindex_every > 0 and step % self.reindex_every == 0

    def newest_version_at(self, step: int) -> int:
        """The newest version whose snapshot exists once update `step` is trained."""
        return step // self.reindex_every if self.reindex_every else 0


@dataclass(frozen=True)
class RunKeys:
    """Every Redis key of one run (the only place they are spelled)."""

    run: str

    @property
    def prefix(self) -> str:
        return f"marge:{self.run}"

    def slots(self, rank: int) -> str:
        """Rank `rank`'s batches, one entry per slot."""
        return f"{self.prefix}:slots:{rank}"

    def next_slot(self, group: int = 0) -> str:
        """The first slot batch builder `group` has not written (its cursor)."""
        return f"{self.prefix}:next_slot:{group}"

    def progress(self, rank: int) -> str:
        """The first update rank `rank` has not trained (backpressure)."""
        return f"{self.prefix}:progress:{rank}"

    @property
    def progress_by_rank(self) -> str:
        """The same progress as a sorted set (member: the rank, score: its progress), written with each rank's key:
        the slowest rank is its first member, so a writer reads it in O(log world), not one key per rank."""
        return f"{self.prefix}:progress:ranked"

    @property
    def committed(self) -> str:
        """The update of the newest checkpoint whose batches are in the ledger."""
        return f"{self.prefix}:committed"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def dead_slots(self) -> str:
        """The slots whose batches are in the dead-letter stream (a slot is dead-lettered once)."""
        return f"{self.prefix}:deadletter:slots"

    @property
    def replay_requests(self) -> str:
        """Dead-letter entries an operator asked to train again, oldest first (`marge queue replay`)."""
        return f"{self.prefix}:replay:requested"

    @property
    def replays(self) -> str:
        """Where requeued batches went: slot -> dead-letter entry."""
        return f"{self.prefix}:replay:placed"

    def ledger(self, step: int) -> str:
        """The commits of the checkpoint of update `step`: rank -> its `CommitRecord` (`CommitRecord.encoded`)."""
        return f"{self.prefix}:ledger:{step}"

    @property
    def ledger_steps(self) -> str:
        """The checkpoint updates that have commits (a sorted set scored by update): what a reset deletes above
        its update, and the audit walks in order."""
        return f"{self.prefix}:ledger:steps"

    @property
    def ledger_trained(self) -> str:
        """Checkpoint update -> the batches its commits recorded (every rank's): the `trained` count is their sum."""
        return f"{self.prefix}:ledger:trained"

    @property
    def counters(self) -> str:
        return f"{self.prefix}:counters"

    @property
    def steps(self) -> str:
        """The trainer's recent step records (a capped list)."""
        return f"{self.prefix}:steps"

    @property
    def trainer_status(self) -> str:
        return f"{self.prefix}:trainer"

    @property
    def generation(self) -> str:
        """The trainer group's generation: raised by each new group's rank 0 as it starts (`start_generation`);
        a rank's writes carry the generation it joined and are refused once a newer group has started."""
        return f"{self.prefix}:trainer:generation"

    @property
    def stop(self) -> str:
        """Set by the driver: trainers stop at the next step boundary."""
        return f"{self.prefix}:control:stop"

    @property
    def lease(self) -> str:
        """The driver that owns the run (pid, host, heartbeat)."""
        return f"{self.prefix}:lease"


@dataclass(frozen=True)
class BatchId:
    """A batch's id: "v<index version>-e<pass over its graph>-s<shard>-<n>-c<content digest>", deterministic for a
    seed, so a ledger recognises a batch seen before. The position (version, pass, shard, n) says where the batch
    comes from; the content digest (`Batch.content_digest`) what it holds, so a batch built again with other content
    has another id: the trainer refuses an entry whose content is not its id's, and `marge audit` reports a
    position trained or recorded with two contents. Built and parsed only here."""

    version: int
    epoch: int
    shard: int
    number: int
    content: str = ""  # empty: an id made before the batch (or outside the batcher) carries no digest

    def __str__(self) -> str:
        position = f"v{self.version}-e{self.epoch}-s{self.shard}-{self.number}"
        return f"{position}-c{self.content}" if self.content else position

    @property
    def position(self) -> str:
        """The id without its content digest."""
        return str(dataclasses.replace(self, content=""))

    @classmethod
    def parse(cls, text: str) -> "BatchId | None":
        """The parts of a batcher-made id; None for ids made elsewhere (probes, benchmarks)."""
        parts = text.split("-")
        content = ""
        if len(parts) == 5 and parts[4][:1] == "c" and len(parts[4]) > 1:
            content = parts.pop()[1:]
        if len(parts) != 4 or [p[:1] for p in parts[:3]] != ["v", "e", "s"]:
            return None
        try:
            return cls(int(parts[0][1:]), int(parts[1][1:]), int(parts[2][1:]), int(parts[3]), content)
        except ValueError:
            return None

    @classmethod
    def of(cls, batch: "Batch") -> "BatchId | None":
        return cls.parse(batch.batch_id)



DIGEST_MODULUS = 1 << 128


def trained_digest(pairs: Iterable[tuple[int, str | None]]) -> str:
    """A digest of a set of trained (slot, batch id) pairs that adds up (`add_digests`): the sum, modulo 2^128, of
    each pair's SHA-256 (its first 128 bits). The digest of a union of disjoint sets is the sum of theirs, whatever
    the order, so every rank's commit of a checkpoint interval and rank 0's train-log lines of the same updates must
    add up to the same value; a pair named twice counts twice (a sum, not an XOR, which would cancel it). 32 hex
    digits."""
    total = 0
    for slot, batch_id in pairs:
        total += int.from_bytes(hashlib.sha256(f"{slot} {batch_id}".encode()).digest()[:16], "big")
    return f"{total % DIGEST_MODULUS:032x}"


def add_digests(digests: Iterable[str]) -> str:
    """The digest of the union of the disjoint sets `digests` are of (`trained_digest`)."""
    return f"{sum(int(d, 16) for d in digests) % DIGEST_MODULUS:032x}"


@dataclass(frozen=True)
class CommitRecord:
    """What one rank commits for one checkpoint interval, updates `since` .. `step` - 1: how many batches the rank
    trained in it and their `trained_digest`. Its size does not depend on the world or the interval: it stands for
    the (slot, batch id) pairs, which stay with the rank, and in train_log.jsonl (`marge audit` adds the lines up and
    compares)."""

    step: int
    """The checkpoint's update: the interval ends before it."""
    since: int
    """The update the interval starts at (the previous checkpoint's, or the one the group resumed from)."""
    trained: int
    digest: str

    @classmethod
    def of(cls, step: int, since: int, pairs: list[tuple[int, str]]) -> "CommitRecord":
        return cls(step, since, len(pairs), trained_digest(pairs))

    def encoded(self) -> str:
        """"<since> <trained> <digest>": under 64 bytes, so Redis keeps a checkpoint's hash of records as a listpack
        (compact, and dumped in one order however often it is reloaded) up to 128 ranks."""
        return f"{self.since} {self.trained} {self.digest}"

    @classmethod
    def decoded(cls, step: int, text: str | bytes) -> "CommitRecord":
        since, trained, digest = (text.decode() if isinstance(text, bytes) else text).split()
        return cls(step, int(since), int(trained), digest)
