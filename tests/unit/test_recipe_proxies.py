"""The counters behind benchmarks/recipe_efficiency.py's CPU proxies of the GPU's costs: each counts what it names
(attention shapes, dtype casts, device reads before the optimizer's step) and the prefetch proxy fails on a
serialised host."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import recipe_efficiency as proxies  # noqa: E402  (benchmarks/ is not a package)


def test_the_attention_census_counts_each_distinct_call_shape_once():
    real_sdpa = F.scaled_dot_product_attention
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 12, 16)
    with proxies.AttentionCalls() as attention:
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, k)
        F.scaled_dot_product_attention(q[:1], k[:1], k[:1])
        F.scaled_dot_product_attention(q, k, k, attn_mask=torch.zeros(8, 12))
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert F.scaled_dot_product_attention is real_sdpa  # restored
    assert len(attention.calls) == 6
    assert len(set(attention.calls)) == 4  # the repeats are one shape; batch, a mask, causality each make another
    assert proxies.new_shapes_per_update([{1, 2}, {2, 3}, {3}, {4, 1}]) == [2, 1, 0, 1]


def test_the_attention_census_sees_the_models_calls_on_the_meta_device():
    from marge.model.architecture import preset
    from marge.model.sizes import build_on_meta
    from services.trainer.inputs import to_model_inputs
    from tests.unit.test_unpadded import SPECIALS, skewed_batch

    model = build_on_meta(preset("tiny", vocab_size=200, relevance_layers=1, relevance_pooling="mean")).train()
    with proxies.AttentionCalls() as attention:
        for docs in (30, 41):
            inputs = to_model_inputs(skewed_batch(docs=docs, targets=9), SPECIALS, "linked", unpadded=True).to("meta")
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout).loss.backward()
    per_batch = len(attention.calls) // 2
    assert per_batch > 0 and all(call[1][0] > 0 for call in attention.calls)
    assert len(set(attention.calls[:per_batch])) < len(set(attention.calls))  # the second batch's sizes are new


def test_the_cast_counter_counts_casts_and_nothing_else():
    x, weight = torch.randn(4, 8), torch.randn(3, 8)
    with proxies.Casts() as plain:
        F.linear(x, weight)
        x.to(torch.float32)  # same dtype: no copy
    with proxies.Casts() as deliberate:
        x.to(torch.float64)
        torch.empty(4, 8, dtype=torch.bfloat16).copy_(x)
    with proxies.Casts() as autocast, torch.autocast("cpu", torch.bfloat16):
        out = F.linear(x, weight)
    assert out.dtype == torch.bfloat16
    assert (plain.count, deliberate.count) == (0, 2)
    assert autocast.count == 2  # the input and the weight, to bf16


def test_dropout_counts_as_cudas_one_kernel_each_way_and_is_put_back():
    from host_overhead import Launches

    x = torch.randn(4, 8, requires_grad=True)
    counts = {}
    for name, context in (("cpu", proxies.contextlib.nullcontext()), ("cuda", proxies.dropout_as_on_cuda())):
        x.grad = None
        with context, Launches() as launches:
            torch.nn.Dropout(0.1).train()(x).sum().backward()
        counts[name] = launches.count
    assert counts["cpu"] - counts["cuda"] == 2  # draw, scale, product (the mask's allocation is no kernel) -> one
    with proxies.dropout_as_on_cuda():
        assert torch.equal(F.dropout(x, 0.1, training=False), x)  # evaluation: no dropout
    assert F.dropout.__module__ == "torch.nn.functional"  # put back


def test_the_pageable_copy_counter_counts_copies_from_memory_never_pinned():
    host = torch.randn(4, 8)
    with proxies.pinning_emulated() as pinned:
        pinned_host = host.pin_memory()
    assert pinned
    with pytest.raises(RuntimeError):  # the emulation is put back: a CPU build refuses to pin
        torch.randn(2).pin_memory()
    meta = torch.device("meta")
    with proxies.PageableCopies(pinned) as pageable:
        pinned_host.to(meta, non_blocking=True)
        pinned_host[1:].to(meta, non_blocking=True)  # a view of pinned memory is pinned
        host.to(meta, non_blocking=True)  # never pinned: the driver stages it, holding the host
        torch.empty(4, 8, device=meta).copy_(host)
        host.to(torch.float64)  # not to a device
    assert pageable.count == 2


def tiny_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def test_the_drain_counter_counts_reads_before_the_optimizers_step_only():
    from services.trainer import step as step_module
    from services.trainer.step import read_to_host

    def item_before_step(model, optimizer):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        loss.item()
        optimizer.step()

    def item_after_step(model, optimizer):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        optimizer.step()
        loss.item()

    def batched_read_before_step(model, optimizer):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        step_module.read_to_host(torch.stack([loss.detach(), loss.detach()]))  # looked up at the call, as run_update
        optimizer.step()

    counts = []
    for update in (item_before_step, item_after_step, batched_read_before_step):
        model, optimizer = tiny_optimizer()
        with proxies.DrainsBeforeStep(optimizer) as drains:
            update(model, optimizer)
        counts.append((drains.before_step, drains.after_step))
    assert counts == [(1, 0), (0, 1), (1, 0)]
    assert step_module.read_to_host is read_to_host  # restored


def spin(seconds: float) -> None:
    """Pure Python for `seconds` of this thread's CPU time: holds the GIL throughout."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_prefetch_proxy_fails_on_a_serialised_host_and_passes_an_overlapped_one():
    update_s, prepare_s = 0.06, 0.04
    threshold = proxies.serialised_threshold(prepare_s / update_s)
    serialised = proxies.prefetch_slowdown(lambda u: spin(update_s), lambda u: spin(prepare_s), updates=5)
    overlapped = proxies.prefetch_slowdown(lambda u: spin(update_s), lambda u: time.sleep(prepare_s), updates=5)
    # preparation holding the GIL lands on the update's host time; preparation that waits (I/O, or work that
    # releases the GIL) does not
    assert serialised["slowdown"] > threshold, (serialised, threshold)
    assert overlapped["slowdown"] < threshold, (overlapped, threshold)
    # at the H200's sizes the pass mark reads its never-pausing prefetch thread (1.48x) as a failure
    assert proxies.serialised_threshold(proxies.PREPARE_OVER_UPDATE_HOST) < 1.48
