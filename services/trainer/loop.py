"""The trainer stage: the per-worker loop that Ray Train's TorchTrainer runs on every DDP rank.

Each update s, told top to bottom in `Rank.run`:

    next batches      every rank takes its `grad_accum` slots of update s from its source (its stream in the
                      run's Redis, or memory), waiting for them; the ranks agree (one all-reduce) that all have
                      them, or all stop (stop asked, time up)
    forward/backward  each rank runs the objectives on its batches (`run_update`, the step the reference loop
                      and the single process share; relevance recomputed with gradients from the batch tokens); a
                      batch the model cannot take is left out (its place taken by a zero-weight substitute, so the
                      update goes on) and kept with the reason; DDP averages the gradients
    read              the update's figures (gradient norm, losses, the statistics all-reduced on the device) come
                      back to the host in one copy: the only time an update waits for the device. When a batch's
                      loss was not finite, every rank computes the update again without it (it is kept with the
                      reason)
    step              the optimizer steps (an update whose gradient is still not finite is skipped, its batches
                      dead-lettered)
    log               rank 0 writes one record for the update (every rank's slots, the mean loss)
    snapshot          every `snapshot_every` updates rank 0 publishes g and measures retrieval health
    checkpoint        every `checkpoint_every` updates all ranks report the training state (every rank's
                      batches, the ones it left out, and RNG); once it is durable each rank dead-letters the
                      ones it could not train and commits the rest: only then do they count (marge.protocol), so a crash anywhere
                      loses none of them and counts none twice
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from marge.checkpoint import load_model_weights, rng_state, set_rng_state
from marge.corpus import Corpus
from marge.metrics import StageMetrics
from marge.protocol import Delivery, Slots
from marge.snapshot import publish_snapshot
from marge.tensorboard import RunBoard
from marge.utils import setup_logging
from services.trainer.health import HealthMonitor, loggable
from services.trainer.job import TrainerJob
from services.trainer.objectives import objectives_for
from services.trainer.source import source_for
from services.trainer.state import report_checkpoint, resume, truncate_log
from services.trainer.step import Backward, Item, UpdateFigures, build_optimizer, build_scheduler, compiled, run_update

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
    "aligned_evidence_gain": "Aligned probe: held-out paragraphs' loss with unrelated minus with their translations (nats/token)",
    "aligned_evidence_gain_per_char": "Aligned probe's evidence gain per target character (nats/char)",
}


def trainer_metrics(run: str, rank: int, with_health: bool) -> StageMetrics:
    m = StageMetrics("trainer", run, worker=str(rank), rank=str(rank))
    m.counter("marge_batches_trained", "Batches trained (they count once the next checkpoint is durable)")
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


def process_group_backend(use_gpu: bool) -> str:
    """The DDP process group's backend per device type. On GPUs: NCCL for CUDA tensors and gloo for CPU ones (an
    NCCL-only group refuses a CPU tensor, "No backend type associated with device type cpu", and picklable
    objects gathered with `all_gather_object` are CPU-side); on CPUs: gloo."""
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry point on every rank: `config["job"]` is the `TrainerJob`."""
    setup_logging()
    Rank(config["job"]).run()


