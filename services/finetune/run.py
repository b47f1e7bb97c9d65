"""Fine-tuning a pre-trained MARGE checkpoint on a generation or classification task (`marge finetune`).

    FinetuneConfig        what the command line sets, checked before anything loads
    load_start_model      the model to start from: a pre-training checkpoint, a fine-tuned model, or random
                          weights of the checkpoint's shape (the baseline)
    freeze                the paper's zero-shot transfer recipe: word embeddings and the first decoder layers
    ExampleOrder          which examples each update (and each DDP rank) takes: seeded epochs, no state
    Finetuning            one process's (one rank's) model, optimizer, schedule and loop: update, evaluate,
                          keep the best weights, stop early
    run_finetune          in this process (--workers 1) or as a Ray Train job of N DDP ranks; rank 0 writes
                          the model directory atomically

One update is the same function (`finetune_update`) in one process and on every DDP rank: each rank takes
`batch_size / workers` examples of the update's batch, DDP averages the gradients.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from marge.contracts.artifacts import atomic_directory
from marge.contracts.config import FieldError, at_least, positive
from marge.contracts.tasks import PAIR_INPUTS, TASKS, Example, label_counts, label_set, read_task_file
from marge.contracts.tokenizer import MargeTokenizer
from marge.model.finetuned import (
    FineTunedModel,
    MargeForClassification,
    TaskTensors,
    collate,
    encode_for,
    evaluate,
    label_config,
    labels_of,
    save_finetuned,
    task_loss,
)
from marge.model.network import Marge
from marge.model.optim import OptimizerConfig, build_optimizer, has_own_relevance_encoder, lr_factor
from marge.model.restore import load_model
from marge.util import loopback

log = logging.getLogger("marge.finetune")

METRICS = {"generation": ("chrf", "bleu", "loss"), "classification": ("accuracy", "macro_f1", "loss")}
"""Validation metrics each task can stop on; the first is the default. Lower is better only for loss."""


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig(OptimizerConfig):
    task: str
    train: str
    out: str
    valid: str | None = None
    """Validation file: evaluated every `eval_every` updates; the best evaluation's weights are the result."""
    checkpoint: str
    """A pre-training checkpoint (`marge pretrain`'s `checkpoint`) or a fine-tuned model directory."""
    random_init: bool = False
    """Start from random weights of the checkpoint's shape (the baseline), keeping its tokenizer."""
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 16
    """Examples per update, over all workers."""
    lr: float = 1e-4
    """Peak learning rate (the rest of the optimizer's settings: `OptimizerConfig`)."""
    warmup_steps: int | None = None
    """Linear warm-up, then linear decay to 0 at the last update (None: 6% of the updates)."""
    freeze_embeddings: bool = False
    freeze_decoder_layers: int = 0
    """Freeze the first N decoder layers (self-attention-only layers first)."""
    freeze_local_decoder_layers: bool = False
    """Freeze the decoder's self-attention-only layers, however many the model has. Paper §3, zero-shot
    transfer: "we freeze word embeddings and the first 4 decoder layers", which in the paper's model are its 4
    self-attention-only layers (`zero-shot` on the command line: this and the embeddings)."""
    eval_every: int | None = None
    """Evaluate on `valid` every this many updates (None: 10 times per run)."""
    metric: str | None = None
    """The validation metric for early stopping and best-model choice (default: chrf / accuracy)."""
    patience: int = 3
    """Stop after this many evaluations without improvement (0: never stop early)."""
    valid_limit: int | None = 64
    """Evaluate on at most this many validation examples (generation decodes each one; None: all)."""
    classifier_dropout: float = 0.1
    pair_input: str = "both"
    """How a classification pair is fed: 'both' (paper, BART) or 'split' (`marge.contracts.tasks.PAIR_INPUTS`)."""
    workers: int = 1
    """DDP ranks (Ray Train workers); more than 1 runs on Ray."""
    ray_address: str | None = None
    seed: int = 0
    torch_threads: int | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise FieldError("task", self.task, f"one of {list(TASKS)}")
        if (self.steps is None) == (self.epochs is None):
            raise FieldError("steps/epochs", (self.steps, self.epochs), "exactly one of --steps N or --epochs N")
        if self.steps is not None:
            positive(self, "steps")
        if self.epochs is not None:
            positive(self, "epochs")
        super().__post_init__()
        positive(self, "batch_size", "workers")
        at_least(self, "freeze_decoder_layers", 0)
        at_least(self, "patience", 0)
        at_least(self, "classifier_dropout", 0)
        if self.warmup_steps is not None:
            at_least(self, "warmup_steps", 0)
        for name in ("eval_every", "valid_limit", "torch_threads"):
            if getattr(self, name) is not None:
                positive(self, name)
        if self.batch_size % self.workers:
            raise FieldError("batch_size", self.batch_size, f"a multiple of --workers ({self.workers}): each rank "
                             "takes an equal share of every update")
        if self.pair_input not in PAIR_INPUTS:
            raise FieldError("pair_input", self.pair_input, f"one of {list(PAIR_INPUTS)}")
        if self.metric is not None and self.metric not in METRICS[self.task]:
            raise FieldError("metric", self.metric, f"one of {list(METRICS[self.task])} for {self.task}")

    @property
    def stop_metric(self) -> str:
        return self.metric or METRICS[self.task][0]

    def total_steps(self, num_examples: int) -> int:
        # exactly one of steps and epochs is set (__post_init__): epochs whenever steps is not
        return self.steps or max(1, math.ceil(cast(float, self.epochs) * num_examples / self.batch_size))


