"""Projections run together (`Attention.in_projection`): a self-attention's queries, keys and values, and a
cross-attention's keys and values, come from one matmul over the concatenated weights and one scatter into rows.
The values and every gradient are those of separate projections (fp64, padded rows and real tokens alike), the
parameters and checkpoint keys are unchanged, and a self-attention launches fewer kernels than separate projections
do."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from marge.model.layers import Attention
from services.trainer.inputs import real_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from host_overhead import Launches  # noqa: E402  (benchmarks/ is not a package)

LENGTHS = np.array([5, 3, 7, 1])
WIDTH = 7


def separately(attn: Attention, x: torch.Tensor, real) -> list[torch.Tensor]:
    """What the projections were before they ran together: one matmul and one scatter each."""
    return [attn.split_heads(proj(x) if real is None else real.to_rows(proj(x)))
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]


def block(attn: Attention, x: torch.Tensor, real, fused: bool) -> torch.Tensor:
    """A self-attention's output (keys masked where the rows are padding), from either projection path."""
    q, k, v = attn.project_qkv(x, real) if fused else separately(attn, x, real)
    key_ok = (torch.arange(WIDTH)[None, :] < torch.from_numpy(LENGTHS)[:, None])[:, None, None, :]
    return attn.attend(q, k, v, attn_bias=key_ok, real=real)


@pytest.mark.parametrize("layout", ["padded", "real"])
def test_values_and_gradients_are_those_of_separate_projections(layout):
    torch.manual_seed(0)
    attn = Attention(32, 4, 0.0).double()
    real = real_tokens(LENGTHS, WIDTH) if layout == "real" else None
    x = torch.randn(int(LENGTHS.sum()), 32) if real else torch.randn(len(LENGTHS), WIDTH, 32)
    x = x.double().requires_grad_()
    for fused_out, separate_out in zip(attn.project_qkv(x, real), separately(attn, x, real)):
        assert fused_out.shape == separate_out.shape
        torch.testing.assert_close(fused_out, separate_out, rtol=1e-12, atol=1e-12)
    k_fused, v_fused = attn.project_kv(x, real)
    torch.testing.assert_close(k_fused, separately(attn, x, real)[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v_fused, separately(attn, x, real)[2], rtol=1e-12, atol=1e-12)

    weights = torch.randn_like(block(attn, x, real, True))
    grads = {}
    for fused in (True, False):
        inputs = [x, *attn.parameters()]
        grads[fused] = torch.autograd.grad((block(attn, x, real, fused) * weights).sum(), inputs)
    for got, want in zip(grads[True], grads[False]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_parameters_and_checkpoint_keys_are_those_of_separate_projections():
    """Old checkpoints load as they are: the concatenation is made for each call, never stored."""
    assert list(Attention(32, 4, 0.0).state_dict()) == [f"{name}_proj.{kind}" for name in ("q", "k", "v", "out")
                                                         for kind in ("weight", "bias")]


def test_a_self_attention_launches_fewer_kernels_than_separate_projections():
    """On the real-token layout the recipe trains with: one matmul and one scatter instead of three of each, one
    gradient for x instead of three summed (the weights' concatenation costs two launches)."""
    torch.manual_seed(0)
    attn = Attention(32, 4, 0.0)
    real = real_tokens(LENGTHS, WIDTH)
    counts = {}
    for fused in (True, False):
        x = torch.randn(int(LENGTHS.sum()), 32, requires_grad=True)
        with Launches() as launches:
            block(attn, x, real, fused).sum().backward()
        counts[fused] = launches.count
    assert counts[True] <= counts[False] - 10, counts
