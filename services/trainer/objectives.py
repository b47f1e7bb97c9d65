"""What the trainer optimises: the objectives of a run, each with its settings (the `objectives:` section).

An objective is a plug-in (fairseq's criterion idea): it owns how its inputs are made from a batch of corpus
documents (`prepare`, CPU, no model) and what loss the model pays on them (`loss`); the training step sums the
weighted losses and logs each. The models (`marge.model.network`, `marge.model.veco`) hold only architectures.

    objectives:
      marge:                  {weight: 1.0, attend_to: all}                       # paper Eq. 2
      bart:                   {weight: 1.0, text_infilling: 0.3, sentence_permutation: 1.0}
      veco:                   {weight: 1.0, mask_share: 0.15, pairs: halves}       # CA-MLM, its own model
      self_evidence:          {prob: 0.5, until: 1500, deletion: 0.3}             # deviation, off in `paper`
      denoising_contrastive:  {weight: 0.3, deletion: 0.6, temperature: 0.05, extra_documents: 64}  # deviation

A section that names none of marge, bart and veco trains MARGE alone; one that names some trains exactly
those. What the run needs follows from them (`ObjectivesConfig.needs_index`, `.batches`, `.model_family`):

* **marge** — reconstruct every target from the evidence of its batch, cross-attention biased by
  beta * f (paper Eq. 2, 4): needs the retrieval index and batches built from its graph. `attend_to: all`
  lets a target read every evidence document of its batch (Eq. 2 conditions x_i on z_1..M); deviation
  `linked`: only those it has a retrieval link to.
* **bart** (Lewis et al. 2019) — reconstruct each target document from a noised copy of itself
  (`services.trainer.noising`: text infilling and sentence permutation by default, the BART paper's best
  pair), on the same encoder-decoder with no relevance bias; the decoder's language token selects the output
  language (mBART). Alone it needs no index: the batcher packs documents. With marge it denoises the targets
  of MARGE's batches (the batcher counts that work in the token budget): the mixture this project compares,
  because denoising teaches the decoder to read its encoder from the first update, which MARGE's retrieved
  evidence does not (experiments/copy_race/README.md).
* **veco** (Luo et al. 2020) — cross-attention masked LM on pairs (x, y), its own model (`marge.model.veco`):
  `pairs: halves` splits each document at the sentence end nearest its middle (VECO's rule for monolingual
  text: adjacent segments of one document; no index); `pairs: index` pairs each target of a MARGE batch with
  its strongest cross-lingual link (pseudo-parallel text from MARGE's own index; no translation data).
* **self_evidence** (deviation, with marge) — early in training the decoder has no reason to read its
  evidence: retrieved documents are translations or paraphrases it cannot yet use, so the reconstruction loss
  ignores them and g gets no signal. A share `prob` of targets also receives a noised copy of itself as an
  extra, linked evidence document (tokens deleted, neighbours shuffled), which the decoder learns to read
  within tens of updates, as in a denoising autoencoder. The share anneals linearly to 0 at `until`.
* **denoising_contrastive** (deviation, with marge) — makes g a discriminative fingerprint of a document: two
  noised views of every document in the batch, which carries `extra_documents` random unlinked documents of its
  shard as more negatives (the batcher adds them from its bounded store; embedded with the current parameters: a
  queue of stale vectors lets the encoder drift away from them, a degenerate solution), must find each other
  (SimCSE style). g learns which tokens identify a
  document, like a learned IDF, and across languages the tokens they share.
* **relevance_distillation** (extension beyond the paper, with marge) — f is trained towards which documents the
  decoder actually reads: KL(reading || softmax(f / temperature)) over each target's evidence (by default only
  the evidence in other languages), where `reading` is the last cross-attention layer's attention without the
  beta * f term, averaged over heads, target tokens and each document's keys, and given no gradient (ADist of
  Izacard & Grave 2021 and Atlas). Its gradient reaches g through f whatever beta is, and under
  `marge.detach_relevance` too (only beta * f's own path is cut): the control of what beta * f adds beyond it.

Randomness is keyed by (run seed, step, slot of the batch in the step), so a batch is prepared the same
way on a DDP rank, in the reference loop and in the single-process run.

Each objective is registered (`services.trainer.objective_registry`: its settings, its random stream, its role and
how it is built), and `Objectives` builds the configured ones from the registry: a new objective is one class and
one registration, its settings under `objectives.registered.<name>` (or, for one of this package, a field here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from marge.contracts.batch import (
    ENCODER_SPECIALS,
    Batch,
    SpecialTokens,
    as_decoder_input,
    as_encoder_input,
    as_labels,
    encoder_rows_flat,
)
from marge.contracts.config import ConfigError, FieldError, at_least, build, one_of, positive, within
from marge.model.layers import RealTokens, pad_rows
from marge.model.network import Marge, MargeOutput
from marge.model.veco import mlm_mask
from services.trainer.inputs import ATTEND_TO, EXACT, AttentionLayout, ModelInputs, real_tokens, to_model_inputs
from services.trainer.noising import BartNoise, bart_noise
from services.trainer.objective_registry import (
    PASSES,
    REGISTRY,
    ObjectiveContext,
    ObjectiveLoss,
    Registration,
    register,
)

VECO_PAIRS = ("halves", "index")
MAIN_OBJECTIVES = ("marge", "bart", "veco")
"""Objectives that can make up a run on their own; the first configured one is the run's logged `loss`."""