class Rank:
    """One DDP rank's part of the run: its model, optimizer, objectives and source, and the loop over updates."""

    def __init__(self, job: TrainerJob):
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.job, self.rank, self.world = job, ctx.get_world_rank(), ctx.get_world_size()
        t = job.trainer
        if self.world != t.num_workers:
            raise RuntimeError(f"{self.world} trainer ranks, but trainer.num_workers is {t.num_workers}")
        self.slots = Slots(t.num_workers, t.grad_accum)
        torch.set_num_threads(t.torch_threads)
        torch.manual_seed(job.seed + self.rank)
        self.device = ray.train.torch.get_device()
        if job.faults.trace_collectives:  # a probe for CPU tests of the GPU path (marge.faults)
            from services.trainer.trace import trace_collectives

            trace_collectives(job.faults.trace_collectives, self.rank, self.device)
        corpus = Corpus.open(job.paths.corpus, verify_checksums=False)
        self.corpus_root, self.tokenizer = corpus.root, corpus.tokenizer()
        self.model = load_model_weights(job.paths.init_weights).to(self.device)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = build_scheduler(self.optimizer, t, job.max_steps)
        resumed = resume(self.model, self.optimizer, self.scheduler, self.device, self.rank, job.resume_from,
                         job.paths.checkpoints)
        self.step, self.tokens_seen = resumed.step, resumed.tokens_seen
        if self.step:
            log.info("rank %d resumed at update %d", self.rank, self.step)
        if self.rank == 0:
            truncate_log(job.paths.train_log, self.step)  # lines of updates the checkpoint does not hold
        # DDP (gloo on CPU, NCCL on GPU), under torch.compile with trainer.compile
        self.ddp_model = compiled(ray.train.torch.prepare_model(self.model), t.compile)
        corpus_tokens = corpus.all_tokens() if job.objectives.needs_corpus else None
        self.objectives = objectives_for(job.objectives, self.tokenizer, corpus_tokens)
        self.source = source_for(job, self.rank)
        self.source.progress(self.step)  # a resumed rank: the batcher may write up to `lookahead` past it
        self.committed = [(n, b) for n, b in resumed.trained if self.slots.rank_of(n) == self.rank]
        """(slot, batch id) of this rank's last commit: committed again with the next one (commits are
        idempotent), so a commit a Redis restart lost, or a crash cut off, is made good."""
        if self.step:  # dead letters first: a commit trims the stream that holds their batches
            for slot, fields, reason in resumed.dead:
                if self.slots.rank_of(slot) == self.rank:
                    self.source.dead_letter(Delivery(slot, None, fields), reason)
            self.source.commit(self.step, self.committed)
        self.metrics = trainer_metrics(job.paths.name, self.rank, with_health=self.rank == 0)
        self.health = HealthMonitor(job.health, job.heldout_pairs, self.tokenizer, seed=job.seed) \
            if self.rank == 0 and job.objectives.model_family == "marge" else None
        """Retrieval and evidence probes of g and the decoder: for the MARGE model (a BART run's too)."""
        self.board = RunBoard(job.paths.run_dir, "trainer", job.tensorboard and self.rank == 0)
        """Rank 0's TensorBoard writer (run.tensorboard): every update's record."""
        self.uncommitted: list[tuple[int, str]] = []
        """(slot, batch id) this rank trained since the last durable checkpoint."""
        self.uncommitted_dead: list[tuple[Delivery, str]] = []
        """Deliveries this rank could not train since the last durable checkpoint, and why."""
        if resumed.rng is not None:  # last: a resumed rank draws what the uninterrupted run would have drawn
            set_rng_state(resumed.rng)

    def run(self) -> None:
        job, t = self.job, self.job.trainer
        speed, last_metrics, last_checkpoint = Throughput(), {}, self.step
        while self.step < job.max_steps:
            t_wait = time.perf_counter()
            deliveries = self.take_deliveries()
            speed.waited(time.perf_counter() - t_wait)
            if deliveries is None:
                log.info("rank %d stopping at update %d (stop requested or time up)", self.rank, self.step)
                break
            t_step = time.perf_counter()
            items = [Item(d.slot, d.batch, d.problem) for d in deliveries]
            lr = self.optimizer.param_groups[0]["lr"]
            names = [p.name for p in self.objectives.plugins]
            done, read = run_update(self.ddp_model, self.optimizer, self.scheduler, self.objectives, items, self.slots, t,
                                    self.device, job.seed, self.model.cfg, self.tokenizer.specials,
                                    job.faults.nan_loss_slot,
                                    figures=lambda done: update_statistics(deliveries, done, names, self.device))
            by_slot = {d.slot: d for d in deliveries}
            self.uncommitted_dead.extend((by_slot[slot], f"update {self.step}: {reason}") for slot, reason in done.dead_lettered)
            self.step += 1
            self.source.progress(self.step)
            self.uncommitted.extend(done.trained)
            record = step_record(self.step, deliveries, done, read, lr, self.world, t_step, self.objectives.primary, names)
            speed.tokens += record["tokens"]
            speed.target_tokens += record["target_tokens"]
            self.tokens_seen += record["target_tokens"]
            for d in deliveries:
                if d.batch is not None and d.batch.snapshot_step >= 0:  # batches without an index have none
                    self.metrics.observe("marge_batch_staleness_steps", self.step - 1 - d.batch.snapshot_step)
            self.metrics.inc("marge_batches_trained", len(done.trained))
            if self.rank == 0:
                record.update(speed.snapshot(), time=time.time())
                last_metrics = {"step": self.step, "loss": record["loss"], **speed.snapshot()}
                if self.step % t.snapshot_every == 0:
                    if job.objectives.needs_index:  # the indexer's input
                        publish_snapshot(job.paths.snapshots, self.model, self.step, self.tokenizer.sha256)
                    if self.health is not None:
                        record["health"] = self.health.measure(self.model, self.device)
                        log.info("health at step %d: %s", self.step, loggable(record["health"]))
                log_step(record, self.metrics, job, self.source)
                self.board.step(record)
            if self.step % t.checkpoint_every == 0 or self.step >= job.max_steps:
                self.checkpoint(last_metrics)
                last_checkpoint = self.step
        if self.step > last_checkpoint:  # stopped early: still checkpoint the last completed update (all ranks)
            self.checkpoint(last_metrics)
        self.board.close()

    def take_deliveries(self) -> list[Delivery] | None:
        """This rank's deliveries of the current update, or None when any rank cannot get its own (all stop)."""
        deliveries = []
        for micro in range(self.slots.grad_accum):
            delivery = self.source.get(self.slots.slot(self.step, self.rank, micro))
            if delivery is None:
                break
            deliveries.append(delivery)
        ready = torch.tensor([1.0 if len(deliveries) == self.slots.grad_accum else 0.0])
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # a host decision on a host tensor (gloo): no device sync
        return deliveries if ready.item() == 1 else None  # nothing trained: the same slots are read again later

    def checkpoint(self, metrics: dict) -> None:
        """Report the state (every rank's uncommitted batches and RNG), then commit this rank's batches."""
        gathered: list = [None] * self.world
        dead = [(d.slot, d.fields, reason) for d, reason in self.uncommitted_dead]
        dist.all_gather_object(gathered, {"trained": self.uncommitted, "dead": dead, "rng": rng_state()})
        report_checkpoint(self.rank, self.step, self.model, self.optimizer, self.scheduler, self.corpus_root,
                          [item for part in gathered for item in part["trained"]],
                          [item for part in gathered for item in part["dead"]], [part["rng"] for part in gathered],
                          self.tokens_seen, metrics, self.job)
        dist.barrier()  # ranks other than 0 return from report before rank 0's upload is done: commit after it
        for delivery, reason in self.uncommitted_dead:  # before the commit, which trims the stream below the update
            self.source.dead_letter(delivery, reason)
        self.source.commit(self.step, self.committed + self.uncommitted)
        self.committed, self.uncommitted, self.uncommitted_dead = self.uncommitted, [], []


