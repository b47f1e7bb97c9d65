"""Building index versions: indexing one shard with one relevance-encoder snapshot (no Ray here; the actor in
`actor.py` calls it), a version's shards, its manifest and which shards a refresh rebuilds. The links a shard keeps
are `services.indexer.links`'s, their candidates `services.indexer.neighbours`'s (docs/pipeline.md, "Three kinds of
index").

For a shard (paper §2.4): embed every document with g (batched, no grad), put the unit vectors in a
FAISS inner-product index (inner product of unit vectors = cosine = f), find each document's nearest
neighbours within the shard in every language, and keep the strongest pairs across the whole shard:
the top `links_monolingual * n` same-language pairs and the top `links_crosslingual * n`
cross-language pairs ("we take on average 4 monolingual and 4 crosslingual links per target", §3).
Some documents end up with no link; they wait for the next index.

What ranks the candidates is the version's link source (`IndexerConfig.link_source`): cos(g) (the paper), a
char 2-4-gram TF-IDF cosine within the shard (the lexical bootstrap's version 0, or a frozen lexical index),
cos(g) + lambda * tfidf (the hand-over from the bootstrap to g), or the corpus's alignment (a diagnostic
oracle). Every version reports how many of its cross-lingual links join the same page and how many join
aligned translations (`crosslingual_parallel_precision`), when the corpus knows its paragraphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marge.contracts.batch import SpecialTokens
from marge.contracts.corpus import ShardDocuments
from marge.contracts.index_store import flat_ip_index, write_graph
from marge.model.embedding import embed_documents
from marge.model.network import RelevanceEncoder
from marge.util.progress import track
from services.indexer.config import IndexerConfig
from services.indexer.links import version_links

log = logging.getLogger(__name__)


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
    """Mean cos(g) of the kept links (whatever ranked them)."""
    mean_random_cosine: float
    crosslingual_same_group: float
    """Share of cross-lingual links joining documents of the same group (translations of one page)."""
    monolingual_same_group: float
    crosslingual_parallel_precision: float | None = None
    """Share of cross-lingual links joining aligned translations (the same paragraph of the same page), or None
    when the corpus has no paragraph ids."""
    link_source: str = "g"
    """What ranked this shard's links: 'g', 'tfidf', 'hybrid' (cos(g) + lexical_weight * tfidf) or 'aligned'."""
    lexical_weight: float = 0.0

    def as_manifest_entry(self) -> dict:
        return dict(self.__dict__)


