"""How much of the learning recipe's update is real work, measured on a CPU: before and after, in one run.

On a GPU the recipe's update ran far below the bench step (docs/gpu.md). Most of the gap is visible without a GPU:
the FLOPs a padded batch executes against those `training_flops` credits, the host's preparation of a batch and how
much it slows the update's own host work when it runs beside it (the single process's and each rank's prefetch
thread), the aten operations that launch kernels, and the host-to-device copies that block. Batches are the
recipe's shape (benchmarks/recipe_batches.py: demo paragraph lengths, the project's greedy batcher, 16k tokens,
self-evidence and the denoising loss, as learning-gpu.yaml had them when the H200 probe ran), the model is
learning-gpu.yaml's of then (`base`, 4k vocabulary, 128 positions, g = 1 mean-pooled layer); updates are 2 batches
(learning-gpu.yaml's `grad_accum`). The attention census also runs the file's objectives and model as they are now.

* executed_over_credited_flops: FLOPs of the forward and backward of one update's batches (FlopCounterMode, on the
  meta device: shapes only) over `marge.model.sizes.training_flops` of the tokens they hold;
* prepare_ms_per_16k_batch: `Objectives.prepare` per batch, scaled to 16,384 budget tokens (median of 12);
  planner_ms_per_batch: the greedy batcher's time per batch it makes;
* prefetch_host_slowdown: host time of an update's forward and backward on the meta device (no arithmetic: the
  host's own work) while a thread prepares the next update's batches (as the trainer's prefetcher does), over
  without (median of 9 updates each); `_without_pause`: while a thread prepares batches without rest. The first
  cannot tell much: 2 batches of preparation beside a meta update several times as long move it by a few percent
  at most, however serialised the host is (`_serialised` below can fail);
* prefetch_host_slowdown_serialised: the update's host work (as above) beside the trainer's own prefetcher
  (`services.trainer.prefetch.Prefetcher`, started for the next update as the trainer starts it) whose
  preparation is sized to the H200's share of the update's host time (`PREPARE_OVER_UPDATE_HOST`: the next
  update's batches prepared as many times over as that needs here; the share reached:
  prefetch_preparation_over_update_host), over the update alone, timed in pairs up to the end of the preparation
  (`prefetch_slowdown`). It passes under `_threshold` (`serialised_threshold`: at most half of the preparation on
  the update's host time; a fully serialised host lands all of it, and the H200's never-pausing thread, 1.48, is
  above it). prefetch_preparation_on_update_path: the share of the preparation's seconds the update lost (0:
  overlapped, 1: serialised). What it cannot see: the update here is host work only; on a GPU, preparation that
  runs while the host waits for the device costs nothing, so this is the host-bound case (the recipe's update on
  shapes seen before was host-bound on the H200). Pinning (`pin_memory`) is not part of the preparation here;
* launch_ops_per_update: aten operations that compute (views and metadata excluded) in that forward and backward,
  gradients unset first as each update starts (the first batch's gradients are stolen, the second's added), with
  dropout counted as CUDA runs it (`dropout_as_on_cuda`: one fused kernel each way, not a CPU's 3 and 1);
  allocations (`empty`, `empty_like`) are no launch (`host_overhead.NO_KERNEL`);
* attention_shapes_50_batches: distinct attention signatures (`AttentionCalls`: the q, k and v shapes, a mask
  given, is_causal and dtype of every `F.scaled_dot_product_attention` and FlexAttention call) over the forwards
  and backwards of 50 recipe batches on the meta device, prepared as the trainer prepares them with
  learning-gpu.yaml's `trainer:` settings (`recipe_trainer`: `unpadded`, `key_bias`, the attention buckets
  `bucket_rows` and `bucket_width`, which follow that file) and its objectives and model; what cuDNN's SDPA
  builds a graph for. new_attention_shapes_per_update_after_20 (and `_max`): signatures first seen in each of
  updates 21 to 25; attention_calls_per_update; `attention_buckets`: the buckets used; the same keys
  `_probe_objectives`: with the objectives and model every other figure here uses; `_exact_blocks`: buckets 0
  (where the file sets some); `_bucketed`: buckets of BUCKETED (where it sets none).
  The meta device computes in fp32 (bf16 under the GPU's autocast, the same for every call: the count does not
  change); a backward's kernels run on its forward's shapes, so the forwards' signatures are the backwards' too;
* casts_per_update, launches_per_update_all, drains_before_optimizer_step: a real update on the CPU at d_model 64
  (`update_census`): dtype casts (`Casts`) in its forward and backward under bf16 autocast, emulated by the CPU's
  autocast (`torch.autocast("cpu", torch.bfloat16)`, what `Objectives.losses` enables on a CPU: the meta device
  has no autocast); every launch of an update: launch_ops_per_update plus the casts autocast adds
  (casts_per_update less casts_without_autocast_per_update) plus update_ops_outside_forward_backward (clipping, the
  figures' read, the fused AdamW step counted as its CPU aten operations, optimizer_step_ops: one `_fused_adamw_`
  and one `_foreach_add_` per parameter group, zero_grad); device reads before `optimizer.step` is entered
  (`DrainsBeforeStep`: `read_to_host`, `.item()` and the like), with `build_optimizer(..., fused=True)`. What the
  launch count cannot see: the meta device's SDPA is the math path (about 8 operations a call against 1 to 3 kernels of cuDNN or flash),
  multi-tensor kernels (fused AdamW, foreach clipping) launch once per chunk of tensors on CUDA, and memsets,
  allocations and a library's extra kernels (split-K matmuls, two-pass reductions) are no aten operation;
  `_bf16_params`: the same update with `trainer.bf16_params` (bf16 parameters, fp32 masters, no autocast): its
  casts, its operations outside the forward and backward (the gradients' and the weights' multi-tensor copies
  added), and its launches_per_update_all (launch_ops_per_update plus those casts, less the fp32 model's own);
* blocking_h2d_copies_per_update: host-to-device copies without `non_blocking` while an update moves its inputs,
  computes its losses and gathers its statistics (`update_statistics`), with the meta device as the device;
  pageable_h2d_copies_per_update: those copies (blocking or not) whose source is not pinned memory, the prepared
  batches pinned first as a rank's prefetcher pins them on a GPU (`pinning_emulated`, `PageableCopies`);
* decoder_run_over_real, denoising_views_run_over_real: positions the projections and feed-forward layers run on
  over the real tokens, of the decoder and of g over the denoising loss's views;
* distinct_shapes_50_batches: input shape signatures over 50 prepared batches: what a static compile would
  specialise on;
* compile_{eager,layers,model}: `trainer.compile` off, by layer and whole (`trainer.compile_scope`) over 50 recipe
  batches of 4,096 budget tokens on `base`'s layers at d_model 64 (the graphs depend on layers and shapes, not
  widths): first update, steady update, graphs compiled (recompilations included), graph breaks;
  compiled_graphs_50_batches (by layer), cold_compile_s_regional and cold_compile_s_whole (the first update's
  seconds over eager's).

"Before" is a given commit of this repository, exported with `git archive` and measured in a subprocess by this same
file; "after" is the working tree, padded (`trainer.unpadded: false`) and on real tokens only (`true`).

    python benchmarks/recipe_efficiency.py --before ced48d1 --out benchmarks/results/recipe-efficiency-cpu-2core.json
    python benchmarks/recipe_efficiency.py --smoke          # seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from host_overhead import REPO, SYNCHRONISING, Launches, exported, write_result
from torch.utils._python_dispatch import TorchDispatchMode

PER_UPDATE = 2
META = torch.device("meta")


def host_to_device(func, args, out) -> torch.Tensor | None:
    """The host tensor an `aten::_to_copy` or `aten::copy_` copies to a device (None: no such copy)."""
    name = func._schema.name
    if name not in ("aten::_to_copy", "aten::copy_"):
        return None
    source = args[1] if name == "aten::copy_" else args[0]
    target = args[0] if name == "aten::copy_" else out
    return source if source.device.type == "cpu" and target.device.type != "cpu" else None


class BlockingCopies(TorchDispatchMode):
    """Host-to-device copies that do not ask for `non_blocking`: on a GPU each waits for the stream's queued work."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if host_to_device(func, args, out) is not None:
            non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) \
                if func._schema.name == "aten::copy_" else kwargs.get("non_blocking", False)
            if not non_blocking:
                self.count += 1
        return out


