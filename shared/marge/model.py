"""MARGE: a Multilingual Autoencoder that Retrieves and GEnerates (Lewis et al. 2020, §2-3).

The model reconstructs each target document x_i from a set of evidence documents z_1..M:

* every evidence document is encoded on its own by a bidirectional encoder; the encoder states of all
  evidence in the batch are concatenated into one memory that the decoder cross-attends over;
* relevance f(x, z) = cos(g(x), g(z)), where g is the state of the first (BOS) token (or the mean of the
  states) after the first `relevance_layers` encoder layers (the same parameters as the encoder: paper §2.2);
  `unit_relevance` is the one function that turns g into what f compares, for every stage;
* every cross-attention logit from a token of z_j gets + beta * f(x_i, z_j) (paper Eq. 4), so the
  reconstruction loss trains g through beta * f; a target reads only the keys of the evidence it may see
  (gathered per target, `CrossMemory`), which equals attending over the whole memory with the others masked;
* the decoder has `decoder_local_layers` self-attention-only layers at its base, then
  `decoder_layers` layers with cross-attention (paper §3); its first input is a language token that
  selects the output language.

Tensor-shape legend (suffixes on variable names):
    N  targets in the batch             T  target (decoder) positions
    M  evidence documents in the batch  S  evidence (encoder) positions
    L  keys of the concatenated evidence memory = M * S
    K  keys one target reads (its visible documents' keys, gathered; = L when it may read all)
    R  rows given to the relevance encoder (any set of documents)
    U  the real (non-padding) tokens of a padded block, one after another (`RealTokens`, `trainer.unpadded`)
    D  model width    H  attention heads    E  head width = D // H    V  vocabulary
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Self

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from marge.batch import framed_rows

# ----------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------


class ArchitectureConfig:
    """What every architecture's config (`MargeConfig`, `marge.veco.VecoConfig`) does besides holding its fields
    (a frozen dataclass's, with `d_model` and `num_heads`): its head width, its plain values to save, a saved config
    read back, field overrides and the named presets."""

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

    vocab_size: int
    """Rows of the (tied) token embedding. Must be >= the tokenizer's vocabulary."""
    d_model: int
    """Width of every layer (paper: 1024)."""
    num_heads: int
    """Attention heads of every attention layer; divides d_model."""
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
    max_positions: int = 512
    """Longest document / target in tokens, specials included (paper: 512-token chunks)."""
    dropout: float = 0.1
    """Dropout on embeddings, residual branches and feed-forward hidden states."""
    attention_dropout: float = 0.0
    """Dropout on attention weights."""
    pad_id: int = 0
    """The tokenizer's padding id: padded positions are masked everywhere and never predicted."""
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
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix and embedding."""
    embedding_layernorm: bool = True
    """A LayerNorm on token + position embedding before the first encoder and decoder layer (BART's and
    mBART's `layernorm_embedding`; the paper does not say). Chosen because it learned fastest of the fixes
    measured: embeddings are drawn at std 0.02, and without this norm the pre-LayerNorm residual stream
    starts at that scale, which kept a 2+2-layer model on a copy task at 8.09 nats/token
    after 300 updates while HF BART reached 0.85; with it, 0.66 (3 seeds; post-LN instead: 1.34, a 4.4x
    larger embedding init instead: 0.97; benchmarks/copy_race.py, experiments/copy-race/README.md). False: the
    model before that change (and the `paper` preset: with it the paper's BOS-pooled g starts collapsed)."""

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
    """The checks every architecture's config makes (`MargeConfig`, `marge.veco.VecoConfig`): positive sizes,
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


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------


def embed(tokens_RS: Tensor, token_table: nn.Embedding, position_table: nn.Embedding, start_position: int,
          norm: nn.LayerNorm | None) -> Tensor:
    """Token + position embedding of rows whose first token sits at `start_position`, then the embedding
    LayerNorm where the model has one (`MargeConfig.embedding_layernorm`)."""
    positions_S = torch.arange(start_position, start_position + tokens_RS.shape[1], device=tokens_RS.device)
    return embed_at(tokens_RS, positions_S, token_table, position_table, norm)


def embed_at(ids: Tensor, positions: Tensor, token_table: nn.Embedding, position_table: nn.Embedding,
             norm: nn.LayerNorm | None) -> Tensor:
    """Token + position embedding of `ids` at `positions` (shapes that broadcast: rows and their positions, or real
    tokens and each one's position), then the embedding LayerNorm where the model has one."""
    x = token_table(ids) + position_table(positions)
    return x if norm is None else norm(x)


def run_layers(x_RSD: Tensor, layers, key_ok_RS: Tensor) -> Tensor:
    """Encoder layers over embedded rows, padding keys masked: the encoder forward of `Marge` and of g alone."""
    key_ok_R11S = key_ok_RS[:, None, None, :]
    for layer in layers:
        x_RSD = layer(x_RSD, key_ok_R11S)
    return x_RSD


def pad_rows(rows: list[list[int]], pad_id: int) -> Tensor:
    """Token rows of different lengths as one (rows, longest) tensor, padded with `pad_id` (which every layer
    masks)."""
    return torch.from_numpy(framed_rows(rows, pad_id))


def pool_relevance(states_RSD: Tensor, key_ok_RS: Tensor, pooling: str) -> Tensor:
    """g from the relevance layer's states: the BOS state, or the mean over the document's tokens."""
    if pooling == "bos":
        return states_RSD[:, 0]
    weights_RS1 = key_ok_RS.unsqueeze(-1).to(states_RSD.dtype)
    return (states_RSD * weights_RS1).sum(1) / weights_RS1.sum(1).clamp(min=1)


def unit_relevance(g_RD: Tensor, center_D: Tensor | None) -> Tensor:
    """What f compares: g minus the centre (when the model centres), L2-normalised, in float32.

    The trainer (with the batch's mean as the centre), the indexer, the retrieval service, the health
    probes and evaluation (with the snapshot's running centre) all compute g's unit vectors here.
    """
    g_RD = g_RD.float()
    if center_D is not None:
        g_RD = g_RD - center_D.float()
    return F.normalize(g_RD, dim=-1)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ffn: int, dropout: float):
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_ffn)
        self.fc_out = nn.Linear(d_ffn, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(self.dropout(F.gelu(self.fc_in(x)))))


MASKED_LOGIT = -3.0e4
"""What a key that may not be read adds to its logits when a key bias is folded into the heads (`fold_key_bias`):
finite, so that no row of the softmax is NaN, and far enough below any logit that its weight is exactly 0."""

FOLD_WIDTH = 8
"""Dimensions `fold_key_bias` adds to every head (one carries the bias, the rest keep the width a multiple of 8,
which the fused attention kernels want)."""


def is_key_bias(attn_bias: Tensor | None) -> bool:
    """Whether `attn_bias` depends on the key alone ((rows, 1, 1, keys)): what `fold_key_bias` can fold."""
    return attn_bias is not None and attn_bias.dim() == 4 and attn_bias.shape[1] == 1 and attn_bias.shape[2] == 1


def key_bias_logits(bias_B11K: Tensor, dtype: torch.dtype) -> Tensor:
    """The key bias as what it adds to each key's logits (B K): a boolean "may read" mask as 0 / MASKED_LOGIT, a
    float bias (beta * f, -inf where a key may not be read) clamped at MASKED_LOGIT."""
    bias_BK = bias_B11K[:, 0, 0, :]
    if bias_BK.dtype == torch.bool:
        return torch.zeros(bias_BK.shape, dtype=dtype, device=bias_BK.device).masked_fill(~bias_BK, MASKED_LOGIT)
    return torch.clamp(bias_BK.to(dtype), min=MASKED_LOGIT)


def fold_key_bias(q_BHQE: Tensor, k_BHKE: Tensor, v_BHKE: Tensor,
                  bias_B11K: Tensor) -> tuple[Tensor, Tensor, Tensor, float]:
    """q', k', v' and the softmax scale whose attention equals attending q, k, v with `bias_B11K` added to every
    logit of key k (a boolean "may read" mask, or a float bias such as beta * f, -inf where a key may not be read).

    The bias rides in an extra head dimension: q' = [q, 1, 0...], k' = [k, c * sqrt(E), 0...], v' = [v, 0...], so
    q'.k' / sqrt(E) = q.k / sqrt(E) + c, exactly; keys that may not be read get c = MASKED_LOGIT. Attention then
    carries no mask, so the fused (flash) kernels apply, and the bias's gradient flows back through k' (to g and
    beta for beta * f) instead of as a dense (rows, heads, queries, keys) tensor."""
    b, h, nq, e = q_BHQE.shape
    nk = k_BHKE.shape[2]
    c_BK = key_bias_logits(bias_B11K, q_BHQE.dtype)
    c_BHK1 = (c_BK * math.sqrt(e))[:, None, :, None].expand(b, h, nk, 1)
    q2 = torch.cat([q_BHQE, q_BHQE.new_ones(b, h, nq, 1), q_BHQE.new_zeros(b, h, nq, FOLD_WIDTH - 1)], dim=-1)
    k2 = torch.cat([k_BHKE.expand(b, h, nk, e), c_BHK1.to(k_BHKE.dtype), k_BHKE.new_zeros(b, h, nk, FOLD_WIDTH - 1)], dim=-1)
    v2 = torch.cat([v_BHKE.expand(b, h, nk, e), v_BHKE.new_zeros(b, h, nk, FOLD_WIDTH)], dim=-1)
    return q2, k2, v2, 1.0 / math.sqrt(e)


KEY_BIAS_PATHS = ("folded", "mask", "flex")
"""How attention adds a bias of the key alone (the encoder's padding, the cross-attention's beta * f):
folded  into an extra head dimension (`fold_key_bias`): no mask, so SDPA's flash kernels apply, but every head is
        E + 8 wide (64 -> 72, which flash kernels round up to 96);
mask    as SDPA's additive float mask of (B 1 1 K), heads E wide: on a GPU the memory-efficient kernel, which takes
        the bias and returns its gradient (flash kernels take no mask);
flex    as FlexAttention's `score_mod` (logit + bias[b, key]), heads E wide: fused only under torch.compile
        (`trainer.compile`), eager it materialises the logits; no attention dropout; its backward needs a GPU.
`mask` gives the folded path's values and gradients; `flex` its values (tests/test_gpu_readiness.py,
tests/test_unpadded.py), its gradients tested only where a GPU is."""


def key_biased_attention(q_BHQE: Tensor, k_BHKE: Tensor, v_BHKE: Tensor, bias_B11K: Tensor, path: str,
                         dropout_p: float) -> Tensor:
    """Attention of q over k, v with `bias_B11K` (boolean "may read", or float with -inf for "may not") added to
    the logits of each key, by `path` (`KEY_BIAS_PATHS`)."""
    if path == "folded":
        q2, k2, v2, scale = fold_key_bias(q_BHQE, k_BHKE, v_BHKE, bias_B11K)
        return F.scaled_dot_product_attention(q2, k2, v2, dropout_p=dropout_p, scale=scale)[..., :q_BHQE.shape[-1]]
    bias_BK = key_bias_logits(bias_B11K, q_BHQE.dtype)
    if path == "mask":
        return F.scaled_dot_product_attention(q_BHQE, k_BHKE, v_BHKE, attn_mask=bias_BK[:, None, None, :],
                                              dropout_p=dropout_p)
    if path != "flex":
        raise ValueError(f"key bias path {path!r} is not one of {KEY_BIAS_PATHS}")
    if dropout_p:
        raise ValueError("trainer.key_bias=flex has no attention dropout: set model.attention_dropout=0, or use "
                         "trainer.key_bias=mask or folded")
    from torch.nn.attention.flex_attention import flex_attention

    def add_key_bias(score, b, h, q_idx, kv_idx):
        return score + bias_BK[b, kv_idx]

    n = q_BHQE.shape[0]  # keys shared by every row (an expanded view) are given per row, as flex wants them
    return flex_attention(q_BHQE, k_BHKE.expand(n, -1, -1, -1), v_BHKE.expand(n, -1, -1, -1), score_mod=add_key_bias)


class ScatterRows(torch.autograd.Function):
    """x (U D) into a zero (size D) block at `index_U`, whose entries are distinct: the backward is a gather (the
    autograd of `index_copy`/`index_select` would scatter-add, which the CPU runs serially)."""

    @staticmethod
    def forward(ctx, x_UD: Tensor, index_U: Tensor, size: int) -> Tensor:
        ctx.save_for_backward(index_U)
        return x_UD.new_zeros(size, x_UD.shape[-1]).index_copy_(0, index_U, x_UD)

    @staticmethod
    def backward(ctx, grad_XD: Tensor):
        (index_U,) = ctx.saved_tensors
        return grad_XD.index_select(0, index_U), None, None


class GatherRows(torch.autograd.Function):
    """Rows `index_U` (distinct) of x (X D): the backward puts the gradient back in place, no scatter-add."""

    @staticmethod
    def forward(ctx, x_XD: Tensor, index_U: Tensor) -> Tensor:
        ctx.save_for_backward(index_U)
        ctx.size = x_XD.shape[0]
        return x_XD.index_select(0, index_U)

    @staticmethod
    def backward(ctx, grad_UD: Tensor):
        (index_U,) = ctx.saved_tensors
        return grad_UD.new_zeros(ctx.size, grad_UD.shape[-1]).index_copy_(0, index_U, grad_UD), None


@dataclass
class RealTokens:
    """Where the real (non-padding) tokens of a right-padded (rows, width) block sit. Layers given one run their
    projections, feed-forward layers and norms on these U tokens alone (no FLOP on padding) and lay them out in
    rows only for the attention call (`to_rows`, `from_rows`). Made on the host (`services.trainer.inputs`)."""

    index_U: Tensor  # row * width + position of each real token, row by row
    row_U: Tensor  # its row
    position_U: Tensor  # its position in the row
    first_R: Tensor  # where each row's first token sits among the U
    lengths_R: Tensor  # real tokens of each row (>= 1)
    rows: int
    width: int

    def to_rows(self, x_UD: Tensor) -> Tensor:
        """(rows, width, D) with x's tokens in place and zeros at padding."""
        return ScatterRows.apply(x_UD, self.index_U, self.rows * self.width).view(self.rows, self.width, -1)

    def from_rows(self, x_RSD: Tensor) -> Tensor:
        """The real tokens (U D) of a (rows, width, D) block."""
        return GatherRows.apply(x_RSD.reshape(self.rows * self.width, -1), self.index_U)

    def take(self, tokens_RS: Tensor) -> Tensor:
        """The real entries (T) of a (rows, width) tensor, e.g. token ids or labels."""
        return tokens_RS.reshape(-1).index_select(0, self.index_U)

    def pool(self, x_UD: Tensor, pooling: str) -> Tensor:
        """`pool_relevance` over real tokens: each row's first token, or the mean of its tokens (R D)."""
        if pooling == "bos":
            return x_UD.index_select(0, self.first_R)
        sums = x_UD.new_zeros(self.rows, x_UD.shape[-1]).index_add_(0, self.row_U, x_UD)
        return sums / self.lengths_R.to(x_UD.dtype)[:, None]

    def tensors(self) -> tuple[Tensor, ...]:
        return self.index_U, self.row_U, self.position_U, self.first_R, self.lengths_R

    def map(self, fn) -> "RealTokens":
        return RealTokens(*(fn(t) for t in self.tensors()), self.rows, self.width)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "RealTokens":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "RealTokens":
        return self.map(lambda t: t.pin_memory())


@dataclass
class UnpaddedLayout:
    """How a host-prepared batch runs without padding (`trainer.unpadded`): the real tokens of the evidence, of the
    targets' encoder rows (their g) and of the decoder rows, and the keys each target reads in a memory made of the
    evidence's real tokens only. The loss and gradients are those of the padded batch (tests/test_unpadded.py):
    padding keys weigh exactly 0 in every softmax, and nothing else mixes tokens."""

    evidence: RealTokens
    targets: RealTokens  # the targets' encoder rows (g)
    decoder: RealTokens  # the decoder's (and the labels') rows
    key_doc_NK: Tensor  # the evidence document of each key slot a target reads ((1, L) when every target reads all)
    visible_NK: Tensor  # False on slots a target may not read (its own document, unused slots)
    key_index_NK: Tensor | None = None  # where each slot's key sits in the memory (None: slot k is memory key k)

    def map(self, fn) -> "UnpaddedLayout":
        return UnpaddedLayout(self.evidence.map(fn), self.targets.map(fn), self.decoder.map(fn), fn(self.key_doc_NK),
                              fn(self.visible_NK), None if self.key_index_NK is None else fn(self.key_index_NK))

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "UnpaddedLayout":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "UnpaddedLayout":
        return self.map(lambda t: t.pin_memory())


class Attention(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention (scale = 1/sqrt(head width)).

    `attn_bias` is added to the logits; it is either a boolean "may attend" mask or a float tensor
    broadcastable to (batch, H, queries, keys) that may carry gradient (the beta * f path does). A bias of the key
    alone (the encoder's padding, the cross-attention's beta * f) goes the way `key_bias` says (`KEY_BIAS_PATHS`,
    an execution setting: `trainer.key_bias`; by default folded into the heads, so the attention has no mask). Only
    a bias that depends on the query (the causal mask of incremental decoding over a cache) is passed to SDPA as a
    mask.
    """

    key_bias = "folded"

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def split_heads(self, x_BXD: Tensor) -> Tensor:
        b, x, d = x_BXD.shape
        return x_BXD.view(b, x, self.num_heads, d // self.num_heads).transpose(1, 2)  # B H X E

    def project_kv(self, memory_BLD: Tensor, real: RealTokens | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values in heads (B H L E); `real`: projected from the real tokens only, then laid out in rows."""
        if real is None:
            return self.split_heads(self.k_proj(memory_BLD)), self.split_heads(self.v_proj(memory_BLD))
        return (self.split_heads(real.to_rows(self.k_proj(memory_BLD))),
                self.split_heads(real.to_rows(self.v_proj(memory_BLD))))

    def forward(self, x_BQD: Tensor, k_BHLE: Tensor, v_BHLE: Tensor, attn_bias: Tensor | None = None,
                is_causal: bool = False, real: RealTokens | None = None) -> Tensor:
        """`real`: x holds only the real tokens (U D) of the rows `real` describes; the projections run on those
        alone, the attention on the rows, and the output comes back as real tokens."""
        q = self.q_proj(x_BQD)
        q_BHQE = self.split_heads(q if real is None else real.to_rows(q))
        k_BHLE, v_BHLE = k_BHLE.to(q_BHQE.dtype), v_BHLE.to(q_BHQE.dtype)
        dropout_p = self.dropout if self.training else 0.0
        if is_key_bias(attn_bias) and not is_causal:
            out_BHQE = key_biased_attention(q_BHQE, k_BHLE, v_BHLE, attn_bias, self.key_bias, dropout_p)
        else:
            if attn_bias is not None and attn_bias.dtype != torch.bool:
                attn_bias = attn_bias.to(q_BHQE.dtype)  # SDPA wants a float mask in the query's dtype (bf16 autocast)
            out_BHQE = F.scaled_dot_product_attention(q_BHQE, k_BHLE, v_BHLE, attn_mask=attn_bias, dropout_p=dropout_p,
                                                      is_causal=is_causal)
        b, _, q, _ = out_BHQE.shape
        out = out_BHQE.transpose(1, 2).reshape(b, q, -1)
        return self.out_proj(out if real is None else real.from_rows(out))


class EncoderLayer(nn.Module):
    """Pre-LayerNorm bidirectional self-attention + FFN."""

    def __init__(self, cfg: MargeConfig):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.encoder_ffn, cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BSD: Tensor, key_ok_B11S: Tensor, real: RealTokens | None = None) -> Tensor:
        """`real`: x holds only the real tokens (U D) of the rows; every layer but the attention runs on those."""
        h = self.self_attn_norm(x_BSD)
        k, v = self.self_attn.project_kv(h, real)
        x_BSD = x_BSD + self.dropout(self.self_attn(h, k, v, attn_bias=key_ok_B11S, real=real))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


def causal_attention(num_queries: int, num_keys: int, device: torch.device) -> dict[str, Any]:
    """SDPA arguments so that query q (the last `num_queries` of `num_keys` positions) sees keys <= itself."""
    past = num_keys - num_queries
    if num_queries == 1:
        return {}  # one new position sees every cached key
    if past == 0:
        return {"is_causal": True}  # lets SDPA pick its fused causal kernels
    q_T1 = torch.arange(num_queries, device=device)[:, None]
    return {"attn_bias": torch.arange(num_keys, device=device)[None, :] <= q_T1 + past}


@dataclass
class LayerCache:
    """Keys/values a decoder layer keeps between incremental decoding steps."""

    self_k: Tensor | None = None  # N H t E, grows by one position per step
    self_v: Tensor | None = None
    cross_k: Tensor | None = None  # N H K E, computed once from the evidence memory
    cross_v: Tensor | None = None

    def reorder(self, index_N: Tensor) -> None:
        """Keep only rows `index_N` (beam search reorders hypotheses every step)."""
        for name in ("self_k", "self_v", "cross_k", "cross_v"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, index_N))


@dataclass
class EncodedEvidence:
    """The evidence as the encoder leaves it: one concatenated memory, and which document each key is from."""

    memory_1LD: Tensor  # all evidence states, flattened into one sequence of L = M * S keys
    key_ok_L: Tensor  # False at padding positions
    key_doc_L: Tensor  # index j of the evidence document each key belongs to
    relevance_MD: Tensor  # g(z_j)


@dataclass
class CrossMemory:
    """What each target's cross-attention reads: the keys of the evidence it may see, and f on each key.

    When some target may not see every document, each target's keys are gathered from the memory
    (`key_index_NK`: K = the most documents any target sees x S); otherwise every target reads all L keys
    (`key_index_NK` None). Keys a target must not read (padding, unused slots) are False in `visible_NK`.
    Each cross-attention layer adds beta * f + (0 or -inf) to the logits of these keys (paper Eq. 4).
    """

    key_index_NK: Tensor | None
    relevance_NK: Tensor
    visible_NK: Tensor

    def gather(self, projected_1HLE: Tensor) -> Tensor:
        """Each target's keys (or values) N H K E from keys projected once over the whole memory."""
        n, k = self.relevance_NK.shape
        if self.key_index_NK is None:
            return projected_1HLE.expand(n, -1, -1, -1)
        # index_select, not `x[:, key_index_NK]`: both gather, but advanced indexing's backward is a sort-based
        # index_put that serialises repeated indices, and every key here is read by many targets. On one H200 it
        # took 93% of the recipe update's GPU time (benchmarks/gpu_probe.py, part G); index_select's backward is an
        # atomic index_add.
        h, _, e = projected_1HLE[0].shape
        gathered_HNKE = projected_1HLE[0].index_select(1, self.key_index_NK.reshape(-1)).view(h, n, k, e)
        return gathered_HNKE.transpose(0, 1)

    def bias(self, beta: Tensor) -> Tensor:
        """beta * f on the keys a target may read, -inf elsewhere (N 1 1 K)."""
        blocked_NK = torch.zeros_like(self.relevance_NK).masked_fill(~self.visible_NK, float("-inf"))
        return (beta * self.relevance_NK + blocked_NK)[:, None, None, :]

    def reorder(self, index_N: Tensor) -> "CrossMemory":
        key_index = None if self.key_index_NK is None else self.key_index_NK.index_select(0, index_N)
        return CrossMemory(key_index, self.relevance_NK.index_select(0, index_N), self.visible_NK.index_select(0, index_N))


class DecoderLayer(nn.Module):
    """Pre-LayerNorm causal self-attention, optional biased cross-attention over the evidence, FFN."""

    def __init__(self, cfg: MargeConfig, d_ffn: int, cross_attention: bool):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model) if cross_attention else None
        self.cross_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout) if cross_attention else None
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, d_ffn, cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_NTD: Tensor, memory_1LD: Tensor | None, cross: CrossMemory | None, beta: Tensor | None,
                cache: LayerCache | None = None, real: RealTokens | None = None) -> Tensor:
        """`real`: x holds only the real tokens (U D) of the targets' rows (training; no cache)."""
        h = self.self_attn_norm(x_NTD)
        k, v = self.self_attn.project_kv(h, real)
        if cache is not None:
            if cache.self_k is not None:
                k, v = torch.cat([cache.self_k, k], dim=2), torch.cat([cache.self_v, v], dim=2)
            cache.self_k, cache.self_v = k, v
        positions = x_NTD.shape[1] if real is None else real.width  # rows are right-padded: causal covers padding
        x_NTD = x_NTD + self.dropout(self.self_attn(h, k, v, **causal_attention(positions, k.shape[2], k.device),
                                                    real=real))
        if self.cross_attn is not None:
            h = self.cross_attn_norm(x_NTD)
            if cache is not None and cache.cross_k is not None:
                k, v = cache.cross_k, cache.cross_v
            else:
                # project the memory once, then give each target its own keys: never N copies of the projection
                k_1HLE, v_1HLE = self.cross_attn.project_kv(memory_1LD)
                k, v = cross.gather(k_1HLE), cross.gather(v_1HLE)
                if cache is not None:
                    cache.cross_k, cache.cross_v = k, v
            x_NTD = x_NTD + self.dropout(self.cross_attn(h, k, v, attn_bias=cross.bias(beta), real=real))
        return x_NTD + self.ffn(self.ffn_norm(x_NTD))


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------