def index_shard(docs: ShardDocuments, encoder: RelevanceEncoder, specials: SpecialTokens, out_dir: Path,
                cfg: IndexerConfig, device: str = "cpu", seed: int = 0, search: str = "faiss",
                snapshot_step: int = 0) -> ShardIndexResult:
    """Embed, index and link one shard; writes graph-XXXXX.parquet into `out_dir`, and shard-XXXXX.faiss
    (what the retrieval service searches) when `search` is 'faiss'. `snapshot_step` (the version's) decides the
    link source (`IndexerConfig.link_source`)."""
    t0 = time.perf_counter()
    autocast = torch.bfloat16 if cfg.bf16 and torch.device(device).type == "cuda" else None
    unit = embed_documents(encoder, docs.tokens, specials, cfg.batch_tokens, device, autocast)
    t1 = time.perf_counter()
    source, lexical_weight = cfg.link_source(snapshot_step)
    links = version_links(docs, unit, cfg, snapshot_step, seed, search, device)
    t2 = time.perf_counter()
    index_file, graph_file = None, f"graph-{docs.shard:05d}.parquet"
    if search == "faiss":
        import faiss

        index_file = f"shard-{docs.shard:05d}.faiss"
        faiss.write_index(flat_ip_index(unit, docs.doc_ids), str(Path(out_dir) / index_file))
    write_graph(Path(out_dir) / graph_file, links["target_id"], links["evidence_id"], links["score"],
                links["cross_lingual"])
    # health figures: cosine of kept links vs random pairs (how spread out g is), links within a page, links
    # between aligned translations
    pos = {int(d): i for i, d in enumerate(docs.doc_ids)}
    rows_t = np.array([pos[int(t)] for t in links["target_id"]], dtype=np.int64)
    rows_e = np.array([pos[int(e)] for e in links["evidence_id"]], dtype=np.int64)
    same = docs.groups[rows_t] == docs.groups[rows_e] if len(rows_t) else np.zeros(0, dtype=bool)
    parallel = np.array([docs.translations(i, j) for i, j in zip(rows_t.tolist(), rows_e.tolist())], dtype=bool)
    linked_cos = np.sum(unit[rows_t] * unit[rows_e], axis=1) if len(rows_t) else np.zeros(0)
    cross = links["cross_lingual"]
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, len(unit), size=(2, min(2048, len(unit) * 4)))
    random_cos = float(np.mean(np.sum(unit[a] * unit[b], axis=1)[a != b])) if len(unit) > 1 else 0.0
    return ShardIndexResult(
        shard=docs.shard, num_documents=len(docs), num_edges=len(links["target_id"]),
        cross_lingual_edges=int(links["cross_lingual"].sum()),
        targets_with_links=len(np.unique(links["target_id"])), embed_seconds=t1 - t0, link_seconds=t2 - t1,
        index_file=index_file, graph_file=graph_file,
        mean_positive_cosine=float(linked_cos.mean()) if len(linked_cos) else 0.0,
        mean_random_cosine=random_cos,
        crosslingual_same_group=float(same[cross].mean()) if cross.any() else 0.0,
        monolingual_same_group=float(same[~cross].mean()) if (~cross).any() else 0.0,
        crosslingual_parallel_precision=(float(parallel[cross].mean()) if cross.any() else 0.0) if docs.aligned else None,
        link_source=source, lexical_weight=float(lexical_weight))


def index_corpus(corpus, encoder: RelevanceEncoder, specials: SpecialTokens, root: Path, version: int,
                 snapshot_step: int, cfg: IndexerConfig, extra: dict | None = None, seed: int = 0, **kwargs):
    """Index every shard in this process and commit the version (the Ray indexer spreads the shards
    over workers instead). Returns the committed IndexVersion."""
    from marge.contracts.index_store import commit_version, staging_dir

    staging = staging_dir(root, version)
    staging.mkdir(parents=True, exist_ok=True)
    entries = [index_shard(corpus.read_shard(s), encoder, specials, staging, cfg, seed=seed + s,
                           snapshot_step=snapshot_step, **kwargs)
               .as_manifest_entry() for s in track(range(corpus.num_shards), f"indexing v{version}", unit="shard")]
    return commit_version(root, version, snapshot_step, entries, keep_versions=cfg.keep_versions, extra=extra)


def index_build_record(committed, entries: list[dict], started_unix: float) -> dict:
    """The figures of one committed index version (what the coordinator logs, exports and reports)."""
    m = committed.manifest
    seconds = time.time() - started_unix
    embedded = sum(e["num_documents"] for e in entries if "carried_from_version" not in e)  # not carried over

    def mean(key: str) -> float | None:  # weighted by shard size, over the shards that have the figure
        have = [e for e in entries if e.get(key) is not None]
        if not have:
            return None
        return sum(e[key] * e["num_documents"] for e in have) / max(1, sum(e["num_documents"] for e in have))

    return {"version": committed.version, "snapshot_step": committed.snapshot_step, "seconds": round(seconds, 2),
            "started_unix": started_unix, "finished_unix": time.time(),
            "num_documents": m["num_documents"], "num_edges": m["num_edges"],
            "crosslingual_share": m["cross_lingual_edges"] / max(1, m["num_edges"]),
            "documents_embedded": embedded, "docs_per_s": embedded / max(seconds, 1e-9),
            "embed_seconds": round(sum(e["embed_seconds"] for e in entries), 3),
            "link_seconds": round(sum(e["link_seconds"] for e in entries), 3),
            "linked_cosine": mean("mean_positive_cosine"), "random_cosine": mean("mean_random_cosine"),
            "crosslingual_link_precision": mean("crosslingual_same_group"),
            "crosslingual_parallel_precision": mean("crosslingual_parallel_precision"),
            "monolingual_same_group": mean("monolingual_same_group"),
            "link_sources": sorted({e.get("link_source", "g") for e in entries}),
            "lexical_weight": max((e.get("lexical_weight", 0.0) for e in entries), default=0.0)}


