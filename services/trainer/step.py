"""One optimizer update of MARGE, shared by the DDP trainer workers, the in-process reference loop and the
single-process run.

An update consumes `batches_per_step` batches (world size x gradient accumulation): each batch's objective
is scaled by 1/batches_per_step before backward, so summed gradients equal the gradient of the average
loss, whether the batches ran in one process or across DDP ranks (DDP averages across ranks). The
optimizer refuses to step on a non-finite gradient. An update reads the device back once (`run_update`): a GPU
never waits for the host in the middle of a forward, a backward or between them, and with a fused optimizer (the
GPU's) not before the optimizer's step either: the device itself skips a step whose gradient is not finite.

`reference_train` is the baseline the distributed trainer is checked against: the same model,
optimizer, schedule, objectives and batches, in one process, without Ray or Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from marge.contracts.batch import Batch
from marge.contracts.slots import Slots
from marge.model.network import Marge
from marge.model.optim import build_optimizer, has_own_relevance_encoder, lr_factor
from services.trainer.config import COMPILE_SCOPES, TrainerConfig
from services.trainer.inputs import substitute_batch, untrainable
from services.trainer.objectives import Objectives, ObjectivesConfig, PreparedBatch, apply_objective_settings
from services.trainer.precision import bf16_parameters, check_precision, full_precision, stepped_gradients

# Dense bf16 tensor-core peak (FLOP/s) by device name, from the vendors' data sheets: the denominator of MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                   "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None (CPUs, unknown GPUs): MFU is reported only where this is known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


@dataclass
class StepRecord:
    step: int
    loss: float
    """Mean loss of the run's primary objective (marge: NLL per target token) over the update's batches."""
    target_tokens: int
    batch_ids: list[str]
    lr: float
    beta: list[float]
    grad_norm: float
    seconds: float
    index_versions: list[int] = field(default_factory=list)
    snapshot_steps: list[int] = field(default_factory=list)
    objectives: dict[str, float] = field(default_factory=dict)
    """Each objective's mean loss over the update's batches."""
    dead_lettered: list[tuple[int, str]] = field(default_factory=list)
    """(slot, reason) of the batches that could not be trained."""


def apply_execution_settings(model: nn.Module, cfg: TrainerConfig) -> nn.Module:
    """The trainer's settings that change how the model computes, not what: the loss's chunking over the
    vocabulary (`trainer.loss_chunk_tokens`; a model without a chunked loss, VECO's, ignores it), how attention
    adds a key bias (`trainer.key_bias`) and whether it may use cuDNN's kernel (`trainer.cudnn_attention`, a
    setting of the process)."""
    from marge.model.layers import Attention

    torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
    if hasattr(model, "loss_chunk_tokens"):
        setattr(model, "loss_chunk_tokens", cfg.loss_chunk_tokens)  # an int attribute, which Module's typing cannot say
    for module in model.modules():
        if isinstance(module, Attention):
            module.key_bias = cfg.key_bias
    return model


DDP_SETTINGS = {"broadcast_buffers": False, "gradient_as_bucket_view": True}
"""How DDP wraps the trainer's model (`ray.train.torch.prepare_model`'s DDP arguments). No buffer broadcast: by
default DDP copies rank 0's buffers over every rank's at each forward (a collective per micro-batch, before any
compute), and the model's only buffer, the running centre of g, is not an input of the training forward (which
centres on the batch's own mean); the loop averages it over the ranks once per update instead
(`loop.share_relevance_center`). Gradients as views of the all-reduce buckets: no copy of every gradient into the
buckets and back, and one gradient-sized buffer less. Left at their defaults: the 25 MB bucket size (not measured
on a multi-GPU node) and `static_graph` (the denoising loss runs g outside DDP's forward, so the graph DDP sees
is not the whole backward)."""


def ddp_settings(model: nn.Module, objectives: ObjectivesConfig) -> dict:
    """DDP_SETTINGS for this model and objectives, with `find_unused_parameters` where an update can leave
    parameters without a gradient: g's own encoder (`model.own_relevance_encoder`) while f is detached
    (`objectives.marge.detach_relevance`, or before `detach_relevance_until`) and no loss on g reaches it. Without
    it DDP stops the second update ("parameters that did not receive grad"). Only there, since finding them walks
    the autograd graph every update; with a loss on g (the denoising loss, the distillation) g gets a gradient in
    every update anyway."""
    own = has_own_relevance_encoder(model)
    marge = objectives.marge
    detached_some_update = marge is not None and (marge.detach_relevance or marge.detach_relevance_until > 0)
    g_loss = objectives.denoising_contrastive is not None or objectives.relevance_distillation is not None
    return {**DDP_SETTINGS, "find_unused_parameters": bool(own and detached_some_update and not g_loss)}


def compiled(model: nn.Module, enabled: bool, scope: str = "layers", backend: str = "inductor",
             dynamic: bool = True) -> nn.Module:
    """The model (or its DDP wrapper) to train with (`trainer.compile`, `trainer.compile_scope`,
    `trainer.compile_dynamic`).

    `layers` (regional): each repeated layer (every member of an nn.ModuleList: the encoder's, the decoders') is
    compiled on its own, in place, with `fullgraph=True` (a graph break is an error, not a silent split); layers of
    one kind share their graphs, so a cold compile costs one layer of each kind, not the whole stack, and DDP's hooks
    stay outside every graph. The loss head (`projected_nll`: the tied output projection's cast, log-softmax and NLL
    over every row) is compiled too, where gradients are on. Only the training forward is compiled: in eval mode
    (probes, snapshots, generation) a layer runs eagerly. `model`: the whole model or wrapper under `torch.compile` (DDP's buckets split its graph).
    `dynamic`: shapes traced as symbols (a few graphs for every batch size: the real-token count and the row widths
    vary every batch) or as constants (a graph per shape, what CUDA graphs need: only where shapes are bounded). The
    parameters, buffers and attributes stay the model's own."""
    if not enabled:
        return model
    if scope == "model":  # a Module compiles to a Module
        return cast(nn.Module, torch.compile(model, dynamic=dynamic, backend=backend))
    if scope != "layers":
        raise ValueError(f"trainer.compile_scope {scope!r} is not one of {COMPILE_SCOPES}")
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for layer in module:
                compile_training_forward(layer, backend, dynamic)
        head = getattr(module, "projected_nll", None)
        if callable(head):  # the loss head, between the layers and the optimizer
            setattr(module, "projected_nll", compiled_while_training(head, backend, dynamic))
    return model


def compile_training_forward(layer: nn.Module, backend: str = "inductor", dynamic: bool = True) -> None:
    """`layer`'s forward through torch.compile while it trains, eagerly in eval mode."""
    eager = layer.forward
    fast = torch.compile(eager, dynamic=dynamic, fullgraph=True, backend=backend)

    def forward(*args, **kwargs):
        return (fast if layer.training else eager)(*args, **kwargs)

    layer.forward = forward


def compiled_while_training(function: Callable, backend: str = "inductor", dynamic: bool = True) -> Callable:
    """`function` through torch.compile where gradients are on (a training step), eagerly where they are off
    (probes, snapshots, generation: other shapes, which a static compile would compile again)."""
    fast = torch.compile(function, dynamic=dynamic, fullgraph=True, backend=backend)

    def either(*args, **kwargs):
        return (fast if torch.is_grad_enabled() else function)(*args, **kwargs)

    either.__wrapped__ = function  # type: ignore[attr-defined]
    return either


def compile_cache_env(run_dir: Path) -> dict[str, str]:
    """Where torch.compile keeps what it compiled (Inductor's FX graph and kernel caches, Triton's kernels): under
    the run's folder, so that a restarted or resumed rank reuses them instead of compiling again. Set in this
    process's environment unless already set; returns what was set."""
    chosen = {"TORCHINDUCTOR_CACHE_DIR": str(Path(run_dir) / "compile-cache" / "inductor"),
              "TRITON_CACHE_DIR": str(Path(run_dir) / "compile-cache" / "triton")}
    set_now = {key: value for key, value in chosen.items() if key not in os.environ}
    os.environ.update(set_now)
    return set_now


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig,
                    max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    total = cfg.schedule_steps(max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total))


