"""VECO: a Transformer encoder with a plug-and-play cross-attention module, pre-trained with CA-MLM
(Luo et al. 2020, "VECO: Variable and Flexible Cross-lingual Pre-training", §2).

A baseline family beside MARGE, built from the same blocks (`marge.model.layers.Attention`, `FeedForward`, `embed`):

* every layer has three modules: bidirectional self-attention (theta_s), a cross-attention module (theta_c)
  and an FFN; the cross-attention's queries come from this stream's previous layer (S^{l-1}), its keys and
  values from the PAIRED input's last-layer states H^L;
* the cross-attention module is plugged out (skipped entirely) when no paired states are given: the model
  is then a plain pre-LayerNorm encoder, H = `encode(x)` (mBERT-like), and plugged in otherwise,
  S = `encode(x, paired=H_y)`;
* CA-MLM on a pair (x, y) and its masked version (x^, y^) (paper Eq. 3):
  -log P(x|x^) - log P(x|y^, x^) - log P(y|y^) - log P(y|x^, y^), where the first and third terms read H
  (plug-out) and the second and fourth read S (plug-in, keys/values from the other side's H).

The paper builds on XLM-R (post-LayerNorm); this module uses marge's pre-LayerNorm layers and embedding
LayerNorm, so that a VECO and a MARGE model of one width and depth are trained and compared alike.

Tensor-shape legend (suffixes on variable names):
    B  pairs (rows) in the batch      S  positions of this stream      P  positions of the paired input
    W  positions of x and y padded to one width    M  masked (labelled) positions gathered from a batch
    D  model width    H  attention heads    E  head width = D // H    V  vocabulary
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from marge.model.architecture import ArchitectureConfig, check_shared_fields, init_parameters
from marge.model.layers import Attention, FeedForward, embed
from marge.model.sizes import count_parameters

FAMILY = "veco"
"""The model family this module builds (MARGE's is `marge.model.network`); configs do not carry it as a field."""

# ----------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VecoConfig(ArchitectureConfig):
    """Architecture of one VECO model. Built only through `VecoConfig(...)`/`veco_preset()`, validated there."""

    layers: int
    """Layers, each with self-attention, a cross-attention module and an FFN (paper, VECO-large: 24)."""
    ffn: int
    """Hidden width of every layer's feed-forward layers."""

    def __post_init__(self) -> None:
        check_shared_fields(self, ("vocab_size", "d_model", "num_heads", "layers", "ffn", "max_positions"))
        if not self.init_std > 0.0:
            raise ValueError(f"model.init_std must be > 0, got {self.init_std}")
        if not isinstance(self.embedding_layernorm, bool):
            raise ValueError(f"model.embedding_layernorm must be true or false, got {self.embedding_layernorm!r}")


VECO_PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a laptop CPU. Depth 6 = marge tiny's 3 encoder + 1 local + 2 cross decoder layers, so that
    # the two families are compared at one depth and width.
    "tiny": dict(vocab_size=8000, d_model=64, num_heads=4, layers=6, ffn=256, max_positions=512, dropout=0.0),
    # A single-GPU model for an hour-long run: depth 14 = marge base's 6 + 2 + 6.
    "base": dict(vocab_size=32000, d_model=512, num_heads=8, layers=14, ffn=2048, max_positions=512, dropout=0.1),
    # Paper §4.1, VECO-large (XLM-R large's shape plus a cross-attention module per layer): 24 x 1024,
    # FFN 4096, 16 heads, the 250k vocabulary: 662M parameters. The embedding LayerNorm is XLM-R's too.
    "paper": dict(vocab_size=250_000, d_model=1024, num_heads=16, layers=24, ffn=4096, max_positions=512,
                  dropout=0.1, embedding_layernorm=True),
}


def veco_preset(name: str, **overrides: Any) -> VecoConfig:
    """The named architecture, with optional field overrides (validated like any other config)."""
    return VecoConfig.from_preset(VECO_PRESETS, name, overrides, what="VECO model")


