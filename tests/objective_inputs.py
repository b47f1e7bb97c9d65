"""Toy batches and objectives the objective tests share."""

from __future__ import annotations

import numpy as np

from marge.contracts.batch import Batch, SpecialTokens
from marge.contracts.config import build
from services.trainer.objectives import (
    Objectives,
    ObjectivesConfig,
)

SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 4, "de": 5}, mask_id=1)

SENTENCE_END = 9

VOCAB = 64


def objectives(**sections) -> ObjectivesConfig:
    return build(ObjectivesConfig, sections, "objectives")


def toy_batch(rng: np.random.Generator, targets: int = 3, evidence: int = 2) -> Batch:
    """Targets 0..T-1 in English, evidence in German, every target linked to every evidence document."""
    docs = targets + evidence
    tokens = tuple(rng.integers(10, VOCAB, size=int(rng.integers(6, 20))).astype(np.int32) for _ in range(docs))
    tokens = tuple(np.where(np.arange(len(t)) % 5 == 4, SENTENCE_END, t).astype(np.int32) for t in tokens)
    edges = np.array([(t, e) for t in range(targets) for e in range(evidence)], dtype=np.int32)
    return Batch("toy", 0, 0, np.arange(docs, dtype=np.int64), ("en",) * targets + ("de",) * evidence, tokens,
                 np.arange(targets, dtype=np.int32), np.arange(targets, docs, dtype=np.int32), edges,
                 np.where(np.arange(len(edges)) % 2 == 0, 100.0, 50.0).astype(np.float32))


def toy_objectives(cfg: ObjectivesConfig) -> Objectives:
    return Objectives(cfg, SPECIALS, sentence_ends=np.array([SENTENCE_END]), vocab_size=VOCAB)
