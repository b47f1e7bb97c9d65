"""`marge pretrain`: the driver of one MARGE pre-training run on Ray.

    driver (this process; a Ray job entrypoint)
     |- IndexCoordinator "marge-indexer-coordinator" -> IndexerWorker "marge-indexer-<i>" x N
     |- Batcher "marge-batcher-<n>" (batcher.builders) -> Redis streams
     |- TorchTrainer (Ray Train): DDP workers <- Redis stream; rank 0 -> snapshots -> indexer

The stages talk only through files with manifests (snapshots/, index/) and the Redis stream. With no
Ray or Redis address the driver starts a local Ray and a private redis-server and stops both (by
PID) when it ends. It prints one progress line per stage every `run.progress_every_s` seconds and,
last on stdout, one JSON object summarising the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from marge.contracts.config import ConfigError
from marge.contracts.corpus import Corpus
from marge.contracts.index_store import drop_versions_after, latest_version
from marge.contracts.paths import RunPaths
from marge.contracts.protocol import BatchQueue, read_url_file, write_url_file
from marge.contracts.train_log import RunFigures, TrainLog, feed
from marge.eval.refresh import RefreshCost
from marge.eval.tensorboard import RunBoard
from marge.model.checkpoint import read_manifest
from marge.model.lineage import newest_good_checkpoint, start_generation
from marge.model.snapshot import drop_snapshots_after, latest_snapshot
from marge.util.files import atomic_write_text
from services.batcher.stats import combined_stats
from services.driver.config import PipelineConfig, config_drift, environment_endpoints, probe_files, with_absolute_paths
from services.driver.lock import PIPELINE, DriverLock, check_folder_mode
from services.driver.plan import estimated_throughput, warn_if_behind
from services.driver.progress import Progress, log_progress, setup_phase
from services.driver.redis_server import private_conf_dir
from services.driver.resources import (
    RedisEndpoint,
    StageFailure,
    apply_local_ray_env,
    check_local_fit,
    describe_stage_failure,
    is_ray_failure,
    ray_for,
    ray_running,
    redis_for,
)
from services.driver.spec import RunSpec, compile_spec
from services.trainer.init import ensure_initial_model
from services.trainer.job import TrainerJob
from services.trainer.rank import process_group_backend, train_loop_per_worker

log = logging.getLogger("marge.pipeline")


def run_pipeline(cfg: PipelineConfig, reuse_folder: bool = False) -> dict:
    """Prepare what is missing, start Redis, Ray and the stages, train until done, stop what was started. A run.dir
    holding a `--single-process` run is refused unless `reuse_folder`.

    Started again on a run that stopped or crashed, it resumes: from the newest checkpoint that verifies, with
    the snapshots and index versions of later updates discarded and the queue reset to that update (the
    batcher writes the same batches into the same slots again), so every batch is trained exactly once."""
    started = time.time()
    cfg = with_absolute_paths(environment_endpoints(cfg))
    paths = cfg.paths()
    if not cfg.ray.address and not ray_running():
        check_local_fit(cfg)  # a run a local Ray could not hold is refused before anything starts or is written
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    with DriverLock(paths.run_dir, PIPELINE, reuse_folder):
        checkpoint = resume_checkpoint(cfg, paths)  # chosen (read once); nothing cut back yet
        atomic_write_text(paths.run_dir / "config.yaml", yaml.safe_dump(cfg.to_saved_dict(), sort_keys=False))
        corpus = open_corpus(cfg)
        spec = compile_spec(with_probes(cfg, corpus), corpus.tokenizer().vocab_size)
        cfg, model_cfg = spec.config, spec.model
        spec.write()
        with setup_phase(log, "initial model") as notes:
            ensure_initial_model(model_cfg, paths, corpus, cfg.run.seed)
            notes.append(f"{paths.init_weights.name} and the step-0 snapshot in {paths.run_dir}")
        capacity = (warn_if_behind(cfg, model_cfg, corpus, estimated_throughput(cfg)) if cfg.objectives.needs_index
                    else None)  # the plan is the indexer's against the trainers'; without an index there is none
        with contextlib.ExitStack() as running:
            with setup_phase(log, "Redis and Ray") as notes:
                redis = running.enter_context(redis_for(cfg))
                running.enter_context(redis.watched())
                running.enter_context(ray_for(cfg))
                notes.append(f"Redis {'private redis-server' if redis.server else 'at redis.url'}, Ray "
                             f"{'at ' + cfg.ray.address if cfg.ray.address else 'local'}")
            # a new trainer generation first: a group a killed driver left running can then neither write to the
            # queue nor finish a checkpoint this run resumes from (the lineage abandons it)
            fence = BatchQueue.connect(redis.url, paths.name, spec.slots)  # joins the generation: not for writes
            start_generation(paths.checkpoints, fence.start_generation, checkpoint_step(checkpoint))
            point = resume_point(paths, checkpoint)
            queue = BatchQueue.connect(redis.url, paths.name, spec.slots)
            queue.reset_from(point.step)
            queue.clear_stop()
            floor = spec.version_plan.version_for_step(point.step)
            url_file = stage_url_file(paths, redis.url)  # the stages get its path, not the password
            with running_stages(spec, url_file, floor) as stages:
                log.info("[setup] stages asked of Ray: %s; the trainers start next, the first index is built "
                         "meanwhile", ", ".join(stages.runs))
                deadline = started + 60 * cfg.run.max_minutes if cfg.run.max_minutes else None
                job = spec.trainer_job(url_file, deadline, resume_from=point.checkpoint)
                board = RunBoard(paths.run_dir, "index", cfg.run.tensorboard)
                progress = Progress(cfg.run.max_steps, queue, stages.coordinator, stages.batchers, board, point.step,
                                    deadline, joined_cluster=bool(cfg.ray.address))
                try:
                    result = supervise(make_trainer(cfg, job), stages, queue, progress, cfg.run.progress_every_s)
                finally:
                    board.close()
                summary = {**summarize(paths, queue, stages, result, started, point, redis),
                           "objectives": list(cfg.objectives.enabled), "capacity_plan": capacity}
        summary["g_health"] = final_g_health(cfg, paths, corpus)
        return summary


def dry_run(cfg: PipelineConfig, reuse_folder: bool = False) -> dict:
    """What `marge pretrain` would do with `cfg`, checked as far as it can be without starting Ray or Redis or
    writing anything: the config in full, that this machine's local Ray could hold the run (when it would start
    one), that a resumed run keeps its settings, the corpus (prepared, or the inputs to prepare it from), the
    probes' data, the model and, with an index, the capacity plan (indexer against trainers). A check that fails
    raises the error the run would have stopped with."""
    cfg = with_absolute_paths(environment_endpoints(cfg))
    paths = cfg.paths()
    if not cfg.ray.address and not ray_running():
        check_local_fit(cfg)
    check_folder_mode(paths.run_dir, PIPELINE, reuse_folder)
    checkpoint = resume_checkpoint(cfg, paths)  # what `resume_point` would pick, nothing deleted
    out: dict[str, Any] = {"run_dir": str(paths.run_dir), "objectives": list(cfg.objectives.enabled),
                           "resumes_from_step": read_manifest(checkpoint, verify=False)["step"] if checkpoint else 0,
                           "ray": cfg.ray.address or "a local Ray started for the run",
                           "trainers": f"{cfg.trainer.num_workers} x {'GPU' if cfg.trainer.use_gpu else 'CPU'}"}
    root = Path(cfg.data.corpus)
    if not (root / "manifest.json").exists():
        if not cfg.data.raw:
            ensure_corpus(cfg)  # raises: nothing to prepare it from
        missing = [p for p in cfg.data.raw if not Path(p).exists()]
        if missing:
            raise ConfigError(f"data.raw names input that does not exist: {missing}")
        from services.prepare.options import PrepareOptions
        from services.prepare.run import chosen_engine

        engine = chosen_engine(PrepareOptions(inputs=[Path(p) for p in cfg.data.raw], out=root,
                                              engine=cfg.data.prepare_engine))
        out["corpus"] = (f"{root}: to be prepared from {', '.join(cfg.data.raw)} "
                         f"({'on Ray Data' if engine == 'ray' else 'in the driver process'})")
        out.update(compiled_facts(compile_spec(cfg)))  # the vocabulary is data.vocab_size until the tokenizer exists
        return out
    corpus = ensure_corpus(cfg)
    spec = compile_spec(with_probes(cfg, corpus), corpus.tokenizer().vocab_size)
    cfg = spec.config
    out["corpus"] = {"path": str(root), "documents": corpus.manifest["num_documents"],
                     "languages": corpus.languages, "shards": corpus.num_shards}
    out["probes"] = {"health.documents": cfg.health.documents, "data.heldout_pairs": cfg.data.heldout_pairs}
    out.update(compiled_facts(spec))
    if cfg.objectives.needs_index:
        from services.driver.plan import plan_run

        try:
            out["capacity_plan"] = plan_run(cfg)
        except ValueError as e:  # GPU workers planned on a machine without one: the plan needs a measurement
            out["capacity_plan"] = str(e)
    return out


def compiled_facts(spec: RunSpec) -> dict[str, Any]:
    """What a dry run shows of the run's spec: what spec.json would hold, less the config it was given."""
    return {key: value for key, value in spec.to_dict().items() if key not in ("config", "spec_version")}


