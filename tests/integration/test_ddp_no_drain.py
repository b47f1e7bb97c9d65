"""Two real DDP ranks (torch.distributed, gloo on loopback) run the pipeline's update (`run_update` with the loop's
all-reduced statistics) with the fused AdamW, whose step the device skips on a non-finite gradient: nothing reads
the device before the step on either rank, and a NaN loss on one rank's batch takes both ranks through the same
second pass to the for-each optimizer's outcome."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from marge.contracts.slots import Slots
from services.trainer.config import TrainerConfig
from services.trainer.loop import update_statistics
from services.trainer.objectives import Objectives, ObjectivesConfig
from services.trainer.step import (
    Item,
    Trainee,
    build_optimizer,
    build_scheduler,
    ddp_settings,
    run_update,
    seed_key,
)
from tests.gpu_inputs import SPECIALS, linked_batch, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from recipe_efficiency import DrainsBeforeStep  # noqa: E402  (benchmarks/ is not a package)

SLOTS = Slots(2, 1)
NAN_SLOT = SLOTS.slot(1, 1, 0)  # rank 1's batch of update 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_updates(rank: int, port: int, fused: bool, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        cfg = TrainerConfig(lr=1e-3, warmup_steps=0)
        objectives = Objectives(ObjectivesConfig(), SPECIALS)
        model = tiny_model().train()
        wrapped = DistributedDataParallel(model, **ddp_settings(model, objectives.cfg))
        optimizer = build_optimizer(model, cfg, fused=fused)
        scheduler = build_scheduler(optimizer, cfg, 10)
        names = list(objectives.part_names)
        out = []
        trainee = Trainee(model, wrapped, optimizer, scheduler, objectives, cfg, torch.device("cpu"), slots=SLOTS,
                          nan_loss_slot=NAN_SLOT)
        for step in range(2):
            slot = SLOTS.slot(step, rank, 0)
            batch = linked_batch(np.random.default_rng(slot))  # prepared on the host beforehand, as the ranks do
            items = [Item(slot, batch, prepared=objectives.prepare(batch, seed_key(0, SLOTS, slot)))]
            torch.manual_seed(100 * step + rank)
            with DrainsBeforeStep(optimizer) as drains:
                done, read = run_update(
                    trainee, items,
                    figures=lambda done, items=items: update_statistics(items, done, names, "cpu", dist.all_reduce))
            out.append({"drains": drains.reads, "trained": done.trained, "dead": done.dead_lettered,
                        "grad_norm": read.grad_norm, "stats": read.extra["stats"]})
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
        steps = sorted({float(optimizer.state[p]["step"]) for p in model.parameters()})
        results[rank] = ("ok", out, params, steps)
    except Exception as e:  # handed to the test, which names it
        results[rank] = ("error", f"{type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def run_ranks(fused: bool) -> dict:
    results = mp.Manager().dict()
    mp.spawn(two_updates, args=(free_port(), fused, results), nprocs=2, join=True)
    return dict(results)


def test_ddp_ranks_step_before_reading_and_agree_on_a_nan_loss_second_pass():
    fused, foreach = run_ranks(True), run_ranks(False)
    for results in (fused, foreach):
        assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    for rank in (0, 1):
        _, updates, params, steps = fused[rank]
        _, foreach_updates, foreach_params, foreach_steps = foreach[rank]
        assert [u["drains"] for u in updates] == [[], []]
        # the for-each optimizer's reads come first: one, and on the NaN loss's update the second pass's too (on a
        # CPU the counter also sees rank 1's stand-in batch being prepared: scalar reads of host tensors)
        assert [u["drains"].count("read_to_host") for u in foreach_updates] == [1, 2]
        nan_update = updates[1]
        if rank == 1:
            assert nan_update["trained"] == [] and [s for s, _ in nan_update["dead"]] == [NAN_SLOT]
            assert "non-finite loss (nan)" in nan_update["dead"][0][1]
        else:  # its batch trained in the second pass, with rank 1's zero-weight stand-in
            assert len(nan_update["trained"]) == 1 and nan_update["dead"] == []
        for a, b in zip(updates, foreach_updates, strict=True):
            assert (a["trained"], a["dead"]) == (b["trained"], b["dead"])
            assert a["grad_norm"] == b["grad_norm"] or abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * b["grad_norm"]
            np.testing.assert_allclose(a["stats"], b["stats"], rtol=1e-5)
        assert steps == foreach_steps == [2.0]  # the step the device skipped counts nothing
        np.testing.assert_allclose(params, foreach_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fused[0][2], fused[1][2])  # one model on both ranks