# ----------------------------------------------------------------------------------------------------
# The model to start from, and what stays frozen
# ----------------------------------------------------------------------------------------------------


def load_start_model(cfg: FinetuneConfig, labels: list[str] | None) -> tuple[Marge, MargeTokenizer, dict[str, Any]]:
    """(model, tokenizer, where it came from). A classifier gets a new head unless it continues a classifier
    fine-tuned on the same labels."""
    directory = Path(cfg.checkpoint)
    body = load_model(directory)  # verifies the manifest; a fine-tuned directory gives its MARGE model
    if not isinstance(body, Marge):
        raise ValueError(f"{directory} holds a {type(body).__name__} model: fine-tuning needs a MARGE-family "
                         "checkpoint (from the marge or bart objective)")
    tokenizer = MargeTokenizer.load(directory)
    origin = {"checkpoint": str(directory), "random_init": cfg.random_init}
    if cfg.random_init:
        torch.manual_seed(cfg.seed)
        body = Marge(body.cfg)
    if cfg.task == "generation":
        return body.train(), tokenizer, origin
    torch.manual_seed(cfg.seed + 1)
    if labels is None:
        raise ValueError("a classifier needs the training file's labels (label_set)")
    model = MargeForClassification(body.cfg, len(labels), cfg.classifier_dropout)
    missing, unexpected = model.load_state_dict(body.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("classifier.") for k in missing), (missing, unexpected)
    previous = previous_classifier(directory)
    if previous is not None and not cfg.random_init:
        if previous[0] == labels:
            model.classifier.load_state_dict(previous[1])
            origin["continued_classifier"] = True
        else:
            log.info("%s was fine-tuned on labels %s; starting a new classifier head for %s", directory, previous[0], labels)
    return model.train(), tokenizer, origin


def previous_classifier(directory: Path) -> tuple[list[str], dict[str, torch.Tensor]] | None:
    """The labels and head weights of a fine-tuned classifier directory (None for anything else)."""
    from safetensors.torch import load_file

    path = directory / "finetune_config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("task") != "classification":
        return None
    weights = load_file(str(directory / "model.safetensors"))
    return labels_of(config), {k[len("classifier."):]: v for k, v in weights.items() if k.startswith("classifier.")}


def refuse_classifier(checkpoint: str | None) -> None:
    """A fine-tuned classifier's decoder was trained to feed its head, not to write text: translating with it
    would print noise, so say which directory to use instead."""
    config = Path(checkpoint) / "finetune_config.json" if checkpoint else None
    if config is not None and config.is_file():
        task = json.loads(config.read_text(encoding="utf-8")).get("task")
        if task != "generation":
            raise ValueError(f"{checkpoint} is a model fine-tuned for {task}, which cannot translate: use a pre-training "
                             "checkpoint or a `marge finetune --task generation` directory (`marge eval finetuned` "
                             "evaluates this one)")


