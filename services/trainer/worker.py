"""The trainer stage: the per-worker loop that Ray Train's TorchTrainer runs on every DDP rank.

Each step, every rank takes `grad_accum` batches from the Redis stream through the consumer group,
the ranks agree (one all-reduce) that all of them have their batches and time is not up, then each
runs forward/backward (relevance scores recomputed with gradients from the batch tokens), DDP
averages the gradients, the optimizer steps, and only then each rank acknowledges its batches.
Rank 0 publishes a relevance-encoder snapshot every `snapshot_every` updates and, with all ranks,
reports a checkpoint of the whole training state every `checkpoint_every` updates, so that a
resubmitted job (same run name and directory) resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from marge.augment import SelfEvidence
from marge.checkpoint import load_model_weights, load_training_state, save_checkpoint, set_rng_state
from marge.config import PipelineConfig
from marge.corpus import Corpus
from marge.protocol import BatchQueue, Delivery
from marge.snapshot import publish_snapshot
from marge.training import (DenoisingContrastive, OptimConfig, build_optimizer, build_scheduler, forward_backward,
                            maybe_no_sync, optimizer_step, unwrap)
from marge.utils import setup_logging

log = logging.getLogger(__name__)


def self_evidence_config(cfg: PipelineConfig) -> SelfEvidence | None:
    t = cfg.trainer
    if t.self_evidence_prob <= 0:
        return None
    return SelfEvidence(prob=t.self_evidence_prob, until=t.self_evidence_until, deletion=t.self_evidence_deletion)


def optim_config(cfg: PipelineConfig) -> OptimConfig:
    return OptimConfig(lr=cfg.trainer.lr, warmup_steps=cfg.trainer.warmup_steps, total_steps=cfg.total_steps,
                       weight_decay=cfg.trainer.weight_decay, clip_norm=cfg.trainer.clip_norm)


def init_weights_path(cfg: PipelineConfig) -> Path:
    return Path(cfg.run.dir) / "init" / "model.safetensors"


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


class Metrics:
    def __init__(self, run: str, rank: int):
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = {"stage": "trainer", "run": run, "rank": str(rank)}
        keys = tuple(tags)
        self.acked = Counter("marge_batches_acked", "Batches trained and acknowledged", tag_keys=keys)
        self.tokens_per_s = Gauge("marge_trainer_tokens_per_second", "Evidence + target tokens per second", tag_keys=keys)
        self.loss = Gauge("marge_trainer_loss", "Mean target-token NLL of the last step", tag_keys=keys)
        self.beta = Gauge("marge_trainer_beta", "Relevance bias weight beta (mean over layers)", tag_keys=keys)
        self.step = Gauge("marge_trainer_step", "Optimizer updates done", tag_keys=keys)
        self.wait = Gauge("marge_trainer_wait_share", "Share of trainer time spent waiting for batches", tag_keys=keys)
        self.staleness = Histogram("marge_batch_staleness_steps", "Trainer step minus the batch's snapshot step",
                                   boundaries=[1, 10, 100, 1000, 10000, 100000], tag_keys=keys)
        for m in (self.acked, self.tokens_per_s, self.loss, self.beta, self.step, self.wait, self.staleness):
            m.set_default_tags(tags)


class HealthProbe:
    """Rank 0's retrieval-health measurements at every snapshot (marge.health), exported as Ray gauges."""

    def __init__(self, cfg: PipelineConfig, tokenizer, run: str, rank: int):
        from ray.util.metrics import Gauge

        from marge.health import HealthMonitor

        self.monitor = HealthMonitor(cfg.health, cfg.data.heldout_pairs, tokenizer, seed=cfg.run.seed)
        tags = {"stage": "trainer", "run": run, "rank": str(rank)}
        self.gauges = {name: Gauge(f"marge_{name}", help_text, tag_keys=tuple(tags)) for name, help_text in (
            ("evidence_gain", "Probe loss with shuffled minus with true evidence (nats/token)"),
            ("copy_gain", "Probe loss with shuffled evidence minus with a noised copy of the target"),
            ("relevance_cos_true", "Mean f(target, its true evidence) on the probe set"),
            ("relevance_cos_shuffled", "Mean f(target, unrelated evidence) on the probe set"),
            ("g_spread", "Mean cosine of g between unrelated probe documents"),
            ("heldout_p_at_1", "Held-out cross-lingual retrieval P@1, mean over directions"))}
        for gauge in self.gauges.values():
            gauge.set_default_tags(tags)

    def measure(self, model, device) -> dict:
        out = self.monitor.measure(model, device)
        for name, gauge in self.gauges.items():
            if name in out:
                gauge.set(out[name])
        return out


