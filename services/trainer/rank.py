"""The trainer stage on Ray Train: one DDP rank, the host `TorchTrainer` runs `train_loop_per_worker` on.

The loop itself (next batches → update → record → snapshot/health → log → checkpoint) is
`services.trainer.loop.TrainingLoop`, the same the single process runs. What a rank adds around it:

    next batches  every rank takes its `grad_accum` slots of update s from its source (its stream in the run's
                  Redis, or memory), read and prepared in a thread while update s-1 trained (`trainer.prefetch`);
                  the ranks agree (one all-reduce on a host tensor) that all have them, or all stop (stop asked,
                  time up)
    figures       the update's statistics are summed over the ranks on the device (NCCL on GPUs) and every
                  rank's slots gathered, so rank 0's record covers the whole update
    snapshot      rank 0 publishes g for the indexer (which builds on its own) and measures retrieval health
    log           rank 0 sets the gauges and publishes the record in Redis for the driver's progress lines
    checkpoint    all ranks start writing the training state, each its share (marge.model.checkpoint, format 2), rank 0
                  with every rank's commit record (a count and a digest of its interval's batches: what the ranks
                  exchange does not grow with the interval), the batches they left out, and RNG, and go on training
                  while it is written;
                  at the first update boundary where every rank's part is durable and the manifest written (or
                  before the next checkpoint, or at the end) they report it to Ray Train, and each rank
                  dead-letters the ones it could not train and commits the rest: only then do they count
                  (marge.contracts.protocol), so a crash anywhere loses none of them and counts none twice
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from marge.contracts.corpus import Corpus
from marge.contracts.protocol import Delivery
from marge.contracts.slots import CommitRecord, Slots
from marge.contracts.train_log import TrainLog, UpdateRecord
from marge.eval.metrics import StageMetrics
from marge.eval.tensorboard import RunBoard
from marge.model.checkpoint import (
    CheckpointWrite,
    WriteSettings,
    complete_checkpoints,
    load_model_shell,
    load_model_weights,
    rng_state,
    set_rng_state,
)
from marge.model.lineage import start_generation
from marge.model.snapshot import publish_snapshot
from marge.util.files import setup_logging
from services.trainer.health import HealthMonitor, loggable
from services.trainer.inputs import AttentionLayout, untrainable
from services.trainer.job import TrainerJob
from services.trainer.loop import TrainingLoop, UpdateInput, UpdateMeter
from services.trainer.objectives import PreparedBatch, objectives_for
from services.trainer.precision import bf16_parameters, reduce_in_fp32
from services.trainer.prefetch import Prefetcher
from services.trainer.source import BatchSource, source_for
from services.trainer.state import (
    IntervalRecords,
    begin_checkpoint,
    ray_checkpoint_dir,
    report_checkpoint,
    resume,
)
from services.trainer.step import (
    Backward,
    Item,
    Trainee,
    compile_cache_env,
    compiled,
    ddp_settings,
    device_peak_flops,
    seed_key,
    training_parts,
)

log = logging.getLogger(__name__)

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
    objects gathered with `gather_object` are CPU-side); on CPUs: gloo."""
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry point on every rank: `config["job"]` is the `TrainerJob`."""
    setup_logging()
    Rank(config["job"]).run()


def deliveries_prepared(source: BatchSource, slots: Slots, rank: int, prepare: Callable[[Delivery], PreparedBatch | None],
                        step: int) -> list[tuple[Delivery, PreparedBatch | None]]:
    """Rank `rank`'s deliveries of update `step` in micro-batch order, each prepared, up to the first slot `source`
    does not hold. Reading a slot does not consume it (marge.contracts.protocol), so batches read ahead and never
    trained are read again by the resumed run."""
    out = []
    for micro in range(slots.grad_accum):
        delivery = source.get(slots.slot(step, rank, micro))
        if delivery is None:
            break
        out.append((delivery, prepare(delivery)))
    return out


class Rank:
    """One DDP rank's part of the run: its model, optimizer, objectives and source, hosting the training loop."""

    def __init__(self, job: TrainerJob):
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.job, self.rank, self.world = job, ctx.get_world_rank(), ctx.get_world_size()
        t = job.trainer
        if self.world != t.num_workers or self.world != job.slots.world:
            raise RuntimeError(f"{self.world} trainer ranks, but trainer.num_workers is {t.num_workers} and the "
                               f"run's slots are laid out for {job.slots.world}")
        self.slots = job.slots
        torch.set_num_threads(t.torch_threads)
        torch.manual_seed(job.seed + self.rank)
        self.device = ray.train.torch.get_device()
        if job.faults.trace_collectives:  # a probe for CPU tests of the GPU path (marge.contracts.faults)
            from services.trainer.trace import trace_collectives

            trace_collectives(job.faults.trace_collectives, self.rank, self.device)
        corpus = Corpus.open(job.paths.corpus, verify_checksums=False)
        self.tokenizer = corpus.tokenizer()
        # a rank that resumes reads the checkpoint, not the init weights as well (at 963M parameters, 3.9 GB a rank)
        ray_checkpoint = ray_checkpoint_dir()
        resumable = bool(ray_checkpoint or job.resume_from or complete_checkpoints(job.paths.checkpoints))
        self.model, self.optimizer, self.scheduler = self.training_state(job, from_init_weights=not resumable)
        self.checkpoint_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        """The checkpoint's own gloo group: its writes' collectives run in a thread while training uses the default
        group, and two threads must not interleave collectives on one group."""
        self.pending: PendingCheckpoint | None = None
        """The checkpoint being written, whose batches are committed once it is durable."""
        resumed = resume(self.model, self.optimizer, self.scheduler, self.device, self.rank, job.resume_from,
                         job.paths.checkpoints, group=self.checkpoint_group, ray_checkpoint=ray_checkpoint)
        if resumable and resumed.step == 0:  # no checkpoint could be read after all: start from the init weights
            self.model, self.optimizer, self.scheduler = self.training_state(job, from_init_weights=True)
        self.step, self.tokens_seen = resumed.step, resumed.tokens_seen
        if job.trainer.bf16_params:  # after the restore (into the fp32 parameters, the masters), before DDP
            bf16_parameters(self.model, self.optimizer)
        if self.step:
            log.info("rank %d resumed at update %d", self.rank, self.step)
        self.writes_log = self.rank == 0
        self.train_log = TrainLog(job.paths.train_log)
        self.objectives = objectives_for(job.objectives, self.tokenizer, job.trainer.unpadded,
                                         AttentionLayout.of(job.trainer))
        self.source = source_for(job, self.rank, self.step)
        # before anything is cut back to the checkpoint: the replaced group's ranks are fenced from the queue, and
        # the lineage abandons every checkpoint that group finishes past this one (a crash after this line and
        # before the cuts leaves nothing the next group would resume from wrongly)
        generation = [start_generation(job.paths.checkpoints, self.source.start_generation, self.step)
                      if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(generation, src=0)
        if generation[0] is None:  # every rank has rank 0's generation once the broadcast returns
            raise RuntimeError(f"rank {self.rank}: no queue generation from rank 0")
        self.generation: int = generation[0]
        """This group's trainer generation: its queue writes carry it, its checkpoints record it."""
        self.source.join_generation(self.generation)
        if self.rank == 0:
            self.train_log.truncate_after(self.step)  # lines of updates the checkpoint does not hold
            self.source.agree_with(self.step)  # resumed below the last commit: the queue is reset to the checkpoint
        if dist.is_initialized():
            dist.barrier()  # no rank reads its stream before the queue agrees with the checkpoint
        self.source.progress(self.step)  # a resumed rank: the batcher may write up to `lookahead` past it
        self.committed: CommitRecord | None = next((c for r, c in resumed.commits if r == self.rank), None)
        """This rank's last commit: committed again with the next one (commits are idempotent), so a commit a Redis
        restart lost, or a crash cut off, is made good."""
        if self.step:  # dead letters first (from the checkpoint's copy of their entries), then the commits
            for slot, fields, reason in resumed.dead:
                if self.slots.rank_of(slot) == self.rank:
                    self.source.dead_letter(Delivery(slot, None, fields), reason)
            # this rank stands for the saving group's ranks r with r % world == rank (the same ranks, in a group of
            # the same size)
            self.source.commit(self.step, [(r, c) for r, c in resumed.commits if r % self.world == self.rank])
        self.metrics = trainer_metrics(job.paths.name, self.rank, with_health=self.writes_log)
        self.health = HealthMonitor(job.health, job.heldout_pairs, self.tokenizer, seed=job.seed) \
            if self.writes_log and job.objectives.model_family == "marge" else None
        """Retrieval and evidence probes of g and the decoder: for the MARGE model (a BART run's too)."""
        self.board = RunBoard(job.paths.run_dir, "trainer", job.tensorboard and self.writes_log)
        """Rank 0's TensorBoard writer (run.tensorboard): every update's record."""
        self.uncommitted: list[tuple[int, str]] = []
        """(slot, batch id) this rank trained since the last checkpoint it began."""
        self.interval_start = self.step
        """The update the next checkpoint's interval starts at (the last checkpoint begun, or the one resumed)."""
        self.uncommitted_dead: list[tuple[Delivery, str]] = []
        """Deliveries this rank could not train since the last durable checkpoint, and why."""
        self.prefetcher = Prefetcher(self.read_prepared) if t.prefetch else None
        """Reads and prepares the next update's deliveries while this one trains (trainer.prefetch)."""
        self.last_metrics: dict = {}
        """What rank 0 reports to Ray Train with a checkpoint (step, loss, throughput)."""
        wrapped = ray.train.torch.prepare_model(self.model,
                                                parallel_strategy_kwargs=ddp_settings(self.model, job.objectives))
        if t.bf16_params and isinstance(wrapped, DistributedDataParallel):
            wrapped.register_comm_hook(None, reduce_in_fp32)  # bf16 gradients summed in fp32
        if t.compile:
            compile_cache_env(job.paths.run_dir)
        trainee = Trainee(self.model, compiled(wrapped, t.compile, t.compile_scope, dynamic=t.compile_dynamic),
                          self.optimizer, self.scheduler, self.objectives, t, self.device, slots=self.slots,
                          seed=job.seed, max_steps=job.max_steps, nan_loss_slot=job.faults.nan_loss_slot)
        self.loop = TrainingLoop(trainee, self, self.train_log, self.board,
                                 UpdateMeter(self.model.cfg, device_peak_flops(self.device)))
        if resumed.rng is not None:  # last: a resumed rank draws what the uninterrupted run would have drawn
            set_rng_state(resumed.rng)

    def training_state(self, job: TrainerJob, from_init_weights: bool):
        """(model, optimizer, scheduler) on this rank's device: the run's init weights, or only their model's shape
        (`load_model_shell`) for a checkpoint to be loaded over."""
        t = job.trainer
        base = load_model_weights(job.paths.init_weights).to(self.device) if from_init_weights else \
            load_model_shell(job.paths.init_weights, self.device)  # built where it trains: no host copy per rank
        return training_parts(base, t, job.objectives, job.max_steps)

    def run(self) -> None:
        try:
            self.step = self.loop.run(self.step)
            self.finish_checkpoint()  # the last one's batches count once it is durable
        finally:
            self.board.close()

    # --- the loop's host -----------------------------------------------------------------------------

    def prepare(self, delivery: Delivery) -> PreparedBatch | None:
        """A delivery prepared ahead (None: one the model cannot take, left to the step to dead-letter)."""
        cfg = self.model.cfg
        if delivery.problem is not None or delivery.batch is None or untrainable(
                delivery.batch, self.tokenizer.specials, cfg.vocab_size, cfg.max_positions) is not None:
            return None
        prepared = self.objectives.prepare(delivery.batch, seed_key(self.job.seed, self.slots, delivery.slot))
        return prepared.pin_memory() if self.device.type == "cuda" else prepared

    def read_prepared(self, step: int) -> list[tuple[Delivery, PreparedBatch | None]]:
        """This rank's deliveries of update `step`, each prepared (`deliveries_prepared`), in a prefetch thread."""
        return deliveries_prepared(self.source, self.slots, self.rank, self.prepare, step)

    def next_update(self, step: int) -> UpdateInput | None:
        """This rank's deliveries of update `step`, or None when any rank cannot get its own (all stop)."""
        if self.prefetcher is not None:
            taken = self.prefetcher.take(step)
        else:
            taken = []
            for micro in range(self.slots.grad_accum):
                delivery = self.source.get(self.slots.slot(step, self.rank, micro))
                if delivery is None:
                    break
                taken.append((delivery, None))
        have = len(taken) == self.slots.grad_accum and not self.source.stopping()  # a stop counts at this boundary
        written = self.pending is None or self.pending.write.done()
        ready = torch.tensor([1.0 if have else 0.0, 1.0 if written else 0.0])
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # a host decision on a host tensor (gloo): no device sync
        if self.pending is not None and ready[1].item() == 1:  # every rank's part is durable: its batches count now
            self.finish_checkpoint()
        if ready[0].item() != 1:
            return None  # nothing trained: the same slots are read again later
        if self.prefetcher is not None and step + 1 < self.job.max_steps:
            self.prefetcher.start(step + 1)  # read and prepared while this update trains
        # a prepared delivery passed `untrainable` in `prepare`: the step need not check it again
        return UpdateInput([Item(d.slot, d.batch, d.problem, prepared, checked=prepared is not None)
                            for d, prepared in taken],
                           [d for d, _ in taken])

    def gather(self, part: Any) -> list[Any]:
        """Every rank's `part` on rank 0, the only one that writes them (the log, the checkpoint's small files);
        another rank gets its own alone: what a rank receives does not grow with the world."""
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(part, gathered, dst=0)
        return gathered if gathered is not None else [part]

    def reduce(self, values: torch.Tensor) -> None:
        dist.all_reduce(values)

    def after_update(self, step: int, update: UpdateInput, done: Backward, record: UpdateRecord) -> None:
        by_slot = {d.slot: d for d in update.host_data}
        self.uncommitted_dead.extend((by_slot[slot], f"update {step - 1}: {reason}")
                                     for slot, reason in done.dead_lettered)
        self.step = step
        self.source.progress(step)
        self.uncommitted.extend(done.trained)
        self.tokens_seen += record.target_tokens
        for d in update.host_data:
            if d.batch is not None and d.batch.snapshot_step >= 0:  # batches without an index have none
                self.metrics.observe("marge_batch_staleness_steps", step - 1 - d.batch.snapshot_step)
        self.metrics.inc("marge_batches_trained", len(done.trained))
        if self.job.faults.slow_update_s:  # test-only (marge.contracts.faults): a run slow enough to fault mid-way
            time.sleep(self.job.faults.slow_update_s)

    def snapshot(self, step: int) -> dict:
        if self.job.objectives.needs_index:  # the indexer's input
            publish_snapshot(self.job.paths.snapshots, self.model, step, self.tokenizer.sha256)
        if self.health is None:
            return {}
        health = self.health.measure(self.model, self.device)
        log.info("health at step %d: %s", step, loggable(health))
        return health

    def logged(self, record: UpdateRecord) -> None:
        """Rank 0: the update's gauges, and its record for the driver's progress."""
        self.last_metrics = {"step": record.step, "loss": record.loss, "tokens_per_s": record.tokens_per_s,
                             "target_tokens_per_s": record.target_tokens_per_s, "wait_share": record.wait_share,
                             "elapsed_s": record.elapsed_s, "startup_wait_s": record.startup_wait_s}
        m = self.metrics
        m.set("marge_trainer_loss", record.loss)
        if record.beta:
            m.set("marge_trainer_beta", sum(record.beta) / len(record.beta))
        m.set("marge_trainer_step", record.step)
        m.set("marge_trainer_tokens_per_second", record.tokens_per_s)
        m.set("marge_trainer_wait_share", record.wait_share)
        health = record.health or {}
        for name in HEALTH_GAUGES:
            if name in health:
                m.set(f"marge_{name}", health[name])
        self.source.publish(record.to_dict())

    def fault_point(self, point: str, step: int) -> None:
        """The test-only `faults.crash_in_commit_window`: this rank dies here, once."""
        faults = self.job.faults
        if (faults.crash_in_commit_window, faults.crash_in_commit_window_step, faults.crash_in_commit_window_rank) \
                != (point, step, self.rank):
            return
        marker = self.job.paths.run_dir / "faults" / f"crashed-{point}-{step}-rank{self.rank}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("1")
        log.error("faults.crash_in_commit_window: rank %d dying %s of update %d", self.rank, point.replace("_", " "),
                  step)
        os._exit(17)

    def checkpoint(self, step: int) -> None:
        """Start writing the state (every rank's uncommitted batches and RNG) and go on training; the batches
        count once it is durable (`finish_checkpoint`). A checkpoint still being written is finished first."""
        self.finish_checkpoint()
        if self.writes_log:  # the log's lines of the interval are durable before its batches count (the audit's input)
            self.train_log.sync()
        dead = [(d.slot, d.fields, reason) for d, reason in self.uncommitted_dead]
        # the rank's pairs stay here: the record stands for them
        record = CommitRecord.of(step, self.interval_start, self.uncommitted)
        self.interval_start = step
        gathered = self.gather({"commit": (record.trained, record.digest), "dead": dead, "rng": rng_state()})
        records = IntervalRecords([(r, record.since, *part["commit"]) for r, part in enumerate(gathered)],
                                  [item for part in gathered for item in part["dead"]],
                                  [part["rng"] for part in gathered], self.tokens_seen)
        write = begin_checkpoint(self.rank, step, self.model, self.optimizer, self.scheduler, records, self.job,
                                 WriteSettings(group=self.checkpoint_group, generation=self.generation))
        self.pending = PendingCheckpoint(write, dict(self.last_metrics), record, self.uncommitted_dead)
        self.uncommitted, self.uncommitted_dead = [], []

    def finish_checkpoint(self) -> None:
        """Once the pending checkpoint is complete on every rank (waiting for it if need be): report it, then
        dead-letter this rank's batches it left out and commit the ones it trained. Every rank calls it at the
        same update (a collective)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        step = pending.write.step
        report_checkpoint(self.rank, pending.write, pending.metrics)
        self.fault_point("after_report", step)
        dist.barrier()  # ranks other than 0 return from report before rank 0's report is done: commit after it
        self.fault_point("after_barrier", step)
        for delivery, reason in pending.dead:  # before the commit (their entries are held here, not read again)
            self.source.dead_letter(delivery, reason)
        previous = [(self.rank, self.committed)] if self.committed is not None else []
        self.source.commit(step, previous + [(self.rank, pending.record)])
        self.committed = pending.record


@dataclass
class PendingCheckpoint:
    """A checkpoint being written and what counts once it is durable."""
    write: CheckpointWrite
    metrics: dict
    """What rank 0 reports to Ray Train with it (the metrics of its update)."""
    record: CommitRecord
    """What this rank trained in the checkpoint's interval (how many batches, their digest)."""
    dead: list[tuple[Delivery, str]]
    """Deliveries this rank could not train in the interval, and why."""
