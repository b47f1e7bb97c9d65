"""A new objective is one class and one registration (services.trainer.objective_registry): `SpreadObjective`
(tests/spread_objective.py),
an auxiliary loss that pushes a batch's targets' g vectors apart, joins a run from its config section alone, draws
from its own random stream (the other objectives' inputs are unchanged), adds its weighted loss and its passes, and
trains through the trainer's own update. Bad registrations and bad settings are refused naming what to fix."""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import spread_objective
import torch
from objective_inputs import SPECIALS, VOCAB, objectives, toy_batch, toy_objectives
from spread_objective import SpreadConfig

from marge.contracts.config import ConfigError
from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer import step as step_module
from services.trainer.config import TrainerConfig
from services.trainer.objective_registry import REGISTRY, Registration, register, unregister
from services.trainer.objectives import Objectives, objective_rng, real_count

CPU = torch.device("cpu")


@pytest.fixture
def spread():
    """The registration, removed after the test."""
    spread_objective.register_spread()
    yield
    if "spread" in REGISTRY:
        unregister("spread")


def model() -> Marge:
    torch.manual_seed(0)
    return Marge(preset("tiny", vocab_size=VOCAB, max_positions=64)).train()


def test_a_registered_objective_joins_from_its_section_and_adds_its_weighted_loss(spread):
    cfg = objectives(marge={}, registered={"spread": {"weight": 0.5, "dropped": 0.2}})
    assert cfg.enabled == ("marge", "spread") and cfg.config_of("spread") == SpreadConfig(weight=0.5, dropped=0.2)
    run = toy_objectives(cfg)
    assert [p.name for p in run.plugins] == ["marge", "spread"] and run.part_names == ("marge", "spread")
    batch = toy_batch(np.random.default_rng(0))
    prepared = run.prepare(batch, (0, 3, 1))
    losses = run.losses(model(), prepared, CPU, bf16=False)
    assert set(losses.parts) == {"marge", "spread"} and float(losses.parts["spread"]) != 0.0
    assert float(losses.objective.detach()) == pytest.approx(
        float(losses.parts["marge"]) + 0.5 * float(losses.parts["spread"]), rel=1e-6)
    solo = toy_objectives(objectives(marge={}))  # the run without it
    alone, work = solo.prepare(batch, (0, 3, 1)), run.work(prepared)
    assert work["relevance"] == solo.work(alone)["relevance"] + real_count(prepared.parts["spread"]["rows"], 0)
    assert work["target"] == solo.work(alone)["target"]


def test_its_own_random_stream_leaves_the_other_objectives_draws_unchanged(spread):
    batch = toy_batch(np.random.default_rng(1))
    sections = {"marge": {}, "self_evidence": {"prob": 1.0, "until": 10}, "denoising_contrastive": {"weight": 0.3,
                                                                                                   "extra_documents": 0}}
    alone = toy_objectives(objectives(**sections)).prepare(batch, (0, 2, 0))
    both = toy_objectives(objectives(**sections, registered={"spread": {"dropped": 0.5}})).prepare(batch, (0, 2, 0))
    for a, b in zip(alone.parts["marge"].tensors(), both.parts["marge"].tensors()):
        assert torch.equal(a, b)
    for name in ("first", "second"):
        assert torch.equal(alone.parts["denoising_contrastive"][name], both.parts["denoising_contrastive"][name])
    again = toy_objectives(objectives(marge={}, registered={"spread": {"dropped": 0.5}})).prepare(batch, (0, 2, 0))
    assert torch.equal(again.parts["spread"]["rows"], both.parts["spread"]["rows"])  # keyed by its stream alone
    other_step = toy_objectives(objectives(marge={}, registered={"spread": {"dropped": 0.5}})).prepare(batch, (0, 5, 0))
    assert not torch.equal(other_step.parts["spread"]["rows"], both.parts["spread"]["rows"])


def test_it_trains_through_the_trainers_update(spread):
    """`train_step` backpropagates it: its targets' g vectors, near one direction at init, spread apart (marge's loss
    is weighted to almost nothing, so that this loss alone moves g)."""
    cfg = objectives(marge={"weight": 1e-30}, registered={"spread": {"weight": 1.0}})
    run = toy_objectives(cfg)
    net = model()
    trainer = TrainerConfig(lr=1e-2, warmup_steps=0)
    optimizer = step_module.build_optimizer(net, trainer)
    scheduler = step_module.build_scheduler(optimizer, trainer, 10)
    batches = [toy_batch(np.random.default_rng(s)) for s in range(2)]
    prepared = [run.prepare(b, (0, 0, k)) for k, b in enumerate(batches)]
    before = float(np.mean([float(run.losses(net, p, CPU, False).parts["spread"]) for p in prepared]))
    for step in range(15):
        step_module.train_step(step_module.Trainee.in_process(net, optimizer, scheduler, run, trainer, CPU),
                               batches, step)
    after = float(np.mean([float(run.losses(net, p, CPU, False).parts["spread"]) for p in prepared]))
    assert after < before - 0.05, (before, after)


