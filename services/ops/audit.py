"""`marge audit` and `marge queue`: what a run trained, checked against its checkpoint, ledger and logs.

The account of one run (the `marge.contracts.protocol` delivery rules), from the newest good checkpoint C:

    slots of updates 0..C-1   each trained (train_log.jsonl names it, and a commit of its rank covers its update:
                              the ledger's record of a checkpoint interval, or the checkpoint's own record of its
                              last interval when the driver died before the ranks recorded it in Redis:
                              `batches_awaiting_commit`)
                              or dead-lettered (in the dead-letter stream with that slot, or in the checkpoint's
                              record of the ones its interval left out)
    lost                      such a slot in none of these: no line names it trained and no dead letter names
                              it, or its update is in no committed interval of its rank
    commits disagree          a checkpoint interval whose lines do not add up to its ranks' commits: a rank's count
                              of trained batches, or the interval's `trained_digest` (the lines' against the
                              commits', content digests included), or a rank that trained without a commit
    trained twice             a batch id (a position, on a compact line) that train_log.jsonl shows in two
                              trained slots up to C
    content changed           a batch position (version, pass, shard, n) that train_log.jsonl (lines listing ids in
                              full) or the dead letters name with two content digests (`BatchId`): a builder made it
                              again with other content, so "the same batch" was not the same
    pending                   written into the streams, not yet covered by a checkpoint

The account streams train_log.jsonl (its segments, then the live file) and holds no map over the run's slots or
batch ids, so its memory does not grow with the run, whatever the number of batch builders: `account` is that core,
from its inputs alone (no Redis, no files), `audit` reads them. It holds one checkpoint interval's commits at a time
(one record a rank, read from Redis as the log reaches the interval), the dead letters, each builder's place in its
own schedule and the shards of the passes the builders are in, and reads the log once; only ids out of their
builder's order that no dead letter names (a batch doubled or rebuilt) are remembered, and counted over the log a
second time.

The run's Redis is opened as the run left it: a `redis.url` from --redis-url or MARGE_REDIS_URL, else the
run's private server, started from its AOF for the audit (and stopped again) when it is not running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from marge.contracts.protocol import BatchQueue
from marge.contracts.slots import BatchId, CommitRecord, Slots, add_digests, trained_digest
from marge.contracts.train_log import TrainLog, TrainLogError, UpdateRecord
from marge.model.checkpoint import read_manifest
from marge.model.lineage import newest_good_checkpoint
from services.driver.config import PipelineConfig, load_config, redis_url_from_environment
from services.driver.redis_server import LocalRedis, private_conf_dir


def run_config_of(run_dir: Path) -> PipelineConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --run must be the run.dir of a `marge pretrain` run")
    return load_config(path)


@contextlib.contextmanager
def run_queue(run_dir: Path, redis_url: str | None = None) -> Iterator[tuple[PipelineConfig, BatchQueue]]:
    """The run's config and its queue on the run's Redis (see the module docstring)."""
    cfg = run_config_of(run_dir)
    url = redis_url or redis_url_from_environment()
    if url:
        yield cfg, BatchQueue.connect(url, cfg.run.name, cfg.slots())
        return
    data_dir, conf_dir = Path(run_dir) / "redis", private_conf_dir(Path(run_dir))
    if not (conf_dir / "redis.conf").exists() and single_process_run(Path(run_dir)):
        raise ValueError(f"{run_dir} was trained in a single process (`marge pretrain --single-process`: "
                         "its checkpoints are in checkpoints/, not ray_train/): it had no batch queue, so there is "
                         "nothing to audit; its train_log.jsonl lists the batches of every update")
    if not (conf_dir / "redis.conf").exists():
        raise FileNotFoundError(f"{conf_dir}/redis.conf not found: the run used an external Redis (set "
                                "MARGE_REDIS_URL_FILE or MARGE_REDIS_URL, or pass --redis-url), or its private "
                                "server ran as another user or with another "
                                "MARGE_STATE_DIR")
    server = LocalRedis.reopen(data_dir, conf_dir).start()
    try:
        yield cfg, BatchQueue.connect(server.url, cfg.run.name, cfg.slots())
    finally:
        if server.process is not None:  # started here for the audit; a server that a live driver owns stays
            server.stop()


def single_process_run(run_dir: Path) -> bool:
    """Whether `run_dir` is a single-process run's (checkpoints in checkpoints/, none under ray_train/)."""
    return (run_dir / "checkpoints").is_dir() and not (run_dir / "ray_train").exists()


