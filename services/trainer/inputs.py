"""From a `Batch` (the numpy contract) to the tensors `Marge.forward` takes: the trainer's side of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from marge.contracts.batch import (
    Batch,
    SpecialTokens,
    decoder_cost,
    decoder_rows,
    encoder_cost,
    encoder_rows,
    label_rows,
)
from marge.model.layers import PACK_BLOCK, PackedCross, RealTokens, UnpaddedLayout
from marge.model.network import check_inputs

ATTEND_TO = ("all", "linked")


@dataclass
class ModelInputs:
    """The tensors `Marge.forward` takes (see its docstring for their meaning)."""

    evidence_MS: Tensor
    target_enc_NS: Tensor
    decoder_in_NT: Tensor
    labels_NT: Tensor
    allowed_NM: Tensor
    linked_NM: Tensor  # the batch's retrieval links (target i -> evidence j): for objectives; the model takes none
    crosslingual_NM: Tensor  # evidence j is in another language than target i: for objectives; the model takes none
    width: int | None = None
    """`marge.model.network.check_inputs` of these tensors, made on the host: the forward then reads nothing back from the
    device (None: the forward checks)."""
    layout: UnpaddedLayout | None = None
    """Where the real tokens are and which keys each target reads (`unpadded_layout`); None: run padded."""
    detach_relevance: bool = False
    """This batch trains with f detached (`MargeObjectiveConfig.detached_at` its update)."""

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.evidence_MS, self.target_enc_NS, self.decoder_in_NT, self.labels_NT, self.allowed_NM,
                self.linked_NM, self.crosslingual_NM)

    def to(self, device: torch.device | str) -> "ModelInputs":
        evidence, target_enc, decoder_in, labels, allowed, linked, crosslingual = (t.to(device, non_blocking=True)
                                                                                   for t in self.tensors())
        return ModelInputs(evidence, target_enc, decoder_in, labels, allowed, linked, crosslingual, width=self.width,
                           layout=None if self.layout is None else self.layout.to(device),
                           detach_relevance=self.detach_relevance)

    def pin_memory(self) -> "ModelInputs":
        """Page-locked copies, so that `.to(cuda, non_blocking=True)` overlaps with the device's work."""
        evidence, target_enc, decoder_in, labels, allowed, linked, crosslingual = (t.pin_memory()
                                                                                   for t in self.tensors())
        return ModelInputs(evidence, target_enc, decoder_in, labels, allowed, linked, crosslingual, width=self.width,
                           layout=None if self.layout is None else self.layout.pin_memory(),
                           detach_relevance=self.detach_relevance)

    def as_kwargs(self) -> dict[str, Tensor]:
        """The arguments of `Marge.forward`."""
        return dict(evidence_MS=self.evidence_MS, target_enc_NS=self.target_enc_NS, decoder_in_NT=self.decoder_in_NT,
                    labels_NT=self.labels_NT, allowed_NM=self.allowed_NM)


def text_lengths(docs) -> np.ndarray:
    return np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))


