"""What a GPU will feel, checked on a CPU: device reads inside the forward, graph breaks, the DDP process group's
backends and the cluster's GPUs (no GPU needed; CI never uses one).

The tests of this subject that need a server or take long are in tests/integration/test_gpu_readiness_compile.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gpu_inputs import SPECIALS, DeviceReads, linked_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from services.trainer.inputs import to_model_inputs


def test_on_gpus_the_process_group_has_a_backend_for_cpu_and_cuda_tensors():
    from services.trainer.rank import process_group_backend

    backends = dict(item.split(":") for item in process_group_backend(use_gpu=True).split(","))
    assert backends == {"cpu": "gloo", "cuda": "nccl"}  # NCCL alone refuses CPU tensors (all_gather_object's)
    assert process_group_backend(use_gpu=False) == "gloo"


def test_a_run_asking_for_gpus_a_cluster_does_not_have_is_refused_naming_both_sides():
    from pathlib import Path

    from marge.contracts.config import ConfigError
    from services.driver.config import load_config

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "deploy/configs/tiny.yaml", ["trainer.use_gpu=true"])
    assert cfg.gpus_needed() == 2
    cfg.check_fits(8, 2)
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(trainer 2 x 1\) but the Ray cluster has 0: start Ray on "
                                          r"GPU nodes"):
        cfg.check_fits(8, 0)
    both = load_config(repo / "deploy/configs/tiny.yaml", ["trainer.use_gpu=true", "indexer.use_gpu=true",
                                                           "indexer.num_gpus_per_worker=0.5"])
    with pytest.raises(ConfigError, match=r"needs 2.5 GPUs \(trainer 2 x 1 \+ indexer 1 x 0.5\) but the Ray cluster has 1"):
        both.check_fits(8, 1)
    load_config(repo / "deploy/configs/tiny.yaml").check_fits(8, 0)  # a CPU run needs none


def test_an_update_reads_the_device_back_once_on_the_fused_adamw_path(monkeypatch):
    """The single process's and the reference loop's update (`train_step`): two batches with every auxiliary of the
    learning recipe, the fused AdamW of the GPU path. Inside it no scalar is read back (no `.item()`, `bool(t)`,
    `float(t)`), and the update's figures come back in exactly one copy."""
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

    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                             self_evidence=SelfEvidenceConfig(prob=0.5, until=10),
                                             denoising_contrastive=DenoisingContrastiveConfig(weight=0.3, extra_documents=4)),
                            SPECIALS)
    model = tiny_model().train()
    cfg = TrainerConfig(lr=1e-3, warmup_steps=0)
    optimizer = step_module.build_optimizer(model, cfg, fused=True)
    scheduler = step_module.build_scheduler(optimizer, cfg, 10)
    batches = [linked_batch(np.random.default_rng(k)) for k in range(2)]
    slots = Slots(1, 2)
    prepared = [objectives.prepare(b, step_module.seed_key(0, slots, slot)) for slot, b in enumerate(batches)]
    copies = []
    original = step_module.read_to_host
    monkeypatch.setattr(step_module, "read_to_host", lambda values: copies.append(values.numel()) or original(values))
    before = [p.detach().clone() for p in model.parameters()]
    with DeviceReads() as reads:
        record = step_module.train_step(
            step_module.Trainee.in_process(model, optimizer, scheduler, objectives, cfg, torch.device("cpu")), batches, 0,
            prepared)
    assert reads.calls == [] and len(copies) == 1
    assert np.isfinite(record.loss) and record.target_tokens > 0 and np.isfinite(record.grad_norm) and record.beta
    assert set(record.objectives) == {"marge", "denoising_contrastive"}
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the optimizer stepped


@pytest.mark.parametrize("path", ["folded", "mask", "flex"])
def test_every_way_of_adding_a_key_bias_equals_adding_it_to_the_logits(path):
    """trainer.key_bias's paths (folded into the heads, SDPA's mask, FlexAttention's score_mod) against
    softmax(q.k / sqrt(E) + bias) v written out: the same values, and the same gradients to q, k, v and the bias
    (beta * f: gradient to g and beta), with -inf for keys a target may not read; a boolean "may read" mask the
    same way. FlexAttention has no CPU backward: on a CPU its values alone (gradients where a GPU is)."""
    from marge.model.layers import key_biased_attention

    trains = path != "flex" or torch.cuda.is_available()
    device, dtype, tol = (("cuda", torch.float32, 1e-5) if path == "flex" and trains else ("cpu", torch.float64, 1e-12))
    torch.manual_seed(0)
    b, h, nq, nk, e = 3, 2, 5, 7, 16
    q, k, v = (torch.randn(b, h, n, e, dtype=dtype, device=device, requires_grad=trains) for n in (nq, nk, nk))
    bias = (3 * torch.randn(b, 1, 1, nk, dtype=dtype, device=device)).requires_grad_(trains)
    blocked = torch.zeros(b, 1, 1, nk, dtype=torch.bool, device=device)
    blocked[0, 0, 0, 3:] = True
    blocked[2, 0, 0, :2] = True

    def written_out(q, k, v, bias):
        logits = q @ k.transpose(-1, -2) / e ** 0.5 + bias.masked_fill(blocked, float("-inf"))
        return logits.softmax(-1) @ v

    expected = written_out(q, k, v, bias)
    got = key_biased_attention(q, k, v, bias.masked_fill(blocked, float("-inf")), path, 0.0)
    torch.testing.assert_close(got, expected, rtol=0, atol=tol)
    if trains:
        grad = torch.randn_like(expected)
        for a, c in zip(torch.autograd.grad(expected, (q, k, v, bias), grad),
                        torch.autograd.grad(got, (q, k, v, bias), grad), strict=True):
            torch.testing.assert_close(c, a, rtol=0, atol=tol)
    mask = torch.ones(b, 1, 1, nk, dtype=torch.bool, device=device)
    mask[1, 0, 0, -2:] = False
    with torch.no_grad():
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(key_biased_attention(q, k, v, mask, path, 0.0), reference, rtol=0, atol=tol)


