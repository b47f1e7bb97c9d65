"""The batch queue's parts that need no server: a batch's encoding and its tamper checks, slot and version
arithmetic, the audit's check for a position with two contents, a checkpoint read retried on an I/O error (the queue
against a real redis-server is tests/integration/test_queue.py)."""

from __future__ import annotations

import numpy as np
import pytest

from marge.contracts.batch import Batch
from marge.contracts.protocol import ProtocolError, decode_batch, encode_batch
from marge.contracts.slots import Slots, VersionPlan


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


def test_slot_and_version_arithmetic():
    s = Slots(world=2, grad_accum=3)
    assert s.per_step == 6 and s.slot(step=4, rank=1, micro=2) == 29
    assert (s.step_of(29), s.rank_of(29)) == (4, 1)
    assert [s.rank_of(n) for n in range(6)] == [0, 0, 0, 1, 1, 1]
    plan = VersionPlan(reindex_every=10, lag=4)
    # version 0 serves updates 0..13; version v >= 1 serves 10v+4 .. 10v+13 and is built from snapshot 10v
    assert [plan.version_for_step(t) for t in (0, 13, 14, 23, 24)] == [0, 0, 1, 1, 2]
    assert [plan.first_step(v) for v in (0, 1, 2)] == [0, 14, 24]
    assert plan.snapshot_step(2) == 20
    assert all(plan.version_for_step(plan.first_step(v)) == v for v in range(50))


def test_the_audit_finds_a_position_recorded_with_two_contents():
    from services.ops.audit import content_changed

    ids = ["v1-e0-s2-0-caaaaaaaaaaaa", "v1-e0-s2-0-caaaaaaaaaaaa", "v1-e0-s2-1-cbbbbbbbbbbbb", "v1-e0-s2-1",
           "probe-3", None]
    assert content_changed(ids) == []  # the same content twice, an id without a digest, ids from elsewhere
    assert content_changed([*ids, "v1-e0-s2-1-ccccccccccccc"]) == [
        {"position": "v1-e0-s2-1", "contents": ["bbbbbbbbbbbb", "cccccccccccc"]}]


def test_a_checkpoint_read_that_fails_with_an_io_error_is_tried_again_before_an_older_one_is_taken(caplog):
    from services.trainer.state import with_io_retries

    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError(5, "Input/output error")
        return "loaded"

    with caplog.at_level("WARNING"):
        assert with_io_retries(flaky, "reading checkpoint step-8", delays_s=(0.01, 0.01, 0.01)) == "loaded"
    assert len(attempts) == 3 and caplog.text.count("trying again") == 2

    def always():
        attempts.append(1)
        raise OSError(5, "Input/output error")

    attempts.clear()
    with pytest.raises(OSError):
        with_io_retries(always, "reading", delays_s=(0.01, 0.01))
    assert len(attempts) == 3

    def missing():
        attempts.append(1)
        raise FileNotFoundError("model.safetensors")

    attempts.clear()
    with pytest.raises(FileNotFoundError):
        with_io_retries(missing, "reading", delays_s=(0.01,))
    assert len(attempts) == 1  # a file that is not there will not appear: the checkpoint's own fault
