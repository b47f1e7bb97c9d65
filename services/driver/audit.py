"""`marge audit` and `marge queue`: what a run trained, checked against its checkpoint, ledger and logs.

The account of one run (the `marge.contracts.protocol` delivery rules), from the newest good checkpoint C:

    slots of updates 0..C-1   each trained (in the ledger's window, with the batch id train_log.jsonl gives
                              that slot; for an update whose batches left the window, in train_log.jsonl, as
                              many as the ledger's retired count of that update)
                              or dead-lettered (in the dead-letter stream with that slot)
                              (or in the checkpoint's record of its last interval, when the driver died
                              before the ranks recorded it in Redis: `batches_awaiting_commit`)
    lost                      such a slot in none of these
    trained twice             a batch id the ledger recorded for two slots (counted at commit), or that
                              train_log.jsonl shows in two updates up to C
    content changed           a batch position (version, pass, shard, n) that the ledger, train_log.jsonl or the
                              dead letters name with two content digests (`BatchId`): a builder made it again
                              with other content, so "the same batch" was not the same
    pending                   written into the streams, not yet covered by a checkpoint

The account streams train_log.jsonl (its segments, then the live file) and holds no map over the run's slots or
batch ids, so its memory does not grow with the run, whatever the number of batch builders: `account` is that core,
from its inputs alone (no Redis, no files), `audit` reads them. Beyond the ledger's window and the dead letters it
holds each builder's place in its own schedule and the shards of the passes the builders are in, and reads the log
once; only ids out of their builder's order that no dead letter names (a batch doubled or rebuilt) are remembered,
and counted over the log a second time.

The ledger's retired counts (one per update that left the window: 450,000 at the paper's run length) stay in Redis:
the account reads them a block of RETIRED_BLOCK updates at a time, as the log goes past (`RetiredCounts`), and sums
them as it goes, so the audit's memory stays flat in the run's length with them too (`benchmarks/train_log_scale.py`).

The run's Redis is opened as the run left it: a `redis.url` from --redis-url or MARGE_REDIS_URL, else the
run's private server, started from its AOF for the audit (and stopped again) when it is not running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from marge.contracts.protocol import BatchQueue
from marge.contracts.slots import BatchId, Slots
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


def checkpoint_deliveries(checkpoint: Path | None) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(slot, batch id) trained and (slot, reason) left out in the checkpoint's last interval (its tensors are
    memory-mapped, not read)."""
    if checkpoint is None:
        return [], []
    import torch

    state = torch.load(Path(checkpoint) / "training_state.pt", map_location="cpu", weights_only=True, mmap=True)
    return ([(int(n), str(b)) for n, b in state.get("trained_since_previous", ())],
            [(int(n), str(r)) for n, _, r in state.get("dead_since_previous", ())])


def content_changed(batch_ids) -> list[dict]:
    """Positions named with more than one content digest among `batch_ids` (ids without a digest are skipped)."""
    contents: dict[str, set[str]] = {}
    for text in batch_ids:
        parsed = BatchId.parse(text) if text else None
        if parsed is not None and parsed.content:
            contents.setdefault(parsed.position, set()).add(parsed.content)
    return [{"position": p, "contents": sorted(c)} for p, c in sorted(contents.items()) if len(c) > 1]


RETIRED_BLOCK = 10_000
"""Updates whose retired counts one HMGET reads (`RetiredCounts`): 45 round trips for the paper's 450,000 updates."""


class RetiredCounts(Mapping):
    """The ledger's retired counts (update -> batches that left the window) read in place in Redis, a block of
    `block` consecutive updates at a time (one HMGET), holding one block: the account asks for them in update order, so
    a run of U updates costs U / `block` round trips and the memory of one block, whatever U. Iterating goes through
    HSCAN (which may give a field twice, as Redis documents; the account does not iterate)."""

    def __init__(self, client, key: str, block: int = RETIRED_BLOCK):
        self.client, self.key, self.block = client, key, block
        self._start: int | None = None
        self._counts: list = []

    def get(self, update: int, default=None):
        start = update - update % self.block
        if start != self._start:
            self._counts = self.client.hmget(self.key, [str(u) for u in range(start, start + self.block)])
            self._start = start
        count = self._counts[update - start]
        return default if count is None else int(count)

    def __getitem__(self, update: int) -> int:
        count = self.get(update)
        if count is None:
            raise KeyError(update)
        return count

    def __contains__(self, update: object) -> bool:
        return isinstance(update, int) and self.get(update) is not None

    def __iter__(self) -> Iterator[int]:
        return (int(k) for k, _ in self.client.hscan_iter(self.key, count=self.block))

    def __len__(self) -> int:
        return int(self.client.hlen(self.key))


