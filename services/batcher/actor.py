"""The batcher stage on Ray: reads the newest index version, builds batches, feeds the Redis stream.

Shown on the Ray dashboard as `marge-batcher`. It switches to a newer index version as soon as one
is committed (the batches already queued stay valid: they carry their version and snapshot step), and
waits instead of dropping anything when the stream is full. Its position (version, epoch) is kept in
Redis so a restarted run does not rebuild batches it already produced.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import ray

from marge.batcher.core import DocumentStore, batcher_config, epoch_batches
from marge.config import PipelineConfig
from marge.corpus import Corpus
from marge.index_store import latest_version
from marge.protocol import BatchQueue
from marge.utils import setup_logging

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=4)
class Batcher:
    def __init__(self, cfg: PipelineConfig, redis_url: str):
        from ray.util.metrics import Counter, Gauge

        setup_logging()
        self.cfg = cfg
        self.bcfg = batcher_config(cfg)
        self.index_root = Path(cfg.run.dir) / "index"
        self.docs = DocumentStore(Corpus.open(cfg.data.corpus))
        self.queue = BatchQueue.connect(redis_url, cfg.run.name, claim_idle_ms=cfg.queue.claim_idle_ms,
                                        max_deliveries=cfg.queue.max_deliveries)
        self.queue.ensure_group()
        self.state_key = f"{self.queue.prefix}:batcher"
        self._stop = threading.Event()
        self.produced = 0
        self.produced_by_version: dict[int, int] = {}
        self.cross_share_sum = 0.0
        self.tokens_sum = 0
        self.stats_extra: dict = {}
        tags = {"stage": "batcher", "run": cfg.run.name}
        self.c_produced = Counter("marge_batches_produced", "Batches written to the queue", tag_keys=tuple(tags))
        self.g_depth = Gauge("marge_queue_depth", "Batches waiting in the Redis stream", tag_keys=tuple(tags))
        self.g_version = Gauge("marge_batcher_index_version", "Index version batches are built from", tag_keys=tuple(tags))
        self.g_cross = Gauge("marge_batch_crosslingual_share", "Cross-lingual share of edges inside produced batches",
                             tag_keys=tuple(tags))
        for metric in (self.c_produced, self.g_depth, self.g_version, self.g_cross):
            metric.set_default_tags(tags)

    def _load_position(self) -> tuple[int, int]:
        raw = self.queue.r.get(self.state_key)
        if raw is None:
            return -1, -1
        state = json.loads(raw)
        return int(state["version"]), int(state["epoch"])

    def _save_position(self, version: int, epoch: int) -> None:
        self.queue.r.set(self.state_key, json.dumps({"version": version, "epoch": epoch}))

    def run(self, poll_s: float = 0.2) -> None:
        """Produce batches until stopped, always from the newest committed index version.

        One epoch is one pass over a version's graph; the next pass (new seed order, new batch ids)
        follows until a newer version is committed, which is taken up at once.
        """
        version_no, epoch = self._load_position()  # the last pass started (-1, -1: none)
        while not self._stop.is_set():
            version = latest_version(self.index_root)
            if version is None:
                self._stop.wait(poll_s)
                continue
            if version.version != version_no:
                version_no, epoch = version.version, 0
            else:
                epoch += 1
            limit = self.cfg.batcher.epochs_per_version
            if limit and epoch >= limit:
                epoch -= 1  # this version is used up: wait for a newer one
                self._stop.wait(poll_s)
                continue
            self._save_position(version_no, epoch)
            self.g_version.set(version_no)
            for batch in epoch_batches(version, self.docs, self.bcfg, epoch, stats=self.stats_extra):
                if self.queue.put(batch, self.cfg.queue.max_depth, should_stop=self._stop.is_set) is None:
                    return
                self._count(batch, version_no)
                if self.produced % 8 == 0:
                    newer = latest_version(self.index_root)
                    if newer is not None and newer.version > version_no:
                        log.info("batcher: index v%d appeared, leaving v%d", newer.version, version_no)
                        break

    def _count(self, batch, version_no: int) -> None:
        self.produced += 1
        self.produced_by_version[version_no] = self.produced_by_version.get(version_no, 0) + 1
        self.cross_share_sum += batch.cross_lingual_edge_share()
        self.tokens_sum += batch.cost_tokens()
        self.c_produced.inc()
        self.g_depth.set(self.queue.depth())
        self.g_cross.set(self.cross_share_sum / self.produced)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return {"produced": self.produced, "produced_by_version": dict(self.produced_by_version),
                "crosslingual_share": self.cross_share_sum / max(1, self.produced),
                "mean_batch_tokens": self.tokens_sum / max(1, self.produced), "depth": self.queue.depth(),
                **self.stats_extra, "time": time.time()}