@dataclass
class MargeOutput:
    loss: Tensor  # mean NLL per target token (padding excluded)
    nll_per_target_N: Tensor  # summed NLL of each target
    tokens_per_target_N: Tensor
    relevance_NM: Tensor  # f(x_i, z_j) = cos(g(x_i), g(z_j)), with gradient
    logits_NTV: Tensor | None = None


class Marge(nn.Module):
    def __init__(self, cfg: MargeConfig):
        super().__init__()
        self.cfg = cfg
        self.loss_chunk_tokens = 0
        """Target tokens whose output logits the training loss computes at a time (0: all at once); set by the
        trainer from `trainer.loss_chunk_tokens`. Not architecture: it changes no weight."""
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.encoder_embed_tokens = (None if cfg.tie_encoder_embeddings
                                     else nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id))
        self.encoder_positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.decoder_positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.encoder_embedding_norm = nn.LayerNorm(cfg.d_model) if cfg.embedding_layernorm else None
        self.decoder_embedding_norm = nn.LayerNorm(cfg.d_model) if cfg.embedding_layernorm else None
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.encoder_norm = nn.LayerNorm(cfg.d_model)
        self.decoder_local_layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.decoder_local_ffn, cross_attention=False) for _ in range(cfg.decoder_local_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.decoder_ffn, cross_attention=True) for _ in range(cfg.decoder_layers))
        self.decoder_norm = nn.LayerNorm(cfg.d_model)
        self.beta = nn.Parameter(torch.full((1,), float(cfg.beta_init)))
        """The one trainable scalar of paper Eq. 4, shared by every cross-attention layer."""
        self.register_buffer("relevance_center", torch.zeros(cfg.d_model))
        """Running mean of g over training batches (`model.relevance_centering`), carried by snapshots."""
        self.dropout = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_parameters(self, self.cfg.init_std, self.cfg.pad_id)
        with torch.no_grad():
            self.beta.fill_(self.cfg.beta_init)

    @property
    def encoder_token_embedding(self) -> nn.Embedding:
        return self.embed_tokens if self.encoder_embed_tokens is None else self.encoder_embed_tokens

    # --- encoder and relevance ------------------------------------------------------------------

    def _embed_encoder(self, tokens_RS: Tensor) -> Tensor:
        self._check_lengths(tokens_RS, "document")
        return self.dropout(embed(tokens_RS, self.encoder_token_embedding, self.encoder_positions, 0,
                                  self.encoder_embedding_norm))

    def _embed_decoder(self, decoder_in_NT: Tensor, start_position: int) -> Tensor:
        return self.dropout(embed(decoder_in_NT, self.embed_tokens, self.decoder_positions, start_position,
                                  self.decoder_embedding_norm))

    def _check_lengths(self, tokens: Tensor, what: str) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"{what} tokens must be a 2-D (rows, positions) tensor, got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_positions:
            raise ValueError(f"{what} length {tokens.shape[1]} exceeds model.max_positions={self.cfg.max_positions}")

    def encoder_states(self, tokens_RS: Tensor, num_layers: int | None = None) -> Tensor:
        """States after the first `num_layers` encoder layers (all layers + final norm when None)."""
        layers = self.encoder_layers if num_layers is None else self.encoder_layers[:num_layers]
        x = run_layers(self._embed_encoder(tokens_RS), layers, tokens_RS != self.cfg.pad_id)
        return self.encoder_norm(x) if num_layers is None else x

    def relevance_vectors(self, tokens_RS: Tensor, real: RealTokens | None = None) -> Tensor:
        """g(x): the BOS state after the first `relevance_layers` encoder layers (R D), or their mean. `real`: the
        rows' real tokens (host-made), run without their padding."""
        if real is not None:
            return self.encode_real(tokens_RS, real, self.cfg.relevance_layers)[1]
        states = self.encoder_states(tokens_RS, self.cfg.relevance_layers)
        return pool_relevance(states, tokens_RS != self.cfg.pad_id, self.cfg.relevance_pooling)

    def unit_relevance_vectors(self, tokens_RS: Tensor) -> Tensor:
        """g(x) as the index stores it: `unit_relevance` with the running centre (R D, float32)."""
        return unit_relevance(self.relevance_vectors(tokens_RS),
                              self.relevance_center if self.cfg.relevance_centering else None)

    def relevance(self, targets_ND: Tensor, evidence_MD: Tensor) -> Tensor:
        """f(x_i, z_j) = cos(g(x_i), g(z_j)) for every target/evidence pair (N M), in [-1, 1].

        With centring, the centre is this batch's mean g; in training it also moves the running centre."""
        center_D = None
        if self.cfg.relevance_centering:
            center_D = torch.cat([targets_ND, evidence_MD]).mean(0)
            if self.training:
                with torch.no_grad():
                    self.relevance_center.lerp_(center_D.detach().float(), RELEVANCE_CENTER_MOMENTUM)
        return unit_relevance(targets_ND, center_D) @ unit_relevance(evidence_MD, center_D).T

    def encode_evidence(self, evidence_MS: Tensor) -> EncodedEvidence:
        """Encode each evidence document separately, then concatenate (one pass gives g(z) too). Every row starts
        with BOS (`as_encoder_input`; `check_inputs` checks it where inputs were not prepared on the host)."""
        key_ok_MS = evidence_MS != self.cfg.pad_id
        key_ok_M11S = key_ok_MS[:, None, None, :]
        x = self._embed_encoder(evidence_MS)
        relevance_MD = x[:, 0]
        for i, layer in enumerate(self.encoder_layers):
            x = layer(x, key_ok_M11S)
            if i + 1 == self.cfg.relevance_layers:
                relevance_MD = pool_relevance(x, key_ok_MS, self.cfg.relevance_pooling)
        m, s, d = x.shape
        memory_1LD = self.encoder_norm(x).reshape(1, m * s, d)
        key_doc_L = torch.arange(m, device=x.device).repeat_interleave(s)
        return EncodedEvidence(memory_1LD, key_ok_MS.reshape(-1), key_doc_L, relevance_MD)

    def cross_memory(self, evidence: EncodedEvidence, relevance_NM: Tensor, allowed_NM: Tensor,
                     width: int | None = None) -> CrossMemory:
        """The keys each target reads and f on each of them (see `CrossMemory`). `width`: the most documents any
        target may read (`layout_width`), computed here when not given (one read of a device tensor)."""
        if allowed_NM.shape != relevance_NM.shape:
            raise ValueError(f"allowed mask shape {tuple(allowed_NM.shape)} != relevance shape {tuple(relevance_NM.shape)}")
        if width is None:
            width = layout_width(allowed_NM)
        n, m = allowed_NM.shape
        if width == m:  # someone reads every document: one shared memory, masked per target
            return CrossMemory(None, relevance_NM[:, evidence.key_doc_L],
                               allowed_NM[:, evidence.key_doc_L] & evidence.key_ok_L[None, :])
        s = evidence.key_ok_L.shape[0] // m
        # each target's allowed documents first, in document order (a stable sort of the mask)
        order_NM = torch.sort(allowed_NM.to(torch.int8), dim=1, descending=True, stable=True).indices
        docs_NV = order_NM[:, :width]
        slot_ok_NV = allowed_NM.gather(1, docs_NV)
        key_index_NK = (docs_NV[:, :, None] * s + torch.arange(s, device=docs_NV.device)).reshape(n, width * s)
        relevance_NK = relevance_NM.gather(1, docs_NV)[:, :, None].expand(n, width, s).reshape(n, width * s)
        visible_NK = (slot_ok_NV[:, :, None] & evidence.key_ok_L[key_index_NK].view(n, width, s)).reshape(n, width * s)
        return CrossMemory(key_index_NK, relevance_NK, visible_NK)

    # --- decoder --------------------------------------------------------------------------------

    def decode(self, decoder_in_NT: Tensor, memory_1LD: Tensor | None, cross: CrossMemory | None,
               caches: list[LayerCache] | None = None, start_position: int = 0) -> Tensor:
        """Decoder states (N T D) for `decoder_in_NT`, cross-attending over the evidence memory.

        With `caches` the call is one step of incremental decoding: positions start at
        `start_position` and every layer appends its keys/values to its cache.
        """
        n, t = decoder_in_NT.shape
        if start_position + t > self.cfg.max_positions:
            raise ValueError(f"target length {start_position + t} exceeds model.max_positions={self.cfg.max_positions}")
        x = self._embed_decoder(decoder_in_NT, start_position)
        layers = [*self.decoder_local_layers, *self.decoder_layers]
        for i, layer in enumerate(layers):
            x = layer(x, memory_1LD, cross, self.beta, None if caches is None else caches[i])
        return self.decoder_norm(x)

    def logits(self, states_NTD: Tensor) -> Tensor:
        return states_NTD @ self.embed_tokens.weight.T  # tied output projection

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in range(len(self.decoder_local_layers) + len(self.decoder_layers))]

    # --- the reconstruction loss ----------------------------------------------------------------

    def forward(self, evidence_MS: Tensor, target_enc_NS: Tensor | None, decoder_in_NT: Tensor, labels_NT: Tensor,
                allowed_NM: Tensor, return_logits: bool = False, width: int | None = None,
                detach_relevance: bool = False, layout: UnpaddedLayout | None = None) -> MargeOutput:
        """Negative log-likelihood of each target given the evidence and relevance scores (paper Eq. 2).

        evidence_MS    evidence documents as encoder input (BOS ... EOS, padded)
        target_enc_NS  the targets as encoder input, only used for g(x_i); None: no relevance bias (f = 0, no
                       g pass over the targets), as a plain encoder-decoder (the BART objective)
        decoder_in_NT  language token, then the target's text tokens (padded)
        labels_NT      the target's text tokens, then EOS (padded with pad_id: ignored)
        allowed_NM     True where target i may attend to evidence j (never its own document)
        width          `check_inputs` of these inputs, done on the host when the batch was prepared; None: checked
                       here, which reads device values back (the trainer never leaves it None)
        detach_relevance  beta * f still biases the cross-attention, but no gradient reaches g through f (the
                       control that measures what the relevance bias teaches g: `objectives.marge.detach_relevance`)
        layout         where the real tokens are and which keys each target reads (`UnpaddedLayout`, made on the
                       host): every layer but the attention runs on real tokens only; the same loss (`width` is then
                       not needed)
        """
        self._check_lengths(decoder_in_NT, "target")
        if decoder_in_NT.shape != labels_NT.shape:
            raise ValueError(f"decoder input {tuple(decoder_in_NT.shape)} and labels {tuple(labels_NT.shape)} differ")
        if layout is not None:
            if return_logits:
                raise ValueError("return_logits needs the padded layout (layout=None)")
            return self._forward_unpadded(evidence_MS, target_enc_NS, decoder_in_NT, labels_NT, allowed_NM, layout,
                                          detach_relevance)
        if width is None:
            width = check_inputs(evidence_MS, allowed_NM, self.cfg.pad_id)
        evidence = self.encode_evidence(evidence_MS)
        relevance_NM = self._target_relevance(target_enc_NS, evidence.relevance_MD, allowed_NM.shape, detach_relevance)
        cross = self.cross_memory(evidence, relevance_NM, allowed_NM, width)
        states_NTD = self.decode(decoder_in_NT, evidence.memory_1LD, cross)
        n, t, d = states_NTD.shape
        tokens_N = (labels_NT != self.cfg.pad_id).sum(1)
        logits_NTV, nll_sum = None, None
        if return_logits:
            logits_NTV = self.logits(states_NTD)  # scored as (N*T, V) rows: no transposed copy of the largest tensor
            nll_R = token_nll(logits_NTV.reshape(n * t, -1), labels_NT.reshape(n * t), self.cfg.pad_id)
        else:
            nll_sum, nll_R = self._row_nll(states_NTD.reshape(n * t, d), labels_NT.reshape(n * t))
        nll_N = nll_R.view(n, t).sum(1)
        loss = (nll_N.sum() if nll_sum is None else nll_sum) / tokens_N.sum().clamp(min=1)
        return MargeOutput(loss, nll_N, tokens_N, relevance_NM, logits_NTV)

    def _row_nll(self, states_RD: Tensor, labels_R: Tensor) -> tuple[Tensor | None, Tensor]:
        """Each row's NLL under the tied output projection, as `trainer.loss_chunk_tokens` says: with gradients on and
        a chunk size, fused (3 matmuls a chunk, no logits kept; its sum, which carries the gradient, comes first),
        without gradients chunked, else all logits at once (no sum: None)."""
        chunk = self.loss_chunk_tokens
        if chunk and torch.is_grad_enabled():
            return fused_linear_nll(states_RD, self.embed_tokens.weight, labels_R, self.cfg.pad_id, chunk)
        if chunk:
            return None, chunked_token_nll(states_RD, self.embed_tokens.weight, labels_R, self.cfg.pad_id, chunk)
        return None, token_nll(self.logits(states_RD), labels_R, self.cfg.pad_id)

    def _target_relevance(self, target_enc_NS: Tensor | None, relevance_MD: Tensor, shape: torch.Size,
                          detach: bool, real: RealTokens | None = None) -> Tensor:
        """f(x_i, z_j) of the batch: zero without targets' encoder input (no relevance bias); under `detach` the same
        f as a constant to the backward pass (the targets' g pass then needs no graph)."""
        if target_enc_NS is None:
            return torch.zeros(shape, device=relevance_MD.device)
        if detach:
            with torch.no_grad():
                return self.relevance(self.relevance_vectors(target_enc_NS, real), relevance_MD.detach())
        return self.relevance(self.relevance_vectors(target_enc_NS, real), relevance_MD)

    def encode_real(self, tokens_RS: Tensor, real: RealTokens,
                    num_layers: int | None = None) -> tuple[Tensor, Tensor | None]:
        """`encoder_states` over the real tokens only (U D), and g of each row where the layers reach g's layer."""
        self._check_lengths(tokens_RS, "document")
        x = embed_at(real.take(tokens_RS), real.position_U, self.encoder_token_embedding, self.encoder_positions,
                       self.encoder_embedding_norm)
        x = self.dropout(x)
        key_ok_R11S = (tokens_RS != self.cfg.pad_id)[:, None, None, :]
        relevance_RD = None
        layers = self.encoder_layers if num_layers is None else self.encoder_layers[:num_layers]
        for i, layer in enumerate(layers):
            x = layer(x, key_ok_R11S, real)
            if i + 1 == self.cfg.relevance_layers:
                relevance_RD = real.pool(x, self.cfg.relevance_pooling)
        return (self.encoder_norm(x) if num_layers is None else x), relevance_RD

    def _forward_unpadded(self, evidence_MS: Tensor, target_enc_NS: Tensor | None, decoder_in_NT: Tensor,
                          labels_NT: Tensor, allowed_NM: Tensor, layout: UnpaddedLayout,
                          detach_relevance: bool) -> MargeOutput:
        """`forward` on real tokens (`UnpaddedLayout`): the memory is the evidence's real tokens (L of them), each
        target reads its documents' keys there, and the loss is taken over the targets' real tokens."""
        memory_LD, relevance_MD = self.encode_real(evidence_MS, layout.evidence)
        relevance_NM = self._target_relevance(target_enc_NS, relevance_MD, allowed_NM.shape, detach_relevance,
                                              layout.targets)
        n = allowed_NM.shape[0]
        cross = CrossMemory(layout.key_index_NK, relevance_NM.gather(1, layout.key_doc_NK.expand(n, -1)),
                            layout.visible_NK)
        real = layout.decoder
        x = self.dropout(embed_at(real.take(decoder_in_NT), real.position_U, self.embed_tokens,
                                    self.decoder_positions, self.decoder_embedding_norm))
        memory_1LD = memory_LD[None]
        for layer in [*self.decoder_local_layers, *self.decoder_layers]:
            x = layer(x, memory_1LD, cross, self.beta, None, real)
        states_UD, labels_U = self.decoder_norm(x), real.take(labels_NT)
        tokens_N = (labels_NT != self.cfg.pad_id).sum(1)
        nll_sum, nll_U = self._row_nll(states_UD, labels_U)
        nll_N = nll_U.new_zeros(n).index_add_(0, real.row_U, nll_U)
        loss = (nll_N.sum() if nll_sum is None else nll_sum) / tokens_N.sum().clamp(min=1)
        return MargeOutput(loss, nll_N, tokens_N, relevance_NM)


