"""What one run's bookkeeping costs at its world size, against a budget: `marge plan`'s "at scale" figures.

Some costs grow with the number of trainer ranks, the checkpoint or the corpus rather than with the work, so a config
that trains at 8 GPUs could stall at 512. Each is scaled from a unit cost measured with the real code (the benchmark
named beside it, its result committed) or computed by the real code here, and compared with a budget that keeps it
from becoming the run's bottleneck:

    redis_commit_s_per_checkpoint        every rank's commit (`BatchQueue.commit`: its `CommitRecord` of the interval
                                         and the previous one's again), serialised in the one Redis after the
                                         checkpoint's barrier: world x the Redis CPU of one commit
    checkpoint_exchange_bytes_per_rank   what the most loaded rank receives at a checkpoint: rank 0 gathers every
                                         rank's record, RNG state and (rare) dead letters (`gather_object`)
    train_log_bytes_per_update           one train_log.jsonl line (`UpdateRecord.to_json`) for world x grad_accum
                                         batches (their ids in runs above `FULL_IDS_MAX_BATCHES`)
    redis_peak_bytes                     the queue's Redis at its peak (`plan.redis_footprint`)
    restore_host_bytes_per_node          host memory the ranks of one node hold at once while restoring
                                         (`marge.model.restore`: a batch and a broadcast buffer each), against one
                                         model's weights
    driver_read_bytes_at_start           the driver hashes the checkpoint it resumes from once
    serving_index_peak_bytes_per_worker  the serving index's on-disk merge (measured merging a 984 MiB index)
    serving_index_train_bytes            the serving index's quantiser training (one process): its training sample
                                         at the corpus's size (`serving_index.default_nlist`, 39 vectors a list, d
                                         floats each) times the samples the training holds at once (measured)

The budgets are chosen, not measured: a checkpoint's Redis work under 5 s, the exchange under 16 MB a rank, a log
line under 4 KiB, Redis under 1 GB, a restore under one model's weights per node, the driver reading the checkpoint
at most once, an index worker or the process training the quantisers under 16 GB.
"""

from __future__ import annotations

from marge.contracts.slots import BatchId, Slots
from marge.contracts.train_log import UpdateRecord
from marge.model.checkpoint import PART_BYTES
from marge.model.restore import RESTORE_BATCH_BYTES
from services.driver.config import PipelineConfig

COMMIT_REDIS_S_PER_RANK = 0.000128
"""Redis CPU of one rank's steady-state commit (two records), flat in the interval: at most 0.13 ms for intervals of
1,000 to 16,000 batches on a real redis-server, 2-core CPU (benchmarks/checkpoint_records_scale.py;
benchmarks/results/checkpoint-records-cpu-2core.json)."""
EXCHANGE_BYTES_PER_RANK = 9330
"""Pickled bytes of one rank's part of the checkpoint's gather: its record and its RNG state (most of it) (same
benchmark)."""
LEDGER_BYTES_PER_RECORD = 48.140625
"""Redis memory of one commit record (MEMORY USAGE of a checkpoint's hash of 512 records; same benchmark)."""
SHARD_BATCHES = 500
"""Batches of one shard's pass a builder writes in a row, for the line's runs (the batcher numbers a shard's batches
consecutively; fewer a shard gives more runs: 500 is a small shard's)."""
SERVING_INDEX_PEAK_BYTES_PER_WORKER = 183_349_248
"""Peak anonymous memory of the process merging a 984 MiB serving index on disk (1M documents at d 1024, 16
parts; benchmarks/serving_index_merge.py; benchmarks/results/serving-index-merge-cpu-2core.json). Training the
coarse quantiser on a sample and adding shards are not in it, nor a corpus of 100M documents."""
SERVING_INDEX_TRAIN_COPIES = 2.11
"""What the quantiser training of a serving-index build holds at once, in training samples: 2.11 samples of peak
anonymous memory growth (1.73 GB for an 819 MB sample of 200,000 vectors at d 1024), against 4.01 before the sample
was let go early and centred in place (benchmarks/serving_index_train.py;
benchmarks/results/serving-index-train-cpu-2core.json)."""
RANKS_PER_NODE = 8
"""GPUs per node the restore's per-node figure assumes (an 8-GPU node)."""

BUDGET_COMMIT_S = 5.0
BUDGET_EXCHANGE_BYTES = 16e6
BUDGET_TRAIN_LOG_LINE_BYTES = 4096
BUDGET_REDIS_BYTES = 1e9
BUDGET_SERVING_INDEX_BYTES = 16e9


