"""`marge.contracts.train_log`: the typed, versioned record of every update, its writer and its reader, its segments, and
`marge audit`'s account streamed over them.

The tests of this subject that need a server or take long are in tests/integration/test_train_log_redis.py."""

from __future__ import annotations

import json
import math

import pytest
from train_log_inputs import SLOTS, audited_run, ledger_of, scheduled_ids

from marge.contracts.slots import BatchId, CommitRecord, Slots, trained_digest
from marge.contracts.train_log import SCHEMA_VERSION, RunFigures, TrainLog, TrainLogError, UpdateRecord, read_train_log
from services.ops.audit import CheckpointState, QueueState, account


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


# -- segments: a long run's log, rolled every `segment_updates` records


def written(log: TrainLog, steps) -> list[UpdateRecord]:
    records = [record(step) for step in steps]
    for r in records:
        log.append(r)
    return records


def test_the_live_file_rolls_into_a_segment_named_by_its_updates_at_the_segment_size(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=3)
    written(log, range(1, 8))
    assert sorted(p.name for p in (tmp_path / "train_log.segments").iterdir()) == [
        "steps-00000001-00000003.jsonl", "steps-00000004-00000006.jsonl"]
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [7]
    assert [(s.first, s.last) for s in log.segments()] == [(1, 3), (4, 6)]
    written(log, (8, 9))  # the live file is full again: rolled, and no live file until the next update
    assert not log.path.exists() and [s.last for s in log.segments()] == [3, 6, 9]


def test_a_new_writer_counts_the_live_file_it_continues(tmp_path):
    written(TrainLog.of_run(tmp_path, segment_updates=4), (1, 2))
    written(TrainLog.of_run(tmp_path, segment_updates=4), (3, 4, 5))  # a resumed writer: 2 lines there already
    assert [(s.first, s.last) for s in TrainLog.of_run(tmp_path).segments()] == [(1, 4)]


def test_reading_across_segments_equals_reading_one_file(tmp_path):
    segmented, single = TrainLog.of_run(tmp_path / "seg", segment_updates=4), TrainLog.of_run(tmp_path / "one")
    assert written(segmented, range(1, 15)) == written(single, range(1, 15))
    assert len(segmented.segments()) == 3 and not single.segments()
    assert segmented.read() == single.read() == read_train_log(tmp_path / "seg")
    for through in (0, 3, 4, 5, 12, 14, 99):
        assert list(segmented.iter_records(through_step=through)) == single.read(through_step=through)


def test_a_reader_sees_every_update_once_while_the_writer_rolls(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=3)
    written(log, range(1, 6))  # segment 1-3, live 4-5
    reading = log.iter_records()
    assert next(reading).step == 1  # the reader has listed the segments
    written(log, (6, 7))  # 4-6 rolled under it, 7 in a new live file
    assert [r.step for r in reading] == [2, 3, 4, 5, 6, 7]


def test_truncating_inside_the_live_file_touches_no_segment(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=3)
    written(log, range(1, 9))
    before = {s.path.name: s.path.stat().st_mtime_ns for s in log.segments()}
    log.truncate_after(7)
    assert [r.step for r in log.read()] == list(range(1, 8))
    assert {s.path.name: s.path.stat().st_mtime_ns for s in log.segments()} == before
    written(log, (8, 9))  # the writer counts the cut live file again: 7, 8, 9 roll as one segment
    assert [s.last for s in log.segments()] == [3, 6, 9]


def test_truncating_inside_a_rolled_segment_makes_it_the_live_file_again(tmp_path):
    """A checkpoint older than the last roll: later segments go, the one holding the checkpoint is cut."""
    log, reference = TrainLog.of_run(tmp_path / "seg", segment_updates=3), TrainLog.of_run(tmp_path / "one")
    written(log, range(1, 12))  # segments 1-3, 4-6, 7-9, live 10-11
    log.truncate_after(5)
    assert [(s.first, s.last) for s in log.segments()] == [(1, 3)]
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [4, 5]
    written(log, range(6, 12))  # the resumed run writes 6.. again; its segments are named as before
    written(reference, range(1, 12))
    assert log.read() == reference.read()
    assert [(s.first, s.last) for s in log.segments()] == [(1, 3), (4, 6), (7, 9)]
    log.truncate_after(6)  # the checkpoint is a segment's last update: the segment stays whole
    assert [s.last for s in log.segments()] == [3, 6] and not log.path.exists()
    assert [r.step for r in log.read()] == list(range(1, 7))
    log.truncate_after(0)
    assert log.read() == [] and log.segments() == []


