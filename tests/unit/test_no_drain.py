"""An update does not hold a GPU up while the host decides whether to step: with the fused AdamW (the GPU's) the
device skips a non-finite step itself and the update's one read comes after `optimizer.step()`; every outcome of
the non-finite paths stays what the for-each optimizer's host-decided order gives. Checked on a CPU with the fused
CPU kernel."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_inputs import SPECIALS, DeviceReads, linked_batch, tiny_model

from marge.contracts.slots import Slots
from services.trainer import step as step_module
from services.trainer.config import TrainerConfig
from services.trainer.objectives import (
    DenoisingContrastiveConfig,
    MargeObjectiveConfig,
    Objectives,
    ObjectivesConfig,
    SelfEvidenceConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from recipe_efficiency import DrainsBeforeStep  # noqa: E402  (benchmarks/ is not a package)

CPU = torch.device("cpu")
CFG = TrainerConfig(lr=1e-3, warmup_steps=0)


def recipe_objectives() -> Objectives:
    return Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                       self_evidence=SelfEvidenceConfig(prob=0.5, until=10),
                                       denoising_contrastive=DenoisingContrastiveConfig(weight=0.3, extra_documents=4)),
                      SPECIALS)


def training(fused: bool):
    model = tiny_model().train()
    optimizer = step_module.build_optimizer(model, CFG, fused=fused)
    return model, optimizer, step_module.build_scheduler(optimizer, CFG, 10)


def trainee(model, optimizer, scheduler, objectives) -> step_module.Trainee:
    return step_module.Trainee.in_process(model, optimizer, scheduler, objectives, CFG, CPU)


def update_batches(step: int) -> list:
    return [linked_batch(np.random.default_rng(10 * step + k)) for k in range(2)]


def prepared(objectives: Objectives, step: int, batches: list) -> list:
    """Prepared as the hosts do, in their prefetch thread (on the host: no device involved)."""
    slots = Slots(1, len(batches))
    return [objectives.prepare(b, step_module.seed_key(0, slots, slots.slot(step, 0, k))) for k, b in enumerate(batches)]


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{name: value.detach().clone() for name, value in optimizer.state[p].items()}
            for group in optimizer.param_groups for p in group["params"]]


def test_nothing_reads_the_device_before_the_fused_optimizer_steps(monkeypatch):
    """The single process's and the reference loop's update on the learning recipe's objectives, its batches
    prepared beforehand (as the hosts' prefetch threads do): no figure read (`read_to_host`) and no scalar read
    (`.item()`, `bool(t)`, ...) before `optimizer.step()` is entered; the one read comes after it."""
    model, optimizer, scheduler = training(fused=True)
    objectives = recipe_objectives()
    copies: list[int] = []
    original = step_module.read_to_host
    monkeypatch.setattr(step_module, "read_to_host", lambda values: copies.append(values.numel()) or original(values))
    reads = DeviceReads()
    at_step: list[tuple[int, list[str]]] = []  # (figure reads, scalar reads) when the step is entered
    optimizer.register_step_pre_hook(lambda *_: at_step.append((len(copies), list(reads.calls))))
    batches = update_batches(0)
    ready = prepared(objectives, 0, batches)
    with reads:
        record = step_module.train_step(trainee(model, optimizer, scheduler, objectives), batches, 0, ready)
    assert np.isfinite(record.loss) and not record.dead_lettered
    assert at_step == [(0, [])], f"(figure reads, scalar reads) before the optimizer stepped: {at_step}"
    assert len(copies) == 1 and reads.calls == []


@pytest.mark.parametrize("fused,expected", [(True, []), (False, ["read_to_host"])])
def test_the_drain_counter_sees_the_read_the_host_decides_on(fused, expected):
    """`DrainsBeforeStep`, the count benchmarks report: the for-each optimizer's update reads its figures before
    stepping (1), the fused one after (0)."""
    model, optimizer, scheduler = training(fused)
    objectives, batches = recipe_objectives(), update_batches(0)
    ready = prepared(objectives, 0, batches)
    with DrainsBeforeStep(optimizer) as drains:
        step_module.train_step(trainee(model, optimizer, scheduler, objectives), batches, 0, ready)
    assert drains.stepped and drains.reads == expected
    assert step_module.read_to_host.__name__ == "read_to_host"  # put back


def train_two_updates(fused: bool, nan_loss_slot: int | None):
    """Update 0, then update 1 with `nan_loss_slot`; the same seeds either way."""
    torch.manual_seed(1)
    model, optimizer, scheduler = training(fused)
    objectives = recipe_objectives()
    steps_entered = []
    optimizer.register_step_pre_hook(lambda *_: steps_entered.append(1))
    faulty = dataclasses.replace(trainee(model, optimizer, scheduler, objectives), nan_loss_slot=nan_loss_slot)
    records = [step_module.train_step(faulty, update_batches(s), s) for s in range(2)]
    return model, optimizer, records, len(steps_entered)


def test_a_nan_loss_batch_is_left_out_the_same_way_with_the_fused_optimizer():
    """A batch whose loss is not finite (`faults.nan_loss_slot`): the device skips the first pass's step, the update
    is computed again without the batch, which is dead-lettered; the record, the parameters and the optimizer's
    moments are the for-each optimizer's to rounding, and the step counter counts the update once."""
    nan_slot = Slots(1, 2).slot(1, 0, 1)
    fused_model, fused_opt, fused_records, fused_steps = train_two_updates(True, nan_slot)
    foreach_model, foreach_opt, foreach_records, foreach_steps = train_two_updates(False, nan_slot)
    assert fused_steps == 3 and foreach_steps == 2  # the fused path also entered the step it skipped
    fused, foreach = fused_records[1], foreach_records[1]
    assert fused.dead_lettered == foreach.dead_lettered
    assert [slot for slot, _ in fused.dead_lettered] == [nan_slot] and "non-finite loss (nan)" in fused.dead_lettered[0][1]
    assert fused.target_tokens == foreach.target_tokens and fused.batch_ids == foreach.batch_ids
    assert fused.loss == pytest.approx(foreach.loss, rel=1e-5) and np.isfinite(fused.loss)
    assert fused.grad_norm == pytest.approx(foreach.grad_norm, rel=1e-5)
    assert fused.beta == pytest.approx(foreach.beta, rel=1e-6)
    assert fused.objectives == pytest.approx(foreach.objectives, rel=1e-5)
    for a, b in zip(fused_model.parameters(), foreach_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(optimizer_state(fused_opt), optimizer_state(foreach_opt), strict=True):
        assert float(a["step"]) == float(b["step"]) == 2.0
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("fused", [True, False])
def test_an_update_whose_gradient_is_not_finite_changes_no_parameter_and_no_optimizer_state(fused):
    """Finite losses but a gradient that is not (a hook makes one parameter's gradient infinite): the update is
    skipped (its batches dead-lettered, its place in the schedule used up) and the parameters, the moments and the
    step counters are exactly what the update before left. The fused optimizer gets there by stepping with the
    device's own skip; the for-each one by not stepping."""
    torch.manual_seed(1)
    model, optimizer, scheduler = training(fused)
    objectives = recipe_objectives()
    step_module.train_step(trainee(model, optimizer, scheduler, objectives), update_batches(0), 0)
    params, state = [p.detach().clone() for p in model.parameters()], optimizer_state(optimizer)
    steps_entered = []
    optimizer.register_step_pre_hook(lambda *_: steps_entered.append(1))
    poisoned = next(p for p in model.parameters() if p.ndim == 2)
    poisoned.register_hook(lambda grad: grad + float("inf"))
    batches = update_batches(1)
    record = step_module.train_step(trainee(model, optimizer, scheduler, objectives), batches, 1)
    slots = Slots(1, 2)
    assert record.dead_lettered == [(slots.slot(1, 0, k), "non-finite gradient; update skipped") for k in range(2)]
    assert np.isnan(record.loss) and not np.isfinite(record.grad_norm)
    assert len(steps_entered) == (1 if fused else 0)
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    for before, after in zip(state, optimizer_state(optimizer), strict=True):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert scheduler.last_epoch == 2


def test_a_batch_is_checked_for_untrainable_input_once_per_update(monkeypatch):
    """`untrainable` costs milliseconds a batch: once per batch even when the update is computed twice (a NaN loss),
    and not at all in the step for a batch its host already checked (`Item.checked`: prepared in the prefetch
    thread)."""
    calls: list[str] = []
    original = step_module.untrainable
    monkeypatch.setattr(step_module, "untrainable", lambda batch, *args: calls.append(batch.batch_id) or original(batch, *args))
    model, optimizer, scheduler = training(fused=True)
    objectives = recipe_objectives()
    slots = Slots(1, 2)
    batches = update_batches(0)
    items = [step_module.Item(slots.slot(0, 0, k), b) for k, b in enumerate(batches)]
    run = dataclasses.replace(trainee(model, optimizer, scheduler, objectives), slots=slots)
    done, _ = step_module.run_update(dataclasses.replace(run, nan_loss_slot=slots.slot(0, 0, 1)), items)
    assert len(calls) == 2 and done.trained == [(slots.slot(0, 0, 0), batches[0].batch_id)]
    calls.clear()
    checked = [step_module.Item(slots.slot(1, 0, k), b, checked=True) for k, b in enumerate(update_batches(1))]
    done, _ = step_module.run_update(run, checked)
    assert calls == [] and len(done.trained) == 2


@pytest.mark.parametrize("dynamic,graphs", [(True, 1), (False, 2)])
def test_compile_dynamic_chooses_symbolic_or_per_shape_graphs(dynamic, graphs):
    """`trainer.compile_dynamic`: a layer compiled by `compiled` takes two row counts with one graph (dynamic) or
    one graph each (static: what CUDA graphs need)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8)])).train()
    step_module.compiled(model, True, "layers", backend=counter, dynamic=dynamic)
    layer = model[0][0]
    for rows in (3, 5):
        layer(torch.randn(rows, 8)).sum().backward()
    assert counter.frame_count == graphs
