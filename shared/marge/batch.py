"""The training batch: a subgraph of the evidence/target graph, and its conversion to model tensors.

A batch holds each document once (a document may be a target and evidence at the same time), the
indices of its targets and evidence documents, and the graph edges that made the batcher put them
together. It carries the index version and snapshot step it was built from, so the trainer can log
staleness. `marge.protocol` serialises it for the queue; `to_model_inputs` turns it into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class SpecialTokens:
    pad_id: int
    bos_id: int
    eos_id: int
    lang_ids: dict[str, int]

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
        return int(sum(len(self.doc_tokens[i]) + 1 for i in self.targets))

    def cost_tokens(self) -> int:
        """The budget measure: encoder tokens of the evidence + decoder tokens of the targets (specials included)."""
        return int(sum(len(self.doc_tokens[i]) + 2 for i in self.evidence)
                   + sum(len(self.doc_tokens[i]) + 1 for i in self.targets))

    def cross_lingual_edge_share(self) -> float:
        if len(self.edges) == 0:
            return 0.0
        t_lang = [self.doc_langs[self.targets[t]] for t in self.edges[:, 0]]
        e_lang = [self.doc_langs[self.evidence[e]] for e in self.edges[:, 1]]
        return float(np.mean([a != b for a, b in zip(t_lang, e_lang)]))


@dataclass
class ModelInputs:
    """The tensors `Marge.forward` takes (see its docstring for their meaning)."""

    evidence_MS: Tensor
    target_enc_NS: Tensor
    decoder_in_NT: Tensor
    labels_NT: Tensor
    allowed_NM: Tensor
    linked_NM: Tensor  # the batch's retrieval links (target i -> evidence j), for auxiliary losses on f

    def to(self, device: torch.device | str) -> "ModelInputs":
        return ModelInputs(*(t.to(device, non_blocking=True) for t in
                             (self.evidence_MS, self.target_enc_NS, self.decoder_in_NT, self.labels_NT, self.allowed_NM,
                              self.linked_NM)))

    def pin_memory(self) -> "ModelInputs":
        """Page-locked copies, so that `.to(cuda, non_blocking=True)` overlaps with the device's work."""
        return ModelInputs(*(t.pin_memory() for t in (self.evidence_MS, self.target_enc_NS, self.decoder_in_NT,
                                                      self.labels_NT, self.allowed_NM, self.linked_NM)))

    def as_kwargs(self) -> dict[str, Tensor]:
        return dict(evidence_MS=self.evidence_MS, target_enc_NS=self.target_enc_NS, decoder_in_NT=self.decoder_in_NT,
                    labels_NT=self.labels_NT, allowed_NM=self.allowed_NM, linked_NM=self.linked_NM)


def pad_rows(rows: list[list[int]], pad_id: int) -> Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


def as_encoder_input(tokens: np.ndarray | list[int], specials: SpecialTokens) -> list[int]:
    """BOS, the text, EOS: how every document enters the encoder (language-agnostic on purpose)."""
    return [specials.bos_id, *map(int, tokens), specials.eos_id]


def to_model_inputs(batch: Batch, specials: SpecialTokens, attend_to: str = "all") -> ModelInputs:
    """Tensors for one batch.

    attend_to="all": every target cross-attends over all evidence in the batch except its own
    document (paper Eq. 2 conditions x_i on z_1..M). attend_to="linked": only over the evidence it
    has a graph edge to.
    """
    enc = [as_encoder_input(batch.doc_tokens[i], specials) for i in batch.evidence]
    tgt = [batch.doc_tokens[i] for i in batch.targets]
    target_enc = [as_encoder_input(t, specials) for t in tgt]
    decoder_in = [[specials.lang_id(batch.doc_langs[i]), *map(int, batch.doc_tokens[i])] for i in batch.targets]
    labels = [[*map(int, t), specials.eos_id] for t in tgt]
    target_doc_N = torch.as_tensor(batch.doc_ids[batch.targets])
    evidence_doc_M = torch.as_tensor(batch.doc_ids[batch.evidence])
    allowed_NM = target_doc_N[:, None] != evidence_doc_M[None, :]  # a target never sees itself
    linked_NM = torch.zeros_like(allowed_NM)
    linked_NM[torch.as_tensor(batch.edges[:, 0], dtype=torch.long), torch.as_tensor(batch.edges[:, 1], dtype=torch.long)] = True
    linked_NM &= allowed_NM
    if attend_to == "linked":
        allowed_NM = allowed_NM & linked_NM
    elif attend_to != "all":
        raise ValueError(f"attend_to must be 'all' or 'linked', got {attend_to!r}")
    return ModelInputs(pad_rows(enc, specials.pad_id), pad_rows(target_enc, specials.pad_id),
                       pad_rows(decoder_in, specials.pad_id), pad_rows(labels, specials.pad_id), allowed_NM, linked_NM)
