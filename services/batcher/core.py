"""From a committed index version to a stream of `Batch` objects (no Ray here; `actor.py` wraps it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from marge.batch import Batch
from marge.corpus import Corpus, ShardDocuments
from marge.index_store import IndexVersion
from marge.protocol import BatchId
from marge.utils import BudgetCache
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.greedy import BatchPlan, plan_document_batches, plan_shard_batches

log = logging.getLogger(__name__)


PER_DOCUMENT_BYTES = 200
"""Memory of one cached document besides its tokens (doc id, offset, position entry, language string): about
150 bytes measured with tracemalloc on the demo shards; `tests/test_batcher.py` keeps the estimate above it."""


@dataclass
class ShardTokens:
    """One corpus shard as batches need it: each document's tokens, language and length by doc id."""

    shard: int
    doc_ids: np.ndarray  # int64, corpus order
    langs: np.ndarray  # object (str)
    flat: np.ndarray  # int32: every document's tokens, one after the other
    offsets: np.ndarray  # document i is flat[offsets[i]:offsets[i + 1]]
    position: dict[int, int]

    @classmethod
    def from_documents(cls, docs: ShardDocuments) -> "ShardTokens":
        lengths = np.array([len(t) for t in docs.tokens], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat = np.concatenate(docs.tokens).astype(np.int32, copy=False) if len(docs.tokens) else np.zeros(0, np.int32)
        return cls(docs.shard, docs.doc_ids, docs.langs, flat, offsets,
                   {d: i for i, d in enumerate(docs.doc_ids.tolist())})

    def tokens(self, doc_id: int) -> np.ndarray:
        i = self.position[doc_id]
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def lang(self, doc_id: int) -> str:
        return self.langs[self.position[doc_id]]

    def lengths(self) -> dict[int, int]:
        return dict(zip(self.doc_ids.tolist(), np.diff(self.offsets).tolist()))

    @property
    def nbytes(self) -> int:
        """Estimated memory held (what the store's budget counts)."""
        return self.flat.nbytes + self.offsets.nbytes + self.doc_ids.nbytes + PER_DOCUMENT_BYTES * len(self.doc_ids)


class DocumentStore:
    """The corpus's documents for the batcher, read one shard at a time.

    The indexer links documents within their shard, so a shard's batches need only that shard: the store reads
    a shard when its batches are built and keeps the most recently used shards while they fit in
    `cache_mb` (the shard in use always stays). Memory is bounded by the largest shard and the budget, not by
    the corpus; a corpus that fits the budget is read once, as if it were held whole. Each shard file's sha256
    is checked on its first read only.
    """

    def __init__(self, corpus: Corpus, cache_mb: float = 512.0):
        self.corpus = corpus
        self._cache = BudgetCache(int(cache_mb * 2**20), self._read, lambda tokens: tokens.nbytes)
        """Shared with the plan-ahead thread, which reads the next shard while batches of this one are built."""
        self._checked: set[int] = set()

    @property
    def shard_numbers(self) -> list[int]:
        return [info.shard for info in self.corpus.shards]

    @property
    def reads(self) -> int:
        """Shard files read so far (a corpus that fits the budget: each once)."""
        return self._cache.reads

    def shard(self, shard: int) -> ShardTokens:
        return self._cache.get(shard)

    def _read(self, shard: int) -> ShardTokens:
        docs = self.corpus.read_shard(shard, verify_checksum=False if shard in self._checked else None)
        self._checked.add(shard)
        tokens = ShardTokens.from_documents(docs)
        del docs
        # the Parquet read's buffers are free now; Arrow's allocator would keep their pages for the next
        # read, which can be a few hundred MB on a large shard: give them back so memory follows the budget
        pa.default_memory_pool().release_unused()
        return tokens

    @property
    def cached_bytes(self) -> int:
        return self._cache.cached_bytes


def materialize(plan: BatchPlan, docs: ShardTokens, batch_id: BatchId, index_version: int, snapshot_step: int) -> Batch:
    doc_ids = list(dict.fromkeys(plan.targets + plan.evidence))  # unique, first-seen order
    pos = {d: i for i, d in enumerate(doc_ids)}
    edges = np.array([(t, e) for t, e, _ in plan.edges], dtype=np.int32).reshape(-1, 2)
    batch = Batch(batch_id=str(batch_id), index_version=index_version, snapshot_step=snapshot_step,
                 doc_ids=np.array(doc_ids, dtype=np.int64), doc_langs=tuple(docs.lang(d) for d in doc_ids),
                 doc_tokens=tuple(docs.tokens(d) for d in doc_ids),
                 targets=np.array([pos[t] for t in plan.targets], dtype=np.int32),
                 evidence=np.array([pos[e] for e in plan.evidence], dtype=np.int32),
                 edges=edges, edge_weights=np.array([w for _, _, w in plan.edges], dtype=np.float32))
    return dataclasses.replace(batch, batch_id=str(dataclasses.replace(batch_id, content=batch.content_digest())))


def epoch_batches(version: IndexVersion, docs: DocumentStore, cfg: BatcherConfig, epoch: int, seed: int = 0,
                  shards: list[int] | None = None, stats: dict | None = None,
                  shape: BatchShape = BatchShape()) -> Iterator[Batch]:
    """One pass over the graph of `version`: shards in a seeded order, greedy batches within each.

    Batch ids are deterministic (`BatchId`), so the same seed, version and epoch always give the same
    batches, and the ledger can recognise a batch seen before.
    """
    entries = [s for s in version.shards if shards is None or s["shard"] in shards]
    order = [int(entries[j]["shard"]) for j in np.random.default_rng([seed, version.version, epoch]).permutation(len(entries))]

    def plan(k: int):
        return plan_shard(version, docs, cfg, epoch, seed, order[k], shape, stats)

    # with plan_ahead, shard k+1 is planned in a thread while shard k's batches are materialised and written
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-ahead") if cfg.plan_ahead else None
    try:
        upcoming = ahead.submit(plan, 0) if ahead and order else None
        for k, shard in enumerate(order):
            planned = upcoming.result() if upcoming else plan(k)
            upcoming = ahead.submit(plan, k + 1) if ahead and k + 1 < len(order) else None
            if planned is None:
                continue
            plans, shard_docs = planned
            for n, batch_plan in enumerate(plans):
                yield materialize(batch_plan, shard_docs, BatchId(version.version, epoch, shard, n), version.version,
                                  version.snapshot_step)
            del planned, plans, shard_docs  # this shard's plans and documents go before the one after the next
    finally:
        if ahead:
            ahead.shutdown(wait=False, cancel_futures=True)


def plan_shard(version: IndexVersion, docs: DocumentStore, cfg: BatcherConfig, epoch: int, seed: int, shard: int,
               shape: BatchShape, stats: dict | None) -> tuple[list[BatchPlan], ShardTokens] | None:
    """The greedy batches of one shard's links in pass `epoch`, with the shard's documents; None without links."""
    graph = version.read_graph(shard)
    if graph.num_rows == 0:
        return None
    shard_docs = docs.shard(shard)
    target_ids, evidence_ids = graph.column("target_id").to_numpy(), graph.column("evidence_id").to_numpy()
    named = np.concatenate([target_ids, evidence_ids])
    outside = ~np.isin(named, shard_docs.doc_ids)
    if outside.any():
        raise ValueError(f"index v{version.version} ({version.path}): shard {shard}'s links name doc id "
                         f"{int(named[outside][0])}, which corpus shard {shard} does not hold: the index was built "
                         f"from another corpus ({docs.corpus.root})")
    plans, counters = plan_shard_batches(
        target_ids, evidence_ids, graph.column("cross_lingual").to_numpy(zero_copy_only=False),
        graph.column("score").to_numpy(), shard_docs.lengths(), cfg.max_tokens, cfg.crosslingual_weight,
        cfg.monolingual_weight, np.random.default_rng([seed, version.version, epoch, shard]), cfg.seed_lookahead,
        shape.target_cost)
    if stats is not None:
        stats["oversized_seeds"] = stats.get("oversized_seeds", 0) + counters["oversized_seeds"]
    return plans, shard_docs


NO_INDEX = -1
"""index_version and snapshot_step of batches built without an index (their id says version 0)."""


def corpus_epoch_batches(docs: DocumentStore, cfg: BatcherConfig, shape: BatchShape, epoch: int, seed: int = 0,
                         stats: dict | None = None) -> Iterator[Batch]:
    """One pass over the corpus without an index ('documents' batches): shards in a seeded order, each shard's
    documents packed in a seeded order under the token budget. Ids are deterministic, as `epoch_batches`'."""
    shard_numbers = sorted(docs.shard_numbers)
    for j in np.random.default_rng([seed, 0, epoch]).permutation(len(shard_numbers)):
        shard = shard_numbers[j]
        shard_docs = docs.shard(shard)
        plans, counters = plan_document_batches(shard_docs.doc_ids, shard_docs.lengths(), cfg.max_tokens,
                                                np.random.default_rng([seed, 0, epoch, shard]), shape.document_cost)
        if stats is not None:
            stats["oversized_seeds"] = stats.get("oversized_seeds", 0) + counters["oversized_seeds"]
        for n, plan in enumerate(plans):
            yield materialize(plan, shard_docs, BatchId(0, epoch, shard, n), NO_INDEX, NO_INDEX)
