"""`marge.train_log`: the typed, versioned record of every update, its writer and its reader."""

from __future__ import annotations

import json
import math

import pytest

from marge.train_log import SCHEMA_VERSION, TrainLog, TrainLogError, UpdateRecord, read_train_log


def record(step: int, **fields) -> UpdateRecord:
    values = {"loss": 2.0 + step, "lr": 1e-4, "grad_norm": 0.5, "batch_ids": [f"b{step}-0", f"b{step}-1"],
              "slots": [2 * step - 2, 2 * step - 1]}
    return UpdateRecord(step=step, **{**values, **fields})


def test_records_round_trip_through_the_file_with_their_schema(tmp_path):
    log = TrainLog.of_run(tmp_path)
    written = [record(1, health={"g_spread": 0.3}), record(2, mfu=0.41, dead_lettered=[3])]
    for r in written:
        log.append(r)
    lines = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [line["schema"] for line in lines] == [SCHEMA_VERSION] * 2
    assert "mfu" not in lines[0] and "health" not in lines[1]  # optional fields only where measured
    assert read_train_log(tmp_path) == written
    assert read_train_log(tmp_path, through_step=1) == written[:1]
    assert written[1].trained_slots() == {2: "b2-0"}


def test_lines_written_before_the_schema_field_still_read(tmp_path):
    old = {"step": 1, "loss": 3.0, "objectives": {"marge": 3.0}, "lr": 0.0, "grad_norm": 1.0, "beta": [1.0],
           "batch_ids": ["x"], "index_versions": [0], "snapshot_steps": [0], "staleness_max": 0, "step_seconds": 0.1,
           "tokens": 10, "target_tokens": 5, "tokens_per_s": 1.0, "target_tokens_per_s": 0.5, "wait_share": 0.0,
           "elapsed_s": 1.0, "time": 1.0}
    (tmp_path / "train_log.jsonl").write_text(json.dumps(old) + "\n")
    (r,) = read_train_log(tmp_path)
    assert r.schema == 1 and r.loss == 3.0 and r.slots == [] and r.health is None


def test_a_newer_schema_or_a_record_without_its_fields_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "train_log.jsonl"
    path.write_text(json.dumps({**record(1).to_dict(), "schema": SCHEMA_VERSION + 1}) + "\n")
    with pytest.raises(TrainLogError, match=r"train_log.jsonl:1: .*newer than this marge reads"):
        read_train_log(tmp_path)
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(TrainLogError, match=r":1: an update record needs lr, grad_norm, batch_ids"):
        read_train_log(tmp_path)


def test_a_torn_last_line_is_skipped_and_a_torn_line_before_it_is_an_error(tmp_path):
    log = TrainLog.of_run(tmp_path)
    log.append(record(1))
    with open(log.path, "a") as f:
        f.write('{"step": 2, "lo')  # a crash mid-write
    assert [r.step for r in log.read()] == [1]
    log.path.write_text(log.path.read_text() + "\n" + record(3).to_json() + "\n")
    with pytest.raises(TrainLogError, match=r"train_log.jsonl:2: not JSON"):
        log.read()


def test_truncate_after_drops_later_updates_and_a_torn_line(tmp_path):
    log = TrainLog.of_run(tmp_path)
    for step in (1, 2, 3):
        log.append(record(step))
    with open(log.path, "a") as f:
        f.write('{"step": 4, ')
    log.truncate_after(2)
    assert [r.step for r in log.read()] == [1, 2]
    before = log.path.read_text()
    log.truncate_after(5)  # nothing to drop: the file is not rewritten
    assert log.path.read_text() == before
    TrainLog(tmp_path / "none.jsonl").truncate_after(0)  # no log yet: nothing to do
    assert read_train_log(tmp_path / "empty-run") == []


def test_a_skipped_update_says_so():
    assert record(1, grad_norm=math.inf).skipped and not record(1).skipped