def layout_width(allowed_NM: Tensor) -> int:
    """The most evidence documents any target may read: the width of each target's gathered keys (all M: one
    shared memory). A target that may read none is an error."""
    counts_N = allowed_NM.sum(1)
    if not bool((counts_N > 0).all()):
        empty = (counts_N == 0).nonzero().flatten().tolist()
        raise ValueError(f"target(s) {empty} have no evidence document they may attend to")
    return int(counts_N.max())


def check_inputs(evidence_MS: Tensor, allowed_NM: Tensor, pad_id: int) -> int:
    """What the forward needs to know about its inputs before it runs, checked: every evidence row starts with a
    token (BOS), every target may read some evidence; returns `layout_width`. On host tensors (as the trainer
    prepares batches) it costs no device synchronisation; given its result, the forward reads no device value
    back."""
    if evidence_MS.shape[0] and not bool((evidence_MS[:, 0] != pad_id).all()):
        raise ValueError("every evidence document needs a non-padding first (BOS) token")
    return layout_width(allowed_NM)


def token_nll(logits_RV: Tensor, labels_R: Tensor, pad_id: int) -> Tensor:
    """Negative log-likelihood of each row's label (0 where the label is padding), in fp32."""
    return F.cross_entropy(logits_RV.float(), labels_R, ignore_index=pad_id, reduction="none")


