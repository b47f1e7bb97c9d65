"""From a committed index version to a stream of `Batch` objects (no Ray here; `actor.py` wraps it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from marge.batch import Batch
from marge.corpus import Corpus
from marge.index_store import IndexVersion
from marge.protocol import BatchId
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.greedy import BatchPlan, plan_document_batches, plan_shard_batches

log = logging.getLogger(__name__)


class DocumentStore:
    """Tokens and language of every document of a corpus, by doc id (what batches are made of)."""

    def __init__(self, corpus: Corpus, shards: list[int] | None = None):
        self.tokens: dict[int, np.ndarray] = {}
        self.langs: dict[int, str] = {}
        self.shard_docs: dict[int, np.ndarray] = {}
        """Doc ids of each shard (what a batch without an index is drawn from)."""
        for s in shards if shards is not None else range(corpus.num_shards):
            docs = corpus.read_shard(s)
            self.shard_docs[s] = docs.doc_ids
            for doc_id, lang, tokens in zip(docs.doc_ids.tolist(), docs.langs, docs.tokens):
                self.tokens[doc_id] = tokens
                self.langs[doc_id] = lang

    def lengths(self) -> dict[int, int]:
        return {d: len(t) for d, t in self.tokens.items()}


def materialize(plan: BatchPlan, docs: DocumentStore, batch_id: BatchId, index_version: int, snapshot_step: int) -> Batch:
    doc_ids = list(dict.fromkeys(plan.targets + plan.evidence))  # unique, first-seen order
    pos = {d: i for i, d in enumerate(doc_ids)}
    edges = np.array([(t, e) for t, e, _ in plan.edges], dtype=np.int32).reshape(-1, 2)
    return Batch(batch_id=str(batch_id), index_version=index_version, snapshot_step=snapshot_step,
                 doc_ids=np.array(doc_ids, dtype=np.int64), doc_langs=tuple(docs.langs[d] for d in doc_ids),
                 doc_tokens=tuple(docs.tokens[d] for d in doc_ids),
                 targets=np.array([pos[t] for t in plan.targets], dtype=np.int32),
                 evidence=np.array([pos[e] for e in plan.evidence], dtype=np.int32),
                 edges=edges, edge_weights=np.array([w for _, _, w in plan.edges], dtype=np.float32))


def epoch_batches(version: IndexVersion, docs: DocumentStore, cfg: BatcherConfig, epoch: int, seed: int = 0,
                  shards: list[int] | None = None, stats: dict | None = None,
                  shape: BatchShape = BatchShape()) -> Iterator[Batch]:
    """One pass over the graph of `version`: shards in a seeded order, greedy batches within each.

    Batch ids are deterministic (`BatchId`), so the same seed, version and epoch always give the same
    batches, and the ledger can recognise a batch seen before.
    """
    lengths = docs.lengths()
    entries = [s for s in version.shards if shards is None or s["shard"] in shards]
    order = np.random.default_rng([seed, version.version, epoch]).permutation(len(entries))
    for j in order:
        shard = int(entries[j]["shard"])
        graph = version.read_graph(shard)
        if graph.num_rows == 0:
            continue
        rng = np.random.default_rng([seed, version.version, epoch, shard])
        plans, counters = plan_shard_batches(
            graph.column("target_id").to_numpy(), graph.column("evidence_id").to_numpy(),
            graph.column("cross_lingual").to_numpy(zero_copy_only=False), graph.column("score").to_numpy(),
            lengths, cfg.max_tokens, cfg.crosslingual_weight, cfg.monolingual_weight, rng, cfg.seed_lookahead,
            shape.target_cost)
        if stats is not None:
            stats["oversized_seeds"] = stats.get("oversized_seeds", 0) + counters["oversized_seeds"]
        for n, plan in enumerate(plans):
            yield materialize(plan, docs, BatchId(version.version, epoch, shard, n), version.version,
                              version.snapshot_step)


NO_INDEX = -1
"""index_version and snapshot_step of batches built without an index (their id says version 0)."""


def corpus_epoch_batches(docs: DocumentStore, cfg: BatcherConfig, shape: BatchShape, epoch: int, seed: int = 0,
                         stats: dict | None = None) -> Iterator[Batch]:
    """One pass over the corpus without an index ('documents' batches): shards in a seeded order, each shard's
    documents packed in a seeded order under the token budget. Ids are deterministic, as `epoch_batches`'."""
    lengths = docs.lengths()
    shard_numbers = sorted(docs.shard_docs)
    for j in np.random.default_rng([seed, 0, epoch]).permutation(len(shard_numbers)):
        shard = shard_numbers[j]
        plans, counters = plan_document_batches(docs.shard_docs[shard], lengths, cfg.max_tokens,
                                                np.random.default_rng([seed, 0, epoch, shard]), shape.document_cost)
        if stats is not None:
            stats["oversized_seeds"] = stats.get("oversized_seeds", 0) + counters["oversized_seeds"]
        for n, plan in enumerate(plans):
            yield materialize(plan, docs, BatchId(0, epoch, shard, n), NO_INDEX, NO_INDEX)