@dataclass
class QueueState:
    """What the audit reads from the run's Redis. The ledger is its window of two checkpoint intervals and the dead
    letters are few; `retired_by_update` has one count per update that left the window, which `of` leaves in Redis
    (`RetiredCounts`)."""

    counts: dict[str, int]
    ledger: dict[str, dict]
    """Batch id -> {"step", "slot"} of the batches in the ledger's window."""
    retired_by_update: Mapping[int, int]
    """Update -> how many of its batches left the window (the account asks in update order, with `get`)."""
    dead_letters: list[dict]

    @classmethod
    def of(cls, queue: BatchQueue) -> "QueueState":
        # the ledger before the retired counts (read later, as the account goes): an entry retired in between is then
        # seen twice (harmless), not missed
        counts, ledger = queue.counts(), queue.ledger_entries()
        return cls(counts, ledger, RetiredCounts(queue.r, queue.keys.ledger_retired), queue.dead_letters())


@dataclass
class CheckpointState:
    """The newest good checkpoint: the update it holds and what its last interval trained and left out."""

    step: int
    path: str | None = None
    trained: list[tuple[int, str]] = field(default_factory=list)
    """(slot, batch id) trained in its last interval (`checkpoint_deliveries`)."""
    dead: list[tuple[int, str]] = field(default_factory=list)
    """(slot, reason) left out in its last interval."""


def audit(cfg: PipelineConfig, queue: BatchQueue) -> dict:
    """The run's account (see the module docstring); `ok` is whether nothing was lost or trained twice."""
    path = newest_good_checkpoint(cfg.paths().checkpoints)
    step = int(read_manifest(path, verify=False)["step"]) if path else 0
    state = QueueState.of(queue)
    trained, dead = checkpoint_deliveries(path)
    log = TrainLog.of_run(cfg.paths().run_dir)
    return account(lambda: log.iter_records(through_step=step), cfg.slots(),
                   CheckpointState(step, str(path) if path else None, trained, dead), state, source=str(log.path))


def account(read_records: Callable[[], Iterable[UpdateRecord]], slots: Slots, checkpoint: CheckpointState,
            queue: QueueState, source: str = "train log") -> dict:
    """The audit's account from its inputs alone, no Redis, no files: `read_records()` gives the train log's
    records up to the checkpoint, in update order, and is called once, or twice when the log holds ids out of their
    builder's order that no dead letter names (each call a new pass).

    It holds what the ledger window and the dead letters hold, each builder's place in its schedule, and those
    out-of-order ids, never a map over the run's slots or batch ids: exactly-once is checked while streaming
    (`_SlotAccount` for the slots, `_BatchIdAccount` for the batch ids)."""
    counts = queue.counts
    slot_account = _SlotAccount(slots, checkpoint, queue)
    ids = _BatchIdAccount(queue, slots)
    updates = 0
    for record in read_records():
        updates += 1
        trained = record.trained_slots()
        if record.slots:
            slot_account.settle_through(min(record.slots), max(record.slots), trained, record.step, source)
        ids.first_pass(record)
    slot_account.finish()
    if ids.needs_second_pass:
        ids.start_second_pass()
        for record in read_records():
            ids.second_pass(record)
    logged_twice = ids.trained_twice()
    changed = ids.content_changed()
    trained_twice = counts.get("trained_twice", 0) + len(logged_twice)
    awaiting = slot_account.awaiting()
    awaiting_dead = slot_account.awaiting_dead
    dead = queue.dead_letters
    return {
        "ok": (not slot_account.lost_count and trained_twice == 0 and not slot_account.disagree_count
               and not slot_account.retired_disagree and not changed),
        "steps": checkpoint.step, "checkpoint": checkpoint.path,
        "committed_step": counts["committed_step"],
        "batches_produced": counts.get("produced", 0),
        "batches_trained": len(slot_account.ledger_slot) + slot_account.from_log_count + len(awaiting),
        "batches_lost": slot_account.lost_count, "lost_slots": slot_account.lost,
        "trained_twice": trained_twice, "trained_twice_ids": logged_twice[:REPORTED],
        "ledger_disagrees_with_train_log": slot_account.disagree,
        "content_changed": changed[:REPORTED],
        "batches_retired_from_ledger": slot_account.retired_total,
        "retired_counts_disagree_with_train_log": slot_account.retired_disagree[:REPORTED],
        "batches_pending": counts["pending"],
        "batches_awaiting_commit": len(awaiting) + len(awaiting_dead),
        "batches_dead_lettered": sum(1 for d in dead if d["replayed_to_slot"] is None) + len(awaiting_dead),
        "batches_replayed": sum(1 for d in dead if d["replayed_to_slot"] is not None),
        "train_log_updates": updates,
    }


