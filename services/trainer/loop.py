"""The training loop around the step, written once for both hosts: a DDP rank of the pipeline
(`services.trainer.rank`) and the single process (`services.driver.single_process`).

Each update s, told top to bottom in `TrainingLoop.run`:

    next batches  `host.next_update(s)`: the batches of update s this process trains (a DDP rank: its slots from
                  its source, once every rank has its own; the single process: every slot, prefetched), or None
                  when the run must stop (stop asked, time up)
    update        `run_update` (services.trainer.step): forward and backward of every batch, the optimizer step
                  (with the GPU's fused optimizer, skipped on the device when the gradient is not finite), then the
                  update's figures read from the device in one copy (the statistics summed over the ranks on the
                  device first): the host never holds the device up between the backward and the step; a batch
                  that cannot be trained is left out with the reason
    record        the update's `UpdateRecord` (marge.contracts.train_log) over every rank (`host.gather`)
    after         `host.after_update`: what the host keeps until the next checkpoint makes it count
    snapshot      every `trainer.snapshot_every` updates the writer (rank 0; the single process) publishes g and
                  measures retrieval health (`host.snapshot`), and the share of g's gradient that flows through f
                  on the batches just trained (`services.trainer.gradient_paths`)
    log           the writer appends the record to train_log.jsonl and TensorBoard; `host.logged` (gauges, progress)
    checkpoint    every `trainer.checkpoint_every` updates, at the last update and when the loop stops early:
                  `host.checkpoint` (on DDP a collective: every rank takes part)

What differs between the hosts is behind `LoopHost`: where batches come from, how figures cross ranks, what a
snapshot triggers (the pipeline's indexer builds on its own; the single process builds the index in line) and
how a checkpoint is made durable (Ray Train's report and the queue's commit; a folder in the run).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from marge.contracts.train_log import TrainLog, UpdateRecord
from marge.eval.tensorboard import RunBoard
from marge.model.sizes import training_flops, training_flops_per_token
from marge.model.veco import VecoConfig, veco_training_flops_per_token
from services.trainer.gradient_paths import gradient_paths
from services.trainer.step import Backward, Item, Trainee, UpdateFigures, run_update

log = logging.getLogger(__name__)


@dataclass
class UpdateInput:
    """The batches of one update this process trains, and what the host needs back about them."""

    items: list[Item]
    host_data: Any = None
    """The host's own (a DDP rank: the deliveries, for commits and dead letters)."""


class LoopHost(Protocol):
    writes_log: bool
    """This process writes the train log, snapshots and health (DDP rank 0; the single process)."""

    def next_update(self, step: int) -> UpdateInput | None:
        """The batches of update `step`, waiting for them; None: stop (on DDP every rank stops together)."""

    def gather(self, part: list) -> list[list]:
        """Every process's `part`, in rank order, on the process that writes the log; elsewhere `[part]` (one
        process: `[part]`)."""

    def reduce(self, values: torch.Tensor) -> None:
        """Sum `values` over the processes, in place, on its device (one process: nothing to do)."""

    def after_update(self, step: int, update: UpdateInput, done: Backward, record: UpdateRecord) -> None:
        """Update `step` is trained: keep what the next checkpoint makes count."""

    def snapshot(self, step: int) -> dict:
        """Writer only, every `snapshot_every` updates: publish g (with an index) and return retrieval health."""

    def logged(self, record: UpdateRecord) -> None:
        """Writer only: the record is in the train log (gauges, progress lines)."""

    def checkpoint(self, step: int) -> None:
        """Make the training state of update `step` durable."""