def final_g_health(cfg: PipelineConfig, paths: RunPaths, corpus: Corpus) -> dict | None:
    """g of the run's newest snapshot against random initialisations (its step-0 snapshot and
    `INIT_BASELINES - 1` more models of its config drawn with other seeds), every one centred alike, on the held-out
    pairs, with an interval over held-out pages (`services.trainer.health.g_health`): logged as the run's last
    progress line, with a warning when g has collapsed or is not above its initialisation; None when the run has
    no held-out pairs or no trained snapshot."""
    from marge.eval.evaluation import pair_pages, read_pairs
    from marge.model.snapshot import load_relevance_encoder, read_snapshot, snapshot_dirname
    from services.driver.verdict_context import add_verdict_context
    from services.trainer.health import INIT_BASELINES, centre_rows, describe_g_health, g_health, random_encoders

    pairs_path = cfg.health.pairs or cfg.data.heldout_pairs
    newest = latest_snapshot(paths.snapshots)
    initial = paths.snapshots / snapshot_dirname(0)
    if not pairs_path or not Path(pairs_path).exists() or newest is None or newest.step == 0 or not initial.exists():
        log.info("[g] not measured: %s", "no held-out pairs (data.heldout_pairs)" if not pairs_path or
                 not Path(pairs_path).exists() else "no snapshot after update 0")
        return None
    tokenizer = corpus.tokenizer()
    pairs = read_pairs(Path(pairs_path), tokenizer.languages)
    trained = load_relevance_encoder(newest)
    seeds = [cfg.run.seed + 1000 * k for k in range(1, INIT_BASELINES)]
    initials = [load_relevance_encoder(read_snapshot(initial)), *random_encoders(trained.cfg, seeds)]
    documents = Path(cfg.health.documents) if cfg.health.documents else None
    health = g_health(trained, initials, tokenizer, pairs, centre_rows(corpus, seed=cfg.run.seed),
                      pair_pages(pairs, documents))
    health["snapshot_step"] = newest.step
    add_verdict_context(health, pairs, corpus, paths.index, cfg.indexer)  # chance, TF-IDF, languages cut off
    log.info(describe_g_health(health))
    if health["warning"]:
        log.warning(health["warning"])
    return health


