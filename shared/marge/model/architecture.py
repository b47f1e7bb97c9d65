"""MARGE's architecture as a validated, frozen config: `MargeConfig` (and `ArchitectureConfig`, what VECO's config
shares with it), the named presets (`tiny`, `base`, `paper`) and parameter initialisation."""


from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Self

import torch
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ArchitectureConfig:
    """What every architecture's config (`MargeConfig`, `marge.model.veco.VecoConfig`) shares: the fields of a
    Transformer's embeddings and attention, declared once here, and what each config does besides holding its
    fields: its head width, its plain values to save, a saved config read back, field overrides and the named
    presets. Each family adds its own layers' fields."""

    vocab_size: int
    """Rows of the (tied) token embedding. Must be >= the tokenizer's vocabulary."""
    d_model: int
    """Width of every layer (paper: 1024)."""
    num_heads: int
    """Attention heads of every attention layer; divides d_model."""
    max_positions: int = 512
    """Longest document, target or input in tokens, specials included (paper: 512-token chunks)."""
    dropout: float = 0.1
    """Dropout on embeddings, residual branches and feed-forward hidden states."""
    attention_dropout: float = 0.0
    """Dropout on attention weights."""
    pad_id: int = 0
    """The tokenizer's padding id: padded positions are masked as keys everywhere and never predicted."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix and embedding."""
    embedding_layernorm: bool = True
    """A LayerNorm on token + position embedding before the first layer (BART's and mBART's `layernorm_embedding`;
    the paper does not say). Chosen because it learned fastest of the fixes measured: embeddings are drawn at std
    0.02, and without this norm the pre-LayerNorm residual stream starts at that scale, which kept a 2+2-layer
    model on a copy task at 8.09 nats/token after 300 updates while HF BART reached 0.85; with it, 0.66 (3 seeds;
    post-LN instead: 1.34, a 4.4x larger embedding init instead: 0.97; experiments/copy_race/copy_race.py,
    experiments/copy_race/README.md). False: the model before that change (and the `paper` preset: with it the
    paper's BOS-pooled g starts collapsed). The two families differ in their objective, not in this."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def upgraded(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A saved config's values as this version's fields take them (`from_dict`): what older versions saved
        dropped or given the meaning it had then. None to upgrade here."""
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        values = cls.upgraded(dict(values))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> Self:
        return replace(self, **overrides)

    @classmethod
    def from_preset(cls, presets: dict[str, dict[str, Any]], name: str, overrides: dict[str, Any],
                    what: str = "model") -> Self:
        """The architecture `presets` names `name`, with field overrides (validated like any other config)."""
        if name not in presets:
            raise ValueError(f"unknown {what} preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


@dataclass(frozen=True, kw_only=True)
class MargeConfig(ArchitectureConfig):
    """Architecture of one MARGE model. Built only through `MargeConfig(...)`/`preset()`, validated there."""

    encoder_layers: int
    """Bidirectional encoder layers (paper: 12); the first `relevance_layers` of them are g."""
    encoder_ffn: int
    """Hidden width of the encoder's feed-forward layers (paper: 4096)."""
    relevance_layers: int = 4
    """g = the BOS state after this many encoder layers (paper §2.2: 4)."""
    decoder_local_layers: int = 4
    """Self-attention + FFN layers at the decoder base, before any cross-attention (paper §3: 4)."""
    decoder_local_ffn: int
    """Hidden width of the self-attention-only decoder layers' feed-forward layers (paper: 4096)."""
    decoder_layers: int
    """Decoder layers with cross-attention over the evidence (paper: 12)."""
    decoder_ffn: int
    """Hidden width of the cross-attention decoder layers' feed-forward layers (paper: 16536)."""
    beta_init: float = 1.0
    """Initial value of the relevance-bias weight beta (the paper does not give one)."""
    relevance_centering: bool = False
    """Deviation from the paper (off in `paper`): f compares g minus a centre, so that a direction shared by
    all documents does not make every pair look relevant. In training the centre is the batch's mean g (the
    measured recipe); the model keeps a running mean of it (`relevance_center`) that snapshots carry, and
    the indexer, the retrieval service and the probes subtract that one (`unit_relevance`)."""
    relevance_pooling: str = "bos"
    """'bos': g is the first token's state (paper §2.2). Deviation 'mean': the mean of the relevance
    layer's states over the document's tokens (a far better random-init hash of the text)."""
    tie_encoder_embeddings: bool = True
    """True (as BART and the paper's preset): one token embedding for encoder input, decoder input and
    output. Deviation False: the encoder (and so g) gets its own input embedding, which the decoder's
    language-modelling softmax does not reshape."""
    own_relevance_encoder: bool = False
    """False (the paper, §2.2): g is the first `relevance_layers` layers of the encoder, which the evidence memory
    the decoder reads runs through too. Deviation True: g gets an encoder of its own (token and position
    embeddings, their norm and `relevance_layers` layers, shaped like the encoder's), which only f (and a loss on g,
    where one is configured) trains: neither the decoder's reading of the memory nor its language model reaches
    it. The first layers of the encoder then serve the memory alone."""

    def __post_init__(self) -> None:
        check_shared_fields(self, ("vocab_size", "d_model", "num_heads", "encoder_layers", "encoder_ffn",
                                   "decoder_local_ffn", "decoder_layers", "decoder_ffn", "max_positions",
                                   "relevance_layers"))
        if self.decoder_local_layers < 0:
            raise ValueError(f"model.decoder_local_layers must be >= 0, got {self.decoder_local_layers}")
        if self.relevance_layers > self.encoder_layers:
            raise ValueError(
                f"model.relevance_layers ({self.relevance_layers}) cannot exceed model.encoder_layers "
                f"({self.encoder_layers}): g shares the first layers of the encoder")
        if self.max_positions < 3:
            raise ValueError("model.max_positions must leave room for BOS, one token and EOS (>= 3)")
        if self.relevance_pooling not in ("bos", "mean"):
            raise ValueError(f"model.relevance_pooling must be 'bos' or 'mean', got {self.relevance_pooling!r}")

    @classmethod
    def upgraded(cls, values: dict[str, Any]) -> dict[str, Any]:
        for name in EXECUTION_FIELDS:  # saved by older versions in the architecture; they change no weight
            values.pop(name, None)
        for name, neutral in RETIRED_FIELDS.items():  # options removed because they showed no measured benefit
            if name in values and values.pop(name) != neutral:
                raise ValueError(f"this model was saved with {name}, an option that no longer exists: load it with "
                                 "the version of marge that trained it")
        # A config saved before `embedding_layernorm` existed describes a model without that norm (its
        # checkpoint or snapshot has no such tensors), not today's default.
        return {"embedding_layernorm": False, **values}


def check_shared_fields(cfg: Any, positive_ints: tuple[str, ...]) -> None:
    """The checks every architecture's config makes (`MargeConfig`, `marge.model.veco.VecoConfig`): positive sizes,
    heads that divide the width, dropout rates in [0, 1), a padding id inside the vocabulary."""
    for name in positive_ints:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
    if cfg.d_model % cfg.num_heads:
        raise ValueError(f"model.d_model ({cfg.d_model}) must be divisible by model.num_heads ({cfg.num_heads})")
    for name in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"model.{name} must be in [0, 1), got {getattr(cfg, name)}")
    if not 0 <= cfg.pad_id < cfg.vocab_size:
        raise ValueError(f"model.pad_id ({cfg.pad_id}) must be a valid token id below vocab_size ({cfg.vocab_size})")


