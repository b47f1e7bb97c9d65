"""The batcher stage on Ray: `batcher.builders` batch builders, each writing its group of ranks' slots into their
Redis streams, in slot order.

Shown on the Ray dashboard as `marge-batcher-<n>`. Which batch a slot holds is decided by the deterministic
schedule (`services.batcher.schedule`); a builder only follows its cursor in the queue (`next_slot:<n>`), waits
for the index version a slot needs, and waits while it is `lookahead` updates ahead of the slowest rank. The
builders share nothing but the queue. Killed, Ray restarts one (and its `run`) and it carries on from its cursor;
if the cursor moves back (a resumed run, a Redis restart that lost its last writes) it writes those slots again,
identically.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time

import numpy as np
import ray

from marge.contracts.batch import Batch
from marge.contracts.corpus import Corpus
from marge.contracts.index_store import IndexVersion
from marge.contracts.protocol import BatchQueue
from marge.contracts.slots import BatchId
from marge.eval.metrics import StageMetrics
from marge.util.files import setup_logging
from services.batcher.core import DocumentStore
from services.batcher.job import BatcherJob
from services.batcher.schedule import BatchSchedule, wait_for_version
from services.batcher.stats import links_by_language
from services.batcher.writer import write_slots

log = logging.getLogger(__name__)


def poisoned(batch: Batch) -> Batch:
    """The batch with one token id no vocabulary has (the `faults.poison_slot` switch), under an id that names this
    content: a builder that makes a bad batch, not one whose entry was altered (which the trainer refuses apart)."""
    tokens = list(batch.doc_tokens)
    tokens[int(batch.targets[0])] = np.concatenate([tokens[int(batch.targets[0])], [2**30]]).astype(np.int32)
    bad = Batch(batch.batch_id, batch.index_version, batch.snapshot_step, batch.doc_ids, batch.doc_langs,
                tuple(tokens), batch.targets, batch.evidence, batch.edges, batch.edge_weights)
    named = BatchId.of(bad)
    if named is None:
        return bad
    return dataclasses.replace(bad, batch_id=str(dataclasses.replace(named, content=bad.content_digest())))


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=-1, max_task_retries=-1)
class Batcher:
    """One batch builder: its `BatcherJob` (its section, the queue's, the run's paths, seed, slot layout, version
    plan and batch shape, the file that holds the queue's address, and which builder it is)."""

    def __init__(self, job: BatcherJob):
        setup_logging()
        cfg, paths, slots = job.batcher, job.paths, job.slots
        self.cfg, self.paths, self.seed, self.slots, self.plan, self.shape = cfg, paths, job.seed, slots, job.plan, job.shape
        self.group = job.group
        self.faults = job.faults
        self.lookahead_steps = max(1, math.ceil(job.queue.max_depth / slots.per_step))
        self.stall_s = job.queue.stall_s
        self.docs = DocumentStore(Corpus.open(paths.corpus), cfg.shard_cache_mb)
        self.queue = BatchQueue.from_url_file(job.redis_url_file, paths.name, slots)
        self._stop = threading.Event()
        self.produced = 0
        self.produced_by_version: dict[int, int] = {}
        self.cross_share_sum = 0.0
        self.tokens_sum = 0
        self.links_version = -1
        self.links: dict[tuple[str, str], int] = {}
        """Links by (target, evidence) language in this builder's batches of index version `links_version` (its
        newest): what the progress lines judge a language's share of the cross-lingual links by."""
        self.waiting_for_version: int | None = None
        self._building: int | None = None
        """The slot whose batch is being built."""
        m = self.metrics = StageMetrics("batcher", paths.name, worker=str(job.group))
        m.counter("marge_batches_produced", "Batches written to the queue")
        m.gauge("marge_batcher_next_slot", "The first slot not written yet")
        m.gauge("marge_batcher_index_version", "Index version batches are built from")
        m.gauge("marge_batch_crosslingual_share", "Cross-lingual share of edges inside produced batches")

    def _version(self, number: int) -> IndexVersion | None:
        """Committed index version `number`, waiting for the indexer to build it; None once stopped, or once this
        builder's cursor leaves the slot it builds (a trainer group reset the queue to an older checkpoint: the
        ranks need earlier slots, and the version waited for needs their progress)."""
        self.waiting_for_version = number
        building = self._building
        index = wait_for_version(self.paths.index, number, self._stop,
                                 give_up=lambda: self.queue.next_slot(self.group) != building)
        self.waiting_for_version = None
        if index is not None:
            self.metrics.set("marge_batcher_index_version", number)
        return index

    def run(self) -> None:
        """Write this builder's slots from its cursor on, until stopped (`services.batcher.writer.write_slots`)."""
        schedule = BatchSchedule(self.docs, self.cfg, self.seed, self.slots, self.plan, self._version, self.shape,
                                 self.group, self.paths.batch_counts)

        def scheduled(slot: int, replays_before: int) -> Batch | None:
            self._building = slot
            batch = schedule.batch(slot, replays_before)
            return poisoned(batch) if batch is not None and slot == self.faults.poison_slot else batch

        write_slots(self.queue, scheduled, schedule.replays_before, self.lookahead_steps, self._stop, self._count,
                    self.group, self.stall_s)

    def _count(self, batch: Batch, slot: int) -> None:
        self.produced += 1
        self.produced_by_version[batch.index_version] = self.produced_by_version.get(batch.index_version, 0) + 1
        self.cross_share_sum += batch.cross_lingual_edge_share()
        self.tokens_sum += batch.cost_tokens()
        if batch.index_version > self.links_version:
            self.links_version, self.links = batch.index_version, {}
        if batch.index_version == self.links_version:
            for pair, n in links_by_language(batch).items():
                self.links[pair] = self.links.get(pair, 0) + n
        self.metrics.inc("marge_batches_produced")
        self.metrics.set("marge_batcher_next_slot", slot + 1)
        self.metrics.set("marge_batch_crosslingual_share", self.cross_share_sum / self.produced)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return {"produced": self.produced, "produced_by_version": dict(self.produced_by_version),
                "crosslingual_share": self.cross_share_sum / max(1, self.produced),
                "mean_batch_tokens": self.tokens_sum / max(1, self.produced), "next_slot": self.queue.next_slot(self.group),
                "waiting_for_version": self.waiting_for_version, "time": time.time(),
                "links_version": self.links_version, "links_by_language": dict(self.links),
                "documents_by_language": dict(self.docs.corpus.manifest["languages"])}