def checkpoint_deliveries(checkpoint: Path | None) -> tuple[dict[int, CommitRecord], list[tuple[int, str]]]:
    """(rank -> its commit of the checkpoint's last interval, (slot, reason) of the batches the interval left out)
    (its tensors are memory-mapped, not read)."""
    if checkpoint is None:
        return {}, []
    import torch

    state = torch.load(Path(checkpoint) / "training_state.pt", map_location="cpu", weights_only=True, mmap=True)
    step = int(read_manifest(checkpoint, verify=False)["step"])
    return ({int(r): CommitRecord(step, int(since), int(t), str(d)) for r, since, t, d in state.get("commits", ())},
            [(int(n), str(r)) for n, _, r in state.get("dead_since_previous", ())])


def content_changed(batch_ids) -> list[dict]:
    """Positions named with more than one content digest among `batch_ids` (ids without a digest are skipped)."""
    contents: dict[str, set[str]] = {}
    for text in batch_ids:
        parsed = BatchId.parse(text) if text else None
        if parsed is not None and parsed.content:
            contents.setdefault(parsed.position, set()).add(parsed.content)
    return [{"position": p, "contents": sorted(c)} for p, c in sorted(contents.items()) if len(c) > 1]


@dataclass
class QueueState:
    """What the audit reads from the run's Redis: the counters, the checkpoint updates that have commits, each
    interval's commits when the account reaches it (`commits`, one HGETALL: never every interval at once), and the
    dead letters (few)."""

    counts: dict[str, int]
    committed_steps: list[int]
    """Checkpoint updates with commits in the ledger, in order."""
    commits: Callable[[int], dict[int, CommitRecord]]
    """Checkpoint update -> rank -> its commit."""
    dead_letters: list[dict]

    @classmethod
    def of(cls, queue: BatchQueue) -> "QueueState":
        return cls(queue.counts(), queue.committed_steps(), queue.commits, queue.dead_letters())


@dataclass
class CheckpointState:
    """The newest good checkpoint: the update it holds and what its last interval committed and left out."""

    step: int
    path: str | None = None
    commits: dict[int, CommitRecord] = field(default_factory=dict)
    """Rank -> its commit of the checkpoint's last interval (`checkpoint_deliveries`)."""
    dead: list[tuple[int, str]] = field(default_factory=list)
    """(slot, reason) left out in its last interval."""


def audit(cfg: PipelineConfig, queue: BatchQueue) -> dict:
    """The run's account (see the module docstring); `ok` is whether nothing was lost, trained twice or changed,
    and every interval adds up to its commits."""
    path = newest_good_checkpoint(cfg.paths().checkpoints)
    step = int(read_manifest(path, verify=False)["step"]) if path else 0
    state = QueueState.of(queue)
    commits, dead = checkpoint_deliveries(path)
    log = TrainLog.of_run(cfg.paths().run_dir)
    return account(lambda: log.iter_records(through_step=step), cfg.slots(),
                   CheckpointState(step, str(path) if path else None, commits, dead), state, source=str(log.path))


def account(read_records: Callable[[], Iterable[UpdateRecord]], slots: Slots, checkpoint: CheckpointState,
            queue: QueueState, source: str = "train log") -> dict:
    """The audit's account from its inputs alone, no Redis, no files: `read_records()` gives the train log's
    records up to the checkpoint, in update order, and is called once, or twice when the log holds ids out of their
    builder's order that no dead letter names (each call a new pass).

    It holds one interval's commits, the dead letters, each builder's place in its schedule and those out-of-order
    ids, never a map over the run's slots or batch ids: exactly-once is checked while streaming (`_SlotAccount` for
    the slots and the commits, `_BatchIdAccount` for the batch ids)."""
    counts = queue.counts
    slot_account = _SlotAccount(slots, checkpoint, queue)
    ids = _BatchIdAccount(queue, slots)
    updates = 0
    for record in read_records():
        updates += 1
        if record.slots:
            slot_account.settle_update(record, source)
        ids.first_pass(record)
    slot_account.finish()
    if ids.needs_second_pass:
        ids.start_second_pass()
        for record in read_records():
            ids.second_pass(record)
    logged_twice = ids.trained_twice()
    changed = ids.content_changed()
    trained_twice = counts.get("trained_twice", 0) + len(logged_twice)
    dead = queue.dead_letters
    conflicts = counts.get("commit_conflicts", 0)
    return {
        "ok": (not slot_account.lost_count and trained_twice == 0 and not slot_account.disagree_count and not changed
               and not conflicts),
        "steps": checkpoint.step, "checkpoint": checkpoint.path,
        "committed_step": counts["committed_step"],
        "batches_produced": counts.get("produced", 0),
        "batches_trained": slot_account.trained_count + slot_account.awaiting_count,
        "batches_lost": slot_account.lost_count, "lost_slots": slot_account.lost,
        "trained_twice": trained_twice, "trained_twice_ids": logged_twice[:REPORTED],
        "commits_disagree_with_train_log": slot_account.disagree,
        "commit_conflicts": conflicts,
        "content_changed": changed[:REPORTED],
        "checkpoint_intervals": slot_account.intervals_checked,
        "batches_pending": counts["pending"],
        "batches_awaiting_commit": slot_account.awaiting_count + len(slot_account.awaiting_dead),
        "batches_dead_lettered": sum(1 for d in dead if d["replayed_to_slot"] is None)
        + len(slot_account.awaiting_dead),
        "batches_replayed": sum(1 for d in dead if d["replayed_to_slot"] is not None),
        "train_log_updates": updates,
    }