def freeze(model: Marge, embeddings: bool, decoder_layers: int) -> list[str]:
    """Stop gradients to the word embeddings and/or the first `decoder_layers` decoder layers (the paper's
    zero-shot transfer recipe: embeddings and 4 layers); returns the frozen parameters' names."""
    stack = [*model.decoder_local_layers, *model.decoder_layers]
    if decoder_layers > len(stack):
        raise FieldError("freeze_decoder_layers", decoder_layers,
                         f"at most the model's {len(stack)} decoder layers ({len(model.decoder_local_layers)} "
                         f"self-attention-only, then {len(model.decoder_layers)} with cross-attention)")
    frozen: list[nn.Module] = list(stack[:decoder_layers])
    if embeddings:
        frozen.append(model.embed_tokens)  # tied: also the output projection, as in the paper's recipe
        if model.encoder_embed_tokens is not None:
            frozen.append(model.encoder_embed_tokens)
    ids = {id(p) for module in frozen for p in module.parameters()}
    names = []
    for name, p in model.named_parameters():
        if id(p) in ids:
            p.requires_grad_(False)
            names.append(name)
    return names


# ----------------------------------------------------------------------------------------------------
# Which examples an update takes
# ----------------------------------------------------------------------------------------------------


class ExampleOrder:
    """Epoch after epoch, a seeded permutation of the training examples; update u takes positions
    u*B .. u*B + B - 1 of that stream and rank r the r-th equal share of them. A pure function of
    (seed, update, rank): nothing to save, the same on every rank."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = num_examples, batch_size, seed
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            self._epochs = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._epochs[epoch]

    def indices(self, update: int, rank: int = 0, world: int = 1) -> list[int]:
        share = self.batch_size // world
        start = update * self.batch_size + rank * share
        return [int(self._epoch(p // self.n)[p % self.n]) for p in range(start, start + share)]


def finetune_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, batch: TaskTensors,
                    clip_norm: float) -> float:
    """One optimizer update on one batch (this rank's share); returns its loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = task_loss(model, batch)
    loss.backward()
    if clip_norm:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip_norm)
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def better(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value < best if metric == "loss" else value > best


@dataclass
class Evaluation:
    step: int
    metrics: dict[str, float]


class Finetuning:
    """One process's part of a fine-tuning run (rank `rank` of `world`)."""

    def __init__(self, cfg: FinetuneConfig, rank: int = 0, world: int = 1, device: torch.device | None = None,
                 wrap=None):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = device or torch.device("cpu")
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.train_examples, self.valid_examples, self.labels = read_data(cfg)
        self.model, self.tokenizer, self.origin = load_start_model(cfg, self.labels)
        self.frozen = freeze(self.model, cfg.freeze_embeddings, max(
            cfg.freeze_decoder_layers, len(self.model.decoder_local_layers) if cfg.freeze_local_decoder_layers else 0))
        self.model.to(self.device)
        self.trained_model = wrap(self.model) if wrap else self.model  # DDP on Ray Train
        self.view = FineTunedModel(self.model, self.tokenizer, self.finetune_config(), self.device)
        self.train_encoded = encode_for(self.view, self.train_examples)
        self.valid_encoded = None if self.valid_examples is None else encode_for(self.view, self.valid_examples)
        self.total_steps = cfg.total_steps(len(self.train_examples))
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(0.06 * self.total_steps)
        self.optimizer = build_optimizer(self.model, cfg)  # the pre-training optimizer's groups, these settings
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, warmup, self.total_steps))
        self.order = ExampleOrder(len(self.train_encoded), cfg.batch_size, cfg.seed)
        self.eval_every = cfg.eval_every or max(1, self.total_steps // 10)
        self.evaluations: list[Evaluation] = []
        self.best: Evaluation | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.losses: list[tuple[int, float]] = []

    def finetune_config(self) -> dict[str, Any]:
        cfg = {"task": self.cfg.task, "classifier_dropout": self.cfg.classifier_dropout,
               "pair_input": self.cfg.pair_input, **self.origin,
               "frozen_parameters": len(getattr(self, "frozen", [])), "hyperparameters": asdict(self.cfg)}
        return {**cfg, **label_config(self.labels)} if self.labels else cfg

    # --- one update, one evaluation ---------------------------------------------------------------

    def update(self, step: int) -> float:
        batch = collate([self.train_encoded[i] for i in self.order.indices(step, self.rank, self.world)],
                        self.tokenizer.specials.pad_id).to(self.device)
        return finetune_update(self.trained_model, self.optimizer, self.scheduler, batch, self.cfg.clip_norm)

    @torch.no_grad()
    def validation_loss(self) -> float:
        self.model.eval()
        total, weight = 0.0, 0
        if self.valid_encoded is None:  # evaluations run only with a validation file
            raise ValueError("no validation examples to take the loss on (give --valid)")
        encoded = self.valid_encoded[: self.cfg.valid_limit]
        for start in range(0, len(encoded), 32):
            batch = collate(encoded[start:start + 32], self.tokenizer.specials.pad_id).to(self.device)
            w = int((batch.labels_NT != self.tokenizer.specials.pad_id).sum()) if batch.labels_NT is not None \
                else batch.num_rows
            total += float(task_loss(self.model, batch)) * w
            weight += w
        return total / max(1, weight)

    def evaluate(self, step: int) -> Evaluation:
        """Validation metrics (rank 0 only). Generation decodes greedily here (beam 1): the choice between
        evaluations needs a ranking, not the final score; `marge eval finetuned` uses the full beam."""
        if self.valid_examples is None:  # evaluations run only with a validation file
            raise ValueError("no validation examples to evaluate on (give --valid)")
        examples = self.valid_examples[: self.cfg.valid_limit]
        metrics = {k: v for k, v in evaluate(self.view, examples, num_beams=1).items()
                   if k in METRICS[self.cfg.task]}
        metrics["loss"] = self.validation_loss()
        evaluation = Evaluation(step, metrics)
        self.evaluations.append(evaluation)
        value = metrics[self.cfg.stop_metric]
        if better(self.cfg.stop_metric, value, None if self.best is None else self.best.metrics[self.cfg.stop_metric]):
            self.best = evaluation
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        log.info("update %d: validation %s", step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return evaluation

    def should_stop(self) -> bool:
        """`patience` evaluations in a row without a new best."""
        if not self.cfg.patience or self.best is None:
            return False
        return len(self.evaluations) - 1 - self.evaluations.index(self.best) >= self.cfg.patience

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to the last update or an early stop; every rank returns, rank 0 with the metrics."""
        start, step, stopped_early = time.time(), 0, False
        bar = progress_bar(self.total_steps, self.rank)
        while step < self.total_steps:
            loss = self.update(step)
            step += 1
            self.losses.append((step, loss))
            bar.update(loss)
            if self.valid_examples is not None and (step % self.eval_every == 0 or step == self.total_steps):
                stop = False
                if self.rank == 0:
                    evaluation = self.evaluate(step)
                    bar.note(evaluation.metrics, self.cfg.stop_metric)
                    stop = self.should_stop()
                if agree_to_stop(stop, self.device) and step < self.total_steps:
                    stopped_early = True
                    if self.best is not None:  # rank 0 evaluates; the other ranks follow its decision, knowing no best
                        log.info("stopping early at update %d: %d evaluations without a better %s than %.4f (update "
                                 "%d)", step, self.cfg.patience, self.cfg.stop_metric,
                                 self.best.metrics[self.cfg.stop_metric], self.best.step)
                    break
        bar.close()
        seconds = time.time() - start
        return {"task": self.cfg.task, "steps": step, "total_steps": self.total_steps, "stopped_early": stopped_early,
                "seconds": round(seconds, 2), "examples_per_s": round(step * self.cfg.batch_size / seconds, 2),
                "train_examples": len(self.train_examples), "train_loss_first": self.losses[0][1],
                "train_loss_last": float(np.mean([x for _, x in self.losses[-10:]])),
                "train_loss": [[s, round(x, 4)] for s, x in self.losses[:: max(1, len(self.losses) // 50)]],
                "metric": self.cfg.stop_metric,
                "best": None if self.best is None else {"step": self.best.step, **self.best.metrics},
                "evaluations": [{"step": e.step, **e.metrics} for e in self.evaluations],
                "frozen_parameters": self.frozen, "workers": self.world,
                **({"label_counts": label_counts(self.train_examples)} if self.labels else {})}

    def save(self, summary: dict[str, Any]) -> Path:
        """Rank 0: the best evaluation's weights (the last ones without validation), written atomically."""
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        with atomic_directory(Path(self.cfg.out), overwrite=self.cfg.overwrite) as tmp:
            save_finetuned(tmp, self.model, self.tokenizer, self.finetune_config(), summary)
        return Path(self.cfg.out)


def agree_to_stop(stop: bool, device: torch.device) -> bool:
    """Rank 0's decision, on every rank (a broadcast when DDP runs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return stop
    flag = torch.tensor([1 if stop else 0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class progress_bar:
    """A tqdm bar on rank 0 when stderr is a terminal; otherwise a log line every 10% of the run."""

    def __init__(self, total: int, rank: int):
        self.total, self.rank, self.done, self.loss = total, rank, 0, float("nan")
        self.bar = None
        if rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="fine-tuning", unit="update", dynamic_ncols=True)

    def update(self, loss: float) -> None:
        self.done += 1
        self.loss = loss if math.isnan(self.loss) else 0.9 * self.loss + 0.1 * loss
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{self.loss:.3f}", refresh=False)
        elif self.rank == 0 and (self.done % max(1, self.total // 10) == 0 or self.done == self.total):
            log.info("update %d/%d: training loss %.4f", self.done, self.total, self.loss)

    def note(self, metrics: dict[str, float], metric: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{self.loss:.3f}", **{metric: f"{metrics[metric]:.3f}"})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------
# Data, checked before anything starts
# ----------------------------------------------------------------------------------------------------


def read_data(cfg: FinetuneConfig) -> tuple[list[Example], list[Example] | None, list[str] | None]:
    """(training examples, validation examples, labels): every line checked against the checkpoint's tokenizer."""
    languages = MargeTokenizer.load(Path(cfg.checkpoint)).languages
    train = read_task_file(cfg.train, cfg.task, languages)
    labels = label_set(train) if cfg.task == "classification" else None
    valid = None if cfg.valid is None else read_task_file(cfg.valid, cfg.task, languages, labels)
    return train, valid, labels


def check_before_start(cfg: FinetuneConfig) -> None:
    """Everything that can fail in seconds: the output folder, the checkpoint, both data files."""
    if Path(cfg.out).exists() and not cfg.overwrite:
        raise FileExistsError(f"{cfg.out} already exists; choose another --out or pass --overwrite to replace it")
    from marge.model.checkpoint import CHECKPOINT_FORMAT, FINETUNED_FORMAT, read_manifest

    read_manifest(Path(cfg.checkpoint), formats=(CHECKPOINT_FORMAT, FINETUNED_FORMAT))
    read_data(cfg)


def finetune_in_process(cfg: FinetuneConfig) -> dict[str, Any]:
    run = Finetuning(cfg)
    summary = run.run()
    summary["out"] = str(run.save(summary))
    return summary


def finetune_worker(config: dict) -> None:
    """Ray Train's entry point on every DDP rank."""
    import ray.train
    import ray.train.torch

    from marge.util.files import setup_logging

    setup_logging()
    cfg: FinetuneConfig = config["cfg"]
    ctx = ray.train.get_context()
    torch.manual_seed(cfg.seed)
    def wrap(model):  # g's own encoder gets no gradient from a task that never computes f: DDP must not wait for it
        unused = {"find_unused_parameters": True} if has_own_relevance_encoder(model) else None
        return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=unused)

    run = Finetuning(cfg, ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(), wrap=wrap)
    summary = run.run()
    if run.rank == 0:
        summary["out"] = str(run.save(summary))
    ray.train.report({"done": 1})


@contextlib.contextmanager
def joined_ray(address: str):
    """A connection to a running cluster for the block; leaving it disconnects (the cluster keeps running)."""
    import ray

    from marge.util.local_ray import keeping_sigterm_handler

    with keeping_sigterm_handler():
        ray.init(address=address, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()


def finetune_on_ray(cfg: FinetuneConfig) -> dict[str, Any]:
    """N DDP ranks on Ray Train (the configured cluster, or a local Ray started and stopped here)."""
    from marge.util.local_ray import apply_local_ray_env, local_ray

    if not cfg.ray_address:
        apply_local_ray_env()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    storage = Path(cfg.out).absolute().parent / f".{Path(cfg.out).name}.ray"  # Ray Train's run folder, removed after
    cluster: contextlib.AbstractContextManager
    if ray.is_initialized():  # embedded in a program (or a test) that runs Ray
        cluster = contextlib.nullcontext()
    elif cfg.ray_address:
        cluster = joined_ray(cfg.ray_address)
    else:
        cluster = local_ray(max(os.cpu_count() or 1, cfg.workers), log_to_driver=True, setup_hook=loopback.SETUP_HOOK)
    try:
        with cluster:
            trainer = TorchTrainer(finetune_worker, train_loop_config={"cfg": cfg},
                                   scaling_config=ScalingConfig(num_workers=cfg.workers, resources_per_worker={"CPU": 1}),
                                   torch_config=TorchConfig(backend="gloo"),
                                   run_config=RunConfig(name="finetune", storage_path=str(storage)))
            trainer.fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    summary = json.loads((Path(cfg.out) / "metrics.json").read_text(encoding="utf-8"))
    return {**summary, "out": cfg.out}


def run_finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Check everything up front, fine-tune, write `cfg.out`; returns the run's summary (metrics.json)."""
    check_before_start(cfg)
    summary = finetune_in_process(cfg) if cfg.workers == 1 else finetune_on_ray(cfg)
    return summary

