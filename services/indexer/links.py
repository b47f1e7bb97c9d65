"""The link graph of an index version: which target -> evidence links each shard keeps, by the version's link source.

One of the three things called an index here (docs/pipeline.md, "Three kinds of index"): the graph the batcher
builds batches from (`graph-*.parquet` of a version, `marge.contracts.index_store`). Candidates come from the
neighbour search (`services.indexer.neighbours`); this module keeps the strongest under the link budget
(`indexer.links_monolingual`, `links_crosslingual`, `link_rule`) or, for the diagnostic oracles, links by the
corpus's alignment. A new link source is a branch of `version_links` and a value of `IndexerConfig.link_source`."""

from __future__ import annotations

import numpy as np
import torch

from marge.contracts.corpus import ShardDocuments
from services.indexer.config import IndexerConfig
from services.indexer.neighbours import lexical_vectors, nearest_neighbours, scored_neighbours


def shard_links(doc_ids: np.ndarray, langs: np.ndarray, unit: np.ndarray | None, cfg: IndexerConfig,
                search: str = "faiss", device: str | torch.device = "cpu", lexical=None,
                lexical_weight: float | None = 0.0) -> dict[str, np.ndarray]:
    """The kept directed links (target -> evidence) of one shard, strongest first within each kind.

    Candidates are ranked by cos(g) of the unit vectors `unit` (with `search`, the exact neighbour search of
    `nearest_neighbours`: 'faiss', the pipeline's, or 'torch'), by cos(g) + lexical_weight * tfidf when
    `lexical` (the shard's `lexical_vectors`) is given with a weight > 0, or by tfidf alone when `lexical_weight`
    is None.
    """
    n = len(doc_ids)
    targets, evidence, scores = [], [], []
    all_rows = np.arange(n)
    use_lexical = lexical is not None and (lexical_weight is None or lexical_weight > 0)
    for lang in np.unique(langs):
        members = np.nonzero(langs == lang)[0]
        k = min(len(members), cfg.candidates_per_language + 1)  # +1: a document finds itself
        if k == 0:
            continue
        if use_lexical:
            sims, rows = scored_neighbours(unit, lexical, members, k, lexical_weight)
        else:
            if unit is None:
                raise ValueError("ranking by cos(g) needs the unit vectors; without them give `lexical` and "
                                 "lexical_weight None (tfidf alone)")
            sims, rows = nearest_neighbours(unit[members], unit, k, search, cfg.use_gpu, device)
        nbrs = np.where(rows >= 0, members[np.clip(rows, 0, None)], -1)
        targets.append(np.repeat(all_rows, k))
        evidence.append(nbrs.reshape(-1))
        scores.append(sims.reshape(-1))
    t = np.concatenate(targets)
    e = np.concatenate(evidence)
    s = np.concatenate(scores)
    ok = (e >= 0) & (e != t) & (s >= cfg.min_score)
    t, e, s = t[ok], e[ok], s[ok]
    cross = langs[t] != langs[e]
    keep = []
    for mask, per_doc in ((~cross, cfg.links_monolingual), (cross, cfg.links_crosslingual)):
        idx = np.nonzero(mask)[0]
        if cfg.link_rule == "shard":
            budget = int(round(per_doc * n))
            if budget and len(idx):
                # stable sort by score, ties broken by (target, evidence) order: deterministic
                keep.append(idx[np.argsort(-s[idx], kind="stable")[:budget]])
        elif len(idx) and per_doc > 0:
            # per target: sort by (target, -score), keep the first `per_doc` of each target
            order = idx[np.lexsort((-s[idx], t[idx]))]
            first = np.r_[0, np.nonzero(np.diff(t[order]))[0] + 1]
            rank = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
            keep.append(order[rank < int(round(per_doc))])
    keep_idx = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    return {"target_id": doc_ids[t[keep_idx]], "evidence_id": doc_ids[e[keep_idx]],
            "score": s[keep_idx].astype(np.float32), "cross_lingual": cross[keep_idx]}


def aligned_partners(docs: ShardDocuments) -> list[list[int]]:
    """Each document's aligned translations in the shard (positions, sorted): the corpus's alignment labels, which the
    diagnostic oracles link by and nothing else reads."""
    paragraph_ids = docs.paragraph_ids
    if paragraph_ids is None or not docs.aligned:  # aligned: paragraph ids present, and some not empty
        raise ValueError(f"shard {docs.shard}: indexer.links 'aligned' needs a corpus prepared from input with "
                         "paragraph_ids (see `marge prepare`); this one has none")
    by_key: dict[tuple[str, str], list[int]] = {}
    for i in range(len(docs)):
        for pid in paragraph_ids[i]:
            by_key.setdefault((docs.groups[i], pid), []).append(i)
    return [sorted({j for pid in paragraph_ids[i] for j in by_key[(docs.groups[i], pid)]
                    if docs.langs[j] != docs.langs[i]}) for i in range(len(docs))]


