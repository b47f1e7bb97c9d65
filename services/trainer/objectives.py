"""What the trainer optimises: the objectives of a run, each with its settings (the `objectives:` section).

An objective owns how its inputs are made from a batch of corpus documents and what loss the model pays
(fairseq's criterion idea); the training step sums the weighted losses. The model (`marge.model`) holds
only the architecture and its reconstruction loss.

    objectives:
      marge:                  {weight: 1.0, attend_to: all}                       # paper Eq. 2
      self_evidence:          {prob: 0.5, until: 1500, deletion: 0.3}             # deviation, off in `paper`
      denoising_contrastive:  {weight: 0.3, deletion: 0.6, temperature: 0.05, extra_documents: 64}  # deviation

* **marge** — reconstruct every target from the evidence of its batch, cross-attention biased by
  beta * f (paper Eq. 2, 4). `attend_to: all` lets a target read every evidence document of its batch
  (Eq. 2 conditions x_i on z_1..M); deviation `linked`: only those it has a retrieval link to.
* **self_evidence** (deviation) — early in training the decoder has no reason to read its evidence:
  retrieved documents are translations or paraphrases it cannot yet use, so the reconstruction loss
  ignores them and g gets no signal. A share `prob` of targets also receives a noised copy of itself as
  an extra, linked evidence document (tokens deleted, neighbours shuffled), which the decoder learns to
  read within tens of updates, as in a denoising autoencoder. The share anneals linearly to 0 at `until`.
* **denoising_contrastive** (deviation) — makes g a discriminative fingerprint of a document: two
  noised views of every document in the batch, plus `extra_documents` random corpus documents as more
  negatives (embedded with the current parameters: a queue of stale vectors lets the encoder drift away
  from them, a degenerate solution), must find each other (SimCSE style). g learns which tokens identify a
  document, like a learned IDF, and across languages the tokens they share.

Randomness is keyed by (run seed, step, slot of the batch in the step), so a batch is prepared the same
way on a DDP rank, in the reference loop and in the single-process run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from marge.batch import Batch, SpecialTokens, as_encoder_input
from marge.config import FieldError, at_least, one_of, positive, within
from marge.model import Marge, pad_rows
from services.trainer.inputs import ModelInputs, to_model_inputs

ATTEND_TO = ("all", "linked")


# ----------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MargeObjectiveConfig:
    weight: float = 1.0
    attend_to: str = "all"
    """'all': a target cross-attends to every evidence document of its batch (paper Eq. 2); deviation
    'linked': only to the ones it has a retrieval link to."""

    def __post_init__(self) -> None:
        positive(self, "weight")
        one_of(self, "attend_to", ATTEND_TO)


@dataclass(frozen=True, kw_only=True)
class SelfEvidenceConfig:
    prob: float
    """Share of targets given a noised copy of themselves at step 0."""
    until: int
    """The share falls linearly to 0 at this step."""
    deletion: float = 0.3
    """Share of the copy's tokens deleted."""
    shuffle_window: int = 3
    """Tokens move at most this far (local shuffling)."""

    def __post_init__(self) -> None:
        within(self, "prob", 0.0, 1.0)
        positive(self, "until", "shuffle_window")
        within(self, "deletion", 0.0, 1.0, high_open=True)

    def prob_at(self, step: int) -> float:
        return 0.0 if step >= self.until else self.prob * (1.0 - step / self.until)


@dataclass(frozen=True, kw_only=True)
class DenoisingContrastiveConfig:
    weight: float
    deletion: float = 0.6
    """Share of a view's tokens deleted."""
    temperature: float = 0.05
    extra_documents: int = 32
    """Random corpus documents added to each batch's loss as negatives."""

    def __post_init__(self) -> None:
        positive(self, "weight", "temperature")
        within(self, "deletion", 0.0, 1.0, high_open=True)
        at_least(self, "extra_documents", 0)


@dataclass(frozen=True, kw_only=True)
class ObjectivesConfig:
    """The run's objectives; an absent (null) entry is off."""

    marge: MargeObjectiveConfig = field(default_factory=MargeObjectiveConfig)
    self_evidence: SelfEvidenceConfig | None = None
    denoising_contrastive: DenoisingContrastiveConfig | None = None

    def __post_init__(self) -> None:
        if self.self_evidence is not None and self.self_evidence.prob == 0:
            raise FieldError("self_evidence.prob", 0, "> 0 (or leave self_evidence out to turn it off)")

    @property
    def needs_corpus(self) -> bool:
        """Whether the trainer must read the corpus (the denoising loss draws extra negatives from it)."""
        return self.denoising_contrastive is not None and self.denoising_contrastive.extra_documents > 0


# ----------------------------------------------------------------------------------------------------
# Noise
# ----------------------------------------------------------------------------------------------------


def noised(tokens: np.ndarray, deletion: float, shuffle_window: int, rng: np.random.Generator) -> np.ndarray:
    """`tokens` with a `deletion` share deleted (at least one kept) and the rest moved at most `shuffle_window - 1`."""
    keep = rng.random(len(tokens)) >= deletion
    kept = tokens[keep] if keep.any() else tokens[:1]
    if shuffle_window > 1 and len(kept) > 1:
        order = np.argsort(np.arange(len(kept)) + rng.uniform(0, shuffle_window, size=len(kept)), kind="stable")
        kept = kept[order]
    return kept.astype(np.int32)


