"""One optimizer update in this process through whichever interface the measured tree has: the benchmarks that
measure an older commit beside this one (`--before`) call the trainer through this.

This tree: `train_step(Trainee, batches, step, prepared)`. Trees before `Trainee` moved into the step module:
`train_step(model, optimizer, scheduler, objectives, batches, cfg, step, device, seed, prepared)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def update_fn(model, optimizer, scheduler, objectives, cfg, device) -> Callable[..., Any]:
    """`update(batches, step, prepared=None) -> StepRecord`: one update of `model` (as given: itself, or compiled)
    on `batches`, seed 0."""
    from services.trainer import step as step_module

    if hasattr(step_module, "Trainee"):
        trainee = step_module.Trainee.in_process(model, optimizer, scheduler, objectives, cfg, device)
        return lambda batches, step, prepared=None: step_module.train_step(trainee, batches, step, prepared)
    return lambda batches, step, prepared=None: step_module.train_step(  # type: ignore[call-arg]  # older trees
        model, optimizer, scheduler, objectives, batches, cfg, step, device, 0, prepared)
