"""The Redis batch queue against a real redis-server: encoding, backpressure, redelivery, dead letters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from marge.batch import Batch
from marge.protocol import CONSUMER_GROUP, BatchQueue, ProtocolError, QueueConfig, decode_batch, encode_batch


def make_batch(i: int, rng=np.random.default_rng(0)) -> Batch:
    tokens = tuple(rng.integers(4, 500, size=n).astype(np.int32) for n in (5, 9, 3))
    return Batch(f"v0-e0-s0-{i}", 0, 0, np.array([10 * i, 10 * i + 1, 10 * i + 2], dtype=np.int64),
                 ("en", "de", "zh"), tokens, np.array([0], dtype=np.int32), np.array([1, 2], dtype=np.int32),
                 np.array([[0, 0], [0, 1]], dtype=np.int32), np.array([100.0, 100.0], dtype=np.float32))


def test_encode_decode_round_trip_and_tampering():
    batch = make_batch(1)
    fields = encode_batch(batch)
    back = decode_batch(fields)
    assert back.batch_id == batch.batch_id and back.doc_langs == batch.doc_langs
    assert all(np.array_equal(a, b) for a, b in zip(back.doc_tokens, batch.doc_tokens))
    assert np.array_equal(back.edges, batch.edges)
    tampered = {**fields, b"tokens": fields[b"tokens"][:-4] + b"\x01\x00\x00\x00"}
    with pytest.raises(ProtocolError, match="sha256"):
        decode_batch(tampered)
    with pytest.raises(ProtocolError, match="protocol version"):
        decode_batch({**fields, b"v": b"9"})
    assert b"pickle" not in fields[b"header"] and not fields[b"tokens"].startswith(b"\x80")


def test_local_redis_is_private_persistent_and_never_evicts(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    config = client.config_get("*")
    assert config["appendonly"] == "yes" and config["maxmemory-policy"] == "noeviction"
    assert config["bind"] == "127.0.0.1" and config["protected-mode"] == "yes"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port).ping()


def test_put_get_ack_and_the_ledger(redis_server):
    q = BatchQueue.connect(redis_server.url, "t1")
    q.ensure_group()
    for i in range(3):
        q.put(make_batch(i), max_depth=10)
    got = [q.get("rank0", block_ms=100) for _ in range(3)]
    assert [d.batch.batch_id for d in got] == [f"v0-e0-s0-{i}" for i in range(3)]
    assert q.get("rank0", block_ms=50) is None
    assert q.pending() == 3
    assert q.ack(got[:2], step=1, rank=0) == []
    counts = q.counts()
    assert counts["acked"] == 2 and counts["pending"] == 1 and counts["depth"] == 1 and counts["ledger"] == 2
    assert q.already_trained("v0-e0-s0-0") and not q.already_trained("v0-e0-s0-2")
    # acknowledging the same batch again is reported as a double training
    assert q.ack([got[0]], step=2, rank=0) == ["v0-e0-s0-0"]


def test_producer_waits_when_full_and_drops_nothing(redis_server):
    q = BatchQueue.connect(redis_server.url, "t2")
    q.ensure_group()
    produced = []

    def produce():
        for i in range(6):
            q.put(make_batch(i), max_depth=3)
            produced.append(i)

    thread = threading.Thread(target=produce)
    thread.start()
    time.sleep(0.5)
    assert len(produced) == 3 and q.depth() == 3  # waiting, not trimming
    received = []
    while len(received) < 6:
        d = q.get("rank0", block_ms=500)
        assert d is not None
        assert q.depth() <= 3
        q.ack([d], step=len(received), rank=0)
        received.append(d.batch.batch_id)
    thread.join(timeout=5)
    assert received == [f"v0-e0-s0-{i}" for i in range(6)]


CONSUMER = """
import sys, time
from marge.protocol import BatchQueue
q = BatchQueue.connect(sys.argv[1], "t3")
d = q.get("doomed", block_ms=5000)
print(d.batch.batch_id, flush=True)
time.sleep(60)  # 'training' forever: killed before it acknowledges
"""


def test_a_batch_held_by_a_killed_consumer_is_redelivered_and_trained_once(redis_server):
    q = BatchQueue.connect(redis_server.url, "t3", QueueConfig(claim_idle_ms=300))
    q.ensure_group()
    q.put(make_batch(7), max_depth=10)
    proc = subprocess.Popen([sys.executable, "-c", CONSUMER, redis_server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "v0-e0-s0-7"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert q.pending() == 1
    assert q.get("survivor", block_ms=50) is None  # not yet idle long enough to claim
    time.sleep(0.4)
    d = q.get("survivor", block_ms=50)
    assert d is not None and d.batch.batch_id == "v0-e0-s0-7" and d.times_delivered == 2
    assert q.ack([d], step=1, rank=1) == []
    ledger = q.ledger_entries()
    assert list(ledger) == ["v0-e0-s0-7"] and ledger["v0-e0-s0-7"]["rank"] == 1
    counts = q.counts()
    assert counts["redelivered"] == 1 and counts["pending"] == 0 and counts.get("trained_twice", 0) == 0


def test_a_redelivered_batch_already_in_the_ledger_is_not_trained_again(redis_server, tmp_path):
    from marge.paths import RunPaths
    from services.trainer.config import HealthConfig, TrainerConfig
    from services.trainer.job import TrainerJob
    from services.trainer.objectives import ObjectivesConfig
    from services.trainer.source import RedisSource

    q = BatchQueue.connect(redis_server.url, "t4", QueueConfig(claim_idle_ms=100))
    q.ensure_group()
    q.put(make_batch(1), max_depth=10)
    q.put(make_batch(2), max_depth=10)
    first = q.get("a", block_ms=100)
    # trained and recorded, but the consumer died before XACK: simulate by writing the ledger only
    q.r.hset(q.ledger, first.batch.batch_id, '{"step": 1, "rank": 0}')
    time.sleep(0.15)
    job = TrainerJob(TrainerConfig(), ObjectivesConfig(), HealthConfig(), QueueConfig(block_ms=100, claim_idle_ms=100),
                     RunPaths.of("t4", tmp_path, tmp_path), seed=0, max_steps=10, deadline_unix=time.time() + 5,
                     redis_url=redis_server.url)
    d = RedisSource(job, rank=1, consumed=[]).next(step=1)
    assert d.batch.batch_id == "v0-e0-s0-2"  # the already-trained one was skipped and acknowledged
    assert q.counts()["skipped_already_trained"] == 1
    assert q.r.xpending(q.stream, CONSUMER_GROUP)["pending"] == 1


def test_tampered_and_poison_entries_go_to_the_dead_letter_stream(redis_server):
    q = BatchQueue.connect(redis_server.url, "t5", QueueConfig(claim_idle_ms=50, max_deliveries=2))
    q.ensure_group()
    fields = encode_batch(make_batch(1))
    fields[b"header"] = fields[b"header"].replace(b'"index_version":0', b'"index_version":1')
    q.r.xadd(q.stream, fields)
    q.r.xadd(q.stream, {b"v": b"1", b"header": b"\x80\x04pickle", b"tokens": b"", b"sha256": b"x"})
    q.put(make_batch(2), max_depth=10)
    d = q.get("a", block_ms=100)
    assert d.batch.batch_id == "v0-e0-s0-2"
    # never acknowledged: delivered again and again until it is dead-lettered
    for _ in range(3):
        time.sleep(0.07)
        d = q.get("a", block_ms=10)
        if d is None:
            break
    reasons = [entry[1][b"reason"].decode() for entry in q.r.xrange(q.dead)]
    assert any("sha256" in r for r in reasons)
    assert sum("delivered 3 times" in r for r in reasons) == 1
    assert q.counts()["dead_lettered"] == 3 and q.depth() == 0