def training_parts(base: nn.Module, trainer: TrainerConfig, objectives: ObjectivesConfig,
                   max_steps: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """(model, optimizer, scheduler) a host trains, before a checkpoint is restored into them: `base` with the
    trainer's execution settings and the objectives' (`apply_execution_settings`, `apply_objective_settings`), its
    optimizer and its schedule. The same on a DDP rank and in the single process; bf16 parameters
    (`trainer.bf16_params`) are made after the restore, which writes the fp32 masters."""
    model = apply_objective_settings(apply_execution_settings(base, trainer), objectives)
    optimizer = build_optimizer(model, trainer)
    return model, optimizer, build_scheduler(optimizer, trainer, max_steps)


def forward_backward(model: nn.Module, objectives: Objectives, prepared: PreparedBatch, scale: float,
                     device: torch.device, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The objectives of one prepared batch, backpropagated with weight `scale`.

    Returns (the primary objective's loss, target tokens, each objective's loss), as tensors still on the device."""
    losses = objectives.losses(model, prepared, device, bf16)
    (losses.objective * scale).backward()
    return losses.parts[objectives.primary], losses.target_tokens, losses.parts


@dataclass
class Item:
    """One batch of an update, as its rank sees it: its slot, the batch (None when it could not be decoded) and
    why it cannot be trained if that is known before the forward."""

    slot: int
    batch: Batch | None
    problem: str | None = None
    prepared: PreparedBatch | None = None
    """Prepared beforehand (`Objectives.prepare` with this slot's key), e.g. by a prefetching thread."""
    checked: bool = False
    """`untrainable` has already judged the batch: `problem` is its verdict (None: trainable). The check costs
    milliseconds a batch; done where the batch is prepared, it stays off the update's critical path."""


@dataclass
class Backward:
    """What one rank's part of an update did: which slots it trained, and their figures as device tensors (read
    back once per update, by `PackedFigures.read`)."""

    trained: list[tuple[int, str]] = field(default_factory=list)
    losses: list[dict] = field(default_factory=list)
    """Per trained batch: each objective's loss."""
    target_tokens: list = field(default_factory=list)
    objective: list = field(default_factory=list)
    """Per trained batch: the weighted objective that was backpropagated (its finiteness decides a second pass)."""
    dead_lettered: list[tuple[int, str]] = field(default_factory=list)
    """(slot, reason) of the batches that could not be trained."""


@dataclass
class Trainee:
    """What an update trains, and with what: built once by each host (a DDP rank, the single process) and given to
    every update (`run_update`; `services.trainer.loop` runs one after another), or built for one process outside
    the pipeline (`Trainee.in_process`: the reference loop, `marge plan --measure`, the benchmarks)."""

    model: nn.Module
    """The model itself: its config, snapshots and probes read it."""
    trained: nn.Module
    """What the updates run: the model, under DDP and/or torch.compile."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    objectives: Objectives
    cfg: TrainerConfig
    device: torch.device
    slots: Slots | None = None
    """The run's slot layout, which numbers the host's batches; None only for one process outside the pipeline
    (`Trainee.in_process`), whose updates `train_step` numbers 0 .. n-1 (`run_update` refuses a trainee without)."""
    seed: int = 0
    max_steps: int = 0
    """Where the training loop stops (`TrainingLoop` refuses 0; `train_step` does not read it)."""
    nan_loss_slot: int | None = None
    """Test-only fault (marge.contracts.faults): this slot's loss is made NaN."""

    @classmethod
    def in_process(cls, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, objectives: Objectives,
                   cfg: TrainerConfig, device: torch.device, seed: int = 0) -> "Trainee":
        """`model` trained in this process (as it is given: itself, or under torch.compile), its updates numbered by
        `train_step`."""
        return cls(getattr(model, "_orig_mod", model), model, optimizer, scheduler, objectives, cfg, device, seed=seed)


def seed_key(seed: int, slots: Slots, slot: int) -> tuple[int, int, int]:
    """What seeds a batch's preparation: (run seed, update, position in the update). The same on a DDP rank, in
    the reference loop and in the single process."""
    return seed, slots.step_of(slot), slot % slots.per_step


def backward_items(t: Trainee, items: list[Item], excluded: dict[int, str] | None = None) -> Backward:
    """Backpropagate a rank's batches of one update, each with weight 1/len(items), reading nothing back from the
    device.

    A batch the model cannot take (undecodable, a token outside the vocabulary, ...; known on the host), or one in
    `excluded` (slot -> reason: a batch whose loss was not finite in a first pass), is not trained: a zero-weight
    stand-in batch takes its place, so that a DDP rank makes the same forwards and collectives as the others, and it
    is returned in `dead_lettered` with the reason. A loss that is not finite is backpropagated like any other: the
    update's gradient is then not finite, which `run_update` sees in its one read of the update's figures."""
    model, objectives, cfg, device, specials = t.trained, t.objectives, t.cfg, t.device, t.objectives.specials
    if t.slots is None:
        raise ValueError("the trainee has no slot layout to number its batches by: give Trainee(slots=...) the run's "
                         "slots, or train in one process through train_step, which numbers its update's batches")
    model_cfg, slots = cast(Any, t.model).cfg, t.slots
    out = Backward()
    for i, item in enumerate(items):
        key = seed_key(t.seed, slots, item.slot)
        batch = item.batch
        if not item.checked and not item.problem:
            if batch is None:  # a batch that could not be decoded comes with its problem (Item)
                raise ValueError(f"slot {item.slot}: no batch, and no problem saying why")
            item.problem = untrainable(batch, specials, model_cfg.vocab_size, model_cfg.max_positions)
            item.checked = True  # a second pass over the update does not check it again
        problem = item.problem or (excluded or {}).get(item.slot)
        with maybe_no_sync(model, i < len(items) - 1):
            if problem is None:
                if batch is None:  # (cannot be: a batch-less item has its problem, checked above)
                    raise ValueError(f"slot {item.slot}: no batch, and no problem saying why")
                item.prepared = item.prepared or objectives.prepare(batch, key)  # kept for a second pass
                losses = objectives.losses(model, item.prepared, device, cfg.autocast)
                if item.slot == t.nan_loss_slot:  # test-only fault (marge.contracts.faults)
                    losses.objective = losses.objective * float("nan")
                (losses.objective / len(items)).backward()
                out.trained.append((item.slot, batch.batch_id))
                out.losses.append(losses.parts)
                out.target_tokens.append(losses.target_tokens)
                out.objective.append(losses.objective.detach())
                continue
            out.dead_lettered.append((item.slot, problem))
            substitute = objectives.prepare(substitute_batch(specials), key)
            (objectives.losses(model, substitute, device, cfg.autocast).objective * 0.0).backward()
    return out


class NonFiniteGradient(RuntimeError):
    pass


def gradient_norm(model: nn.Module, clip_norm: float, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """The gradient's total norm as a device tensor (no host read), the gradient clipped to `clip_norm` first: of
    the parameters `optimizer` steps (with bf16 parameters their fp32 masters, the gradients copied in first:
    `services.trainer.precision.stepped_gradients`)."""
    params = stepped_gradients(model, optimizer)
    if clip_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip_norm)
    return torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params if p.grad is not None]))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the device itself can skip `optimizer.step()` when the gradient is not finite: torch's fused
    optimizers (`build_optimizer`'s on CUDA) read a `found_inf` flag inside their kernel, as under
    `torch.amp.GradScaler`. The for-each and per-tensor ones do not: the host reads the gradient norm and decides."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless_not_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """`optimizer.step()`, skipped on the device when `grad_norm` is not finite, with nothing read back: the fused
    kernel returns without touching a parameter or a moment, and puts back the step counters it advanced. Only for
    an optimizer that `skips_on_device`."""
    # a 0-d flag: the kernel subtracts it from each parameter's 0-d step counter
    setattr(optimizer, "found_inf", (~torch.isfinite(grad_norm.detach())).to(torch.float32).reshape(()))
    try:
        optimizer.step()
    finally:
        delattr(optimizer, "found_inf")  # for this step only, as GradScaler does: a later step reads no stale flag


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, clip_norm: float) -> float:
    """Clip, step, schedule (for loops outside the pipeline's updates: the benchmarks). The gradient norm is read
    after the step where the device skips a non-finite one (`skips_on_device`), before it otherwise."""
    norm = gradient_norm(model, clip_norm, optimizer)
    on_device = skips_on_device(optimizer)
    if on_device:
        step_unless_not_finite(optimizer, norm)
    grad_norm = float(norm)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradient("loss or gradient is not finite; stopping before the optimizer update "
                                "(lower trainer.lr, or turn trainer.bf16 off)")
    if not on_device:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def read_to_host(values: torch.Tensor) -> list[float]:
    """The one device-to-host read of an update: every figure it needs, packed into one tensor."""
    return values.to("cpu").tolist()


@dataclass
class UpdateFigures:
    """An update's figures, read from the device in one copy."""

    grad_norm: float
    objective: list[float]
    """Per trained batch."""
    losses: list[dict[str, float]]
    target_tokens: list[int]
    beta: list[float]
    extra: dict[str, list[float]]
    """What the caller asked to read with them (the DDP loop: its all-reduced statistics)."""


@dataclass
class PackedFigures:
    """An update's figures packed into one device tensor (nothing read yet), and where each one lies in it."""

    flat: torch.Tensor
    names: list[list[str]]
    """Per trained batch: its objectives, in the order they were packed."""
    batches: int
    beta: int
    """How many values beta has (0: no beta)."""
    extra: dict[str, int]

    def read(self) -> UpdateFigures:
        """The figures, read back in one copy (`read_to_host`)."""
        flat = read_to_host(self.flat)
        at = 1
        objective = flat[at:at + self.batches]
        at += self.batches
        losses = []
        for keys in self.names:
            losses.append(dict(zip(keys, flat[at:at + len(keys)])))
            at += len(keys)
        target_tokens = [int(v) for v in flat[at:at + self.batches]]
        at += self.batches
        beta = flat[at:at + self.beta]
        at += self.beta
        extra = {}
        for name, size in self.extra.items():
            extra[name] = flat[at:at + size]
            at += size
        return UpdateFigures(flat[0], objective, losses, target_tokens, beta, extra)


def pack_figures(done: Backward, grad_norm: torch.Tensor, beta: torch.Tensor | None,
                 extra: dict[str, torch.Tensor]) -> PackedFigures:
    """`done`'s device figures, the gradient norm, beta (its value now: packing copies it) and `extra`, in one
    float64 tensor on the device, with no host read."""
    names = [sorted(parts) for parts in done.losses]
    pieces: list[torch.Tensor] = [grad_norm.detach().reshape(1)]
    pieces += [o.reshape(1) for o in done.objective]
    pieces += [parts[n].detach().reshape(1) for parts, keys in zip(done.losses, names) for n in keys]
    pieces += [torch.as_tensor(t).reshape(1) for t in done.target_tokens]
    if beta is not None:
        pieces.append(beta.detach().reshape(-1))
    pieces += [v.detach().reshape(-1) for v in extra.values()]
    device = grad_norm.device
    flat = torch.cat([p.to(device=device, dtype=torch.float64) for p in pieces])
    return PackedFigures(flat, names, len(done.objective), beta.numel() if beta is not None else 0,
                         {name: value.numel() for name, value in extra.items()})


def run_update(t: Trainee, items: list[Item], figures: Callable[[Backward], dict[str, torch.Tensor]] | None = None
               ) -> tuple[Backward, UpdateFigures]:
    """One optimizer update of a rank's `items`, with one read of the device (`PackedFigures.read`) on its way.

    Forward and backward of every batch, then the update's figures (gradient norm, each batch's objective and
    losses, target tokens, beta and what `figures(done)` adds; the DDP loop: its statistics, all-reduced) are packed
    on the device and read back in one copy; the optimizer steps when the gradient is finite. With a fused optimizer
    (`skips_on_device`: the GPU's) the step comes before the read, skipped by the device itself when the gradient
    is not finite, so the host never holds the device up to decide; otherwise the host reads, then steps. When the
    gradient is not finite because some batch's loss was not finite (`figures` may give the count over all ranks as
    `nonfinite_losses`, so that every DDP rank takes the same path), the update is computed again without those
    batches (they are dead-lettered): a second read, only then, the first step having been skipped. A gradient
    still not finite skips the update: its place in the schedule is used up and its batches are dead-lettered."""
    optimizer = t.optimizer
    check_precision(t.cfg.bf16_params, optimizer)
    beta = getattr(t.model, "beta", None)
    beta = None if beta is None else full_precision(beta)  # bf16 parameters: the optimizer's fp32 value
    steps_first = skips_on_device(optimizer)

    def backward_and_read(excluded):
        done = backward_items(t, items, excluded)
        extra = figures(done) if figures else {}
        grad_norm = gradient_norm(t.trained, t.cfg.clip_norm, optimizer)
        packed = pack_figures(done, grad_norm, beta, extra)  # beta as this update's forwards saw it
        if steps_first:
            step_unless_not_finite(optimizer, grad_norm)
        return done, packed.read()

    done, read = backward_and_read(None)
    nonfinite = read.extra.get("nonfinite_losses", [sum(not math.isfinite(o) for o in read.objective)])[0]
    if not math.isfinite(read.grad_norm) and nonfinite > 0:
        excluded = {slot: f"non-finite loss ({value}) on batch {batch_id}"
                    for (slot, batch_id), value in zip(done.trained, read.objective) if not math.isfinite(value)}
        optimizer.zero_grad(set_to_none=True)  # (a step already taken was skipped on the device: nothing to undo)
        done, read = backward_and_read(excluded)
    if math.isfinite(read.grad_norm):
        if not steps_first:
            optimizer.step()
    else:
        done.dead_lettered.extend((slot, "non-finite gradient; update skipped") for slot, _ in done.trained)
        done.trained.clear()
        read.objective.clear()
        read.losses.clear()
        read.target_tokens.clear()
    t.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return done, read


def train_step(t: Trainee, batches: list[Batch], step: int, prepared: list[PreparedBatch] | None = None) -> StepRecord:
    """One optimizer update on `batches` in this process: the reference loop's, `marge plan --measure`'s and the
    benchmarks' step (the DDP ranks and the single process run `run_update` through `services.trainer.loop`).

    Batch k of the list takes slot step * len(batches) + k (rank * grad_accum + micro-step on the DDP ranks),
    so its preparation and its 1/len(batches) share of the gradient are what the DDP trainer gives it.
    `prepared` are the batches already prepared that way (`Objectives.prepare`), e.g. by a prefetching thread.
    """
    t0 = time.perf_counter()
    slots = Slots(1, len(batches))
    items = [Item(slots.slot(step, 0, k), b, None, prepared[k] if prepared else None) for k, b in enumerate(batches)]
    lr = t.optimizer.param_groups[0]["lr"]
    done, read = run_update(dataclasses.replace(t, slots=slots), items)
    objectives = t.objectives
    parts = {name: sum(p[name] for p in read.losses) / len(read.losses) for name in read.losses[0]} \
        if read.losses else {objectives.primary: float("nan")}
    return StepRecord(step, parts[objectives.primary], sum(read.target_tokens), [b.batch_id for b in batches], lr,
                      read.beta, read.grad_norm, time.perf_counter() - t0, [b.index_version for b in batches],
                      [b.snapshot_step for b in batches], parts, done.dead_lettered)


def reference_train(model: Marge, step_batches: Iterable[list[Batch]], objectives: Objectives, cfg: TrainerConfig,
                    max_steps: int, device: str | torch.device = "cpu", seed: int = 0,
                    start_step: int = 0) -> list[StepRecord]:
    """Train in this process on the given batches, one list of batches per optimizer step."""
    device = torch.device(device)
    apply_objective_settings(model.to(device).train(), objectives.cfg)
    optimizer = build_optimizer(model, cfg)
    if cfg.bf16_params:
        bf16_parameters(model, optimizer)
    scheduler = build_scheduler(optimizer, cfg, max_steps)
    trainee = Trainee.in_process(model, optimizer, scheduler, objectives, cfg, device, seed)
    return [train_step(trainee, batches, step) for step, batches in enumerate(step_batches, start=start_step)]


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, skip_sync: bool):
    """Inside gradient accumulation, DDP need not all-reduce until the last micro-batch."""
    if skip_sync and hasattr(model, "no_sync"):
        with cast(DistributedDataParallel, model).no_sync():  # only DDP has no_sync
            yield
    else:
        yield
