"""The batcher stage on Ray: reads the newest index version, builds batches, feeds the Redis stream.

Shown on the Ray dashboard as `marge-batcher`. It switches to a newer index version as soon as one
is committed (the batches already queued stay valid: they carry their version and snapshot step), and
waits instead of dropping anything when the stream is full. Its position (version, epoch) is kept in
Redis so a restarted run does not rebuild batches it already produced.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from marge.corpus import Corpus
from marge.index_store import latest_version
from marge.metrics import StageMetrics
from marge.paths import RunPaths
from marge.protocol import BatchQueue, QueueConfig
from marge.utils import setup_logging
from services.batcher.config import BatcherConfig
from services.batcher.core import DocumentStore, epoch_batches

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=4)
class Batcher:
    """Gets the `batcher:` and `queue:` sections, the run's paths and seed, and the queue's address."""

    def __init__(self, cfg: BatcherConfig, queue: QueueConfig, paths: RunPaths, seed: int, redis_url: str):
        setup_logging()
        self.cfg, self.queue_cfg, self.paths, self.seed = cfg, queue, paths, seed
        self.docs = DocumentStore(Corpus.open(paths.corpus))
        self.queue = BatchQueue.connect(redis_url, paths.name, queue)
        self.queue.ensure_group()
        self._stop = threading.Event()
        self.produced = 0
        self.produced_by_version: dict[int, int] = {}
        self.cross_share_sum = 0.0
        self.tokens_sum = 0
        self.stats_extra: dict = {}
        m = self.metrics = StageMetrics("batcher", paths.name)
        m.counter("marge_batches_produced", "Batches written to the queue")
        m.gauge("marge_queue_depth", "Batches waiting in the Redis stream")
        m.gauge("marge_batcher_index_version", "Index version batches are built from")
        m.gauge("marge_batch_crosslingual_share", "Cross-lingual share of edges inside produced batches")

    def run(self, poll_s: float = 0.2) -> None:
        """Produce batches until stopped, always from the newest committed index version.

        One epoch is one pass over a version's graph; the next pass (new seed order, new batch ids)
        follows until a newer version is committed, which is taken up at once.
        """
        version_no, epoch = self.queue.batcher_position()  # the last pass started (-1, -1: none)
        while not self._stop.is_set():
            version = latest_version(self.paths.index)
            if version is None:
                self._stop.wait(poll_s)
                continue
            if version.version != version_no:
                version_no, epoch = version.version, 0
            else:
                epoch += 1
            limit = self.cfg.epochs_per_version
            if limit and epoch >= limit:
                epoch -= 1  # this version is used up: wait for a newer one
                self._stop.wait(poll_s)
                continue
            self.queue.save_batcher_position(version_no, epoch)
            self.metrics.set("marge_batcher_index_version", version_no)
            for batch in epoch_batches(version, self.docs, self.cfg, epoch, self.seed, stats=self.stats_extra):
                if self.queue.put(batch, self.queue_cfg.max_depth, should_stop=self._stop.is_set) is None:
                    return
                self._count(batch, version_no)
                if self.produced % 8 == 0:
                    newer = latest_version(self.paths.index)
                    if newer is not None and newer.version > version_no:
                        log.info("batcher: index v%d appeared, leaving v%d", newer.version, version_no)
                        break

    def _count(self, batch, version_no: int) -> None:
        self.produced += 1
        self.produced_by_version[version_no] = self.produced_by_version.get(version_no, 0) + 1
        self.cross_share_sum += batch.cross_lingual_edge_share()
        self.tokens_sum += batch.cost_tokens()
        self.metrics.inc("marge_batches_produced")
        self.metrics.set("marge_queue_depth", self.queue.depth())
        self.metrics.set("marge_batch_crosslingual_share", self.cross_share_sum / self.produced)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return {"produced": self.produced, "produced_by_version": dict(self.produced_by_version),
                "crosslingual_share": self.cross_share_sum / max(1, self.produced),
                "mean_batch_tokens": self.tokens_sum / max(1, self.produced), "depth": self.queue.depth(),
                **self.stats_extra, "time": time.time()}