def resume_checkpoint(cfg: PipelineConfig, paths: RunPaths) -> Path | None:
    """The checkpoint a (re)started run resumes from: its newest good one (`newest_good_checkpoint`, every part
    hashed), read once by the driver, with the config checked against the one it was trained with (`check_resume`).
    The ranks hash again only the share each of them reads."""
    checkpoint = newest_good_checkpoint(paths.checkpoints)
    check_resume(cfg, paths, checkpoint)
    return checkpoint


def check_resume(cfg: PipelineConfig, paths: RunPaths, checkpoint: Path | None) -> None:
    """A run resumed from `checkpoint` trains on with the settings it was trained with: a config that changes
    anything else (`config.RESUMABLE` says what may change) is refused with the differences. Extending a run past its
    schedule says what happens to the learning rate."""
    saved_path = paths.run_dir / "config.yaml"
    if not saved_path.exists() or checkpoint is None:
        return  # a new run (or one that never reached a checkpoint: it starts over)
    saved = yaml.safe_load(saved_path.read_text(encoding="utf-8"))
    drift = config_drift(saved, cfg.to_saved_dict())
    if drift:
        raise ConfigError(f"{paths.run_dir} resumes from {checkpoint.name} with settings it was not trained with: "
                          + "; ".join(drift) + ". Put them back, or start a new run (another run.name and run.dir)")
    steps_before, steps = saved.get("run", {}).get("max_steps"), cfg.run.max_steps
    if cfg.trainer.total_steps is None and steps_before is not None and steps != steps_before:
        log.warning("run.max_steps %d -> %d with trainer.total_steps unset: the learning rate now anneals to 0 at "
                    "update %d instead of %d, so from the resumed update on it is higher than it was (set "
                    "trainer.total_steps to keep the schedule)", steps_before, steps, steps, steps_before)


