"""bf16 parameters under DDP (`trainer.bf16_params`): three real ranks (torch.distributed, gloo on loopback), the
model's bf16 gradients all-reduced through `reduce_in_fp32` (summed in fp32, rounded to bf16 once), the update
stepping fp32 masters that stay bitwise equal on every rank."""

from __future__ import annotations

import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from marge.contracts.slots import Slots
from services.trainer.config import TrainerConfig
from services.trainer.objectives import Objectives, ObjectivesConfig
from services.trainer.precision import bf16_parameters, master_weights, reduce_in_fp32
from services.trainer.step import Item, Trainee, build_optimizer, build_scheduler, ddp_settings, run_update, seed_key
from tests.gpu_inputs import SPECIALS, linked_batch, tiny_model

WORLD = 3  # a mean over 3 is inexact in bf16: rounding twice (each share, then the sum) shows
SLOTS = Slots(WORLD, 1)
CFG = TrainerConfig(lr=1e-3, warmup_steps=0, bf16=True, bf16_params=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        objectives = Objectives(ObjectivesConfig(), SPECIALS)
        model = tiny_model().train()
        optimizer = build_optimizer(model, CFG, fused=True)
        bf16_parameters(model, optimizer)
        wrapped = DistributedDataParallel(model, **ddp_settings(model, objectives.cfg))
        wrapped.register_comm_hook(None, reduce_in_fp32)
        scheduler = build_scheduler(optimizer, CFG, 10)

        # one batch's gradient, local (no_sync) and all-reduced: the reduced one is the fp32 mean rounded once
        batch = linked_batch(np.random.default_rng(100 + rank))
        prepared = objectives.prepare(batch, seed_key(0, SLOTS, SLOTS.slot(0, rank, 0)))
        with wrapped.no_sync():
            objectives.losses(wrapped, prepared, torch.device("cpu"), CFG.autocast).objective.backward()
        local = torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        objectives.losses(wrapped, prepared, torch.device("cpu"), CFG.autocast).objective.backward()
        reduced = torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(gathered, local)
        shares = torch.stack(gathered).double()
        exact = shares.sum(0) / WORLD
        expected = exact.to(torch.bfloat16).double()
        # an fp32 sum is off by a few fp32 steps of its terms (which shows where they cancel), then rounded once to
        # bf16 (at most one bf16 step); bf16 all the way rounds each share and every partial sum to bf16 steps
        allowed = 2 ** -7 * exact.abs() + 2 ** -21 * shares.abs().mean(0)
        model.zero_grad(set_to_none=True)

        for step in range(2):
            slot = SLOTS.slot(step, rank, 0)
            batch = linked_batch(np.random.default_rng(slot))
            items = [Item(slot, batch, prepared=objectives.prepare(batch, seed_key(0, SLOTS, slot)))]
            run_update(Trainee(model, wrapped, optimizer, scheduler, objectives, CFG, torch.device("cpu"), slots=SLOTS),
                       items)
        weights = master_weights(optimizer)
        assert weights is not None
        results[rank] = {"exact": float((reduced.double() == expected).float().mean()),
                         "outside": int(((reduced.double() - exact).abs() > allowed).sum()),
                         "masters": torch.cat([m.detach().flatten() for m in weights.masters]),
                         "copies_match": all(torch.equal(c, m.to(torch.bfloat16))
                                             for c, m in zip(weights.copies, weights.masters))}
    finally:
        dist.destroy_process_group()


def test_bf16_gradients_are_summed_in_fp32_and_the_masters_stay_equal():
    results = mp.Manager().dict()
    mp.start_processes(rank_main, args=(free_port(), results), nprocs=WORLD, join=True, start_method="fork")
    assert sorted(results.keys()) == list(range(WORLD))
    for rank in range(WORLD):
        r = results[rank]
        assert r["exact"] > 0.99, r["exact"]  # the mean rounded once to bf16, but where the shares cancel
        assert r["outside"] == 0, r["outside"]
        assert r["copies_match"]
        assert torch.equal(r["masters"], results[0]["masters"])
