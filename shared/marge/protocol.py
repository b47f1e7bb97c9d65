"""The batch queue between batcher and trainers: a Redis Stream, a consumer group, a ledger.

Message (one stream entry, no pickle anywhere):
    v        protocol version ("1")
    header   JSON: batch_id, index_version, snapshot_step, doc ids/langs/lengths, targets, evidence, edges
    tokens   every document's token ids, int32 little-endian, concatenated in doc order
    sha256   of header + tokens

Delivery (at least once, trained at most once):
  * the batcher XADDs only while the stream holds fewer than `max_depth` entries: it waits rather
    than trimming, so nothing is dropped (acknowledged entries are deleted, so XLEN = queue depth);
  * a trainer reads through the consumer group; an entry stays pending until acknowledged, and one
    that stays unacknowledged for `claim_idle_ms` (its trainer died) is claimed by another trainer;
  * after the optimizer step that used a batch, the trainer records it in the ledger (HSETNX
    batch_id -> step/rank), acknowledges and deletes the entry, in one transaction; a redelivered batch
    already in the ledger is acknowledged without training;
  * an undecodable, tampered or too-often-delivered entry goes to the dead-letter stream with a reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from marge.batch import Batch
from marge.config import positive

log = logging.getLogger(__name__)

PROTOCOL_VERSION = b"1"
CONSUMER_GROUP = "trainers"


@dataclass(frozen=True, kw_only=True)
class QueueConfig:
    """The queue's settings (the `queue:` section), read by the batcher (depth) and the trainers (delivery)."""

    max_depth: int = 32
    """Batches waiting in the stream at most; the batcher waits (nothing is trimmed or dropped)."""
    block_ms: int = 1000
    """How long a trainer's read waits for a new batch before it checks whether to stop."""
    claim_idle_ms: int = 60000
    """A delivered batch not acknowledged for this long is claimed by another trainer."""
    max_deliveries: int = 3
    """A batch delivered more often than this goes to the dead-letter stream."""

    def __post_init__(self) -> None:
        positive(self, "max_depth", "block_ms", "claim_idle_ms", "max_deliveries")


