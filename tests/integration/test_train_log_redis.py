"""`marge.contracts.train_log`: the typed, versioned record of every update, its writer and its reader, its segments, and
`marge audit`'s account streamed over them.

These need a server or take long; the quick tests of this subject are in tests/unit/test_train_log.py (no server)."""

from __future__ import annotations

from train_log_inputs import SLOTS, audited_run

from services.driver.audit import CheckpointState, QueueState, account

# -- segments: a long run's log, rolled every `segment_updates` records


# -- `marge audit`'s account, streamed over a segmented log (services.driver.audit.account)


def test_the_account_reads_the_retired_counts_from_redis_a_block_at_a_time(tmp_path, redis_server):
    """`QueueState.of` leaves the retired counts in Redis (`RetiredCounts`: HMGET of a block of updates as the log
    goes past); the account gives the same verdicts as with them all in one dict, clean or not."""
    import redis

    from services.driver.audit import RetiredCounts

    client = redis.Redis.from_url(redis_server.url)
    hmgets: list[int] = []

    class Counted(RetiredCounts):
        def get(self, update, default=None):
            start = update - update % self.block
            if start != self._start:
                hmgets.append(start)
            return super().get(update, default)

    def edit(ids, dead):  # slot 21 (update 10) left out with no dead letter; slot 3 dead-lettered, replayed into 26
        dead.extend([21, 3])
        ids[26] = ids[3]
        return [{"slot": 3, "batch_id": ids[3], "replayed_to_slot": 26}]

    log, dead_letters = audited_run(tmp_path, edit=edit)
    for key, override, disagree in (("as-trained", {}, [10]), ("miscounted", {4: 1, 99: 5}, [4, 10])):
        retired = {u: SLOTS.per_step - sum(1 for d in dead_letters if SLOTS.step_of(d["slot"]) == u)
                   for u in range(16)} | override
        client.hset(key, mapping={str(u): k for u, k in retired.items()})
        counts = {"committed_step": 16, "pending": 0, "produced": 32}
        hmgets.clear()
        from_redis = account(lambda: log.iter_records(through_step=16), SLOTS, CheckpointState(16),
                             QueueState(counts, {}, Counted(client, key, block=3), dead_letters))
        in_memory = account(lambda: log.iter_records(through_step=16), SLOTS, CheckpointState(16),
                            QueueState(counts, {}, retired, dead_letters))
        assert from_redis == in_memory
        assert hmgets == list(range(0, 16, 3))  # one HMGET per block of 3 updates, in update order
        assert from_redis["batches_retired_from_ledger"] == sum(k for u, k in retired.items() if u < 16)
        assert (from_redis["batches_lost"], from_redis["lost_slots"]) == (1, [21]) and not from_redis["ok"]
        assert from_redis["retired_counts_disagree_with_train_log"] == disagree  # update 99: past the checkpoint
    counted = RetiredCounts(client, "miscounted", block=3)
    assert sorted(counted) == sorted(retired) and len(counted) == 17 and 99 in counted and 16 not in counted
    assert counted[99] == 5 and counted.get(40) is None
