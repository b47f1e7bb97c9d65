"""Inputs the GPU-readiness tests share: a linked batch, the tiny model, and a counter of device reads."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from marge.contracts.batch import Batch, SpecialTokens
from marge.model.architecture import preset
from marge.model.network import Marge

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