REPORTED = 100
"""Slots, batch ids, intervals and updates listed in the account (each list's count is given in full where it has
one)."""


@dataclass
class _Interval:
    """One checkpoint interval's commits (updates `since` .. `step` - 1) and what the log said of it so far."""

    since: int
    step: int
    commits: dict[int, CommitRecord]
    awaiting: bool
    """Its commits are the checkpoint's own, not yet in the ledger."""
    trained_by_rank: dict[int, int] = field(default_factory=dict)
    digests: list[str] = field(default_factory=list)


class _SlotAccount:
    """Every slot of updates 0..C-1, in slot order as the log streams past: trained (named by a line, in an interval
    its rank committed, or in the checkpoint's own last interval), dead-lettered, or lost; and each checkpoint
    interval checked against its commits (each rank's count, the interval's digest). Holds the current interval's
    commits, the dead letters and the first `REPORTED` slots of each finding."""

    def __init__(self, slots: Slots, checkpoint: CheckpointState, queue: QueueState):
        self.slots = slots
        self.step = checkpoint.step
        self.covered = checkpoint.step * slots.per_step
        self.commits = queue.commits
        steps = [s for s in queue.committed_steps if s <= checkpoint.step]
        self.awaiting_commits = checkpoint.commits if checkpoint.step and checkpoint.step not in steps else {}
        """The checkpoint's own interval's commits, when the ledger does not have them yet."""
        if self.awaiting_commits:
            steps.append(checkpoint.step)
        self.pending_steps = steps
        """Checkpoint updates whose intervals are still ahead of the log, in order."""
        self.interval: _Interval | None = None
        self.dead_slots = {d["slot"] for d in queue.dead_letters}
        self.awaiting_dead = {n for n, _ in checkpoint.dead if n not in self.dead_slots}
        self.next_slot = 0
        self.trained_count = self.awaiting_count = 0
        self.intervals_checked = 0
        self.lost_count, self.lost = 0, list[int]()
        self.disagree_count, self.disagree = 0, list[dict]()

    def _interval_of(self, update: int) -> _Interval | None:
        """The interval holding `update` (checking the ones the log has left behind); None: no commit covers it."""
        while self.interval is not None and update >= self.interval.step:
            self._check(self.interval)
            self.interval = None
        while self.interval is None and self.pending_steps and self.pending_steps[0] <= update:
            self._check(self._open(self.pending_steps.pop(0)))  # an interval the log has no line of
        if self.interval is None and self.pending_steps:
            self.interval = self._open(self.pending_steps.pop(0))
        interval = self.interval
        return interval if interval is not None and interval.since <= update < interval.step else None

    def _open(self, step: int) -> _Interval:
        awaiting = step == self.step and bool(self.awaiting_commits)
        commits = self.awaiting_commits if awaiting else self.commits(step)
        starts = {c.since for c in commits.values()}
        if len(starts) > 1:
            self._disagree(step, None, f"its ranks' commits start at different updates {sorted(starts)}")
        return _Interval(min(starts, default=step), step, commits, awaiting)

    def settle_update(self, record: UpdateRecord, source: str) -> None:
        """Settle every slot up to the record's last, the record being update `record.step` - 1's."""
        first, last = min(record.slots), max(record.slots)
        if first < self.next_slot:
            raise TrainLogError(f"{source}: update {record.step} records slot {first}, which an earlier line already "
                                "passed: the log's lines are out of update order (two writers?); cut it at the "
                                "checkpoint with TrainLog.truncate_after, or restore it from a copy, and audit again")
        for n in range(self.next_slot, first):  # updates no line names
            self._settle(n, False, None)
        update = record.step - 1
        interval = self._interval_of(update) if update < self.step else None
        trained = record.trained_slots()
        for n in range(first, last + 1):
            self._settle(n, n in trained, interval)
        if interval is not None:
            interval.digests.append(record.trained_digest or trained_digest(trained.items()))
        self.next_slot = last + 1

    def finish(self) -> None:
        """Settle the slots up to the checkpoint that no record named, and check the intervals left."""
        for n in range(self.next_slot, self.covered):
            self._settle(n, False, None)
        self.next_slot = max(self.next_slot, self.covered)
        if self.interval is not None:
            self._check(self.interval)
            self.interval = None
        while self.pending_steps:
            self._check(self._open(self.pending_steps.pop(0)))

    def _settle(self, n: int, trained: bool, interval: _Interval | None) -> None:
        if n >= self.covered:
            return
        rank = self.slots.rank_of(n)
        if trained and interval is not None and rank in interval.commits:
            interval.trained_by_rank[rank] = interval.trained_by_rank.get(rank, 0) + 1
            if interval.awaiting:
                self.awaiting_count += 1
            else:
                self.trained_count += 1
            return
        if trained and interval is not None:  # trained, but its rank committed nothing for the interval
            interval.trained_by_rank[rank] = interval.trained_by_rank.get(rank, 0) + 1
        if not trained and (n in self.dead_slots or n in self.awaiting_dead):
            return
        self.lost_count += 1
        if len(self.lost) < REPORTED:
            self.lost.append(n)

    def _check(self, interval: _Interval) -> None:
        """An interval the log has passed: each rank's count and the interval's digest against its commits."""
        self.intervals_checked += 1
        found = self.disagree_count
        for rank in sorted(set(interval.commits) | set(interval.trained_by_rank)):
            committed = interval.commits[rank].trained if rank in interval.commits else None
            logged = interval.trained_by_rank.get(rank, 0)
            if committed is None:
                self._disagree(interval.step, rank, f"trained {logged} batches it never committed")
            elif committed != logged:
                self._disagree(interval.step, rank, f"committed {committed} batches, the log names {logged}")
        if self.disagree_count > found:  # the digest cannot agree either: one finding an interval is enough
            return
        committed_digest = add_digests(c.digest for c in interval.commits.values())
        if committed_digest != add_digests(interval.digests):
            self._disagree(interval.step, None, "its batches are not the ones its ranks committed (digest)")

    def _disagree(self, step: int, rank: int | None, what: str) -> None:
        self.disagree_count += 1
        if len(self.disagree) < REPORTED:
            self.disagree.append({"checkpoint": step, "rank": rank, "what": what})