def test_a_truncation_cut_short_by_a_crash_is_finished_by_the_next_one(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=3)
    written(log, range(1, 8))
    (tmp_path / "train_log.segments" / "steps-00000004-00000006.jsonl").replace(log.path)  # crashed after the move
    log.truncate_after(5)
    assert [r.step for r in log.read()] == [1, 2, 3, 4, 5]


def test_a_torn_last_line_is_skipped_only_at_the_end_of_the_live_file(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=3)
    written(log, range(1, 6))
    with open(log.path, "a") as f:
        f.write('{"step": 6, "lo')
    assert [r.step for r in log.read()] == [1, 2, 3, 4, 5]
    log.truncate_after(5)
    assert log.path.read_text().endswith("}\n") and len(log.path.read_text().splitlines()) == 2
    segment = log.segments()[0].path
    segment.write_text(segment.read_text() + '{"step": 4, "lo\n')
    with pytest.raises(TrainLogError, match=r"steps-00000001-00000003.jsonl:4: not JSON"):
        log.read()


def test_a_segment_renamed_or_copied_in_by_hand_is_refused_naming_it(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=3)
    written(log, range(1, 7))
    segments = tmp_path / "train_log.segments"
    (segments / "steps-00000004-00000006.jsonl").rename(segments / "steps-00000004-00000005.jsonl")
    with pytest.raises(TrainLogError, match=r"steps-00000004-00000005.jsonl: holds update 6"):
        log.read()
    (segments / "steps-00000002-00000003.jsonl").write_text(record(2).to_json() + "\n")
    with pytest.raises(TrainLogError, match=r"steps-00000002-00000003.jsonl .*overlaps .*steps-00000001-00000003"):
        log.read()