@dataclass(frozen=True)
class ResumePoint:
    step: int
    """The update the run continues from (0: a fresh run)."""
    checkpoint: str | None
    """The newest checkpoint that verifies, or None."""
    discarded: dict[str, list[int]]
    """Snapshot steps and index versions of updates after `step` (a crashed lineage), deleted."""


def checkpoint_step(checkpoint: Path | None) -> int:
    return int(read_manifest(checkpoint, verify=False)["step"]) if checkpoint else 0


def resume_point(paths: RunPaths, checkpoint: Path | None) -> ResumePoint:
    """Where a (re)started run continues: `checkpoint`, its newest good one (`newest_good_checkpoint`). Snapshots and
    index versions of later updates belong to a lineage the checkpoint does not hold: they are deleted, so the
    indexer builds those versions again from the resumed model's snapshots."""
    step = checkpoint_step(checkpoint)
    discarded = {"snapshots": drop_snapshots_after(paths.snapshots, step),
                 "index_versions": drop_versions_after(paths.index, step)}
    if checkpoint:
        log.info("resuming from %s (update %d); discarded the later snapshots %s and index versions %s", checkpoint,
                 step, discarded["snapshots"], discarded["index_versions"])
    return ResumePoint(step, str(checkpoint) if checkpoint else None, discarded)


def open_corpus(cfg: PipelineConfig) -> Corpus:
    """`ensure_corpus` between two set-up lines (preparing a corpus, or opening a large one, takes a while)."""
    with setup_phase(log, f"corpus {cfg.data.corpus}") as notes:
        corpus = ensure_corpus(cfg)
        notes.append(f"{corpus.manifest['num_documents']} documents in {len(corpus.languages)} languages, "
                     f"{corpus.num_shards} shards")
    return corpus


