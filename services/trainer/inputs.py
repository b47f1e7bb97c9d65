"""From a `Batch` (the numpy contract) to the tensors `Marge.forward` takes: the trainer's side of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from marge.batch import Batch, SpecialTokens, as_decoder_input, as_encoder_input, as_labels
from marge.model import check_inputs, pad_rows


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

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.evidence_MS, self.target_enc_NS, self.decoder_in_NT, self.labels_NT, self.allowed_NM,
                self.linked_NM)

    def to(self, device: torch.device | str) -> "ModelInputs":
        return ModelInputs(*(t.to(device, non_blocking=True) for t in self.tensors()), width=self.width)

    def pin_memory(self) -> "ModelInputs":
        """Page-locked copies, so that `.to(cuda, non_blocking=True)` overlaps with the device's work."""
        return ModelInputs(*(t.pin_memory() for t in self.tensors()), width=self.width)

    def as_kwargs(self) -> dict[str, Tensor]:
        """The arguments of `Marge.forward`."""
        return dict(evidence_MS=self.evidence_MS, target_enc_NS=self.target_enc_NS, decoder_in_NT=self.decoder_in_NT,
                    labels_NT=self.labels_NT, allowed_NM=self.allowed_NM)


def to_model_inputs(batch: Batch, specials: SpecialTokens, attend_to: str = "all") -> ModelInputs:
    """Tensors for one batch.

    attend_to="all": every target cross-attends over all evidence in the batch except its own
    document (paper Eq. 2 conditions x_i on z_1..M). attend_to="linked": only over the evidence it
    has a graph edge to.
    """
    enc = [as_encoder_input(batch.doc_tokens[i], specials) for i in batch.evidence]
    tgt = [batch.doc_tokens[i] for i in batch.targets]
    target_enc = [as_encoder_input(t, specials) for t in tgt]
    decoder_in = [as_decoder_input(batch.doc_tokens[i], batch.doc_langs[i], specials) for i in batch.targets]
    labels = [as_labels(t, specials) for t in tgt]
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
    evidence_MS = pad_rows(enc, specials.pad_id)
    return ModelInputs(evidence_MS, pad_rows(target_enc, specials.pad_id), pad_rows(decoder_in, specials.pad_id),
                       pad_rows(labels, specials.pad_id), allowed_NM, linked_NM,
                       width=check_inputs(evidence_MS, allowed_NM, specials.pad_id))


def untrainable(batch: Batch, specials: SpecialTokens, vocab_size: int, max_positions: int) -> str | None:
    """Why the model cannot take this batch (a token id outside the vocabulary, a document too long for the
    positions, a language without a token), or None. A batch like that is dead-lettered, never trained."""
    from marge.batch import decoder_cost, encoder_cost

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