def init_parameters(model: nn.Module, std: float, pad_id: int) -> None:
    """Every architecture's initialisation: Linear and Embedding weights N(0, std), biases 0, LayerNorms the
    identity, and the padding row of every embedding 0."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[pad_id].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


RETIRED_FIELDS: dict[str, Any] = {
    "beta_per_layer": False, "relevance_distill_weight": 0.0, "relevance_distill_temperature": 0.1,
    "relevance_contrastive_weight": 0.0, "relevance_contrastive_temperature": 0.1,
    "relevance_layers_from_reconstruction": True,
}
"""Fields of older saved configs, with the value that means "off": such a config loads when they are off."""

EXECUTION_FIELDS: dict[str, str] = {"loss_chunk_tokens": "trainer.loss_chunk_tokens"}
"""Execution settings older versions kept in the model's config, and where they live now: dropped when a saved
config loads (they change no weight), refused with their new place in a run's `model:` section."""

RELEVANCE_CENTER_MOMENTUM = 0.01
"""Weight of each training batch's mean g in the running centre (`Marge.relevance_center`): ~100 batches."""

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a laptop CPU; every test uses it.
    "tiny": dict(vocab_size=8000, d_model=64, num_heads=4, encoder_layers=3, encoder_ffn=256,
                 relevance_layers=2, decoder_local_layers=1, decoder_local_ffn=256, decoder_layers=2,
                 decoder_ffn=512, max_positions=512, dropout=0.0),
    # A single-GPU model for an hour-long run.
    "base": dict(vocab_size=32000, d_model=512, num_heads=8, encoder_layers=6, encoder_ffn=2048,
                 relevance_layers=4, decoder_local_layers=2, decoder_local_ffn=2048, decoder_layers=6,
                 decoder_ffn=4096, max_positions=512, dropout=0.1),
    # Paper §3 / Table 1: 12x1024 encoder (FFN 4096), 4 local decoder layers (FFN 4096), 12 decoder
    # layers with FFN 16536, 250k vocabulary: 963M parameters.
    # The paper is silent on where the LayerNorms go. Unlike the other presets this one has no LayerNorm on the
    # embeddings: with it, the paper's g (the BOS state after 4 layers) starts collapsed, every document at a
    # mean cosine of 0.979 to every other; without it 0.532, and held-out P@1 of g at initialisation 0.198 vs
    # 0.189 (3 seeds, 8 directions; benchmarks/init_spread.py, benchmarks/results/init-spread.json).
    "paper": dict(vocab_size=250_000, d_model=1024, num_heads=16, encoder_layers=12, encoder_ffn=4096,
                  relevance_layers=4, decoder_local_layers=4, decoder_local_ffn=4096, decoder_layers=12,
                  decoder_ffn=16536, max_positions=512, dropout=0.1, embedding_layernorm=False),
}


def preset(name: str, **overrides: Any) -> MargeConfig:
    """The named architecture, with optional field overrides (validated like any other config)."""
    return MargeConfig.from_preset(PRESETS, name, overrides)

