"""What one run's bookkeeping costs at its world size, against a budget: `marge plan`'s "at scale" figures.

Seven costs grow with the number of trainer ranks, the checkpoint or the corpus rather than with the work, so a
config that trains at 8 GPUs can stall at 512. Each is scaled from a unit cost measured with the real code (the
benchmark named beside it, its result committed) or computed by the real code here, and compared with a budget that
keeps it from becoming the run's bottleneck:

    redis_commit_s_per_checkpoint        every rank's commit of its (slot, batch id) pairs, serialised in the one
                                         Redis after the checkpoint's barrier: world x interval batches x the Redis
                                         CPU per batch of a steady-state commit (which also sees the previous
                                         interval again and retires the one before)
    checkpoint_exchange_bytes_per_rank   what `all_gather_object` hands every rank at a checkpoint: every rank's
                                         interval of pairs, pickled
    train_log_bytes_per_update           one train_log.jsonl line (`UpdateRecord.to_json`) for world x grad_accum
                                         batches
    redis_peak_bytes                     the queue's Redis at its peak (`plan.redis_footprint`)
    restore_host_bytes_per_node          host memory the ranks of one node hold at once while restoring
                                         (`marge.model.restore`: a batch and a broadcast buffer each), against one
                                         model's weights
    driver_read_bytes_at_start           the driver hashes the checkpoint it resumes from once
    serving_index_peak_bytes_per_worker  the serving index's on-disk merge (measured merging a 984 MiB index)

The budgets are chosen, not measured: a checkpoint's Redis work under BUDGET_COMMIT_S, the exchange under 16 MB a
rank, a log line under 4 KB, Redis under 1 GB, a restore under one model's weights per node, the driver reading the
checkpoint at most once, an index worker under 16 GB.
"""

from __future__ import annotations

from marge.contracts.slots import BatchId, Slots
from marge.contracts.train_log import UpdateRecord
from marge.model.checkpoint import PART_BYTES
from marge.model.restore import RESTORE_BATCH_BYTES
from services.driver.config import PipelineConfig

COMMIT_REDIS_US_PER_BATCH = 16.14
"""Redis CPU per batch of a rank's checkpoint interval in a steady-state commit (the interval recorded, the previous
one seen again, the one before retired): 0.258 s for 16,000 batches (2,000 updates x 8) on a real redis-server, 2-core
CPU (benchmarks/checkpoint_records_scale.py; benchmarks/results/checkpoint-records-cpu-2core.json)."""
EXCHANGE_BYTES_PER_BATCH = 41.79
"""Pickled bytes per batch of a rank's part of the checkpoint's `all_gather_object` (same benchmark)."""
SERVING_INDEX_PEAK_BYTES_PER_WORKER = 183_349_248
"""Peak anonymous memory of the process merging a 984 MiB serving index on disk (1M documents at d 1024, 16
parts; benchmarks/serving_index_merge.py; benchmarks/results/serving-index-merge-cpu-2core.json). Training the
coarse quantiser on a sample and adding shards are not in it, nor a corpus of 100M documents."""
RANKS_PER_NODE = 8
"""GPUs per node the restore's per-node figure assumes (an 8-GPU node)."""

BUDGET_COMMIT_S = 5.0
BUDGET_EXCHANGE_BYTES = 16e6
BUDGET_TRAIN_LOG_LINE_BYTES = 4096
BUDGET_REDIS_BYTES = 1e9
BUDGET_SERVING_INDEX_BYTES = 16e9


def train_log_line_bytes(world: int, grad_accum: int) -> int:
    """The bytes of one train_log.jsonl line for an update of world x grad_accum batches with batcher-made ids (a
    late update of a long run: wide slot numbers, a 12-digit content digest each)."""
    slots = Slots(world, grad_accum)
    step = 100_000
    first = step * slots.per_step
    ids: list[str | None] = [str(BatchId(12, 0, 300, n, f"{n % (1 << 48):012x}"))
                             for n in range(first, first + slots.per_step)]
    record = UpdateRecord(step=step + 1, loss=3.21, lr=1e-4, grad_norm=0.9, batch_ids=ids,
                          slots=list(range(first, first + slots.per_step)), beta=[1.0] * 12, index_versions=[12],
                          snapshot_steps=[99_000], objectives={"marge": 3.21})
    return len(record.to_json()) + 1


def scale_costs(cfg: PipelineConfig, parameters: int, checkpoint_bytes: float, redis_peak_bytes: float) -> dict:
    """Each cost of the module docstring at `cfg`'s world: {"value", "budget", "within"} (bytes or seconds)."""
    t = cfg.trainer
    interval_batches = min(t.checkpoint_every, cfg.run.max_steps) * t.grad_accum  # one rank's, per checkpoint
    restore_rank = 2 * max(RESTORE_BATCH_BYTES, PART_BYTES)
    model_bytes = 4 * parameters
    figures = {
        "redis_commit_s_per_checkpoint": (t.num_workers * interval_batches * COMMIT_REDIS_US_PER_BATCH / 1e6,
                                          BUDGET_COMMIT_S),
        "checkpoint_exchange_bytes_per_rank": (t.num_workers * interval_batches * EXCHANGE_BYTES_PER_BATCH,
                                               BUDGET_EXCHANGE_BYTES),
        "train_log_bytes_per_update": (train_log_line_bytes(t.num_workers, t.grad_accum),
                                       BUDGET_TRAIN_LOG_LINE_BYTES),
        "redis_peak_bytes": (redis_peak_bytes, BUDGET_REDIS_BYTES),
        "restore_host_bytes_per_rank": (restore_rank, None),
        "restore_host_bytes_per_node": (min(t.num_workers, RANKS_PER_NODE) * restore_rank, model_bytes),
        "driver_read_bytes_at_start": (checkpoint_bytes, checkpoint_bytes),
        "serving_index_peak_bytes_per_worker": (SERVING_INDEX_PEAK_BYTES_PER_WORKER, BUDGET_SERVING_INDEX_BYTES),
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
    return (f"at {world} rank(s): a checkpoint's commits {commit['value']:,.1f} s of Redis (budget "
            f"{commit['budget']:g}); its exchange {size('checkpoint_exchange_bytes_per_rank')} a rank; a train-log "
            f"line {line['value'] / 1024:,.1f} KiB (budget {line['budget'] / 1024:g}); restore "
            f"{size('restore_host_bytes_per_node')} of host memory a node; serving-index merge "
            f"{size('serving_index_peak_bytes_per_worker')} a worker -- "
            + (f"over budget: {', '.join(over)}" if over else "all within budget"))
