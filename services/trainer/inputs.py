"""From a `Batch` (the numpy contract) to the tensors `Marge.forward` takes: the trainer's side of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from marge.batch import (Batch, SpecialTokens, decoder_cost, decoder_rows, encoder_cost, encoder_rows,
                         label_rows)
from marge.model import PackedLayout, check_inputs

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
    width: int | None = None
    """`marge.model.check_inputs` of these tensors, made on the host: the forward then reads nothing back from the
    device (None: the forward checks)."""
    layout: PackedLayout | None = None
    """Rows sorted by length and the plan that runs them in length buckets (`packed_layout`); None: padded."""

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.evidence_MS, self.target_enc_NS, self.decoder_in_NT, self.labels_NT, self.allowed_NM,
                self.linked_NM)

    def to(self, device: torch.device | str) -> "ModelInputs":
        return ModelInputs(*(t.to(device, non_blocking=True) for t in self.tensors()), width=self.width,
                           layout=None if self.layout is None else self.layout.to(device))

    def pin_memory(self) -> "ModelInputs":
        """Page-locked copies, so that `.to(cuda, non_blocking=True)` overlaps with the device's work."""
        return ModelInputs(*(t.pin_memory() for t in self.tensors()), width=self.width,
                           layout=None if self.layout is None else self.layout.pin_memory())

    def as_kwargs(self) -> dict[str, Tensor]:
        """The arguments of `Marge.forward`."""
        return dict(evidence_MS=self.evidence_MS, target_enc_NS=self.target_enc_NS, decoder_in_NT=self.decoder_in_NT,
                    labels_NT=self.labels_NT, allowed_NM=self.allowed_NM)


BUCKET_MULTIPLE = 8
"""A bucket's positions are rounded up to a multiple of this (matrix kernels want multiples of 8)."""


