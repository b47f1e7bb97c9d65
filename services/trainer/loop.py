"""The trainer stage: the per-worker loop that Ray Train's TorchTrainer runs on every DDP rank.

Each update, told top to bottom in `train_loop_per_worker`:

    next batches      every rank takes `grad_accum` batches from its source (the Redis stream through the
                      consumer group, or memory); the ranks agree (one all-reduce) that all have them
    forward/backward  each rank runs the objectives on its batches (relevance recomputed with gradients
                      from the batch tokens); DDP averages the gradients
    step              the optimizer steps (never on a non-finite gradient)
    acknowledge       each rank acknowledges its batches, only after the step that used them
    log               rank 0 writes one record for the update (every rank's batches, the mean loss)
    snapshot          every `snapshot_every` updates rank 0 publishes g and measures retrieval health
    checkpoint        every `checkpoint_every` updates all ranks report the training state, so a resubmitted
                      job (same run name and folder) resumes where it stopped
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from marge.checkpoint import load_model_weights
from marge.corpus import Corpus
from marge.metrics import StageMetrics
from marge.protocol import Delivery
from marge.snapshot import publish_snapshot
from marge.utils import setup_logging
from services.trainer.health import HealthMonitor
from services.trainer.job import TrainerJob
from services.trainer.objectives import Objectives
from services.trainer.source import source_for
from services.trainer.state import recent_batches, report_checkpoint, resume
from services.trainer.step import build_optimizer, build_scheduler, forward_backward, maybe_no_sync, optimizer_step

log = logging.getLogger(__name__)


@dataclass
class Throughput:
    """Running totals for tokens/s and the share of time spent waiting for batches.

    The clock starts when the first step's batches are in hand: the wait for the very first index
    (start-up) is reported separately as `startup_wait_s`, not as steady-state waiting.
    """

    started: float | None = None
    startup_wait_s: float = 0.0
    wait_s: float = 0.0
    tokens: int = 0
    target_tokens: int = 0

    def waited(self, seconds: float) -> None:
        if self.started is None:
            self.startup_wait_s += seconds
            self.started = time.perf_counter()
        else:
            self.wait_s += seconds

    def snapshot(self) -> dict:
        elapsed = max(time.perf_counter() - (self.started or time.perf_counter()), 1e-9)
        return {"tokens_per_s": self.tokens / elapsed, "target_tokens_per_s": self.target_tokens / elapsed,
                "wait_share": self.wait_s / elapsed, "elapsed_s": elapsed, "startup_wait_s": self.startup_wait_s}


HEALTH_GAUGES = {
    "evidence_gain": "Probe loss with shuffled minus with true evidence (nats/token)",
    "copy_gain": "Probe loss with shuffled evidence minus with a noised copy of the target",
    "relevance_cos_true": "Mean f(target, its true evidence) on the probe set",
    "relevance_cos_shuffled": "Mean f(target, unrelated evidence) on the probe set",
    "g_spread": "Mean cosine of g between unrelated probe documents",
    "heldout_p_at_1": "Held-out cross-lingual retrieval P@1, mean over directions",
}


def trainer_metrics(run: str, rank: int, with_health: bool) -> StageMetrics:
    m = StageMetrics("trainer", run, rank=str(rank))
    m.counter("marge_batches_acked", "Batches trained and acknowledged")
    m.gauge("marge_trainer_tokens_per_second", "Evidence + target tokens per second")
    m.gauge("marge_trainer_loss", "Mean target-token NLL of the last step")
    m.gauge("marge_trainer_beta", "Relevance bias weight beta")
    m.gauge("marge_trainer_step", "Optimizer updates done")
    m.gauge("marge_trainer_wait_share", "Share of trainer time spent waiting for batches")
    m.histogram("marge_batch_staleness_steps", "Trainer step minus the batch's snapshot step",
                [1, 10, 100, 1000, 10000, 100000])
    for name, description in HEALTH_GAUGES.items() if with_health else ():
        m.gauge(f"marge_{name}", description)
    return m


def take_batches(source, step: int, count: int, world_ready) -> list[Delivery] | None:
    """`count` batches for this rank, or None when any rank cannot get its own (then every rank stops)."""
    deliveries = []
    for _ in range(count):
        delivery = source.next(step)
        if delivery is None:
            break
        deliveries.append(delivery)
    ready = torch.tensor([1.0 if len(deliveries) == count else 0.0])
    world_ready(ready)
    return deliveries if ready.item() == 1 else None  # unread or untrained batches stay pending: redelivered later


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry point on every rank: `config["job"]` is the `TrainerJob`."""
    run_rank(config["job"])