@dataclass(frozen=True)
class AttentionLayout:
    """How an unpadded batch's attention blocks are laid out (execution settings: the loss and gradients are the
    exact block's).

    rows, width  the blocks' rows (documents, targets) rounded up to a multiple of `rows`, their widths (positions,
                 the key slots a target reads) to a multiple of `width` (`trainer.bucket_rows`, `bucket_width`; 0:
                 exact): a fused attention kernel that builds a plan per exact shape (cuDNN's) then builds a few over
                 a run instead of a dozen new ones every update; the extra rows and columns are masked keys and
                 dropped queries.
    packed_cross the training cross-attention reads the packed evidence (`trainer.cross_attention: packed`,
                 `marge.model.layers.PackedCross`) instead of each target's gathered key slots."""

    rows: int = 0
    width: int = 0
    packed_cross: bool = False

    @staticmethod
    def _up(n: int, multiple: int) -> int:
        return -(-n // multiple) * multiple if multiple else n

    def block_rows(self, n: int) -> int:
        return self._up(n, self.rows)

    def block_width(self, n: int) -> int:
        return self._up(n, self.width)

    @classmethod
    def of(cls, trainer) -> "AttentionLayout":
        """The layout a `TrainerConfig` asks for."""
        return cls(trainer.bucket_rows, trainer.bucket_width, trainer.cross_attention == "packed")


EXACT = AttentionLayout()


def real_tokens(lengths: np.ndarray, width: int, attention: AttentionLayout = EXACT) -> RealTokens:
    """The `RealTokens` of right-padded rows of these lengths and width (vectorised; no per-token Python), in a
    block of `attention`'s rows and width."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    row_U = np.repeat(np.arange(len(lengths)), lengths)
    position_U = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    width = attention.block_width(width)
    return RealTokens(torch.from_numpy(row_U * width + position_U), torch.from_numpy(row_U),
                      torch.from_numpy(position_U), torch.from_numpy(starts), torch.from_numpy(lengths),
                      len(lengths), width, attention.block_rows(len(lengths)))


def packed_cross(decoder_lengths: np.ndarray, evidence_lengths: np.ndarray, allowed_NM: np.ndarray) -> PackedCross:
    """The `PackedCross` of a batch: each real decoder token's target and each memory key's document, padded to whole
    tiles, and the key tiles each query tile must read: those holding a document some target of the query tile
    may read (a product of three small incidence matrices: query tiles x targets, targets x documents, documents x
    key tiles)."""
    n, m = allowed_NM.shape
    queries, keys = int(decoder_lengths.sum()), int(evidence_lengths.sum())
    q_tiles, k_tiles = max(1, -(-queries // PACK_BLOCK)), max(1, -(-keys // PACK_BLOCK))
    target_Q = np.full(q_tiles * PACK_BLOCK, n, dtype=np.int64)
    target_Q[:queries] = np.repeat(np.arange(n), decoder_lengths)
    doc_L = np.full(k_tiles * PACK_BLOCK, m, dtype=np.int64)
    doc_L[:keys] = np.repeat(np.arange(m), evidence_lengths)
    tile_targets = np.zeros((q_tiles, n + 1), dtype=np.float32)
    tile_targets[np.arange(len(target_Q)) // PACK_BLOCK, target_Q] = 1
    doc_tiles = np.zeros((m + 1, k_tiles), dtype=np.float32)
    doc_tiles[doc_L, np.arange(len(doc_L)) // PACK_BLOCK] = 1
    readable = np.zeros((n + 1, m + 1), dtype=np.float32)
    readable[:n, :m] = allowed_NM
    reads_QK = (tile_targets @ readable @ doc_tiles) > 0
    kv_blocks = reads_QK.sum(1).astype(np.int32)
    kv_indices = np.argsort(~reads_QK, axis=1, kind="stable").astype(np.int32)  # the tiles read first, in order
    return PackedCross(torch.from_numpy(target_Q), torch.from_numpy(doc_L), torch.from_numpy(kv_blocks)[None, None],
                       torch.from_numpy(kv_indices)[None, None])


def unpadded_layout(evidence_text: np.ndarray, target_text: np.ndarray, allowed_NM: np.ndarray, evidence_width: int,
                    target_width: int, decoder_width: int, attention: AttentionLayout = EXACT) -> UnpaddedLayout:
    """The `UnpaddedLayout` of a batch's padded rows, from the text tokens of each evidence document and target and
    the rows' widths: its real tokens, and for each target the keys of the evidence it may read in a memory of the
    evidence's real tokens (a target reads only real keys: no padding slot), or, when some target may read every
    document, the whole memory for each (what `Marge.cross_memory` chooses too), laid out as `attention` says: the
    blocks' rows and widths rounded up (the cross-attention's rows are the decoder block's; its key slots, and the
    shared memory, padded with slots no target may read), and the `PackedCross` when the training cross-attention
    reads the packed evidence."""
    evidence_lengths = encoder_cost(evidence_text)
    offset_M = np.cumsum(evidence_lengths) - evidence_lengths  # where each document's keys start in the memory
    n, m = allowed_NM.shape
    block_rows = attention.block_rows(n)
    if m and bool(allowed_NM.sum(1).max() == m):  # someone reads every document: one shared memory, masked
        key_doc_L = np.repeat(np.arange(m), evidence_lengths)
        slots = attention.block_width(len(key_doc_L))
        key_doc, key_index = np.zeros((1, slots), dtype=np.int64), None
        key_doc[0, :len(key_doc_L)] = key_doc_L
        visible_NK = np.zeros((block_rows, slots), dtype=bool)
        visible_NK[:n, :len(key_doc_L)] = allowed_NM[:, key_doc_L]
    else:  # each target reads the keys of its own documents, one after another
        rows_P, docs_P = np.nonzero(allowed_NM)  # row-major: each target's documents in order
        lengths_P = evidence_lengths[docs_P]
        keys_N = np.bincount(rows_P, weights=lengths_P, minlength=n).astype(np.int64)
        total = int(lengths_P.sum())
        within = np.arange(total) - np.repeat(np.cumsum(lengths_P) - lengths_P, lengths_P)
        rows = np.repeat(rows_P, lengths_P)
        cols = np.arange(total) - np.repeat((np.cumsum(keys_N) - keys_N)[rows_P], lengths_P)
        width = attention.block_width(max(1, int(keys_N.max(initial=0))))
        key_index = np.zeros((block_rows, width), dtype=np.int64)
        key_doc = np.zeros((block_rows, width), dtype=np.int64)
        visible_NK = np.zeros((block_rows, width), dtype=bool)
        key_index[rows, cols] = np.repeat(offset_M[docs_P], lengths_P) + within
        key_doc[rows, cols] = np.repeat(docs_P, lengths_P)
        visible_NK[rows, cols] = True
    decoder_lengths = decoder_cost(target_text)
    return UnpaddedLayout(real_tokens(evidence_lengths, evidence_width, attention),
                          real_tokens(encoder_cost(target_text), target_width, attention),
                          real_tokens(decoder_lengths, decoder_width, attention),
                          torch.from_numpy(key_doc), torch.from_numpy(visible_NK),
                          None if key_index is None else torch.from_numpy(key_index),
                          packed_cross(decoder_lengths, evidence_lengths, allowed_NM) if attention.packed_cross else None)


def to_model_inputs(batch: Batch, specials: SpecialTokens, attend_to: str = "all",
                    unpadded: bool = False, attention: AttentionLayout = EXACT) -> ModelInputs:
    """Tensors for one batch.

    attend_to="all": every target cross-attends over all evidence in the batch except its own
    document (paper Eq. 2 conditions x_i on z_1..M). attend_to="linked": only over the evidence it
    has a graph edge to. unpadded: with the `UnpaddedLayout` that runs the batch on its real tokens only (the
    trainer's `unpadded`), its attention laid out as `attention` says (`AttentionLayout`).
    """
    if attend_to not in ATTEND_TO:
        raise ValueError(f"attend_to must be 'all' or 'linked', got {attend_to!r}")
    targets, evidence = np.asarray(batch.targets), np.asarray(batch.evidence)
    allowed_NM = batch.doc_ids[targets][:, None] != batch.doc_ids[evidence][None, :]  # a target never sees itself
    linked_NM = np.zeros_like(allowed_NM)
    linked_NM[batch.edges[:, 0], batch.edges[:, 1]] = True
    linked_NM &= allowed_NM
    langs = np.asarray(batch.doc_langs, dtype=object)
    crosslingual_NM = (langs[targets][:, None] != langs[evidence][None, :]).astype(bool)
    if attend_to == "linked":
        allowed_NM = allowed_NM & linked_NM
    target_docs = [batch.doc_tokens[i] for i in targets]
    evidence_MS = torch.from_numpy(encoder_rows([batch.doc_tokens[i] for i in evidence], specials))
    target_enc_NS = torch.from_numpy(encoder_rows(target_docs, specials))
    labels_NT = torch.from_numpy(label_rows(target_docs, specials))
    allowed = torch.from_numpy(allowed_NM)
    return ModelInputs(evidence_MS, target_enc_NS,
                       torch.from_numpy(decoder_rows(target_docs, [batch.doc_langs[i] for i in targets], specials)),
                       labels_NT, allowed, torch.from_numpy(linked_NM), torch.from_numpy(crosslingual_NM),
                       width=check_inputs(evidence_MS, allowed, specials.pad_id),
                       layout=unpadded_layout(text_lengths([batch.doc_tokens[i] for i in evidence]),
                                              text_lengths(target_docs), allowed_NM, evidence_MS.shape[1],
                                              target_enc_NS.shape[1], labels_NT.shape[1], attention)
                       if unpadded else None)


def untrainable(batch: Batch, specials: SpecialTokens, vocab_size: int, max_positions: int) -> str | None:
    """Why the model cannot take this batch (a token id outside the vocabulary, a document too long for the
    positions, a language without a token), or None. A batch like that is dead-lettered, never trained."""
    for i, tokens in enumerate(batch.doc_tokens):
        tokens = np.asarray(tokens)
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
            return (f"document {int(batch.doc_ids[i])} has token id {int(tokens.max()) if tokens.max() >= vocab_size else int(tokens.min())} "
                    f"outside the vocabulary (0..{vocab_size - 1})")
        if max(encoder_cost(len(tokens)), decoder_cost(len(tokens))) > max_positions:
            return f"document {int(batch.doc_ids[i])} has {len(tokens)} tokens, more than model.max_positions allows"
    unknown = sorted({batch.doc_langs[i] for i in batch.targets} - set(specials.lang_ids))
    if unknown:
        return f"target language(s) {unknown} have no language token in the tokenizer"
    return None


def substitute_batch(specials: SpecialTokens) -> Batch:
    """A two-document batch any model can take: trained with weight 0 in place of a dead-lettered batch, so that
    the rank still joins the update's gradient all-reduce (with a zero gradient)."""
    lang = next(iter(specials.lang_ids))
    tokens = np.array([specials.eos_id, specials.eos_id], dtype=np.int32)
    return Batch("substitute", -1, -1, np.array([-1, -2], dtype=np.int64), (lang, lang), (tokens, tokens),
                 np.array([0], dtype=np.int32), np.array([1], dtype=np.int32), np.array([[0, 0]], dtype=np.int32),
                 np.ones(1, dtype=np.float32))
