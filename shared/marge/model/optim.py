"""The optimizer both trainers build, pre-training's (`services.trainer`) and fine-tuning's (`services.finetune`):
its settings (`OptimizerConfig`), AdamW over a model's parameter groups (`build_optimizer`) and the learning rate's
shape (`lr_factor`). In the library because two stages build it and stages meet only through the library."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from marge.contracts.config import FieldError, at_least, positive


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer's settings, one set of names and meanings for pre-training (`TrainerConfig`) and fine-tuning
    (`services.finetune.run.FinetuneConfig`), both built by `build_optimizer`."""

    lr: float = 3e-4
    """Peak learning rate (paper: 1e-4 first, 2e-4 later; smaller at first for stability, footnote 3)."""
    weight_decay: float = 0.01
    """AdamW weight decay of the weight matrices (none on biases, LayerNorms, embeddings and beta)."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """AdamW's (beta1, beta2)."""
    adam_eps: float = 1e-6
    """AdamW's epsilon."""
    clip_norm: float = 1.0
    """Gradient-norm clipping (0 turns it off)."""
    beta_lr_scale: float = 1.0
    """Deviation (1 in `paper`): beta, the relevance bias's one scalar, learns at `lr` times this. Adam moves a
    parameter by at most about its learning rate per update, so at 1 beta can rise by at most the sum of the
    rates so far (experiments/mechanism measures how close it comes)."""

    def __post_init__(self) -> None:
        positive(self, "lr", "adam_eps", "beta_lr_scale")
        at_least(self, "weight_decay", 0)
        at_least(self, "clip_norm", 0)
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise FieldError("adam_betas", self.adam_betas, "two numbers in [0, 1)")


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; no weight decay on biases, LayerNorms, embeddings and beta, and beta in a
    group of its own at `lr * beta_lr_scale` when that scale is not 1. `cfg`: pre-training's `TrainerConfig` or
    fine-tuning's `FinetuneConfig`, both an `OptimizerConfig`.

    On CUDA it is the fused kernel (one launch for every parameter instead of several per tensor, no read of the
    step counters back to the host, and a step the device skips when the gradient is not finite: `skips_on_device`);
    on CPU the default for-each implementation, whose results the fused one matches to rounding (`fused=True` takes
    the fused CPU kernel: what CPU tests of the GPU path use).
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    beta: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name == "beta" and cfg.beta_lr_scale != 1.0:
            beta.append(p)
            continue
        (decay if p.ndim == 2 and "embed" not in name and "positions" not in name else no_decay).append(p)
    groups: list[dict] = [{"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}]
    if beta:  # its own group only when its rate differs: a run without the option keeps its two groups
        groups.append({"params": beta, "weight_decay": 0.0, "lr": cfg.lr * cfg.beta_lr_scale})
    if fused is None:
        fused = all(p.is_cuda for p in decay + no_decay + beta) or None
    betas = cast(tuple[float, float], tuple(cfg.adam_betas))  # two numbers: OptimizerConfig checks it
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, fused=fused)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to the peak, then linear annealing to 0 at `total_steps` (paper §3)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    return max(0.0, 1.0 - (step - warmup_steps) / span)


def has_own_relevance_encoder(model: nn.Module) -> bool:
    """Whether g is a separate encoder (`MargeConfig.own_relevance_encoder`), not the encoder's first layers."""
    return bool(getattr(getattr(model, "cfg", None), "own_relevance_encoder", False))