@dataclass
class UpdateMeter:
    """Tokens per second, the share of time spent waiting for batches, and model FLOPs utilisation.

    The clock starts when the first update's batches are in hand: the wait for the very first index (start-up) is
    `startup_wait_s`, not steady-state waiting. MFU divides the FLOPs of every pass this process's updates made
    (augmented copies included: `Objectives.work`) by the updates' own time, not the wall clock (probes,
    snapshots, index builds and checkpoints between updates are not the trainer's work), and by the device's peak
    (`peak_flops`: known GPUs only)."""

    model_cfg: Any
    peak_flops: float | None = None
    started: float | None = None
    startup_wait_s: float = 0.0
    wait_s: float = 0.0
    updates: int = 0
    tokens: int = 0
    target_tokens: int = 0
    step_seconds: float = 0.0
    flops: float = 0.0
    _is_veco: bool = field(init=False)

    def __post_init__(self):
        self._is_veco = isinstance(self.model_cfg, VecoConfig)

    def waited(self, seconds: float) -> None:
        if self.started is None:
            self.startup_wait_s += seconds
            self.started = time.perf_counter()
        else:
            self.wait_s += seconds

    def add(self, record: UpdateRecord, local_target_tokens: int, work: dict[str, int] | None) -> None:
        self.updates += 1
        self.tokens += record.tokens
        self.target_tokens += record.target_tokens
        self.step_seconds += record.step_seconds
        if self.peak_flops is None:
            return
        if self._is_veco:  # target tokens = the pairs' text, each read by 4 passes (counted in the per-token FLOPs)
            self.flops += local_target_tokens * veco_training_flops_per_token(self.model_cfg)
        elif work is not None:
            self.flops += training_flops(self.model_cfg, work["target"], work["evidence"], work["relevance"])
        else:
            self.flops += local_target_tokens * training_flops_per_token(self.model_cfg)

    def rates(self) -> dict:
        elapsed = max(time.perf_counter() - (self.started or time.perf_counter()), 1e-9)
        out = {"tokens_per_s": self.tokens / elapsed, "target_tokens_per_s": self.target_tokens / elapsed,
               "wait_share": self.wait_s / elapsed, "elapsed_s": elapsed, "startup_wait_s": self.startup_wait_s}
        if self.peak_flops:
            out["mfu"] = self.flops / max(self.step_seconds, 1e-9) / self.peak_flops
        return out


class TrainingLoop:
    """Updates from `step` until `trainee.max_steps` or until the host says stop (see the module docstring)."""

    def __init__(self, trainee: Trainee, host: LoopHost, train_log: TrainLog, board: RunBoard, meter: UpdateMeter):
        if trainee.slots is None or trainee.max_steps < 1:
            raise ValueError(f"a training loop needs the run's slots and its last update, got slots {trainee.slots} "
                             f"and max_steps {trainee.max_steps}")
        self.t, self.host, self.train_log, self.board, self.meter = trainee, host, train_log, board, meter
        self.names = list(trainee.objectives.part_names)

    def run(self, step: int) -> int:
        """Train from update `step`; returns the number of updates done when it stopped."""
        t, host = self.t, self.host
        last_checkpoint = step
        while step < t.max_steps:
            t_wait = time.perf_counter()
            update = host.next_update(step)
            self.meter.waited(time.perf_counter() - t_wait)
            if update is None:
                log.info("stopping at update %d (stop requested or time up)", step)
                break
            t_step = time.perf_counter()
            lr = t.optimizer.param_groups[0]["lr"]
            done, read = run_update(
                t, update.items, figures=lambda done: update_statistics(update.items, done, self.names, t.device,
                                                                        host.reduce))
            share_relevance_center(t.model, host.reduce)
            seconds = time.perf_counter() - t_step
            step += 1
            record = self.update_record(step, update, done, read, lr, seconds)
            self.meter.add(record, sum(read.target_tokens), self.work(update, done))
            host.after_update(step, update, done, record)
            if host.writes_log:
                record.time = time.time()
                for name, value in self.meter.rates().items():
                    setattr(record, name, value)
                if step % t.cfg.snapshot_every == 0:
                    record.health = {**host.snapshot(step), **self.gradient_paths(update, done)} or None
                self.train_log.append(record)
                self.board.step(record)
                host.logged(record)
            if step % t.cfg.checkpoint_every == 0 or step >= t.max_steps:
                host.checkpoint(step)
                last_checkpoint = step
        if step > last_checkpoint:  # stopped early: still checkpoint the last completed update
            host.checkpoint(step)
        return step

    def update_record(self, step: int, update: UpdateInput, done: Backward, read: UpdateFigures, lr: float,
                      seconds: float) -> UpdateRecord:
        """The update over every rank: every rank's slots and batches (gathered), the mean loss of the primary
        objective and of each objective over the batches trained, and token counts (from the statistics every rank
        read back with the update's figures)."""
        kept = {slot for slot, _ in done.trained}
        stats = read.extra["stats"]
        names = self.names
        skipped = not math.isfinite(read.grad_norm)  # every rank skipped it: no batch of it counts
        means = {name: float("nan") if skipped else stats[2 + i] / max(1.0, stats[2 + len(names) + i])
                 for i, name in enumerate(names)}
        mine = [(item.slot, item.batch.batch_id if item.batch else None,
                 item.batch.index_version if item.batch else -1, item.batch.snapshot_step if item.batch else -1,
                 item.slot in kept) for item in update.items]
        flat = sorted(entry for part in self.host.gather(mine) for entry in part)
        snapshot_steps = [s for _, _, _, s, _ in flat if s >= 0]
        return UpdateRecord(
            step=step, loss=means[self.t.objectives.primary], objectives=means, lr=lr, grad_norm=read.grad_norm,
            beta=read.beta, slots=[n for n, *_ in flat], batch_ids=[b for _, b, *_ in flat],
            dead_lettered=[n for n, _, _, _, ok in flat if not ok],
            index_versions=sorted({v for _, _, v, _, _ in flat if v >= 0}),
            snapshot_steps=sorted(set(snapshot_steps)),
            staleness_max=max((step - 1 - s for s in snapshot_steps), default=0), step_seconds=seconds,
            tokens=0 if skipped else int(stats[0]), target_tokens=0 if skipped else int(stats[1]))

    def gradient_paths(self, update: UpdateInput, done: Backward) -> dict[str, float]:
        """The share of g's gradient that flows through f, on the batches this process just trained
        (`services.trainer.gradient_paths`; nothing is applied)."""
        kept = {slot for slot, _ in done.trained}
        prepared = [item.prepared for item in update.items if item.slot in kept and item.prepared is not None]
        return gradient_paths(self.t.model, self.t.objectives, prepared, self.t.device, self.t.cfg.autocast)

    def work(self, update: UpdateInput, done: Backward) -> dict[str, int] | None:
        """The passes this process's trained batches made (MFU's numerator), when MFU is measured."""
        if self.meter.peak_flops is None:
            return None
        kept = {slot for slot, _ in done.trained}
        prepared = [item.prepared for item in update.items if item.slot in kept and item.prepared is not None]
        if not prepared:
            return None
        works = [self.t.objectives.work(p) for p in prepared]
        return {k: sum(w[k] for w in works) for k in ("target", "evidence", "relevance")}


