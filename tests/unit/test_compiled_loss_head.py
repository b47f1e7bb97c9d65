"""`trainer.compile` compiles the loss head (the tied output projection's NLL over every row) beside the layers:
the same loss and gradients, compiled where gradients are on, eager where they are off."""

from __future__ import annotations

import numpy as np
import torch
from gpu_inputs import SPECIALS, linked_batch, tiny_model

from marge.model.losses import projected_token_nll
from services.trainer.inputs import to_model_inputs
from services.trainer.step import compiled


def loss_and_gradients(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs.as_kwargs(), width=inputs.width).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_compiled_loss_head_gives_the_eager_loss_and_gradients_and_runs_only_while_training():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    inputs = to_model_inputs(linked_batch(np.random.default_rng(0)), SPECIALS, "linked")
    eager = tiny_model().train()
    model = tiny_model().train()
    model.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled(model, True, "layers", backend=counter)
    assert model.projected_nll is not projected_token_nll and model.projected_nll.__wrapped__ is projected_token_nll
    frames_of_layers_only = CompileCounter()
    torch._dynamo.reset()
    layers_only = tiny_model().train()
    layers_only.load_state_dict(eager.state_dict())
    compiled(layers_only, True, "layers", backend=frames_of_layers_only)
    layers_only.projected_nll = projected_token_nll  # the layers compiled, the loss head not
    loss_and_gradients(layers_only, inputs)
    torch._dynamo.reset()
    expected, expected_grads = loss_and_gradients(eager, inputs)
    got, got_grads = loss_and_gradients(model, inputs)
    assert counter.frame_count == frames_of_layers_only.frame_count + 1  # the loss head's graph
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    frames = counter.frame_count
    with torch.no_grad():
        model.eval()(**inputs.as_kwargs(), width=inputs.width)
    assert counter.frame_count == frames  # a probe or snapshot: eager, nothing compiled
