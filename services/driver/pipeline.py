"""`marge pretrain`: the driver of one MARGE pre-training run on Ray.

    driver (this process; a Ray job entrypoint)
     |- IndexCoordinator "marge-indexer-coordinator" -> IndexerWorker "marge-indexer-<i>" x N
     |- Batcher "marge-batcher" -> Redis stream
     |- TorchTrainer (Ray Train): DDP workers <- Redis stream; rank 0 -> snapshots -> indexer

The stages talk only through files with manifests (snapshots/, index/) and the Redis stream. With no
Ray or Redis address the driver starts a local Ray and a private redis-server and stops both (by
PID) when it ends. It prints one progress line per stage every `run.progress_every_s` seconds and,
last on stdout, one JSON object summarising the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch
import yaml

from marge.checkpoint import save_model_weights
from marge.config import ConfigError, PipelineConfig, environment_endpoints
from marge.corpus import Corpus
from marge.index_store import latest_version
from marge.model import Marge
from marge.protocol import BatchQueue
from marge.redis_server import LocalRedis
from marge.snapshot import latest_snapshot, publish_snapshot
from marge.trainer.worker import init_weights_path, train_loop_per_worker

log = logging.getLogger("marge.pipeline")

# Measured on 2-core machines (see README): loopback-only sockets, no token auth on a private local
# cluster, quick shutdown, and a lighter Ray Train V2 controller.
LOCAL_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
}


def with_absolute_paths(cfg: PipelineConfig) -> PipelineConfig:
    """Ray workers do not share the driver's working directory: give them absolute paths."""
    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(path).resolve())

    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=absolute(cfg.run.dir)),
        data=dataclasses.replace(cfg.data, corpus=absolute(cfg.data.corpus), raw=[absolute(p) for p in cfg.data.raw],
                                 heldout_pairs=absolute(cfg.data.heldout_pairs)),
        health=dataclasses.replace(cfg.health, documents=absolute(cfg.health.documents), pairs=absolute(cfg.health.pairs)))


def ensure_corpus(cfg: PipelineConfig) -> Corpus:
    """Open the prepared corpus, preparing it from `data.raw` first if it does not exist yet."""
    root = Path(cfg.data.corpus)
    if not (root / "manifest.json").exists():
        from marge.prepare import PrepareOptions, prepare

        log.info("preparing %s from %s", root, ", ".join(cfg.data.raw))
        prepare(PrepareOptions(inputs=[Path(p) for p in cfg.data.raw], out=root, vocab_size=cfg.data.vocab_size,
                               max_chunk_tokens=cfg.data.max_chunk_tokens, docs_per_shard=cfg.data.docs_per_shard,
                               num_shards=cfg.data.num_shards, seed=cfg.run.seed))
    corpus = Corpus.open(root)
    if corpus.manifest["max_chunk_tokens"] > cfg.data.max_chunk_tokens:
        raise ConfigError(f"{root} was prepared with max_chunk_tokens={corpus.manifest['max_chunk_tokens']} but "
                          f"data.max_chunk_tokens is {cfg.data.max_chunk_tokens}; re-prepare or change the config")
    return corpus


def ensure_initial_model(cfg: PipelineConfig, corpus: Corpus) -> Path:
    """The run's initial weights (seeded) and the step-0 snapshot the first index is built from."""
    tokenizer = corpus.tokenizer()
    model_cfg = cfg.model_config(vocab_size=tokenizer.vocab_size)
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
    if model_cfg.max_positions < corpus.manifest["max_chunk_tokens"]:
        raise ConfigError(f"model.max_positions {model_cfg.max_positions} < the corpus's max_chunk_tokens "
                          f"{corpus.manifest['max_chunk_tokens']}")
    path = init_weights_path(cfg)
    if path.exists():
        saved = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        if saved != model_cfg.to_dict():
            raise ConfigError(f"{cfg.run.dir} holds a run with a different model config; resume it with the same "
                              "config or choose another run.dir / run.name")
    else:
        torch.manual_seed(cfg.run.seed)
        save_model_weights(path, Marge(model_cfg))
    snapshots = Path(cfg.run.dir) / "snapshots"
    if latest_snapshot(snapshots) is None:
        from marge.checkpoint import load_model_weights

        publish_snapshot(snapshots, load_model_weights(path), 0, tokenizer.sha256)
    return path


def start_redis(cfg: PipelineConfig) -> tuple[str, LocalRedis | None]:
    if cfg.redis.url:
        return cfg.redis.url, None
    data_dir = Path(cfg.run.dir) / "redis"
    password = None
    conf = data_dir / "redis.conf"
    if conf.exists():  # a resumed run reopens its own queue, ledger and pending batches (AOF)
        for line in conf.read_text().splitlines():
            if line.startswith("requirepass "):
                password = line.split(" ", 1)[1]
    server = LocalRedis(data_dir, appendfsync=cfg.redis.appendfsync, maxmemory=cfg.redis.maxmemory,
                        password=password).start()
    return server.url, server


