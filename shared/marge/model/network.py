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
    D  model width    H  attention heads    E  head width = D // H    V  vocabul

The config is `marge.model.architecture`, the layers `marge.model.layers`, the loss kernels `marge.model.losses`,
sizes and FLOPs `marge.model.sizes`.
"""


from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from marge.model.architecture import RELEVANCE_CENTER_MOMENTUM, MargeConfig, init_parameters
from marge.model.layers import (
    CrossMemory,
    DecoderLayer,
    EncodedEvidence,
    EncoderLayer,
    LayerCache,
    RealTokens,
    UnpaddedLayout,
    embed,
    embed_at,
    packed_block_mask,
    pool_relevance,
    run_layers,
    unit_relevance,
)
from marge.model.losses import chunked_token_nll, fused_linear_nll, projected_token_nll, token_nll


@dataclass
class MargeOutput:
    loss: Tensor  # mean NLL per target token (padding excluded)
    nll_per_target_N: Tensor  # summed NLL of each target
    tokens_per_target_N: Tensor
    relevance_NM: Tensor  # f(x_i, z_j) = cos(g(x_i), g(z_j)), with gradient
    logits_NTV: Tensor | None = None
    reading_NM: Tensor | None = None  # forward(reading=True): how the decoder spreads its attention over documents


class Marge(nn.Module):
    relevance_center: Tensor  # a buffer (register_buffer below); named here so its type is a tensor's

    def __init__(self, cfg: MargeConfig):
        super().__init__()
        self.cfg = cfg
        self.loss_chunk_tokens = 0
        """Target tokens whose output logits the training loss computes at a time (0: all at once); set by the
        trainer from `trainer.loss_chunk_tokens`. Not architecture: it changes no weight."""
        self.projected_nll = projected_token_nll
        """The unchunked loss head: each row's NLL of the tied output projection. `trainer.compile` swaps in a
        compiled copy, so the [rows x vocabulary] logits' cast, log-softmax and NLL (and their backward) run as a few
        fused kernels instead of fp32 copies of the logits."""
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.encoder_embed_tokens = (None if cfg.tie_encoder_embeddings
                                     else nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id))
        self.relevance_encoder = OwnRelevanceEncoder(cfg) if cfg.own_relevance_encoder else None
        """g's own encoder (`model.own_relevance_encoder`); None: g is the first layers of the encoder."""
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

    def relevance_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """g's parameters in two parts: the token embedding it reads (`embedding`: the decoder's too when tied) and
        the rest of g (`layers`: its layers, position embedding and embedding norm)."""
        if self.relevance_encoder is not None:
            tower = self.relevance_encoder
            embedding, positions, norm, layers = (tower.embed_tokens, tower.positions, tower.embedding_norm,
                                                  list(tower.layers))
        else:
            embedding, positions, norm = self.encoder_token_embedding, self.encoder_positions, self.encoder_embedding_norm
            layers = list(self.encoder_layers[:self.cfg.relevance_layers])
        rest = [*positions.parameters(), *(norm.parameters() if norm is not None else ()),
                *(p for layer in layers for p in layer.parameters())]
        return {"embedding": [embedding.weight], "layers": [p for p in rest if p.requires_grad]}

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
        if self.relevance_encoder is not None:
            self._check_lengths(tokens_RS, "document")
            return self.relevance_encoder(tokens_RS, real, self.dropout)
        if real is not None:
            return _reached(self.encode_real(tokens_RS, real, self.cfg.relevance_layers)[1])
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
        if self.relevance_encoder is not None:
            relevance_MD = self.relevance_vectors(evidence_MS)
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
                               allowed_NM[:, evidence.key_doc_L] & evidence.key_ok_L[None, :], evidence.key_doc_L[None])
        s = evidence.key_ok_L.shape[0] // m
        # each target's allowed documents first, in document order (a stable sort of the mask)
        order_NM = torch.sort(allowed_NM.to(torch.int8), dim=1, descending=True, stable=True).indices
        docs_NV = order_NM[:, :width]
        slot_ok_NV = allowed_NM.gather(1, docs_NV)
        key_index_NK = (docs_NV[:, :, None] * s + torch.arange(s, device=docs_NV.device)).reshape(n, width * s)
        relevance_NK = relevance_NM.gather(1, docs_NV)[:, :, None].expand(n, width, s).reshape(n, width * s)
        visible_NK = (slot_ok_NV[:, :, None] & evidence.key_ok_L[key_index_NK].view(n, width, s)).reshape(n, width * s)
        return CrossMemory(key_index_NK, relevance_NK, visible_NK, docs_NV.repeat_interleave(s, dim=1))

    # --- decoder --------------------------------------------------------------------------------

    def decode(self, decoder_in_NT: Tensor, memory_1LD: Tensor | None, cross: CrossMemory | None,
               caches: list[LayerCache] | None = None, start_position: int = 0, taps: dict | None = None) -> Tensor:
        """Decoder states (N T D) for `decoder_in_NT`, cross-attending over the evidence memory.

        With `caches` the call is one step of incremental decoding: positions start at
        `start_position` and every layer appends its keys/values to its cache. `taps`: the last cross-attention
        layer's unbiased key mass is put there (`DecoderLayer.forward`).
        """
        n, t = decoder_in_NT.shape
        if start_position + t > self.cfg.max_positions:
            raise ValueError(f"target length {start_position + t} exceeds model.max_positions={self.cfg.max_positions}")
        x = self._embed_decoder(decoder_in_NT, start_position)
        layers = [*self.decoder_local_layers, *self.decoder_layers]
        for i, layer in enumerate(layers):
            x = layer(x, memory_1LD, cross, self.beta, None if caches is None else caches[i],
                      taps=taps if i == len(layers) - 1 else None)
        return self.decoder_norm(x)

    def logits(self, states_NTD: Tensor) -> Tensor:
        return states_NTD @ self.embed_tokens.weight.T  # tied output projection

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in range(len(self.decoder_local_layers) + len(self.decoder_layers))]

    # --- the reconstruction loss ----------------------------------------------------------------

    def forward(self, evidence_MS: Tensor, target_enc_NS: Tensor | None, decoder_in_NT: Tensor, labels_NT: Tensor,
                allowed_NM: Tensor, return_logits: bool = False, width: int | None = None,
                detach_relevance: bool = False, layout: UnpaddedLayout | None = None,
                reading: bool = False) -> MargeOutput:
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
        reading        also return `reading_NM` (`reading_distribution`: which documents the decoder reads, no
                       gradient), and f with its graph even under `detach_relevance` (the bias still gets f's value
                       alone): what a loss that trains f on the decoder's reading needs
        """
        self._check_lengths(decoder_in_NT, "target")
        if decoder_in_NT.shape != labels_NT.shape:
            raise ValueError(f"decoder input {tuple(decoder_in_NT.shape)} and labels {tuple(labels_NT.shape)} differ")
        if layout is not None:
            if return_logits:
                raise ValueError("return_logits needs the padded layout (layout=None)")
            return self._forward_unpadded(evidence_MS, target_enc_NS, decoder_in_NT, labels_NT, allowed_NM, layout,
                                          detach_relevance, reading)
        if width is None:
            width = check_inputs(evidence_MS, allowed_NM, self.cfg.pad_id)
        evidence = self.encode_evidence(evidence_MS)
        relevance_NM = self._target_relevance(target_enc_NS, evidence.relevance_MD, allowed_NM.shape,
                                              detach_relevance and not reading)
        bias_NM = relevance_NM.detach() if detach_relevance else relevance_NM
        cross = self.cross_memory(evidence, bias_NM, allowed_NM, width)
        taps = {"query_ok_NT": decoder_in_NT != self.cfg.pad_id} if reading else None
        states_NTD = self.decode(decoder_in_NT, evidence.memory_1LD, cross, taps=taps)
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
        read_NM = reading_distribution(taps["key_mass_NK"], cross, allowed_NM) if taps is not None else None
        return MargeOutput(loss, nll_N, tokens_N, relevance_NM, logits_NTV, read_NM)

    def _row_nll(self, states_RD: Tensor, labels_R: Tensor) -> tuple[Tensor | None, Tensor]:
        """Each row's NLL under the tied output projection, as `trainer.loss_chunk_tokens` says: with gradients on and
        a chunk size, fused (3 matmuls a chunk, no logits kept; its sum, which carries the gradient, comes first),
        without gradients chunked, else all logits at once (no sum: None)."""
        chunk = self.loss_chunk_tokens
        if chunk and torch.is_grad_enabled():
            return fused_linear_nll(states_RD, self.embed_tokens.weight, labels_R, self.cfg.pad_id, chunk)
        if chunk:
            return None, chunked_token_nll(states_RD, self.embed_tokens.weight, labels_R, self.cfg.pad_id, chunk)
        return None, self.projected_nll(states_RD, self.embed_tokens.weight, labels_R, self.cfg.pad_id)

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
        key_ok_R11S = real.key_ok()
        relevance_RD = None
        layers = self.encoder_layers if num_layers is None else self.encoder_layers[:num_layers]
        for i, layer in enumerate(layers):
            x = layer(x, key_ok_R11S, real)
            if i + 1 == self.cfg.relevance_layers:
                relevance_RD = real.pool(x, self.cfg.relevance_pooling)
        return (self.encoder_norm(x) if num_layers is None else x), relevance_RD

    def _forward_unpadded(self, evidence_MS: Tensor, target_enc_NS: Tensor | None, decoder_in_NT: Tensor,
                          labels_NT: Tensor, allowed_NM: Tensor, layout: UnpaddedLayout,
                          detach_relevance: bool, reading: bool = False) -> MargeOutput:
        """`forward` on real tokens (`UnpaddedLayout`): the memory is the evidence's real tokens (L of them), each
        target reads its documents' keys there, and the loss is taken over the targets' real tokens."""
        memory_LD, relevance_MD = self.encode_real(evidence_MS, layout.evidence)
        if self.relevance_encoder is not None:
            relevance_MD = self.relevance_vectors(evidence_MS, layout.evidence)
        relevance_NM = self._target_relevance(target_enc_NS, _reached(relevance_MD), allowed_NM.shape,
                                              detach_relevance and not reading, layout.targets)
        bias_NM = relevance_NM.detach() if detach_relevance else relevance_NM
        n = allowed_NM.shape[0]
        real = layout.decoder
        # the cross-attention's rows are the decoder block's (targets, then empty rows that read nothing); its keys
        # the memory's, then slots of padding (`UnpaddedLayout`: a bucketed block)
        rows = real.block_rows
        bias_BM = F.pad(bias_NM, (0, 0, 0, rows - n))
        cross = CrossMemory(layout.key_index_NK, bias_BM.gather(1, layout.key_doc_NK.expand(rows, -1)),
                            layout.visible_NK, layout.key_doc_NK)
        query_ok_NT = decoder_in_NT != self.cfg.pad_id
        taps = {"query_ok_NT": F.pad(query_ok_NT, (0, real.width - query_ok_NT.shape[1], 0, rows - n))} \
            if reading else None
        x = self.dropout(embed_at(real.take(decoder_in_NT), real.position_U, self.embed_tokens,
                                    self.decoder_positions, self.decoder_embedding_norm))
        memory_1LD = memory_LD[None]
        packed = layout.packed if not reading else None  # the probes' reading taps read the gathered keys
        if packed is not None:  # the packed memory: the evidence's real tokens, then keys of no document
            memory_1LD = F.pad(memory_LD, (0, 0, 0, packed.doc_L.shape[0] - memory_LD.shape[0]))[None]
            cross.packed, cross.relevance_PP = packed, F.pad(bias_NM, (0, 1, 0, 1))
            cross.block_mask = packed_block_mask(packed, F.pad(allowed_NM, (0, 1, 0, 1)))
        elif layout.key_index_NK is None and layout.key_doc_NK.shape[1] > memory_LD.shape[0]:
            memory_1LD = F.pad(memory_LD, (0, 0, 0, layout.key_doc_NK.shape[1] - memory_LD.shape[0]))[None]
        layers = [*self.decoder_local_layers, *self.decoder_layers]
        for i, layer in enumerate(layers):
            x = layer(x, memory_1LD, cross, self.beta, None, real, taps=taps if i == len(layers) - 1 else None)
        states_UD, labels_U = self.decoder_norm(x), real.take(labels_NT)
        tokens_N = (labels_NT != self.cfg.pad_id).sum(1)
        nll_sum, nll_U = self._row_nll(states_UD, labels_U)
        nll_N = nll_U.new_zeros(n).index_add_(0, real.row_U, nll_U)
        loss = (nll_N.sum() if nll_sum is None else nll_sum) / tokens_N.sum().clamp(min=1)
        read_NM = None
        if taps is not None:
            targets_N = torch.arange(n, device=bias_NM.device)
            read_NM = reading_distribution(taps["key_mass_NK"][:n], cross.reorder(targets_N), allowed_NM)
        return MargeOutput(loss, nll_N, tokens_N, relevance_NM, None, read_NM)


@torch.no_grad()
def reading_distribution(key_mass_NK: Tensor, cross: CrossMemory, allowed_NM: Tensor) -> Tensor:
    """Which evidence documents the decoder reads (N M, rows sum to 1 over the documents a target may read): the
    last cross-attention layer's unbiased attention (`Attention.key_mass`) averaged over each document's keys, so
    that a long document does not count for more than a short one (Izacard & Grave 2021 average over a passage's
    tokens too)."""
    n, m = allowed_NM.shape
    if cross.key_doc_NK is None:
        raise ValueError("the cross memory does not say which document each key is from (key_doc_NK)")
    doc_NK = cross.key_doc_NK.expand(n, -1)
    visible_NK = cross.visible_NK.float()
    mass_NM = key_mass_NK.new_zeros(n, m).scatter_add_(1, doc_NK, key_mass_NK * visible_NK)
    keys_NM = key_mass_NK.new_zeros(n, m).scatter_add_(1, doc_NK, visible_NK)
    per_key_NM = (mass_NM / keys_NM.clamp(min=1)).masked_fill(~allowed_NM, 0.0)
    return per_key_NM / per_key_NM.sum(1, keepdim=True).clamp(min=1e-12)


class OwnRelevanceEncoder(nn.Module):
    """g's own encoder (`model.own_relevance_encoder`): token and position embeddings, their norm and
    `relevance_layers` encoder layers, pooled as `relevance_pooling` says. `RelevanceEncoder` (what the indexer
    runs) loads it under its own names (`relevance_state_dict`)."""

    def __init__(self, cfg: MargeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.embedding_norm = nn.LayerNorm(cfg.d_model) if cfg.embedding_layernorm else None
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.relevance_layers))

    def forward(self, tokens_RS: Tensor, real: RealTokens | None = None, dropout: nn.Module | None = None) -> Tensor:
        """g of each row (R D); `real`: the rows' real tokens, run without their padding."""
        drop = dropout if dropout is not None else nn.Identity()
        if real is None:
            x = drop(embed(tokens_RS, self.embed_tokens, self.positions, 0, self.embedding_norm))
            return pool_relevance(run_layers(x, self.layers, tokens_RS != self.cfg.pad_id),
                                  tokens_RS != self.cfg.pad_id, self.cfg.relevance_pooling)
        x = drop(embed_at(real.take(tokens_RS), real.position_U, self.embed_tokens, self.positions,
                          self.embedding_norm))
        key_ok_R11S = real.key_ok()
        for layer in self.layers:
            x = layer(x, key_ok_R11S, real)
        return real.pool(x, self.cfg.relevance_pooling)