def ensure_corpus(cfg: PipelineConfig) -> Corpus:
    """Open the prepared corpus, preparing it from `data.raw` first if it does not exist yet."""
    root = Path(cfg.data.corpus)
    if not (root / "manifest.json").exists():
        from services.prepare.options import PrepareOptions
        from services.prepare.run import prepare

        if not cfg.data.raw:
            raise ConfigError(f"data.corpus {root} is not a prepared corpus ({root / 'manifest.json'} is missing) and "
                              "data.raw names no input to prepare it from: check the path, run `marge prepare INPUT "
                              f"--out {root}`, or set data.raw")
        log.info("preparing %s from %s", root, ", ".join(cfg.data.raw))
        d = cfg.data
        opts = PrepareOptions(inputs=[Path(p) for p in d.raw], out=root, vocab_size=d.vocab_size,
                              max_chunk_tokens=d.max_chunk_tokens, document_unit=d.document_unit,
                              min_document_tokens=d.min_document_tokens,
                              languages=tuple(d.languages) if d.languages else None,
                              docs_per_shard=d.docs_per_shard, num_shards=d.num_shards,
                              heldout_permille=d.heldout_permille, seed=cfg.run.seed, engine=d.prepare_engine,
                              workers=d.prepare_workers, tokenizer_sample_lines=d.tokenizer_sample_lines)
        prepare(opts, ray_address=cfg.ray.address)
    corpus = Corpus.open(root)
    if corpus.manifest["max_chunk_tokens"] > cfg.data.max_chunk_tokens:
        raise ConfigError(f"{root} was prepared with max_chunk_tokens={corpus.manifest['max_chunk_tokens']} but "
                          f"data.max_chunk_tokens is {cfg.data.max_chunk_tokens}; re-prepare or change the config")
    # data.document_unit and data.languages say how to prepare a missing corpus; an existing one is used as it is
    unit = corpus.manifest.get("document_unit", "chunk")
    if unit != cfg.data.document_unit:
        log.warning("%s was prepared with document_unit=%r, not data.document_unit=%r: training on it as it is "
                    "(point data.corpus at a new folder to prepare one with the config's settings)", root, unit,
                    cfg.data.document_unit)
    extra = sorted(set(corpus.languages) - set(cfg.data.languages or corpus.languages))
    if extra:
        log.warning("%s also holds %s, which data.languages %s leaves out: training on it as it is (point data.corpus "
                    "at a new folder to prepare one with the config's languages)", root, extra, cfg.data.languages)
    inputs = {Path(p).name for p in corpus.manifest.get("inputs", [])}
    if cfg.data.raw and inputs and inputs != {Path(p).name for p in cfg.data.raw} and (
            cfg.health.documents or cfg.data.heldout_pairs):
        log.warning("%s was prepared from %s, not from data.raw %s: the probes configured beside data.raw "
                    "(health.documents %s, data.heldout_pairs %s) may belong to another corpus; set them for this "
                    "one, or to null to use its own held-out split", root, sorted(inputs), cfg.data.raw,
                    cfg.health.documents, cfg.data.heldout_pairs)
    return corpus


def with_probes(cfg: PipelineConfig, corpus: Corpus) -> PipelineConfig:
    """`cfg` with its probes' inputs resolved: health.documents and data.heldout_pairs as the config gives them, else
    the corpus's own held-out split (`marge prepare --heldout-permille`); what is left unset turns that probe off, and
    the log says which it is (never another corpus's files in their place)."""
    for key, given in probe_files(cfg).items():
        if not Path(given).exists():
            raise ConfigError(f"{key} names {given}, which does not exist: point it at this corpus's probe file, or "
                              f"set it to null to use the corpus's own held-out split ({corpus.root})")
        if not cfg.health.external_probes and corpus.probe_home(given) is None:
            raise ConfigError(
                f"{key} names {given}, which is neither {corpus.root}'s held-out split nor beside the inputs it was "
                f"prepared from ({', '.join(corpus.manifest.get('inputs', [])) or 'none recorded'}): g would be "
                f"judged on another corpus's text. Set {key} to null to use the corpus's own held-out split "
                "(`marge prepare --heldout-permille N`), or health.external_probes=true to measure on this file anyway")
        check_probe_languages(key, Path(given), corpus.languages)
    documents = cfg.health.documents or (str(corpus.heldout_file("documents")) if corpus.heldout_file("documents") else None)
    pairs = cfg.data.heldout_pairs or (str(corpus.heldout_file("pairs")) if corpus.heldout_file("pairs") else None)
    for what, path, named, key in (("evidence-gain probes", documents, cfg.health.documents, "health.documents"),
                                   ("held-out retrieval P@1", pairs, cfg.data.heldout_pairs or cfg.health.pairs,
                                    "data.heldout_pairs")):
        if cfg.health.pairs and key == "data.heldout_pairs":
            continue
        if path is None:
            log.info("%s: off (%s is not set and %s has no held-out split: `marge prepare --heldout-permille N`)",
                     what, key, corpus.root)
        elif named is None:
            log.info("%s: from the corpus's held-out split (%s)", what, path)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, heldout_pairs=pairs),
                               health=dataclasses.replace(cfg.health, documents=documents))