@contextlib.contextmanager
def pinning_emulated():
    """`Tensor.pin_memory` where there is no accelerator (a CPU build refuses it): a copy whose storage is
    remembered as pinned. Yields the remembered storages' addresses, for `PageableCopies`."""
    pinned: set[int] = set()
    original = torch.Tensor.pin_memory

    def pin(self, *args, **kwargs):
        copy = self.clone()
        pinned.add(copy.untyped_storage().data_ptr())
        return copy

    torch.Tensor.pin_memory = pin  # type: ignore[method-assign]  # restored below: the census's stand-in
    try:
        yield pinned
    finally:
        torch.Tensor.pin_memory = original  # type: ignore[method-assign]


class PageableCopies(TorchDispatchMode):
    """Host-to-device copies from memory that was not pinned (`pinning_emulated`'s `pinned`): on a GPU such a copy
    is staged through a pinned buffer by the driver and holds the host until it is done, `non_blocking` or not."""

    def __init__(self, pinned: set[int]):
        super().__init__()
        self.pinned = pinned
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = host_to_device(func, args, out)
        if source is not None and source.numel() and source.untyped_storage().data_ptr() not in self.pinned:
            self.count += 1
        return out


# ----------------------------------------------------------------------------------------------------
# Counters: attention shapes, casts, device reads before the optimizer's step, prefetch overlap
# ----------------------------------------------------------------------------------------------------