# ----------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MargeObjectiveConfig:
    weight: float = 1.0
    """Weight of this loss in the sum the step backpropagates."""
    attend_to: str = "all"
    """'all': a target cross-attends to every evidence document of its batch (paper Eq. 2); deviation
    'linked': only to the ones it has a retrieval link to."""
    detach_relevance: bool = False
    """A control, not a recipe: true keeps beta * f in the cross-attention logits but lets no gradient reach g
    through f, so g learns only from what reaches it otherwise (the encoder's memory, an auxiliary loss). The
    difference in g's retrieval against the same run with false is what the relevance bias teaches g
    (experiments/mechanism)."""
    detach_relevance_until: int = 0
    """Deviation (0 in `paper`): f is detached as above for the updates before this one, then trains g. With
    self-evidence over the same updates the decoder learns to read its evidence as text (copying from a noised
    copy of the target) without g being rewarded for recognising a document's own copy."""
    train_beta: bool = True
    """A control: false keeps beta at `model.beta_init` for the whole run (no gradient, not in the optimizer)."""

    def __post_init__(self) -> None:
        positive(self, "weight")
        one_of(self, "attend_to", ATTEND_TO)
        at_least(self, "detach_relevance_until", 0)

    def detached_at(self, step: int) -> bool:
        """Whether update `step` trains with f detached."""
        return self.detach_relevance or step < self.detach_relevance_until


@dataclass(frozen=True, kw_only=True)
class BartObjectiveConfig(BartNoise):
    """The BART objective: its weight and its noise (`BartNoise`: which noising functions, at which rates)."""

    weight: float = 1.0
    """Weight of this loss in the sum the step backpropagates."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "weight")


@dataclass(frozen=True, kw_only=True)
class VecoObjectiveConfig:
    weight: float = 1.0
    """Weight of this loss in the sum the step backpropagates."""
    mask_share: float = 0.15
    """Share of each side's tokens chosen for the masked LM (80% mask, 10% random, 10% kept: BERT, VECO)."""
    pairs: str = "halves"
    """'halves': (x, y) = the two halves of a document, split at the sentence end nearest its middle (VECO's
    adjacent-sentence rule for monolingual text); 'index': a MARGE batch's target and its strongest
    cross-lingual link (pseudo-parallel pairs from the index; needs one)."""

    def __post_init__(self) -> None:
        positive(self, "weight")
        within(self, "mask_share", 0.0, 1.0)
        if self.mask_share == 0:
            raise FieldError("mask_share", 0, "> 0")
        one_of(self, "pairs", VECO_PAIRS)


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
    """Weight of this loss in the sum the step backpropagates."""
    deletion: float = 0.6
    """Share of a view's tokens deleted."""
    temperature: float = 0.05
    """Softmax temperature of the cosines between views."""
    extra_documents: int = 32
    """Random unlinked documents of its shard each batch carries as more negatives (the batcher draws them from its
    bounded store: `services.batcher.config.BatchShape.negatives`; no trainer reads the corpus)."""

    def __post_init__(self) -> None:
        positive(self, "weight", "temperature")
        within(self, "deletion", 0.0, 1.0, high_open=True)
        at_least(self, "extra_documents", 0)


@dataclass(frozen=True, kw_only=True)
class RelevanceDistillationConfig:
    weight: float
    """Weight of this loss in the sum the step backpropagates."""
    temperature: float = 0.1
    """f is divided by this before the softmax the decoder's reading is matched against (f is a cosine in [-1, 1])."""
    crosslingual_only: bool = True
    """Match only over each target's evidence in other languages (the documents retrieval is judged on), not over
    same-language evidence, which the decoder reads for what it shares with the target's page."""

    def __post_init__(self) -> None:
        positive(self, "weight", "temperature")