def run_rank(job: TrainerJob) -> None:
    import ray.train
    import ray.train.torch

    setup_logging()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    t = job.trainer
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(job.seed + rank)
    device = ray.train.torch.get_device()
    corpus = Corpus.open(job.paths.corpus, verify_checksums=False)
    tokenizer = corpus.tokenizer()
    model = load_model_weights(job.paths.init_weights).to(device)
    optimizer = build_optimizer(model, t)
    scheduler = build_scheduler(optimizer, t, job.max_steps)
    step, consumed, tokens_seen = resume(model, optimizer, scheduler, device)
    if step:
        log.info("rank %d resumed from step %d (%d batches consumed)", rank, step, len(consumed))
    ddp_model = ray.train.torch.prepare_model(model)  # DDP (gloo on CPU, NCCL on GPU)
    corpus_tokens = [tok for s in range(corpus.num_shards) for tok in corpus.read_shard(s).tokens] \
        if job.objectives.needs_corpus else None
    objectives = Objectives(job.objectives, tokenizer.specials, corpus_tokens)
    source = source_for(job, rank, consumed)
    metrics = trainer_metrics(job.paths.name, rank, with_health=rank == 0)
    health = HealthMonitor(job.health, job.heldout_pairs, tokenizer, seed=job.seed) if rank == 0 else None
    speed, last_metrics, last_checkpoint = Throughput(), {}, step

    def all_ranks_ready(flag: torch.Tensor) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)

    while step < job.max_steps:
        t_wait = time.perf_counter()
        deliveries = take_batches(source, step, t.grad_accum, all_ranks_ready)
        speed.waited(time.perf_counter() - t_wait)
        if deliveries is None:
            log.info("rank %d stopping at step %d (stop requested, time up or no batches left)", rank, step)
            break

        t_step = time.perf_counter()
        results = []
        for i, d in enumerate(deliveries):
            prepared = objectives.prepare(d.batch, (job.seed, step, rank * t.grad_accum + i))
            with maybe_no_sync(ddp_model, i < len(deliveries) - 1):
                results.append(forward_backward(ddp_model, objectives, prepared, 1.0 / len(deliveries), device, t.bf16))
        lr = optimizer.param_groups[0]["lr"]
        grad_norm = optimizer_step(ddp_model, optimizer, scheduler, t.clip_norm)
        step += 1
        source.ack(deliveries, step)  # only after the optimizer step that used them
        consumed.extend(d.batch.batch_id for d in deliveries)

        record = step_record(step, deliveries, results, lr, grad_norm, model, world, t_step)
        speed.tokens += record["tokens"]
        speed.target_tokens += record["target_tokens"]
        tokens_seen += record["target_tokens"]
        for d in deliveries:
            metrics.observe("marge_batch_staleness_steps", step - 1 - d.batch.snapshot_step)
        metrics.inc("marge_batches_acked", len(deliveries))
        if rank == 0:
            record.update(speed.snapshot(), time=time.time())
            last_metrics = {"step": step, "loss": record["loss"], **speed.snapshot()}
            if step % t.snapshot_every == 0:
                publish_snapshot(job.paths.snapshots, model, step, tokenizer.sha256)
                record["health"] = health.measure(model, device)
                log.info("health at step %d: %s", step, {k: v for k, v in record["health"].items() if k != "p_at_1"})
            log_step(record, metrics, job, source)
        if step % t.checkpoint_every == 0 or step >= job.max_steps:
            consumed = recent_batches(consumed)
            report_checkpoint(rank, step, model, optimizer, scheduler, corpus.root, consumed, tokens_seen, last_metrics)
            last_checkpoint = step
    if step > last_checkpoint:  # stopped early: still checkpoint the last completed step (all ranks take part)
        report_checkpoint(rank, step, model, optimizer, scheduler, corpus.root, recent_batches(consumed), tokens_seen,
                          last_metrics)


def step_record(step: int, deliveries: list[Delivery], results: list, lr: float, grad_norm: float, model, world: int,
                t_step: float) -> dict:
    """One update's record across ranks: every rank's batches, the mean loss over ranks, token counts (on every
    rank: the collectives need them all; rank 0 writes it)."""
    loss = sum(float(r[0]) for r in results) / len(results)
    stats = torch.tensor([loss, float(sum(d.batch.cost_tokens() for d in deliveries)),
                          float(sum(int(r[1]) for r in results))])
    dist.all_reduce(stats)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [(d.batch.batch_id, d.batch.index_version, d.batch.snapshot_step)
                                      for d in deliveries])
    flat = [item for part in gathered for item in part]
    return {"step": step, "loss": float(stats[0]) / world, "lr": lr, "grad_norm": grad_norm,
            "beta": model.beta.detach().float().cpu().tolist(), "batch_ids": [b for b, _, _ in flat],
            "index_versions": sorted({v for _, v, _ in flat}), "snapshot_steps": sorted({s for _, _, s in flat}),
            "staleness_max": max(step - 1 - s for _, _, s in flat), "step_seconds": time.perf_counter() - t_step,
            "tokens": int(stats[1]), "target_tokens": int(stats[2])}


def log_step(record: dict, metrics: StageMetrics, job: TrainerJob, source) -> None:
    """Rank 0: the update's gauges, its line in train_log.jsonl, and its record for the driver's progress."""
    metrics.set("marge_trainer_loss", record["loss"])
    metrics.set("marge_trainer_beta", sum(record["beta"]) / len(record["beta"]))
    metrics.set("marge_trainer_step", record["step"])
    metrics.set("marge_trainer_tokens_per_second", record["tokens_per_s"])
    metrics.set("marge_trainer_wait_share", record["wait_share"])
    for name in HEALTH_GAUGES:
        if name in record.get("health", {}):
            metrics.set(f"marge_{name}", record["health"][name])
    with open(job.paths.train_log, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    source.publish(record)
