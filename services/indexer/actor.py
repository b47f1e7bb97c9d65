"""The indexer stage on Ray: a coordinator that watches for new snapshots and N workers that index shards.

Shown on the Ray dashboard as `marge-indexer-coordinator` and `marge-indexer-<i>` (actor names are
scoped by the run's Ray namespace). Workers are plain Ray actors with their own resources
(`indexer.num_cpus_per_worker`, `indexer.num_gpus_per_worker`), so the indexer scales on its own:
more workers index more shards at once. A worker writes its shards' files into the version's
staging folder; the coordinator commits the version (manifest, rename, LATEST) once every shard is in.
Version v is always built from the snapshot of update v * reindex_every (the batch schedule relies on it).
Each actor gets the `indexer:` section, the run's paths and its seed: nothing else of the run's config.
Killed, an actor is restarted by Ray and the call it was serving is retried (its shards are indexed again).

The pool can change while the run trains (`marge scale --run NAME --indexer-workers N`): the coordinator
records the wanted size in the run folder (`indexer_pool.json`, so a restarted coordinator keeps it) and
applies it between versions, never during one, so a removed worker never takes a shard of a version being
built with it. Each version's manifest says how many workers built it (`indexer_workers`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import ray

from marge.contracts.corpus import Corpus
from marge.contracts.faults import FaultsConfig
from marge.contracts.index_store import latest_version, staging_dir, version_dirname
from marge.contracts.paths import RunPaths
from marge.contracts.slots import VersionPlan
from marge.eval.metrics import StageMetrics
from marge.model.snapshot import load_relevance_encoder, read_snapshot, snapshot_dirname
from marge.util.files import atomic_write_text, setup_logging
from services.indexer.config import IndexerConfig
from services.indexer.core import build_version, describe_build, index_shard, prune_unneeded_snapshots

log = logging.getLogger(__name__)


class BuildStopped(Exception):
    """The coordinator was stopped while a build waited on its workers."""


STOP_GRACE_S = 8.0
"""How long a stopped coordinator waits for its workers' calls to end at a shard boundary (the driver removes the
stages 10 s after asking them to stop; a call still running then is killed and Ray logs it as a failed task)."""


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=2)  # 2: `stop` reaches it during `index_shards`
class IndexerWorker:
    def __init__(self, cfg: IndexerConfig, paths: RunPaths, seed: int, worker_index: int,
                 faults: FaultsConfig = FaultsConfig()):
        import torch

        setup_logging()
        self.cfg, self.paths, self.seed, self.faults = cfg, paths, seed, faults
        if cfg.nice:
            os.nice(cfg.nice)  # yield the CPU to trainers that share it
        torch.set_num_threads(max(1, int(cfg.num_cpus_per_worker)))
        self.device = "cuda" if cfg.use_gpu and torch.cuda.is_available() else "cpu"
        self.corpus = Corpus.open(paths.corpus)
        self.specials = self.corpus.tokenizer().specials
        self.metrics = StageMetrics("indexer", paths.name, worker=str(worker_index))
        self.metrics.counter("marge_indexer_docs_embedded", "Documents embedded by the indexer")
        self.metrics.gauge("marge_indexer_docs_per_second", "Documents embedded per second (last shard)")
        self._stop = threading.Event()

    def stop(self) -> None:
        """The run is over: a call in progress returns at its next shard boundary (what it indexed stays staged)."""
        self._stop.set()

    def index_shards(self, version: int, snapshot_step: int, shards: list[int]) -> list[dict]:
        """Index `shards` with the snapshot of `snapshot_step` into the staging folder of `version` (fewer, once
        stopped: the build it belongs to is left unfinished)."""
        encoder = load_relevance_encoder(read_snapshot(self.paths.snapshots / snapshot_dirname(snapshot_step)), self.device)
        out = staging_dir(self.paths.index, version)
        out.mkdir(parents=True, exist_ok=True)
        entries = []
        for shard in shards:
            if self._stop.is_set():
                break
            self._slow_down(version, shard)
            result = index_shard(self.corpus.read_shard(shard), encoder, self.specials, out, self.cfg,
                                 device=self.device, seed=self.seed + shard, snapshot_step=snapshot_step)
            self._record_shard(version, shard, "indexed")
            self.metrics.inc("marge_indexer_docs_embedded", result.num_documents)
            self.metrics.set("marge_indexer_docs_per_second", result.num_documents / max(result.embed_seconds, 1e-9))
            entries.append(result.as_manifest_entry())
        return entries

    def _slow_down(self, version: int, shard: int) -> None:
        """The test-only `faults.slow_index_shard_s`: record the shard's start, then wait before indexing it."""
        if self.faults.slow_index_shard_s is None:
            return
        self._record_shard(version, shard, "started")
        time.sleep(self.faults.slow_index_shard_s)

    def _record_shard(self, version: int, shard: int, event: str) -> None:
        if self.faults.slow_index_shard_s is None:
            return
        record = {"version": version, "shard": shard, "event": event, "pid": os.getpid(),
                  "node": ray.util.get_node_ip_address(), "time": time.time()}
        path = self.paths.run_dir / "faults" / "index-shards.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:  # one short append: whole lines from every worker
            f.write(json.dumps(record) + "\n")


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=-1, max_task_retries=-1)
class IndexCoordinator:
    """Builds version v as soon as the snapshot of update v * reindex_every is published.

    `floor` is the oldest version the run still needs (a resumed run's): a needed version that is missing
    (pruned, or dropped with a discarded lineage) is built again from its snapshot. The floor rises with the
    versions built (never below the `keep_versions` newest), so a version pruned on purpose is not rebuilt,
    also when Ray restarts the actor with its original arguments.
    """

    def __init__(self, cfg: IndexerConfig, paths: RunPaths, plan: VersionPlan, workers: int, floor: int = 0,
                 seed: int = 0, faults: FaultsConfig = FaultsConfig()):
        setup_logging()
        self.cfg, self.paths, self.plan, self.seed, self.faults = cfg, paths, plan, seed, faults
        # the driver's first `workers`, found by name: actor handles as constructor arguments would be references
        # Ray cannot restore if it restarts this actor (ray-project/ray#53727); `scale` adds and removes from the end
        self.workers = [self._worker(i) for i in range(workers)]
        self.wanted_workers = read_pool_size(paths) or len(self.workers)
        self.building: int | None = None  # the version being built (its pool is fixed)
        self._pool_lock = threading.Lock()  # `scale` (another thread of this actor) vs a build taking its pool
        self.num_shards = Corpus.open(paths.corpus, verify_checksums=False).num_shards
        self._stop = threading.Event()
        self._in_flight: list = []  # the workers' calls of the build in progress
        current = latest_version(paths.index)
        self.floor = max(floor, self._oldest_kept(current.version if current else -1))
        self.version = current.version if current else -1
        self.indexed_step = current.snapshot_step if current else None
        self.history: list[dict] = []
        m = self.metrics = StageMetrics("indexer", paths.name, worker="coordinator")
        m.gauge("marge_index_version", "Newest committed index version")
        m.gauge("marge_indexer_workers", "Indexer workers in the pool (applied between versions)")
        m.gauge("marge_index_edges", "Links in the newest index")
        m.gauge("marge_index_crosslingual_share", "Share of cross-lingual links in the newest index")
        m.gauge("marge_index_linked_cosine", "Mean cosine of kept links")
        m.gauge("marge_index_random_cosine", "Mean cosine of random in-shard pairs (spread of g)")
        m.gauge("marge_index_crosslingual_link_precision",
                "Share of cross-lingual links that join translations of the same page")
        m.gauge("marge_index_crosslingual_parallel_precision",
                "Share of cross-lingual links that join aligned translations (the same paragraph of the same page)")
        m.gauge("marge_index_lexical_weight", "lambda of cos(g) + lambda * tfidf in the newest index (0: g alone)")
        m.counter("marge_index_versions_built", "Index versions committed")
        m.histogram("marge_index_build_seconds", "Seconds to build one index version", [1, 5, 15, 60, 300, 1800])
        m.gauge("marge_index_embed_seconds", "Seconds the workers spent embedding the newest version (summed)")
        m.gauge("marge_index_link_seconds", "Seconds the workers spent searching and linking the newest version (summed)")

    def _oldest_kept(self, newest: int) -> int:
        return newest + 1 - self.cfg.keep_versions

    def due(self) -> int | None:
        """The version to build now (the oldest needed one that is missing and has its snapshot), or None."""
        latest = latest_version(self.paths.index)
        newest = latest.version if latest else -1
        for version in range(max(0, self.floor), newest + 2):
            if (self.paths.index / version_dirname(version) / "manifest.json").exists():
                continue
            if (self.paths.snapshots / snapshot_dirname(self.plan.snapshot_step(version)) / "manifest.json").exists():
                return version
        return None

    # --- the worker pool -------------------------------------------------------------------------------

    def scale(self, workers: int) -> dict:
        """Ask for `workers` indexer workers from the next version on (the one being built keeps its pool)."""
        if workers < 1:
            raise ValueError(f"the indexer needs at least 1 worker, asked for {workers}")
        with self._pool_lock:
            before = self.wanted_workers
            self.wanted_workers = workers
            write_pool_size(self.paths, workers)
            # a version being built keeps the pool it started with
            first = (self.building if self.building is not None else self.version) + 1
        log.info("indexer pool: %d -> %d workers, from index version v%d", before, workers, first)
        return {"workers": len(self.workers), "wanted": workers, "from_version": first}

    def pool(self) -> dict:
        return {"workers": len(self.workers), "wanted": self.wanted_workers, "version": self.version,
                "cpus_per_worker": self.cfg.num_cpus_per_worker}

    def _worker(self, i: int):
        """Worker `marge-indexer-<i>` of this run: the running one (after a restart of this coordinator, or one a
        scale-up started before it), else a new one."""
        namespace = ray.get_runtime_context().namespace
        try:
            return ray.get_actor(f"marge-indexer-{i}", namespace=namespace)
        except ValueError:
            return start_worker(self.cfg, self.paths, self.seed, i, namespace, self.faults)

    def _apply_pool(self) -> None:
        """Grow or shrink the pool to the wanted size; only called between versions."""
        while len(self.workers) < self.wanted_workers:
            self.workers.append(self._worker(len(self.workers)))
            log.info("indexer pool: started marge-indexer-%d", len(self.workers) - 1)
        while len(self.workers) > self.wanted_workers:
            ray.kill(self.workers.pop(), no_restart=True)
            log.info("indexer pool: stopped marge-indexer-%d", len(self.workers))
        self.metrics.set("marge_indexer_workers", len(self.workers))

    # --- building ----------------------------------------------------------------------------------------

    def _index(self, version: int, snapshot_step: int, shards_of: dict[int, list[int]]) -> list[dict]:
        """Every worker indexes its shards. Ray restarts a crashed worker and retries its call; a worker that
        is gone for good (stopped by an earlier pool change this coordinator no longer knows of, after a
        restart) is replaced and its shards are indexed by the new one."""
        refs = {i: self.workers[i].index_shards.remote(version, snapshot_step, shards) for i, shards in shards_of.items()}
        self._in_flight = list(refs.values())
        entries = []
        for i, ref in refs.items():
            try:
                entries += self._unless_stopped(ref)
            except ray.exceptions.RayActorError:
                log.warning("marge-indexer-%d is gone; starting a new one for shards %s of v%d", i, shards_of[i], version)
                namespace = ray.get_runtime_context().namespace
                self.workers[i] = start_worker(self.cfg, self.paths, self.seed, i, namespace, self.faults)
                entries += self._unless_stopped(self.workers[i].index_shards.remote(version, snapshot_step, shards_of[i]))
        return entries

    def _unless_stopped(self, ref):
        """`ray.get(ref)`, or BuildStopped once `stop` is called: the run is over, and a build still waiting on its
        workers then ends before the driver removes the stage (killed mid-call, Ray would report a failed task)."""
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                return ray.get(ref)
            if self._stop.is_set():
                raise BuildStopped()

    def build(self, version: int) -> dict:
        with self._pool_lock:
            self.building = version
            self._apply_pool()
        snapshot_step = self.plan.snapshot_step(version)
        n = len(self.workers)

        def index_shards(shards: list[int], staging) -> list[dict]:  # the workers write into the staging folder
            return self._index(version, snapshot_step, {i: shards[i::n] for i in range(n) if shards[i::n]})

        committed, record = build_version(self.paths.index, self.paths.run_dir, version, snapshot_step, self.num_shards,
                                          self.cfg, index_shards, workers=n, seed=self.seed)
        with self._pool_lock:
            self.version, self.indexed_step, self.building = max(self.version, version), snapshot_step, None
        self.floor = max(self.floor, self._oldest_kept(self.version))
        pruned = (prune_unneeded_snapshots(self.paths, self.plan, self.paths.checkpoints, self.cfg.keep_snapshots)
                  if self.cfg.keep_snapshots else [])
        if pruned:
            log.info("snapshots no longer needed, deleted: steps %s", pruned)
        self.history.append(record)
        m = self.metrics
        m.set("marge_index_version", version)
        m.set("marge_index_edges", record["num_edges"])
        m.set("marge_index_crosslingual_share", record["crosslingual_share"])
        m.set("marge_index_linked_cosine", record["linked_cosine"])
        m.set("marge_index_random_cosine", record["random_cosine"])
        m.set("marge_index_crosslingual_link_precision", record["crosslingual_link_precision"])
        if record["crosslingual_parallel_precision"] is not None:
            m.set("marge_index_crosslingual_parallel_precision", record["crosslingual_parallel_precision"])
        m.set("marge_index_lexical_weight", record["lexical_weight"])
        m.inc("marge_index_versions_built")
        m.observe("marge_index_build_seconds", record["seconds"])
        m.set("marge_index_embed_seconds", record["embed_seconds"])
        m.set("marge_index_link_seconds", record["link_seconds"])
        log.info("index v%d committed from snapshot step %d: %s", version, snapshot_step, describe_build(record))
        return record

    def run(self, poll_s: float = 0.5) -> None:
        """Index on every due snapshot until stopped (a build in progress then ends unfinished: its staging folder
        is taken up again by the next build of that version)."""
        while not self._stop.is_set():
            todo = self.due()
            if todo is None:
                self._stop.wait(poll_s)
                continue
            try:
                self.build(todo)
            except BuildStopped:
                for worker in self.workers:
                    worker.stop.remote()
                ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=STOP_GRACE_S)
                log.info("index v%d: build left unfinished, the run is over", todo)
                with self._pool_lock:
                    self.building = None
                return

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return {"version": self.version, "indexed_step": self.indexed_step, "history": list(self.history)}


def start_worker(cfg: IndexerConfig, paths: RunPaths, seed: int, index: int, namespace: str,
                 faults: FaultsConfig = FaultsConfig()):
    """`IndexerWorker` as the run names and sizes it: `marge-indexer-<index>` in the run's namespace."""
    return IndexerWorker.options(name=f"marge-indexer-{index}", namespace=namespace, num_cpus=cfg.num_cpus_per_worker,  # type: ignore[attr-defined]  # @ray.remote makes it an actor class; mypy does not apply class decorators
                                 num_gpus=cfg.num_gpus_per_worker if cfg.use_gpu else 0,
                                 resources=dict(cfg.resources)).remote(cfg, paths, seed, index, faults)


def pool_file(paths: RunPaths):
    return paths.run_dir / "indexer_pool.json"


def read_pool_size(paths: RunPaths) -> int | None:
    """The pool size last asked for with `marge scale` (None: the config's `indexer.num_workers`)."""
    path = pool_file(paths)
    return int(json.loads(path.read_text(encoding="utf-8"))["workers"]) if path.exists() else None


def write_pool_size(paths: RunPaths, workers: int) -> None:
    atomic_write_text(pool_file(paths), json.dumps({"workers": workers, "unix": time.time()}) + "\n")