def next_batch(queue: BatchQueue, consumer: str, cfg: PipelineConfig, step: int, stop_key: str,
               deadline: float | None) -> Delivery | None:
    """Block until a batch this run has not trained yet arrives; None when the run must stop."""
    while True:
        if queue.r.get(stop_key) is not None or (deadline is not None and time.time() > deadline):
            return None
        delivery = queue.get(consumer, block_ms=cfg.queue.block_ms)
        if delivery is None:
            continue
        if queue.already_trained(delivery.batch.batch_id):
            queue.skip(delivery, "already_trained")  # a redelivery of a batch whose step already happened
            continue
        staleness = step - delivery.batch.snapshot_step
        if cfg.trainer.max_staleness and staleness > cfg.trainer.max_staleness:
            queue.dead_letter(delivery.entry_id, delivery.fields,
                              f"stale: {staleness} updates behind (max {cfg.trainer.max_staleness})")
            continue
        return delivery


class RedisSource:
    """The pipeline's feed: the run's Redis stream, read through the consumer group."""

    def __init__(self, cfg: PipelineConfig, redis_url: str, rank: int, consumed: list[str], deadline: float | None):
        self.cfg, self.rank, self.deadline = cfg, rank, deadline
        self.queue = BatchQueue.connect(redis_url, cfg.run.name, claim_idle_ms=cfg.queue.claim_idle_ms,
                                        max_deliveries=cfg.queue.max_deliveries)
        self.queue.ensure_group()
        if rank == 0 and consumed:  # a fresh Redis (or a lost ledger) still learns what the checkpoint trained on
            pipe = self.queue.r.pipeline(transaction=False)
            for batch_id in consumed:
                pipe.hsetnx(self.queue.ledger, batch_id, json.dumps({"step": -1, "rank": -1, "restored": True}))
            pipe.execute()
        self.consumer = f"rank{rank}-{uuid.uuid4().hex[:8]}"
        self.stop_key = f"{self.queue.prefix}:control:stop"

    def next(self, step: int) -> Delivery | None:
        return next_batch(self.queue, self.consumer, self.cfg, step, self.stop_key, self.deadline)

    def ack(self, deliveries: list[Delivery], step: int) -> None:
        self.queue.ack(deliveries, step, self.rank)

    def publish(self, record: dict) -> None:
        line = json.dumps(record)
        pipe = self.queue.r.pipeline()
        pipe.rpush(f"{self.queue.prefix}:steps", line)
        pipe.ltrim(f"{self.queue.prefix}:steps", -10000, -1)
        pipe.hset(f"{self.queue.prefix}:trainer", mapping={"last": line})
        pipe.execute()