class _BatchIdAccount:
    """Batches trained twice (the same id in two trained slots of the log) and positions named with two contents
    (`content_changed`), over the log, the ledger and the dead letters, without a map over every batch id.

    Each batch builder fills its own slots (`Slots.group_of`) with its own sequence, in one order: index version,
    pass, shard (each of its shards once a pass, no shard of another builder's in that pass), number; so ids that
    follow their builder's order (`_ScheduleOrder`) are all different positions. The positions a dead letter names
    (replays, in a healthy run) are counted wherever they occur, on the one pass. Any other id out of order (a batch
    doubled or rebuilt, or a builder's sequence broken) is remembered, and a second pass counts every occurrence of
    those ids and positions. Ids made elsewhere (not `BatchId`s: probes, tests) are counted as they come."""

    def __init__(self, queue: QueueState, slots: Slots):
        self.slots = slots
        self.order = _ScheduleOrder(slots.builders)
        self.contents: dict[tuple[int, int, int, int], set[str]] = {}
        """Position -> content digests, for the positions named out of order or in the dead letters."""
        self.dead_positions: set[tuple[int, int, int, int]] = set()
        """Positions the dead letters name: each occurrence counted on the first pass, none checked for order."""
        for text in [d["batch_id"] for d in queue.dead_letters]:
            parsed = BatchId.parse(text) if text else None
            if parsed is not None and parsed.content:
                self.contents.setdefault(_position(parsed), set()).add(parsed.content)
        for d in queue.dead_letters:
            parsed = BatchId.parse(d["batch_id"]) if d["batch_id"] else None
            if parsed is not None:
                self.dead_positions.add(_position(parsed))
        self.out_of_order_ids: set[str] = set()
        """Other ids trained out of their builder's order: each counted over the whole log on the second pass."""
        self.counted: dict[str, list[int]] = {}
        """Id -> [times trained, first trained occurrence], of the ids at `dead_positions` (first pass) and of
        `out_of_order_ids` (second pass)."""
        self.elsewhere: dict[str | None, list[int]] = {}
        """Ids that are not `BatchId`s -> [times trained, first trained occurrence]."""
        self.occurrence = 0
        self.needs_second_pass = False

    def _occurrences(self, record: UpdateRecord):
        """(builder, batch id, trained) of each of the record's batches, in slot order (builder 0 where a record
        names no slots)."""
        dead = set(record.dead_lettered)
        for i, batch_id in enumerate(record.batch_ids):
            slot = record.slots[i] if i < len(record.slots) else None
            yield (0 if slot is None else self.slots.group_of(slot)), batch_id, slot is not None and slot not in dead

    @staticmethod
    def _count(counts: dict, batch_id: str | None, occurrence: int) -> None:
        counts.setdefault(batch_id, [0, occurrence])[0] += 1

    def first_pass(self, record: UpdateRecord) -> None:
        for group, batch_id, trained in self._occurrences(record):
            parsed = BatchId.parse(batch_id) if batch_id else None
            if parsed is None:
                if trained:
                    self._count(self.elsewhere, batch_id, self.occurrence)
            else:
                position = _position(parsed)
                if position in self.dead_positions:
                    if trained:
                        self._count(self.counted, batch_id, self.occurrence)
                elif not self.order.follows(group, position):
                    self.needs_second_pass = True
                    if trained:
                        self.out_of_order_ids.add(str(batch_id))
                    if parsed.content:
                        self.contents.setdefault(position, set())
                if parsed.content and position in self.contents:
                    self.contents[position].add(parsed.content)
            self.occurrence += trained

    def start_second_pass(self) -> None:
        self.occurrence = 0  # the same numbering as the first pass's, so first occurrences compare across both

    def second_pass(self, record: UpdateRecord) -> None:
        for _, batch_id, trained in self._occurrences(record):
            if trained and batch_id in self.out_of_order_ids:
                self._count(self.counted, batch_id, self.occurrence)
            parsed = BatchId.parse(batch_id) if batch_id else None
            if parsed is not None and parsed.content and _position(parsed) in self.contents:
                self.contents[_position(parsed)].add(parsed.content)
            self.occurrence += trained

    def trained_twice(self) -> list[str | None]:
        """Ids trained in more than one slot, in the order of their first trained occurrence."""
        counts = [*self.elsewhere.items(), *self.counted.items()]
        return [batch_id for batch_id, (times, _) in sorted(counts, key=lambda kv: kv[1][1]) if times > 1]

    def content_changed(self) -> list[dict]:
        named = sorted((str(BatchId(*position)), contents) for position, contents in self.contents.items()
                       if len(contents) > 1)
        return [{"position": p, "contents": sorted(c)} for p, c in named]


