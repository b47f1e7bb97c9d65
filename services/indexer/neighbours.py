"""Neighbour search while indexing: the exact top-k inner products a version's link graph is ranked by.

One of the three things called an index here (docs/pipeline.md, "Three kinds of index"): not the link graph a
version keeps (`services.indexer.links`) nor the index the retrieval service searches (`services.retrieval`), but the
search that finds each document's candidates within its shard: FAISS's exact inner product (the pipeline's), the
same as one matrix product in torch (a process without FAISS), or char TF-IDF cosines with or without cos(g). A new
search backend is a branch of `nearest_neighbours` and a name in `SEARCH_BACKENDS`."""

from __future__ import annotations

import numpy as np
import torch

from marge.contracts.index_store import flat_ip_index


@torch.no_grad()
def searchable(index, use_gpu: bool):
    """The FAISS index on the GPU when asked and available (search only: the stored index stays on the CPU)."""
    import faiss

    if use_gpu and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    return index


SEARCH_BACKENDS = ("faiss", "torch")


def nearest_neighbours(database: np.ndarray, queries: np.ndarray, k: int, backend: str = "faiss",
                       use_gpu: bool = False, device: str | torch.device = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner products of every query against `database` (scores, row indices into `database`).

    'faiss' is the pipeline's search (IndexFlatIP). 'torch' is the same exact search as one matrix product
    and `topk` on `device`, for a single process without FAISS (a machine where only torch is installed): both
    return the k largest inner products; rows tied on score may come in another order.
    """
    if backend == "faiss":
        index = searchable(flat_ip_index(database, np.arange(len(database), dtype=np.int64)), use_gpu)
        return index.search(queries, k)
    if backend != "torch":
        raise ValueError(f"unknown search backend {backend!r}; choose one of {SEARCH_BACKENDS}")
    db = torch.as_tensor(database, device=device)
    scores, rows = [], []
    for start in range(0, len(queries), 4096):  # bounded memory: 4096 x len(database) scores at a time
        sims = torch.as_tensor(queries[start:start + 4096], device=device) @ db.T
        top = sims.topk(k, dim=1)
        scores.append(top.values.float().cpu().numpy())
        rows.append(top.indices.cpu().numpy())
    return np.concatenate(scores), np.concatenate(rows).astype(np.int64)


def lexical_vectors(texts: list[str]):
    """Char 2-4-gram TF-IDF rows of a shard's texts (the held-out baseline's features, fitted on the shard alone:
    no weights learned, no labels), L2-normalised: their inner products are cosines."""
    from marge.eval.evaluation import char_tfidf

    return char_tfidf().fit_transform(texts).astype(np.float32).tocsr()


def scored_neighbours(unit: np.ndarray | None, lexical, members: np.ndarray, k: int, lexical_weight: float | None,
                      block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of every document among `members` by cos(g) + lexical_weight * tfidf, or by tfidf alone when
    `lexical_weight` is None (scores, row indices into `members`), `block` queries at a time."""
    scores, rows = [], []
    n = unit.shape[0] if unit is not None else lexical.shape[0]
    for start in range(0, n, block):
        stop = min(n, start + block)
        sims = np.asarray((lexical[start:stop] @ lexical[members].T).todense(), dtype=np.float32)
        if lexical_weight is not None:
            if unit is None:
                raise ValueError("a lexical_weight adds tfidf to cos(g): give the unit vectors too (or None to rank "
                                 "by tfidf alone)")
            sims = unit[start:stop] @ unit[members].T + np.float32(lexical_weight) * sims
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < sims.shape[1] else np.tile(np.arange(sims.shape[1]), (len(sims), 1))
        top_scores = np.take_along_axis(sims, top, axis=1)
        order = np.argsort(-top_scores, axis=1, kind="stable")
        scores.append(np.take_along_axis(top_scores, order, axis=1))
        rows.append(np.take_along_axis(top, order, axis=1))
    return np.concatenate(scores), np.concatenate(rows).astype(np.int64)