def prune_unneeded_snapshots(paths, plan, checkpoints: Path, keep_last: int) -> list[int]:
    """Delete the snapshots no one will read again (`indexer.keep_snapshots`): kept are step 0 (the initial g the
    run's verdict compares with), those of the index versions on disk (the service encodes queries with a version's
    own snapshot), every one from the snapshot of the index version the oldest kept checkpoint resumes with on (a
    resume rebuilds the versions it needs from them), and the newest `keep_last`. Returns the steps deleted."""
    from marge.contracts.index_store import VERSIONS, read_version
    from marge.model.checkpoint import checkpoint_order, complete_checkpoints
    from marge.model.snapshot import SNAPSHOTS, prune_snapshots

    kept_checkpoints = complete_checkpoints(checkpoints)
    resume_from = checkpoint_order(kept_checkpoints[0])[0] if kept_checkpoints else 0
    needed_from = plan.snapshot_step(plan.version_for_step(resume_from))
    keep = {0} | {read_version(p).snapshot_step for p in VERSIONS.versions(paths.index)}
    keep |= {SNAPSHOTS.order(p.name) for p in SNAPSHOTS.versions(paths.snapshots)
             if SNAPSHOTS.order(p.name) >= needed_from}
    return prune_snapshots(paths.snapshots, keep, keep_last)


def build_version(root: Path, run_dir: Path, version: int, snapshot_step: int, num_shards: int, cfg: IndexerConfig,
                  index_shards, workers: int = 1, extra: dict | None = None, seed: int = 0):
    """Build index version `version` from the snapshot of `snapshot_step`, the one way both hosts do it: the shards
    this refresh embeds (every shard, the version's sample, or a rotating window: `plan_refresh`) indexed by
    `index_shards(shards,
    staging)` (in this process, or spread over Ray workers), the others carried over from the previous version, the
    version committed (checksums, manifest last, LATEST moved) and its figures appended to the run's
    index_builds.jsonl. Returns (the committed IndexVersion, its build record)."""
    from marge.contracts.index_store import commit_version, staging_dir
    from marge.eval.refresh import append_build

    started = time.time()
    staging = staging_dir(root, version)
    staging.mkdir(parents=True, exist_ok=True)
    previous, shards, carried = plan_refresh(root, version, num_shards, cfg, seed)
    entries = [{**entry, "snapshot_step": snapshot_step} for entry in index_shards(shards, staging)]
    if carried:
        entries += carry_shards(previous, carried, staging)
    cost = {"indexer_workers": workers, "build_seconds": round(time.time() - started, 3),
            "embed_seconds": round(sum(e["embed_seconds"] for e in entries), 3),
            "link_seconds": round(sum(e["link_seconds"] for e in entries), 3),
            "shards_rebuilt": len(shards), "shards_carried": len(carried)}
    committed = commit_version(root, version, snapshot_step, entries, extra={**cost, **(extra or {})},
                               keep_versions=cfg.keep_versions)
    record = {**index_build_record(committed, entries, started), "indexer_workers": workers,
              "shards_rebuilt": len(shards), "shards_carried": len(carried)}
    append_build(run_dir, record)
    return committed, record