@dataclass(frozen=True, kw_only=True)
class ObjectivesConfig:
    """The run's objectives; an absent (null) entry is off. Naming none of marge, bart, veco means marge."""

    marge: MargeObjectiveConfig | None = None
    """MARGE's reconstruction loss (paper Eq. 2); trained when no main objective is named."""
    bart: BartObjectiveConfig | None = None
    """BART's denoising loss on the batch's targets (alone: document batches, no index)."""
    veco: VecoObjectiveConfig | None = None
    """VECO's cross-attention masked LM, on its own model (never with marge or bart)."""
    self_evidence: SelfEvidenceConfig | None = None
    """Deviation: noised copies of targets as extra evidence early in training (with marge)."""
    denoising_contrastive: DenoisingContrastiveConfig | None = None
    """Deviation: a contrastive loss that makes g a fingerprint of its document (with marge)."""
    relevance_distillation: RelevanceDistillationConfig | None = None
    """Extension beyond the paper: f is trained to match which documents the decoder reads (with marge)."""
    registered: dict[str, Any] = field(default_factory=dict)
    """Objectives registered outside this package (`services.trainer.objective_registry.register`), by their
    registered name: each one's settings, as its registration's settings class takes them."""
    imports: list[str] = field(default_factory=list)
    """Modules that register the objectives named in `registered`, imported wherever the objectives are read or
    built (the driver and every trainer worker), so that a worker knows them too: importable on every node."""

    def __post_init__(self) -> None:
        if all(getattr(self, name) is None for name in MAIN_OBJECTIVES):
            object.__setattr__(self, "marge", MargeObjectiveConfig())  # the default run: MARGE alone
        import_modules(self.imports)
        object.__setattr__(self, "registered", {name: registered_settings(name, value)
                                                for name, value in self.registered.items()})
        if self.self_evidence is not None and self.self_evidence.prob == 0:
            raise FieldError("self_evidence.prob", 0, "> 0 (or leave self_evidence out to turn it off)")
        if self.veco is not None and (self.marge is not None or self.bart is not None):
            raise ConfigError("objectives.veco trains its own model (an encoder with plug-in cross-attention, "
                              "marge.model.veco); it cannot share a run with marge or bart (an encoder-decoder): "
                              "configure veco alone")
        if self.marge is None:
            for aux in self.enabled:
                if REGISTRY[aux].needs_marge:
                    key = f"objectives.registered.{aux}" if aux in self.registered else f"objectives.{aux}"
                    raise ConfigError(f"{key} is an auxiliary of the marge objective: add objectives.marge or "
                                      f"remove {aux}")

    def import_registrations(self) -> None:
        """Imports `imports` (again a no-op where done) and checks that every objective of `registered` is registered
        in this process: a worker that lacked one would otherwise train without it."""
        import_modules(self.imports)
        missing = sorted(set(self.registered) - set(REGISTRY))
        if missing:
            raise ConfigError(f"objectives.registered: {missing} not registered in this process: name the module "
                              "that registers them in objectives.imports, so that every process imports it")

    def config_of(self, name: str) -> Any:
        """The settings of objective `name` (None: not configured)."""
        if name in self.registered:
            return self.registered[name]
        return getattr(self, name, None) if name in BUILT_IN else None

    @property
    def enabled(self) -> tuple[str, ...]:
        """The configured objectives in registration order, main ones first."""
        ordered = sorted(REGISTRY.values(), key=lambda r: r.role != "main")  # stable: registration order within
        return tuple(r.name for r in ordered if self.config_of(r.name) is not None)

    @property
    def primary(self) -> str:
        """The objective whose loss is the run's `loss` (train_log, summary): the first of marge, bart, veco."""
        return next(name for name in MAIN_OBJECTIVES if getattr(self, name) is not None)

    @property
    def needs_index(self) -> bool:
        """Whether batches come from the retrieval index (and so the indexer runs and snapshots are published)."""
        return self.marge is not None or (self.veco is not None and self.veco.pairs == "index")

    @property
    def batches(self) -> str:
        """'retrieval': the batcher's greedy subgraphs of the index graph; 'documents': documents packed without
        an index (every document a target)."""
        return "retrieval" if self.needs_index else "documents"

    @property
    def model_family(self) -> str:
        """'marge' (the encoder-decoder of `marge.model.network`) or 'veco' (`marge.model.veco`)."""
        return "veco" if self.veco is not None else "marge"

    @property
    def extra_target_passes(self) -> int:
        """Extra encoder+decoder passes per target a retrieval batch's budget must hold (bart on MARGE's targets)."""
        return 1 if self.bart is not None and self.batches == "retrieval" else 0

    @property
    def batch_negatives(self) -> int:
        """Unlinked documents each retrieval batch carries for the objectives (the most any of them asks for)."""
        return max((REGISTRY[name].negatives(self.config_of(name)) for name in self.enabled), default=0)


BUILT_IN = tuple(f.name for f in fields(ObjectivesConfig) if f.name not in ("registered", "imports"))
"""The objectives with a field of their own in `ObjectivesConfig` (registered at the end of this module)."""