def apply_local_ray_env(cfg: PipelineConfig) -> None:
    """Ray reads these when it is first imported: set them before any `import ray` for a local cluster."""
    if not cfg.ray.address:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)


def start_ray(cfg: PipelineConfig) -> bool:
    """Connect to the configured cluster, or start a local one. Returns True when we started it."""
    apply_local_ray_env(cfg)
    import ray

    namespace = f"marge-{cfg.run.name}"
    if ray.is_initialized():  # embedded in a program (or a test) that already runs Ray
        return False
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, namespace=namespace, log_to_driver=True)
        return False
    needed = (cfg.trainer.num_workers * cfg.trainer.num_cpus_per_worker
              + cfg.indexer.num_workers * cfg.indexer.num_cpus_per_worker)
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(needed + 0.999))
    ray.init(address="local", namespace=namespace, num_cpus=num_cpus, include_dashboard=cfg.ray.include_dashboard,
             dashboard_host="127.0.0.1", object_store_memory=cfg.ray.object_store_memory, log_to_driver=False)
    return True


class Progress:
    """One line per stage, from the actors' stats and the trainer's last step record in Redis."""

    def __init__(self, cfg: PipelineConfig, queue: BatchQueue, coordinator, batcher):
        self.cfg, self.queue, self.coordinator, self.batcher = cfg, queue, coordinator, batcher

    def lines(self) -> list[str]:
        import ray

        idx, bat = ray.get([self.coordinator.stats.remote(), self.batcher.stats.remote()], timeout=30)
        counts = self.queue.counts()
        last = self.queue.r.hget(f"{self.queue.prefix}:trainer", "last")
        out = []
        if idx["history"]:
            h = idx["history"][-1]
            out.append(f"[indexer] v{h['version']} from snapshot {h['snapshot_step']} | {h['num_documents']} docs, "
                       f"{h['num_edges']} links, {100 * h['crosslingual_share']:.0f}% cross-lingual | "
                       f"{h['docs_per_s']:.0f} docs/s | link cos {h['linked_cosine']:.3f} vs random {h['random_cosine']:.3f}")
        else:
            out.append("[indexer] building the first index")
        out.append(f"[batcher] produced {bat['produced']} | queue depth {counts['depth']} | pending {counts['pending']} | "
                   f"cross-lingual share in batches {100 * bat['crosslingual_share']:.0f}%")
        if last:
            r = json.loads(last)
            out.append(f"[trainer] step {r['step']}/{self.cfg.run.max_steps} | loss {r['loss']:.3f} | "
                       f"{r['tokens_per_s']:.0f} tok/s | waiting {100 * r['wait_share']:.1f}% | beta "
                       f"{sum(r['beta']) / len(r['beta']):.3f} | staleness {r['staleness_max']} | index v{max(r['index_versions'])}")
        else:
            out.append("[trainer] starting")
        return out