def check_probe_languages(key: str, path: Path, languages: list[str]) -> None:
    """A probe file must speak the corpus's languages: pairs with at least one direction between two of them,
    documents with at least two of them (the probes pair a page across languages)."""
    from marge.contracts.documents import PrepareError, read_documents
    from marge.eval.evaluation import PairsError, read_pairs

    try:
        if key == "health.documents":
            spoken = sorted({lang for page in read_documents(path).values() for lang in page} & set(languages))
            if len(spoken) < 2:
                raise ConfigError(f"{key}: {path} has documents in {spoken or 'none'} of the corpus's languages "
                                  f"{languages}; the probes need a page in two of them")
        else:
            read_pairs(path, languages)
    except (PairsError, PrepareError) as e:
        raise ConfigError(f"{key}: {e}") from None


def stage_url_file(paths: RunPaths, url: str) -> Path:
    """The file the stages read the queue's Redis URL from: they are given its path, never the URL, because Ray keeps a
    job's arguments where its dashboard serves them (Ray Train's run state). MARGE_REDIS_URL_FILE when the URL came
    from it (the secret mounted at that path on every node); else a 0600 file beside the private redis-server's
    config, outside the run folder, which the stages of a one-machine run can read (on a cluster without
    MARGE_REDIS_URL_FILE, the workers fall back to MARGE_REDIS_URL from the job's runtime env)."""
    given = os.environ.get("MARGE_REDIS_URL_FILE")
    if given and not os.environ.get("MARGE_REDIS_URL") and read_url_file(Path(given)) == url:
        return Path(given)
    folder = private_conf_dir(paths.run_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return write_url_file(folder / "url", url)


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
        torch_config=TorchConfig(backend=process_group_backend(t.use_gpu)),
        run_config=RunConfig(name=cfg.run.name, storage_path=str(job.paths.ray_train),
                             checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=t.max_failures)))


@dataclass
class Stages:
    """The running indexer and batch builder actors, and the object refs of their `run` loops."""

    coordinator: Any
    """None when the run's objectives need no index."""
    batchers: list[Any]
    """The batch builders, builder n at n."""
    runs: dict[str, Any]


@contextlib.contextmanager
def running_stages(spec: RunSpec, redis_url_file: Path, floor: int = 0) -> Iterator[Stages]:
    """The indexer and batcher actors, named in the run's namespace, running until the block ends. `floor`: the
    oldest index version the run still needs (the indexer builds it again if it is missing)."""
    import ray

    from services.batcher.actor import Batcher
    from services.indexer.actor import IndexCoordinator, start_worker, write_pool_size

    cfg, paths = spec.config, spec.paths
    namespace = f"marge-{cfg.run.name}"  # actor names are unique per run, also on a shared cluster
    ix = cfg.indexer
    workers, coordinator, runs = [], None, {}
    if cfg.objectives.needs_index:  # BART alone, or VECO on document halves, trains without one
        # the config's pool; `marge scale` resizes it while the run trains (the coordinator owns the change).
        # A new driver starts from the config (a resubmission's `indexer.num_workers` is what the cluster was
        # sized for); only a coordinator that Ray restarts within this driver keeps a scaled size.
        write_pool_size(paths, ix.num_workers)
        workers = [start_worker(ix, paths, cfg.run.seed, i, namespace, cfg.faults) for i in range(ix.num_workers)]
        coordinator = IndexCoordinator.options(name="marge-indexer-coordinator", namespace=namespace).remote(  # type: ignore[attr-defined]  # @ray.remote makes it an actor class; mypy does not apply class decorators
            ix, paths, spec.version_plan, len(workers), floor, cfg.run.seed, cfg.faults)
        runs["indexer"] = coordinator.run.remote()
    batchers = [Batcher.options(name=f"marge-batcher-{group}", namespace=namespace).remote(  # type: ignore[attr-defined]  # @ray.remote makes it an actor class; mypy does not apply class decorators
        spec.batcher_job(redis_url_file, group)) for group in range(spec.slots.builders)]
    for group, batcher in enumerate(batchers):
        runs[f"batcher {group}" if len(batchers) > 1 else "batcher"] = batcher.run.remote()
    loops = [actor for actor in (coordinator, *batchers) if actor is not None]
    try:
        yield Stages(coordinator, batchers, runs)
    finally:
        for loop in loops:
            with contextlib.suppress(Exception):  # best effort: the actor is killed next
                ray.get(loop.stop.remote(), timeout=10)
        # let the `run` loops return first: killed mid-task, Ray would retry them (max_task_retries) and log it
        ray.wait(list(runs.values()), num_returns=len(runs), timeout=10)
        for actor in (*loops, *workers):
            ray.kill(actor)


