"""The single-process training host (`marge pretrain --single-process`; `python -m experiments.learning
--single-process` runs it for the learning study): the pipeline's indexer, batcher and trainer cores in one process.

What runs is the code the Ray stages run, without the transport between them:

    indexer  publish_snapshot -> load_relevance_encoder -> build_version (index_shard with search="torch")
    batcher  epoch_batches over the newest committed index version (the paper's greedy subgraph search)
    trainer  the training loop (services.trainer.loop, the one the DDP ranks run): `trainer.num_workers *
             trainer.grad_accum` batches per update, batch k in slot k (the slot a DDP rank gives it), so the
             per-step losses equal the DDP trainer's on the same batches

and the differences one process implies, each on purpose:

* exact top-k neighbours as a torch matrix product on the run's device instead of FAISS (the same links up
  to the order of tied scores); index versions hold link graphs but no `.faiss` files, so `marge serve`
  cannot serve them (`marge report` and the batcher read them as usual);
* batches handed over in memory instead of a Redis stream;
* the index is rebuilt synchronously, at every `indexer.reindex_every` updates: the pipeline builds it beside
  training and its batches lag by up to a queue's depth, here the first batch after a rebuild comes from it.

It needs torch, numpy, pyarrow, sentencepiece, safetensors, PyYAML, scikit-learn and matplotlib, and no Ray,
Redis, FAISS or FastAPI.

A run folder is resumable: `--resume` continues it for `--minutes` more of training from its newest
checkpoint (same step count, same batch stream, curves and report extended; baselines measured once).

    DIR/
      config.yaml            the run's config (a resumed chunk uses it, not the command line)
      experiment.json        mode and one record per chunk (device, minutes, steps, tokens/s, MFU)
      baselines.json         random init by layer, TF-IDF, initial probe health (measured once)
      checkpoint_evals.jsonl held-out P@1 (every pair) + evidence gain at each checkpoint
      report.json, curves.png
      run/                   config.yaml, spec.json, init/, snapshots/, index/, checkpoints/step-N/, train_log.jsonl,
                             index_builds.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from marge.contracts.artifacts import atomic_directory
from marge.contracts.batch import Batch
from marge.contracts.config import ConfigError, resumable_keys
from marge.contracts.corpus import Corpus
from marge.contracts.index_store import IndexVersion, drop_versions_after, version_dirname
from marge.contracts.train_log import TrainLog, UpdateRecord
from marge.eval.evaluation import read_pairs
from marge.eval.refresh import INDEX_BUILDS
from marge.eval.tensorboard import RunBoard
from marge.model.checkpoint import checkpoint_order, complete_checkpoints, load_model_weights, save_checkpoint
from marge.model.lineage import newest_good_checkpoint
from marge.model.network import Marge
from marge.model.restore import restore_training
from marge.model.snapshot import (
    SnapshotInfo,
    drop_snapshots_after,
    load_relevance_encoder,
    publish_snapshot,
    read_snapshot,
    snapshot_dirname,
)
from marge.util.files import atomic_write_text
from services.batcher.core import DocumentStore
from services.batcher.schedule import RunSchedule, wait_for_version
from services.driver.config import PipelineConfig, config_drift, load_config, with_absolute_paths
from services.driver.learning_report import (
    FinalModel,
    RunAccount,
    assemble_report,
    checkpoint_evaluation,
    heldout_pairs_path,
    measure_baselines,
)
from services.driver.lock import SINGLE_PROCESS, DriverLock
from services.driver.pipeline import final_g_health, open_corpus, with_probes
from services.driver.progress import setup_phase
from services.driver.spec import RunSpec, compile_spec
from services.indexer.core import build_version, describe_build, index_shard, prune_unneeded_snapshots
from services.trainer.health import HealthMonitor, loggable
from services.trainer.init import ensure_initial_model
from services.trainer.inputs import AttentionLayout, untrainable
from services.trainer.loop import TrainingLoop, UpdateInput, UpdateMeter
from services.trainer.objectives import PreparedBatch, objectives_for
from services.trainer.precision import bf16_parameters
from services.trainer.prefetch import Prefetcher
from services.trainer.step import (
    Item,
    Trainee,
    compile_cache_env,
    compiled,
    device_peak_flops,
    seed_key,
    training_parts,
)

log = logging.getLogger("marge.single_process")

EXPERIMENT_FILE = "experiment.json"
RESUMABLE_OVERRIDES = set(resumable_keys(PipelineConfig, comparable=True))
"""What a resumed chunk may change: the settings marked comparable (`marge.contracts.config.resumable`), which extend the run
or report more or less often. (With trainer.total_steps unset the schedule anneals to run.max_steps, so extending
the run stretches the rest of the schedule.)"""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA device here; use --device cpu")
    return device


# ----------------------------------------------------------------------------------------------------
# The batcher core: the pipeline's schedule, prefetched in a thread
# ----------------------------------------------------------------------------------------------------


@dataclass
class StepInput:
    step: int
    batches: list[Batch]
    prepared: list[PreparedBatch | None]
    """None where the batch cannot be trained."""
    problems: list[str | None]
    """Why each batch cannot be trained (`untrainable`), or None."""


class ScheduleReader:
    """Draws each update's batches from the batch schedule, in order, checks that the model can take each one
    (`check`: `untrainable`) and prepares those it can: what the prefetch thread (services.trainer.prefetch) runs
    while the device trains the update before, so that neither is on the update's critical path.

    The schedule (services.batcher.schedule) is the pipeline batcher's: slot n holds the same batch here as in
    the pipeline's Redis streams, given the same index versions. When the schedule needs an index version that is
    not built yet, the thread waits for the main thread to build it.
    """

    def __init__(self, schedule: RunSchedule, start_step: int, prepare, pin: bool,
                 check: Callable[[Batch], str | None]):
        self.slots = schedule.slots
        self.batches = schedule.batches(start_step * self.slots.per_step)
        self.prepare, self.pin, self.check = prepare, pin, check

    def read(self, step: int) -> StepInput | None:
        batches: list[Batch] = []
        for expected in range(step * self.slots.per_step, (step + 1) * self.slots.per_step):
            slot, batch = next(self.batches, (None, None))
            if slot is None:
                return None  # stopped while waiting for an index version
            if slot != expected:
                raise RuntimeError(f"the batch schedule gave slot {slot} where slot {expected} was due")
            if batch is None:  # the schedule gives a slot with its batch
                raise RuntimeError(f"the batch schedule gave slot {slot} without its batch")
            batches.append(batch)
        problems = [self.check(b) for b in batches]
        prepared = [None if problem else self.prepare(b, step, k)
                    for k, (b, problem) in enumerate(zip(batches, problems))]
        if self.pin:
            prepared = [p.pin_memory() if p is not None else None for p in prepared]
        return StepInput(step, batches, prepared, problems)


# ----------------------------------------------------------------------------------------------------
# The indexer core in this process
# ----------------------------------------------------------------------------------------------------


class InProcessIndexer:
    """Publishes the relevance encoder as a snapshot and indexes every shard with it, exactly searched by torch."""

    def __init__(self, spec: RunSpec, corpus: Corpus, device: torch.device):
        self.cfg, self.corpus, self.device = spec.config, corpus, device
        self.run_dir = spec.paths.run_dir
        self.root = spec.paths.index
        self.tokenizer_sha256 = corpus.tokenizer().sha256
        self.builds_log = self.run_dir / INDEX_BUILDS
        self.board = RunBoard(self.run_dir, "index", self.cfg.run.tensorboard)

    def index_snapshot(self, snapshot: SnapshotInfo, version: int) -> IndexVersion:
        encoder = load_relevance_encoder(snapshot, self.device)
        specials = self.corpus.tokenizer().specials

        def index_shards(shards: list[int], staging: Path) -> list[dict]:
            return [index_shard(self.corpus.read_shard(s), encoder, specials, staging, self.cfg.indexer,
                                device=str(self.device), seed=self.cfg.run.seed + s, search="torch",
                                snapshot_step=snapshot.step).as_manifest_entry() for s in shards]

        committed, record = build_version(self.root, self.run_dir, version, snapshot.step, self.corpus.num_shards,
                                          self.cfg.indexer, index_shards, extra={"search": "torch-exact"},
                                          seed=self.cfg.run.seed)
        log.info("index v%d from snapshot %d: %s", version, snapshot.step, describe_build(record))
        self.board.index_build(record)
        self.board.flush()
        return committed

    def history(self) -> list[dict]:
        if not self.builds_log.exists():
            return []
        return [json.loads(line) for line in self.builds_log.read_text(encoding="utf-8").splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------


def checkpoint_root(cfg: PipelineConfig) -> Path:
    return Path(cfg.run.dir) / "checkpoints"


class SingleProcessRun:
    """One resumable single-process learning experiment in `out_dir` (see the module docstring)."""

    def __init__(self, out_dir: Path, cfg: PipelineConfig, device: torch.device, resume: bool):
        self.out_dir = Path(out_dir).resolve()
        self.device, self.resume = device, resume
        self.corpus = open_corpus(cfg)
        self.tokenizer = self.corpus.tokenizer()
        self.spec = spec = compile_spec(with_probes(cfg, self.corpus), self.tokenizer.vocab_size)
        self.cfg = cfg = spec.config
        self.paths = spec.paths
        spec.write()
        self.pairs = read_pairs(heldout_pairs_path(cfg), self.tokenizer.languages)
        with setup_phase(log, "initial model") as notes:
            ensure_initial_model(spec.model, self.paths, self.corpus, cfg.run.seed)
            notes.append(f"{self.paths.init_weights.name} and the step-0 snapshot in {self.paths.run_dir}")
        # retrieval and evidence probes of g and the decoder: for the MARGE model (a BART run's too), not VECO's
        self.monitor = HealthMonitor(cfg.health, cfg.data.heldout_pairs, self.tokenizer, seed=cfg.run.seed) \
            if cfg.objectives.model_family == "marge" else None
        self.probe = self.monitor.probe if self.monitor else None
        self.indexer = InProcessIndexer(spec, self.corpus, device)
        self.docs = DocumentStore(self.corpus, cfg.batcher.shard_cache_mb)
        self.slots = spec.slots
        self.plan = spec.version_plan
        self.stop_waiting = threading.Event()
        self.schedule = RunSchedule(self.docs, cfg.batcher, cfg.run.seed, self.slots, self.plan,
                                    lambda v: wait_for_version(self.paths.index, v, self.stop_waiting),
                                    spec.batch_shape, self.paths.batch_counts)
        self.train_log = TrainLog(self.paths.train_log)
        self.evals_log = self.out_dir / "checkpoint_evals.jsonl"

    # --- set-up -------------------------------------------------------------------------------------

    def baselines(self) -> dict:
        path = self.out_dir / "baselines.json"
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
        with setup_phase(log, f"baselines on {len(self.pairs)} held-out pairs (random init, TF-IDF)"):
            init_model = load_model_weights(self.paths.init_weights).to(self.device).eval()
            baselines = measure_baselines(init_model, self.tokenizer, self.pairs, self.probe, self.device,
                                          aligned=self.monitor.aligned if self.monitor else None)
        atomic_write_text(path, json.dumps(baselines, indent=2) + "\n")
        return baselines

    def build_training_state(self):
        cfg = self.cfg
        with setup_phase(log, f"model and optimizer on {device_name(self.device)}") as notes:
            model, optimizer, scheduler = training_parts(
                load_model_weights(self.paths.init_weights).to(self.device).train(), cfg.trainer, cfg.objectives,
                cfg.run.max_steps)
            notes.append(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        state: dict[str, Any] = {"step": 0, "tokens_seen": 0, "target_tokens_seen": 0, "train_seconds": 0.0}
        checkpoint = newest_good_checkpoint(checkpoint_root(cfg)) if self.resume else None
        if checkpoint is not None:
            saved = restore_training(checkpoint, model, optimizer, scheduler, self.device)
            state = {k: saved[k] for k in state}
            log.info("resumed at step %d from %s", state["step"], checkpoint)
        elif self.resume:
            log.info("%s has no checkpoint yet: starting it at step 0", self.out_dir)
        if cfg.trainer.bf16_params:  # after the restore, which wrote the fp32 parameters (the masters)
            bf16_parameters(model, optimizer)
        self._forget_after(state["step"])
        if self.cfg.objectives.needs_index:
            self._build_missing_versions(state["step"])
        return model, optimizer, scheduler, state

    def _forget_after(self, step: int) -> None:
        """A chunk that died after its last checkpoint left log lines, evaluations, snapshots and index versions
        from updates the checkpoint does not hold: drop them, so that the resumed run writes them once."""
        def keep_lines(path: Path, keep) -> None:
            if path.exists():
                lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
                atomic_write_text(path, "".join(line + "\n" for line in lines if keep(json.loads(line))))

        self.train_log.truncate_after(step)
        keep_lines(self.evals_log, lambda record: record["step"] <= step)
        keep_lines(self.indexer.builds_log, lambda record: record["snapshot_step"] <= step)
        drop_snapshots_after(self.paths.snapshots, max(step, 0))
        drop_versions_after(self.paths.index, step)

    def _build_missing_versions(self, step: int) -> None:
        """Index versions the next updates need that are not on disk (dropped, pruned, or never built because
        the chunk died first), built from their snapshots."""
        needed = range(self.plan.version_for_step(step), self.plan.newest_version_at(step) + 1)
        for version in needed:
            if not (self.paths.index / version_dirname(version) / "manifest.json").exists():
                snapshot = read_snapshot(self.paths.snapshots / snapshot_dirname(self.plan.snapshot_step(version)))
                with setup_phase(log, f"index v{version} from snapshot {snapshot.step} "
                                      f"({self.corpus.manifest['num_documents']} documents)") as notes:
                    self.indexer.index_snapshot(snapshot, version)
                    build = self.indexer.history()[-1]
                    notes.append(f"{build['docs_per_s']:.0f} docs/s")

    # --- the loop -----------------------------------------------------------------------------------

    def train(self, minutes: float | None) -> dict:
        """Train for `minutes` (None: no limit) or to run.max_steps, then checkpoint: one chunk of the run."""
        cfg, device, t = self.cfg, self.device, self.cfg.trainer
        model, optimizer, scheduler, state = self.build_training_state()
        objectives = objectives_for(cfg.objectives, self.tokenizer, t.unpadded, AttentionLayout.of(t))

        def prepare(batch: Batch, step: int, position: int) -> PreparedBatch:
            return objectives.prepare(batch, seed_key(cfg.run.seed, self.slots, step * self.slots.per_step + position))

        def check(batch: Batch) -> str | None:
            return untrainable(batch, self.tokenizer.specials, model.cfg.vocab_size, model.cfg.max_positions)

        step = state["step"]
        board = RunBoard(cfg.run.dir, "trainer", cfg.run.tensorboard)
        prefetcher: Prefetcher[StepInput | None] = Prefetcher(
            ScheduleReader(self.schedule, step, prepare, pin=device.type == "cuda", check=check).read)
        prefetcher.start(step)
        host = InProcessHost(self, model, optimizer, scheduler, state, prefetcher, minutes)
        # what the updates run is the model under torch.compile (trainer.compile); probes and snapshots use the model
        if t.compile:
            compile_cache_env(Path(cfg.run.dir))
        trainee = Trainee(model, compiled(model, t.compile, t.compile_scope, dynamic=t.compile_dynamic), optimizer,
                          scheduler, objectives, t, device, slots=self.slots, seed=cfg.run.seed,
                          max_steps=cfg.run.max_steps)
        meter = UpdateMeter(model.cfg, device_peak_flops(device))
        log.info("training on %s %s from step %d (%d batches per update, bf16 %s%s)", device,
                 f"for {minutes:.1f} min" if minutes is not None else f"to update {cfg.run.max_steps}", step,
                 self.slots.per_step, t.bf16, " parameters" if t.bf16_params else "")
        try:
            step = TrainingLoop(trainee, host, self.train_log, board, meter).run(step)
        finally:
            self.stop_waiting.set()  # a prefetch waiting for an index version this chunk will not build
            prefetcher.close()
            self.stop_waiting.clear()
            board.close()
            self.indexer.board.flush()
        state["train_seconds"] += host.elapsed()
        last = complete_checkpoints(checkpoint_root(cfg))
        if not last or checkpoint_order(last[-1])[0] != step:  # the resume point of the next chunk
            self.checkpoint(model, optimizer, scheduler, step, state, 0.0)
        rates = meter.rates()
        return {"steps": step, "chunk_steps": meter.updates, "chunk_seconds": round(host.elapsed(), 1),
                "tokens_per_s": rates["tokens_per_s"], "target_tokens_per_s": rates["target_tokens_per_s"],
                "mfu": rates.get("mfu"), "train_seconds": state["train_seconds"], "model": model}

    def snapshot_and_reindex(self, model: Marge, step: int) -> dict:
        """Measure retrieval health (a MARGE model); with an index, publish g and, at a multiple of
        `indexer.reindex_every`, build the version the schedule gives that snapshot (its batches are trained
        `batcher.index_lag` updates later, as in the pipeline)."""
        health = {}
        if self.monitor is not None:
            health = self.monitor.measure(model, self.device)
            model.train()
            log.info("health at step %d: %s", step, loggable(health))
        if self.cfg.objectives.needs_index:
            snapshot = publish_snapshot(self.paths.snapshots, model, step, self.tokenizer.sha256)
            if self.plan.builds_at(step):
                self.indexer.index_snapshot(snapshot, self.plan.newest_version_at(step))
                if self.cfg.indexer.keep_snapshots:
                    prune_unneeded_snapshots(self.paths, self.plan, checkpoint_root(self.cfg),
                                             self.cfg.indexer.keep_snapshots)
        return health

    def checkpoint(self, model: Marge, optimizer, scheduler, step: int, state: dict, chunk_seconds: float) -> Path:
        """The whole training state as a pipeline-format checkpoint, then its held-out evaluation. Checkpoints
        beyond `trainer.keep_checkpoints` go."""
        # train_seconds counts the chunks before this one plus this chunk so far
        saved_state = {**state, "step": step, "train_seconds": state["train_seconds"] + chunk_seconds}
        target = checkpoint_root(self.cfg) / f"step-{step:08d}"
        with atomic_directory(target, overwrite=True) as tmp:
            save_checkpoint(tmp, model, optimizer, scheduler, step, self.corpus.root, saved_state)
        model.eval()  # no dropout in the held-out figures
        point = checkpoint_evaluation(model, self.tokenizer, self.pairs, self.cfg.health.eval_layer, self.probe,
                                      step, self.device)
        model.train()
        with open(self.evals_log, "a", encoding="utf-8") as f:
            f.write(json.dumps(point) + "\n")
        for old in complete_checkpoints(checkpoint_root(self.cfg))[:-max(1, self.cfg.trainer.keep_checkpoints)]:
            shutil.rmtree(old)
        return target

    # --- the report ---------------------------------------------------------------------------------

    def report(self, baselines: dict, chunk: dict, minutes_total: float, started: float, experiment: dict) -> dict:
        cfg = self.cfg
        over_time = ([json.loads(line) for line in self.evals_log.read_text(encoding="utf-8").splitlines() if line.strip()]
                     if self.evals_log.exists() else [])
        records = self.train_log.read()
        final_model = chunk["model"].eval()
        checkpoints = complete_checkpoints(checkpoint_root(cfg))
        pipeline = {"steps": chunk["steps"], "mode": "single-process", "device": device_name(self.device),
                    "tokens_per_s": chunk["tokens_per_s"], "target_tokens_per_s": chunk["target_tokens_per_s"],
                    "mfu": chunk["mfu"], "last_chunk_steps": chunk["chunk_steps"],
                    "last_chunk_seconds": chunk["chunk_seconds"], "train_seconds": round(chunk["train_seconds"], 1),
                    "loss_first": records[0].loss if records else None,
                    "loss_last": records[-1].loss if records else None,
                    "beta": records[-1].beta if records else None,
                    "index_versions": sorted({v for r in records for v in r.index_versions})}
        g = final_g_health(cfg, self.paths, self.corpus) if cfg.objectives.model_family == "marge" else None
        final = FinalModel(final_model, self.tokenizer, self.pairs, cfg.health.eval_layer, self.device)
        run = RunAccount(records, str(checkpoints[-1]) if checkpoints else None, self.indexer.history(), pipeline,
                         minutes_total, time.time() - started)
        return assemble_report(baselines, over_time, final, run, cfg, self.out_dir,
                               extra={"mode": "single-process", "device": device_name(self.device),
                                      "chunks": experiment["chunks"], "g_health": g})


class InProcessHost:
    """The training loop's host in this process (services.trainer.loop): every slot of an update from the
    prefetcher, until the chunk's minutes are up; snapshots build the index in line; checkpoints are folders in
    the run, each evaluated on the held-out pairs."""

    writes_log = True

    def __init__(self, run: SingleProcessRun, model: Marge, optimizer, scheduler, state: dict, prefetcher: Prefetcher,
                 minutes: float | None):
        self.run, self.model, self.optimizer, self.scheduler = run, model, optimizer, scheduler
        self.state, self.prefetcher, self.minutes = state, prefetcher, minutes
        self.started = time.perf_counter()
        self.deadline = self.started + 60 * minutes if minutes is not None else math.inf
        self.next_progress = self.started + run.cfg.run.progress_every_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def next_update(self, step: int) -> UpdateInput | None:
        if time.perf_counter() >= self.deadline:
            return None
        item = self.prefetcher.take(step)
        if item is None or item.step != step:
            raise RuntimeError(f"prefetched batches are for update {item and item.step}, not {step}")
        self.prefetcher.start(step + 1)  # drawn and prepared while this update trains
        base = step * self.run.slots.per_step
        return UpdateInput([Item(base + k, batch, problem, prepared, checked=True)  # checked in the prefetch thread
                            for k, (batch, problem, prepared) in enumerate(zip(item.batches, item.problems,
                                                                              item.prepared))])

    def gather(self, part: list) -> list[list]:
        return [part]

    def reduce(self, values: torch.Tensor) -> None:
        pass

    def after_update(self, step: int, update: UpdateInput, done, record: UpdateRecord) -> None:
        self.state["tokens_seen"] += record.tokens
        self.state["target_tokens_seen"] += record.target_tokens

    def snapshot(self, step: int) -> dict:
        if not (self.run.cfg.objectives.needs_index or self.run.monitor):
            return {}
        return self.run.snapshot_and_reindex(self.model, step)

    def logged(self, record: UpdateRecord) -> None:
        if time.perf_counter() < self.next_progress:
            return
        log.info("step %d | loss %.3f %s| %.0f tok/s (%.0f target)%s%s%s | %.1f%s min",
                 record.step, record.loss, record.objectives if len(record.objectives) > 1 else "",
                 record.tokens_per_s, record.target_tokens_per_s,
                 f" | MFU {100 * record.mfu:.1f}%" if record.mfu is not None else "",
                 f" | beta {float(np.mean(record.beta)):.3f}" if record.beta else "",
                 f" | index v{','.join(map(str, record.index_versions))}" if record.index_versions else "",
                 self.elapsed() / 60, f"/{self.minutes:.1f}" if self.minutes is not None else "")
        self.next_progress = time.perf_counter() + self.run.cfg.run.progress_every_s

    def checkpoint(self, step: int) -> None:
        self.run.checkpoint(self.model, self.optimizer, self.scheduler, step, self.state, self.elapsed())


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {torch.get_num_threads()} threads"


def run_single_process(config: Path | None, overrides: list[str], minutes: float, out_dir: Path, resume: bool = False,
                       device: str = "auto") -> dict:
    """One chunk of a single-process learning experiment: a fresh run, or `resume` of the one in `out_dir`."""
    out_dir = Path(out_dir).resolve()
    meta_path = out_dir / EXPERIMENT_FILE
    if resume:  # `--resume` of a run stopped before its first checkpoint starts it again at step 0
        if not meta_path.exists():
            raise FileNotFoundError(f"{out_dir} holds no single-process experiment ({EXPERIMENT_FILE} is missing); "
                                    "start one without --resume")
        changed = sorted({o.split("=", 1)[0].strip() for o in overrides} - RESUMABLE_OVERRIDES)
        if config is not None or changed:
            raise ValueError(f"--resume continues the run with its own config ({out_dir / 'config.yaml'}): drop "
                             f"{'--config' if config is not None else ''}{' and ' if config is not None and changed else ''}"
                             f"{', '.join(changed)} (only {', '.join(sorted(RESUMABLE_OVERRIDES))} may change), "
                             "or start a new run in another --out")
        cfg = load_config(out_dir / "config.yaml", overrides)
    else:
        if meta_path.exists() or (out_dir / "run").exists():
            raise FileExistsError(f"{out_dir} already holds a run: pass --resume to continue it, or choose another --out")
        cfg = load_config(config or Path("deploy/configs/learning.yaml"), overrides)
        cfg = with_absolute_paths(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(out_dir / "run"),
                                                                                      max_minutes=0.0)))
    return train_chunk(cfg, out_dir, resume, minutes, device)


def pretrain_single_process(cfg: PipelineConfig, device: str = "auto", reuse_folder: bool = False) -> dict:
    """`marge pretrain --single-process`: the run in `run.dir` itself (its experiment files beside the run's),
    trained to `run.max_steps` (or for `run.max_minutes`, when set), started or, when `run.dir` already holds a
    single-process run, resumed from its newest checkpoint with the settings it was trained with (`config.RESUMABLE`
    says what may change). A folder a pipeline run wrote is refused (`services.driver.lock`), unless `reuse_folder`
    and that run never trained. Returns the report."""
    out_dir = Path(cfg.run.dir).resolve()
    cfg = with_absolute_paths(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(out_dir))))
    with DriverLock(out_dir, SINGLE_PROCESS, reuse_folder):
        resume = (out_dir / EXPERIMENT_FILE).exists()
        if resume:
            saved = yaml.safe_load((out_dir / "config.yaml").read_text(encoding="utf-8"))
            drift = config_drift(saved, cfg.to_saved_dict())
            if drift:
                raise ConfigError(f"{out_dir} holds a single-process run trained with other settings: "
                                  + "; ".join(drift) + ". Put them back, or start a new run (another run.dir)")
        elif (out_dir / "train_log.jsonl").exists() or (out_dir / "checkpoints").exists():
            raise ConfigError(f"run.dir {out_dir} holds a pipeline run (`marge pretrain` without --single-process): "
                              "resume it the way it was started, or choose another run.dir")
        minutes = cfg.run.max_minutes or None
        return train_chunk(cfg, out_dir, resume, minutes, device)


def train_chunk(cfg: PipelineConfig, out_dir: Path, resume: bool, minutes: float | None, device: str) -> dict:
    """Train the single-process run whose experiment files are in `out_dir` (its run in `cfg.run.dir`) for
    `minutes` (None: to run.max_steps) from its newest checkpoint (`resume`) or from step 0, and report."""
    started = time.time()
    meta_path = out_dir / EXPERIMENT_FILE
    experiment: dict[str, Any] = (json.loads(meta_path.read_text(encoding="utf-8")) if resume
                                  else {"mode": "single-process", "chunks": []})
    if resume:
        atomic_write_text(out_dir / "config.yaml", yaml.safe_dump(cfg.to_saved_dict(), sort_keys=False))
    torch_device = resolve_device(device)
    if torch_device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 parts outside bf16 autocast (loss, norms)
        torch.backends.cudnn.allow_tf32 = True
    if cfg.health.pairs or cfg.data.heldout_pairs:
        heldout_pairs_path(cfg)  # a pairs file named but missing: fail before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    if not resume:  # the config every later chunk resumes with (and `marge report` reads in the run)
        for path in dict.fromkeys((out_dir / "config.yaml", Path(cfg.run.dir) / "config.yaml")):
            atomic_write_text(path, yaml.safe_dump(cfg.to_saved_dict(), sort_keys=False))
        atomic_write_text(meta_path, json.dumps(experiment, indent=2) + "\n")
    run = SingleProcessRun(out_dir, cfg, torch_device, resume)
    baselines = run.baselines()
    chunk = run.train(minutes)
    experiment["chunks"].append({"device": device_name(torch_device),
                                 "minutes": minutes if minutes is not None else round(chunk["chunk_seconds"] / 60, 2),
                                 "steps": chunk["steps"],
                                 "chunk_steps": chunk["chunk_steps"], "seconds": chunk["chunk_seconds"],
                                 "tokens_per_s": round(chunk["tokens_per_s"], 1), "mfu": chunk["mfu"],
                                 "finished_unix": time.time()})
    atomic_write_text(meta_path, json.dumps(experiment, indent=2) + "\n")
    minutes_total = sum(c["minutes"] for c in experiment["chunks"])
    return run.report(baselines, chunk, minutes_total, started, experiment)


def trained_minutes(out_dir: Path) -> float:
    """Minutes of training the single-process run in `out_dir` has done in finished chunks (0: none)."""
    meta = Path(out_dir) / EXPERIMENT_FILE
    if not meta.exists():
        return 0.0
    return sum(c["minutes"] for c in json.loads(meta.read_text(encoding="utf-8"))["chunks"])


def train_for_minutes(config: Path | None, overrides: list[str], minutes: float, out_dir: Path, device: str = "auto",
                      label: str | None = None) -> dict:
    """A single-process run in `out_dir` trained for `minutes` in all: started, continued for what is missing
    (`--resume`), or kept when it has them (its report returned). What the multi-run experiments build on."""
    out_dir = Path(out_dir)
    report_path = out_dir / "report.json"
    done = trained_minutes(out_dir)
    if (out_dir / EXPERIMENT_FILE).exists():
        if done >= minutes - 1e-6 and report_path.exists():
            log.info("%s: already trained for %.1f min, kept", label or out_dir, done)
            return json.loads(report_path.read_text(encoding="utf-8"))
        return run_single_process(None, [], minutes - done, out_dir, resume=True, device=device)
    return run_single_process(config, overrides, minutes, out_dir, device=device)
