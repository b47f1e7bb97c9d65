"""What a GPU will feel, checked on a CPU: device reads inside the forward, graph breaks, the DDP process group's
backends and the cluster's GPUs (no GPU needed; CI never uses one).

These need a server or take long; the quick tests of this subject are in tests/unit/test_gpu_readiness.py (no server)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_inputs import SPECIALS, DeviceReads, linked_batch, tiny_model

from marge.contracts.batch import Batch
from services.trainer.inputs import to_model_inputs


@pytest.mark.parametrize("attend_to", ["linked", "all"])
def test_the_forward_and_backward_read_nothing_back_from_the_device_given_host_checked_inputs(attend_to):
    model = tiny_model().train()
    inputs = to_model_inputs(linked_batch(np.random.default_rng(0)), SPECIALS, attend_to)
    assert inputs.width == (2 if attend_to == "linked" else 4)  # checked and laid out on the host
    with DeviceReads() as reads:
        model(**inputs.as_kwargs(), width=inputs.width).loss.backward()
    assert reads.calls == []
    with DeviceReads() as unchecked:  # the same inputs unprepared: the forward must check them itself
        model(**inputs.as_kwargs()).loss.backward()
    assert len(unchecked.calls) >= 2


def test_forward_and_loss_compile_into_one_graph():
    import torch._dynamo

    model = tiny_model().train()
    inputs = to_model_inputs(linked_batch(np.random.default_rng(1)), SPECIALS, "linked")

    def loss(evidence_MS, target_enc_NS, decoder_in_NT, labels_NT, allowed_NM):
        return model(evidence_MS, target_enc_NS, decoder_in_NT, labels_NT, allowed_NM, width=inputs.width).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(*inputs.tensors()[:5])
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*inputs.tensors()[:5]), loss(*inputs.tensors()[:5]))


def test_marge_pretrain_asking_for_gpus_on_a_machine_without_refuses_before_anything_starts(tmp_path):
    import subprocess
    import sys
    import time
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    repo = Path(__file__).resolve().parents[2]
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "pretrain", "--config",
                           str(repo / "deploy/configs/tiny.yaml"), "trainer.use_gpu=true", f"run.dir={tmp_path / 'run'}"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs 2 GPUs (trainer 2 x 1) but the Ray cluster has 0" in proc.stderr
    assert time.time() - started < 60 and not (tmp_path / "run").exists()  # no Redis, no Ray, nothing written


@pytest.mark.parametrize("scope,unpadded", [("model", False), ("layers", False), ("layers", True)])
def test_varied_batches_compile_into_a_bounded_number_of_graphs(scope, unpadded):
    """The trainer's compiled forward (`trainer.compile`: dynamic shapes) over batches of different sizes, as the
    batcher makes them: the graphs stop growing after the first 30 batches instead of one per batch. By layer
    (`trainer.compile_scope: layers`, each fullgraph) the graphs are per layer kind (encoder, local decoder,
    decoder with cross-attention) and variant (key layout, a batch of one target or row, which dynamic shapes
    specialise), however many layers, padded or on real tokens only (9 here), plus the loss head's two (its first
    shapes, then symbolic ones); in eval mode (probes, generation) the layers run eagerly: nothing more is compiled."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from services.trainer.step import compiled

    torch._dynamo.reset()
    counter = CompileCounter()
    model = tiny_model().train()
    forward = compiled(model, True, scope, backend=counter)

    last = []

    def train_on(seed: int, count: int) -> set:
        rng, shapes = np.random.default_rng(seed), set()
        for _ in range(count):
            n_docs = int(rng.integers(5, 9))
            lengths = rng.integers(3, 20, size=n_docs)
            tokens = tuple(rng.integers(10, 60, size=int(n)).astype(np.int32) for n in lengths)
            n_targets = int(rng.integers(1, 3))
            edges = [[t, e] for t in range(n_targets) for e in range(n_docs - n_targets) if rng.random() < 0.6] or [[0, 0]]
            batch = Batch("b", 0, 0, np.arange(n_docs, dtype=np.int64), ("en",) * n_docs, tokens,
                          np.arange(n_targets, dtype=np.int32), np.arange(n_targets, n_docs, dtype=np.int32),
                          np.array(edges, dtype=np.int32), np.ones(len(edges), dtype=np.float32))
            inputs = to_model_inputs(batch, SPECIALS, "linked", unpadded=unpadded)
            shapes.add(tuple(tuple(t.shape) for t in inputs.tensors()))
            forward(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout).loss.backward()
            last[:] = [inputs]
        return shapes

    assert len(train_on(9, 30)) >= 20
    warm = counter.frame_count
    bound = 11 if scope == "layers" else 10
    assert len(train_on(10, 12)) >= 10 and counter.frame_count == warm and warm <= bound, (warm, counter.frame_count)
    if scope == "layers":
        with torch.no_grad():
            model.eval()(**last[0].as_kwargs(), width=last[0].width, layout=last[0].layout)
        assert counter.frame_count == warm
