"""The training batch (a subgraph of the evidence/target graph) and how documents are framed: numpy only.

A batch holds each document once (a document may be a target and evidence at the same time), the
indices of its targets and evidence documents, and the graph edges that made the batcher put them
together. It carries the index version and snapshot step it was built from, so the trainer can log
staleness. `marge.contracts.protocol` serialises it for the queue; the trainer turns it into tensors
(`services.trainer.inputs`).

Framing, defined here once and used by every stage:

    encoder input   BOS, text, EOS                 (evidence documents, g of any document, queries)
    decoder input   language token, text            (the language token selects the output language)
    labels          text, EOS
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

ENCODER_SPECIALS = 2
"""Tokens the encoder reads besides a document's text: BOS and EOS."""
DECODER_SPECIALS = 1
"""Tokens the decoder predicts besides a target's text: EOS (its input has the language token instead)."""


Cost = TypeVar("Cost", int, np.ndarray)  # the costs below take a count, or an array of counts (element-wise)


def encoder_cost(text_tokens: Cost) -> Cost:
    """Encoder positions of a document with `text_tokens` text tokens."""
    return text_tokens + ENCODER_SPECIALS


def decoder_cost(text_tokens: Cost) -> Cost:
    """Decoder positions of a target with `text_tokens` text tokens."""
    return text_tokens + DECODER_SPECIALS


def max_text_tokens(max_positions: int) -> int:
    """The longest text that fits `max_positions` encoder positions (a document, a query, a chunk)."""
    return max_positions - ENCODER_SPECIALS


@dataclass(frozen=True)
class SpecialTokens:
    pad_id: int
    bos_id: int
    eos_id: int
    lang_ids: dict[str, int]
    mask_id: int = 1
    """What noising objectives (BART's infilling, VECO's masked LM) put in place of hidden text: SentencePiece's
    <unk>, which never comes out of tokenizing text (the tokenizer falls back to bytes), so it is free to mean
    "something was here" without a new vocabulary entry (BART's <mask>)."""

    def lang_id(self, lang: str) -> int:
        try:
            return self.lang_ids[lang]
        except KeyError:
            raise ValueError(f"language {lang!r} has no language token in this tokenizer "
                             f"(it knows {sorted(self.lang_ids)}); re-run `marge prepare` with it") from None


@dataclass(frozen=True)
class Batch:
    batch_id: str
    index_version: int
    snapshot_step: int
    doc_ids: np.ndarray  # U int64, unique
    doc_langs: tuple[str, ...]  # U
    doc_tokens: tuple[np.ndarray, ...]  # U int32 arrays of text token ids (no specials)
    targets: np.ndarray  # N int32 indices into doc_ids
    evidence: np.ndarray  # M int32 indices into doc_ids
    edges: np.ndarray  # E x 2 int32 (target position in `targets`, evidence position in `evidence`)
    edge_weights: np.ndarray  # E float32

    def __post_init__(self) -> None:
        u = len(self.doc_ids)
        if len(self.doc_langs) != u or len(self.doc_tokens) != u:
            raise ValueError(f"batch {self.batch_id}: doc_ids, doc_langs and doc_tokens lengths differ")
        if len(set(self.doc_ids.tolist())) != u:
            raise ValueError(f"batch {self.batch_id}: doc_ids are not unique")
        for name in ("targets", "evidence"):
            idx = getattr(self, name)
            if len(idx) == 0:
                raise ValueError(f"batch {self.batch_id}: no {name}")
            if idx.min() < 0 or idx.max() >= u:
                raise ValueError(f"batch {self.batch_id}: {name} index out of range 0..{u - 1}")
        if self.edges.ndim != 2 or self.edges.shape[1] != 2 or len(self.edges) != len(self.edge_weights):
            raise ValueError(f"batch {self.batch_id}: edges must be E x 2 with one weight each")
        if len(self.edges) and (self.edges[:, 0].max() >= len(self.targets) or self.edges[:, 1].max() >= len(self.evidence)):
            raise ValueError(f"batch {self.batch_id}: an edge points outside the batch")

    @property
    def num_targets(self) -> int:
        return len(self.targets)

    @property
    def num_evidence(self) -> int:
        return len(self.evidence)

    def target_tokens(self) -> int:
        """Tokens the decoder predicts (text + EOS per target)."""
        return int(sum(decoder_cost(len(self.doc_tokens[i])) for i in self.targets))

    def cost_tokens(self) -> int:
        """The budget measure: encoder tokens of the evidence + decoder tokens of the targets (specials included)."""
        return int(sum(encoder_cost(len(self.doc_tokens[i])) for i in self.evidence) + self.target_tokens())

    def content_digest(self) -> str:
        """12 hex digits of a SHA-256 over what the batch trains on (documents, their tokens and languages, targets,
        evidence, edges and weights, the index version and snapshot), not its id: the same batch built again gives
        the same digest, a different one (a builder that is not deterministic) another. Batch ids carry it
        (`marge.contracts.slots.BatchId.content`)."""
        h = hashlib.sha256()
        h.update(np.asarray([self.index_version, self.snapshot_step, len(self.doc_ids)], dtype="<i8").tobytes())
        h.update(np.asarray(self.doc_ids, dtype="<i8").tobytes())
        h.update("\0".join(self.doc_langs).encode("utf-8") + b"\0")
        h.update(np.asarray([len(t) for t in self.doc_tokens], dtype="<i8").tobytes())
        for tokens in self.doc_tokens:
            h.update(np.asarray(tokens, dtype="<i4").tobytes())
        for part in (self.targets, self.evidence, self.edges):
            h.update(np.asarray(part.shape, dtype="<i8").tobytes() + np.asarray(part, dtype="<i4").tobytes())
        h.update(np.asarray(self.edge_weights, dtype="<f4").tobytes())
        return h.hexdigest()[:12]

    def cross_lingual_edge_share(self) -> float:
        if len(self.edges) == 0:
            return 0.0
        t_lang = [self.doc_langs[self.targets[t]] for t in self.edges[:, 0]]
        e_lang = [self.doc_langs[self.evidence[e]] for e in self.edges[:, 1]]
        return float(np.mean([a != b for a, b in zip(t_lang, e_lang)]))


