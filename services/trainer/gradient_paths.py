"""Where the gradient on g comes from: the share of it that flows through f (beta * f in the cross-attention, the
path by which the paper says reconstruction trains retrieval) against all of it (f, the evidence memory that shares
g's layers, the decoder's language model through a tied token embedding, an auxiliary loss on g).

Measured by the writer (trainer rank 0, the single process) at every snapshot, on the batches of the update just
trained, with the parameters after it; the figures go into the update's health record (train_log.jsonl, TensorBoard
`health/f_gradient_share*`). Nothing is applied: the gradients are taken with `torch.autograd.grad` (no `.grad` is
touched), the random state is forked (dropout draws the same masks afterwards as without the measurement) and the
running centre of g is put back, so a run with the measurement trains exactly as one without.

    f_gradient_share            |grad through f| / |grad of the whole objective| over g's parameters
    f_gradient_share_embedding  the same over the token embedding g reads (the decoder's too when tied)
    f_gradient_share_layers     the same over g's encoder layers (and its position embedding and norm)
    g_gradient_norm             |grad of the whole objective| over g's parameters
    distillation_gradient_share |grad through f from `objectives.relevance_distillation`| / the whole (when it is on)

In a run with f detached (`objectives.marge.detach_relevance`) the f path carries nothing: the shares are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from marge.model.network import Marge
from services.trainer.objectives import Objectives, PreparedBatch


def relevance_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """g's parameters in two parts (`Marge.relevance_parameter_groups`): the token embedding it reads and the rest."""
    return cast(Marge, model).relevance_parameter_groups()


def _norm(grads: Sequence[Tensor | None]) -> float:
    squares = [g.detach().float().pow(2).sum() for g in grads if g is not None]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def gradient_paths(model: nn.Module, objectives: Objectives, prepared: list[PreparedBatch], device: torch.device,
                   bf16: bool = False) -> dict[str, float]:
    """The f share of the gradient on g's parameters over `prepared` (see the module docstring); {} when the run
    has no MARGE objective or nothing to measure on. `model` is the model itself (not a DDP or compiled wrapper)."""
    batches = [p for p in prepared if p is not None and p.parts.get("marge") is not None]
    if objectives.cfg.marge is None or not batches or not hasattr(model, "relevance_parameter_groups"):
        return {}
    groups = relevance_parameters(model)
    params = [p for ps in groups.values() for p in ps]
    paths: dict[str, list[Tensor | None]] = {name: [None] * len(params) for name in ("whole", "f", "distillation")}

    def add(path: str, grads) -> None:
        into = paths[path]
        for i, g in enumerate(grads):
            if g is not None:
                into[i] = g if into[i] is None else into[i] + g

    def through_f(loss: Tensor | None, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if loss is None:
            return ()
        (upstream,) = torch.autograd.grad(loss, relevance, retain_graph=True, allow_unused=True)
        if upstream is None:  # f reaches this loss only as a value (beta * f detached)
            return ()
        return torch.autograd.grad(relevance, params, grad_outputs=upstream, retain_graph=True, allow_unused=True)

    centre = getattr(model, "relevance_center", None)
    saved_centre = None if centre is None else centre.detach().clone()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for batch in batches:
            losses = objectives.losses(model, batch, device, bf16)
            relevance = losses.relevance_NM
            if relevance is not None and relevance.requires_grad:
                add("f", through_f(losses.weighted.get("marge"), relevance))
                add("distillation", through_f(losses.weighted.get("relevance_distillation"), relevance))
            add("whole", torch.autograd.grad(losses.objective, params, allow_unused=True))
    if centre is not None and saved_centre is not None:
        with torch.no_grad():
            centre.copy_(saved_centre)
    whole = _norm(paths["whole"])
    out = {"f_gradient_share": _norm(paths["f"]) / whole if whole > 0 else 0.0, "g_gradient_norm": whole}
    if objectives.cfg.relevance_distillation is not None:
        out["distillation_gradient_share"] = _norm(paths["distillation"]) / whole if whole > 0 else 0.0
    start = 0
    for name, members in groups.items():
        part = _norm(paths["whole"][start:start + len(members)])
        out[f"f_gradient_share_{name}"] = _norm(paths["f"][start:start + len(members)]) / part if part > 0 else 0.0
        start += len(members)
    return out
