"""Sizes and throughput: parameter counts (on the meta device, no storage), their breakdown, and the training FLOPs
per target token that MFU and `marge plan` use."""


from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from marge.model.architecture import PRESETS, MargeConfig, preset
from marge.model.layers import (
    CrossMemory,
    EncodedEvidence,
    LayerCache,
    RealTokens,
    UnpaddedLayout,
    pad_rows,
    unit_relevance,
)
from marge.model.network import Marge, MargeOutput, RelevanceEncoder, relevance_state_dict


def build_on_meta(cfg: MargeConfig) -> Marge:
    """The model with no storage behind its parameters: for counting and planning, not for running."""
    with torch.device("meta"):
        return Marge(cfg)


def count_parameters(model: nn.Module) -> int:
    """Parameters, counting the tied input/output embedding once."""
    return sum(p.numel() for p in model.parameters())


def parameter_breakdown(model: Marge) -> dict[str, int]:
    def n(mod: nn.Module | nn.Parameter) -> int:
        return mod.numel() if isinstance(mod, nn.Parameter) else count_parameters(mod)

    return {
        "embeddings": n(model.embed_tokens) + n(model.encoder_positions) + n(model.decoder_positions)
        + sum(n(m) for m in (model.encoder_embed_tokens, model.encoder_embedding_norm, model.decoder_embedding_norm)
              if m is not None),
        "encoder": n(model.encoder_layers) + n(model.encoder_norm),
        "decoder_local": n(model.decoder_local_layers),
        "decoder_cross": n(model.decoder_layers) + n(model.decoder_norm),
        "beta": n(model.beta),
    }


def training_flops(cfg: MargeConfig, target_tokens: float, evidence_tokens: float, relevance_tokens: float) -> float:
    """Approximate training FLOPs (6 x parameters touched per token) of a step that decodes `target_tokens` (the
    output layer included), encodes `evidence_tokens` through the whole encoder and `relevance_tokens` through g
    alone (the targets' g, the denoising loss's views): for MFU figures that credit every pass a step makes."""
    d = cfg.d_model
    enc_layer = 4 * d * d + 2 * d * cfg.encoder_ffn
    dec_local = 4 * d * d + 2 * d * cfg.decoder_local_ffn
    dec_cross = 8 * d * d + 2 * d * cfg.decoder_ffn
    decoder = cfg.decoder_local_layers * dec_local + cfg.decoder_layers * dec_cross + d * cfg.vocab_size
    return 6.0 * (decoder * target_tokens + cfg.encoder_layers * enc_layer * evidence_tokens
                  + cfg.relevance_layers * enc_layer * relevance_tokens)


def training_flops_per_token(cfg: MargeConfig, evidence_per_target_tokens: float = 1.0) -> float:
    """Approximate training FLOPs per target token (6 x parameters touched), for MFU figures: a target's decoding, its
    g, and `evidence_per_target_tokens` encoded evidence tokens per target token."""
    return training_flops(cfg, 1.0, evidence_per_target_tokens, 1.0)


__all__ = [
    "PRESETS", "CrossMemory", "EncodedEvidence", "LayerCache", "Marge", "MargeConfig", "MargeOutput", "RealTokens",
    "RelevanceEncoder", "UnpaddedLayout", "build_on_meta", "count_parameters", "pad_rows", "parameter_breakdown", "preset",
    "relevance_state_dict", "training_flops", "training_flops_per_token", "unit_relevance",
]