def as_encoder_input(tokens: np.ndarray | list[int], specials: SpecialTokens) -> list[int]:
    """BOS, the text, EOS: how every document enters the encoder (language-agnostic on purpose)."""
    return [specials.bos_id, *map(int, tokens), specials.eos_id]


def as_decoder_input(tokens: np.ndarray | list[int], lang: str, specials: SpecialTokens) -> list[int]:
    """The target's language token, then its text."""
    return [specials.lang_id(lang), *map(int, tokens)]


def as_labels(tokens: np.ndarray | list[int], specials: SpecialTokens) -> list[int]:
    """The target's text, then EOS: what the decoder predicts at each input position."""
    return [*map(int, tokens), specials.eos_id]


def framed_rows(docs: Sequence[np.ndarray | Sequence[int]], pad_id: int, first: np.ndarray | int | None = None,
                last: int | None = None) -> np.ndarray:
    """Documents as one (rows, longest) int64 array, each row `first`, the document's tokens, `last`, then `pad_id`:
    one concatenation and one scatter over the whole batch, no per-token Python (what `as_encoder_input`,
    `as_decoder_input` and `as_labels` give row by row). `first`: one id for every row, one per row, or None."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    flat = np.concatenate([np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]) if len(docs) else \
        np.zeros(0, dtype=np.int64)
    return framed_flat(flat, lengths, pad_id, first, last)


def framed_flat(flat: np.ndarray, lengths: np.ndarray, pad_id: int, first: np.ndarray | int | None = None,
                last: int | None = None) -> np.ndarray:
    """`framed_rows` of documents given as their concatenated tokens and each one's length."""
    lead = 0 if first is None else 1
    width = int(lengths.max(initial=0)) + lead + (last is not None)
    out = np.full((len(lengths), width), pad_id, dtype=np.int64)
    if len(lengths) == 0:
        return out
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    out[rows, np.arange(len(flat)) - np.repeat(starts, lengths) + lead] = flat
    if first is not None:
        out[:, 0] = first
    if last is not None:
        out[np.arange(len(lengths)), lengths + lead] = last
    return out


def encoder_rows(docs, specials: SpecialTokens) -> np.ndarray:
    """`as_encoder_input` of every document, padded: BOS, text, EOS."""
    return framed_rows(docs, specials.pad_id, specials.bos_id, specials.eos_id)


def encoder_rows_flat(flat: np.ndarray, lengths: np.ndarray, specials: SpecialTokens) -> np.ndarray:
    """`encoder_rows` of documents given as their concatenated tokens and each one's length."""
    return framed_flat(flat, lengths, specials.pad_id, specials.bos_id, specials.eos_id)


def decoder_rows(docs, langs, specials: SpecialTokens) -> np.ndarray:
    """`as_decoder_input` of every target, padded: its language token, then its text."""
    return framed_rows(docs, specials.pad_id, np.array([specials.lang_id(lang) for lang in langs], dtype=np.int64))


def label_rows(docs, specials: SpecialTokens) -> np.ndarray:
    """`as_labels` of every target, padded: its text, then EOS."""
    return framed_rows(docs, specials.pad_id, None, specials.eos_id)