def share_relevance_center(model: nn.Module, reduce: Callable[[torch.Tensor], None]) -> None:
    """Every process's running centre of g (`Marge.relevance_center`) replaced by their mean, once per update: DDP
    broadcasts no buffers (`step.DDP_SETTINGS`), so each rank moves its own centre towards its own batches' mean g,
    and this keeps them one (the mean over every rank's batches, where rank 0's alone was published before). The
    sum carries a 1 per process to divide by; on the device, with no host read."""
    center = getattr(model, "relevance_center", None)
    if center is None or not getattr(model.cfg, "relevance_centering", False):
        return
    summed = torch.cat([center.to(torch.float64), torch.ones(1, dtype=torch.float64, device=center.device)])
    reduce(summed)
    with torch.no_grad():
        center.copy_((summed[:-1] / summed[-1]).to(center.dtype))


def update_statistics(items: list[Item], done: Backward, names: list[str], device: torch.device | str,
                      reduce: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
    """This process's part of an update's statistics, summed over the processes on the model's device by `reduce`
    (no host read: they come back with the update's other figures): `stats` = [evidence + target tokens, target
    tokens, each objective's loss summed over the trained batches, each objective's count of batches], and the count
    of batches whose objective was not finite (`nonfinite_losses`, which makes every rank agree on a second pass)."""
    kept = {slot for slot, _ in done.trained}
    zero = torch.zeros((), dtype=torch.float64, device=device)
    # host numbers enter as fills made on the device, never as host tensors copied over: a copy from pageable host
    # memory waits for every kernel queued before it, which would stall the host at the end of each update
    def filled(value: float) -> torch.Tensor:
        return torch.full((1,), value, dtype=torch.float64, device=device)

    # a trained slot's item has its batch: one without is set aside, never trained
    cost = filled(float(sum(i.batch.cost_tokens() for i in items if i.slot in kept and i.batch is not None)))
    counts = [filled(float(sum(1 for p in done.losses if n in p))) for n in names]
    target = sum((torch.as_tensor(n, device=device).to(torch.float64) for n in done.target_tokens), zero)
    sums = [sum((p[n].to(torch.float64) for p in done.losses if n in p), zero) for n in names]
    nonfinite = sum(((~torch.isfinite(o)).to(torch.float64) for o in done.objective), zero)
    stats = torch.cat([cost, target.reshape(1), torch.stack(sums), *counts, nonfinite.reshape(1)])
    reduce(stats)  # on the model's device: NCCL's own on GPUs
    return {"stats": stats[:-1], "nonfinite_losses": stats[-1:]}