@pytest.mark.parametrize("sections, message", [
    ({"registered": {"nowhere": {}}}, "objectives.registered.nowhere: is not a registered objective"),
    ({"registered": {"bart": {}}}, "has its own key: objectives.bart"),
    ({"registered": {"spread": {"weight": 0}}}, "objectives.registered.spread.weight must be > 0"),
    ({"registered": {"spread": {"wieght": 1}}}, "did you mean 'weight'"),
    ({"bart": {}, "registered": {"spread": {}}}, "objectives.registered.spread is an auxiliary of the marge objective"),
])
def test_bad_settings_are_refused_naming_the_key(spread, sections, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        objectives(**sections)


@dataclass(frozen=True)
class Unweighted:
    share: float = 0.5


def test_a_registration_must_take_a_new_name_and_a_new_stream():
    with pytest.raises(ValueError, match="already registered"):
        register(Registration("bart", SpreadConfig, 11, "auxiliary", build=lambda cfg, c: None))
    with pytest.raises(ValueError, match="rng_stream 1 is 'denoising_contrastive'"):
        register(Registration("other", SpreadConfig, 1, "auxiliary", build=lambda cfg, c: None))
    with pytest.raises(ValueError, match="auxiliary objectives need a build function"):
        Registration("other", SpreadConfig, 11, "auxiliary")
    with pytest.raises(ValueError, match="role 'loss' is not one of"):
        Registration("other", SpreadConfig, 11, "loss", build=lambda cfg, c: None)
    with pytest.raises(ValueError, match="settings class dict must be a dataclass"):
        Registration("other", dict, 11, "auxiliary", build=lambda cfg, c: None)
    with pytest.raises(ValueError, match="the settings of auxiliary objectives need a `weight` field"):
        Registration("other", Unweighted, 11, "auxiliary", build=lambda cfg, c: None)
    assert "other" not in REGISTRY


def test_a_registered_main_objective_is_refused():
    register(Registration("mainly", SpreadConfig, 12, "main", build=lambda cfg, c: None, needs_marge=False))
    try:
        with pytest.raises(ConfigError, match="only this package's main objectives"):
            objectives(registered={"mainly": {}})
    finally:
        unregister("mainly")


def test_the_built_in_objectives_keep_their_streams():
    """Every run's figures so far were drawn from these: a change here changes them all. self_evidence drew from the
    seed key itself before objectives had streams; stream 0 gives the same draws (numpy pads a seed with zeros)."""
    names = ("marge", "self_evidence", "denoising_contrastive", "bart", "veco", "relevance_distillation")
    assert {name: REGISTRY[name].rng_stream for name in names} == {
        "marge": None, "self_evidence": 0, "denoising_contrastive": 1, "bart": 2, "veco": 3,
        "relevance_distillation": None}
    for key in ((0, 5, 1), (7, 0, 3), (123, 99999, 0)):
        assert np.array_equal(objective_rng("self_evidence", key).random(8), np.random.default_rng(list(key)).random(8))
    assert objective_rng("marge", (0, 5, 1)) is None  # draws nothing


def test_a_module_named_in_imports_registers_its_objectives_wherever_the_section_is_read():
    """The driver reads the section from YAML; a trainer worker gets it pickled and builds the objectives from it:
    both import the module that registers it (unpickling imports only the settings class's module, which registers
    nothing), so the worker trains what the driver configured."""
    sections = {"marge": {}, "imports": ["spread_registration"], "registered": {"spread": {"weight": 0.5}}}
    unregister_everywhere()
    try:
        cfg = objectives(**sections)  # the driver: the section's import registers it
        assert cfg.enabled == ("marge", "spread")
        shipped = pickle.dumps(cfg)
        unregister_everywhere()  # a fresh worker process: the registering module not imported, nothing registered
        worker = Objectives(pickle.loads(shipped), SPECIALS, sentence_ends=np.array([9]), vocab_size=VOCAB)
        assert [p.name for p in worker.plugins] == ["marge", "spread"]
    finally:
        unregister_everywhere()


def test_a_worker_without_the_registration_refuses_instead_of_training_without_it(spread):
    cfg = objectives(marge={}, registered={"spread": {}})  # registered by hand in the driver, no `imports`
    shipped = pickle.dumps(cfg)
    unregister("spread")
    with pytest.raises(ConfigError, match=r"\['spread'\] not registered in this process: name the module"):
        Objectives(pickle.loads(shipped), SPECIALS)


def test_an_import_that_fails_is_refused_naming_the_module():
    with pytest.raises(ConfigError, match="objectives.imports: cannot import 'no_such_objectives'"):
        objectives(imports=["no_such_objectives"])


def unregister_everywhere() -> None:
    """As if this process had never imported tests/spread_registration.py."""
    if "spread" in REGISTRY:
        unregister("spread")
    sys.modules.pop("spread_registration", None)
