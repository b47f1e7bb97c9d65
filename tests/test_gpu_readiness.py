"""What a GPU will feel, checked on a CPU: device reads inside the forward, graph breaks, the DDP process group's
backends and the cluster's GPUs (no GPU needed; CI never uses one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from marge.batch import Batch, SpecialTokens
from marge.model import Marge, preset
from services.trainer.inputs import to_model_inputs

SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 5, "de": 6, "fr": 7})


class DeviceReads(TorchDispatchMode):
    """Counts the operations that copy a device value to the host (`.item()`, `bool(t)`, `int(t)`, ...): on a GPU
    each one waits for every kernel launched before it."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
             "aten::_unique2"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def linked_batch(rng: np.random.Generator) -> Batch:
    """Three targets, four evidence documents, targets reading 1, 2 and 1 of them (the gathered key layout)."""
    lengths = (9, 7, 12, 5, 8, 10, 6)
    tokens = tuple(rng.integers(10, 60, size=n).astype(np.int32) for n in lengths)
    edges = np.array([[0, 0], [1, 1], [1, 2], [2, 3]], dtype=np.int32)
    return Batch("b", 0, 0, np.arange(7, dtype=np.int64), ("en", "de", "fr", "en", "de", "fr", "en"), tokens,
                 np.array([0, 1, 2], dtype=np.int32), np.array([3, 4, 5, 6], dtype=np.int32), edges,
                 np.ones(len(edges), dtype=np.float32))


def tiny_model() -> Marge:
    torch.manual_seed(0)
    return Marge(preset("tiny", vocab_size=64, max_positions=32, relevance_pooling="mean", relevance_centering=True))


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


def test_on_gpus_the_process_group_has_a_backend_for_cpu_and_cuda_tensors():
    from services.trainer.loop import process_group_backend

    backends = dict(item.split(":") for item in process_group_backend(use_gpu=True).split(","))
    assert backends == {"cpu": "gloo", "cuda": "nccl"}  # NCCL alone refuses CPU tensors (all_gather_object's)
    assert process_group_backend(use_gpu=False) == "gloo"


def test_a_run_asking_for_gpus_a_cluster_does_not_have_is_refused_naming_both_sides():
    from pathlib import Path

    from marge.config import ConfigError
    from services.driver.config import load_config

    repo = Path(__file__).resolve().parents[1]
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


def test_marge_pretrain_asking_for_gpus_on_a_machine_without_refuses_before_anything_starts(tmp_path):
    import subprocess
    import sys
    import time
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    repo = Path(__file__).resolve().parents[1]
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "services.driver.cli", "pretrain", "--config",
                           str(repo / "deploy/configs/tiny.yaml"), "trainer.use_gpu=true", f"run.dir={tmp_path / 'run'}"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs 2 GPUs (trainer 2 x 1) but the Ray cluster has 0" in proc.stderr
    assert time.time() - started < 60 and not (tmp_path / "run").exists()  # no Redis, no Ray, nothing written


def test_an_update_reads_the_device_back_once_on_the_fused_adamw_path(monkeypatch):
    """The single process's and the reference loop's update (`train_step`): two batches with every auxiliary of the
    learning recipe, the fused AdamW of the GPU path. Inside it no scalar is read back (no `.item()`, `bool(t)`,
    `float(t)`), and the update's figures come back in exactly one copy."""
    from marge.protocol import Slots
    from services.trainer import step as step_module
    from services.trainer.config import TrainerConfig
    from services.trainer.objectives import (DenoisingContrastiveConfig, MargeObjectiveConfig, Objectives,
                                             ObjectivesConfig, SelfEvidenceConfig)

    rng = np.random.default_rng(3)
    corpus_tokens = [rng.integers(10, 60, size=n).astype(np.int32) for n in (5, 9, 7, 11, 6, 8)]
    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                             self_evidence=SelfEvidenceConfig(prob=0.5, until=10),
                                             denoising_contrastive=DenoisingContrastiveConfig(weight=0.3, extra_documents=4)),
                            SPECIALS, corpus_tokens)
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
        record = step_module.train_step(model, optimizer, scheduler, objectives, batches, cfg, 0, torch.device("cpu"),
                                        0, prepared)
    assert reads.calls == [] and len(copies) == 1
    assert np.isfinite(record.loss) and record.target_tokens > 0 and np.isfinite(record.grad_norm) and record.beta
    assert set(record.objectives) == {"marge", "denoising_contrastive"}
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the optimizer stepped