@dataclass(frozen=True)
class RunKeys:
    """Every Redis key of one run (the only place they are spelled)."""

    run: str

    @property
    def prefix(self) -> str:
        return f"marge:{self.run}"

    @property
    def stream(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def ledger(self) -> str:
        return f"{self.prefix}:ledger"

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
    def stop(self) -> str:
        """Set by the driver: trainers stop at the next step boundary."""
        return f"{self.prefix}:control:stop"

    @property
    def batcher_position(self) -> str:
        return f"{self.prefix}:batcher"


@dataclass(frozen=True)
class BatchId:
    """A batch's id: "v<index version>-e<pass over its graph>-s<shard>-<n>", deterministic for a seed, so a
    ledger recognises a batch seen before. Built and parsed only here."""

    version: int
    epoch: int
    shard: int
    number: int

    def __str__(self) -> str:
        return f"v{self.version}-e{self.epoch}-s{self.shard}-{self.number}"

    @classmethod
    def parse(cls, text: str) -> "BatchId | None":
        """The parts of a batcher-made id; None for ids made elsewhere (probes, benchmarks)."""
        parts = text.split("-")
        if len(parts) != 4 or [p[:1] for p in parts[:3]] != ["v", "e", "s"]:
            return None
        try:
            return cls(int(parts[0][1:]), int(parts[1][1:]), int(parts[2][1:]), int(parts[3]))
        except ValueError:
            return None

STEP_RECORDS_KEPT = 10000
"""Step records kept in Redis for progress lines and summaries (train_log.jsonl keeps them all)."""


class ProtocolError(ValueError):
    pass


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
        return Batch(
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


@dataclass
class Delivery:
    entry_id: bytes
    batch: Batch
    times_delivered: int
    fields: dict[bytes, bytes]


class BatchQueue:
    """One run's batch stream on a Redis server (keys: `RunKeys`), and the run's small shared state there."""

    def __init__(self, client, run_id: str, claim_idle_ms: int = 60000, max_deliveries: int = 3):
        self.r = client
        self.keys = RunKeys(run_id)
        self.stream = self.keys.stream
        self.dead = self.keys.dead_letter
        self.ledger = self.keys.ledger
        self.counters = self.keys.counters
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries

    @classmethod
    def connect(cls, url: str, run_id: str, cfg: QueueConfig | None = None) -> "BatchQueue":
        import redis

        cfg = cfg or QueueConfig()
        client = redis.Redis.from_url(url, socket_keepalive=True, health_check_interval=30)
        return cls(client, run_id, claim_idle_ms=cfg.claim_idle_ms, max_deliveries=cfg.max_deliveries)

    def ensure_group(self) -> None:
        import redis

        try:
            self.r.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # --- producer ----------------------------------------------------------------------------

    def depth(self) -> int:
        return int(self.r.xlen(self.stream))

    def put(self, batch: Batch, max_depth: int, poll_s: float = 0.05, should_stop=lambda: False) -> bytes | None:
        """Append `batch`, first waiting while the stream holds `max_depth` entries. None if stopped."""
        fields = encode_batch(batch)
        while self.depth() >= max_depth:
            if should_stop():
                return None
            time.sleep(poll_s)
        entry_id = self.r.xadd(self.stream, fields)
        self.r.hincrby(self.counters, "produced", 1)
        return entry_id

    # --- consumer ----------------------------------------------------------------------------

    def get(self, consumer: str, block_ms: int = 1000) -> Delivery | None:
        """The next batch for `consumer`: a stale pending one first (its trainer died), else a new one."""
        while True:
            claimed = self.r.xautoclaim(self.stream, CONSUMER_GROUP, consumer, self.claim_idle_ms, "0-0", count=1)
            entries = claimed[1]
            if entries:
                self.r.hincrby(self.counters, "redelivered", 1)
            else:
                response = self.r.xreadgroup(CONSUMER_GROUP, consumer, {self.stream: ">"}, count=1, block=block_ms)
                if not response:
                    return None
                entries = response[0][1]
            entry_id, fields = entries[0]
            if not fields:  # deleted while pending (already handled elsewhere)
                self.r.xack(self.stream, CONSUMER_GROUP, entry_id)
                continue
            times = self._times_delivered(entry_id)
            try:
                batch = decode_batch(fields)
            except ProtocolError as e:
                self.dead_letter(entry_id, fields, f"undecodable: {e}")
                continue
            if times > self.max_deliveries:
                self.dead_letter(entry_id, fields, f"delivered {times} times (max {self.max_deliveries})")
                continue
            return Delivery(entry_id, batch, times, fields)

    def _times_delivered(self, entry_id: bytes) -> int:
        info = self.r.xpending_range(self.stream, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    def already_trained(self, batch_id: str) -> bool:
        return bool(self.r.hexists(self.ledger, batch_id))

    def ack(self, deliveries: list[Delivery], step: int, rank: int) -> list[str]:
        """Record the batches as trained at `step`, acknowledge and delete them (one transaction).

        Returns the ids that were already in the ledger (a double training, which should never happen).
        """
        pipe = self.r.pipeline(transaction=True)
        for d in deliveries:
            pipe.hsetnx(self.ledger, d.batch.batch_id, json.dumps({"step": step, "rank": rank, "t": time.time()}))
        ids = [d.entry_id for d in deliveries]
        if ids:
            pipe.xack(self.stream, CONSUMER_GROUP, *ids)
            pipe.xdel(self.stream, *ids)
        pipe.hincrby(self.counters, "acked", len(deliveries))
        results = pipe.execute()
        doubles = [d.batch.batch_id for d, fresh in zip(deliveries, results) if not fresh]
        if doubles:
            self.r.hincrby(self.counters, "trained_twice", len(doubles))
            log.error("batches trained twice: %s", doubles)
        return doubles

    def skip(self, delivery: Delivery, reason: str) -> None:
        """Acknowledge and delete without training (already trained, or stale)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.stream, CONSUMER_GROUP, delivery.entry_id)
        pipe.xdel(self.stream, delivery.entry_id)
        pipe.hincrby(self.counters, f"skipped_{reason}", 1)
        pipe.execute()

    def dead_letter(self, entry_id: bytes, fields: dict[bytes, bytes], reason: str) -> None:
        log.warning("dead-lettering entry %s: %s", entry_id, reason)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.dead, {**fields, b"reason": reason.encode(), b"entry_id": entry_id})
        pipe.xack(self.stream, CONSUMER_GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.hincrby(self.counters, "dead_lettered", 1)
        pipe.execute()

    # --- accounting ------------------------------------------------------------------------------

    def pending(self) -> int:
        """Delivered but not yet acknowledged."""
        try:
            return int(self.r.xpending(self.stream, CONSUMER_GROUP)["pending"])
        except Exception:  # group not created yet
            return 0

    def counts(self) -> dict[str, int]:
        raw = self.r.hgetall(self.counters)
        out = {k.decode(): int(v) for k, v in raw.items()}
        out["depth"] = self.depth() if self.r.exists(self.stream) else 0
        out["pending"] = self.pending()
        out["ledger"] = int(self.r.hlen(self.ledger))
        out["dead_letter_depth"] = int(self.r.xlen(self.dead)) if self.r.exists(self.dead) else 0
        return out

    def ledger_entries(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v) for k, v in self.r.hgetall(self.ledger).items()}

    def restore_ledger(self, batch_ids: list[str]) -> None:
        """Mark batches a checkpoint says were trained (a fresh Redis, or a lost ledger, learns them again)."""
        pipe = self.r.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hsetnx(self.ledger, batch_id, json.dumps({"step": -1, "rank": -1, "restored": True}))
        pipe.execute()

    # --- the run's shared state ------------------------------------------------------------------

    def request_stop(self) -> None:
        self.r.set(self.keys.stop, "1")

    def clear_stop(self) -> None:
        self.r.delete(self.keys.stop)

    def stop_requested(self) -> bool:
        return self.r.get(self.keys.stop) is not None

    def publish_step(self, record: dict) -> None:
        """The trainer's record of one update: the newest `STEP_RECORDS_KEPT` and the last one."""
        line = json.dumps(record)
        pipe = self.r.pipeline()
        pipe.rpush(self.keys.steps, line)
        pipe.ltrim(self.keys.steps, -STEP_RECORDS_KEPT, -1)
        pipe.hset(self.keys.trainer_status, mapping={"last": line})
        pipe.execute()

    def last_step(self) -> dict | None:
        line = self.r.hget(self.keys.trainer_status, "last")
        return None if line is None else json.loads(line)

    def step_records(self) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(self.keys.steps, 0, -1)]

    def batcher_position(self) -> tuple[int, int]:
        """(index version, pass) the batcher last started; (-1, -1) before its first."""
        raw = self.r.get(self.keys.batcher_position)
        if raw is None:
            return -1, -1
        state = json.loads(raw)
        return int(state["version"]), int(state["epoch"])

    def save_batcher_position(self, version: int, epoch: int) -> None:
        self.r.set(self.keys.batcher_position, json.dumps({"version": version, "epoch": epoch}))
