"""The batches between batcher and trainers, in Redis: one stream per trainer rank, one entry per slot.

Slots. An update (step) s takes B = world x grad_accum batches; slot n = s*B + rank*grad_accum + micro is
one rank's batch of one update (`Slots`). `batcher.builders` batch builders split the ranks into groups; each
fills its group's slots in order with a deterministic sequence of its own (services.batcher.schedule), so which
batch a slot holds depends on the seed, the builder count and the index versions, never on timing.

Message (one stream entry, no pickle anywhere), in the stream of the slot's rank, with entry id `<n+1>-0`:
    v        protocol version ("2")
    slot     n
    header   JSON: batch_id, index_version, snapshot_step, doc ids/langs/lengths, targets, evidence, edges
    tokens   every document's token ids, int32 little-endian, concatenated in doc order
    sha256   of header + tokens

Delivery (every slot trained, or dead-lettered, exactly once in the run's final model):
  * a builder writes slot n once, together with its cursor `next_slot:<builder>`, in one script (all or nothing;
    a second write of slot n, by a restarted builder or a retried call, changes nothing), and only while slot
    n's update is fewer than `lookahead` updates ahead of the slowest rank (backpressure: nothing is dropped);
    one offer's Redis work does not depend on the world size or the builder count;
  * rank r reads its slots of update s in order and waits for a missing one; no other rank reads them; when
    it has trained update s, its stream drops the entries of updates <= s, so a stream holds the look-ahead,
    not a checkpoint interval;
  * a batch counts as trained only when a durable checkpoint covers its update: after the checkpoint of
    update C is reported, each rank records a `CommitRecord` of its interval's batches (how many, and their
    `trained_digest`) in the ledger (`ledger:<C>`: rank -> record), with `committed` = C. A record stands for the
    batches, so a commit's Redis work, and what the ranks exchange at a checkpoint, do not grow with the world or
    the interval; a rank commits its previous record again with the next (records are idempotent: one already
    there is kept, and one that differs is counted in `commit_conflicts`);
  * the ledger holds one record per rank and checkpoint (about 48 bytes: 5.3 MB over the paper's 225 checkpoints at
    512 ranks). train_log.jsonl (rank 0, on the run's storage) keeps every update's slots and batch ids (compacted
    above `train_log.FULL_IDS_MAX_BATCHES` batches, with the update's `trained_digest`); `marge audit` adds its
    lines up per checkpoint interval and rank and checks them against the records: a slot lost, a batch trained
    twice (an id or position in two slots), and an interval whose batches are not the ones its ranks committed;
  * a crash before that loses nothing: the resumed run (from checkpoint C) has the queue reset to C
    (`reset_from`, by the driver as a run starts and by a restarted trainer group's rank 0 when a commit or a
    rank's progress went past C: `needs_reset`), and the builders write slots C*B... again, identically;
  * a batch that cannot be trained (undecodable, tampered, poison, non-finite loss) is left out of its update
    (a zero-weight substitute keeps the rank in the gradient all-reduce) and, when the checkpoint that covers
    the update is durable, goes to the dead-letter stream with its slot and the reason (once per slot; the
    checkpoint keeps them too, so a crash before the dead letter is written loses none);
  * `marge queue replay ENTRY` requeues a dead-lettered batch: builder 0 writes it into the next slot it
    writes (recorded in `replays`: slot -> dead-letter entry) and its scheduled batches of that version move
    one slot on. A resumed run forgets the placements from its checkpoint on and places those requests again.

What a Redis crash can lose. With `appendfsync always` (the default) redis-server writes and fsyncs each change
to its append-only file before it replies: nothing acknowledged is lost, to a killed server or to a machine crash.
With `everysec` it replies first: a machine crash (or a killed server while a slow disk holds its writes back) can
lose about the last 2 seconds of acknowledged writes. Batches it loses are written again (the builders follow
their cursors back); a lost commit is made again by the rank's next commit or by a resumed run (commits are
idempotent); but a lost generation bump is issued again to the next group (a straggler of the lost group is then
not fenced), and a dead letter or a replay request of those seconds is lost, or a replay placed again in another
slot (`marge audit` reports the slot lost or trained twice). Losing the append-only file itself loses the commits:
the audit then reports every update before the last checkpoint lost.

The layout (slots, versions, keys) is `marge.contracts.slots`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marge.contracts.batch import Batch
from marge.contracts.slots import BatchId, CommitRecord, RunKeys, Slots
from marge.util.files import atomic_write_text

log = logging.getLogger(__name__)

PROTOCOL_VERSION = b"2"

STEP_RECORDS_KEPT = 100
"""Step records kept in Redis (the progress lines read the last one; train_log.jsonl keeps them all)."""


class ProtocolError(ValueError):
    pass


class Fenced(RuntimeError):
    """A write by a rank of a trainer group that a newer group has replaced (a rank of a partitioned node that
    woke up): refused, so that it cannot trim, commit, advance progress or publish under its successor."""


FENCE = """
        local generation_key, generation = KEYS[#KEYS], ARGV[#ARGV]
        if generation ~= '' then
            local current = redis.call('GET', generation_key)
            if current ~= generation then
                return redis.error_reply('FENCED ' .. tostring(current))
            end
        end"""
"""The check every trainer write script starts with: its last key is the generation's, its last argument the
generation of the writing rank ('' for a writer outside any group: tools, tests, the driver)."""


class SlotGone(RuntimeError):
    """A slot a rank waits for is not in its stream and never will be: the stream already holds a later slot
    (entries are written in slot order), so it was trimmed by a commit, or never rewritten after a resume."""

    def __init__(self, slot: int, rank: int, later_slot: int, advice: str = ""):
        super().__init__(f"slot {slot} is not in rank {rank}'s stream and never will be: the stream already holds "
                         f"slot {later_slot}" + (f". {advice}" if advice else ""))
        self.slot, self.rank, self.later_slot = slot, rank, later_slot


class Stalled(RuntimeError):
    """A trainer rank or a batch builder waited `queue.stall_s` for something that did not come: the message says
    what it waited for and where the queue stands."""


def write_url_file(path: Path, url: str) -> Path:
    """Keep the Redis URL `url` in `path`, readable by its owner only (written atomically): the path, not the URL,
    is what travels to the stages."""
    atomic_write_text(path, url + "\n", mode=0o600)
    return path


def first_line_url(path: Path) -> str:
    """The Redis URL on the first line of the secret file `path`: OSError when it cannot be read, ValueError when its
    first line is no redis://, rediss:// or unix:// URL."""
    lines = Path(path).read_text(encoding="utf-8").strip().splitlines()
    url = lines[0].strip() if lines else ""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{path}: its first line is not a redis://, rediss:// or unix:// URL")
    return url


def read_url_file(path: Path) -> str:
    """The URL a stage reads from the file the driver named (`first_line_url`), with what to do when it cannot."""
    try:
        return first_line_url(path)
    except OSError as e:
        raise FileNotFoundError(f"cannot read the queue's Redis URL from {path} ({e}): the driver writes it as the "
                                "run starts, on its own node; on a cluster, give the URL as MARGE_REDIS_URL_FILE, a "
                                "0600 file at the same path on every node") from None


def encode_batch(batch: Batch) -> dict[bytes, bytes]:
    lengths = [len(t) for t in batch.doc_tokens]
    header = {
        "batch_id": batch.batch_id, "index_version": batch.index_version, "snapshot_step": batch.snapshot_step,
        "doc_ids": batch.doc_ids.tolist(), "doc_langs": list(batch.doc_langs), "doc_lengths": lengths,
        "targets": batch.targets.tolist(), "evidence": batch.evidence.tolist(), "edges": batch.edges.tolist(),
        "edge_weights": batch.edge_weights.tolist(), "created_unix": time.time(),
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    tokens = np.concatenate([np.asarray(t, dtype="<i4") for t in batch.doc_tokens]).tobytes() if lengths else b""
    digest = hashlib.sha256(header_bytes + tokens).hexdigest().encode()
    return {b"v": PROTOCOL_VERSION, b"header": header_bytes, b"tokens": tokens, b"sha256": digest}


def decode_batch(fields: dict[bytes, bytes]) -> Batch:
    """The batch in a stream entry, or ProtocolError saying why it cannot be trusted."""
    version = fields.get(b"v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION!r}")
    missing = [k.decode() for k in (b"header", b"tokens", b"sha256") if k not in fields]
    if missing:
        raise ProtocolError(f"fields {missing} missing")
    header_bytes, tokens = fields[b"header"], fields[b"tokens"]
    if hashlib.sha256(header_bytes + tokens).hexdigest().encode() != fields[b"sha256"]:
        raise ProtocolError("sha256 mismatch (corrupt or tampered entry)")
    try:
        h = json.loads(header_bytes)
        lengths = [int(n) for n in h["doc_lengths"]]
        if len(tokens) != 4 * sum(lengths):
            raise ProtocolError(f"token payload has {len(tokens)} bytes, header says {4 * sum(lengths)}")
        flat = np.frombuffer(tokens, dtype="<i4").astype(np.int32)
        bounds = np.cumsum([0, *lengths])
        batch = Batch(
            batch_id=str(h["batch_id"]), index_version=int(h["index_version"]), snapshot_step=int(h["snapshot_step"]),
            doc_ids=np.array(h["doc_ids"], dtype=np.int64), doc_langs=tuple(h["doc_langs"]),
            doc_tokens=tuple(flat[bounds[i]:bounds[i + 1]] for i in range(len(lengths))),
            targets=np.array(h["targets"], dtype=np.int32), evidence=np.array(h["evidence"], dtype=np.int32),
            edges=np.array(h["edges"], dtype=np.int32).reshape(-1, 2),
            edge_weights=np.array(h["edge_weights"], dtype=np.float32))
    except ProtocolError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed header ({e})") from None
    named = BatchId.of(batch)
    if named is not None and named.content and named.content != batch.content_digest():
        raise ProtocolError(f"batch {batch.batch_id} holds content {batch.content_digest()}, not the {named.content} "
                            "its id names (written by a builder that is not deterministic, or altered)")
    return batch


def entry_id(slot: int) -> str:
    return f"{slot + 1}-0"


def slot_of_entry(entry: str) -> int:
    """The slot whose stream entry id is `entry` (the inverse of `entry_id`)."""
    return int(entry.split("-")[0]) - 1


class Offer:
    """What `BatchQueue.offer` did."""

    WRITTEN, ALREADY, AHEAD = "written", "already", "ahead"
    MOVED, REPLAY, REPLAYS = "moved", "replay", "replays"


@dataclass
class Delivery:
    slot: int
    batch: Batch | None
    """None when the entry could not be decoded (`problem` says why)."""
    fields: dict[bytes, bytes]
    problem: str | None = None


class BatchQueue:
    """One run's batches on a Redis server (keys: `RunKeys`), and the run's small shared state there."""

    def __init__(self, client, run_id: str, slots: Slots | None = None):
        self.r = client
        self.keys = RunKeys(run_id)
        self.slots = slots
        self.dead = self.keys.dead_letter
        self.counters = self.keys.counters
        self.generation: int | None = None
        """The trainer group this client writes for (`start_generation`/`join_generation`); None: unfenced."""

    @classmethod
    def connect(cls, url: str, run_id: str, slots: Slots | None = None) -> "BatchQueue":
        """A client that rides out a Redis restart (retries with backoff for about a minute)."""
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=40)
        client = redis.Redis.from_url(url, socket_keepalive=True, health_check_interval=10, retry=retry,
                                      retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        return cls(client, run_id, slots)

    @classmethod
    def from_url_file(cls, path: str | Path, run_id: str, slots: Slots | None = None) -> "BatchQueue":
        """`connect` to the URL on the first line of the file `path` (the driver's `stage_url_file`), or, where that
        file is not on this node, to MARGE_REDIS_URL, which a job's runtime env gives every worker."""
        path = Path(path)
        if not path.exists() and os.environ.get("MARGE_REDIS_URL"):
            return cls.connect(os.environ["MARGE_REDIS_URL"], run_id, slots)
        return cls.connect(read_url_file(path), run_id, slots)

    def _slots(self) -> Slots:
        if self.slots is None:
            raise ValueError("this queue was opened without the run's slot layout (world size, grad_accum)")
        return self.slots

    # --- producer ----------------------------------------------------------------------------

    def next_slot(self, group: int | None = None) -> int:
        """Builder `group`'s cursor (the first of its slots not written); None: the first slot any builder has not
        written (every slot below it is written)."""
        if group is not None:
            value = self.r.get(self.keys.next_slot(group))
            return int(value) if value is not None else self.slots.first_slot_of_group(group, 0) if self.slots else 0
        builders = self.slots.builders if self.slots is not None else 1
        return min(self.next_slot(g) for g in range(builders))

    def slowest_progress(self) -> int:
        """The first update the slowest rank has not trained (0 while a rank has not reported yet)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(self.keys.progress_by_rank)
        pipe.zrange(self.keys.progress_by_rank, 0, 0, withscores=True)
        reported, slowest = pipe.execute()
        return int(slowest[0][1]) if reported >= self._slots().world and slowest else 0

    def position(self, group: int = 0) -> tuple[int, str | None, dict[int, str]]:
        """Where builder `group` stands, in one round trip: its cursor (the first of its slots not written), the
        oldest replay request (None if none) and where requeued batches went (slot -> dead-letter entry). Requeued
        batches go into builder 0's slots only: the other builders see no request and no placement."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.keys.next_slot(group))
        if group == 0:
            pipe.lindex(self.keys.replay_requests, 0)
            pipe.hgetall(self.keys.replays)
            cursor, request, placed = pipe.execute()
        else:
            (cursor,), request, placed = pipe.execute(), None, {}
        return (int(cursor) if cursor is not None else self._slots().first_slot_of_group(group, 0),
                None if request is None else request.decode(), {int(k): v.decode() for k, v in placed.items()})

    def put(self, slot: int, batch: Batch, lookahead_steps: int, poll_s: float = 0.05,
            should_stop=lambda: False) -> bool:
        """Write `batch` into `slot` once the slowest rank is within `lookahead_steps` updates of it.

        False if stopped first. A slot written before (its entry id exists) is left as it is."""
        return self._put(slot, encode_batch(batch), lookahead_steps, poll_s, should_stop)

    def put_replay(self, slot: int, entry: str, lookahead_steps: int, poll_s: float = 0.05,
                   should_stop=lambda: False) -> bool:
        """Write the dead-lettered batch `entry` (the oldest replay request) into `slot`, and record where it went."""
        return self._put(slot, self.replay_fields(entry), lookahead_steps, poll_s, should_stop, entry)

    def replay_fields(self, entry: str) -> dict[bytes, bytes]:
        """The stream entry that requeues dead-lettered batch `entry` (its fields, and which entry it replays)."""
        found = self.r.xrange(self.dead, entry, entry)
        if not found:
            raise ValueError(f"replay request for dead-letter entry {entry}, which does not exist")
        fields = {k: v for k, v in found[0][1].items() if k not in (b"slot", b"reason", b"time")}
        return {**fields, b"replay_of": entry.encode()}

    def _put(self, slot: int, fields: dict[bytes, bytes], lookahead_steps: int, poll_s: float, should_stop,
             replay_entry: str | None = None) -> bool:
        while True:
            if not self.wait_for_room(slot, lookahead_steps, poll_s, should_stop):
                return False
            if self.offer(slot, fields, lookahead_steps, replay_entry=replay_entry)[0] != Offer.AHEAD:
                return True

    def wait_for_room(self, slot: int, lookahead_steps: int, poll_s: float = 0.05, should_stop=lambda: False,
                      cursor_at: bool = False, stall_s: float | None = None) -> bool:
        """Wait (polling the ranks' progress) until `slot`'s update is fewer than `lookahead_steps` updates ahead of
        the slowest rank; False if stopped first. With `cursor_at`, the wait also ends when the cursor of the slot's
        builder leaves `slot` (a trainer group reset the queue to an older checkpoint: the ranks wait for earlier
        slots, and their progress will not reach this one until the builder writes those). Raises `Stalled` after
        `stall_s` seconds without room."""
        slots = self._slots()
        group = slots.group_of(slot)
        started = time.monotonic()
        while slots.step_of(slot) >= (slowest := self.slowest_progress()) + lookahead_steps:
            if should_stop():
                return False
            if cursor_at and self.next_slot(group) != slot:
                return True
            if stall_s is not None and time.monotonic() - started > stall_s:
                raise Stalled(
                    f"batch builder {group} waited {stall_s:.0f} s (queue.stall_s) for room to write slot {slot} "
                    f"(update {slots.step_of(slot)}): the slowest trainer rank is still at update {slowest} "
                    f"({self.describe_progress()}). Check the trainer ranks (`marge status`, the Ray dashboard); "
                    "raise queue.stall_s if they pause longer than that on purpose")
            time.sleep(poll_s)
        return True

    def describe_progress(self) -> str:
        """Each rank's progress, for a message: 'rank 0 at update 5, rank 1 not reported'."""
        reported = {int(r): int(s) for r, s in self.r.zrange(self.keys.progress_by_rank, 0, -1, withscores=True)}
        return ", ".join(f"rank {r} at update {reported[r]}" if r in reported else f"rank {r} not reported"
                         for r in range(self._slots().world))

    _OFFER = """
        local slot, per_step, lookahead, known = tonumber(ARGV[1]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
        local following, takes_replays = ARGV[8], ARGV[9] == '1'
        local cursor = tonumber(redis.call('GET', KEYS[2]) or ARGV[10])
        if slot < cursor then return {'already', cursor} end
        -- a replay whose request is gone (a reset dropped its dead letter, or placed it elsewhere) is not written
        if ARGV[3] ~= '' and not redis.call('LPOS', KEYS[4], ARGV[3]) then return {'replays', cursor} end
        if known >= 0 then
            if slot > cursor then return {'moved', cursor} end
            if takes_replays then
                if ARGV[3] == '' and redis.call('LLEN', KEYS[4]) > 0 then return {'replay', cursor} end
                if redis.call('HLEN', KEYS[5]) ~= known then return {'replays', cursor} end
            end
        end
        local slowest = 0
        if redis.call('ZCARD', KEYS[6]) >= tonumber(ARGV[7]) then
            slowest = tonumber(redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')[2])
        end
        if math.floor(slot / per_step) >= slowest + lookahead then return {'ahead', slowest} end
        if #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) > 0 then
            redis.call('SET', KEYS[2], following)
            return {'already', following}
        end
        redis.call('XADD', KEYS[1], ARGV[2], unpack(ARGV, 11))
        redis.call('SET', KEYS[2], following)
        redis.call('HINCRBY', KEYS[3], 'produced', 1)
        if ARGV[3] ~= '' then
            redis.call('LREM', KEYS[4], 1, ARGV[3])
            redis.call('HSET', KEYS[5], ARGV[1], ARGV[3])
        end
        return {'written', following}"""

    def offer(self, slot: int, fields: dict[bytes, bytes], lookahead_steps: int, replay_entry: str | None = None,
              placements_known: int | None = None) -> tuple[str, int]:
        """Write `fields` into `slot` if the queue is where the writer thinks it is: one round trip, one script
        (all or nothing), against the cursor of the slot's builder (`Slots.group_of`). Returns (`Offer` status,
        value):

            written   the entry was written; value: the builder's new cursor (its next slot)
            already   the slot holds an entry (a restarted batcher, or this very call retried after a connection
                      reset hid its reply): nothing changed; value: the cursor
            ahead     the slot's update is `lookahead_steps` or more ahead of the slowest rank; value: its progress
        and, with `placements_known` (the batcher's count of requeued batches placed so far), the changes it must
        read first (`position`): `moved` (the cursor is elsewhere: a resumed run, a Redis restart that lost the last
        writes), `replay` (an operator asked for a requeue), `replays` (placements changed); the last two only for
        builder 0, the one that places requeued batches."""
        slots = self._slots()
        group = slots.group_of(slot)
        flat = [x for pair in {b"slot": str(slot).encode(), **fields}.items() for x in pair]
        status, value = self.r.eval(
            self._OFFER, 6, self.keys.slots(slots.rank_of(slot)), self.keys.next_slot(group), self.counters,
            self.keys.replay_requests, self.keys.replays, self.keys.progress_by_rank, slot, entry_id(slot),
            replay_entry or "", slots.per_step, lookahead_steps, -1 if placements_known is None else placements_known,
            slots.world, slots.next_in_group(slot), "1" if group == 0 else "0", slots.first_slot_of_group(group, 0),
            *flat)
        return status.decode(), int(value)

    def replay_placements(self) -> dict[int, str]:
        """Slot -> dead-letter entry of every requeued batch written so far."""
        return {int(k): v.decode() for k, v in self.r.hgetall(self.keys.replays).items()}

    def next_replay_request(self) -> str | None:
        value = self.r.lindex(self.keys.replay_requests, 0)
        return None if value is None else value.decode()

    # --- consumer ----------------------------------------------------------------------------

    def get(self, slot: int, block_ms: int | None = 1000) -> Delivery | None:
        """The entry of `slot`, waiting up to `block_ms` for it (None: not at all; redis-server ends a wait at its
        own clock's tick, 100 ms at its default hz, however short the wait asked); None if it has not been written
        yet. Raises
        SlotGone when the stream holds a later slot instead (XREAD would answer at once every time: a reader
        waiting on would spin)."""
        rank = self._slots().rank_of(slot)
        key = self.keys.slots(rank)
        found = self.r.xrange(key, entry_id(slot), entry_id(slot))
        if not found:
            response = self.r.xread({key: f"{slot}-0"}, count=1, block=block_ms)
            entries = response[0][1] if response else []
            found = [e for e in entries if e[0].decode() == entry_id(slot)]
            if not found:
                if entries:
                    raise SlotGone(slot, rank, slot_of_entry(entries[0][0].decode()))
                return None
        fields = found[0][1]
        try:
            return Delivery(slot, decode_batch(fields), fields)
        except ProtocolError as e:
            return Delivery(slot, None, fields, f"undecodable: {e}")

    def committed_step(self) -> int:
        """The update of the newest checkpoint rank 0 committed (0 before any)."""
        return int(self.r.get(self.keys.committed) or 0)

    def start_generation(self) -> int:
        """A new trainer group starts (its rank 0 calls this first): from now on, writes of every older group's
        ranks are refused. Returns the new generation, which this client joins."""
        self.generation = int(self.r.incr(self.keys.generation))
        return self.generation

    def join_generation(self, generation: int) -> None:
        self.generation = generation

    def _fenced_eval(self, script: str, keys: list, args: list):
        """`script` (which begins with FENCE) with the generation key and this client's generation appended."""
        import redis

        try:
            return self.r.eval(script, len(keys) + 1, *keys, self.keys.generation, *args,
                               "" if self.generation is None else str(self.generation))
        except redis.ResponseError as e:
            if not str(e).startswith("FENCED"):
                raise
            current = str(e).split(" ", 1)[1]
            log.error("write refused: this rank belongs to trainer generation %s, and generation %s has started",
                      self.generation, current)
            raise Fenced(f"this rank belongs to trainer generation {self.generation}, but generation {current} has "
                         "started (a newer trainer group replaced this one): its writes are refused") from None

    _PROGRESS = FENCE + """
        redis.call('SET', KEYS[1], ARGV[1])
        redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
        redis.call('XTRIM', KEYS[3], 'MINID', ARGV[3])
        return 1"""

    def progress(self, rank: int, step: int) -> None:
        """Rank `rank` has trained every update before `step`: the builders may write further ahead, and the rank's
        stream drops those updates' entries (a group that resumes from an older checkpoint has the queue reset to
        it, and the builders write those slots again: `needs_reset`), so a stream holds the look-ahead, not a
        checkpoint interval."""
        self._fenced_eval(self._PROGRESS, [self.keys.progress(rank), self.keys.progress_by_rank, self.keys.slots(rank)],
                          [step, rank, entry_id(step * self._slots().per_step)])

    _COMMIT = FENCE + """
        local steps, trained_by, counters, stream, committed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
        local n = tonumber(ARGV[1])
        local conflicts = {}
        for i = 0, n - 1 do
            local step, rank, record, count = ARGV[3 + 4 * i], ARGV[4 + 4 * i], ARGV[5 + 4 * i], ARGV[6 + 4 * i]
            local ledger = KEYS[6 + i]
            local before = redis.call('HGET', ledger, rank)
            if not before then
                redis.call('HSET', ledger, rank, record)
                redis.call('ZADD', steps, tonumber(step), step)
                redis.call('HINCRBY', trained_by, step, tonumber(count))
                redis.call('HINCRBY', counters, 'trained', tonumber(count))
            elseif before ~= record then
                conflicts[#conflicts + 1] = step .. ':' .. rank
            end
        end
        if #conflicts > 0 then redis.call('HINCRBY', counters, 'commit_conflicts', #conflicts) end
        if ARGV[2] ~= '' then redis.call('SET', committed, ARGV[2]) end
        redis.call('XTRIM', stream, 'MINID', ARGV[3 + 4 * n])
        return conflicts"""

    def commit(self, rank: int, step: int, records: list[tuple[int, CommitRecord]]) -> list[str]:
        """The checkpoint of update `step` is durable: record `records` ((rank, `CommitRecord`): this rank's of the
        checkpoint's interval and of the one before, or, as a group resumes, the checkpoint's records of the ranks
        this rank stands for) and trim this rank's stream below the update. One script, so all or nothing; its
        Redis work does not depend on the world, the interval or the batches (a record stands for them). Idempotent:
        a record already there is left as it is (a rank commits its previous record again with the next, and a
        resumed rank its checkpoint's, so a commit a Redis restart lost is made good). Rank 0's commit moves
        `committed` to `step`. Returns "step:rank" of the records that differ from one recorded before for the same
        checkpoint and rank (counted in `commit_conflicts`: two groups trained the interval differently without a
        reset between them)."""
        slots = self._slots()
        args: list = []
        for owner, record in records:
            args += [record.step, owner, record.encoded(), record.trained]
        conflicts = [c.decode() for c in self._fenced_eval(
            self._COMMIT, [self.keys.ledger_steps, self.keys.ledger_trained, self.counters, self.keys.slots(rank),
                           self.keys.committed, *(self.keys.ledger(record.step) for _, record in records)],
            [len(records), step if rank == 0 else "", *args, entry_id(step * slots.per_step)])]
        if conflicts:
            log.error("commits that differ from the ones recorded before (checkpoint:rank): %s", conflicts)
        return conflicts

    _DEAD_LETTER_ONCE = FENCE + """
        if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
            redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2, #ARGV - 1))
            redis.call('HINCRBY', KEYS[3], 'dead_lettered', 1)
            return 1
        end
        return 0"""

    def dead_letter(self, slot: int, fields: dict[bytes, bytes], reason: str) -> bool:
        """Keep a batch that cannot be trained, with its slot and why, for an operator (`marge queue`). A slot is
        dead-lettered once (a resumed run meeting the same bad batch again adds nothing). True if it was new."""
        entry = {**fields, b"slot": str(slot).encode(), b"reason": reason.encode(), b"time": str(time.time()).encode()}
        flat = [x for pair in entry.items() for x in pair]
        added = bool(self._fenced_eval(self._DEAD_LETTER_ONCE, [self.keys.dead_slots, self.dead, self.counters],
                                       [slot, *flat]))
        if added:
            log.warning("dead-lettered slot %d: %s", slot, reason)
        return added

    # --- resuming -------------------------------------------------------------------------------

    def needs_reset(self, step: int) -> bool:
        """Whether a trainer group resuming from the checkpoint of `step` needs `reset_from(step)`: a commit or a
        rank's progress went past it, so the slots since `step` are trimmed from the streams (or counted as
        trained) and must be written again."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.keys.committed)
        pipe.zrange(self.keys.progress_by_rank, -1, -1, withscores=True)
        committed, furthest = pipe.execute()
        return int(committed or 0) > step or bool(furthest and int(furthest[0][1]) > step)

    _RESET = FENCE + """
        local dead, requests, counters, dead_slots, replays = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
        local ledger_steps, by_rank, committed, trained_by = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
        local step, first, world, builders = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
        local ledger_prefix = ARGV[5]
        local rank_keys, group_keys = 9, 9 + 2 * world
        -- dead letters of the discarded updates: those slots are trained again (and may be dead-lettered again)
        local dropped, n_dropped = {}, 0
        for _, e in ipairs(redis.call('XRANGE', dead, '-', '+')) do
            local slot = -1
            for i = 1, #e[2], 2 do if e[2][i] == 'slot' then slot = tonumber(e[2][i + 1]) end end
            if slot >= first then
                dropped[e[1]], n_dropped = true, n_dropped + 1
                redis.call('XDEL', dead, e[1])
                redis.call('LREM', requests, 0, e[1])
            end
        end
        redis.call('HINCRBY', counters, 'dead_lettered', 0 - n_dropped)  -- (-0 is not an integer to Redis)
        for _, m in ipairs(redis.call('SMEMBERS', dead_slots)) do
            if tonumber(m) >= first then redis.call('SREM', dead_slots, m) end
        end
        -- batches requeued into the discarded slots are requested again, in slot order, before any other request
        local placed, later = redis.call('HGETALL', replays), {}
        for i = 1, #placed, 2 do
            local n = tonumber(placed[i])
            if n >= first then
                redis.call('HDEL', replays, placed[i])
                if not dropped[placed[i + 1]] then later[#later + 1] = {n, placed[i + 1]} end
            end
        end
        table.sort(later, function(a, b) return a[1] < b[1] end)
        for i = #later, 1, -1 do redis.call('LPUSH', requests, later[i][2]) end
        -- every rank back at the checkpoint; ranks of another world size must not linger in the progress set
        redis.call('DEL', by_rank)
        for rank = 0, world - 1 do
            redis.call('DEL', KEYS[rank_keys + 1 + 2 * rank])
            redis.call('SET', KEYS[rank_keys + 2 + 2 * rank], step)
            redis.call('ZADD', by_rank, step, rank)
        end
        for group = 0, builders - 1 do redis.call('SET', KEYS[group_keys + 1 + group], ARGV[6 + group]) end
        redis.call('HSET', counters, 'produced', first)  -- the later slots are written (and counted) again
        redis.call('SET', committed, step)
        -- the commits of later checkpoints go: those batches are trained again
        local later_steps = redis.call('ZRANGEBYSCORE', ledger_steps, '(' .. step, '+inf')
        for _, s in ipairs(later_steps) do
            redis.call('DEL', ledger_prefix .. s)
            redis.call('HDEL', trained_by, s)
        end
        redis.call('ZREMRANGEBYSCORE', ledger_steps, '(' .. step, '+inf')
        local total = 0
        local counts = redis.call('HVALS', trained_by)
        for i = 1, #counts do total = total + tonumber(counts[i]) end
        redis.call('HSET', counters, 'trained', total)
        return 1"""

    def reset_from(self, step: int) -> None:
        """Make the queue agree with a run resumed from the checkpoint of `step`: every slot from `step` on
        is written again (the builders' sequences are deterministic), the commits of later checkpoints and the dead
        letters of later updates go (those slots are trained again), and batches requeued into those slots are
        requested again (placed anew). One script: a caller that dies during it leaves the queue as it was
        (`needs_reset` still says so) or reset, never between; fenced like every trainer write, so a replaced
        group's rank 0 cannot rewind its successor's queue."""
        slots = self._slots()
        keys = [self.dead, self.keys.replay_requests, self.counters, self.keys.dead_slots, self.keys.replays,
                self.keys.ledger_steps, self.keys.progress_by_rank, self.keys.committed, self.keys.ledger_trained]
        for rank in range(slots.world):
            keys += [self.keys.slots(rank), self.keys.progress(rank)]
        keys += [self.keys.next_slot(group) for group in range(slots.builders)]
        # the commits' hashes are named by their update (`RunKeys.ledger`): the script deletes the later ones by that
        # prefix (one Redis, never a cluster: the run's keys all live on the one server)
        self._fenced_eval(self._RESET, keys, [step, step * slots.per_step, slots.world, slots.builders,
                                              self.keys.ledger(0)[:-1],
                                              *(slots.first_slot_of_group(g, step) for g in range(slots.builders))])

    # --- accounting ------------------------------------------------------------------------------

    def pending(self) -> int:
        """Written, not yet trained (a rank's progress trims its stream)."""
        return sum(int(self.r.xlen(self.keys.slots(r))) for r in range(self._slots().world))

    def counts(self) -> dict[str, int]:
        raw = self.r.hgetall(self.counters)
        out = {k.decode(): int(v) for k, v in raw.items()}
        out["next_slot"] = self.next_slot()
        committed = self.r.get(self.keys.committed)
        out["committed_step"] = int(committed) if committed is not None else 0
        out["pending"] = self.pending() if self.slots is not None else 0
        out["ledger"] = int(self.r.zcard(self.keys.ledger_steps))
        out["dead_letter_depth"] = int(self.r.xlen(self.dead)) if self.r.exists(self.dead) else 0
        return out

    def committed_steps(self) -> list[int]:
        """The checkpoint updates that have commits, in order."""
        return [int(s) for s in self.r.zrange(self.keys.ledger_steps, 0, -1)]

    def commits(self, step: int) -> dict[int, CommitRecord]:
        """Rank -> its commit for the checkpoint of update `step` (none: not committed)."""
        return {int(rank): CommitRecord.decoded(step, record)
                for rank, record in self.r.hgetall(self.keys.ledger(step)).items()}

    def dead_letters(self) -> list[dict[str, Any]]:
        """Every dead-lettered batch: its entry, slot, batch id, reason, and where it was requeued (if it was)."""
        placed = {entry: slot for slot, entry in self.replay_placements().items()}
        requested = {v.decode() for v in self.r.lrange(self.keys.replay_requests, 0, -1)}
        out = []
        for entry, fields in self.r.xrange(self.dead):
            entry = entry.decode()
            try:
                batch_id = json.loads(fields[b"header"]).get("batch_id")
            except (KeyError, ValueError, AttributeError):
                batch_id = None  # undecodable: the reason says why
            out.append({"entry": entry, "slot": int(fields.get(b"slot", b"-1")), "batch_id": batch_id,
                        "reason": fields.get(b"reason", b"").decode(errors="replace"),
                        "time_unix": float(fields.get(b"time", b"0")),
                        "replayed_to_slot": placed.get(entry), "replay_requested": entry in requested})
        return out

    def request_replay(self, entry: str) -> None:
        """Ask the batcher to write dead-lettered batch `entry` into the next slot it writes."""
        known = {d["entry"]: d for d in self.dead_letters()}
        if entry not in known:
            raise ValueError(f"no dead-lettered entry {entry!r}; `marge queue list-dead` lists them")
        if known[entry]["replayed_to_slot"] is not None or known[entry]["replay_requested"]:
            raise ValueError(f"dead-lettered entry {entry} was requeued already "
                             f"(slot {known[entry]['replayed_to_slot']})")
        self.r.eval(self._REQUEST_ONCE, 1, self.keys.replay_requests, entry)

    _REQUEST_ONCE = """
        if redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
        redis.call('RPUSH', KEYS[1], ARGV[1])
        return 1"""

    # --- the run's shared state ------------------------------------------------------------------

    def request_stop(self) -> None:
        self.r.set(self.keys.stop, "1")

    def clear_stop(self) -> None:
        self.r.delete(self.keys.stop)

    def stop_requested(self) -> bool:
        return self.r.get(self.keys.stop) is not None

    _PUBLISH = FENCE + """
        redis.call('RPUSH', KEYS[1], ARGV[1])
        redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
        redis.call('HSET', KEYS[2], 'last', ARGV[1])
        return 1"""

    def publish_step(self, record: dict) -> None:
        """The trainer's record of one update: the newest `STEP_RECORDS_KEPT` and the last one."""
        self._fenced_eval(self._PUBLISH, [self.keys.steps, self.keys.trainer_status],
                          [json.dumps(record), STEP_RECORDS_KEPT])

    def last_step(self) -> dict | None:
        line = self.r.hget(self.keys.trainer_status, "last")
        return None if line is None else json.loads(line)

    def step_records(self) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(self.keys.steps, 0, -1)]