@pytest.mark.parametrize("attend_to", ["linked", "all"])
def test_no_attention_call_of_a_training_forward_carries_a_mask(monkeypatch, attend_to):
    import torch.nn.functional as F

    calls = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((attn_mask is not None, q.shape[-1]))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = tiny_model().train()
    inputs = to_model_inputs(linked_batch(np.random.default_rng(2)), SPECIALS, attend_to)
    model(**inputs.as_kwargs(), width=inputs.width).loss.backward()
    cfg = model.cfg  # the evidence encoder, g over the targets, the decoder's self- and cross-attention
    expected = cfg.encoder_layers + cfg.relevance_layers + cfg.decoder_local_layers + 2 * cfg.decoder_layers
    assert len(calls) == expected and not any(masked for masked, _ in calls)
    assert all(width % 8 == 0 for _, width in calls)  # head widths the fused kernels take


def test_the_chunked_loss_makes_its_gradients_with_three_matmuls_a_chunk():
    """`model.loss_chunk_tokens` on a 250k-vocabulary-like output layer: the fused loss (`fused_linear_nll`) equals the
    whole loss and its gradients, with 3 matrix products per chunk (logits, d states, d weight) where checkpointed
    chunks need 4 (the logits again in the backward)."""
    from marge.model.losses import chunked_token_nll, fused_linear_nll, token_nll

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"):
                self.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    rows, d, vocab, chunk = 40, 16, 300, 16  # 3 chunks, the last a partial one
    states = torch.randn(rows, d, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, d, dtype=torch.float64) * 0.1).requires_grad_()
    labels = torch.randint(1, vocab, (rows,))
    labels[-5:] = 0  # padding

    def grads(loss):
        return torch.autograd.grad(loss, (states, weight))

    whole = token_nll(states @ weight.T, labels, 0)
    expected = grads(whole.sum())
    with Matmuls() as fused_count:
        total, per_row = fused_linear_nll(states, weight, labels, 0, chunk)
        got = grads(total)
    # the logits are scored in fp32 in both (as under autocast): equal to fp32 rounding
    torch.testing.assert_close(total.double(), whole.sum().double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(per_row, whole.detach().float(), rtol=1e-6, atol=1e-6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with Matmuls() as checkpointed_count:
        grads(chunked_token_nll(states, weight, labels, 0, chunk).sum())
    assert fused_count.count == 3 * 3 and checkpointed_count.count == 4 * 3


def test_a_rank_reads_and_prepares_the_next_update_while_this_one_trains():
    """`trainer.prefetch`: the DDP rank's prefetcher reads its slots of the next update from the source and prepares
    them in a thread (as the single process does); a read that fails is raised in the loop, not lost in the thread."""
    import functools
    import threading

    from marge.contracts.slots import Slots
    from services.trainer.prefetch import Prefetcher
    from services.trainer.rank import deliveries_prepared
    from services.trainer.source import MemorySource

    slots = Slots(2, 2)  # 2 ranks x 2 micro-batches: this rank (1) holds slots 2, 3 of update 0 and 6, 7 of update 1
    batches = [linked_batch(np.random.default_rng(k)) for k in range(4)]
    prepared_in = []

    def prepare(delivery):
        prepared_in.append(threading.current_thread().name)
        return ("prepared", delivery.slot)

    prefetcher = Prefetcher(functools.partial(deliveries_prepared, MemorySource(batches, slots, rank=1), slots, 1, prepare))
    prefetcher.start(1)
    taken = prefetcher.take(1)
    assert [d.slot for d, _ in taken] == [6, 7] and [p for _, p in taken] == [("prepared", 6), ("prepared", 7)]
    assert prepared_in == ["marge-prefetch-1"] * 2  # not the loop's thread
    assert [d.slot for d, _ in prefetcher.take(0)] == [2, 3]  # a step not started ahead is read on demand
    assert prefetcher.take(5) == []  # nothing there: the loop's readiness check stops every rank

    class Broken(MemorySource):
        def get(self, slot):
            raise ConnectionError("redis went away")

    broken = Prefetcher(functools.partial(deliveries_prepared, Broken(batches, slots, rank=1), slots, 1, prepare))
    broken.start(0)
    with pytest.raises(ConnectionError, match="redis went away"):
        broken.take(0)


def test_compiled_kernels_are_cached_under_the_run_folder_unless_the_user_chose_a_place(tmp_path, monkeypatch):
    from services.trainer.step import compile_cache_env

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    assert compile_cache_env(tmp_path) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile-cache" / "inductor")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile-cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere/triton"
