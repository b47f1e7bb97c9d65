"""The indexer stage on Ray: a coordinator that watches for new snapshots and N workers that index shards.

Shown on the Ray dashboard as `marge-indexer-coordinator` and `marge-indexer-<i>` (actor names are
scoped by the run's Ray namespace). Workers are plain Ray actors with their own resources
(`indexer.num_cpus_per_worker`, `indexer.num_gpus_per_worker`), so the indexer scales on its own:
more workers index more shards at once. A worker writes its shards' files into the version's
staging folder; the coordinator commits the version (manifest, rename, LATEST) once every shard is in.
Version v is always built from the snapshot of update v * reindex_every (the batch schedule relies on it).
Each actor gets the `indexer:` section, the run's paths and its seed: nothing else of the run's config.
Killed, an actor is restarted by Ray and the call it was serving is retried (its shards are indexed again).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray

from marge.corpus import Corpus
from marge.index_store import commit_version, latest_version, staging_dir, version_dirname
from marge.metrics import StageMetrics
from marge.paths import RunPaths
from marge.snapshot import load_relevance_encoder, read_snapshot, snapshot_dirname
from marge.utils import setup_logging
from services.indexer.config import IndexerConfig
from services.indexer.core import index_build_record, index_shard

log = logging.getLogger(__name__)


@ray.remote(max_restarts=-1, max_task_retries=-1)
class IndexerWorker:
    def __init__(self, cfg: IndexerConfig, paths: RunPaths, seed: int, worker_index: int):
        import torch

        setup_logging()
        self.cfg, self.paths, self.seed = cfg, paths, seed
        if cfg.nice:
            os.nice(cfg.nice)  # yield the CPU to trainers that share it
        torch.set_num_threads(max(1, int(cfg.num_cpus_per_worker)))
        self.device = "cuda" if cfg.use_gpu and torch.cuda.is_available() else "cpu"
        self.corpus = Corpus.open(paths.corpus)
        self.specials = self.corpus.tokenizer().specials
        self.metrics = StageMetrics("indexer", paths.name, worker=str(worker_index))
        self.metrics.counter("marge_indexer_docs_embedded", "Documents embedded by the indexer")
        self.metrics.gauge("marge_indexer_docs_per_second", "Documents embedded per second (last shard)")

    def index_shards(self, version: int, snapshot_step: int, shards: list[int]) -> list[dict]:
        """Index `shards` with the snapshot of `snapshot_step` into the staging folder of `version`."""
        encoder = load_relevance_encoder(read_snapshot(self.paths.snapshots / snapshot_dirname(snapshot_step)), self.device)
        out = staging_dir(self.paths.index, version)
        out.mkdir(parents=True, exist_ok=True)
        entries = []
        for shard in shards:
            result = index_shard(self.corpus.read_shard(shard), encoder, self.specials, out, self.cfg,
                                 device=self.device, seed=self.seed + shard)
            self.metrics.inc("marge_indexer_docs_embedded", result.num_documents)
            self.metrics.set("marge_indexer_docs_per_second", result.num_documents / max(result.embed_seconds, 1e-9))
            entries.append(result.as_manifest_entry())
        return entries


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=-1, max_task_retries=-1)
class IndexCoordinator:
    """Builds version v as soon as the snapshot of update v * reindex_every is published.

    `floor` is the oldest version the run still needs (a resumed run's): a needed version that is missing
    (pruned, or dropped with a discarded lineage) is built again from its snapshot. The floor rises with the
    versions built (never below the `keep_versions` newest), so a version pruned on purpose is not rebuilt,
    also when Ray restarts the actor with its original arguments.
    """

    def __init__(self, cfg: IndexerConfig, paths: RunPaths, workers: list, floor: int = 0):
        setup_logging()
        self.cfg, self.paths, self.workers = cfg, paths, workers
        self.num_shards = Corpus.open(paths.corpus, verify_checksums=False).num_shards
        self._stop = threading.Event()
        current = latest_version(paths.index)
        self.floor = max(floor, self._oldest_kept(current.version if current else -1))
        self.version = current.version if current else -1
        self.indexed_step = current.snapshot_step if current else None
        self.history: list[dict] = []
        m = self.metrics = StageMetrics("indexer", paths.name)
        m.gauge("marge_index_version", "Newest committed index version")
        m.gauge("marge_index_edges", "Links in the newest index")
        m.gauge("marge_index_crosslingual_share", "Share of cross-lingual links in the newest index")
        m.gauge("marge_index_linked_cosine", "Mean cosine of kept links")
        m.gauge("marge_index_random_cosine", "Mean cosine of random in-shard pairs (spread of g)")
        m.gauge("marge_index_crosslingual_link_precision",
                "Share of cross-lingual links that join translations of the same page")
        m.counter("marge_index_versions_built", "Index versions committed")
        m.histogram("marge_index_build_seconds", "Seconds to build one index version", [1, 5, 15, 60, 300, 1800])

    def _oldest_kept(self, newest: int) -> int:
        return newest + 1 - self.cfg.keep_versions

    def due(self) -> int | None:
        """The version to build now (the oldest needed one that is missing and has its snapshot), or None."""
        latest = latest_version(self.paths.index)
        newest = latest.version if latest else -1
        for version in range(max(0, self.floor), newest + 2):
            if (self.paths.index / version_dirname(version) / "manifest.json").exists():
                continue
            if (self.paths.snapshots / snapshot_dirname(version * self.cfg.reindex_every) / "manifest.json").exists():
                return version
        return None

    def build(self, version: int) -> dict:
        started = time.time()
        snapshot_step = version * self.cfg.reindex_every
        shards = list(range(self.num_shards))
        n = len(self.workers)
        refs = [w.index_shards.remote(version, snapshot_step, shards[i::n]) for i, w in enumerate(self.workers)
                if shards[i::n]]
        entries = [e for part in ray.get(refs) for e in part]
        committed = commit_version(self.paths.index, version, snapshot_step, entries, keep_versions=self.cfg.keep_versions)
        self.version, self.indexed_step = max(self.version, version), snapshot_step
        self.floor = max(self.floor, self._oldest_kept(self.version))
        record = index_build_record(committed, entries, started)
        self.history.append(record)
        m = self.metrics
        m.set("marge_index_version", version)
        m.set("marge_index_edges", record["num_edges"])
        m.set("marge_index_crosslingual_share", record["crosslingual_share"])
        m.set("marge_index_linked_cosine", record["linked_cosine"])
        m.set("marge_index_random_cosine", record["random_cosine"])
        m.set("marge_index_crosslingual_link_precision", record["crosslingual_link_precision"])
        m.inc("marge_index_versions_built")
        m.observe("marge_index_build_seconds", record["seconds"])
        log.info("index v%d committed from snapshot step %d: %d docs, %d links (%.0f%% cross-lingual, %.0f%% of those "
                 "join translations) in %.1fs", version, snapshot_step, record["num_documents"], record["num_edges"],
                 100 * record["crosslingual_share"], 100 * record["crosslingual_link_precision"], record["seconds"])
        return record

    def run(self, poll_s: float = 0.5) -> None:
        """Index on every due snapshot until stopped."""
        while not self._stop.is_set():
            todo = self.due()
            if todo is not None:
                self.build(todo)
            else:
                self._stop.wait(poll_s)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return {"version": self.version, "indexed_step": self.indexed_step, "history": list(self.history)}