def _reached(relevance_RD: Tensor | None) -> Tensor:
    """g from `encode_real`, which is None only when its layers stop short of g's layer."""
    if relevance_RD is None:
        raise ValueError("the encoder layers run stop before model.relevance_layers, so g was not computed")
    return relevance_RD


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


class RelevanceEncoder(nn.Module):
    """g alone: token/position embeddings (and their LayerNorm), the first `relevance_layers` encoder layers and
    the running centre.

    Its parameter names are those of `Marge`, so a snapshot of these tensors from a training model
    loads here directly. Indexers and the retrieval service run this, not the whole model.
    """

    relevance_center: Tensor  # a buffer (register_buffer below); named here so its type is a tensor's

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
    if model.relevance_encoder is not None:
        tower = {k: v.detach().clone() for k, v in model.relevance_encoder.state_dict().items()}
        renamed = {"embed_tokens.": "embed_tokens.", "positions.": "encoder_positions.",
                   "embedding_norm.": "encoder_embedding_norm.", "layers.": "encoder_layers."}
        state = {next(new + k[len(old):] for old, new in renamed.items() if k.startswith(old)): v
                 for k, v in tower.items()}
        state["relevance_center"] = model.relevance_center.detach().clone()
        return state
    prefixes = ("encoder_positions.", "encoder_embedding_norm.", "relevance_center",
                *(f"encoder_layers.{i}." for i in range(model.cfg.relevance_layers)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefixes)}
    # through the module's state_dict, as the rest: what a training host keeps there (its fp32 masters, where the
    # parameters it computes with are bf16 copies)
    state["embed_tokens.weight"] = model.encoder_token_embedding.state_dict()["weight"].detach().clone()
    return state

