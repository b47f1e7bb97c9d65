"""g(x) of many documents at once, batched by length: what the indexer, the serving index and `marge plan` embed
documents with (one function, so that every index holds the same vectors for the same snapshot)."""

from __future__ import annotations

import numpy as np
import torch

from marge.contracts.batch import SpecialTokens, as_encoder_input, encoder_cost
from marge.model.network import RelevanceEncoder
from marge.model.layers import pad_rows


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