def with_self_evidence(batch: Batch, cfg: SelfEvidenceConfig, step: int, rng: np.random.Generator) -> Batch:
    """The batch with noised self-copies added as linked evidence for a `prob_at(step)` share of its targets."""
    p = cfg.prob_at(step)
    if p <= 0:
        return batch
    chosen = [i for i in range(batch.num_targets) if rng.random() < p]
    if not chosen:
        return batch
    doc_ids, langs, tokens = list(batch.doc_ids), list(batch.doc_langs), list(batch.doc_tokens)
    evidence, edges, weights = list(batch.evidence), [tuple(e) for e in batch.edges], list(batch.edge_weights)
    fresh = -1 - int(max(0, -min(doc_ids))) if min(doc_ids) < 0 else -1
    for t in chosen:
        target_doc = int(batch.targets[t])
        doc_ids.append(fresh)
        fresh -= 1
        langs.append(batch.doc_langs[target_doc])
        tokens.append(noised(np.asarray(batch.doc_tokens[target_doc]), cfg.deletion, cfg.shuffle_window, rng))
        evidence.append(len(doc_ids) - 1)
        edges.append((t, len(evidence) - 1))
        weights.append(1.0)
    return Batch(batch.batch_id, batch.index_version, batch.snapshot_step, np.array(doc_ids, dtype=np.int64),
                 tuple(langs), tuple(tokens), batch.targets, np.array(evidence, dtype=np.int32),
                 np.array(edges, dtype=np.int32).reshape(-1, 2), np.array(weights, dtype=np.float32))


def denoising_views(batch: Batch, cfg: DenoisingContrastiveConfig, specials: SpecialTokens,
                    corpus_tokens: list | None, rng: np.random.Generator) -> tuple[Tensor, Tensor] | None:
    """Two noised views (encoder input rows) of every document of the batch and of the extra negatives."""
    docs = list(batch.doc_tokens)
    if corpus_tokens and cfg.extra_documents:
        docs += [corpus_tokens[i] for i in rng.integers(len(corpus_tokens), size=cfg.extra_documents)]
    docs = [np.asarray(d) for d in docs if len(d) > 1]
    if len(docs) < 2:
        return None
    first, second = (pad_rows([as_encoder_input(noised(d, cfg.deletion, 1, rng), specials) for d in docs],
                              specials.pad_id) for _ in range(2))
    return first, second


def denoising_loss(model: Marge, views: tuple[Tensor, Tensor], temperature: float) -> Tensor:
    """Each view must pick its twin among all the others (cross-entropy both ways, temperature-scaled cosines)."""
    a = F.normalize(model.relevance_vectors(views[0]).float(), dim=-1)
    b = F.normalize(model.relevance_vectors(views[1]).float(), dim=-1)
    logits = a @ b.T / temperature
    labels = torch.arange(len(a), device=a.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


# ----------------------------------------------------------------------------------------------------
# The objectives of a run
# ----------------------------------------------------------------------------------------------------


@dataclass
class PreparedBatch:
    """A batch's CPU-side work done: augmented, turned into tensors, its extra views drawn.

    Preparing needs no model, so a single-process trainer prepares the next step's batches in a thread
    while the device runs this one; the DDP worker prepares and computes in turn.
    """

    batch_id: str
    inputs: ModelInputs
    denoise_views: tuple[Tensor, Tensor] | None = None

    def pin_memory(self) -> "PreparedBatch":
        views = None if self.denoise_views is None else tuple(v.pin_memory() for v in self.denoise_views)
        return PreparedBatch(self.batch_id, self.inputs.pin_memory(), views)


@dataclass
class Losses:
    objective: Tensor
    """The weighted sum the step backpropagates."""
    parts: dict[str, Tensor]
    """Each objective's loss, detached; `parts["marge"]` (mean NLL per target token) is the step's logged loss.
    Tensors, not floats: reading them waits for the device, which the step does once, at its end."""
    target_tokens: Tensor


class Objectives:
    """The configured objectives: `prepare` a batch (CPU), then `losses` of the prepared batch on the model."""

    def __init__(self, cfg: ObjectivesConfig, specials: SpecialTokens, corpus_tokens: list | None = None):
        if cfg.needs_corpus and not corpus_tokens:
            raise ValueError("objectives.denoising_contrastive.extra_documents > 0 needs the corpus's documents")
        self.cfg, self.specials, self.corpus_tokens = cfg, specials, corpus_tokens

    def prepare(self, batch: Batch, seed_key: tuple[int, ...]) -> PreparedBatch:
        """`seed_key` = (run seed, step, slot of the batch within the step)."""
        if self.cfg.self_evidence is not None:
            step = seed_key[1] if len(seed_key) > 1 else 0
            batch = with_self_evidence(batch, self.cfg.self_evidence, step, np.random.default_rng(list(seed_key)))
        views = None
        if self.cfg.denoising_contrastive is not None:
            views = denoising_views(batch, self.cfg.denoising_contrastive, self.specials, self.corpus_tokens,
                                    np.random.default_rng([*seed_key, 1]))
        return PreparedBatch(batch.batch_id, to_model_inputs(batch, self.specials, self.cfg.marge.attend_to), views)

    def losses(self, model: torch.nn.Module, prepared: PreparedBatch, device: torch.device, bf16: bool) -> Losses:
        """The weighted objective of one prepared batch (`model` may be DDP-wrapped: its forward runs the model)."""
        inputs = prepared.inputs.to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(**inputs.as_kwargs())
        objective = self.cfg.marge.weight * out.loss
        parts = {"marge": out.loss.detach()}
        denoising = self.cfg.denoising_contrastive
        if denoising is not None and prepared.denoise_views is not None:
            core = model.module if hasattr(model, "module") else model  # DDP wraps the model
            views = tuple(v.to(device, non_blocking=True) for v in prepared.denoise_views)
            loss = denoising_loss(core, views, denoising.temperature)
            objective = objective + denoising.weight * loss
            parts["denoising_contrastive"] = loss.detach()
        return Losses(objective, parts, out.tokens_per_target_N.sum())