def scored_links(docs: ShardDocuments,
                 chosen: list[tuple[int, list[int], np.ndarray | list[int]]]) -> dict[str, np.ndarray]:
    """Links from (target, evidence scored 1, evidence scored 0) positions, in that order per target."""
    targets, evidence, scores = [], [], []
    for i, partners, others in chosen:
        for j, score in [*((j, 1.0) for j in partners), *((int(j), 0.0) for j in others)]:
            targets.append(i)
            evidence.append(j)
            scores.append(score)
    t, e = np.array(targets, dtype=np.int64), np.array(evidence, dtype=np.int64)
    return {"target_id": docs.doc_ids[t], "evidence_id": docs.doc_ids[e], "score": np.array(scores, dtype=np.float32),
            "cross_lingual": docs.langs[t] != docs.langs[e] if len(t) else np.zeros(0, dtype=bool)}


def aligned_links(docs: ShardDocuments, distractors: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Diagnostic oracle links: every document to each of its aligned translations (`ShardDocuments.translations`,
    score 1) and to `distractors` random other documents of the shard that are not its translations (score 0).
    Uses the corpus's alignment labels: never MARGE, only the ceiling a retriever could reach."""
    n = len(docs)
    chosen: list[tuple[int, list[int], np.ndarray | list[int]]] = []
    for i, partners in enumerate(aligned_partners(docs)):
        others = np.setdiff1d(np.arange(n), [i, *partners])
        chosen.append((i, partners, rng.choice(others, size=min(distractors, len(others)), replace=False)
                       if len(others) else []))
    return scored_links(docs, chosen)


def budget_aligned_links(docs: ShardDocuments, cfg: IndexerConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Diagnostic oracle links with the loop's link budget (`IndexerConfig.aligned_layout` 'budget'): each document's
    `links_monolingual` nearest same-language documents by char TF-IDF, and `links_crosslingual` cross-lingual
    links, its aligned translations first (score 1), the free slots filled with random cross-lingual documents of
    the shard (score 0). Uses the corpus's alignment labels: never MARGE, only the ceiling a retriever could
    reach with the loop's budget."""
    from dataclasses import replace

    partners_of = aligned_partners(docs)
    mono = shard_links(docs.doc_ids, docs.langs, None, replace(cfg, links_crosslingual=0),
                       lexical=lexical_vectors(docs.texts), lexical_weight=None)
    budget = int(round(cfg.links_crosslingual))
    chosen = []
    for i, partners in enumerate(partners_of):
        partners = partners[:budget]
        others = np.setdiff1d(np.flatnonzero(docs.langs != docs.langs[i]), partners)
        fill = min(budget - len(partners), len(others))
        chosen.append((i, partners, rng.choice(others, size=fill, replace=False).tolist() if fill > 0 else []))
    cross = scored_links(docs, chosen)
    return {k: np.concatenate([mono[k], cross[k]]) for k in ("target_id", "evidence_id", "score", "cross_lingual")}


def version_links(docs: ShardDocuments, unit: np.ndarray, cfg: IndexerConfig, snapshot_step: int, seed: int = 0,
                  search: str = "faiss", device: str | torch.device = "cpu") -> dict[str, np.ndarray]:
    """The links of one shard as the index version built from the snapshot of `snapshot_step` ranks them
    (`IndexerConfig.link_source`), given the shard's g unit vectors `unit`: what `index_shard` writes, and what a
    held-out measurement of "the evidence this index would link" reads."""
    source, lexical_weight = cfg.link_source(snapshot_step)
    if source == "aligned" and cfg.aligned_layout == "budget":
        return budget_aligned_links(docs, cfg, np.random.default_rng([seed, snapshot_step]))
    if source == "aligned":
        return aligned_links(docs, cfg.aligned_distractors, np.random.default_rng([seed, snapshot_step]))
    if source in ("tfidf", "hybrid"):
        return shard_links(docs.doc_ids, docs.langs, unit, cfg, search, device, lexical_vectors(docs.texts),
                           None if source == "tfidf" else lexical_weight)
    return shard_links(docs.doc_ids, docs.langs, unit, cfg, search, device)
