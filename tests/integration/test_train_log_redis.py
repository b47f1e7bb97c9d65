"""`marge audit`'s account streamed over a segmented train log against the commits in a real redis-server.

The quick tests of this subject are in tests/unit/test_train_log.py (no server)."""

from __future__ import annotations

from train_log_inputs import SLOTS, audited_run, ledger_of

from marge.contracts.protocol import BatchQueue
from services.ops.audit import CheckpointState, QueueState, account


def test_the_account_reads_each_intervals_commits_from_redis_as_the_log_reaches_it(tmp_path, redis_server):
    """`QueueState.of` leaves the commits in Redis and the account reads one checkpoint's at a time (one HGETALL), in
    update order; it gives the same verdicts as with them all in one dict, clean or not."""

    def edit(ids, dead):  # slot 21 (update 10) left out with no dead letter; slot 3 dead-lettered, replayed into 26
        dead.extend([21, 3])
        ids[26] = ids[3]
        return [{"slot": 3, "batch_id": ids[3], "replayed_to_slot": 26}]

    log, dead_letters = audited_run(tmp_path, edit=edit)
    steps, commits = ledger_of(log.iter_records(), SLOTS, 4, 16)
    q = BatchQueue.connect(redis_server.url, "audit-commits", SLOTS)
    for step in steps:
        for rank, record in commits[step].items():
            q.commit(rank, step, [(rank, record)])
    counts = q.counts()
    read: list[int] = []

    def commits_of(step: int):
        read.append(step)
        return q.commits(step)

    state = QueueState(counts, q.committed_steps(), commits_of, dead_letters)
    from_redis = account(lambda: log.iter_records(through_step=16), SLOTS, CheckpointState(16), state)
    in_memory = account(lambda: log.iter_records(through_step=16), SLOTS, CheckpointState(16),
                        QueueState(counts, steps, lambda s: commits[s], dead_letters))
    assert from_redis == in_memory and read == [4, 8, 12, 16]  # each interval once, as the log goes past
    assert (from_redis["batches_lost"], from_redis["lost_slots"]) == (1, [21]) and not from_redis["ok"]
    assert from_redis["commits_disagree_with_train_log"] == [] and from_redis["checkpoint_intervals"] == 4
    assert counts["trained"] == from_redis["batches_trained"] == 32 - 2