REPORTED = 100
"""Slots, batch ids and updates listed in the account (each list's count is given in full where it has one)."""


class _SlotAccount:
    """Every slot of updates 0..C-1, in slot order as the log streams past: trained (in the ledger's window; for
    an update retired from it, in the log; or in the checkpoint's last interval), dead-lettered, or lost; and where
    the ledger and the log name different batches. Holds the ledger's window, the dead letters and the first
    `REPORTED` slots of each finding."""

    def __init__(self, slots: Slots, checkpoint: CheckpointState, queue: QueueState):
        self.per_step = slots.per_step
        self.step = checkpoint.step
        self.covered = checkpoint.step * slots.per_step
        self.ledger_slot = {entry["slot"]: batch_id for batch_id, entry in queue.ledger.items()
                            if entry["slot"] < self.covered}
        self.retired = queue.retired_by_update  # read in place, in update order: one count per update, not copied
        self.retired_total = 0
        """The retired counts of updates 0..C-1, summed as each update's slots are settled (every one is)."""
        self.dead_slots = {d["slot"] for d in queue.dead_letters}
        # the checkpoint is the commit point: its last interval counts even if the driver died before the ranks
        # recorded it in Redis (the resumed run records it first thing)
        self.checkpoint_trained = dict(checkpoint.trained)
        self.awaiting_dead = {n for n, _ in checkpoint.dead if n not in self.dead_slots}
        self.from_log_in_checkpoint: set[int] = set()
        """Slots of the checkpoint's last interval that the log gave already (an update retired from the ledger)."""
        self.next_slot = 0
        self.update: int | None = None
        self.from_log_in_update = 0
        self.from_log_count = 0
        self.lost_count, self.lost = 0, list[int]()
        self.disagree_count, self.disagree = 0, list[int]()
        self.retired_disagree: list[int] = []

    def settle_through(self, first: int, last: int, logged: dict[int, str | None], step: int, source: str) -> None:
        """Settle every slot from the next one up to `last`, `logged` being the trained slots of the record of
        update `step`, which holds slots `first`..`last`."""
        if first < self.next_slot:
            raise TrainLogError(f"{source}: update {step} records slot {first}, which an earlier line already passed: "
                                "the log's lines are out of update order (two writers?); cut it at the checkpoint "
                                "with TrainLog.truncate_after, or restore it from a copy, and audit again")
        for n in range(self.next_slot, last + 1):
            self._settle(n, n in logged, logged.get(n))
        self.next_slot = last + 1

    def finish(self) -> None:
        """Settle the slots up to the checkpoint that no record named."""
        for n in range(self.next_slot, self.covered):
            self._settle(n, False, None)
        self.next_slot = max(self.next_slot, self.covered)
        self._end_update()

    def _settle(self, n: int, has_log: bool, logged_id: str | None) -> None:
        update = n // self.per_step
        if update != self.update:
            self._end_update()
            self.update, self.from_log_in_update = update, 0
        if n in self.ledger_slot:
            trained_id = self.ledger_slot[n]
        elif has_log and update < self.step and self.retired.get(update) is not None:
            self.from_log_count += 1
            self.from_log_in_update += 1
            if n in self.checkpoint_trained:
                self.from_log_in_checkpoint.add(n)
            return  # the log's batch is the slot's: nothing to disagree with
        elif n in self.checkpoint_trained:
            trained_id = self.checkpoint_trained[n]
        else:
            if n < self.covered and n not in self.dead_slots and n not in self.awaiting_dead:
                self.lost_count += 1
                if len(self.lost) < REPORTED:
                    self.lost.append(n)
            return
        if has_log and trained_id != logged_id:
            self.disagree_count += 1
            if len(self.disagree) < REPORTED:
                self.disagree.append(n)

    def _end_update(self) -> None:
        """An update's slots are settled: the log holds as many of its batches as the ledger retired."""
        u = self.update
        retired = self.retired.get(u) if u is not None and u < self.step else None
        if retired is not None and u is not None:  # retired is found only for an update u
            self.retired_total += retired
            if retired != self.from_log_in_update:
                self.retired_disagree.append(u)

    def awaiting(self) -> dict[int, str]:
        """The checkpoint's last interval's trained slots that neither the ledger nor the log gave."""
        return {n: b for n, b in self.checkpoint_trained.items()
                if n not in self.ledger_slot and n not in self.from_log_in_checkpoint}


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
        """Position -> content digests, for the positions named out of order, in the ledger or in the dead letters."""
        self.dead_positions: set[tuple[int, int, int, int]] = set()
        """Positions the dead letters name: each occurrence counted on the first pass, none checked for order."""
        for text in [*queue.ledger, *(d["batch_id"] for d in queue.dead_letters)]:
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