def update_statistics(deliveries: list[Delivery], done: Backward, names: list[str],
                      device: torch.device | str) -> dict[str, torch.Tensor]:
    """This rank's part of an update's statistics, summed over the ranks on the model's device (no host read; they are
    read back with the update's other figures): `stats` = [evidence + target tokens, target tokens, each objective's
    loss summed over the trained batches, each objective's count of batches], and the count of batches whose
    objective was not finite (`nonfinite_losses`, which makes every rank agree on a second pass)."""
    kept = {slot for slot, _ in done.trained}
    zero = torch.zeros((), dtype=torch.float64, device=device)
    cost = torch.tensor([float(sum(d.batch.cost_tokens() for d in deliveries if d.slot in kept))], dtype=torch.float64)
    counts = torch.tensor([float(sum(1 for p in done.losses if n in p)) for n in names], dtype=torch.float64)
    target = sum((torch.as_tensor(n).to(device, torch.float64) for n in done.target_tokens), zero)
    sums = [sum((p[n].to(torch.float64) for p in done.losses if n in p), zero) for n in names]
    nonfinite = sum(((~torch.isfinite(o)).to(torch.float64) for o in done.objective), zero)
    stats = torch.cat([cost.to(device), target.reshape(1), torch.stack(sums), counts.to(device), nonfinite.reshape(1)])
    dist.all_reduce(stats)  # on the model's device: NCCL's own on GPUs
    return {"stats": stats[:-1], "nonfinite_losses": stats[-1:]}


def step_record(step: int, deliveries: list[Delivery], done: Backward, read: UpdateFigures, lr: float, world: int,
                t_step: float, primary: str = "marge", objectives: list[str] | None = None) -> dict:
    """One update's record across ranks: every rank's slots and batches, the mean loss of the primary objective
    (`loss`) and of each objective (`objectives`) over the batches trained, token counts (from the statistics every
    rank read back with the update's figures; rank 0 writes it)."""
    kept = {slot for slot, _ in done.trained}
    names = objectives or [primary]
    stats = read.extra["stats"]
    skipped = not math.isfinite(read.grad_norm)  # every rank skipped it: no batch of it counts
    means = {name: float("nan") if skipped else stats[2 + i] / max(1.0, stats[2 + len(names) + i])
             for i, name in enumerate(names)}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [(d.slot, d.batch.batch_id if d.batch else None,
                                       d.batch.index_version if d.batch else -1, d.batch.snapshot_step if d.batch else -1,
                                       d.slot in kept) for d in deliveries])
    flat = sorted(item for part in gathered for item in part)
    snapshot_steps = [s for _, _, _, s, _ in flat if s >= 0] or [step - 1]
    return {"step": step, "loss": means[primary], "objectives": means, "lr": lr, "grad_norm": read.grad_norm,
            "beta": read.beta, "slots": [n for n, _, _, _, _ in flat],
            "batch_ids": [b for _, b, _, _, _ in flat], "dead_lettered": [n for n, _, _, _, ok in flat if not ok],
            "index_versions": sorted({v for _, _, v, _, _ in flat if v >= 0}),
            "snapshot_steps": sorted(set(snapshot_steps)), "staleness_max": max(step - 1 - s for s in snapshot_steps),
            "step_seconds": time.perf_counter() - t_step, "tokens": 0 if skipped else int(stats[0]),
            "target_tokens": 0 if skipped else int(stats[1])}


def log_step(record: dict, metrics: StageMetrics, job: TrainerJob, source) -> None:
    """Rank 0: the update's gauges, its line in train_log.jsonl, and its record for the driver's progress."""
    metrics.set("marge_trainer_loss", record["loss"])
    if record["beta"]:
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
