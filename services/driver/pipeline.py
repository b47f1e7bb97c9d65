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

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from marge.config import ConfigError
from marge.corpus import Corpus
from marge.index_store import latest_version
from marge.paths import RunPaths
from marge.protocol import BatchQueue
from marge.snapshot import latest_snapshot
from services.driver.config import PipelineConfig, environment_endpoints, with_absolute_paths
from services.driver.plan import estimated_throughput, warn_if_behind
from services.driver.progress import Progress
from services.driver.report import read_train_log
from services.driver.resources import apply_local_ray_env, ray_for, redis_for
from services.trainer.init import ensure_initial_model
from services.trainer.job import TrainerJob
from services.trainer.loop import train_loop_per_worker

log = logging.getLogger("marge.pipeline")


def run_pipeline(cfg: PipelineConfig) -> dict:
    """Prepare what is missing, start Redis, Ray and the stages, train until done, stop what was started."""
    started = time.time()
    cfg = with_absolute_paths(environment_endpoints(cfg))
    paths = cfg.paths()
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    (paths.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
    corpus = ensure_corpus(cfg)
    model_cfg = cfg.model_config(vocab_size=corpus.tokenizer().vocab_size)
    ensure_initial_model(model_cfg, paths, corpus, cfg.run.seed)
    capacity = warn_if_behind(cfg, model_cfg, corpus, estimated_throughput(cfg))
    with redis_for(cfg) as redis_url, ray_for(cfg), running_stages(cfg, paths, redis_url) as stages:
        queue = BatchQueue.connect(redis_url, paths.name, cfg.queue)
        queue.ensure_group()
        queue.clear_stop()
        deadline = started + 60 * cfg.run.max_minutes if cfg.run.max_minutes else None
        trainer = make_trainer(cfg, trainer_job(cfg, redis_url, deadline))
        progress = Progress(cfg.run.max_steps, queue, stages.coordinator, stages.batcher)
        result = supervise(trainer, stages, queue, progress, cfg.run.progress_every_s)
        return {**summarize(paths, queue, stages, result, started), "capacity_plan": capacity}


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


def trainer_job(cfg: PipelineConfig, redis_url: str | None, deadline_unix: float | None = None,
                memory_batches: list[list] | None = None) -> TrainerJob:
    """What every trainer rank gets: its sections, the run's paths, and its batches' source."""
    return TrainerJob(cfg.trainer, cfg.objectives, cfg.health, cfg.queue, cfg.paths(), cfg.run.seed, cfg.run.max_steps,
                      heldout_pairs=cfg.data.heldout_pairs, deadline_unix=deadline_unix, redis_url=redis_url,
                      memory_batches=memory_batches)


def make_trainer(cfg: PipelineConfig, job: TrainerJob):
    """The trainer stage: a Ray Train TorchTrainer whose DDP workers run `job`.

    `run.name` and `run.dir` name its Ray Train run: starting it again with the same pair resumes
    from the run's latest checkpoint.
    """
    apply_local_ray_env(cfg)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t = cfg.trainer
    resources = {"CPU": t.num_cpus_per_worker, **({"GPU": 1} if t.use_gpu else {}), **t.resources}
    return TorchTrainer(
        train_loop_per_worker, train_loop_config={"job": job},
        scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        run_config=RunConfig(name=cfg.run.name, storage_path=str(job.paths.ray_train),
                             checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=0)))


@dataclass
class Stages:
    """The running indexer and batcher actors, and the object refs of their `run` loops."""

    coordinator: Any
    batcher: Any
    runs: dict[str, Any]


@contextlib.contextmanager
def running_stages(cfg: PipelineConfig, paths: RunPaths, redis_url: str) -> Iterator[Stages]:
    """The indexer and batcher actors, named in the run's namespace, running until the block ends."""
    import ray

    from services.batcher.actor import Batcher
    from services.indexer.actor import IndexCoordinator, IndexerWorker

    namespace = f"marge-{cfg.run.name}"  # actor names are unique per run, also on a shared cluster
    ix = cfg.indexer
    workers = [IndexerWorker.options(name=f"marge-indexer-{i}", namespace=namespace, num_cpus=ix.num_cpus_per_worker,
                                     num_gpus=ix.num_gpus_per_worker if ix.use_gpu else 0, resources=dict(ix.resources))
               .remote(ix, paths, cfg.run.seed, i) for i in range(ix.num_workers)]
    coordinator = IndexCoordinator.options(name="marge-indexer-coordinator", namespace=namespace).remote(ix, paths, workers)
    batcher = Batcher.options(name="marge-batcher", namespace=namespace).remote(cfg.batcher, cfg.queue, paths,
                                                                                 cfg.run.seed, redis_url)
    try:
        yield Stages(coordinator, batcher, {"indexer": coordinator.run.remote(), "batcher": batcher.run.remote()})
    finally:
        for loop in (coordinator, batcher):
            with contextlib.suppress(Exception):  # best effort: the actor is killed next
                ray.get(loop.stop.remote(), timeout=10)
        for actor in (coordinator, batcher, *workers):
            ray.kill(actor)


def supervise(trainer, stages: Stages, queue: BatchQueue, progress: Progress, progress_every_s: float):
    """Run the trainer to its end, with a progress line per stage every `progress_every_s`. A stage that dies,
    or an interrupt, asks the trainers to stop at their next step boundary (they checkpoint) and re-raises."""
    import ray

    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="torch-trainer", daemon=True)
    thread.start()
    runs = stages.runs
    next_report = time.time() + progress_every_s
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
            done, _ = ray.wait(list(runs.values()), timeout=0)
            for name, ref in runs.items():
                if ref in done:
                    ray.get(ref)  # raises the stage's error
                    raise RuntimeError(f"the {name} stage stopped unexpectedly")
            if time.time() >= next_report:
                for line in progress.lines():
                    log.info(line)
                next_report = time.time() + progress_every_s
    except BaseException:
        queue.request_stop()  # trainers stop at the next step boundary and checkpoint
        thread.join(timeout=120)
        raise
    if "error" in outcome:
        raise outcome["error"]
    for line in progress.lines():
        log.info(line)
    return outcome["result"]


def summarize(paths: RunPaths, queue: BatchQueue, stages: Stages, result, started: float) -> dict:
    """The run in one JSON object (the driver's last stdout line); figures over the whole run come from
    train_log.jsonl, which keeps every update (Redis keeps only the newest)."""
    import ray

    idx, bat = ray.get([stages.coordinator.stats.remote(), stages.batcher.stats.remote()], timeout=60)
    records = read_train_log(paths.run_dir)
    counts = queue.counts()
    last = records[-1] if records else {}
    snap = latest_snapshot(paths.snapshots)
    index = latest_version(paths.index)
    checkpoint = result.checkpoint.path if result is not None and result.checkpoint is not None else None
    return {
        "steps": last.get("step", 0), "index_versions": sorted({v for r in records for v in r["index_versions"]}),
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
        "run_dir": str(paths.run_dir), "elapsed_s": round(time.time() - started, 1),
    }
