"""The tiny model and hand-made batches the model tests share."""

from __future__ import annotations

import numpy as np
import torch

from marge.contracts.batch import Batch, SpecialTokens
from marge.model.architecture import preset
from marge.model.network import Marge

SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 10, "de": 11, "zh": 12})


def tiny(**overrides) -> Marge:
    torch.manual_seed(0)
    return Marge(preset("tiny", vocab_size=200, **overrides)).eval()


def make_batch(rng: np.random.Generator, lengths=(7, 12, 5, 9), targets=(0, 1), evidence=(1, 2, 3),
               edges=None) -> Batch:
    """Documents of random tokens; `edges` (target position, evidence position) default to every target -> evidence 0."""
    tokens = tuple(rng.integers(20, 200, size=n).astype(np.int32) for n in lengths)
    langs = tuple(["en", "de", "zh", "en"][i % 4] for i in range(len(lengths)))
    edges = np.array(edges if edges is not None else [[t, 0] for t in range(len(targets))], dtype=np.int32)
    return Batch("b0", 0, 0, np.arange(100, 100 + len(lengths), dtype=np.int64), langs, tokens,
                 np.array(targets, dtype=np.int32), np.array(evidence, dtype=np.int32), edges,
                 np.ones(len(edges), dtype=np.float32))
