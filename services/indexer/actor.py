"""The indexer stage on Ray: a coordinator that watches for new snapshots and N workers that index shards.

Shown on the Ray dashboard as `marge-indexer-coordinator` and `marge-indexer-<i>` (actor names are
scoped by the run's Ray namespace). Workers are plain Ray actors with their own resources
(`indexer.num_cpus_per_worker`, `indexer.num_gpus_per_worker`), so the indexer scales on its own:
more workers index more shards at once. A worker writes its shards' files into the version's
staging folder; the coordinator commits the version (manifest, rename, LATEST) once every shard is in.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import ray

from marge.config import PipelineConfig
from marge.corpus import Corpus
from marge.index_store import commit_version, latest_version, staging_dir
from marge.indexer.core import index_build_record, index_shard, link_config
from marge.snapshot import latest_snapshot, load_relevance_encoder, read_snapshot
from marge.utils import setup_logging

log = logging.getLogger(__name__)


@ray.remote
class IndexerWorker:
    def __init__(self, cfg: PipelineConfig, worker_index: int):
        import torch
        from ray.util.metrics import Counter, Gauge

        setup_logging()
        self.cfg = cfg
        self.worker_index = worker_index
        if cfg.indexer.nice:
            os.nice(cfg.indexer.nice)  # yield the CPU to trainers that share it
        torch.set_num_threads(max(1, int(cfg.indexer.num_cpus_per_worker)))
        self.device = "cuda" if cfg.indexer.use_gpu and torch.cuda.is_available() else "cpu"
        self.corpus = Corpus.open(cfg.data.corpus)
        self.specials = self.corpus.tokenizer().specials
        tags = {"stage": "indexer", "run": cfg.run.name, "worker": str(worker_index)}
        self.docs_counter = Counter("marge_indexer_docs_embedded", "Documents embedded by the indexer",
                                    tag_keys=tuple(tags))
        self.docs_counter.set_default_tags(tags)
        self.rate_gauge = Gauge("marge_indexer_docs_per_second", "Documents embedded per second (last shard)",
                                tag_keys=tuple(tags))
        self.rate_gauge.set_default_tags(tags)

    def index_shards(self, version: int, snapshot_path: str, shards: list[int]) -> list[dict]:
        """Index `shards` with the snapshot at `snapshot_path` into the staging folder of `version`."""
        import torch

        snapshot = read_snapshot(Path(snapshot_path))
        encoder = load_relevance_encoder(snapshot, self.device)
        out = staging_dir(Path(self.cfg.run.dir) / "index", version)
        out.mkdir(parents=True, exist_ok=True)
        autocast = torch.bfloat16 if self.device == "cuda" and self.cfg.trainer.bf16 else None
        entries = []
        for shard in shards:
            result = index_shard(self.corpus.read_shard(shard), encoder, self.specials, out, link_config(self.cfg),
                                 batch_tokens=self.cfg.indexer.batch_tokens, device=self.device,
                                 use_gpu_faiss=self.cfg.indexer.use_gpu, autocast_dtype=autocast,
                                 seed=self.cfg.run.seed + shard)
            self.docs_counter.inc(result.num_documents)
            self.rate_gauge.set(result.num_documents / max(result.embed_seconds, 1e-9))
            entries.append(result.as_manifest_entry())
        return entries


@ray.remote(num_cpus=0, max_concurrency=4)
class IndexCoordinator:
    """Re-indexes whenever the newest snapshot is `reindex_every` updates past the indexed one."""

    def __init__(self, cfg: PipelineConfig, workers: list):
        from ray.util.metrics import Counter, Gauge, Histogram

        setup_logging()
        self.cfg = cfg
        self.workers = workers
        self.root = Path(cfg.run.dir) / "index"
        self.snapshots = Path(cfg.run.dir) / "snapshots"
        self.corpus = Corpus.open(cfg.data.corpus, verify_checksums=False)
        self._stop = threading.Event()
        current = latest_version(self.root)
        self.version = current.version if current else -1
        self.indexed_step = current.snapshot_step if current else None
        self.history: list[dict] = []
        tags = {"stage": "indexer", "run": cfg.run.name}
        self.g_version = Gauge("marge_index_version", "Newest committed index version", tag_keys=tuple(tags))
        self.g_edges = Gauge("marge_index_edges", "Links in the newest index", tag_keys=tuple(tags))
        self.g_cross = Gauge("marge_index_crosslingual_share", "Share of cross-lingual links in the newest index",
                             tag_keys=tuple(tags))
        self.g_cos_pos = Gauge("marge_index_linked_cosine", "Mean cosine of kept links", tag_keys=tuple(tags))
        self.g_cos_rand = Gauge("marge_index_random_cosine", "Mean cosine of random in-shard pairs (spread of g)",
                                tag_keys=tuple(tags))
        self.g_precision = Gauge("marge_index_crosslingual_link_precision",
                                 "Share of cross-lingual links that join translations of the same page", tag_keys=tuple(tags))
        self.c_versions = Counter("marge_index_versions_built", "Index versions committed", tag_keys=tuple(tags))
        self.h_seconds = Histogram("marge_index_build_seconds", "Seconds to build one index version",
                                   boundaries=[1, 5, 15, 60, 300, 1800], tag_keys=tuple(tags))
        for metric in (self.g_version, self.g_edges, self.g_cross, self.g_cos_pos, self.g_cos_rand, self.g_precision,
                       self.c_versions, self.h_seconds):
            metric.set_default_tags(tags)

    def due(self) -> tuple[int, str] | None:
        """(snapshot step, path) to index now, or None."""
        snap = latest_snapshot(self.snapshots)
        if snap is None:
            return None
        if self.indexed_step is None or snap.step >= self.indexed_step + self.cfg.indexer.reindex_every:
            return snap.step, str(snap.path)
        return None

    def build(self, snapshot_step: int, snapshot_path: str) -> dict:
        started = time.time()
        version = self.version + 1
        shards = list(range(self.corpus.num_shards))
        n = len(self.workers)
        refs = [w.index_shards.remote(version, snapshot_path, shards[i::n]) for i, w in enumerate(self.workers)
                if shards[i::n]]
        entries = [e for part in ray.get(refs) for e in part]
        committed = commit_version(self.root, version, snapshot_step, entries, keep_versions=self.cfg.indexer.keep_versions,
                                   extra={"snapshot_path": snapshot_path})
        self.version, self.indexed_step = version, snapshot_step
        record = index_build_record(committed, entries, started)
        m = committed.manifest
        seconds = record["seconds"]
        self.history.append(record)
        self.g_version.set(version)
        self.g_edges.set(m["num_edges"])
        self.g_cross.set(record["crosslingual_share"])
        self.g_cos_pos.set(record["linked_cosine"])
        self.g_cos_rand.set(record["random_cosine"])
        self.g_precision.set(record["crosslingual_link_precision"])
        self.c_versions.inc()
        self.h_seconds.observe(seconds)
        log.info("index v%d committed from snapshot step %d: %d docs, %d links (%.0f%% cross-lingual, %.0f%% of those "
                 "join translations) in %.1fs", version, snapshot_step, m["num_documents"], m["num_edges"],
                 100 * record["crosslingual_share"], 100 * record["crosslingual_link_precision"], seconds)
        return record

    def run(self, poll_s: float = 0.5) -> None:
        """Index on every due snapshot until stopped."""
        while not self._stop.is_set():
            todo = self.due()
            if todo is not None:
                self.build(*todo)
            else:
                self._stop.wait(poll_s)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return {"version": self.version, "indexed_step": self.indexed_step, "history": list(self.history)}