def supervise(trainer, stages: Stages, queue: BatchQueue, progress: Progress, progress_every_s: float):
    """Run the trainer to its end, with a progress line per stage every `progress_every_s`. Killed actors are restarted by Ray, killed trainer workers by Ray Train (`trainer.max_failures`);
    a stage's `run` that fails for good, or an interrupt, asks the trainers to stop at their next step boundary
    (they checkpoint) and re-raises."""
    import ray
    import ray.exceptions

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
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as e:
                        if is_ray_failure(e):  # unschedulable or died for good: one line; its own error: as raised
                            raise describe_stage_failure(name, e) from e
                        raise
                    raise StageFailure(f"the {name} stage's loop returned while the run was training: see its "
                                       "worker log under the Ray session's logs folder, and start the run again to "
                                       "resume it")
            if time.time() >= next_report:
                log_progress(progress)
                next_report = time.time() + progress_every_s
    except BaseException:
        queue.request_stop()  # trainers stop at the next step boundary and checkpoint
        # trainers that never trained hold no update to checkpoint: a Ray that cannot start them need not be awaited
        thread.join(timeout=120 if trained_yet(queue) else 10)
        raise
    if "error" in outcome:
        if is_ray_failure(outcome["error"]):
            raise describe_stage_failure("trainer", outcome["error"]) from outcome["error"]
        raise outcome["error"]
    log_progress(progress)
    return outcome["result"]


def trained_yet(queue: BatchQueue) -> bool:
    """Whether the trainers recorded an update (True also when Redis cannot say: then they are waited for)."""
    try:
        return queue.last_step() is not None
    except Exception:  # noqa: BLE001 - asked while failing: the answer must not hide the failure
        return True


def summarize(paths: RunPaths, queue: BatchQueue, stages: Stages, result, started: float, point: ResumePoint,
              redis: RedisEndpoint) -> dict:
    """The run in one JSON object (the driver's last stdout line); figures over the whole run come from
    train_log.jsonl, which keeps every update (Redis keeps only the newest), folded in one pass over it that holds
    one of its files at a time."""
    import ray

    bat = combined_stats(ray.get([b.stats.remote() for b in stages.batchers], timeout=60))
    idx = ray.get(stages.coordinator.stats.remote(), timeout=60) if stages.coordinator is not None else {"history": []}
    figures, refresh = RunFigures(), RefreshCost(idx["history"])
    feed(TrainLog.of_run(paths.run_dir).iter_records(), figures, refresh)
    counts = queue.counts()
    first, last = figures.first, figures.last
    snap = latest_snapshot(paths.snapshots)
    index = latest_version(paths.index)
    checkpoint = result.checkpoint.path if result is not None and result.checkpoint is not None else None
    return {
        "steps": last.step if last else 0, "resumed_from_step": point.step,
        "index_versions": sorted(figures.index_versions),
        "index_versions_built": len(idx["history"]), "latest_index_version": index.version if index else None,
        "batches_produced": counts.get("produced", 0), "batches_trained": counts.get("trained", 0),
        "batches_committed_through_step": counts["committed_step"], "batches_pending": counts["pending"],
        "batches_dead_lettered": counts.get("dead_lettered", 0),
        "commit_conflicts": counts.get("commit_conflicts", 0),
        "redis_restarts": redis.restarts,
        "tokens_per_s": last.tokens_per_s if last else 0.0,
        "target_tokens_per_s": last.target_tokens_per_s if last else 0.0,
        "wait_share": last.wait_share if last else 0.0,
        "loss_first": first.loss if first else None,
        "loss_last": last.loss if last else None, "objective_losses_last": last.objectives if last else {},
        "beta": last.beta if last else None, "staleness_max": figures.staleness_max,
        "batch_crosslingual_share": bat["crosslingual_share"],
        "index_builds": idx["history"],
        "refresh": refresh.result(),
        "checkpoint": checkpoint, "snapshot": str(snap.path) if snap else None,
        "run_dir": str(paths.run_dir), "elapsed_s": round(time.time() - started, 1),
    }