def import_modules(modules: list[str]) -> None:
    """`objectives.imports`, imported (a module imported before is not run again)."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"objectives.imports: cannot import {module!r} ({e}); the module that registers an "
                              "objective must be importable on every node (install it, or ship it with the job's "
                              "working_dir)") from None


def registered_settings(name: str, value: Any) -> Any:
    """`objectives.registered.<name>`'s settings as its registration's class (a mapping from YAML is built and
    checked; settings already built pass through)."""
    registration = REGISTRY.get(name)
    if registration is None or name in BUILT_IN:
        known = sorted(set(REGISTRY) - set(BUILT_IN))
        what = "has its own key: objectives." + name if name in BUILT_IN else "is not a registered objective"
        raise ConfigError(f"objectives.registered.{name}: {what} (registered outside this package: {known or 'none'}; "
                          "register one with services.trainer.objective_registry.register in a module named in "
                          "objectives.imports)")
    if registration.role == "main":
        raise ConfigError(f"objectives.registered.{name}: a main objective decides the run's batches and model, "
                          "which only this package's main objectives (marge, bart, veco) declare")
    if isinstance(value, registration.config):
        return value
    return build(registration.config, value, f"objectives.registered.{name}")


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
                    rng: np.random.Generator) -> tuple[Tensor, Tensor] | None:
    """Two noised views (encoder input rows) of every document of the batch: its targets, its evidence and the
    unlinked negatives it carries (`BatchShape.negatives`)."""
    docs = [np.asarray(d) for d in batch.doc_tokens if len(d) > 1]
    if len(docs) < 2:
        return None
    flat = np.concatenate(docs).astype(np.int64)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    starts = np.cumsum(lengths) - lengths
    doc_of = np.repeat(np.arange(len(docs)), lengths)

    def view() -> Tensor:
        # `noised(d, cfg.deletion, 1, rng)` of every document in one draw (the same random numbers, in the same order)
        keep = rng.random(len(flat)) >= cfg.deletion
        kept_N = np.bincount(doc_of, weights=keep, minlength=len(docs))
        keep[starts[kept_N == 0]] = True  # a document that lost every token keeps its first
        return torch.from_numpy(encoder_rows_flat(flat[keep], np.bincount(doc_of[keep], minlength=len(docs)), specials))
    first = view()
    return first, view()


def denoising_loss(model: Marge, views: tuple[Tensor, Tensor], temperature: float,
                   real: tuple[RealTokens, RealTokens] | None = None) -> Tensor:
    """Each view must pick its twin among all the others (cross-entropy both ways, temperature-scaled cosines).
    `real`: the views' real tokens (g then runs on those alone)."""
    a = F.normalize(model.relevance_vectors(views[0], None if real is None else real[0]).float(), dim=-1)
    b = F.normalize(model.relevance_vectors(views[1], None if real is None else real[1]).float(), dim=-1)
    logits = a @ b.T / temperature
    labels = torch.arange(len(a), device=a.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


# ----------------------------------------------------------------------------------------------------
# The objectives as plug-ins
# ----------------------------------------------------------------------------------------------------


def first_text_id(specials: SpecialTokens) -> int:
    """Ids from here on are text pieces (never pad, BOS, EOS, <unk>/mask or a language token): where random
    replacement tokens are drawn from."""
    return max(specials.pad_id, specials.bos_id, specials.eos_id, specials.mask_id, *specials.lang_ids.values()) + 1


class Tensors(dict):
    """An objective's prepared tensors (or `RealTokens`) by name, movable as one (to the device, into pinned
    memory)."""

    def to(self, device: torch.device | str) -> "Tensors":
        return Tensors({k: v.to(device, non_blocking=True) for k, v in self.items()})

    def pin_memory(self) -> "Tensors":
        return Tensors({k: v.pin_memory() for k, v in self.items()})


def core_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (for methods other than forward, which DDP does not wrap)."""
    return cast(torch.nn.Module, model.module) if hasattr(model, "module") else model  # DDP's .module: the Module


class MargeObjective:
    """Paper Eq. 2: every target reconstructed from its batch's evidence, cross-attention biased by beta * f; with
    `distillation`, also f matched to which documents the decoder reads (`relevance_distillation_loss`)."""

    name = "marge"

    def __init__(self, cfg: MargeObjectiveConfig, specials: SpecialTokens, unpadded: bool = False,
                 distillation: RelevanceDistillationConfig | None = None, attention: AttentionLayout = EXACT):
        self.cfg, self.specials, self.unpadded, self.distillation = cfg, specials, unpadded, distillation
        self.attention = attention

    def prepare(self, batch: Batch, rng: np.random.Generator | None, step: int = 0) -> ModelInputs:
        inputs = to_model_inputs(batch, self.specials, self.cfg.attend_to, self.unpadded, self.attention)
        inputs.detach_relevance = self.cfg.detached_at(step)
        return inputs

    def output(self, model: torch.nn.Module, inputs: ModelInputs) -> MargeOutput:
        """The model's whole output on the prepared batch (f with its graph, per-target NLL): what `loss` sums and
        diagnostics read (`services.trainer.gradient_paths`)."""
        # width was checked on the host: no device read in the forward
        return model(**inputs.as_kwargs(), width=inputs.width, detach_relevance=inputs.detach_relevance,
                     layout=inputs.layout, reading=self.distillation is not None)

    def loss(self, model: torch.nn.Module, inputs: ModelInputs) -> ObjectiveLoss:
        out = self.output(model, inputs)
        return ObjectiveLoss(out.loss, out.tokens_per_target_N.sum(), self.companion_losses(out, inputs),
                             out.relevance_NM)

    def work(self, inputs: ModelInputs, pad_id: int) -> dict[str, int]:
        return {"target": real_count(inputs.labels_NT, pad_id), "evidence": real_count(inputs.evidence_MS, pad_id),
                "relevance": real_count(inputs.target_enc_NS, pad_id)}

    def companion_losses(self, out: MargeOutput, inputs: ModelInputs) -> dict[str, Tensor]:
        """Losses made from the same forward as the reconstruction's (`output`): the relevance distillation."""
        if self.distillation is None or out.reading_NM is None:
            return {}
        d = self.distillation
        candidates_NM = inputs.allowed_NM & inputs.crosslingual_NM if d.crosslingual_only else inputs.allowed_NM
        return {"relevance_distillation": relevance_distillation_loss(out.relevance_NM, out.reading_NM, candidates_NM,
                                                                      d.temperature)}


def relevance_distillation_loss(relevance_NM: Tensor, reading_NM: Tensor, candidates_NM: Tensor,
                                temperature: float) -> Tensor:
    """Mean over targets with at least two candidates of KL(reading || softmax(f / temperature)), both taken over
    the target's candidate documents (the reading renormalised there); 0 (with f's graph) when no target has two."""
    rows_N = candidates_NM.sum(1) >= 2
    if not bool(rows_N.any()):
        return relevance_NM.sum() * 0.0
    f_RM, teacher_RM, ok_RM = relevance_NM[rows_N].float(), reading_NM[rows_N].float(), candidates_NM[rows_N]
    teacher_RM = teacher_RM.masked_fill(~ok_RM, 0.0)
    teacher_RM = teacher_RM / teacher_RM.sum(1, keepdim=True).clamp(min=1e-12)
    log_student_RM = (f_RM / temperature).masked_fill(~ok_RM, float("-inf")).log_softmax(-1).masked_fill(~ok_RM, 0.0)
    log_teacher_RM = teacher_RM.clamp(min=1e-12).log().masked_fill(~ok_RM, 0.0)
    return (teacher_RM * (log_teacher_RM - log_student_RM)).sum(1).mean()


class BartObjective:
    """BART: each target reconstructed from a noised copy of itself (the only evidence it sees, no relevance
    bias); in a MARGE batch, the batch's targets."""

    name = "bart"

    def __init__(self, cfg: BartObjectiveConfig, specials: SpecialTokens, sentence_ends: np.ndarray,
                 vocab_size: int):
        self.cfg, self.specials, self.sentence_ends, self.vocab_size = cfg, specials, sentence_ends, vocab_size
        self.text_low = first_text_id(specials)

    def prepare(self, batch: Batch, rng: np.random.Generator, step: int = 0) -> Tensors:
        sp = self.specials
        sources, decoder_in, labels = [], [], []
        for i in batch.targets:
            tokens = np.asarray(batch.doc_tokens[i])
            noisy = bart_noise(tokens, self.cfg, sp.mask_id, self.sentence_ends, rng, self.vocab_size, self.text_low)
            sources.append(as_encoder_input(noisy[: max(1, len(tokens))], sp))  # never longer than the original
            decoder_in.append(as_decoder_input(tokens, batch.doc_langs[i], sp))
            labels.append(as_labels(tokens, sp))
        n = len(sources)
        return Tensors(evidence_MS=pad_rows(sources, sp.pad_id), decoder_in_NT=pad_rows(decoder_in, sp.pad_id),
                       labels_NT=pad_rows(labels, sp.pad_id), allowed_NM=torch.eye(n, dtype=torch.bool))

    def loss(self, model: torch.nn.Module, inputs: Tensors) -> ObjectiveLoss:
        # each target reads its own noised copy (an identity mask), every row starts with BOS: width 1 (one document
        # per target; for a single target that is every document, the shared layout), known without a device read
        out = model(evidence_MS=inputs["evidence_MS"], target_enc_NS=None, decoder_in_NT=inputs["decoder_in_NT"],
                    labels_NT=inputs["labels_NT"], allowed_NM=inputs["allowed_NM"], width=1)
        return ObjectiveLoss(out.loss, out.tokens_per_target_N.sum())

    def work(self, inputs: Tensors, pad_id: int) -> dict[str, int]:
        return {"target": real_count(inputs["labels_NT"], pad_id), "evidence": real_count(inputs["evidence_MS"], pad_id)}


def split_in_halves(tokens: np.ndarray, sentence_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two adjacent segments of a document (>= 2 tokens): cut after the sentence end nearest its middle, or in
    the middle when no sentence ends inside."""
    middle = len(tokens) // 2
    ends = np.flatnonzero(np.isin(tokens[:-1], sentence_ends)) + 1  # cut positions that leave both sides non-empty
    cut = int(ends[np.argmin(np.abs(ends - middle))]) if len(ends) else middle
    return tokens[:cut], tokens[cut:]


class VecoObjective:
    """VECO's CA-MLM on pairs (x, y): both sides masked, each predicted from itself and from itself + the other
    side's last-layer states (`marge.model.veco.Veco.forward`)."""

    name = "veco"

    def __init__(self, cfg: VecoObjectiveConfig, specials: SpecialTokens, sentence_ends: np.ndarray,
                 vocab_size: int):
        self.cfg, self.specials, self.sentence_ends, self.vocab_size = cfg, specials, sentence_ends, vocab_size
        self.text_low = first_text_id(specials)

    def pairs(self, batch: Batch) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.cfg.pairs == "index":
            strongest: dict[int, tuple[float, int]] = {}
            for (t, e), w in zip(batch.edges.tolist(), batch.edge_weights.tolist()):
                t_doc, e_doc = int(batch.targets[t]), int(batch.evidence[e])
                if batch.doc_langs[t_doc] != batch.doc_langs[e_doc] and w > strongest.get(t, (-np.inf, 0))[0]:
                    strongest[t] = (w, e_doc)
            linked = [(np.asarray(batch.doc_tokens[int(batch.targets[t])]), np.asarray(batch.doc_tokens[e]))
                      for t, (_, e) in sorted(strongest.items())]
            if linked:
                return linked  # a batch without a cross-lingual link falls back to halves
        docs = [np.asarray(batch.doc_tokens[i]) for i in batch.targets]
        return [split_in_halves(d, self.sentence_ends) for d in docs if len(d) >= 2] or \
               [(d, d) for d in docs]  # one-token documents only (the substitute batch): a copy pair

    def prepare(self, batch: Batch, rng: np.random.Generator, step: int = 0) -> Tensors:
        sp = self.specials
        rows: dict[str, list[list[int]]] = {"x_in": [], "x_labels": [], "y_in": [], "y_labels": []}
        for x, y in self.pairs(batch):
            for side, tokens in (("x", x), ("y", y)):
                masked, labels = mlm_mask(tokens, self.cfg.mask_share, sp.mask_id, self.text_low, self.vocab_size, rng)
                rows[f"{side}_in"].append(as_encoder_input(masked, sp))
                rows[f"{side}_labels"].append([sp.pad_id, *np.where(labels < 0, sp.pad_id, labels).tolist(), sp.pad_id])
        return Tensors({f"{name}_BS": pad_rows(r, sp.pad_id) for name, r in rows.items()})

    def loss(self, model: torch.nn.Module, inputs: Tensors) -> ObjectiveLoss:
        out = model(inputs["x_in_BS"], inputs["x_labels_BS"], inputs["y_in_BS"], inputs["y_labels_BS"])
        text_tokens = ((inputs["x_in_BS"] != self.specials.pad_id).sum() + (inputs["y_in_BS"] != self.specials.pad_id).sum()
                       - 2 * ENCODER_SPECIALS * inputs["x_in_BS"].shape[0])  # x and y rows, without BOS and EOS
        return ObjectiveLoss(out.loss, text_tokens)

    def work(self, inputs: Tensors, pad_id: int) -> dict[str, int]:
        return {}  # VECO's passes are counted by its own formula (`marge.model.sizes`)


class DenoisingContrastiveObjective:
    """(Deviation, with marge) two noised views of every document must find each other through g."""

    name = "denoising_contrastive"

    def __init__(self, cfg: DenoisingContrastiveConfig, specials: SpecialTokens, unpadded: bool = False,
                 attention: AttentionLayout = EXACT):
        self.cfg, self.specials, self.unpadded, self.attention = cfg, specials, unpadded, attention

    def prepare(self, batch: Batch, rng: np.random.Generator, step: int = 0) -> Tensors | None:
        views = denoising_views(batch, self.cfg, self.specials, rng)
        if views is None:
            return None
        out = Tensors(first=views[0], second=views[1])
        if self.unpadded:
            for name, view in tuple(out.items()):
                out[f"{name}_real"] = real_tokens((view != self.specials.pad_id).sum(1).numpy(), view.shape[1],
                                                  self.attention)
        return out

    def loss(self, model: torch.nn.Module, views: Tensors) -> ObjectiveLoss:
        real = (views["first_real"], views["second_real"]) if "first_real" in views else None
        # the trainer's model is a Marge (or a compiled one, which forwards its methods)
        loss = denoising_loss(cast(Marge, core_model(model)), (views["first"], views["second"]), self.cfg.temperature,
                              real)
        return ObjectiveLoss(loss, torch.zeros((), dtype=torch.long))

    def work(self, views: Tensors, pad_id: int) -> dict[str, int]:
        return {"relevance": real_count(views["first"], pad_id) + real_count(views["second"], pad_id)}


class SelfEvidence:
    """(Deviation, with marge) an augmentation: noised self-copies added to a batch as evidence (`with_self_evidence`)."""

    name = "self_evidence"

    def __init__(self, cfg: SelfEvidenceConfig):
        self.cfg = cfg

    def augment(self, batch: Batch, step: int, rng: np.random.Generator) -> Batch:
        return with_self_evidence(batch, self.cfg, step, rng)


def real_count(tokens: Tensor, pad_id: int) -> int:
    """Tokens of `tokens` that are not padding."""
    return int((tokens != pad_id).sum())


@dataclass
class PreparedBatch:
    """A batch's CPU-side work done: augmented, and each objective's tensors made (None: nothing to train on).

    Preparing needs no model, so a single-process trainer prepares the next step's batches in a thread
    while the device runs this one; the DDP worker prepares and computes in turn.
    """

    batch_id: str
    parts: dict[str, Any]  # each objective's own inputs (ModelInputs, Tensors, ...), or None

    def pin_memory(self) -> "PreparedBatch":
        return PreparedBatch(self.batch_id, {k: None if v is None else v.pin_memory() for k, v in self.parts.items()})


@dataclass
class Losses:
    objective: Tensor
    """The weighted sum the step backpropagates."""
    parts: dict[str, Tensor]
    """Each objective's loss, detached; `parts[primary]` (e.g. marge's mean NLL per target token) is the step's
    logged loss. Tensors, not floats: reading them waits for the device, which the step does once, at its end."""
    target_tokens: Tensor
    """Tokens the primary objective reconstructs (marge, bart: target text + EOS; veco: the pair's text)."""
    weighted: dict[str, Tensor] = field(default_factory=dict)
    """Each loss times its weight, with its graph (what `objective` sums): for diagnostics of where gradients come
    from (`services.trainer.gradient_paths`)."""
    relevance_NM: Tensor | None = None
    """f of the marge forward, with its graph where it has one."""


class Objectives:
    """The configured objectives: `prepare` a batch (CPU), then `losses` of the prepared batch on the model."""

    def __init__(self, cfg: ObjectivesConfig, specials: SpecialTokens, sentence_ends: np.ndarray | None = None,
                 vocab_size: int | None = None, unpadded: bool = False, attention: AttentionLayout = EXACT):
        """`unpadded`: MARGE batches and the denoising loss's views run on their real tokens only
        (`trainer.unpadded`), their attention laid out as `attention` says (`AttentionLayout.of` the trainer's
        settings). Each configured objective is built by its registration."""
        cfg.import_registrations()  # in a worker, the section arrives pickled: its __post_init__ did not run here
        context = ObjectiveContext(specials, sentence_ends, vocab_size, unpadded, attention, cfg)
        self.cfg, self.specials, self.primary = cfg, specials, cfg.primary
        self.plugins: list = []
        """The objectives with a loss of their own, in `cfg.enabled`'s order."""
        self.augmentations: list = []
        """The objectives that change a batch before the plug-ins prepare it."""
        for name in cfg.enabled:
            registration = REGISTRY[name]
            if registration.build is not None:
                built = registration.build(cfg.config_of(name), context)
                (self.augmentations if registration.role == "augmentation" else self.plugins).append(built)
        self.weights = {p.name: cfg.config_of(p.name).weight for p in self.plugins}
        self.weights.update({name: cfg.config_of(name).weight for name in cfg.enabled
                             if REGISTRY[name].role == "companion"})
        self.part_names = tuple(self.weights)
        """Every loss the step sums, as logged: each plug-in's, and the marge objective's companions."""

    def prepare(self, batch: Batch, seed_key: tuple[int, ...]) -> PreparedBatch:
        """`seed_key` = (run seed, step, slot of the batch within the step)."""
        step = seed_key[1] if len(seed_key) > 1 else 0
        for augmentation in self.augmentations:
            batch = augmentation.augment(batch, step, objective_rng(augmentation.name, seed_key))
        parts = {p.name: p.prepare(batch, objective_rng(p.name, seed_key), step) for p in self.plugins}
        return PreparedBatch(batch.batch_id, parts)

    def work(self, prepared: PreparedBatch) -> dict[str, int]:
        """Tokens each kind of pass (`PASSES`) of the step processes for a prepared batch, augmentation included
        (self-evidence copies, the denoising loss's views), summed over the objectives (`Objective.work`): what MFU
        credits. Counted when asked (only where MFU is measured), not while batches are prepared."""
        work = dict.fromkeys(PASSES, 0)
        for plugin in self.plugins:
            if prepared.parts[plugin.name] is not None:
                for kind, tokens in plugin.work(prepared.parts[plugin.name], self.specials.pad_id).items():
                    work[kind] += tokens
        return work

    def losses(self, model: torch.nn.Module, prepared: PreparedBatch, device: torch.device, bf16: bool) -> Losses:
        """The weighted objective of one prepared batch (`model` may be DDP-wrapped: its forward runs the model)."""
        objective, parts, tokens, relevance = None, {}, None, None
        weighted: dict[str, Tensor] = {}
        # one autocast region for every objective of the batch: autocast keeps the bf16 copy of each fp32 weight
        # until its outermost region ends, so the weights are cast once per batch, not once per objective
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            for plugin in self.plugins:
                inputs = prepared.parts[plugin.name]
                if inputs is None:
                    continue
                out = plugin.loss(model, inputs.to(device))
                if out.relevance_NM is not None:
                    relevance = out.relevance_NM
                for name, value in {plugin.name: out.loss, **out.companions}.items():
                    weighted[name] = self.weights[name] * value
                    objective = weighted[name] if objective is None else objective + weighted[name]
                    parts[name] = value.detach()
                if plugin.name == self.primary:
                    tokens = out.predicted
        if objective is None or tokens is None:  # the step backpropagates the objective and counts these tokens
            raise ValueError(f"batch {prepared.batch_id}: the primary objective {self.primary!r} has nothing to "
                             "train on (untrainable() should have set this batch aside)")
        return Losses(objective, parts, tokens, weighted, relevance)


def objective_rng(name: str, seed_key: tuple[int, ...]) -> np.random.Generator | None:
    """Objective `name`'s generator for the batch of `seed_key`: its own stream of the key (None for an objective that
    draws nothing)."""
    stream = REGISTRY[name].rng_stream
    return None if stream is None else np.random.default_rng([*seed_key, stream])


def apply_objective_settings(model: torch.nn.Module, cfg: ObjectivesConfig) -> torch.nn.Module:
    """What the objectives change about the model's trainable parameters, applied before the optimizer and any DDP
    wrapper are built: `objectives.marge.train_beta: false` takes beta out of training (no gradient, so neither
    the optimizer nor DDP's all-reduce sees it)."""
    if cfg.marge is not None and not cfg.marge.train_beta and hasattr(model, "beta"):
        model.beta.requires_grad_(False)
    return model


def objectives_for(cfg: ObjectivesConfig, tokenizer, unpadded: bool = False,
                   attention: AttentionLayout = EXACT) -> Objectives:
    """The run's objectives with what they need from its tokenizer (`marge.contracts.tokenizer.MargeTokenizer`)."""
    from services.trainer.noising import sentence_end_ids

    pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    return Objectives(cfg, tokenizer.specials, sentence_end_ids(pieces), tokenizer.vocab_size, unpadded, attention)


# ----------------------------------------------------------------------------------------------------
# The built-in objectives' registrations
# ----------------------------------------------------------------------------------------------------


def tokenizer_facts(context: ObjectiveContext) -> tuple[np.ndarray, int]:
    """The sentence ends and vocabulary size bart and veco need, or a clear error."""
    if context.sentence_ends is None or context.vocab_size is None:
        raise ValueError("the bart and veco objectives need the tokenizer's sentence ends and vocabulary size "
                         "(build them with `objectives_for`)")
    return context.sentence_ends, context.vocab_size




# the random streams are those every run so far drew from: changing one changes every figure made with it (marge
# draws nothing; self_evidence's stream 0 is the seed key itself, which it drew from before objectives had streams)
register(Registration("marge", MargeObjectiveConfig, None, "main", needs_marge=False,
                      build=lambda cfg, c: MargeObjective(cfg, c.specials, c.unpadded,
                                                          c.settings.relevance_distillation, c.attention)))
register(Registration("bart", BartObjectiveConfig, 2, "main", needs_marge=False,
                      build=lambda cfg, c: BartObjective(cfg, c.specials, *tokenizer_facts(c))))
register(Registration("veco", VecoObjectiveConfig, 3, "main", needs_marge=False,
                      build=lambda cfg, c: VecoObjective(cfg, c.specials, *tokenizer_facts(c))))
register(Registration("self_evidence", SelfEvidenceConfig, 0, "augmentation", build=lambda cfg, c: SelfEvidence(cfg)))
register(Registration("denoising_contrastive", DenoisingContrastiveConfig, 1, "auxiliary",
                      build=lambda cfg, c: DenoisingContrastiveObjective(cfg, c.specials, c.unpadded, c.attention),
                      negatives=lambda cfg: cfg.extra_documents))
register(Registration("relevance_distillation", RelevanceDistillationConfig, None, "companion"))