class AttentionCalls:
    """Records every attention call while active: `F.scaled_dot_product_attention` (what `marge.model.layers` calls,
    looked up on `torch.nn.functional` at each call) and FlexAttention (`flex_attention`, imported at each call
    too), each as (kind, q, k and v shapes, a mask given, is_causal, dtype): what a kernel that plans per exact
    shape (cuDNN's SDPA) keys its plan on. Python-level, so it sees the meta device's calls as well (there SDPA
    decomposes into math operations that no dispatch mode would name). A backward runs each call's backward on the
    forward's shapes, so the forwards' signatures are the backwards' too."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __enter__(self) -> "AttentionCalls":
        import torch.nn.attention.flex_attention as flex_module
        import torch.nn.functional as F

        self._restore = [(F, "scaled_dot_product_attention", F.scaled_dot_product_attention),
                         (flex_module, "flex_attention", flex_module.flex_attention)]
        real_sdpa, real_flex = F.scaled_dot_product_attention, flex_module.flex_attention

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            self.calls.append(("sdpa", tuple(query.shape), tuple(key.shape), tuple(value.shape),
                               attn_mask is not None, bool(is_causal), str(query.dtype)))
            return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             **kwargs)

        def flex(query, key, value, score_mod=None, block_mask=None, *args, **kwargs):
            self.calls.append(("flex", tuple(query.shape), tuple(key.shape), tuple(value.shape),
                               block_mask is not None, False, str(query.dtype)))
            return real_flex(query, key, value, score_mod, block_mask, *args, **kwargs)

        F.scaled_dot_product_attention = sdpa
        flex_module.flex_attention = flex  # type: ignore[assignment]
        return self

    def __exit__(self, *exc) -> None:
        for module, name, real in self._restore:
            setattr(module, name, real)


@contextlib.contextmanager
def dropout_as_on_cuda():
    """`F.dropout` (what `nn.Dropout` calls) as CUDA runs it, while launches are counted: `native_dropout`, one fused
    kernel (and one in the backward), where a CPU or the meta device runs 3 (the mask's Bernoulli draw, its scaling,
    the product, after allocating the mask) and 1 in the backward. The draws differ from the CPU's: only counts are
    read under it."""
    original = torch.nn.functional.dropout

    def fused(input, p=0.5, training=True, inplace=False):
        return torch.native_dropout(input, p, training)[0] if training and p > 0 else input

    torch.nn.functional.dropout = fused
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


def new_shapes_per_update(updates: list[set]) -> list[int]:
    """How many attention signatures each update shows for the first time (in the order the updates ran)."""
    seen: set = set()
    new = []
    for signatures in updates:
        new.append(len(signatures - seen))
        seen |= signatures
    return new


class Casts(TorchDispatchMode):
    """dtype casts: `aten::_to_copy` to another dtype (what `.to(dtype)`, `.float()` and autocast's casts dispatch)
    and `aten::copy_` between tensors of different dtypes. Each is a kernel on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name == "aten::_to_copy" and isinstance(out, torch.Tensor) and out.dtype != args[0].dtype:
            self.count += 1
        elif name == "aten::copy_" and isinstance(args[1], torch.Tensor) and args[0].dtype != args[1].dtype:
            self.count += 1
        return out


class DrainsBeforeStep(TorchDispatchMode):
    """Device reads before `optimizer.step` is entered (a step pre-hook marks the moment): calls of
    `services.trainer.step.read_to_host` (the update's batched read; what it does inside is not counted again),
    scalar reads (`aten::_local_scalar_dense`: `.item()`, `float(t)`, `bool(t)`), value-sized operations
    (`nonzero`, `masked_select`, `unique`) and copies from a device to the host. Each makes the host wait until the
    device has run everything queued, so the GPU drains before the step is even launched. On a CPU a copy to the
    host copies nothing, but `read_to_host` is still counted: the benchmark and the tests see the GPU's order.

        with DrainsBeforeStep(optimizer) as drains:
            run_update(...)
        drains.reads  # what read the device before the step, in order ([] when nothing did)

    `after_step` counts the same after it. It wraps the module's `read_to_host` by name, so it measures any tree
    that has one (an older commit's too)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.reads: list[str] = []
        self.after_step = 0
        self.stepped = False
        self._reading = 0

    @property
    def before_step(self) -> int:
        return len(self.reads)

    def _note(self, what: str) -> None:
        if self.stepped:
            self.after_step += 1
        else:
            self.reads.append(what)

    def __enter__(self):
        from services.trainer import step as step_module

        self._step_module, self._original = step_module, getattr(step_module, "read_to_host", None)
        if self._original is not None:
            original = self._original

            def counted(*args, **kwargs):
                self._note("read_to_host")
                self._reading += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self._reading -= 1

            step_module.read_to_host = counted
        self._hook = self.optimizer.register_step_pre_hook(lambda *_: setattr(self, "stepped", True))
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        if self._original is not None:
            self._step_module.read_to_host = self._original
        return super().__exit__(*exc)

    @staticmethod
    def blocking_to_host(name: str, args, kwargs: dict, out) -> bool:
        """A copy from a device to the host that the host waits for (a `non_blocking` one returns at once)."""
        if name == "aten::_to_copy":
            source, non_blocking = args[0], kwargs.get("non_blocking", False)
        elif name == "aten::copy_":
            source, non_blocking = args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        else:
            return False
        return isinstance(out, torch.Tensor) and out.device.type == "cpu" and isinstance(source, torch.Tensor) \
            and source.device.type not in ("cpu", "meta") and not non_blocking

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._reading:
            name = func._schema.name
            if name in SYNCHRONISING or self.blocking_to_host(name, args, kwargs or {}, out):
                self._note(name)
        return out


PREPARE_OVER_UPDATE_HOST = 0.040 / 0.19
"""The sizes the prefetch proxy keeps (`prefetch_host_slowdown_serialised`): on one H200 an update of the recipe on
attention shapes seen before took about 0.19 s, all of it host-bound (docs/gpu.md), and preparing the next update's
2 batches took 24 to 40 ms of the host (benchmarks/results/gpu-probe-h200.json, `prepare_ms_unpadded`, per batch);
the larger share."""


def serialised_threshold(prepare_over_update: float) -> float:
    """The prefetch proxy's pass mark: no more than half of the preparation lands on the update's host time (a
    fully serialised host lands all of it: 1 + `prepare_over_update`)."""
    return 1 + prepare_over_update / 2


def prefetch_slowdown(update: Callable[[int], object], prepare: Callable[[int], object], updates: int) -> dict:
    """Host seconds of `update(u)` beside the trainer's prefetcher (`services.trainer.prefetch.Prefetcher`)
    preparing update u+1 as the trainer does (`start(u + 1)`, then the update; the next update's `take` waits for
    what is left of it), over the same update alone, timed in pairs, one after the other (a machine's changing load
    falls on both). The timed span runs to the end of the preparation: what cannot overlap the update's host work
    (it holds the GIL, or runs after it) is time the host spends before it can launch the next update. `slowdown`:
    the median of the pairs' ratios."""
    from services.trainer.prefetch import Prefetcher

    prefetcher = Prefetcher(prepare)
    update(0)  # warm-up
    beside, alone = [], []
    for u in range(updates):
        t0 = time.perf_counter()
        prefetcher.start(u + 1)
        update(u)
        prefetcher.take(u + 1)
        beside.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        update(u)
        alone.append(time.perf_counter() - t0)
    return {"alone_s": statistics.median(alone), "with_prefetcher_s": statistics.median(beside),
            "slowdown": statistics.median(b / a for b, a in zip(beside, alone))}


def recipe_config() -> dict:
    """learning-gpu.yaml as a mapping: the file beside the importable tree's code (this one's, or an exported
    commit's)."""
    import yaml

    from services.trainer import config as trainer_config

    path = Path(trainer_config.__file__).resolve().parents[2] / "deploy" / "configs" / "learning-gpu.yaml"
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def recipe_trainer():
    """learning-gpu.yaml's `trainer:` section as the importable tree's `TrainerConfig` (its `unpadded`, `key_bias`,
    `bf16` and attention layout where the tree has them)."""
    from marge.contracts.config import build
    from services.trainer.config import TrainerConfig

    return build(TrainerConfig, recipe_config()["trainer"], "trainer")


def objectives_settings(trainer) -> dict:
    """What `Objectives` takes from the trainer's settings, as the tree's trainer passes it: `unpadded` and the
    attention's layout (`services.trainer.inputs.AttentionLayout.of` the trainer: `trainer.bucket_rows`,
    `bucket_width`, ...) or, in a tree before that, its buckets, where the tree has them."""
    from services.trainer.objectives import Objectives

    params = inspect.signature(Objectives).parameters
    settings: dict = {}
    if "unpadded" in params:
        settings["unpadded"] = trainer.unpadded
    elif trainer.unpadded:
        raise SystemExit("this tree has no unpadded path")
    rows, width = getattr(trainer, "bucket_rows", 0), getattr(trainer, "bucket_width", 0)
    if "attention" in params:
        from services.trainer.inputs import AttentionLayout

        settings["attention"] = AttentionLayout.of(trainer)
    elif "buckets" in params:
        from services.trainer.inputs import AttentionBuckets

        settings["buckets"] = AttentionBuckets(rows, width)
    elif rows or width:
        raise SystemExit(f"trainer.bucket_rows={rows}, bucket_width={width}, but this tree's Objectives takes no "
                         "`buckets`: the census would count exact blocks; pass the buckets the way the trainer does")
    return settings


def objective(model, objectives, prepared, device):
    """`Objectives.losses` without autocast (the meta device has none): the weighted sum of the plugins' losses."""
    total, tokens = None, None
    for plugin in objectives.plugins:
        inputs = prepared.parts[plugin.name]
        if inputs is None:
            continue
        out = plugin.loss(model, inputs.to(device))  # a tuple in trees before the objective registry
        loss, predicted = (out.loss, out.predicted) if hasattr(out, "predicted") else out
        weighted = objectives.weights[plugin.name] * loss
        total = weighted if total is None else total + weighted
        if plugin.name == objectives.primary:
            tokens = predicted
    return total, tokens


def executed_and_credited(meta_model, objectives, update: list, pad_id: int) -> tuple[float, float]:
    """FLOPs of the forward and backward of an update's prepared batches on a model on the meta device (shapes only),
    and what `marge.model.sizes.training_flops` credits for the tokens they hold."""
    from torch.utils.flop_counter import FlopCounterMode

    from marge.model.sizes import training_flops

    with FlopCounterMode(display=False) as counter:
        for p in update:
            objective(meta_model, objectives, p, META)[0].backward()
    work = {"target": 0, "evidence": 0, "relevance": 0}
    for p in update:
        for key, value in (objectives.work(p) if hasattr(objectives, "work") else p.work(pad_id)).items():  # trees
            # before the objective registry counted on the prepared batch
            work[key] += value
    return counter.get_total_flops(), training_flops(meta_model.cfg, work["target"], work["evidence"], work["relevance"])


def recipe_setup(unpadded: bool, narrow: bool, count: int, max_tokens: int, trainer=None):
    """The recipe's special tokens, `count` recipe-shaped batches of `max_tokens`, its objectives (self-evidence and
    the denoising loss of learning-gpu.yaml; `unpadded` where the tree has it, or what `trainer`, a TrainerConfig,
    gives them: `objectives_settings`) and its model's config (`base`, 4k vocabulary, 128 positions, g = 1
    mean-pooled layer; `narrow`: d_model 64). For this tree or an exported one."""
    from recipe_batches import LANGUAGES, objectives_corpus, recipe_batches

    from marge.contracts.batch import SpecialTokens
    from marge.model.architecture import preset
    from services.trainer.objectives import (
        DenoisingContrastiveConfig,
        MargeObjectiveConfig,
        Objectives,
        ObjectivesConfig,
        SelfEvidenceConfig,
    )

    specials = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={lang: 4 + k for k, lang in enumerate(LANGUAGES)})
    made = recipe_batches(count, max_tokens=max_tokens)
    kwargs = {}
    if trainer is not None:
        kwargs = objectives_settings(trainer)
    elif "unpadded" in inspect.signature(Objectives).parameters:
        kwargs["unpadded"] = unpadded
    elif unpadded:
        raise SystemExit("this tree has no unpadded path")
    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                             self_evidence=SelfEvidenceConfig(prob=0.5, until=1500, deletion=0.3),
                                             denoising_contrastive=DenoisingContrastiveConfig(weight=0.3,
                                                                                              extra_documents=64)),
                            specials, **objectives_corpus(Objectives, made), **kwargs)
    cfg = preset("base", vocab_size=4000, max_positions=128, relevance_layers=1, relevance_pooling="mean",
                 relevance_centering=True, tie_encoder_embeddings=False,
                 **(dict(d_model=64, num_heads=4, encoder_ffn=128, decoder_local_ffn=128, decoder_ffn=128) if narrow
                    else {}))
    return specials, made, objectives, cfg