def test_an_old_single_file_log_reads_unchanged_and_rolls_at_its_next_update(tmp_path):
    records = [record(step) for step in range(1, 26)]
    (tmp_path / "train_log.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    log = TrainLog.of_run(tmp_path, segment_updates=10)
    assert log.read() == records and list(log.iter_records(through_step=7)) == records[:7]
    log.append(record(26))  # 26 lines in a live file of at most 10: rolled whole, named by what it holds
    assert [(s.first, s.last) for s in log.segments()] == [(1, 26)] and log.read() == [*records, record(26)]


def test_the_summary_fold_over_a_segmented_log_equals_the_whole_list(tmp_path):
    log = TrainLog.of_run(tmp_path, segment_updates=4)
    for step in range(1, 11):
        log.append(record(step, staleness_max=step % 4, index_versions=[step // 4]))
    figures, everything = RunFigures.of(log.iter_records()), log.read()
    assert (figures.first, figures.last, figures.updates) == (everything[0], everything[-1], 10)
    assert figures.staleness_max == max(r.staleness_max for r in everything) == 3
    assert figures.index_versions == {0, 1, 2}
    assert RunFigures.of([]).staleness_max == 0 and RunFigures.of([]).last is None


# -- `marge audit`'s account, streamed over a segmented log (services.ops.audit.account)


EVERY = 4
"""Updates between the audited run's checkpoints."""


def account_of(log: TrainLog, dead_letters: list[dict], step: int = 16, edit_commits=None,
               passes: list[int] | None = None) -> dict:
    """The account up to update `step`, every rank's commits those of its lines (`ledger_of`), changed by
    `edit_commits(update -> rank -> commit)`."""
    counts = {"committed_step": step, "pending": 0, "produced": step * SLOTS.per_step}
    steps, commits = ledger_of(log.iter_records(), SLOTS, EVERY, step)
    if edit_commits:
        edit_commits(commits)

    def read_records():
        if passes is not None:
            passes.append(1)
        return log.iter_records(through_step=step)

    return account(read_records, SLOTS, CheckpointState(step),
                   QueueState(counts, steps, lambda s: commits.get(s, {}), dead_letters))


def test_the_account_of_a_clean_segmented_run_reads_its_log_once(tmp_path):
    log, dead_letters = audited_run(tmp_path)
    assert len(log.segments()) == 4
    passes: list[int] = []
    result = account_of(log, dead_letters, passes=passes)
    assert result["ok"] and result["batches_trained"] == 32 and result["train_log_updates"] == 16
    assert (result["batches_lost"], result["trained_twice"], result["content_changed"]) == (0, 0, [])
    assert len(passes) == 1  # every batch id in its schedule's order: nothing to count again


def test_the_account_finds_a_lost_slot_in_a_later_segment(tmp_path):
    def untrained_without_a_dead_letter(ids, dead):  # slot 21 (update 10, segment 3) left out, no dead letter says so
        dead.append(21)
        return []

    log, dead_letters = audited_run(tmp_path, edit=untrained_without_a_dead_letter)
    result = account_of(log, dead_letters)
    assert not result["ok"] and result["batches_lost"] == 1 and result["lost_slots"] == [21]
    assert result["commits_disagree_with_train_log"] == [] and result["batches_trained"] == 31


def test_the_account_finds_commits_that_disagree_with_the_log_and_an_uncommitted_interval(tmp_path):
    """Each interval's lines are added up against its ranks' commits: a count, the digest of what was trained (a
    batch id changed after the commit), and a rank whose interval has no commit (its batches never counted)."""
    log, dead_letters = audited_run(tmp_path)

    def miscounted(commits):  # rank 1 says it trained 5 batches in updates 4-7, the log names 4
        c = commits[8][1]
        commits[8][1] = CommitRecord(c.step, c.since, 5, c.digest)

    result = account_of(log, dead_letters, edit_commits=miscounted)
    assert not result["ok"] and result["batches_lost"] == 0
    assert result["commits_disagree_with_train_log"] == [
        {"checkpoint": 8, "rank": 1, "what": "committed 5 batches, the log names 4"}]

    def other_batch(commits):  # rank 0's commit of updates 12-15 stands for another batch in one slot
        c = commits[16][0]
        commits[16][0] = CommitRecord(c.step, c.since, c.trained, trained_digest([(24, ids_at(25)), (26, ids_at(26)),
                                                                                   (28, ids_at(28)), (30, ids_at(30))]))

    result = account_of(log, dead_letters, edit_commits=other_batch)
    assert not result["ok"] and [d["checkpoint"] for d in result["commits_disagree_with_train_log"]] == [16]

    def uncommitted(commits):  # rank 1 never committed updates 0-3: its 4 batches are lost
        del commits[4][1]

    result = account_of(log, dead_letters, edit_commits=uncommitted)
    assert not result["ok"] and result["lost_slots"] == [1, 3, 5, 7] and result["batches_trained"] == 28
    assert result["commits_disagree_with_train_log"] == [
        {"checkpoint": 4, "rank": 1, "what": "trained 4 batches it never committed"}]


def test_a_replayed_dead_letter_is_trained_once_and_a_batch_trained_at_two_slots_twice(tmp_path):
    def replayed(ids, dead):  # slot 3 (segment 1) dead-lettered, its batch replayed into slot 26 (segment 4)
        dead.append(3)
        ids[26] = ids[3]
        return [{"slot": 3, "batch_id": ids[3], "replayed_to_slot": 26}]

    log, dead_letters = audited_run(tmp_path / "replay", edit=replayed)
    passes: list[int] = []
    result = account_of(log, dead_letters, passes=passes)
    assert result["ok"] and result["trained_twice"] == 0 and result["batches_replayed"] == 1
    assert len(passes) == 1  # a dead letter's position is counted wherever it occurs, on the one pass

    def trained_twice(ids, dead):  # slot 2's batch trained there (segment 1) and again at slot 29 (segment 4)
        ids[29] = ids[2]
        return []

    log, dead_letters = audited_run(tmp_path / "twice", edit=trained_twice)
    result = account_of(log, dead_letters)
    assert not result["ok"] and result["trained_twice"] == 1 and result["trained_twice_ids"] == [str(ids_at(2))]


def ids_at(slot: int) -> str:
    return scheduled_ids(slot + 1)[slot]


def test_the_account_finds_a_position_recorded_with_two_contents_across_segments(tmp_path):
    def rebuilt(ids, dead):  # slot 5's batch dead-lettered, and replayed into slot 30 built again with other content
        dead.append(5)
        parsed = BatchId.parse(ids[5])
        ids[30] = str(BatchId(parsed.version, parsed.epoch, parsed.shard, parsed.number, "bbbbbbbbbbbb"))
        return [{"slot": 5, "batch_id": ids[5], "replayed_to_slot": 30}]

    log, dead_letters = audited_run(tmp_path, edit=rebuilt)
    result = account_of(log, dead_letters)
    position = BatchId.parse(ids_at(5))
    assert not result["ok"] and result["trained_twice"] == 0
    assert result["content_changed"] == [{"position": position.position,
                                          "contents": sorted([position.content, "bbbbbbbbbbbb"])}]


def test_the_account_refuses_a_log_out_of_update_order_naming_it(tmp_path):
    log, dead_letters = audited_run(tmp_path)
    log.append(UpdateRecord(step=3, loss=1.0, lr=1e-4, grad_norm=1.0, batch_ids=["x", "y"], slots=[4, 5]))
    with pytest.raises(TrainLogError, match=r"update 3 records slot 4, which an earlier line already passed"):
        account_of(log, dead_letters)


# -- compact lines: an update of more than FULL_IDS_MAX_BATCHES batches


def test_a_line_of_many_batches_holds_runs_and_reads_back_as_positions_with_the_digest_of_the_full_ids(tmp_path):
    from services.driver.scale_costs import late_update_record

    record = late_update_record(512, 8, 4)
    line = record.to_json()
    assert len(line) < 1024 and "batch_ids" not in json.loads(line)  # 192 KB with every id in full
    (back,) = read_back(tmp_path, record)
    assert back.slots == record.slots and back.dead_lettered == record.dead_lettered
    assert back.batch_ids == [BatchId.parse(b).position for b in record.batch_ids]  # content digests left out
    assert back.trained_digest == trained_digest(record.trained_slots().items())  # ... but not from the digest
    small = UpdateRecord(step=1, loss=1.0, lr=1e-4, grad_norm=1.0, batch_ids=record.batch_ids[:64],
                         slots=record.slots[:64])
    assert json.loads(small.to_json())["batch_ids"] == record.batch_ids[:64]  # up to 64 batches: in full


def read_back(tmp_path, *records: UpdateRecord) -> list[UpdateRecord]:
    log = TrainLog.of_run(tmp_path)
    for r in records:
        log.append(r)
    return log.read()


def test_the_account_of_compact_lines_finds_a_batch_trained_twice_and_a_changed_content_by_its_digest(tmp_path):
    """On compact lines a position stands for its batch: one in two slots is trained twice; a batch whose content
    changed after its rank committed it makes its interval's digest disagree."""
    slots = Slots(world=16, grad_accum=8)  # 128 batches an update: compact lines
    ids = [str(BatchId(0, 0, n // 500, n % 500, f"{n:012x}")) for n in range(8 * slots.per_step)]
    records = [UpdateRecord(step=u + 1, loss=1.0, lr=1e-4, grad_norm=1.0, slots=list(range(u * 128, (u + 1) * 128)),
                            batch_ids=ids[u * 128:(u + 1) * 128]) for u in range(8)]
    steps, commits = ledger_of(records, slots, 4, 8)
    state = QueueState({"committed_step": 8, "pending": 0}, steps, lambda s: commits.get(s, {}), [])

    def audited(lines: list[UpdateRecord]) -> dict:
        (tmp_path / "train_log.jsonl").unlink(missing_ok=True)
        log = TrainLog.of_run(tmp_path)
        for r in lines:
            log.append(r)
        return account(lambda: log.iter_records(through_step=8), slots, CheckpointState(8), state)

    assert audited(records)["ok"] and audited(records)["batches_trained"] == 8 * 128
    doubled = [*records[:6], UpdateRecord(**{**records[6].__dict__, "batch_ids": [ids[5], *ids[6 * 128 + 1:7 * 128]],
                                              "trained_digest": ""}), records[7]]
    result = audited(doubled)
    assert not result["ok"] and result["trained_twice_ids"] == [BatchId.parse(ids[5]).position]
    changed = [*records[:2], UpdateRecord(**{**records[2].__dict__, "trained_digest": "",
                                              "batch_ids": [ids[256][:-12] + "ffffffffffff", *ids[257:384]]}),
               *records[3:]]
    result = audited(changed)
    assert not result["ok"] and result["trained_twice"] == 0 and result["batches_lost"] == 0
    assert result["commits_disagree_with_train_log"] == [
        {"checkpoint": 4, "rank": None, "what": "its batches are not the ones its ranks committed (digest)"}]