def late_update_record(world: int, grad_accum: int, builders: int, shard_batches: int = SHARD_BATCHES
                       ) -> UpdateRecord:
    """A late update's record (wide slot numbers) of world x grad_accum batches with batcher-made ids: each builder's
    slots hold consecutive numbers of its shard's pass, the next shard every `shard_batches` of its batches, each id
    with a 12-digit content digest."""
    slots = Slots(world, grad_accum, builders=min(builders, world))
    step = 100_000
    first = step * slots.per_step
    ids: list[str | None] = []
    for n in range(first, first + slots.per_step):
        group, k = slots.group_of(n), slots.group_index(n)
        shard, number = 1000 * group + k // shard_batches, k % shard_batches
        ids.append(str(BatchId(12, 0, shard, number, f"{(shard * 7919 + number * 2654435761) % (1 << 48):012x}")))
    return UpdateRecord(step=step + 1, loss=3.21, lr=1e-4, grad_norm=0.9, batch_ids=ids,
                        slots=list(range(first, first + slots.per_step)), beta=[1.0] * 12, index_versions=[12],
                        snapshot_steps=[99_000], objectives={"marge": 3.21})


def train_log_line_bytes(world: int, grad_accum: int, builders: int = 1) -> int:
    """The bytes of one train_log.jsonl line of `late_update_record`."""
    return len(late_update_record(world, grad_accum, builders).to_json()) + 1


def serving_index_sample_bytes(documents: int, dim: int) -> float:
    """The bytes of the serving index's training sample for a corpus of `documents` (`marge index build`'s rule)."""
    from services.retrieval.serving_index import MIN_POINTS_PER_LIST, default_nlist

    return max(MIN_POINTS_PER_LIST * default_nlist(documents), 10_000) * dim * 4


def scale_costs(cfg: PipelineConfig, parameters: int, checkpoint_bytes: float, redis_peak_bytes: float,
                documents: int, dim: int) -> dict:
    """Each cost of the module docstring at `cfg`'s world: {"value", "budget", "within"} (bytes or seconds)."""
    t = cfg.trainer
    restore_rank = 2 * max(RESTORE_BATCH_BYTES, PART_BYTES)
    model_bytes = 4 * parameters
    figures = {
        "redis_commit_s_per_checkpoint": (t.num_workers * COMMIT_REDIS_S_PER_RANK, BUDGET_COMMIT_S),
        "checkpoint_exchange_bytes_per_rank": (t.num_workers * EXCHANGE_BYTES_PER_RANK, BUDGET_EXCHANGE_BYTES),
        "train_log_bytes_per_update": (train_log_line_bytes(t.num_workers, t.grad_accum, cfg.batcher.builders),
                                       BUDGET_TRAIN_LOG_LINE_BYTES),
        "redis_peak_bytes": (redis_peak_bytes, BUDGET_REDIS_BYTES),
        "restore_host_bytes_per_rank": (restore_rank, None),
        "restore_host_bytes_per_node": (min(t.num_workers, RANKS_PER_NODE) * restore_rank, model_bytes),
        "driver_read_bytes_at_start": (checkpoint_bytes, checkpoint_bytes),
        "serving_index_peak_bytes_per_worker": (SERVING_INDEX_PEAK_BYTES_PER_WORKER, BUDGET_SERVING_INDEX_BYTES),
        "serving_index_train_bytes": (SERVING_INDEX_TRAIN_COPIES * serving_index_sample_bytes(documents, dim),
                                      BUDGET_SERVING_INDEX_BYTES),
    }
    return {name: {"value": value, "budget": budget, "within": None if budget is None else value <= budget}
            for name, (value, budget) in figures.items()}


def over_budget(costs: dict) -> list[str]:
    """The names of the costs above their budget."""
    return [name for name, c in costs.items() if c["within"] is False]


def describe_costs(costs: dict, world: int) -> str:
    """One line for `marge plan`."""
    def size(name: str) -> str:
        c = costs[name]
        return f"{c['value'] / 1e6:,.1f} MB" + (f" (budget {c['budget'] / 1e6:,.0f})" if c["budget"] else "")

    commit, line = costs["redis_commit_s_per_checkpoint"], costs["train_log_bytes_per_update"]
    over = over_budget(costs)
    return (f"at {world} rank(s): a checkpoint's commits {commit['value']:,.3f} s of Redis (budget "
            f"{commit['budget']:g}); its exchange {size('checkpoint_exchange_bytes_per_rank')} a rank; a train-log "
            f"line {line['value'] / 1024:,.1f} KiB (budget {line['budget'] / 1024:g}); restore "
            f"{size('restore_host_bytes_per_node')} of host memory a node; serving-index merge "
            f"{size('serving_index_peak_bytes_per_worker')} a worker, its quantiser training "
            f"{size('serving_index_train_bytes')} -- "
            + (f"over budget: {', '.join(over)}" if over else "all within budget"))