class MemorySource:
    """The in-process baseline's feed: a fixed list of batches for this rank (no Redis, no other stages)."""

    def __init__(self, batches: list):
        self.batches = iter(batches)

    def next(self, step: int) -> Delivery | None:
        batch = next(self.batches, None)
        return None if batch is None else Delivery(b"", batch, 1, {})

    def ack(self, deliveries: list[Delivery], step: int) -> None:
        pass

    def publish(self, record: dict) -> None:
        pass


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    setup_logging()
    cfg: PipelineConfig = config["pipeline"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.run.seed + rank)
    device = ray.train.torch.get_device()
    corpus = Corpus.open(cfg.data.corpus, verify_checksums=False)
    tokenizer = corpus.tokenizer()
    model = load_model_weights(init_weights_path(cfg)).to(device)
    optimizer = build_optimizer(model, optim_config(cfg))
    scheduler = build_scheduler(optimizer, optim_config(cfg))
    step, consumed, tokens_seen = 0, [], 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_training_state(Path(d))
            from safetensors.torch import load_file

            model.load_state_dict(load_file(str(Path(d) / "model.safetensors"), device=str(device)))
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            step, consumed, tokens_seen = int(state["step"]), list(state["consumed_batches"]), int(state["tokens_seen"])
        log.info("rank %d resumed from step %d (%d batches consumed)", rank, step, len(consumed))
    ddp_model = ray.train.torch.prepare_model(model)  # DDP (gloo on CPU, NCCL on GPU)

    deadline = config.get("deadline_unix")
    if "memory_batches" in config:  # the benchmark's in-process feed: the same loop without Redis
        source = MemorySource(config["memory_batches"][rank])
    else:
        source = RedisSource(cfg, config["redis_url"], rank, consumed, deadline)
    self_evidence = self_evidence_config(cfg)
    t = cfg.trainer
    denoising = None
    if t.denoise_weight > 0:
        corpus_tokens = [tok for s in range(corpus.num_shards) for tok in corpus.read_shard(s).tokens]
        denoising = DenoisingContrastive(t.denoise_weight, t.denoise_deletion, t.denoise_temperature,
                                         t.denoise_extra_documents, corpus_tokens)
    metrics = Metrics(cfg.run.name, rank)
    health = HealthProbe(cfg, tokenizer, cfg.run.name, rank) if rank == 0 else None
    speed = Throughput()
    run_dir = Path(cfg.run.dir)
    last_metrics: dict = {}
    last_checkpoint = step

    while step < cfg.run.max_steps:
        t_wait = time.perf_counter()
        deliveries: list[Delivery] = []
        for _ in range(cfg.trainer.grad_accum):
            d = source.next(step)
            if d is None:
                break
            deliveries.append(d)
        speed.waited(time.perf_counter() - t_wait)
        ready = torch.tensor([1.0 if len(deliveries) == cfg.trainer.grad_accum else 0.0])
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # every rank must have its batches, or all stop
        if ready.item() < 1:
            log.info("rank %d stopping at step %d (stop requested or time is up)", rank, step)
            break  # batches read but not trained stay pending and are redelivered later

        t_step = time.perf_counter()
        losses, step_tokens, step_target_tokens = [], 0, 0
        for i, d in enumerate(deliveries):
            with maybe_no_sync(ddp_model, i < len(deliveries) - 1):
                loss, n_target = forward_backward(ddp_model, d.batch, tokenizer.specials, 1.0 / len(deliveries), device,
                                                  cfg.trainer.bf16, cfg.batcher.attend_to, self_evidence,
                                                  (cfg.run.seed, step, rank * cfg.trainer.grad_accum + i), denoising)
            losses.append(loss)
            step_target_tokens += n_target
            step_tokens += d.batch.cost_tokens()
        lr = optimizer.param_groups[0]["lr"]
        grad_norm = optimizer_step(ddp_model, optimizer, scheduler, cfg.trainer.clip_norm)
        step += 1
        source.ack(deliveries, step)  # only after the optimizer step that used them
        consumed.extend(d.batch.batch_id for d in deliveries)

        # one record per step: every rank's batches and the mean loss over ranks
        stats = torch.tensor([sum(losses) / len(losses), float(step_tokens), float(step_target_tokens)])
        dist.all_reduce(stats)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, [(d.batch.batch_id, d.batch.index_version, d.batch.snapshot_step)
                                          for d in deliveries])
        speed.tokens += int(stats[1])
        speed.target_tokens += int(stats[2])
        tokens_seen += int(stats[2])
        mean_loss = float(stats[0]) / world
        staleness = [step - 1 - d.batch.snapshot_step for d in deliveries]
        for s in staleness:
            metrics.staleness.observe(s)
        metrics.acked.inc(len(deliveries))
        if rank == 0:
            beta = unwrap(ddp_model).beta.detach().float().cpu().tolist()
            flat = [item for part in gathered for item in part]
            perf = speed.snapshot()
            record = {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "beta": beta,
                      "batch_ids": [b for b, _, _ in flat], "index_versions": sorted({v for _, v, _ in flat}),
                      "snapshot_steps": sorted({s for _, _, s in flat}),
                      "staleness_max": max(step - 1 - s for _, _, s in flat), "step_seconds": time.perf_counter() - t_step,
                      "tokens": int(stats[1]), "target_tokens": int(stats[2]), **perf, "time": time.time()}
            metrics.loss.set(mean_loss)
            metrics.beta.set(sum(beta) / len(beta))
            metrics.step.set(step)
            metrics.tokens_per_s.set(perf["tokens_per_s"])
            metrics.wait.set(perf["wait_share"])
            last_metrics = {"step": step, "loss": mean_loss, **perf}
            if step % cfg.trainer.snapshot_every == 0:
                publish_snapshot(run_dir / "snapshots", unwrap(ddp_model), step, tokenizer.sha256)
                record["health"] = health.measure(unwrap(ddp_model), device)
                log.info("health at step %d: %s", step, {k: v for k, v in record["health"].items() if k != "p_at_1"})
            with open(run_dir / "train_log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            source.publish(record)
        if step % cfg.trainer.checkpoint_every == 0 or step >= cfg.run.max_steps:
            consumed = recent_batches(consumed)
            _report_checkpoint(ray, rank, step, unwrap(ddp_model), optimizer, scheduler, corpus.root,
                               consumed, tokens_seen, last_metrics)
            last_checkpoint = step
    if step > last_checkpoint:  # stopped early: still checkpoint the last completed step (all ranks take part)
        _report_checkpoint(ray, rank, step, unwrap(ddp_model), optimizer, scheduler, corpus.root,
                           recent_batches(consumed), tokens_seen, last_metrics)


def recent_batches(batch_ids: list[str], keep_versions: int = 3) -> list[str]:
    """Consumed ids of the newest index versions only: older versions are never produced again, so their
    ids cannot come back, and the list stays bounded over a long run."""
    def version(batch_id: str) -> int:
        head = batch_id.split("-", 1)[0]
        return int(head[1:]) if head.startswith("v") and head[1:].isdigit() else -1

    if not batch_ids:
        return batch_ids
    newest = max(version(b) for b in batch_ids)
    return [b for b in batch_ids if version(b) > newest - keep_versions or version(b) < 0]


def _report_checkpoint(ray, rank: int, step: int, model, optimizer, scheduler, tokenizer_dir: Path,
                       consumed: list[str], tokens_seen: int, metrics: dict) -> None:
    """All ranks call report (it is a barrier); rank 0 attaches the checkpoint folder."""
    from ray.train import Checkpoint

    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="marge-ckpt-") as tmp:
            save_checkpoint(Path(tmp), model, optimizer, scheduler, step, tokenizer_dir,
                            {"consumed_batches": consumed, "tokens_seen": tokens_seen})
            ray.train.report({**metrics, "step": step}, checkpoint=Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"step-{step:08d}")
    else:
        ray.train.report({"step": step})
