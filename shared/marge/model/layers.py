"""MARGE's building blocks: embeddings, relevance pooling, attention with the key bias beta * f (three kernels),
the unpadded layout, encoder and decoder layers, and the cross-attention memory each target reads.

Tensor-shape suffixes follow the legend in `marge.model.network`."""


from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention as _flex_attention

from marge.contracts.batch import framed_rows
from marge.model.architecture import MargeConfig


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


def is_key_bias(attn_bias: Tensor | None) -> TypeGuard[Tensor]:
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
`mask` gives the folded path's values and gradients; `flex` its values (tests/unit/test_gpu_readiness.py,
tests/unit/test_unpadded.py), and its gradients where a GPU is (benchmarks/gpu_speed.py's `checks`: on one H200)."""


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
        raise ValueError(f"the 'flex' key bias path has no attention dropout, got dropout_p={dropout_p}: attend "
                         "with dropout_p=0, or by the 'mask' or 'folded' path")
    from torch.nn.attention.flex_attention import flex_attention

    def add_key_bias(score, b, h, q_idx, kv_idx):
        return score + bias_BK[b, kv_idx]

    n = q_BHQE.shape[0]  # keys shared by every row (an expanded view) are given per row, as flex wants them
    return flex_attention(q_BHQE, k_BHKE.expand(n, -1, -1, -1), v_BHKE.expand(n, -1, -1, -1), score_mod=add_key_bias)


PACK_BLOCK = 128
"""Query and key tiles of packed cross-attention (`PackedCross`): FlexAttention's block size."""


@dataclass
class PackedCross:
    """Cross-attention over packed evidence (`trainer.cross_attention: packed`): every target's real decoder tokens
    in one sequence of queries, the evidence's real tokens in one sequence of keys (the memory, projected once), and
    which (query tile, key tile) pairs hold a target reading one of its documents. FlexAttention then skips every
    other tile, masks within a tile by `readable` (a target reads only its documents) and adds beta * f per
    (target, document): no key slot padded to the longest target, no per-target copy of the keys, heads 64 wide.
    Both sequences are padded to whole tiles with a query of no target (row N) and keys of no document (column M).
    Made on the host (`services.trainer.inputs`)."""

    target_Q: Tensor  # the target of each query (Q: the decoder's real tokens, then padding: N)
    doc_L: Tensor  # the evidence document of each memory key (L: the memory, then padding: M)
    kv_blocks: Tensor  # key tiles each query tile reads (1 1 Q/PACK_BLOCK), int32
    kv_indices: Tensor  # which, first (1 1 Q/PACK_BLOCK L/PACK_BLOCK), int32

    def map(self, fn) -> "PackedCross":
        return PackedCross(fn(self.target_Q), fn(self.doc_L), fn(self.kv_blocks), fn(self.kv_indices))


_compiled_flex: list = []


def flex_kernel(device: torch.device):
    """FlexAttention as it runs fast: compiled (once per process) on a GPU; eager elsewhere, where it materialises
    the logits and has no backward (values only: what the CPU tests compare). The function compiled is torch's own
    as this module found it on import, not whatever wraps it later (a benchmark's call census would be compiled
    into the graph and recompile it at every call)."""
    if device.type != "cuda":
        return _flex_attention
    if not _compiled_flex:
        _compiled_flex.append(torch.compile(_flex_attention))
    return _compiled_flex[0]


def packed_block_mask(packed: PackedCross, readable_NM: Tensor):
    """The FlexAttention block mask of `packed`: its tiles, and within a tile `readable_NM[target, document]`
    ((N+1) x (M+1), False on the padding row and column)."""
    from torch.nn.attention.flex_attention import BlockMask

    target_Q, doc_L = packed.target_Q, packed.doc_L

    def readable(b, h, q_idx, kv_idx):
        return readable_NM[target_Q[q_idx], doc_L[kv_idx]]

    return BlockMask.from_kv_blocks(kv_num_blocks=packed.kv_blocks, kv_indices=packed.kv_indices,
                                    BLOCK_SIZE=PACK_BLOCK, mask_mod=readable,
                                    seq_lengths=(target_Q.shape[0], doc_L.shape[0]))


def packed_cross_attention(q_1HQE: Tensor, k_1HLE: Tensor, v_1HLE: Tensor, packed: PackedCross, block_mask,
                           bias_NM: Tensor) -> Tensor:
    """Attention of the packed queries over the packed memory, a target reading only its documents' keys, with
    `bias_NM[target, document]` (beta * f, padded as `PackedCross` says) added to each logit."""
    target_Q, doc_L = packed.target_Q, packed.doc_L

    def add_relevance(score, b, h, q_idx, kv_idx):
        return score + bias_NM[target_Q[q_idx], doc_L[kv_idx]]

    return flex_kernel(q_1HQE.device)(q_1HQE, k_1HLE, v_1HLE, score_mod=add_relevance, block_mask=block_mask)


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
    """Where the real (non-padding) tokens of `rows` right-padded rows sit, and the (block_rows, width) block the
    attention lays them out in. Layers given one run their projections, feed-forward layers and norms on these U
    tokens alone (no FLOP on padding) and lay them out in the block only for the attention call (`to_rows`,
    `from_rows`). The block may be larger than the rows need (`trainer.bucket_rows`, `trainer.bucket_width`): empty
    rows and columns whose keys are masked (`key_ok`) and whose outputs are dropped, so that attention sees a
    bounded set of shapes. Made on the host (`services.trainer.inputs`)."""

    index_U: Tensor  # row * width + position of each real token, row by row: its place in the block
    row_U: Tensor  # its row
    position_U: Tensor  # its position in the row
    first_R: Tensor  # where each row's first token sits among the U
    lengths_R: Tensor  # real tokens of each row (>= 1)
    rows: int
    width: int  # the block's width (>= the longest row)
    block_rows: int = 0  # the block's rows (>= rows; 0: rows)

    def __post_init__(self) -> None:
        self.block_rows = self.block_rows or self.rows

    def to_rows(self, x_UD: Tensor) -> Tensor:
        """(block_rows, width, D) with x's tokens in place and zeros elsewhere."""
        return ScatterRows.apply(x_UD, self.index_U, self.block_rows * self.width).view(self.block_rows, self.width, -1)

    def from_rows(self, x_RSD: Tensor) -> Tensor:
        """The real tokens (U D) of a (block_rows, width, D) block."""
        return GatherRows.apply(x_RSD.reshape(self.block_rows * self.width, -1), self.index_U)

    def key_ok(self) -> Tensor:
        """Which keys of the block are real tokens (block_rows 1 1 width): what the encoder's attention may read."""
        lengths_B = F.pad(self.lengths_R, (0, self.block_rows - self.rows))
        return (torch.arange(self.width, device=lengths_B.device)[None, :] < lengths_B[:, None])[:, None, None, :]

    def take(self, tokens_RS: Tensor) -> Tensor:
        """The real entries (T) of the rows' right-padded (rows, any width >= the longest row) tensor, e.g. token
        ids or labels."""
        return tokens_RS[self.row_U, self.position_U]

    def pool(self, x_UD: Tensor, pooling: str) -> Tensor:
        """`pool_relevance` over real tokens: each row's first token, or the mean of its tokens (R D)."""
        if pooling == "bos":
            return x_UD.index_select(0, self.first_R)
        sums = x_UD.new_zeros(self.rows, x_UD.shape[-1]).index_add_(0, self.row_U, x_UD)
        return sums / self.lengths_R.to(x_UD.dtype)[:, None]

    def tensors(self) -> tuple[Tensor, ...]:
        return self.index_U, self.row_U, self.position_U, self.first_R, self.lengths_R

    def map(self, fn) -> "RealTokens":
        index_U, row_U, position_U, first_R, lengths_R = (fn(t) for t in self.tensors())
        return RealTokens(index_U, row_U, position_U, first_R, lengths_R, self.rows, self.width, self.block_rows)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "RealTokens":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "RealTokens":
        return self.map(lambda t: t.pin_memory())


@dataclass
class UnpaddedLayout:
    """How a host-prepared batch runs without padding (`trainer.unpadded`): the real tokens of the evidence, of the
    targets' encoder rows (their g) and of the decoder rows, and the keys each target reads in a memory made of the
    evidence's real tokens only. The loss and gradients are those of the padded batch (tests/unit/test_unpadded.py):
    padding keys weigh exactly 0 in every softmax, and nothing else mixes tokens."""

    evidence: RealTokens
    targets: RealTokens  # the targets' encoder rows (g)
    decoder: RealTokens  # the decoder's (and the labels') rows
    key_doc_NK: Tensor  # the evidence document of each key slot a target reads ((1, L) when every target reads all)
    visible_NK: Tensor  # False on slots a target may not read (its own document, unused slots)
    key_index_NK: Tensor | None = None  # where each slot's key sits in the memory (None: slot k is memory key k)
    packed: PackedCross | None = None  # the training cross-attention over packed evidence, when it runs so

    def map(self, fn) -> "UnpaddedLayout":
        return UnpaddedLayout(self.evidence.map(fn), self.targets.map(fn), self.decoder.map(fn), fn(self.key_doc_NK),
                              fn(self.visible_NK), None if self.key_index_NK is None else fn(self.key_index_NK),
                              None if self.packed is None else self.packed.map(fn))

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

    def in_projection(self, x: Tensor, parts: tuple[nn.Linear, ...], real: RealTokens | None) -> list[Tensor]:
        """x through `parts` (some of q_proj, k_proj, v_proj) as one matmul, each result in heads (B H X E); `real`:
        x holds only the real tokens, and the results are laid out in rows (one scatter for all the parts).

        One matmul, one scatter into rows and one gradient for x, where separate projections make one of each per
        part: fewer kernel launches an update (docs/gpu.md). The weights are concatenated for the call (a copy of
        parts x d^2 values, against tokens x d of activations), so the parameters, their names and every checkpoint
        stay those of separate projections."""
        if len(parts) == 1:
            y = parts[0](x)
            return [self.split_heads(y if real is None else real.to_rows(y))]
        y = F.linear(x, torch.cat([p.weight for p in parts]), torch.cat([p.bias for p in parts]))
        if real is not None:
            y = real.to_rows(y)
        b, s, _ = y.shape
        # (B X parts H E) -> parts x (B H X E): views of y; their gradients come back as one stacked tensor
        return list(y.view(b, s, len(parts), self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0))

    def project_kv(self, memory_BLD: Tensor, real: RealTokens | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values in heads (B H L E); `real`: projected from the real tokens only, then laid out in rows."""
        k_BHLE, v_BHLE = self.in_projection(memory_BLD, (self.k_proj, self.v_proj), real)
        return k_BHLE, v_BHLE

    def project_qkv(self, x_BSD: Tensor, real: RealTokens | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of a self-attention in heads (B H S E), as `project_kv` and `attend` take them."""
        q_BHSE, k_BHSE, v_BHSE = self.in_projection(x_BSD, (self.q_proj, self.k_proj, self.v_proj), real)
        return q_BHSE, k_BHSE, v_BHSE

    @torch.no_grad()
    def key_mass(self, x_BQD: Tensor, k_BHKE: Tensor, visible_BK: Tensor, query_ok_BQ: Tensor,
                 real: RealTokens | None = None) -> Tensor:
        """How much attention each key gets with no bias on the logits (B K, float32): softmax(q.k / sqrt(E)) over
        the keys a row may read, averaged over the heads and over the row's real queries (`query_ok_BQ`). What
        the decoder reads whatever beta * f says: the relevance-distillation teacher (Izacard & Grave 2021)."""
        q_BHQE = self.in_projection(x_BQD, (self.q_proj,), real)[0].float()
        logits_BHQK = q_BHQE @ k_BHKE.float().transpose(-1, -2) / math.sqrt(q_BHQE.shape[-1])
        logits_BHQK = logits_BHQK.masked_fill(~visible_BK[:, None, None, :], float("-inf"))
        probs_BQK = logits_BHQK.softmax(-1).mean(1)
        weights_BQ1 = query_ok_BQ[:, :probs_BQK.shape[1], None].float()
        return (probs_BQK * weights_BQ1).sum(1) / weights_BQ1.sum(1).clamp(min=1)

    def packed(self, x_UD: Tensor, k_1HLE: Tensor, v_1HLE: Tensor, cross: "CrossMemory", beta: Tensor) -> Tensor:
        """Cross-attention of the targets' real tokens (U D, in `cross.packed`'s order) over the packed memory
        (`packed_cross_attention`); the output as real tokens."""
        packed, relevance_PP = cross.packed, cross.relevance_PP
        if packed is None or relevance_PP is None:
            raise ValueError("packed cross-attention needs the CrossMemory's packed layout and its f")
        if self.dropout and self.training:
            raise ValueError("trainer.cross_attention=packed has no attention dropout: set model.attention_dropout=0")
        q_UD = self.q_proj(x_UD)
        u, queries = q_UD.shape[0], packed.target_Q.shape[0]
        q_1HQE = self.split_heads(F.pad(q_UD, (0, 0, 0, queries - u))[None])
        out_1HQE = packed_cross_attention(q_1HQE, k_1HLE.to(q_1HQE.dtype), v_1HLE.to(q_1HQE.dtype), packed,
                                          cross.block_mask, beta * relevance_PP)
        return self.out_proj(out_1HQE[0].transpose(0, 1).reshape(queries, -1)[:u])

    def forward(self, x_BQD: Tensor, k_BHLE: Tensor, v_BHLE: Tensor, attn_bias: Tensor | None = None,
                is_causal: bool = False, real: RealTokens | None = None) -> Tensor:
        """`real`: x holds only the real tokens (U D) of the rows `real` describes; the projections run on those
        alone, the attention on the rows, and the output comes back as real tokens."""
        (q_BHQE,) = self.in_projection(x_BQD, (self.q_proj,), real)
        return self.attend(q_BHQE, k_BHLE, v_BHLE, attn_bias, is_causal, real)

    def attend(self, q_BHQE: Tensor, k_BHLE: Tensor, v_BHLE: Tensor, attn_bias: Tensor | None = None,
               is_causal: bool = False, real: RealTokens | None = None) -> Tensor:
        """`forward` from queries already in heads (`project_qkv`'s): the attention, then the output projection."""
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
        q, k, v = self.self_attn.project_qkv(h, real)
        x_BSD = x_BSD + self.dropout(self.self_attn.attend(q, k, v, attn_bias=key_ok_B11S, real=real))
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
    key_doc_NK: Tensor | None = None
    """The evidence document of each key slot ((1, K) when every target reads the same keys): what turns a per-key
    figure into a per-document one (`Marge.reading_distribution`). None where nothing needs it (decoding)."""
    packed: PackedCross | None = None
    """Set: the training forward reads the packed memory instead (`packed_cross_attention`), with these two."""
    relevance_PP: Tensor | None = None  # f per (target, document), padded as `PackedCross` says
    block_mask: Any = None  # `packed_block_mask`, made once per forward

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
        key_doc = (None if self.key_doc_NK is None or self.key_doc_NK.shape[0] == 1
                   else self.key_doc_NK.index_select(0, index_N))
        return CrossMemory(key_index, self.relevance_NK.index_select(0, index_N), self.visible_NK.index_select(0, index_N),
                           key_doc if key_doc is not None else self.key_doc_NK)


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
                cache: LayerCache | None = None, real: RealTokens | None = None, taps: dict | None = None) -> Tensor:
        """`real`: x holds only the real tokens (U D) of the targets' rows (training; no cache). `taps`: given (with
        the targets' real query positions as `query_ok_NT`), the cross-attention's unbiased mass on each key slot is
        put there as `key_mass_NK` (`Attention.key_mass`)."""
        h = self.self_attn_norm(x_NTD)
        q, k, v = self.self_attn.project_qkv(h, real)
        if cache is not None:
            if cache.self_k is not None and cache.self_v is not None:  # set together, below
                k, v = torch.cat([cache.self_k, k], dim=2), torch.cat([cache.self_v, v], dim=2)
            cache.self_k, cache.self_v = k, v
        positions = x_NTD.shape[1] if real is None else real.width  # rows are right-padded: causal covers padding
        x_NTD = x_NTD + self.dropout(self.self_attn.attend(q, k, v, **causal_attention(positions, k.shape[2], k.device),
                                                           real=real))
        # cross_attn and cross_attn_norm are made together (`cross_attention`): either both or neither
        if self.cross_attn is not None and self.cross_attn_norm is not None:
            if cross is None or beta is None:
                raise ValueError("a decoder layer with cross-attention needs the evidence's CrossMemory and beta")
            h = self.cross_attn_norm(x_NTD)
            if cross.packed is not None and cache is None and taps is None and memory_1LD is not None:
                k_1HLE, v_1HLE = self.cross_attn.project_kv(memory_1LD)
                x_NTD = x_NTD + self.dropout(self.cross_attn.packed(h, k_1HLE, v_1HLE, cross, beta))
                return x_NTD + self.ffn(self.ffn_norm(x_NTD))
            if cache is not None and cache.cross_k is not None and cache.cross_v is not None:
                k, v = cache.cross_k, cache.cross_v
            else:
                if memory_1LD is None:
                    raise ValueError("a decoder layer with cross-attention needs the evidence memory when no "
                                     "cached cross keys are given")
                # project the memory once, then give each target its own keys: never N copies of the projection
                k_1HLE, v_1HLE = self.cross_attn.project_kv(memory_1LD)
                k, v = cross.gather(k_1HLE), cross.gather(v_1HLE)
                if cache is not None:
                    cache.cross_k, cache.cross_v = k, v
            if taps is not None:
                taps["key_mass_NK"] = self.cross_attn.key_mass(h, k, cross.visible_NK, taps["query_ok_NT"], real)
            x_NTD = x_NTD + self.dropout(self.cross_attn(h, k, v, attn_bias=cross.bias(beta), real=real))
        return x_NTD + self.ffn(self.ffn_norm(x_NTD))

