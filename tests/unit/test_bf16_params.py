"""bf16 parameters with fp32 master weights (`trainer.bf16_params`): no cast in the forward or the backward, the
optimizer and every state_dict on fp32 masters, a checkpoint round trip that resumes exactly, and training that
follows bf16 autocast's. On a CPU (bf16 matmuls are emulated there: the counts are the device's, the values close)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_inputs import tiny_model
from test_no_drain import recipe_objectives, update_batches
from tiny_training import stand_in_tokenizer

from marge.contracts.config import FieldError
from marge.model.architecture import preset
from marge.model.checkpoint import save_checkpoint
from marge.model.network import Marge, relevance_state_dict
from marge.model.restore import restore_training
from services.trainer import step as step_module
from services.trainer.config import TrainerConfig
from services.trainer.precision import bf16_parameters, full_precision, master_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from recipe_efficiency import Casts  # noqa: E402  (benchmarks/ is not a package)

CPU = torch.device("cpu")
AUTOCAST = TrainerConfig(lr=1e-3, warmup_steps=0, bf16=True)
PARAMS = TrainerConfig(lr=1e-3, warmup_steps=0, bf16=True, bf16_params=True)


def training(cfg: TrainerConfig, model: Marge | None = None):
    model = (model or tiny_model()).train()
    optimizer = step_module.build_optimizer(model, cfg, fused=True)
    if cfg.bf16_params:
        bf16_parameters(model, optimizer)
    return model, optimizer, step_module.build_scheduler(optimizer, cfg, 40)


def trainee(model, optimizer, scheduler, objectives, cfg: TrainerConfig) -> step_module.Trainee:
    return step_module.Trainee.in_process(model, optimizer, scheduler, objectives, cfg, CPU)


def losses(cfg: TrainerConfig, updates: int) -> list[float]:
    model, optimizer, scheduler = training(cfg)
    objectives = recipe_objectives()
    return [step_module.train_step(trainee(model, optimizer, scheduler, objectives, cfg), update_batches(s % 5), s).loss
            for s in range(updates)]


def test_bf16_params_needs_bf16():
    with pytest.raises(FieldError, match="bf16_params"):
        TrainerConfig(bf16_params=True)
    assert PARAMS.autocast is False and AUTOCAST.autocast is True


def test_no_cast_in_the_forward_or_the_backward():
    """Autocast casts every weight, every weight's gradient and the activations between fp32 and bf16 ops, so each
    layer adds dozens of casts; bf16 parameters cast only what the model asks for in fp32 or bf16 on purpose: the
    loss's logits and f's vectors once an objective, and the key bias each cross-attention layer adds."""
    objectives = recipe_objectives()
    prepared = [objectives.prepare(b, (0, 0, k)) for k, b in enumerate(update_batches(0))]
    counts = {}
    for extra in (0, 2):
        for name, cfg in (("autocast", AUTOCAST), ("params", PARAMS)):
            torch.manual_seed(0)
            model, _, _ = training(cfg, Marge(preset("tiny", vocab_size=64, max_positions=32, relevance_pooling="mean",
                                                     relevance_centering=True, encoder_layers=3 + extra,
                                                     decoder_layers=2 + extra)))
            with Casts() as casts:
                for p in prepared:
                    objectives.losses(model, p, CPU, cfg.autocast).objective.backward()
            counts[name, extra] = casts.count
    assert counts["autocast", 0] > 200 and counts["autocast", 2] > counts["autocast", 0] + 100, counts
    added = {name: counts[name, 2] - counts[name, 0] for name in ("autocast", "params")}
    assert added["params"] <= 0.1 * added["autocast"], counts
    assert counts["params", 0] <= 0.15 * counts["autocast", 0], counts


def test_the_optimizer_and_every_state_dict_hold_the_fp32_masters():
    model, optimizer, scheduler = training(PARAMS)
    objectives = recipe_objectives()
    for s in range(3):
        step_module.train_step(trainee(model, optimizer, scheduler, objectives, PARAMS), update_batches(s), s)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(p.dtype == torch.float32 for p in stepped)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    weights = master_weights(optimizer)
    assert weights is not None
    for copy, master in zip(weights.copies, weights.masters):  # the model computes with its masters, rounded
        assert torch.equal(copy, master.to(torch.bfloat16))
    state = model.state_dict()
    masters = {id(m) for m in stepped}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for name, value in state.items():
        assert value.dtype == torch.float32, name
        if name in by_name:
            assert torch.equal(value, full_precision(by_name[name])), name
    layer = model.encoder_layers[0]  # a module's own state_dict (a snapshot of g takes one) holds masters too
    assert all(v.dtype == torch.float32 for v in layer.state_dict().values())
    assert len(masters) == len(stepped)

    snapshot = relevance_state_dict(model)  # what a snapshot of g publishes: the masters' values, not bf16's
    embedding = model.encoder_token_embedding
    assert torch.equal(snapshot["embed_tokens.weight"], full_precision(embedding.weight))
    assert not torch.equal(snapshot["embed_tokens.weight"], embedding.weight.float())
    for key, value in snapshot.items():
        assert value.dtype == torch.float32, key


def test_beta_is_reported_as_the_optimizer_holds_it():
    """The update's figures read beta's fp32 master (the checkpoint's value), not its bf16 copy."""
    model, optimizer, scheduler = training(PARAMS)
    objectives = recipe_objectives()
    for s in range(3):
        before = full_precision(model.beta).detach().flatten().tolist()
        record = step_module.train_step(trainee(model, optimizer, scheduler, objectives, PARAMS), update_batches(s), s)
        assert record.beta == pytest.approx(before, rel=1e-7)  # as this update's forwards saw it
    assert not torch.equal(full_precision(model.beta), model.beta.float())  # its bf16 rounding differs


def test_an_update_refuses_a_model_its_precision_setting_does_not_describe():
    objectives = recipe_objectives()
    model = tiny_model().train()
    optimizer = step_module.build_optimizer(model, PARAMS, fused=True)  # not converted
    scheduler = step_module.build_scheduler(optimizer, PARAMS, 40)
    with pytest.raises(ValueError, match="bf16_parameters"):
        step_module.train_step(trainee(model, optimizer, scheduler, objectives, PARAMS), update_batches(0), 0)
    bf16_parameters(model, optimizer)
    with pytest.raises(ValueError, match="bf16_params is off"):
        step_module.train_step(trainee(model, optimizer, scheduler, objectives, AUTOCAST), update_batches(0), 0)


def test_a_checkpoint_resumes_bf16_params_exactly(tmp_path: Path):
    """Save after 2 updates, restore into a fresh trainee, convert (as the hosts do, after the restore): the next
    updates' losses equal the uninterrupted run's to the bit."""
    objectives = recipe_objectives()
    model, optimizer, scheduler = training(PARAMS)
    for s in range(2):
        step_module.train_step(trainee(model, optimizer, scheduler, objectives, PARAMS), update_batches(s), s)
    directory = save_checkpoint(tmp_path / "step-00000002", model, optimizer, scheduler, 2,
                                stand_in_tokenizer(tmp_path / "tok"), {"tokens_seen": 2})
    rng = torch.get_rng_state()
    straight = [step_module.train_step(trainee(model, optimizer, scheduler, objectives, PARAMS),
                                       update_batches(s), s).loss
                for s in (2, 3)]

    torch.manual_seed(7)  # another init: everything must come from the checkpoint
    fresh = tiny_model().train()
    fresh_optimizer = step_module.build_optimizer(fresh, PARAMS, fused=True)
    fresh_scheduler = step_module.build_scheduler(fresh_optimizer, PARAMS, 40)
    restore_training(directory, fresh, fresh_optimizer, fresh_scheduler, CPU)
    bf16_parameters(fresh, fresh_optimizer)
    torch.set_rng_state(rng)
    resumed = [step_module.train_step(trainee(fresh, fresh_optimizer, fresh_scheduler, objectives, PARAMS),
                                      update_batches(s), s).loss for s in (2, 3)]
    assert resumed == straight


def test_a_restore_into_a_converted_model_writes_the_masters(tmp_path: Path):
    """A restore after the conversion (a state_dict's tensors are the masters): `publish` refreshes the copies."""
    model, optimizer, scheduler = training(PARAMS)
    step_module.train_step(trainee(model, optimizer, scheduler, recipe_objectives(), PARAMS), update_batches(0), 0)
    directory = save_checkpoint(tmp_path / "step-00000001", model, optimizer, scheduler, 1,
                                stand_in_tokenizer(tmp_path / "tok"), {"tokens_seen": 1})
    other, other_optimizer, other_scheduler = training(PARAMS)  # the init: the update above is in the checkpoint
    weights = master_weights(other_optimizer)
    assert weights is not None
    restore_training(directory, other, other_optimizer, other_scheduler, CPU)
    weights.publish()
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_training_follows_bf16_autocast():
    """30 updates of the learning recipe's objectives on the tiny model: the loss with bf16 parameters stays within
    1% of autocast's at every update, and both fall."""
    autocast, params = losses(AUTOCAST, 30), losses(PARAMS, 30)
    assert all(np.isfinite(params))
    worst = max(abs(a - b) / a for a, b in zip(autocast, params))
    assert worst < 0.01, worst
    assert np.mean(params[-5:]) < np.mean(params[:5]) - 0.1
