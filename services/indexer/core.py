"""Indexing one shard with one relevance-encoder snapshot (no Ray here; the actor in `actor.py` calls it).

For a shard (paper §2.4): embed every document with g (batched, no grad), put the unit vectors in a
FAISS inner-product index (inner product of unit vectors = cosine = f), find each document's nearest
neighbours within the shard in every language, and keep the strongest pairs across the whole shard:
the top `links_monolingual * n` same-language pairs and the top `links_crosslingual * n`
cross-language pairs ("we take on average 4 monolingual and 4 crosslingual links per target", §3).
Some documents end up with no link; they wait for the next index.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marge.batch import SpecialTokens, as_encoder_input, encoder_cost
from marge.corpus import ShardDocuments
from marge.index_store import flat_ip_index, write_graph
from marge.model import RelevanceEncoder, pad_rows
from services.indexer.config import IndexerConfig

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
    and `topk` on `device`, for a single process with no FAISS (a GPU machine that cannot install it): both
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


def shard_links(doc_ids: np.ndarray, langs: np.ndarray, unit: np.ndarray, cfg: IndexerConfig,
                search: str = "faiss", device: str | torch.device = "cpu") -> dict[str, np.ndarray]:
    """The kept directed links (target -> evidence) of one shard, strongest first within each kind.

    `search` picks the exact neighbour search (`nearest_neighbours`): 'faiss' (the pipeline) or 'torch'.
    """
    n = len(doc_ids)
    targets, evidence, scores = [], [], []
    all_rows = np.arange(n)
    for lang in np.unique(langs):
        members = np.nonzero(langs == lang)[0]
        k = min(len(members), cfg.candidates_per_language + 1)  # +1: a document finds itself
        if k == 0:
            continue
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


@dataclass
class ShardIndexResult:
    shard: int
    num_documents: int
    num_edges: int
    cross_lingual_edges: int
    targets_with_links: int
    embed_seconds: float
    link_seconds: float
    index_file: str | None
    """The shard's FAISS index (None when the shard was indexed without FAISS: `search='torch'`)."""
    graph_file: str
    mean_positive_cosine: float
    mean_random_cosine: float
    crosslingual_same_group: float
    """Share of cross-lingual links joining documents of the same group (translations of one page)."""
    monolingual_same_group: float

    def as_manifest_entry(self) -> dict:
        return dict(self.__dict__)


def index_shard(docs: ShardDocuments, encoder: RelevanceEncoder, specials: SpecialTokens, out_dir: Path,
                cfg: IndexerConfig, device: str = "cpu", seed: int = 0, search: str = "faiss") -> ShardIndexResult:
    """Embed, index and link one shard; writes graph-XXXXX.parquet into `out_dir`, and shard-XXXXX.faiss
    (what the retrieval service searches) when `search` is 'faiss'."""
    t0 = time.perf_counter()
    autocast = torch.bfloat16 if cfg.bf16 and torch.device(device).type == "cuda" else None
    unit = embed_documents(encoder, docs.tokens, specials, cfg.batch_tokens, device, autocast)
    t1 = time.perf_counter()
    links = shard_links(docs.doc_ids, docs.langs, unit, cfg, search, device)
    t2 = time.perf_counter()
    index_file, graph_file = None, f"graph-{docs.shard:05d}.parquet"
    if search == "faiss":
        import faiss

        index_file = f"shard-{docs.shard:05d}.faiss"
        faiss.write_index(flat_ip_index(unit, docs.doc_ids), str(Path(out_dir) / index_file))
    write_graph(Path(out_dir) / graph_file, links["target_id"], links["evidence_id"], links["score"],
                links["cross_lingual"])
    # health figures: cosine of kept links vs of random pairs (how spread out g is)
    pos = {int(d): i for i, d in enumerate(docs.doc_ids)}
    same = np.array([docs.groups[pos[int(t)]] == docs.groups[pos[int(e)]]
                     for t, e in zip(links["target_id"], links["evidence_id"])], dtype=bool)
    cross = links["cross_lingual"]
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, len(unit), size=(2, min(2048, len(unit) * 4)))
    random_cos = float(np.mean(np.sum(unit[a] * unit[b], axis=1)[a != b])) if len(unit) > 1 else 0.0
    return ShardIndexResult(
        shard=docs.shard, num_documents=len(docs), num_edges=len(links["target_id"]),
        cross_lingual_edges=int(links["cross_lingual"].sum()),
        targets_with_links=len(np.unique(links["target_id"])), embed_seconds=t1 - t0, link_seconds=t2 - t1,
        index_file=index_file, graph_file=graph_file,
        mean_positive_cosine=float(links["score"].mean()) if len(links["score"]) else 0.0,
        mean_random_cosine=random_cos,
        crosslingual_same_group=float(same[cross].mean()) if cross.any() else 0.0,
        monolingual_same_group=float(same[~cross].mean()) if (~cross).any() else 0.0)