def _position(parsed: BatchId) -> tuple[int, int, int, int]:
    return parsed.version, parsed.epoch, parsed.shard, parsed.number


class _ScheduleOrder:
    """Whether each next batch position of a builder follows its schedule's order after the ones that did (see
    `_BatchIdAccount`): a later version or pass; the same shard with a higher number; or a shard of the same pass
    that no builder has visited yet (the builders' shards of a pass are disjoint). Holds each builder's position and
    the shards visited in the passes from the furthest-behind builder's to the furthest-ahead's; a pass is forgotten
    once every builder has left it. Builders whose passes differ in length drift apart within an index version, but
    all of them change version at the same update: what is held is bounded by one version's passes, not by the run
    (a run without an index has one version; there it is the passes the builders have drifted apart by)."""

    def __init__(self, builders: int = 1):
        self.current: list[tuple[int, int, int, int] | None] = [None] * builders
        self.visited: dict[tuple[int, int], set[int]] = {}
        """(version, pass) -> the shards builders visited in it, in their order."""

    def follows(self, group: int, position: tuple[int, int, int, int]) -> bool:
        current, in_pass = self.current[group], position[:2]
        if current is not None:
            if in_pass < current[:2]:
                return False
            if in_pass == current[:2] and position[2] == current[2]:
                if position[3] <= current[3]:
                    return False
                self.current[group] = position
                return True
        shards = self.visited.setdefault(in_pass, set())
        if position[2] in shards:  # this builder's earlier shard of the pass, or another builder's
            return False
        shards.add(position[2])
        self.current[group] = position
        if current is None or in_pass != current[:2]:
            self._forget_passes_behind_every_builder()
        return True

    def _forget_passes_behind_every_builder(self) -> None:
        oldest = min(c[:2] for c in self.current if c is not None)
        for in_pass in [p for p in self.visited if p < oldest]:
            del self.visited[in_pass]