def length_buckets(lengths: np.ndarray, max_buckets: int, multiple: int = BUCKET_MULTIPLE) -> list[tuple[int, int, int]]:
    """(first row, end row, positions) buckets over rows sorted by length (ascending), at most `max_buckets`,
    chosen to pad the fewest positions (exact, by dynamic programming over the distinct rounded lengths); a
    bucket's positions are its longest row rounded up to `multiple`, never past the longest row of all."""
    if len(lengths) == 0:
        return []
    longest = int(lengths[-1])
    rounded = np.minimum(-(-lengths // multiple) * multiple, longest)
    values = np.unique(rounded)
    ends = np.searchsorted(rounded, values, side="right")  # rows up to and including each distinct value
    k = len(values)
    cost = np.full((max_buckets + 1, k), np.inf)
    back = np.zeros((max_buckets + 1, k), dtype=np.int64)
    cost[1] = ends * values
    for b in range(2, max_buckets + 1):
        for j in range(k):
            cost[b, j], back[b, j] = cost[b - 1, j], -1  # fewer buckets are allowed
            for i in range(j):
                c = cost[b - 1, i] + (ends[j] - ends[i]) * values[j]
                if c < cost[b, j]:
                    cost[b, j], back[b, j] = c, i
    cuts, b, j = [], max_buckets, k - 1
    while j >= 0 and b >= 1:
        if b > 1 and back[b, j] == -1:
            b -= 1
            continue
        i = back[b, j] if b > 1 else -1
        cuts.append((int(ends[i]) if i >= 0 else 0, int(ends[j]), int(values[j])))
        j, b = i, b - 1
    return cuts[::-1]


def packed_layout(evidence_lengths: np.ndarray, target_lengths: np.ndarray, allowed_NM: np.ndarray,
                  max_buckets: int) -> PackedLayout:
    """The `PackedLayout` of a batch whose evidence and target rows are sorted by length (ascending):
    `evidence_lengths` encoder positions of each evidence row, `target_lengths` decoder positions of each target
    (its g row has one more). Vectorised over the batch's (target, document) pairs; no per-token Python."""
    evidence_rows = length_buckets(evidence_lengths, max_buckets)
    positions_M = np.concatenate([np.full(end - first, width) for first, end, width in evidence_rows]) \
        if evidence_rows else np.zeros(0, dtype=np.int64)
    offset_M = np.cumsum(positions_M) - positions_M  # where each document's keys start in the memory
    n, m = allowed_NM.shape
    if m and bool(allowed_NM.sum(1).max() == m):  # someone reads every document: one shared memory, masked
        key_doc_1L = np.repeat(np.arange(m), positions_M)[None]
        key_ok_L = (np.arange(int(positions_M.sum())) - np.repeat(offset_M, positions_M)) < np.repeat(evidence_lengths, positions_M)
        visible_NK = allowed_NM[:, key_doc_1L[0]] & key_ok_L[None]
        keys_N = np.full(n, key_doc_1L.shape[1])
        key_doc, key_index = key_doc_1L, None
    else:  # each target reads the real keys of its own documents only
        rows_P, docs_P = np.nonzero(allowed_NM)  # row-major: each target's documents in order
        lengths_P = evidence_lengths[docs_P]
        keys_N = np.bincount(rows_P, weights=lengths_P, minlength=n).astype(np.int64)
        total = int(lengths_P.sum())
        within = np.arange(total) - np.repeat(np.cumsum(lengths_P) - lengths_P, lengths_P)
        row_start_N = np.cumsum(keys_N) - keys_N
        rows = np.repeat(rows_P, lengths_P)
        cols = np.arange(total) - np.repeat(row_start_N[rows_P], lengths_P)
        width = max(1, int(keys_N.max(initial=0)))
        key_index, key_doc = np.zeros((n, width), dtype=np.int64), np.zeros((n, width), dtype=np.int64)
        visible_NK = np.zeros((n, width), dtype=bool)
        key_index[rows, cols] = np.repeat(offset_M[docs_P], lengths_P) + within
        key_doc[rows, cols] = np.repeat(docs_P, lengths_P)
        visible_NK[rows, cols] = True
    target_rows = []
    for first, end, positions in length_buckets(target_lengths, max_buckets):
        g_positions = int(target_lengths[end - 1]) + 1  # BOS, text, EOS: one more than the decoder's
        target_rows.append((first, end, positions, g_positions, max(1, int(keys_N[first:end].max()))))
    return PackedLayout(tuple(evidence_rows), tuple(target_rows), torch.from_numpy(key_doc),
                        torch.from_numpy(visible_NK), None if key_index is None else torch.from_numpy(key_index))


def to_model_inputs(batch: Batch, specials: SpecialTokens, attend_to: str = "all",
                    max_buckets: int = 0) -> ModelInputs:
    """Tensors for one batch.

    attend_to="all": every target cross-attends over all evidence in the batch except its own
    document (paper Eq. 2 conditions x_i on z_1..M). attend_to="linked": only over the evidence it
    has a graph edge to. max_buckets > 0: rows sorted by length, with the `PackedLayout` that runs them in at most
    that many length buckets (the trainer's `length_buckets`); 0: one padded block each.
    """
    if attend_to not in ATTEND_TO:
        raise ValueError(f"attend_to must be 'all' or 'linked', got {attend_to!r}")
    targets, evidence = np.asarray(batch.targets), np.asarray(batch.evidence)
    allowed_NM = batch.doc_ids[targets][:, None] != batch.doc_ids[evidence][None, :]  # a target never sees itself
    linked_NM = np.zeros_like(allowed_NM)
    linked_NM[batch.edges[:, 0], batch.edges[:, 1]] = True
    linked_NM &= allowed_NM
    if attend_to == "linked":
        allowed_NM = allowed_NM & linked_NM
    if max_buckets:  # rows sorted by length; the masks follow
        by_length_N = np.argsort([len(batch.doc_tokens[i]) for i in targets], kind="stable")
        by_length_M = np.argsort([len(batch.doc_tokens[i]) for i in evidence], kind="stable")
        targets, evidence = targets[by_length_N], evidence[by_length_M]
        allowed_NM, linked_NM = allowed_NM[by_length_N][:, by_length_M], linked_NM[by_length_N][:, by_length_M]
    evidence_docs = [batch.doc_tokens[i] for i in evidence]
    target_docs = [batch.doc_tokens[i] for i in targets]
    evidence_MS = torch.from_numpy(encoder_rows(evidence_docs, specials))
    allowed = torch.from_numpy(allowed_NM)
    layout = None
    if max_buckets:
        layout = packed_layout(np.fromiter((encoder_cost(len(d)) for d in evidence_docs), np.int64, len(evidence_docs)),
                               np.fromiter((decoder_cost(len(d)) for d in target_docs), np.int64, len(target_docs)),
                               allowed_NM, max_buckets)
    return ModelInputs(evidence_MS, torch.from_numpy(encoder_rows(target_docs, specials)),
                       torch.from_numpy(decoder_rows(target_docs, [batch.doc_langs[i] for i in targets], specials)),
                       torch.from_numpy(label_rows(target_docs, specials)), allowed, torch.from_numpy(linked_NM),
                       width=check_inputs(evidence_MS, allowed, specials.pad_id), layout=layout)


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