# ----------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------


class VecoLayer(nn.Module):
    """Pre-LayerNorm bidirectional self-attention, the plug-and-play cross-attention module, FFN.

    The cross-attention module (its own LayerNorm + Attention) reads the paired input's last-layer states
    H^L, the same tensor in every layer (each layer projects it with its own U^K, U^V). Without paired
    states it is skipped entirely, so that a plugged-out layer is exactly `marge.model.layers.EncoderLayer`.
    """

    def __init__(self, cfg: VecoConfig):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model)
        self.cross_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn, cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BSD: Tensor, key_ok_B11S: Tensor, paired_BPD: Tensor | None = None,
                paired_ok_B11P: Tensor | None = None) -> Tensor:
        h = self.self_attn_norm(x_BSD)
        q, k, v = self.self_attn.project_qkv(h)
        x_BSD = x_BSD + self.dropout(self.self_attn.attend(q, k, v, attn_bias=key_ok_B11S))
        if paired_BPD is not None:  # plugged in
            k, v = self.cross_attn.project_kv(paired_BPD)
            x_BSD = x_BSD + self.dropout(self.cross_attn(self.cross_attn_norm(x_BSD), k, v, attn_bias=paired_ok_B11P))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------


@dataclass
class VecoOutput:
    loss: Tensor  # the mean of the four CA-MLM terms, with gradient
    parts: dict[str, Tensor]  # x_self, x_cross, y_self, y_cross: mean NLL per masked token, detached
    masked_tokens: Tensor  # labelled positions of x and y together


CA_MLM_TERMS = ("x_self", "x_cross", "y_self", "y_cross")
"""The four terms of paper Eq. 3: -log P(x|x^), -log P(x|y^,x^), -log P(y|y^), -log P(y|x^,y^)."""