def attention_census(trainer, smoke: bool, configured: bool = True) -> dict:
    """Distinct attention signatures (`AttentionCalls`) over the forwards and backwards of 50 recipe batches (smoke:
    8 small ones), on the meta device (shapes only), prepared as the trainer prepares them: `trainer`'s unpadded
    path and attention layout, its key bias on the model, each batch keyed (seed, update, position in the update).
    `configured`: learning-gpu.yaml's objectives and model (at a 4k vocabulary; `narrow` widths for a smoke run);
    else this file's stand-ins (`recipe_setup`: the denoising loss, as the H200 probe trained). An update is
    `PER_UPDATE` of them in order; `new_..._after_20` counts the signatures each of the updates after the 20th
    (smoke: the 2nd) shows for the first time, mean and max."""
    from recipe_batches import objectives_corpus

    from marge.contracts.config import build
    from marge.model.architecture import preset
    from marge.model.sizes import build_on_meta
    from services.trainer.objectives import Objectives, ObjectivesConfig
    from services.trainer.step import apply_execution_settings

    specials, made, objectives, cfg = recipe_setup(trainer.unpadded, smoke, 8 if smoke else 50,
                                                   2048 if smoke else 16384, trainer)
    if configured:
        tree = recipe_config()
        objectives = Objectives(build(ObjectivesConfig, tree["objectives"], "objectives"), specials,
                                **objectives_corpus(Objectives, made), **objectives_settings(trainer))
        model_section = {key: value for key, value in tree["model"].items() if key != "preset"}
        cfg = preset(tree["model"].get("preset", "base"), **{**model_section, "vocab_size": 4000},
                     **(dict(d_model=64, num_heads=4, encoder_ffn=128, decoder_local_ffn=128, decoder_ffn=128)
                        if smoke else {}))
    model = apply_execution_settings(build_on_meta(cfg).train(), trainer)
    per_update: list[set] = []
    with AttentionCalls() as attention:
        for u in range(len(made.batches) // PER_UPDATE):
            start = len(attention.calls)
            for k in range(PER_UPDATE):
                prepared = objectives.prepare(made.batches[u * PER_UPDATE + k], (0, u, k))
                objective(model, objectives, prepared, META)[0].backward()
            per_update.append(set(attention.calls[start:]))
    new = new_shapes_per_update(per_update)[2 if smoke else 20:]
    return {"attention_shapes_50_batches": len(set().union(*per_update)),
            "new_attention_shapes_per_update_after_20": statistics.mean(new),
            "new_attention_shapes_per_update_after_20_max": max(new),
            "attention_calls_per_update": len(attention.calls) / len(per_update)}


def update_census(trainer, smoke: bool) -> dict:
    """A real update on the CPU (the tree's `train_step`, so its `run_update`; `trainer`'s settings, fused AdamW:
    `build_optimizer(..., fused=True)`), of 2 recipe batches of 4,096 budget tokens (smoke: 2,048) on `base`'s layers
    at d_model 64 (casts and operations depend on the layers, not the widths), after one update of warm-up (the
    optimizer's state made):

    * casts_per_update: `Casts` in the forward and backward of the update's batches under bf16 autocast
      (`Objectives.losses` with bf16 on the CPU: `torch.autocast("cpu", torch.bfloat16)`, which emulates the GPU's
      autocast; on the meta device autocast refuses to run), and without autocast (`casts_without_autocast`);
    * update_ops_outside_forward_backward: `Launches` of the whole update less those of its forward and backward:
      clipping, the figures' read, the optimizer's step, zero_grad; optimizer_step_ops: those of the step alone;
    * drains_before_optimizer_step: `DrainsBeforeStep` over the update (and after it)."""
    from in_process_update import update_fn

    from marge.model.network import Marge
    from services.trainer.step import apply_execution_settings, build_optimizer, build_scheduler

    _, made, objectives, cfg = recipe_setup(trainer.unpadded, True, PER_UPDATE, 2048 if smoke else COMPILE_TOKENS,
                                            trainer)
    torch.manual_seed(0)
    model = apply_execution_settings(Marge(cfg).train(), trainer)
    optimizer = build_optimizer(model, trainer, fused=True)
    bf16_params = getattr(trainer, "bf16_params", False)
    if bf16_params:
        from services.trainer.precision import bf16_parameters

        bf16_parameters(model, optimizer)
    scheduler = build_scheduler(optimizer, trainer, 1000)
    batches = made.batches[:PER_UPDATE]
    prepared = [objectives.prepare(b, (0, 10, k)) for k, b in enumerate(batches)]
    cpu = torch.device("cpu")

    def forward_backward(bf16: bool) -> None:
        model.zero_grad(set_to_none=True)  # as every update starts: the first batch's gradients are stolen, not added
        for p in prepared:
            (objectives.losses(model, p, cpu, bf16).objective / len(prepared)).backward()

    one_update = update_fn(model, optimizer, scheduler, objectives, trainer, cpu)

    def update() -> None:
        model.zero_grad(set_to_none=True)
        one_update(batches, 10, prepared)

    update()
    with Casts() as autocast_casts:  # bf16 compute: autocast, or bf16 parameters without it
        forward_backward(not bf16_params)
    with Casts() as plain_casts:
        forward_backward(False)
    with dropout_as_on_cuda(), Launches() as forward_backward_ops:
        forward_backward(trainer.bf16 and not bf16_params)
    with dropout_as_on_cuda(), Launches() as update_ops:
        update()
    forward_backward(trainer.bf16 and not bf16_params)
    with Launches() as step_ops:
        optimizer.step()
    with DrainsBeforeStep(optimizer) as drains:
        update()
    return {"casts_per_update": autocast_casts.count, "casts_without_autocast_per_update": plain_casts.count,
            "update_ops_outside_forward_backward": update_ops.count - forward_backward_ops.count,
            "optimizer_step_ops": step_ops.count, "drains_before_optimizer_step": drains.before_step,
            "drains_after_optimizer_step": drains.after_step}


def measure(unpadded: bool, smoke: bool, tolerant: bool = False) -> dict:
    """Every figure for the code importable here (this tree's, or the exported commit's). `tolerant` (an older
    commit): a figure whose code path that tree lacks is left out, and `omitted` says why."""
    import numpy as np

    from marge.model.sizes import build_on_meta
    from services.trainer.loop import update_statistics

    torch.set_num_threads(1)
    specials, made, objectives, cfg = recipe_setup(unpadded, smoke, 8 if smoke else 50, 2048 if smoke else 16384)
    batches = made.batches

    def prepare(k: int):
        return objectives.prepare(batches[k % len(batches)], (0, 10, k))

    out: dict = {"batches": len(batches), "planner_ms_per_batch": 1e3 * made.plan_seconds_per_batch}
    seconds = []
    for k in range(12 if not smoke else 2):
        t0 = time.perf_counter()
        prepare(k)
        seconds.append((time.perf_counter() - t0) * 16384 / batches[k].cost_tokens())
    out["prepare_ms_per_16k_batch"] = 1e3 * statistics.median(seconds)
    prepared = [prepare(k) for k in range(len(batches))]
    update = prepared[:PER_UPDATE]

    model = build_on_meta(cfg).train()
    executed, credited = executed_and_credited(model, objectives, update, specials.pad_id)
    out["executed_tflop_per_update"] = executed / 1e12
    out["credited_tflop_per_update"] = credited / 1e12
    out["executed_over_credited_flops"] = executed / credited
    marge = [p.parts["marge"] for p in update]
    real = lambda t: int((t != specials.pad_id).sum())  # noqa: E731

    def decoder_positions(m) -> int:  # what the decoder's projections and feed-forward layers run on
        return m.labels_NT.numel() if getattr(m, "layout", None) is None else real(m.labels_NT)
    out["decoder_run_over_real"] = sum(map(decoder_positions, marge)) / sum(real(m.labels_NT) for m in marge)

    model.zero_grad(set_to_none=True)  # as every update starts (the FLOP count above left gradients behind)
    with dropout_as_on_cuda(), Launches() as launches:
        for p in update:
            objective(model, objectives, p, META)[0].backward()
    out["launch_ops_per_update"] = launches.count

    with pinning_emulated() as pinned:
        update_pinned = [p.pin_memory() for p in update]  # as a rank's prefetcher pins on a GPU (rank.py)
    with BlockingCopies() as copies, PageableCopies(pinned) as pageable:
        losses, tokens, totals = [], [], []
        for p in update_pinned:
            total, predicted = objective(model, objectives, p, META)
            total.backward()
            losses.append({"marge": total.detach()})
            tokens.append(predicted)
            totals.append(total.detach())
        items = [SimpleNamespace(slot=k, batch=batches[k]) for k in range(PER_UPDATE)]
        done = SimpleNamespace(trained=[(k, batches[k].batch_id) for k in range(PER_UPDATE)], losses=losses,
                               target_tokens=tokens, objective=totals)
        update_statistics(items, done, ["marge"], META, lambda stats: None)
    out["blocking_h2d_copies_per_update"] = copies.count
    out["pageable_h2d_copies_per_update"] = pageable.count

    def host_seconds(updates: int) -> list[float]:
        times = []
        for u in range(updates):
            t0 = time.perf_counter()
            for p in prepared[(u * PER_UPDATE) % len(prepared):][:PER_UPDATE]:
                objective(model, objectives, p, META)[0].backward()
            times.append(time.perf_counter() - t0)
        return times

    updates = 3 if smoke else 9
    host_seconds(1)
    alone = statistics.median(host_seconds(updates))

    def beside(prefetcher) -> float:
        """Host seconds of an update while a thread runs `prefetcher(update, stop)`."""
        times = []
        for u in range(updates):
            stop = threading.Event()
            thread = threading.Thread(target=prefetcher, args=(u, stop), daemon=True)
            thread.start()
            times.extend(host_seconds(1))
            stop.set()
            thread.join()
        return statistics.median(times)

    def next_update(u, stop):  # what the trainer's prefetcher does: the next update's batches, then it waits
        for k in range(PER_UPDATE):
            prepare(100 + u * PER_UPDATE + k)

    def without_pause(u, stop):  # a thread that never rests: the worst case
        k = 0
        while not stop.is_set():
            prepare(200 + k)
            k += 1
    out["update_host_s_alone"] = alone
    out["update_host_s_with_prefetch"] = beside(next_update)
    out["prefetch_host_slowdown"] = out["update_host_s_with_prefetch"] / alone
    out["prefetch_host_slowdown_without_pause"] = beside(without_pause) / alone

    def serialised_proxy() -> dict:
        """The update's host work (as above) beside the trainer's prefetcher, its preparation sized to the H200's
        share of the update's host time (`PREPARE_OVER_UPDATE_HOST`): the next update's batches, prepared as many
        times over as that share needs on this machine."""
        one_prepare = []
        for r in range(3):
            t0 = time.perf_counter()
            for k in range(PER_UPDATE):
                prepare(300 + r * PER_UPDATE + k)
            one_prepare.append(time.perf_counter() - t0)
        prepare_s = statistics.median(one_prepare)
        repeat = max(1, round(PREPARE_OVER_UPDATE_HOST * alone / prepare_s))

        def next_update_sized(step: int) -> None:
            for r in range(repeat):
                for k in range(PER_UPDATE):
                    prepare(400 + (step * repeat + r) * PER_UPDATE + k)

        def one_update(u: int) -> None:
            for p in prepared[(u * PER_UPDATE) % len(prepared):][:PER_UPDATE]:
                objective(model, objectives, p, META)[0].backward()

        figures = prefetch_slowdown(one_update, next_update_sized, updates)
        share = repeat * prepare_s / figures["alone_s"]
        return {"prefetch_host_slowdown_serialised": figures["slowdown"],
                "prefetch_host_slowdown_serialised_threshold": serialised_threshold(share),
                "prefetch_preparation_over_update_host": share,
                "prefetch_preparation_on_update_path": (figures["with_prefetcher_s"] - figures["alone_s"])
                / (repeat * prepare_s)}

    def proxy(figures: Callable[[], dict]) -> None:
        try:
            out.update(figures())
        except Exception as e:  # noqa: BLE001 - an older tree without the code path: said in `omitted`
            if not tolerant:
                raise
            out.setdefault("omitted", {})[getattr(figures, "__name__", "figures")] = f"{type(e).__name__}: {e}"[:300]

    proxy(serialised_proxy)

    def signature(p) -> tuple:
        m = p.parts["marge"]
        views = p.parts.get("denoising_contrastive")
        return (tuple(m.evidence_MS.shape), tuple(m.target_enc_NS.shape), tuple(m.labels_NT.shape),
                None if views is None else (tuple(views["first"].shape), tuple(views["second"].shape)))
    out["distinct_shapes_50_batches"] = len({signature(p) for p in prepared[:50]})
    views = [p.parts["denoising_contrastive"] for p in prepared[:12]]
    out["denoising_views_run_over_real"] = 1.0 if "first_real" in views[0] else \
        float(np.mean([v["first"].numel() / real(v["first"]) for v in views]))

    def recipe_attention() -> dict:
        trainer = dataclasses.replace(recipe_trainer(), unpadded=unpadded)
        buckets = [getattr(trainer, "bucket_rows", 0), getattr(trainer, "bucket_width", 0)]
        figures: dict = {"attention_buckets": buckets}
        other, other_suffix = None, ""
        if unpadded and any(buckets):  # the exact blocks (buckets 0), beside
            other, other_suffix = dataclasses.replace(trainer, bucket_rows=0, bucket_width=0), "_exact_blocks"
        elif unpadded and hasattr(trainer, "bucket_rows"):  # the blocks bucketed, beside
            other, other_suffix = dataclasses.replace(trainer, bucket_rows=BUCKETED[0], bucket_width=BUCKETED[1]), \
                "_bucketed"
        for configured, suffix in ((True, ""), (False, "_probe_objectives")):
            figures.update({key + suffix: value for key, value in attention_census(trainer, smoke, configured).items()})
            if other is not None:
                figures.update({f"{key}{suffix}{other_suffix}": value
                                for key, value in attention_census(other, smoke, configured).items()})
        return figures

    def recipe_update() -> dict:
        trainer = dataclasses.replace(recipe_trainer(), unpadded=unpadded)
        figures = update_census(trainer, smoke)
        figures["launches_per_update_all"] = (out["launch_ops_per_update"] + figures["casts_per_update"]
                                              - figures["casts_without_autocast_per_update"]
                                              + figures["update_ops_outside_forward_backward"])
        if hasattr(trainer, "bf16_params"):  # bf16 parameters with fp32 masters, beside
            params = update_census(dataclasses.replace(trainer, bf16=True, bf16_params=True), smoke)
            figures.update({"casts_per_update_bf16_params": params["casts_per_update"],
                            "update_ops_outside_forward_backward_bf16_params":
                                params["update_ops_outside_forward_backward"],
                            "launches_per_update_all_bf16_params":
                                out["launch_ops_per_update"] + params["casts_per_update"]
                                - figures["casts_without_autocast_per_update"]
                                + params["update_ops_outside_forward_backward"]})
        return figures

    proxy(recipe_attention)
    proxy(recipe_update)
    return out


BUCKETED = (128, 32)
"""`trainer.bucket_rows`, `bucket_width` of the `_bucketed` census where learning-gpu.yaml sets none."""
COMPILE_TOKENS = 4096
"""Budget tokens of the compile part's batches: the graphs depend on the layers and the shapes' variety, not on the
widths or the batch size, so a narrow model (`base`'s layers, d_model 64) on small batches shows them in minutes."""


def measure_compile(scope: str, smoke: bool) -> dict:
    """`trainer.compile` over 50 recipe batches (25 updates, unpadded) in a fresh process: the first update's
    seconds (the cold compile, and one update), the median update after the first three, and what Dynamo counted:
    graphs compiled (a recompilation is one more), graph breaks. `scope`: eager (no compile), layers or model
    (`trainer.compile_scope`)."""
    from in_process_update import update_fn
    from torch._dynamo.utils import counters

    from marge.model.network import Marge
    from services.trainer.config import TrainerConfig
    from services.trainer.step import build_optimizer, build_scheduler, compiled

    torch.set_num_threads(1)
    _, made, objectives, cfg = recipe_setup(True, True, 8 if smoke else 50, 2048 if smoke else COMPILE_TOKENS)
    torch.manual_seed(0)
    model = Marge(cfg).train()
    trainer = TrainerConfig(lr=5e-4, warmup_steps=10, grad_accum=PER_UPDATE, num_workers=1,
                            compile=scope != "eager", compile_scope="layers" if scope == "eager" else scope)
    optimizer = build_optimizer(model, trainer)
    scheduler = build_scheduler(optimizer, trainer, 1000)
    trained = compiled(model, trainer.compile, trainer.compile_scope)
    prepared = [objectives.prepare(b, (0, 10, k % PER_UPDATE)) for k, b in enumerate(made.batches)]
    update = update_fn(trained, optimizer, scheduler, objectives, trainer, torch.device("cpu"))
    times = []
    for u in range(len(made.batches) // PER_UPDATE):
        window = slice(u * PER_UPDATE, (u + 1) * PER_UPDATE)
        t0 = time.perf_counter()
        update(made.batches[window], 10 + u, prepared[window])
        times.append(time.perf_counter() - t0)
    return {"batches": len(made.batches), "first_update_s": times[0], "steady_update_s": statistics.median(times[3:]),
            "compiled_graphs": counters["stats"].get("unique_graphs", 0),  # recompilations included
            "graph_breaks": sum(counters["graph_break"].values())}


def compile_arms(smoke: bool) -> dict:
    """measure_compile for eager, layers and model, each in its own process; the cold compile of a scope is its first
    update's seconds less eager's."""
    arms = {}
    for scope in ("eager", "layers", "model"):
        arms[scope] = run_in(REPO, f"measure_compile({scope!r}, {smoke})")
        print(json.dumps({f"compile_{scope}": arms[scope]}), flush=True)
    eager_first = arms["eager"]["first_update_s"]
    return {"compile_batches": f"{arms['eager']['batches']} recipe batches of {COMPILE_TOKENS} budget tokens, "
                               "base's layers at d_model 64, unpadded",
            **{f"compile_{scope}": figures for scope, figures in arms.items()},
            "compiled_graphs_50_batches": arms["layers"]["compiled_graphs"],
            "compiled_graphs_50_batches_whole": arms["model"]["compiled_graphs"],
            "cold_compile_s_regional": arms["layers"]["first_update_s"] - eager_first,
            "cold_compile_s_whole": arms["model"]["first_update_s"] - eager_first}


def run_in(tree: Path, call: str) -> dict:
    """`recipe_efficiency.<call>` in a fresh process importing `tree`'s code (this repository's, or an exported
    commit's): its JSON result."""
    code = (f"import sys, json; sys.path[:0] = [{str(tree / 'shared')!r}, {str(tree)!r}, {str(REPO / 'benchmarks')!r}]; "
            f"import recipe_efficiency; print(json.dumps(recipe_efficiency.{call}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{call} in {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=None, help="the commit to compare with (none: the working tree only)")
    p.add_argument("--smoke", action="store_true", help="tiny widths and few batches: checks that it runs")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-compile", action="store_true", help="without the compile part (eager, layers, model)")
    args = p.parse_args()
    arms = {}
    if args.before:
        arms["before"] = run_in(exported(args.before), f"measure(False, {args.smoke}, tolerant=True)")
        print(json.dumps({"before": arms["before"]}), flush=True)
    for name, unpadded in (("after_padded", False), ("after_unpadded", True)):
        arms[name] = run_in(REPO, f"measure({unpadded}, {args.smoke})")
        print(json.dumps({name: arms[name]}), flush=True)
    base, last = arms.get("before", arms["after_padded"]), arms["after_unpadded"]
    compile_figures = {} if args.no_compile else compile_arms(args.smoke)
    result = {"command": "python benchmarks/recipe_efficiency.py " + " ".join(sys.argv[1:]),
              "machine": "2-core CPU (FLOPs, operations, copies and shapes are the same on any machine; times are "
                         "this machine's)",
              "before_commit": args.before, "updates_of": f"{PER_UPDATE} batches of 16,384 budget tokens",
              **arms, **compile_figures,
              "before_over_after": {key: base[key] / last[key] for key in base
                                    if isinstance(base[key], (int, float)) and last.get(key)}}
    print(json.dumps(result["before_over_after"], indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