def make_trainer(cfg: PipelineConfig, redis_url: str | None, deadline_unix: float | None = None,
                 memory_batches: list[list] | None = None):
    """The trainer stage: a Ray Train TorchTrainer whose DDP workers read batches from Redis.

    `run.name` and `run.dir` name its Ray Train run: starting it again with the same pair resumes
    from the run's latest checkpoint. `memory_batches` (one list per rank) feeds the same loop from
    memory instead of Redis: the in-process baseline of the benchmark.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = {"CPU": cfg.trainer.num_cpus_per_worker, **({"GPU": 1} if cfg.trainer.use_gpu else {}),
                 **cfg.trainer.resources}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"pipeline": cfg, "redis_url": redis_url, "deadline_unix": deadline_unix,
                           **({"memory_batches": memory_batches} if memory_batches is not None else {})},
        scaling_config=ScalingConfig(num_workers=cfg.trainer.num_workers, use_gpu=cfg.trainer.use_gpu,
                                     resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if cfg.trainer.use_gpu else "gloo"),
        run_config=RunConfig(name=cfg.run.name, storage_path=str(Path(cfg.run.dir) / "ray_train"),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.trainer.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=0)))


def run_pipeline(cfg: PipelineConfig) -> dict:
    started = time.time()
    cfg = environment_endpoints(cfg)
    apply_local_ray_env(cfg)
    import ray

    from marge.batcher.actor import Batcher
    from marge.indexer.actor import IndexCoordinator, IndexerWorker

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
    corpus = ensure_corpus(cfg)
    cfg = with_absolute_paths(cfg)
    run_dir = Path(cfg.run.dir)
    ensure_initial_model(cfg, corpus)
    from marge.driver.plan import estimated_throughput, warn_if_behind

    capacity = warn_if_behind(cfg, cfg.model_config(vocab_size=corpus.tokenizer().vocab_size), corpus,
                              estimated_throughput(cfg))
    redis_url, redis_server = start_redis(cfg)
    started_ray = False
    actors = []
    try:
        started_ray = start_ray(cfg)
        queue = BatchQueue.connect(redis_url, cfg.run.name)
        queue.ensure_group()
        stop_key = f"{queue.prefix}:control:stop"
        queue.r.delete(stop_key)
        use_gpu = cfg.indexer.use_gpu
        namespace = f"marge-{cfg.run.name}"  # actor names are unique per run, also on a shared cluster
        workers = [IndexerWorker.options(name=f"marge-indexer-{i}", namespace=namespace,
                                         num_cpus=cfg.indexer.num_cpus_per_worker,
                                         num_gpus=cfg.indexer.num_gpus_per_worker if use_gpu else 0,
                                         resources=dict(cfg.indexer.resources))
                   .remote(cfg, i) for i in range(cfg.indexer.num_workers)]
        coordinator = IndexCoordinator.options(name="marge-indexer-coordinator", namespace=namespace).remote(cfg, workers)
        batcher = Batcher.options(name="marge-batcher", namespace=namespace).remote(cfg, redis_url)
        actors = [*workers, coordinator, batcher]
        background = {"indexer": coordinator.run.remote(), "batcher": batcher.run.remote()}

        deadline = started + 60 * cfg.run.max_minutes if cfg.run.max_minutes else None
        trainer = make_trainer(cfg, redis_url, deadline)
        outcome: dict = {}

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                outcome["error"] = e

        thread = threading.Thread(target=fit, name="torch-trainer", daemon=True)
        thread.start()
        progress = Progress(cfg, queue, coordinator, batcher)
        next_report = time.time() + cfg.run.progress_every_s
        try:
            while thread.is_alive():
                thread.join(timeout=0.5)
                done, _ = ray.wait(list(background.values()), timeout=0)
                for name, ref in background.items():
                    if ref in done:
                        ray.get(ref)  # raises the stage's error
                        raise RuntimeError(f"the {name} stage stopped unexpectedly")
                if time.time() >= next_report:
                    for line in progress.lines():
                        log.info(line)
                    next_report = time.time() + cfg.run.progress_every_s
        except BaseException:
            queue.r.set(stop_key, "1")  # trainers stop at the next step boundary and checkpoint
            thread.join(timeout=120)
            raise
        if "error" in outcome:
            raise outcome["error"]
        for line in progress.lines():
            log.info(line)
        return {**summarize(cfg, queue, coordinator, batcher, outcome["result"], started), "capacity_plan": capacity}
    finally:
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=10) if hasattr(actor, "stop") else None
            except Exception:  # noqa: BLE001 - best effort: the actor is killed next
                pass
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
        if redis_server is not None:
            redis_server.stop()


def summarize(cfg: PipelineConfig, queue: BatchQueue, coordinator, batcher, result, started: float) -> dict:
    import ray

    idx, bat = ray.get([coordinator.stats.remote(), batcher.stats.remote()], timeout=60)
    records = [json.loads(x) for x in queue.r.lrange(f"{queue.prefix}:steps", 0, -1)]
    counts = queue.counts()
    versions = sorted({v for r in records for v in r["index_versions"]})
    last = records[-1] if records else {}
    snap = latest_snapshot(Path(cfg.run.dir) / "snapshots")
    index = latest_version(Path(cfg.run.dir) / "index")
    checkpoint = result.checkpoint.path if result is not None and result.checkpoint is not None else None
    return {
        "steps": last.get("step", 0), "index_versions": versions,
        "index_versions_built": len(idx["history"]), "latest_index_version": index.version if index else None,
        "batches_produced": counts.get("produced", 0), "batches_acked": counts.get("acked", 0),
        "batches_pending": counts["depth"], "batches_dead_lettered": counts.get("dead_lettered", 0),
        "batches_redelivered": counts.get("redelivered", 0), "trained_twice": counts.get("trained_twice", 0),
        "tokens_per_s": last.get("tokens_per_s", 0.0), "target_tokens_per_s": last.get("target_tokens_per_s", 0.0),
        "wait_share": last.get("wait_share", 0.0),
        "loss_first": records[0]["loss"] if records else None, "loss_last": last.get("loss"),
        "beta": last.get("beta"), "staleness_max": max((r["staleness_max"] for r in records), default=0),
        "batch_crosslingual_share": bat["crosslingual_share"],
        "index_builds": idx["history"],
        "checkpoint": checkpoint, "snapshot": str(snap.path) if snap else None,
        "run_dir": cfg.run.dir, "elapsed_s": round(time.time() - started, 1),
    }
