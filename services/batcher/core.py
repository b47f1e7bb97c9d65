"""From a committed index version to a stream of `Batch` objects (no Ray here; `actor.py` wraps it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from marge.contracts.batch import Batch
from marge.contracts.corpus import Corpus, ShardDocuments
from marge.contracts.index_store import IndexVersion
from marge.contracts.slots import BatchId
from marge.util.files import BudgetCache
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.greedy import BatchPlan, add_negatives, plan_document_batches, plan_shard_batches

log = logging.getLogger(__name__)


PER_DOCUMENT_BYTES = 200
"""Memory of one cached document besides its tokens (doc id, offset, position entry, language string): about
150 bytes measured with tracemalloc on the demo shards; `tests/integration/test_batcher.py` keeps the estimate above it."""


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
    # unique, first-seen order; the plan's unlinked negatives last (never one of its own: `add_negatives`)
    doc_ids = list(dict.fromkeys(plan.targets + plan.evidence)) + plan.negatives
    pos = {d: i for i, d in enumerate(doc_ids)}
    edges = np.array([(t, e) for t, e, _ in plan.edges], dtype=np.int32).reshape(-1, 2)
    batch = Batch(batch_id=str(batch_id), index_version=index_version, snapshot_step=snapshot_step,
                 doc_ids=np.array(doc_ids, dtype=np.int64), doc_langs=tuple(docs.lang(d) for d in doc_ids),
                 doc_tokens=tuple(docs.tokens(d) for d in doc_ids),
                 targets=np.array([pos[t] for t in plan.targets], dtype=np.int32),
                 evidence=np.array([pos[e] for e in plan.evidence], dtype=np.int32),
                 edges=edges, edge_weights=np.array([w for _, _, w in plan.edges], dtype=np.float32))
    return dataclasses.replace(batch, batch_id=str(dataclasses.replace(batch_id, content=batch.content_digest())))


class Skip:
    """Batches of a sequence still to be passed over before the first one is yielded (a builder resuming inside
    an index version's sequence): whole shards are passed over by their batch count, without building a batch."""

    def __init__(self, remaining: int = 0):
        self.remaining = remaining


class BatchCounts:
    """How many batches each shard gives in each pass of one index version's sequence for one builder, kept on the
    run's storage (one JSON line per pass and shard, appended as shards are planned), so a builder that resumes
    deep inside a version passes over whole shards by their count instead of planning them again.

    The file's name carries a digest of everything the counts depend on (the version's graph files, the seed, the
    builder's group, the batcher's settings and the batch shape), so a rebuilt version or another setting never
    reads another's counts. A line that does not parse (a torn append) is ignored; every writer writes the same
    numbers, so a line written twice does no harm."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._known: dict[tuple[int, int], int] | None = None

    @classmethod
    def for_version(cls, root: Path, version: IndexVersion, cfg: BatcherConfig, shape: BatchShape, seed: int,
                    group: int, builders: int) -> "BatchCounts | None":
        graphs = [(int(s["shard"]), s.get("graph_file_sha256")) for s in version.shards]
        if any(digest is None for _, digest in graphs):
            return None  # a version without graph checksums cannot be told from a rebuilt one
        settings = {"graphs": graphs, "seed": seed, "group": group, "builders": builders,
                    "batcher": [cfg.max_tokens, cfg.crosslingual_weight, cfg.monolingual_weight, cfg.seed_lookahead],
                    # the negatives change no count: left out, so that adding the field kept every run's counts
                    "shape": {k: v for k, v in dataclasses.asdict(shape).items() if k != "negatives"}}
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        return cls(Path(root) / f"v{version.version:06d}-g{group}-{digest}.jsonl")

    def _load(self) -> dict[tuple[int, int], int]:
        if self._known is None:
            self._known = {}
            if self.path.exists():
                for line in self.path.read_text(errors="replace").splitlines():
                    try:
                        record = json.loads(line)
                        self._known.setdefault((int(record["epoch"]), int(record["shard"])), int(record["batches"]))
                    except (ValueError, KeyError, TypeError):
                        continue
        return self._known

    def get(self, epoch: int, shard: int) -> int | None:
        with self._lock:
            return self._load().get((epoch, shard))

    def record(self, epoch: int, shard: int, batches: int) -> None:
        with self._lock:
            known = self._load()
            if (epoch, shard) in known:
                return
            known[(epoch, shard)] = batches
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps({"epoch": epoch, "shard": shard, "batches": batches}) + "\n")
            except OSError as e:  # a cache: a builder that cannot write it plans again on its next resume
                log.warning("batch counts not recorded in %s: %s", self.path, e)


def group_order(order: list[int], group: int, builders: int) -> list[int]:
    """The shards builder `group` of `builders` takes from a pass's seeded shard order: every `builders`-th."""
    mine = order[group::builders]
    if not mine and order:
        raise ValueError(f"batch builder {group} of {builders} gets no shard of a pass over {len(order)} shards: "
                         "lower batcher.builders or raise indexer.shards_per_version")
    return mine


def epoch_batches(version: IndexVersion, docs: DocumentStore, cfg: BatcherConfig, epoch: int, seed: int = 0,
                  shards: list[int] | None = None, stats: dict | None = None,
                  shape: BatchShape = BatchShape(), group: int = 0, builders: int = 1, skip: Skip | None = None,
                  counts: BatchCounts | None = None) -> Iterator[Batch]:
    """One pass over the graph of `version`: shards in a seeded order (builder `group` of `builders` takes every
    `builders`-th of them), greedy batches within each.

    Batch ids are deterministic (`BatchId`), so the same seed, version and epoch always give the same
    batches, and the ledger can recognise a batch seen before. With `skip`, the pass's first `skip.remaining`
    batches are passed over (whole shards by their count in `counts` when known, else by planning them; no
    batch is built) and `skip` keeps what is left to pass over when the pass ends first.
    """
    entries = [s for s in version.shards if shards is None or s["shard"] in shards]
    order = [int(entries[j]["shard"]) for j in np.random.default_rng([seed, version.version, epoch]).permutation(len(entries))]
    order = group_order(order, group, builders)

    def plan(k: int):
        planned = plan_shard(version, docs, cfg, epoch, seed, order[k], shape, stats)
        if counts is not None:
            counts.record(epoch, order[k], 0 if planned is None else len(planned[0]))
        return planned

    yield from batches_from_shards(order, plan, lambda k: counts.get(epoch, order[k]) if counts else None, skip,
                                   cfg.plan_ahead, BatchId(version.version, epoch, 0, 0), version.version,
                                   version.snapshot_step)


def batches_from_shards(order: list[int], plan, known_count, skip: Skip | None, plan_ahead: bool, pass_id: BatchId,
                        index_version: int, snapshot_step: int) -> Iterator[Batch]:
    """The batches of shards `order` of one pass (`pass_id`: its version and epoch), each shard's from `plan(k)`
    (its plans and documents, or None), after passing over `skip.remaining` of them (`known_count(k)`: shard k's
    batch count, or None when only planning tells). With `plan_ahead`, shard k+1 is planned in a thread while
    shard k's batches are materialised and written."""
    start, offset, first = 0, 0, None
    if skip is not None and skip.remaining:
        for k in range(len(order)):
            count, planned = known_count(k), None
            if count is None:
                planned = plan(k)
                count = 0 if planned is None else len(planned[0])
            if count <= skip.remaining:
                skip.remaining -= count
                continue
            start, offset, first = k, skip.remaining, planned
            skip.remaining = 0
            break
        else:
            return  # the whole pass is passed over
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-ahead") if plan_ahead else None
    try:
        upcoming = None
        for k in range(start, len(order)):
            if k == start:
                planned = first if first is not None else plan(k)
            else:
                planned = upcoming.result() if upcoming else plan(k)
            upcoming = ahead.submit(plan, k + 1) if ahead and k + 1 < len(order) else None
            if planned is None:
                continue
            plans, shard_docs = planned
            for n in range(offset if k == start else 0, len(plans)):
                yield materialize(plans[n], shard_docs, dataclasses.replace(pass_id, shard=order[k], number=n),
                                  index_version, snapshot_step)
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
    add_negatives(plans, shard_docs.doc_ids, shape.negatives,
                  np.random.default_rng([seed, version.version, epoch, shard, NEGATIVES_STREAM]))
    return plans, shard_docs


NEGATIVES_STREAM = 1
"""The negatives' stream of a shard's seed key (the plan's own draws take the key itself)."""


NO_INDEX = -1
"""index_version and snapshot_step of batches built without an index (their id says version 0)."""


def corpus_epoch_batches(docs: DocumentStore, cfg: BatcherConfig, shape: BatchShape, epoch: int, seed: int = 0,
                         stats: dict | None = None, group: int = 0, builders: int = 1,
                         skip: Skip | None = None) -> Iterator[Batch]:
    """One pass over the corpus without an index ('documents' batches): shards in a seeded order (builder `group`
    of `builders` takes every `builders`-th), each shard's documents packed in a seeded order under the token
    budget. Ids are deterministic, and `skip` passes over batches, as `epoch_batches`'."""
    shard_numbers = sorted(docs.shard_numbers)
    order = group_order([shard_numbers[j] for j in np.random.default_rng([seed, 0, epoch]).permutation(len(shard_numbers))],
                        group, builders)

    def plan(k: int):
        shard_docs = docs.shard(order[k])
        plans, counters = plan_document_batches(shard_docs.doc_ids, shard_docs.lengths(), cfg.max_tokens,
                                                np.random.default_rng([seed, 0, epoch, order[k]]), shape.document_cost)
        if stats is not None:
            stats["oversized_seeds"] = stats.get("oversized_seeds", 0) + counters["oversized_seeds"]
        return plans, shard_docs

    yield from batches_from_shards(order, plan, lambda k: None, skip, False, BatchId(0, epoch, 0, 0), NO_INDEX, NO_INDEX)