def describe_build(record: dict) -> str:
    """One line of a committed version's figures, for the logs of either host."""
    parallel = record.get("crosslingual_parallel_precision")
    return (f"{record['num_documents']} docs, {record['num_edges']} links by {'+'.join(record.get('link_sources', ['g']))}"
            + (f" (lambda {record['lexical_weight']:.2f})" if record.get("lexical_weight") else "")
            + f" ({100 * record['crosslingual_share']:.0f}% cross-lingual; of those {100 * record['crosslingual_link_precision']:.0f}% "
            + "join the same page" + (f", {100 * parallel:.0f}% aligned translations" if parallel is not None else "")
            + f") in {record['seconds']:.1f} s")


SHARD_SAMPLE_STREAM = 7
"""Keeps a version's shard sample independent of every other seeded draw of the run."""


def sampled_shards(version: int, num_shards: int, shards_per_version: int, seed: int,
                   sampling: str = "independent") -> list[int]:
    """The shards version `version` holds under `indexer.shards_per_version`: a sample drawn from the run's seed and
    the version alone, so a version rebuilt after a resume, or by the other host, holds the same shards.
    `sampling` (`indexer.shard_sampling`): 'independent' draws each version on its own; 'cycle' takes the
    version's block of k from a seeded permutation of the shards, a new permutation every N // k versions."""
    if not shards_per_version or shards_per_version >= num_shards:
        return list(range(num_shards))
    if sampling == "cycle":
        per_cycle = num_shards // shards_per_version
        cycle, block = divmod(version, per_cycle)
        order = np.random.default_rng([seed, cycle, SHARD_SAMPLE_STREAM, 1]).permutation(num_shards)
        return sorted(int(s) for s in order[block * shards_per_version:(block + 1) * shards_per_version])
    rng = np.random.default_rng([seed, version, SHARD_SAMPLE_STREAM])
    return sorted(int(s) for s in rng.choice(num_shards, size=shards_per_version, replace=False))


def shard_coverage(num_shards: int, shards_per_version: int, versions: int, sampling: str = "independent") -> float:
    """The share of the shards that at least one of `versions` versions holds: expected over the draws for
    'independent'; for 'cycle' exact within the first cycle (a block of k shards a version, N // k blocks a
    cycle), after it a lower bound (each cycle leaves out the N mod k shards past its last block, others each time)."""
    if not shards_per_version or shards_per_version >= num_shards:
        return 1.0 if versions > 0 else 0.0
    if sampling == "cycle":
        per_cycle = num_shards // shards_per_version
        full_cycles = versions // per_cycle
        if full_cycles == 0:
            return versions * shards_per_version / num_shards
        return 1.0 - ((num_shards - per_cycle * shards_per_version) / num_shards) ** full_cycles
    return 1.0 - (1.0 - shards_per_version / num_shards) ** versions


def shards_to_rebuild(version: int, num_shards: int, shards_per_refresh: int, has_previous: bool) -> list[int]:
    """The shards version `version` re-embeds: all of them for a full refresh (or when there is no previous
    version to carry from), else a rotating window of `shards_per_refresh` that depends on the version alone,
    so a version rebuilt after a resume takes the same shards."""
    if not shards_per_refresh or shards_per_refresh >= num_shards or not has_previous:
        return list(range(num_shards))
    return sorted({(version * shards_per_refresh + j) % num_shards for j in range(shards_per_refresh)})


def plan_refresh(root: Path, version: int, num_shards: int, cfg: IndexerConfig, seed: int = 0):
    """(previous committed version or None, shards to embed, shards to carry over) for building `version`: a
    sampled version (`shards_per_version`) embeds its sample and carries nothing."""
    from marge.contracts.index_store import latest_version

    if cfg.shards_per_version:
        return None, sampled_shards(version, num_shards, cfg.shards_per_version, seed, cfg.shard_sampling), []
    shards_per_refresh = cfg.shards_per_refresh
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