def projected_token_nll(states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int) -> Tensor:
    """`token_nll` of the tied output projection `states @ weight.T` (what `Marge.logits` computes)."""
    return token_nll(states_RD @ weight_VD.T, labels_R, pad_id)


def chunked_token_nll(states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int, chunk: int) -> Tensor:
    """`token_nll` of the tied output projection `states @ weight.T`, `chunk` rows at a time. With gradients on,
    each chunk is checkpointed (its logits are recomputed in the backward pass, under the same autocast), so
    at most one chunk's logits exist at any time; the result and its gradients equal the unchunked loss's."""
    pieces = []
    for start in range(0, states_RD.shape[0], chunk):
        rows = slice(start, start + chunk)
        if torch.is_grad_enabled():
            pieces.append(torch.utils.checkpoint.checkpoint(projected_token_nll, states_RD[rows], weight_VD,
                                                            labels_R[rows], pad_id, use_reentrant=False))
        else:
            pieces.append(projected_token_nll(states_RD[rows], weight_VD, labels_R[rows], pad_id))
    return torch.cat(pieces)


class FusedLinearNLL(torch.autograd.Function):
    """sum over rows of -log softmax(states @ weight.T)[label] (padding labels excluded), computed `chunk` rows at a
    time with its gradients made in the same pass (a fused linear cross-entropy, the algorithm of Liger-kernel's, in
    plain PyTorch): per chunk one matmul for the logits and two for the gradients of states and weight, and no
    chunk's logits kept. Its output is the sum (what the training loss backpropagates, scaled by any weight) and each
    row's NLL, which carries no gradient."""

    @staticmethod
    def forward(ctx, states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int, chunk: int):
        rows_total = states_RD.shape[0]
        grad_states_RD = torch.zeros_like(states_RD)
        grad_weight_VD = torch.zeros(weight_VD.shape, dtype=torch.promote_types(weight_VD.dtype, torch.float32),
                                     device=weight_VD.device)
        nll_R = torch.zeros(rows_total, dtype=torch.float32, device=states_RD.device)
        for start in range(0, rows_total, chunk):
            rows = slice(start, min(rows_total, start + chunk))
            s_CD, y_C = states_RD[rows], labels_R[rows]
            logits_CV = (s_CD @ weight_VD.T).float()  # under the caller's autocast, as the unfused loss
            valid_C = y_C != pad_id
            nll_R[rows] = torch.where(valid_C, torch.logsumexp(logits_CV, -1) - logits_CV.gather(1, y_C[:, None])[:, 0],
                                      torch.zeros((), device=logits_CV.device))
            dlogits_CV = torch.softmax(logits_CV, -1)  # d nll / d logits = softmax - one-hot, on valid rows
            dlogits_CV[torch.arange(len(y_C), device=y_C.device), y_C] -= 1.0
            dlogits_CV = (dlogits_CV * valid_C[:, None]).to(s_CD.dtype)  # autocast, where on, casts the products
            grad_states_RD[rows] = (dlogits_CV @ weight_VD.to(s_CD.dtype)).to(grad_states_RD.dtype)
            grad_weight_VD += (dlogits_CV.T @ s_CD).to(grad_weight_VD.dtype)
        ctx.save_for_backward(grad_states_RD, grad_weight_VD)
        ctx.weight_dtype = weight_VD.dtype
        ctx.mark_non_differentiable(nll_R)
        return nll_R.sum(), nll_R

    @staticmethod
    def backward(ctx, grad_sum: Tensor, grad_rows: Tensor):
        grad_states_RD, grad_weight_VD = ctx.saved_tensors
        return (grad_states_RD * grad_sum.to(grad_states_RD.dtype), (grad_weight_VD * grad_sum).to(ctx.weight_dtype),
                None, None, None)


