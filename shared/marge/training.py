"""One optimizer step of MARGE, shared by the in-process reference loop and the DDP trainer workers.

A step consumes `batches_per_step` batches (world size x gradient accumulation): each batch's mean
token loss is scaled by 1/batches_per_step before backward, so summed gradients equal the gradient of
the average loss, whether the batches ran in one process or across DDP ranks (DDP averages across
ranks). The optimizer refuses to step on a non-finite gradient.

`reference_train` is the baseline the distributed trainer is checked against: the same model,
optimizer, schedule and batches, in one process, without Ray or Redis.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

import numpy as np

from marge.augment import SelfEvidence, with_self_evidence
from marge.batch import Batch, ModelInputs, SpecialTokens, to_model_inputs
from marge.model import Marge

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate (paper: 1e-4 first, 2e-4 later; smaller at first for stability, footnote 3)."""
    warmup_steps: int = 100
    """Linear warm-up steps (paper: 10k)."""
    total_steps: int = 1000
    """The rate anneals linearly to 0 at this step (paper: linear annealing to 0)."""
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-6
    clip_norm: float = 1.0
    """Gradient-norm clipping (0 turns it off)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"trainer.lr must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("trainer.warmup_steps must be >= 0 and trainer.total_steps >= 1")
        if self.clip_norm < 0:
            raise ValueError("trainer.clip_norm must be >= 0")


@dataclass
class StepRecord:
    step: int
    loss: float
    target_tokens: int
    batch_ids: list[str]
    lr: float
    beta: list[float]
    grad_norm: float
    seconds: float
    index_versions: list[int] = field(default_factory=list)
    snapshot_steps: list[int] = field(default_factory=list)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, LayerNorms, embeddings and beta.

    On CUDA it is the fused kernel (one launch for every parameter instead of several per tensor); on CPU
    the default for-each implementation, whose results the fused one matches to rounding.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim == 2 and "embed" not in name and "positions" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, fused=on_cuda or None)


# Dense bf16 tensor-core peak (FLOP/s) by device name, from the vendors' data sheets: the denominator of MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                   "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None (CPUs, unknown GPUs): MFU is reported only where this is known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Linear warm-up to the peak, then linear annealing to 0 at total_steps (paper §3)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    return max(0.0, 1.0 - (step - cfg.warmup_steps) / span)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


@dataclass
class DenoisingContrastive:
    """Deviation (off in `paper`): an auxiliary loss that makes g a discriminative fingerprint of a document.

    Two noised views of every document in the batch, plus `extra_documents` random corpus documents (more
    negatives, embedded with the current parameters: a queue of stale vectors lets the encoder drift away
    from them, a degenerate solution), must find each other (SimCSE style). g learns which tokens
    identify a document, like a learned IDF, and across languages the tokens they share.
    """

    weight: float
    deletion: float = 0.6
    temperature: float = 0.05
    extra_documents: int = 32
    corpus_tokens: list | None = None  # documents to draw extra negatives from

    def views(self, batch: Batch, specials: SpecialTokens, rng: np.random.Generator) -> tuple[Tensor, Tensor] | None:
        """Two noised views (encoder input rows) of every document of the batch and of the extra negatives."""
        from marge.augment import SelfEvidence, noised
        from marge.batch import as_encoder_input, pad_rows

        noise = SelfEvidence(deletion=self.deletion, shuffle_window=1)
        docs = list(batch.doc_tokens)
        if self.corpus_tokens and self.extra_documents:
            docs += [self.corpus_tokens[i] for i in rng.integers(len(self.corpus_tokens), size=self.extra_documents)]
        docs = [np.asarray(d) for d in docs if len(d) > 1]
        if len(docs) < 2:
            return None
        first, second = (pad_rows([as_encoder_input(noised(d, noise, rng), specials) for d in docs], specials.pad_id)
                         for _ in range(2))
        return first, second

    def loss(self, model: Marge, batch: Batch, specials: SpecialTokens, device: torch.device,
             rng: np.random.Generator) -> Tensor | None:
        """The loss on fresh views of `batch` (None when it has fewer than 2 usable documents)."""
        views = self.views(batch, specials, rng)
        return None if views is None else self.loss_of_views(model, tuple(v.to(device) for v in views))

    def loss_of_views(self, model: Marge, views: tuple[Tensor, Tensor]) -> Tensor:
        """Each view must pick its twin among all the others (cross-entropy both ways, temperature-scaled cosines)."""
        import torch.nn.functional as F

        a = F.normalize(model.relevance_vectors(views[0]).float(), dim=-1)
        b = F.normalize(model.relevance_vectors(views[1]).float(), dim=-1)
        logits = a @ b.T / self.temperature
        labels = torch.arange(len(a), device=a.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def unwrap(model: nn.Module) -> Marge:
    return model.module if hasattr(model, "module") else model  # DDP wraps the model


@dataclass
class PreparedBatch:
    """A batch's CPU-side work done: augmented, turned into tensors, its denoising views drawn.

    Preparing needs no model, so a single-process trainer prepares the next step's batches in a thread
    while the device runs this one; the DDP worker prepares and computes in turn (`forward_backward`).
    """

    batch_id: str
    inputs: ModelInputs
    denoise_views: tuple[Tensor, Tensor] | None = None

    def pin_memory(self) -> "PreparedBatch":
        views = None if self.denoise_views is None else tuple(v.pin_memory() for v in self.denoise_views)
        return PreparedBatch(self.batch_id, self.inputs.pin_memory(), views)


def prepare_batch(batch: Batch, specials: SpecialTokens, attend_to: str = "all",
                  self_evidence: SelfEvidence | None = None, seed_key: tuple[int, ...] = (0,),
                  denoising: DenoisingContrastive | None = None) -> PreparedBatch:
    """`seed_key` = (run seed, step, slot of the batch within the step) seeds the batch's augmentation, so a
    batch is augmented the same way on a DDP rank, in the reference loop and in the single process."""
    if self_evidence is not None:
        batch = with_self_evidence(batch, self_evidence, seed_key[1] if len(seed_key) > 1 else 0,
                                   np.random.default_rng(list(seed_key)))
    views = None
    if denoising is not None and denoising.weight > 0:
        views = denoising.views(batch, specials, np.random.default_rng([*seed_key, 1]))
    return PreparedBatch(batch.batch_id, to_model_inputs(batch, specials, attend_to), views)


def forward_backward_prepared(model: nn.Module, prepared: PreparedBatch, scale: float, device: torch.device,
                              bf16: bool = False, denoising: DenoisingContrastive | None = None) -> tuple[float, int]:
    """Loss of one prepared batch, backpropagated with weight `scale`. Returns (mean token loss, target tokens)."""
    inputs = prepared.inputs.to(device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(**inputs.as_kwargs())
    objective = out.loss
    auxiliary = out.auxiliary_objective(unwrap(model).cfg)
    if auxiliary is not None:
        objective = objective + auxiliary
    if prepared.denoise_views is not None and denoising is not None:
        views = tuple(v.to(device, non_blocking=True) for v in prepared.denoise_views)
        objective = objective + denoising.weight * denoising.loss_of_views(unwrap(model), views)
    (objective * scale).backward()
    return float(out.loss.detach()), int(out.tokens_per_target_N.sum())


def forward_backward(model: nn.Module, batch: Batch, specials: SpecialTokens, scale: float,
                     device: torch.device, bf16: bool = False, attend_to: str = "all",
                     self_evidence: SelfEvidence | None = None, seed_key: tuple[int, ...] = (0,),
                     denoising: DenoisingContrastive | None = None) -> tuple[float, int]:
    """Prepare one batch (`prepare_batch`) and backpropagate its loss with weight `scale`."""
    prepared = prepare_batch(batch, specials, attend_to, self_evidence, seed_key, denoising)
    return forward_backward_prepared(model, prepared, scale, device, bf16, denoising)


class NonFiniteGradient(RuntimeError):
    pass


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, clip_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if clip_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradient("loss or gradient is not finite; stopping before the optimizer update "
                                "(lower trainer.lr, or turn trainer.bf16 off)")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_step(model: Marge, optimizer: torch.optim.Optimizer, scheduler, batches: list[Batch], specials: SpecialTokens,
               cfg: OptimConfig, step: int, device: torch.device, bf16: bool = False, attend_to: str = "all",
               self_evidence: SelfEvidence | None = None, seed: int = 0,
               denoising: DenoisingContrastive | None = None,
               prepared: list[PreparedBatch] | None = None) -> StepRecord:
    """One optimizer update on `batches` in this process: the reference loop's and the single-process run's step.

    Batch k of the list takes slot k (= rank * grad_accum + micro-step on the DDP ranks), so its augmentation
    and its 1/len(batches) share of the gradient are what the DDP trainer gives it. `prepared` are the
    batches already prepared that way (`prepare_batch`), e.g. by a prefetching thread.
    """
    t0 = time.perf_counter()
    if prepared is None:
        prepared = [prepare_batch(b, specials, attend_to, self_evidence, (seed, step, slot), denoising)
                    for slot, b in enumerate(batches)]
    losses, tokens = [], 0
    for item in prepared:
        loss, n = forward_backward_prepared(model, item, 1.0 / len(prepared), device, bf16, denoising)
        losses.append(loss)
        tokens += n
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = optimizer_step(model, optimizer, scheduler, cfg.clip_norm)
    return StepRecord(step, sum(losses) / len(losses), tokens, [b.batch_id for b in batches], lr,
                      model.beta.detach().float().cpu().tolist(), grad_norm, time.perf_counter() - t0,
                      [b.index_version for b in batches], [b.snapshot_step for b in batches])


def reference_train(model: Marge, step_batches: Iterable[list[Batch]], specials: SpecialTokens, cfg: OptimConfig,
                    device: str | torch.device = "cpu", bf16: bool = False, attend_to: str = "all",
                    optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                    start_step: int = 0, self_evidence: SelfEvidence | None = None, seed: int = 0,
                    denoising: DenoisingContrastive | None = None) -> list[StepRecord]:
    """Train in this process on the given batches, one list of batches per optimizer step."""
    device = torch.device(device)
    model.to(device).train()
    optimizer = optimizer or build_optimizer(model, cfg)
    scheduler = scheduler or build_scheduler(optimizer, cfg)
    return [train_step(model, optimizer, scheduler, batches, specials, cfg, step, device, bf16, attend_to,
                       self_evidence, seed, denoising)
            for step, batches in enumerate(step_batches, start=start_step)]


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, skip_sync: bool):
    """Inside gradient accumulation, DDP need not all-reduce until the last micro-batch."""
    if skip_sync and hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield
