"""Two real DDP ranks (torch.distributed, gloo on loopback) train g's own encoder with f detached: the updates in
which nothing reaches g (`objectives.marge.detach_relevance_until`) must not stop DDP, and g must stay as it was.
Without `find_unused_parameters` DDP refuses the second update; `step.ddp_settings` turns it on exactly there."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer.inputs import to_model_inputs
from services.trainer.objectives import MargeObjectiveConfig, ObjectivesConfig
from services.trainer.step import DDP_SETTINGS, ddp_settings
from tests.unit.test_unpadded import SPECIALS, skewed_batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_detached_updates(rank: int, port: int, settings: dict, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = Marge(preset("tiny", vocab_size=200, own_relevance_encoder=True))
        before = {k: v.detach().clone() for k, v in model.relevance_encoder.state_dict().items()}
        wrapped = DistributedDataParallel(model, **settings)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = to_model_inputs(skewed_batch(seed=rank), SPECIALS, "linked")
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            out = wrapped(**inputs.as_kwargs(), detach_relevance=True)
            out.loss.backward()
            optimizer.step()
        after = model.relevance_encoder.state_dict()
        results[rank] = ("ok", all(torch.equal(before[k], after[k]) for k in before))
    except RuntimeError as e:
        results[rank] = ("error", str(e).splitlines()[0])
    finally:
        dist.destroy_process_group()


def run_ranks(settings: dict) -> dict:
    results = mp.Manager().dict()
    mp.spawn(two_detached_updates, args=(free_port(), settings, results), nprocs=2, join=True)
    return dict(results)


def test_g_own_encoder_trains_under_ddp_while_f_is_detached():
    objectives = ObjectivesConfig(marge=MargeObjectiveConfig(detach_relevance_until=500))
    model = Marge(preset("tiny", vocab_size=200, own_relevance_encoder=True))
    settings = ddp_settings(model, objectives)
    assert settings["find_unused_parameters"] is True
    results = run_ranks(settings)
    assert results == {0: ("ok", True), 1: ("ok", True)}  # two updates, g's own encoder untouched on both ranks


@pytest.mark.slow
def test_without_finding_unused_parameters_ddp_stops_the_second_update():
    """The control: the failure `ddp_settings` prevents is real (PyTorch's DDP, not an assumption)."""
    results = run_ranks(dict(DDP_SETTINGS))
    assert {r[0] for r in results.values()} == {"error"}, results


def test_ddp_finds_unused_parameters_only_where_an_update_can_leave_some():
    own = Marge(preset("tiny", vocab_size=200, own_relevance_encoder=True))
    shared = Marge(preset("tiny", vocab_size=200))
    detached = ObjectivesConfig(marge=MargeObjectiveConfig(detach_relevance=True))
    attached = ObjectivesConfig(marge=MargeObjectiveConfig())
    assert ddp_settings(own, detached)["find_unused_parameters"] is True
    assert ddp_settings(own, attached)["find_unused_parameters"] is False
    assert ddp_settings(shared, detached)["find_unused_parameters"] is False  # the memory path reaches g's layers
    assert {k: v for k, v in ddp_settings(own, detached).items() if k != "find_unused_parameters"} == DDP_SETTINGS