def fused_linear_nll(states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int,
                     chunk: int) -> tuple[Tensor, Tensor]:
    """(summed NLL with its gradient, each row's NLL) of the tied output projection: `FusedLinearNLL`."""
    return FusedLinearNLL.apply(states_RD, weight_VD, labels_R, pad_id, chunk)


class RelevanceEncoder(nn.Module):
    """g alone: token/position embeddings (and their LayerNorm), the first `relevance_layers` encoder layers and
    the running centre.

    Its parameter names are those of `Marge`, so a snapshot of these tensors from a training model
    loads here directly. Indexers and the retrieval service run this, not the whole model.
    """

    def __init__(self, cfg: MargeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.encoder_positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.encoder_embedding_norm = nn.LayerNorm(cfg.d_model) if cfg.embedding_layernorm else None
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.relevance_layers))
        self.register_buffer("relevance_center", torch.zeros(cfg.d_model))

    @classmethod
    def from_model(cls, model: "Marge") -> "RelevanceEncoder":
        encoder = cls(model.cfg)
        encoder.load_state_dict(relevance_state_dict(model))
        return encoder.to(model.beta.device)

    def encoder_states(self, tokens_RS: Tensor, num_layers: int) -> Tensor:
        """States after the first `num_layers` encoder layers (0: the embedded input), as `Marge.encoder_states`."""
        if tokens_RS.shape[1] > self.cfg.max_positions:
            raise ValueError(f"document length {tokens_RS.shape[1]} exceeds model.max_positions={self.cfg.max_positions}")
        x = embed(tokens_RS, self.embed_tokens, self.encoder_positions, 0, self.encoder_embedding_norm)
        return run_layers(x, self.encoder_layers[:num_layers], tokens_RS != self.cfg.pad_id)

    def forward(self, tokens_RS: Tensor) -> Tensor:
        """g(x) for each row (R D): the relevance layer's BOS state or mean state."""
        states = self.encoder_states(tokens_RS, self.cfg.relevance_layers)
        return pool_relevance(states, tokens_RS != self.cfg.pad_id, self.cfg.relevance_pooling)

    def unit_vectors(self, tokens_RS: Tensor) -> Tensor:
        """g(x) as the index stores it and queries search it (`unit_relevance` with the snapshot's centre)."""
        return unit_relevance(self(tokens_RS), self.relevance_center if self.cfg.relevance_centering else None)


def relevance_state_dict(model: Marge) -> dict[str, Tensor]:
    """The tensors `RelevanceEncoder` needs, taken from a full model (what a snapshot publishes)."""
    prefixes = ("encoder_positions.", "encoder_embedding_norm.", "relevance_center",
                *(f"encoder_layers.{i}." for i in range(model.cfg.relevance_layers)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefixes)}
    state["embed_tokens.weight"] = model.encoder_token_embedding.weight.detach().clone()
    return state


# ----------------------------------------------------------------------------------------------------
# Sizes and throughput
# ----------------------------------------------------------------------------------------------------


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