def index_corpus(corpus, encoder: RelevanceEncoder, specials: SpecialTokens, root: Path, version: int,
                 snapshot_step: int, cfg: IndexerConfig, extra: dict | None = None, seed: int = 0, **kwargs):
    """Index every shard in this process and commit the version (the Ray indexer spreads the shards
    over workers instead). Returns the committed IndexVersion."""
    from marge.index_store import commit_version, staging_dir

    staging = staging_dir(root, version)
    staging.mkdir(parents=True, exist_ok=True)
    entries = [index_shard(corpus.read_shard(s), encoder, specials, staging, cfg, seed=seed + s, **kwargs)
               .as_manifest_entry() for s in range(corpus.num_shards)]
    return commit_version(root, version, snapshot_step, entries, keep_versions=cfg.keep_versions, extra=extra)


def index_build_record(committed, entries: list[dict], started_unix: float) -> dict:
    """The figures of one committed index version (what the coordinator logs, exports and reports)."""
    m = committed.manifest
    seconds = time.time() - started_unix
    embedded = sum(e["num_documents"] for e in entries if "carried_from_version" not in e)  # not carried over

    def mean(key: str) -> float:  # weighted by shard size
        total = sum(e["num_documents"] for e in entries)
        return sum(e[key] * e["num_documents"] for e in entries) / max(1, total)

    return {"version": committed.version, "snapshot_step": committed.snapshot_step, "seconds": round(seconds, 2),
            "started_unix": started_unix, "finished_unix": time.time(),
            "num_documents": m["num_documents"], "num_edges": m["num_edges"],
            "crosslingual_share": m["cross_lingual_edges"] / max(1, m["num_edges"]),
            "documents_embedded": embedded, "docs_per_s": embedded / max(seconds, 1e-9),
            "embed_seconds": round(sum(e["embed_seconds"] for e in entries), 3),
            "link_seconds": round(sum(e["link_seconds"] for e in entries), 3),
            "linked_cosine": mean("mean_positive_cosine"), "random_cosine": mean("mean_random_cosine"),
            "crosslingual_link_precision": mean("crosslingual_same_group"),
            "monolingual_same_group": mean("monolingual_same_group")}


def shards_to_rebuild(version: int, num_shards: int, shards_per_refresh: int, has_previous: bool) -> list[int]:
    """The shards version `version` re-embeds: all of them for a full refresh (or when there is no previous
    version to carry from), else a rotating window of `shards_per_refresh` that depends on the version alone,
    so a version rebuilt after a resume takes the same shards."""
    if not shards_per_refresh or shards_per_refresh >= num_shards or not has_previous:
        return list(range(num_shards))
    return sorted({(version * shards_per_refresh + j) % num_shards for j in range(shards_per_refresh)})


def plan_refresh(root: Path, version: int, num_shards: int, shards_per_refresh: int):
    """(previous committed version or None, shards to re-embed, shards to carry over) for building `version`."""
    from marge.index_store import latest_version

    previous = latest_version(root)
    previous = previous if previous is not None and previous.version < version else None
    rebuild = shards_to_rebuild(version, num_shards, shards_per_refresh, previous is not None)
    return previous, rebuild, sorted(set(range(num_shards)) - set(rebuild))


def carry_shards(previous, shards: list[int], staging: Path) -> list[dict]:
    """Manifest entries of `shards` taken over from the committed version `previous` (an IndexVersion): their
    files hard-linked into `staging` (copied where links are not possible), the snapshot step they were built
    from kept, their build seconds zeroed (this version did not pay them)."""
    import os
    import shutil

    entries = []
    by_shard = {e["shard"]: e for e in previous.shards}
    for shard in shards:
        entry = {k: v for k, v in by_shard[shard].items() if not k.endswith("_sha256")}
        for key in ("graph_file", "index_file"):
            if entry.get(key):
                source, target = previous.path / entry[key], Path(staging) / entry[key]
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
        entry.setdefault("snapshot_step", previous.snapshot_step)
        entries.append({**entry, "carried_from_version": previous.version, "embed_seconds": 0.0, "link_seconds": 0.0})
    return entries