class Veco(nn.Module):
    def __init__(self, cfg: VecoConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.embedding_norm = nn.LayerNorm(cfg.d_model) if cfg.embedding_layernorm else None
        self.layers = nn.ModuleList(VecoLayer(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_parameters(self, self.cfg.init_std, self.cfg.pad_id)

    def _check_tokens(self, tokens: Tensor, what: str) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"{what} tokens must be a 2-D (rows, positions) tensor, got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_positions:
            raise ValueError(f"{what} length {tokens.shape[1]} exceeds model.max_positions={self.cfg.max_positions}")
        if not bool((tokens != self.cfg.pad_id).any(1).all()):
            # a row with no key attends over nothing: NaN states, which as the paired input of the row
            # beside it would reach that row through its (masked, but 0 * NaN) attention weights
            raise ValueError(f"every {what} row needs at least one non-padding token")

    # --- encoder --------------------------------------------------------------------------------

    def encode(self, tokens_BS: Tensor, paired_BPD: Tensor | None = None, paired_ok_BP: Tensor | None = None) -> Tensor:
        """Final-normed states (B S D): H (cross-attention plugged out) without `paired_BPD`, else S.

        paired_BPD    the paired input's last-layer states H^L (what `encode` returns for it), row i of
                      the pair beside row i of `tokens_BS`
        paired_ok_BP  False at the paired input's padding (None: every paired position is a key)
        """
        self._check_tokens(tokens_BS, "input")
        paired_ok_B11P = None
        if paired_BPD is not None:
            b, _, d = paired_BPD.shape
            if b != tokens_BS.shape[0] or d != self.cfg.d_model:
                raise ValueError(f"paired states {tuple(paired_BPD.shape)} do not pair with {b} rows of width "
                                 f"{self.cfg.d_model} (tokens {tuple(tokens_BS.shape)})")
            if paired_ok_BP is not None:
                if paired_ok_BP.shape != paired_BPD.shape[:2]:
                    raise ValueError(f"paired mask {tuple(paired_ok_BP.shape)} != paired states "
                                     f"{tuple(paired_BPD.shape[:2])}")
                paired_ok_B11P = paired_ok_BP[:, None, None, :]
        key_ok_B11S = (tokens_BS != self.cfg.pad_id)[:, None, None, :]
        x_BSD = self.dropout(embed(tokens_BS, self.embed_tokens, self.positions, 0, self.embedding_norm))
        for layer in self.layers:
            x_BSD = layer(x_BSD, key_ok_B11S, paired_BPD, paired_ok_B11P)
        return self.final_norm(x_BSD)

    @property
    def encoder_layers(self) -> nn.ModuleList:
        """The layers, under the name retrieval evaluation (`marge.eval.evaluation`) sweeps in either model family."""
        return self.layers

    def encoder_states(self, tokens_RS: Tensor, num_layers: int | None = None) -> Tensor:
        """Plugged-out states after the first `num_layers` layers (0: the embedded input; None: every layer and the
        final norm, = `encode`), as `Marge.encoder_states`: the mBERT-like encoder VECO leaves for understanding."""
        if num_layers is None:
            return self.encode(tokens_RS)
        self._check_tokens(tokens_RS, "input")
        key_ok_R11S = (tokens_RS != self.cfg.pad_id)[:, None, None, :]
        x_RSD = self.dropout(embed(tokens_RS, self.embed_tokens, self.positions, 0, self.embedding_norm))
        for layer in self.layers[:num_layers]:
            x_RSD = layer(x_RSD, key_ok_R11S)
        return x_RSD

    def mlm_logits(self, states_BSD: Tensor) -> Tensor:
        """Token logits of states of any leading shape (the output projection is the token embedding)."""
        return states_BSD @ self.embed_tokens.weight.T

    def _pair_states(self, x_BS: Tensor, y_BS: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """H and S of x and y, from two passes over the 2B rows [x; y] padded to one width W, not four over B.

        Row i of the plug-in pass reads row i + B of the plug-out pass and the other way round (x reads H_y,
        y reads H_x). Padding changes no state (every layer masks it), so this equals the four `encode`
        calls of the definition; it costs the padding of the shorter side, small for sentence pairs.
        Returns (tokens_2BW, H_2BWD, S_2BWD).
        """
        self._check_tokens(x_BS, "x")
        self._check_tokens(y_BS, "y")
        b = x_BS.shape[0]
        if y_BS.shape[0] != b:
            raise ValueError(f"x and y must have the same number of rows (pairs), got {b} and {y_BS.shape[0]}")
        w = max(x_BS.shape[1], y_BS.shape[1])
        tokens_2BW = torch.cat([F.pad(x_BS, (0, w - x_BS.shape[1]), value=self.cfg.pad_id),
                                F.pad(y_BS, (0, w - y_BS.shape[1]), value=self.cfg.pad_id)])
        ok_2BW = tokens_2BW != self.cfg.pad_id
        h_2BWD = self.encode(tokens_2BW)
        s_2BWD = self.encode(tokens_2BW, h_2BWD.roll(b, dims=0), ok_2BW.roll(b, dims=0))
        return tokens_2BW, h_2BWD, s_2BWD

    # --- fine-tuning features -------------------------------------------------------------------

    def plug_out_features(self, x_BS: Tensor) -> Tensor:
        """H_x (B S D): the model with the cross-attention plugged out, as mBERT is used (paper §3)."""
        return self.encode(x_BS)

    def plug_in_features(self, x_BS: Tensor, y_BS: Tensor) -> tuple[Tensor, Tensor]:
        """[H_x; S_x] (B Sx 2D) and [H_y; S_y] (B Sy 2D): plug-in fine-tuning's features when the pair's other
        side is at hand (paper §3), H and S concatenated along the width."""
        _, h_2BWD, s_2BWD = self._pair_states(x_BS, y_BS)
        hs_2BW2D = torch.cat([h_2BWD, s_2BWD], dim=-1)
        b = x_BS.shape[0]
        return hs_2BW2D[:b, : x_BS.shape[1]], hs_2BW2D[b:, : y_BS.shape[1]]

    # --- the CA-MLM loss ------------------------------------------------------------------------

    def ca_mlm_terms(self, x_in_BS: Tensor, x_labels_BS: Tensor, y_in_BS: Tensor,
                     y_labels_BS: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """The four CA-MLM terms (`CA_MLM_TERMS`, with gradient) and the count of labelled positions.

        Each term is the mean NLL over its side's labelled positions (0 where a side has none). The paired
        states are not detached: as in Eq. 3, where theta_s is trained by all four terms, a cross term's
        gradient also reaches the other side's plug-out pass through the keys and values it read. Logits are
        computed only at those positions (M of them, ~15%), never for every position: at the paper's 250k
        vocabulary the full (B S V) logits would be the largest tensor by far.
        """
        for what, tokens_BS, labels_BS in (("x", x_in_BS, x_labels_BS), ("y", y_in_BS, y_labels_BS)):
            if tokens_BS.shape != labels_BS.shape:
                raise ValueError(f"{what} input {tuple(tokens_BS.shape)} and labels {tuple(labels_BS.shape)} differ")
        tokens_2BW, h_2BWD, s_2BWD = self._pair_states(x_in_BS, y_in_BS)
        b, w = x_in_BS.shape[0], tokens_2BW.shape[1]
        labels_2BW = torch.cat([F.pad(x_labels_BS, (0, w - x_labels_BS.shape[1]), value=self.cfg.pad_id),
                                F.pad(y_labels_BS, (0, w - y_labels_BS.shape[1]), value=self.cfg.pad_id)])
        labelled_2BW = labels_2BW != self.cfg.pad_id
        labels_M = labels_2BW[labelled_2BW]
        is_x_M = (torch.arange(2 * b, device=labels_2BW.device)[:, None] < b).expand(-1, w)[labelled_2BW]
        x_tokens, y_tokens = is_x_M.sum(), (~is_x_M).sum()
        terms: dict[str, Tensor] = {}
        for kind, states_2BWD in (("self", h_2BWD), ("cross", s_2BWD)):
            nll_M = F.cross_entropy(self.mlm_logits(states_2BWD[labelled_2BW]).float(), labels_M, reduction="none")
            terms[f"x_{kind}"] = (nll_M * is_x_M).sum() / x_tokens.clamp(min=1)
            terms[f"y_{kind}"] = (nll_M * ~is_x_M).sum() / y_tokens.clamp(min=1)
        return {name: terms[name] for name in CA_MLM_TERMS}, x_tokens + y_tokens

    def ca_mlm(self, x_in_BS: Tensor, x_labels_BS: Tensor, y_in_BS: Tensor, y_labels_BS: Tensor) -> VecoOutput:
        """CA-MLM on pairs (x_i, y_i), row by row (paper Eq. 3).

        x_in_BS, y_in_BS          the masked inputs x^, y^ (padded with pad_id; the sides may differ in length)
        x_labels_BS, y_labels_BS  the original token where masked, pad_id elsewhere (ignored)

        `loss` is the mean of the four terms rather than their sum (the paper's Eq. 3 sums them; this is
        a factor 4, nothing else): so that it has the scale of one MLM loss, and a weight given to it in a
        mixture of objectives, or a learning rate tuned on MLM, means the same thing.
        """
        terms, masked_tokens = self.ca_mlm_terms(x_in_BS, x_labels_BS, y_in_BS, y_labels_BS)
        loss = torch.stack(list(terms.values())).mean()
        return VecoOutput(loss, {name: t.detach() for name, t in terms.items()}, masked_tokens)

    def forward(self, x_in_BS: Tensor, x_labels_BS: Tensor, y_in_BS: Tensor, y_labels_BS: Tensor) -> VecoOutput:
        """`ca_mlm`: the loss is the forward, so that wrappers (DDP, compile) see it."""
        return self.ca_mlm(x_in_BS, x_labels_BS, y_in_BS, y_labels_BS)


# ----------------------------------------------------------------------------------------------------
# Masking
# ----------------------------------------------------------------------------------------------------


def mlm_mask(tokens: np.ndarray, share: float, mask_id: int, vocab_low: int, vocab_high: int,
             rng: np.random.Generator, random_share: float = 0.1, keep_share: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """BERT-style masking of one 1-D token row: (input, labels).

    max(1, round(share * len)) positions are chosen without replacement (a fixed count, as BERT, so that
    short rows are masked too and every row's share is the same); of those, each becomes `mask_id` with
    probability 1 - random_share - keep_share, a random id in [vocab_low, vocab_high) with probability
    `random_share` (which may be the original), and stays with probability `keep_share`, so that the model
    cannot learn that only [MASK] positions need a prediction. Labels are the original id at the chosen
    positions and -1 elsewhere (the caller turns -1 into the model's pad_id). Specials the caller does not
    want masked are its to leave out (mask a slice).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"mlm_mask takes a 1-D integer array, got {tokens.ndim}-D {tokens.dtype}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"mask share must be in (0, 1], got {share}")
    if random_share < 0.0 or keep_share < 0.0 or random_share + keep_share > 1.0:
        raise ValueError(f"random_share ({random_share}) and keep_share ({keep_share}) must be >= 0 and sum to <= 1")
    if not vocab_low < vocab_high:
        raise ValueError(f"random ids need vocab_low < vocab_high, got [{vocab_low}, {vocab_high})")
    inputs = tokens.copy()
    labels = np.full(len(tokens), -1, dtype=np.int64)
    if len(tokens) == 0:
        return inputs, labels
    chosen = rng.choice(len(tokens), size=max(1, round(share * len(tokens))), replace=False)
    labels[chosen] = tokens[chosen]
    u = rng.random(len(chosen))
    masked = u < 1.0 - random_share - keep_share
    randomised = ~masked & (u < 1.0 - keep_share)
    inputs[chosen[masked]] = mask_id
    inputs[chosen[randomised]] = rng.integers(vocab_low, vocab_high, size=int(randomised.sum()))
    return inputs, labels


# ----------------------------------------------------------------------------------------------------
# Sizes and throughput
# ----------------------------------------------------------------------------------------------------


def build_veco_on_meta(cfg: VecoConfig) -> Veco:
    """The model with no storage behind its parameters: for counting and planning, not for running."""
    with torch.device("meta"):
        return Veco(cfg)


def count_veco_parameters(cfg: VecoConfig) -> int:
    """Parameters, counting the tied input/output embedding once (`marge.model.sizes.count_parameters`)."""
    return count_parameters(build_veco_on_meta(cfg))


def veco_training_flops_per_token(cfg: VecoConfig, masked_share: float = 0.15) -> float:
    """Approximate CA-MLM training FLOPs per input token of x or y (6 x parameters touched), for MFU figures.

    CA-MLM runs four passes per pair, two per token: a plug-out pass (self-attention + FFN: H) and a plug-in
    pass (also the cross-attention module, whose key/value projections run over the paired side's tokens,
    one paired token per token for pairs of equal length: S). The output projection runs only at the
    masked positions (`masked_share` of the tokens), once for H and once for S.
    """
    d = cfg.d_model
    plug_out = cfg.layers * (4 * d * d + 2 * d * cfg.ffn)
    plug_in = cfg.layers * (8 * d * d + 2 * d * cfg.ffn)
    output = 2 * masked_share * d * cfg.vocab_size
    return 6.0 * (plug_out + plug_in + output)


__all__ = [
    "CA_MLM_TERMS", "FAMILY", "VECO_PRESETS", "Veco", "VecoConfig", "VecoLayer", "VecoOutput", "build_veco_on_meta",
    "count_veco_parameters", "mlm_mask", "veco_preset", "veco_training_flops_per_token",
]
