"""Vectors of documents from an encoder: g(x) of many documents at once, batched by length (what the indexer, the
serving index and `marge plan` embed documents with: one function, so that every index holds the same vectors for the
same snapshot), and the sentence vectors of retrieval evaluation and of fine-tuned models (a layer's mean state, or
g as unit vectors)."""

from __future__ import annotations

import logging
from typing import Any, overload

import numpy as np
import torch

from marge.contracts.batch import SpecialTokens, as_encoder_input, encoder_cost, max_text_tokens
from marge.model.layers import pad_rows
from marge.model.network import Marge, RelevanceEncoder

log = logging.getLogger(__name__)


@torch.no_grad()
def embed_documents(encoder: RelevanceEncoder, tokens: list[np.ndarray], specials: SpecialTokens,
                    batch_tokens: int = 4096, device: str | torch.device = "cpu",
                    autocast_dtype: torch.dtype | None = None) -> np.ndarray:
    """g(x) of every document as unit vectors (`RelevanceEncoder.unit_vectors`: n D, float32), in input order.

    Documents are sorted by length and packed into batches of about `batch_tokens` padded tokens, so
    little compute goes to padding.
    """
    order = np.argsort([len(t) for t in tokens], kind="stable")
    out = np.zeros((len(tokens), encoder.cfg.d_model), dtype=np.float32)
    start = 0
    while start < len(order):
        stop = start + 1  # at least one document, however long
        # rows pad to the longest, which is the last one (sorted by length)
        while stop < len(order) and (stop - start + 1) * encoder_cost(len(tokens[order[stop]])) <= batch_tokens:
            stop += 1
        rows = [as_encoder_input(tokens[i], specials) for i in order[start:stop]]
        batch = pad_rows(rows, specials.pad_id).to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            vectors = encoder.unit_vectors(batch)
        out[order[start:stop]] = vectors.float().cpu().numpy()
        start = stop
    return out


def encode_texts(tokenizer, texts: list[str], max_positions: int) -> list[list[int]]:
    rows = []
    for ids in tokenizer.encode_batch(texts):
        ids = ids[: max_text_tokens(max_positions)]
        rows.append([tokenizer.specials.bos_id, *ids, tokenizer.specials.eos_id])
    return rows


@torch.no_grad()
def mean_layer_vectors(model: Marge | RelevanceEncoder, rows: list[list[int]], specials: SpecialTokens, layer: int,
                       batch_size: int = 64, device: str = "cpu") -> np.ndarray:
    """Mean of encoder layer `layer`'s states over each row's text tokens (BOS, EOS and padding excluded)."""
    order = np.argsort([len(r) for r in rows], kind="stable")
    vectors: list[Any] = [None] * len(rows)  # `order` covers every row: each slot holds its vector below
    for start in range(0, len(rows), batch_size):
        idx = order[start:start + batch_size]
        tokens = pad_rows([rows[i] for i in idx], specials.pad_id).to(device)
        states = encoder_layer_states(model, tokens, layer)
        keep = (tokens != specials.pad_id) & (tokens != specials.bos_id) & (tokens != specials.eos_id)
        keep = keep.unsqueeze(-1).to(states.dtype)
        mean = (states * keep).sum(1) / keep.sum(1).clamp(min=1)
        for j, i in enumerate(idx):
            vectors[i] = mean[j].float().cpu().numpy()
    out = np.stack(vectors)
    return out


def encoder_layer_states(model: Marge | RelevanceEncoder, tokens_RS: torch.Tensor, layer: int) -> torch.Tensor:
    """States after `layer` encoder layers; layer 0 is the embedded input (tokens + positions, normalised)."""
    return model.encoder_states(tokens_RS, layer)


def has_relevance_encoder(model) -> bool:
    """Whether the model has MARGE's g (VECO does not: its retrieval can only be read from an encoder layer)."""
    return isinstance(model, (Marge, RelevanceEncoder))


@torch.no_grad()
def relevance_unit_vectors(model: Marge | RelevanceEncoder, rows: list[list[int]], specials: SpecialTokens,
                           batch_size: int = 64, device: str = "cpu") -> np.ndarray:
    """g of each row as the index stores it (`unit_relevance`): retrieval exactly as the pipeline searches."""
    if not has_relevance_encoder(model):
        raise ValueError(f"a {type(model).__name__} model has no relevance encoder g: read its retrieval from an "
                         f"encoder layer instead (health.eval_layer: 0..{available_layers(model)})")
    g = model.unit_relevance_vectors if isinstance(model, Marge) else model.unit_vectors
    order = np.argsort([len(r) for r in rows], kind="stable")
    vectors = np.zeros((len(rows), model.cfg.d_model), dtype=np.float32)
    for start in range(0, len(rows), batch_size):
        idx = order[start:start + batch_size]
        vectors[idx] = g(pad_rows([rows[i] for i in idx], specials.pad_id).to(device)).cpu().numpy()
    return vectors


def available_layers(model: Marge | RelevanceEncoder) -> int:
    return len(model.encoder_layers)


@overload
def resolve_layer(model: Marge | RelevanceEncoder, layer: int | None, paper_layer: int = 5) -> int: ...


@overload
def resolve_layer(model: Marge | RelevanceEncoder, layer: int | str | None, paper_layer: int = 5) -> int | str: ...


def resolve_layer(model: Marge | RelevanceEncoder, layer: int | str | None, paper_layer: int = 5) -> int | str:
    """The encoder layer to pool: the given one, else the paper's 5 (or the deepest the model has); or "g"."""
    if layer == "g":
        return layer
    depth = available_layers(model)
    if layer is None:
        chosen = min(paper_layer, depth)
        if chosen != paper_layer:
            log.info("the model has %d encoder layers: pooling layer %d (the paper's choice is %d)",
                     depth, chosen, paper_layer)
        return chosen
    if isinstance(layer, str) or not 0 <= layer <= depth:
        raise ValueError(f"--layer {layer} is out of range: this model has encoder layers 1..{depth} "
                         "(0 = the embedding layer)")
    return layer


@torch.no_grad()
def unit_vector(encoder, tokenizer, token_ids) -> np.ndarray:
    """One text's g as the indexer stores documents and the service searches them (cut to the encoder's length)."""
    ids = list(token_ids)[: max_text_tokens(encoder.cfg.max_positions)]
    rows = pad_rows([as_encoder_input(ids, tokenizer.specials)], tokenizer.specials.pad_id)
    return encoder.unit_vectors(rows)[0].numpy()
