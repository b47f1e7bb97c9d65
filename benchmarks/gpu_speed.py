"""What a user pays for on one GPU, in under 9 minutes: the recipe's update on attention shapes seen and never seen
before, the bench step at 128 to 512 targets eager and compiled with static shapes, the `paper` step, and the DDP
wrapper on the device.

    python benchmarks/gpu_speed.py --out "$OUT"                          # one GPU: every arm
    python benchmarks/gpu_speed.py --out "$OUT" --arms recipe_default --bucket-rows 64 --bucket-width 32
    python benchmarks/gpu_speed.py --out smoke-out --smoke               # a CPU, tiny widths: checks that it runs

Needs only torch and numpy (no prepared corpus, Ray, FAISS or Redis). Every arm runs in a fresh process (no arm
inherits another's cuDNN graphs, compiled kernels or allocator), time-boxed (`--budget-s` for all, a box for each;
an arm the time left cannot cover is skipped), and appends one JSON line to OUT/gpu-speed.jsonl as it ends, so a
run cut short keeps the arms that finished. After every arm OUT/gpu-speed-<device>-<date>.json is written again
(<device> from `torch.cuda.get_device_name`, e.g. h200; <date> the machine's), with:

  device, torch                  the card's name and torch's version
  recipe_update_s_seen           recipe_default: median seconds of an update on batches (so attention shapes) the
                                 process trained on before
  recipe_update_s_never_seen     recipe_default: median seconds of an update on batches never seen (each used once)
  bench_target_tokens_per_s      bench_eager_128: its best round's target tokens/s
  recipe_over_bench_never_seen   the recipe's seconds per target token on never-seen batches (their seconds over
                                 their target tokens) over the bench step's (1 / bench_target_tokens_per_s); the
                                 same for every recipe arm in recipe_over_bench_never_seen_by_variant
  recipe_compiled_over_bench_compiled_never_seen
                                 the same ratio for recipe_compiled over bench_compiled_128 (both compiled by layer)
  base_mfu_bf16, paper_mfu_bf16  the best MFU of the bench_* arms and of the paper_* arms
  ddp_2_ranks_passed             the DDP arm's verdict
  recipe_by_variant              each recipe arm's seen and never-seen seconds and attention shapes
  arms, command                  every arm's record, and the command line

The arms, in the order they run:

  checks                         what a CPU cannot check, on the device: the packed cross-attention's and
                                 FlexAttention's key bias's loss and every gradient against the gathered, folded
                                 path's (a recipe-shaped batch, `tiny` in fp32; as tests/unit/test_unpadded.py
                                 compares them), the bucketed block's, the fused optimizer skipping a non-finite
                                 update on the device, and no read of the device before the optimizer steps
  bench_eager_{128,256,512}      benchmarks/trainer_vs_hf_bart.py's `base` step (`OurStep`: the batch's preparation,
                                 forward, backward, optimizer step; 0 local decoder layers, dropout 0) in bf16 at that
                                 many targets x 128 tokens: target tokens/s (best round; every round listed) and MFU
                                 (`marge.model.sizes.training_flops_per_token` x tokens/s over
                                 `services.trainer.step.device_peak_flops`, as benchmarks/gpu_path.py)
  recipe_{default,exact_shapes,packed_cross,cudnn_on,exact_cudnn_off,compiled,bf16_params}
                                 the learning recipe's update as benchmarks/gpu_probe.py sets it up (learning-gpu.yaml's
                                 model at `base` without g's own encoder, self-evidence and the denoising loss, 2
                                 recipe-shaped batches of <= 16,384 tokens an update, bf16, `trainer.unpadded`) by
                                 `train_step`: 4 warm-up updates on the first 8 batches, the same 4 twice more (seen),
                                 then 16 on fresh batches (never seen). Per update: seconds, target tokens, and the
                                 attention signatures new to the process (benchmarks/recipe_efficiency.py's
                                 `AttentionCalls`: what cuDNN's SDPA builds a graph for). `default`: TrainerConfig's
                                 defaults (`trainer.cudnn_attention` off: flash and memory-efficient kernels, which
                                 build nothing per shape) with buckets of --bucket-rows and --bucket-width
                                 (BUCKET_ROWS, BUCKET_WIDTH); `cudnn_on`: those with cuDNN's SDPA; `exact_shapes`: no
                                 buckets, cuDNN's SDPA on; `exact_cudnn_off`: no buckets; `packed_cross`: `default`
                                 with `trainer.cross_attention: packed` (FlexAttention over the packed evidence,
                                 compiled; a GPU only: a smoke run prepares its batches and trains nothing);
                                 `compiled`: `exact_cudnn_off` with `trainer.compile` (each layer, dynamic shapes,
                                 from an empty compile cache: the warm-up updates hold the cold compile). Each
                                 record states its settings (`trainer`, `cudnn_sdp`).
  paper_{4,16,24}                the `paper` preset's step (966M, 250k vocabulary; trainer_vs_hf_bart.py's `paper`
                                 shape) at 4, 16 and 24 targets x 512 tokens a micro-batch, bf16: seconds a step, MFU
  ddp_2_ranks                    2 ranks on the one device (gloo on CUDA tensors: NCCL refuses two ranks on one GPU)
                                 train a `tiny` model through the trainer's own DDP wrapping (`ddp_settings`) and update
                                 (`run_update`, 2 micro-batches: `maybe_no_sync`), 3 updates, each rank from its own
                                 initial weights and on its own batches: passes when both ranks' parameters are
                                 bitwise equal afterwards and moved from the start
  bench_compiled_{128,512,1024}  the bench step, each layer and the loss head compiled with static shapes (`dynamic=False`) from an empty
                                 compile cache: first step (the cold compile), tokens/s, MFU, graphs compiled
  bench_compiled_chunked_512     bench_compiled_512 with the fused linear + NLL (`trainer.loss_chunk_tokens`
                                 CHUNKED_LOSS_ROWS): no step holds the [rows x vocabulary] fp32 logits
  bench_compiled_eagerhead_512   bench_compiled_512 with the loss head eager (what `trainer.compile` compiled before
                                 it compiled the loss head too)
  paper_compiled_{16,24}         paper_16 and paper_24 with each layer (and the loss head) compiled with static shapes,
                                 from an empty compile cache
  recipe_bf16_params             recipe_exact_cudnn_off with `trainer.bf16_params` (bf16 parameters, fp32 masters in
                                 the optimizer, no autocast: no cast of a weight, its gradient or an activation)
  bench_params_512, bench_compiled_params_512, paper_params_16
                                 bench_eager_512, bench_compiled_512 and paper_16 with bf16 parameters

The recipe and step arms on CUDA count the launches of one more update or step, on shapes seen before, under
torch.profiler (`kernel_launches_per_update`, `kernel_launches_per_step`: the CUDA runtime's and driver's launch calls,
LAUNCH_CALLS; the kernels' device milliseconds and the 15 largest kernels). Every record on CUDA (the DDP arm's: each rank's) has the peak memory allocated and reserved, the allocator's
retries (`num_alloc_retries`) and its device allocations (`num_device_alloc`: cudaMalloc calls). A smoke run uses `aot_eager` for the compiled arms
(the tracing, not a CPU's minutes of Inductor code generation), fewer layers and steps, and no MFU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO), str(REPO / "benchmarks")]

from recipe_batches import LANGUAGES, recipe_batches  # noqa: E402
from recipe_efficiency import AttentionCalls, DrainsBeforeStep, new_shapes_per_update  # noqa: E402
from trainer_vs_hf_bart import SPECIALS as BENCH_SPECIALS  # noqa: E402
from trainer_vs_hf_bart import OurStep, Shape, shape, synthetic_batch, time_steps  # noqa: E402

from marge.contracts.batch import SpecialTokens  # noqa: E402
from marge.contracts.slots import Slots  # noqa: E402
from marge.model.architecture import preset  # noqa: E402
from marge.model.network import Marge  # noqa: E402
from marge.model.sizes import training_flops_per_token  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.objectives import (  # noqa: E402
    DenoisingContrastiveConfig,
    MargeObjectiveConfig,
    Objectives,
    ObjectivesConfig,
    SelfEvidenceConfig,
    apply_objective_settings,
)
from services.trainer.precision import bf16_parameters  # noqa: E402
from services.trainer.step import (  # noqa: E402
    Item,
    Trainee,
    apply_execution_settings,
    build_optimizer,
    build_scheduler,
    compiled,
    ddp_settings,
    device_peak_flops,
    run_update,
    train_step,
)

BUCKET_ROWS = 128
"""`trainer.bucket_rows` of the recipe arms that bucket (--bucket-rows): learning-gpu.yaml's."""
BUCKET_WIDTH = 32
"""`trainer.bucket_width` of the recipe arms that bucket (--bucket-width): learning-gpu.yaml's."""
BUDGET_S = 480
"""Wall seconds for every arm together (the parent's own start and summary add a few)."""
PER_UPDATE = 2  # learning-gpu.yaml's grad_accum
SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={lang: 4 + k for k, lang in enumerate(LANGUAGES)})
SMOKE_WIDTHS = dict(d_model=64, num_heads=4, encoder_ffn=128, decoder_local_ffn=128, decoder_ffn=128, vocab_size=4000,
                    encoder_layers=2, relevance_layers=1, decoder_layers=2)
"""A smoke run's model: every code path of the arm's, at a CPU's speed."""
SMOKE_BOX_FACTOR = 3  # a CPU, maybe shared, takes longer than a GPU to start an arm and run it
SMOKE_BUDGET_S = 1200
SMOKE_TARGETS_DIVISOR = 16  # bench_eager_512 runs 32 targets on a CPU
JSONL = "gpu-speed.jsonl"


@dataclass(frozen=True)
class Arm:
    name: str
    box_s: float  # at most this many wall seconds, its process's start included
    min_s: float  # skipped when less time than this is left


ARMS = (
    Arm("checks", 90, 30),
    Arm("bench_eager_128", 45, 25),
    Arm("recipe_default", 75, 35),
    Arm("recipe_exact_shapes", 75, 35),
    Arm("recipe_packed_cross", 150, 40),
    Arm("recipe_cudnn_on", 75, 35),
    Arm("recipe_exact_cudnn_off", 75, 35),
    Arm("bench_eager_512", 50, 25),
    Arm("recipe_bf16_params", 75, 35),
    Arm("bench_params_512", 50, 25),
    Arm("paper_4", 60, 30),
    Arm("paper_16", 60, 30),
    Arm("ddp_2_ranks", 60, 25),
    Arm("bench_eager_256", 45, 25),
    Arm("bench_compiled_128", 170, 60),
    Arm("bench_compiled_512", 170, 60),
    Arm("bench_compiled_chunked_512", 170, 60),
    Arm("bench_compiled_eagerhead_512", 170, 60),
    Arm("bench_compiled_1024", 170, 60),
    Arm("paper_24", 70, 30),
    Arm("paper_compiled_16", 200, 90),
    Arm("paper_compiled_24", 200, 90),
    Arm("bench_compiled_params_512", 170, 60),
    Arm("paper_params_16", 60, 30),
    Arm("recipe_compiled", 200, 90),
)
ARM_NAMES = tuple(a.name for a in ARMS)
RECIPE_VARIANTS = ("default", "exact_shapes", "packed_cross", "cudnn_on", "exact_cudnn_off", "compiled",
                   "bf16_params")
STEP_WAYS = ("eager", "compiled", "chunked", "eagerhead", "params")
"""How a step arm's name may say it runs: bench_compiled_eagerhead_512 = base, 512 targets, its layers compiled and
its loss head (`projected_nll`) not."""
CHUNKED_LOSS_ROWS = 8192
"""`trainer.loss_chunk_tokens` of the `chunked` step arms: the fused linear + NLL over 8,192 rows at a time (a
1 GB fp32 chunk of logits at `base`'s 32,000 words, where the unchunked loss holds every row's)."""


@dataclass(frozen=True)
class Sizes:
    """How much each arm runs: a GPU's figures, or a CPU's seconds-long smoke run."""

    recipe_max_tokens: int
    recipe_warm_updates: int  # also the updates of one seen round
    recipe_seen_rounds: int
    recipe_never_seen_updates: int
    bench_warm: int
    bench_rounds: int
    bench_steps: int
    paper_warm: int
    paper_rounds: int
    paper_steps: int


GPU_SIZES = Sizes(16384, 4, 2, 16, 3, 3, 8, 2, 2, 4)
SMOKE_SIZES = Sizes(1024, 1, 1, 2, 1, 1, 2, 1, 1, 1)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu-speed.jsonl and the summary")
    p.add_argument("--compare", nargs=3, metavar=("RESULT", "BASE_ARM", "OTHER_ARM"), default=None,
                   help="no GPU: OTHER_ARM's never-seen and seen update seconds over BASE_ARM's in a results file, "
                        "paired update by update (the same batches), with a 95%% bootstrap interval")
    p.add_argument("--smoke", action="store_true", help="on the CPU at tiny widths, few steps: checks that it runs")
    p.add_argument("--arms", nargs="+", default=list(ARM_NAMES), choices=ARM_NAMES, help="run only these arms")
    p.add_argument("--bucket-rows", type=int, default=BUCKET_ROWS, help="trainer.bucket_rows of the recipe arms")
    p.add_argument("--bucket-width", type=int, default=BUCKET_WIDTH, help="trainer.bucket_width of the recipe arms")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall seconds for all the arms together (default {BUDGET_S}; {SMOKE_BUDGET_S} with --smoke)")
    p.add_argument("--arm", default=None, choices=ARM_NAMES, help=argparse.SUPPRESS)  # one arm, in its own process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # the arm's time.time() limit
    return p.parse_args(argv)


# --- what every arm shares -----------------------------------------------------------------------------------


def device_of(args: argparse.Namespace) -> torch.device:
    if args.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False): run benchmarks/gpu_speed.py on "
                           "a GPU machine, or with --smoke on a CPU")
    return torch.device("cuda", 0)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device: torch.device) -> dict:
    """The allocator's peaks and counts since the process started (each arm is a process of its own)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / 2**30,
            "peak_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0)}


def emit(out: Path, record: dict) -> None:
    """One arm's record: printed, and appended to OUT/gpu-speed.jsonl at once (a later kill keeps it)."""
    line = json.dumps(record, default=float)
    print(line, flush=True)
    with open(out / JSONL, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def mfu(s: Shape, target_tokens_per_s: float, device: torch.device) -> float | None:
    """As benchmarks/gpu_path.py: model FLOPs per target token x target tokens/s over the device's bf16 peak."""
    peak = device_peak_flops(device)
    flops = training_flops_per_token(s.model, (s.evidence_tokens + 2) / (s.target_tokens + 1))
    return flops * target_tokens_per_s / peak if peak else None


# --- the recipe's update -------------------------------------------------------------------------------------


def recipe_model_config(smoke: bool):
    """learning-gpu.yaml's model as benchmarks/gpu_probe.py builds it (so its figures compare with the probe's)."""
    recipe = dict(vocab_size=32000, max_positions=128, relevance_layers=1, relevance_pooling="mean",
                  relevance_centering=True, tie_encoder_embeddings=False)
    return preset("base", **(dict(recipe, **SMOKE_WIDTHS, decoder_local_layers=1) if smoke else recipe))


def recipe_trainer(variant: str, bucket_rows: int, bucket_width: int, smoke: bool) -> TrainerConfig:
    """The trainer's execution settings (`default`: unpadded, cuDNN's SDPA off, attention buckets of --bucket-rows
    and --bucket-width), or those with one or two things changed (`cudnn_on`; `exact_shapes`: no buckets, cuDNN's
    SDPA on; `exact_cudnn_off`: no buckets; `packed_cross`; `compiled`: no buckets, each layer compiled with
    dynamic shapes, what `trainer.compile: true` trains with the GPU configs' attention settings)."""
    trainer = TrainerConfig(lr=5e-4, warmup_steps=500, bf16=not smoke, grad_accum=PER_UPDATE, num_workers=1,
                            unpadded=True, bucket_rows=bucket_rows, bucket_width=bucket_width)
    if variant in ("cudnn_on", "exact_shapes"):
        trainer = dataclasses.replace(trainer, cudnn_attention=True)
    if variant in ("exact_shapes", "exact_cudnn_off"):
        return dataclasses.replace(trainer, bucket_rows=0, bucket_width=0)
    if variant == "compiled":
        return dataclasses.replace(trainer, bucket_rows=0, bucket_width=0, compile=True, compile_scope="layers")
    if variant == "packed_cross":
        return dataclasses.replace(trainer, cross_attention="packed")
    if variant == "bf16_params":  # bf16 on a smoke run too: the path is what it checks
        return dataclasses.replace(trainer, bucket_rows=0, bucket_width=0, bf16=True, bf16_params=True)
    return trainer


def recipe_objectives(trainer: TrainerConfig) -> Objectives:
    """gpu_probe.py's objectives (MARGE over linked evidence, self-evidence, the denoising loss), their attention
    blocks laid out as the trainer says (`AttentionLayout.of`: buckets, packed cross-attention)."""
    from services.trainer.inputs import AttentionLayout

    return Objectives(ObjectivesConfig(
        marge=MargeObjectiveConfig(attend_to="linked"),
        self_evidence=SelfEvidenceConfig(prob=0.5, until=1500, deletion=0.3),
        denoising_contrastive=DenoisingContrastiveConfig(weight=0.3, extra_documents=64)),
        SPECIALS, unpadded=trainer.unpadded, attention=AttentionLayout.of(trainer))


def execution(trainer: TrainerConfig) -> dict:
    """The trainer's settings that change how the update computes, as the record states them."""
    names = ("unpadded", "key_bias", "bf16", "bf16_params", "bucket_rows", "bucket_width", "cross_attention", "cudnn_attention",
             "compile", "loss_chunk_tokens")
    return {name: getattr(trainer, name) for name in names if hasattr(trainer, name)}


def recipe_arm(args: argparse.Namespace, variant: str, device: torch.device, deadline: float) -> dict:
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    trainer = recipe_trainer(variant, args.bucket_rows, args.bucket_width, args.smoke)
    warm_batches = sizes.recipe_warm_updates * PER_UPDATE
    wanted = warm_batches + sizes.recipe_never_seen_updates * PER_UPDATE
    made = recipe_batches(wanted, max_tokens=sizes.recipe_max_tokens)
    if len(made.batches) < wanted:
        raise RuntimeError(f"recipe_batches made {len(made.batches)} batches of the {wanted} asked for "
                           f"(max_tokens {sizes.recipe_max_tokens}): lower recipe_never_seen_updates in Sizes")
    obj = recipe_objectives(trainer)
    t0 = time.perf_counter()
    prepared = [obj.prepare(b, (0, 10, k % PER_UPDATE)) for k, b in enumerate(made.batches)]
    prepare_ms = 1e3 * (time.perf_counter() - t0) / len(prepared)
    model_cfg = recipe_model_config(args.smoke)
    record = {"variant": variant,
              "cudnn_version": torch.backends.cudnn.version() if device.type == "cuda" else None,
              "trainer": execution(trainer), "model": {"d_model": model_cfg.d_model, "vocab": model_cfg.vocab_size},
              "batches": len(made.batches), "prepare_ms_per_batch": prepare_ms}
    if variant == "packed_cross" and device.type != "cuda":
        return {**record, "skipped": "packed cross-attention trains only on a GPU (FlexAttention has no CPU "
                                     "backward): its batches were prepared, nothing trained"}
    if device.type == "cuda":
        prepared = [p.pin_memory() for p in prepared]
    torch.manual_seed(0)
    model = apply_execution_settings(Marge(model_cfg).to(device).train(), trainer)  # cuDNN's SDPA on or off too
    record["cudnn_sdp"] = torch.backends.cuda.cudnn_sdp_enabled()
    # as the trainer's hosts do (rank.py, single_process.py); a smoke run traces without Inductor's code generation
    stepped = compiled(model, trainer.compile, trainer.compile_scope, "aot_eager" if args.smoke else "inductor",
                       dynamic=trainer.compile_dynamic)
    optimizer = build_optimizer(model, trainer)
    if getattr(trainer, "bf16_params", False):  # after the optimizer (and, on a host, a restore); the layers
        # compile at their first call, so on the bf16 copies, as on a host where compiling follows the conversion
        bf16_parameters(model, optimizer)
    scheduler = build_scheduler(optimizer, trainer, 5000)
    signatures: list[set] = []  # each update's attention calls' signatures
    step = 10
    trainee = Trainee.in_process(stepped, optimizer, scheduler, obj, trainer, device)

    def update(first: int, calls: AttentionCalls) -> tuple[float, int]:
        nonlocal step
        before = len(calls.calls)
        sync(device)
        t = time.perf_counter()
        trained = train_step(trainee, made.batches[first:first + PER_UPDATE], step, prepared[first:first + PER_UPDATE])
        sync(device)
        step += 1
        signatures.append(set(calls.calls[before:]))
        return time.perf_counter() - t, trained.target_tokens

    warm = range(0, warm_batches, PER_UPDATE)
    # compiled layers would trace the census's wrapper (its list's length becomes a guard: a recompile every call),
    # so a compiled arm counts no attention calls
    census = contextlib.nullcontext(AttentionCalls()) if trainer.compile else AttentionCalls()
    with census as calls:
        warm_up = [update(k, calls) for k in warm]
        seen = [update(k, calls) for _ in range(sizes.recipe_seen_rounds) for k in warm]
        never: list[tuple[float, int]] = []
        truncated = False
        for k in range(warm_batches, wanted, PER_UPDATE):
            if never and time.time() + 2 * max(s for s, _ in never) > deadline:
                truncated = True  # the box would not hold another update: report those done
                break
            never.append(update(k, calls))
    new = new_shapes_per_update(signatures)
    launches = launches_of(lambda: update(0, calls), device)  # one more update, on seen batches, under the profiler
    never_s, never_tokens = sum(s for s, _ in never), sum(t for _, t in never)
    counted = {} if not trainer.compile else {
        "attention_shapes": None, "attention_calls_per_update": None, "new_attention_shapes_warm_up": None,
        "new_attention_shapes_seen": None, "new_attention_shapes_never_seen": None,
        "attention_census": "off: the census's wrapper would be traced into the compiled layers",
        "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    return {**record,
            "recipe_update_s_seen": statistics.median(s for s, _ in seen),
            "recipe_update_s_never_seen": statistics.median(s for s, _ in never),
            "never_seen_s_per_target_token": never_s / never_tokens,
            "never_seen_target_tokens_per_s": never_tokens / never_s, "never_seen_truncated": truncated,
            "update_s_warm_up": [s for s, _ in warm_up], "update_s_seen": [s for s, _ in seen],
            "update_s_never_seen": [s for s, _ in never],
            "target_tokens_seen": [t for _, t in seen], "target_tokens_never_seen": [t for _, t in never],
            "attention_shapes": len(set().union(*signatures)),
            "attention_calls_per_update": len(calls.calls) / len(signatures),
            "new_attention_shapes_warm_up": new[:len(warm_up)],
            "new_attention_shapes_seen": new[len(warm_up):len(warm_up) + len(seen)],
            "new_attention_shapes_never_seen": new[len(warm_up) + len(seen):],
            "kernel_launches_per_update": launches, **counted}


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaLaunchCooperativeKernel")
"""The CUDA runtime and driver calls that launch work (Triton's kernels go through the driver's `cuLaunchKernel`, a
CUDA graph through `cudaGraphLaunch`): what the CPU proxy's launches_per_update_all estimates."""


def launches_of(run: Callable[[], object], device: torch.device) -> dict | None:
    """Launch calls, by name, while `run` runs on a GPU (torch.profiler's CPU-side view of the CUDA API); None on a
    CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    averages = prof.key_averages()
    counts = {e.key: e.count for e in averages if e.key in LAUNCH_CALLS}
    kernels = sorted(((getattr(e, "self_device_time_total", 0.0), e.count, e.key) for e in averages
                      if e.device_type == torch.autograd.DeviceType.CUDA), reverse=True)
    device_ms = sum(us for us, _, _ in kernels) / 1e3
    return {"total": sum(counts.values()), **counts, "device_ms": device_ms,
            "top_kernels": [[key[:100], count, us / 1e3] for us, count, key in kernels[:15]]}


# --- the bench step and the paper step -----------------------------------------------------------------------


def bench_shape(name: str, targets: int, smoke: bool) -> Shape:
    """trainer_vs_hf_bart.py's shape with this many targets (tiny widths, fewer targets on a smoke run)."""
    s = shape(name)
    model = s.model.with_overrides(**SMOKE_WIDTHS) if smoke else s.model
    count = max(1, targets // SMOKE_TARGETS_DIVISOR) if smoke and name == "base" else targets
    return Shape(s.name, model, count, s.target_tokens, s.evidence_tokens)


def new_step(s: Shape, device: torch.device) -> OurStep:
    """The bench's step, its model initialised on the device: the host neither initialises nor copies a `paper`
    model's 966M parameters."""
    with torch.device(device):
        return OurStep(s, device, bf16=device.type == "cuda")


def compile_static_layers(model: nn.Module, backend: str) -> str:
    """Each repeated layer's training forward compiled with static shapes (what CUDA graphs need), in place; says
    how."""
    if "dynamic" in inspect.signature(compiled).parameters:
        compiled(model, True, "layers", backend, dynamic=False)
        return f"services.trainer.step.compiled(model, True, 'layers', {backend!r}, dynamic=False)"
    for module in list(model.modules()):  # a step.py whose `compiled` is dynamic only: the same, by hand
        if isinstance(module, nn.ModuleList):
            for layer in module:
                eager = layer.forward
                fast = torch.compile(eager, dynamic=False, fullgraph=True, backend=backend)

                def forward(*a, _layer=layer, _fast=fast, _eager=eager, **k):
                    return (_fast if _layer.training else _eager)(*a, **k)

                layer.forward = forward
    return (f"torch.compile(layer.forward, dynamic=False, fullgraph=True, backend={backend!r}) per layer, as "
            "step.compile_training_forward")


def step_arm(args: argparse.Namespace, name: str, targets: int, compile_static: bool, device: torch.device,
             deadline: float, chunked: bool = False, eager_head: bool = False, params16: bool = False) -> dict:
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    paper = name == "paper"
    warm, rounds, steps = ((sizes.paper_warm, sizes.paper_rounds, sizes.paper_steps) if paper else
                           (sizes.bench_warm, sizes.bench_rounds, sizes.bench_steps))
    s = bench_shape(name, targets, args.smoke)
    rng = np.random.default_rng(0)
    batches = [synthetic_batch(s, rng, f"b{i}") for i in range(steps)]
    runner = new_step(s, device)
    if chunked:  # the fused linear + NLL (`trainer.loss_chunk_tokens`): no [rows x vocabulary] logits held
        runner.model.loss_chunk_tokens = CHUNKED_LOSS_ROWS
    if params16:  # `trainer.bf16_params`: bf16 parameters, fp32 masters in the optimizer, no autocast
        bf16_parameters(runner.model, runner.optimizer)
        runner.autocast = False
    # a smoke run checks the tracing (static, fullgraph) without a CPU's minutes of Inductor codegen
    how = compile_static_layers(runner.model, "aot_eager" if args.smoke else "inductor") if compile_static else None
    if eager_head and hasattr(runner.model.projected_nll, "__wrapped__"):  # the layers compiled, the loss head not
        runner.model.projected_nll = runner.model.projected_nll.__wrapped__
        how = f"{how}; the loss head eager"
    sync(device)
    t0 = time.perf_counter()
    runner(batches[0])
    sync(device)
    first_step_s = time.perf_counter() - t0
    for batch in batches[1:warm]:
        runner(batch)
    rates: list[float] = []
    round_s = 0.0
    for _ in range(rounds):
        if rates and time.time() + 1.5 * round_s > deadline:
            break  # another round would not fit in the box
        t0 = time.perf_counter()
        rates.append(time_steps(runner, batches, device))
        round_s = time.perf_counter() - t0
    best = max(rates)
    launches = launches_of(lambda: runner(batches[0]), device)
    tokens_per_step = s.targets * (s.target_tokens + 1)
    record = {"shape": name, "targets": s.targets, "target_tokens_per_step": tokens_per_step,
              "evidence_tokens_per_step": s.targets * (s.evidence_tokens + 2), "bf16": runner.bf16,
              "bf16_params": params16,
              "parameters": runner.parameters, "compiled": how, "first_step_s": first_step_s,
              "loss_chunk_tokens": runner.model.loss_chunk_tokens,
              "target_tokens_per_s": best, "seconds_per_step": tokens_per_step / best, "rounds": rates,
              "steps_per_round": steps, "mfu": mfu(s, best, device), "kernel_launches_per_step": launches}
    if compile_static:
        from torch._dynamo.utils import counters

        record["graphs_compiled"] = counters["stats"]["unique_graphs"]
    return record


# --- DDP on the device ---------------------------------------------------------------------------------------

DDP_WORLD = 2
DDP_UPDATES = 3


def ddp_rank(rank: int, folder: str, smoke: bool) -> None:
    """One rank of the DDP arm (torch.multiprocessing.spawn): writes rank<r>.json in `folder`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    t0 = time.perf_counter()
    cuda = not smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # gloo carries CUDA tensors too (broadcast, all-reduce, all-gather: what DDP needs); NCCL refuses 2 ranks on 1 GPU
    dist.init_process_group("gloo", init_method=f"file://{Path(folder) / 'store'}", rank=rank, world_size=DDP_WORLD)
    try:
        model_cfg = preset("tiny")
        s = Shape("ddp", model_cfg, 4, 30, 30)
        trainer = TrainerConfig(lr=1e-3, warmup_steps=0, grad_accum=2, num_workers=DDP_WORLD, use_gpu=cuda,
                                bf16=cuda, unpadded=True)
        objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked")), BENCH_SPECIALS,
                                unpadded=True)
        torch.manual_seed(rank)  # different weights on each rank: DDP's start-up broadcast makes them rank 0's
        model = apply_objective_settings(apply_execution_settings(Marge(model_cfg).to(device).train(), trainer),
                                         objectives.cfg)
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None,
                                          **ddp_settings(model, objectives.cfg))
        start = torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in model.parameters()])
        optimizer = build_optimizer(model, trainer)
        scheduler = build_scheduler(optimizer, trainer, 100)
        slots = Slots(DDP_WORLD, trainer.grad_accum)
        trainee = Trainee(model, wrapped, optimizer, scheduler, objectives, trainer, device, slots=slots)
        rng = np.random.default_rng(100 + rank)  # each rank its own batches
        objective, seconds, dead = [], [], []
        for update in range(DDP_UPDATES):
            items = [Item(slots.slot(update, rank, k), synthetic_batch(s, rng, f"r{rank}-u{update}-{k}"))
                     for k in range(trainer.grad_accum)]
            sync(device)
            t = time.perf_counter()
            done, read = run_update(trainee, items)
            sync(device)
            seconds.append(time.perf_counter() - t)
            objective.append(read.objective)
            dead += done.dead_lettered
        end = torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in model.parameters()])
        gathered = [torch.empty_like(end) for _ in range(DDP_WORLD)]
        dist.all_gather(gathered, end)
        result = {"rank": rank, "max_abs_param_diff_to_rank_0": float((end - gathered[0]).abs().max()),
                  "param_change_l1": float((end - start).abs().sum()), "objective": objective,
                  "update_s": seconds, "dead_lettered": dead, "seconds": time.perf_counter() - t0,
                  "find_unused_parameters": ddp_settings(model, objectives.cfg)["find_unused_parameters"],
                  **memory(device)}
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def ddp_arm(args: argparse.Namespace, device: torch.device) -> dict:
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="gpu-speed-ddp-")
    try:
        t0 = time.perf_counter()
        mp.spawn(ddp_rank, args=(folder, args.smoke), nprocs=DDP_WORLD, join=True)
        seconds = time.perf_counter() - t0
        ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(DDP_WORLD)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    equal = all(r["max_abs_param_diff_to_rank_0"] == 0.0 for r in ranks)
    changed = all(r["param_change_l1"] > 0 for r in ranks)
    own_batches = ranks[0]["objective"] != ranks[1]["objective"]  # else equal weights would prove nothing
    trained = not any(r["dead_lettered"] for r in ranks)
    return {"passed": equal and changed and own_batches and trained, "params_equal": equal, "params_changed": changed,
            "ranks_trained_different_batches": own_batches, "nothing_dead_lettered": trained,
            "backend": "gloo", "tensors_on": device.type, "world": DDP_WORLD, "updates": DDP_UPDATES,
            "seconds": seconds, "ranks": ranks}


# --- what a CPU cannot check ---------------------------------------------------------------------------------


def loss_and_gradients(model: Marge, inputs) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    model.relevance_center.zero_()
    out = model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout)
    out.loss.backward()
    return float(out.loss.detach()), {k: p.grad.detach().clone() for k, p in model.named_parameters()
                                      if p.grad is not None}


def same_loss_and_gradients(reference: tuple[float, dict], other: tuple[float, dict]) -> dict:
    """`other` against `reference` as tests/unit/test_unpadded.py compares them: the loss to 1e-5, each gradient to
    1e-3 relative and 1e-4 of its own largest entry (a key projection's bias, 0 in exact math: of the largest)."""
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    scale = max(float(g.abs().max()) for g in grads_a.values())
    worst, failed = 0.0, []
    for name, g in grads_a.items():
        own = scale if name.endswith("k_proj.bias") else float(g.abs().max())
        h = grads_b.get(name)
        if h is None or not torch.allclose(h, g, rtol=1e-3, atol=1e-4 * own):
            failed.append(name)
        if h is not None:
            worst = max(worst, float((h - g).abs().max()) / max(own, 1e-30))
    loss_ok = abs(loss_b - loss_a) <= 1e-5 * abs(loss_a)
    return {"passed": loss_ok and not failed and grads_a.keys() == grads_b.keys(), "loss": loss_a, "other_loss": loss_b,
            "gradients_failed": failed[:10], "worst_gradient_error_over_own_size": worst}


def checks_arm(device: torch.device) -> dict:
    """Correctness a CPU cannot check (FlexAttention has no CPU backward; the fused optimizer's skip and the step's
    reads are the device's): on a recipe-shaped batch and the `tiny` model in fp32, the packed cross-attention's loss
    and every gradient (beta's included) against the gathered one's, FlexAttention's key bias against the folded
    one's, a non-finite update skipped on the device (no parameter, moment or step count moves), and no read of the
    device before the optimizer steps."""
    from services.trainer.inputs import AttentionLayout, to_model_inputs

    out: dict = {}
    made = recipe_batches(2, max_tokens=4096)
    batch = made.batches[0]
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=4000, max_positions=128, dropout=0.0, relevance_centering=True,
                         relevance_layers=1, relevance_pooling="mean")).to(device).train()
    with torch.no_grad():
        model.beta.fill_(2.0)  # beta * f large enough that an error in it moves the loss and gradients

    def inputs(**layout):
        return to_model_inputs(batch, SPECIALS, "linked", unpadded=True, attention=AttentionLayout(**layout)).to(device)

    gathered = loss_and_gradients(model, inputs())
    out["bucketed"] = same_loss_and_gradients(gathered, loss_and_gradients(model, inputs(rows=128, width=32)))
    if device.type != "cuda":  # FlexAttention has no CPU backward: the smoke run checks the rest
        out.update(checks_of_the_step(model, made, device))
        out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
        return {**out, "flex": "skipped: no CPU backward"}
    t = time.perf_counter()
    out["packed_cross"] = {**same_loss_and_gradients(gathered, loss_and_gradients(model, inputs(packed_cross=True))),
                           "seconds_with_compile": time.perf_counter() - t}
    apply_execution_settings(model, TrainerConfig(key_bias="flex"))
    out["key_bias_flex"] = same_loss_and_gradients(gathered, loss_and_gradients(model, inputs()))
    apply_execution_settings(model, TrainerConfig(key_bias="folded"))
    out.update(checks_of_the_step(model, made, device))
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
    return out


def checks_of_the_step(model: Marge, made, device: torch.device) -> dict:
    """The fused optimizer's skip of a non-finite update on the device, and no read before it steps."""
    from services.trainer.inputs import to_model_inputs
    from services.trainer.step import gradient_norm, step_unless_not_finite

    out: dict = {}
    batch = made.batches[0]

    def inputs():
        return to_model_inputs(batch, SPECIALS, "linked", unpadded=True).to(device)

    trainer = TrainerConfig(lr=1e-3, warmup_steps=0, unpadded=True)
    optimizer = build_optimizer(model, trainer, fused=True)  # what build_optimizer gives on CUDA
    loss_and_gradients(model, inputs())
    step_unless_not_finite(optimizer, gradient_norm(model, 1.0))  # a first, finite step: moments exist
    before = {k: v.detach().clone() for k, v in model.named_parameters()}  # not the running centre (a buffer)
    moments = [{k: v.detach().clone() for k, v in state.items()} for state in optimizer.state.values()]
    loss_and_gradients(model, inputs())
    next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
    step_unless_not_finite(optimizer, gradient_norm(model, 1.0))
    sync(device)
    params = dict(model.named_parameters())
    params_kept = all(torch.equal(v, params[k]) for k, v in before.items())
    moments_kept = all(torch.equal(v, now[k]) for was, now in zip(moments, optimizer.state.values())
                       for k, v in was.items())
    loss_and_gradients(model, inputs())
    step_unless_not_finite(optimizer, gradient_norm(model, 1.0))
    moved = not all(torch.equal(v, params[k]) for k, v in before.items())
    out["nonfinite_step_skipped_on_device"] = {"passed": params_kept and moments_kept and moved,
                                               "params_kept": params_kept, "moments_and_steps_kept": moments_kept,
                                               "finite_step_moved": moved, "fused": bool(optimizer.defaults.get("fused"))}

    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked")), SPECIALS,
                            unpadded=True)
    scheduler = build_scheduler(optimizer, trainer, 100)
    prepared = [objectives.prepare(b, (0, 5, k)) for k, b in enumerate(made.batches[:2])]
    with DrainsBeforeStep(optimizer) as drains:
        train_step(Trainee.in_process(model, optimizer, scheduler, objectives, trainer, device), made.batches[:2], 5,
                   prepared)
    out["drains_before_optimizer_step"] = {"passed": drains.reads == [], "reads": drains.reads}
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
    return out


# --- one arm, in its own process -----------------------------------------------------------------------------


def run_arm(args: argparse.Namespace) -> int:
    name = args.arm
    started = time.perf_counter()
    deadline = args.deadline or time.time() + 3600
    record: dict = {"arm": name}
    try:
        device = device_of(args)
        record.update(device=device_name(device), torch=torch.__version__)
        if name.startswith("recipe_"):
            record.update(recipe_arm(args, name.removeprefix("recipe_"), device, deadline))
        elif name.startswith(("bench_", "paper_")):
            shape_name, *how, targets = name.split("_")  # bench_compiled_chunked_512, paper_16, paper_compiled_16
            unknown = set(how) - set(STEP_WAYS)
            if unknown:
                raise ValueError(f"arm {name!r}: {sorted(unknown)} is not one of {STEP_WAYS}")
            record.update(step_arm(args, "base" if shape_name == "bench" else "paper", int(targets),
                                   "compiled" in how, device, deadline, chunked="chunked" in how,
                                   eager_head="eagerhead" in how, params16="params" in how))
        elif name == "ddp_2_ranks":
            record.update(ddp_arm(args, device))
        elif name == "checks":
            record.update(checks_arm(device))
        else:
            raise ValueError(f"no arm {name!r}: one of {ARM_NAMES}")
        code = 0
    except Exception as e:  # noqa: BLE001 - the arm's record says what failed; the other arms still run
        record["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        record["traceback"] = traceback.format_exc()[-2000:]
        code = 1
    if name != "ddp_2_ranks":  # the ranks used the device, not this process
        with contextlib.suppress(Exception):
            record.update(memory(device_of(args)))
    record["arm_s"] = time.perf_counter() - started
    emit(args.out, record)
    return code


# --- the run: every arm in a fresh process, then the summary -------------------------------------------------


def lines_in(out: Path) -> list[str]:
    path = out / JSONL
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def records_since(out: Path, first_line: int) -> dict[str, dict]:
    """The last record of each arm in OUT/gpu-speed.jsonl from line `first_line` on (this run's: a folder may hold
    earlier runs' lines too)."""
    found = {}
    for line in lines_in(out)[first_line:]:
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            found[record.get("arm")] = record
    return found


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200" (a known card's model), else the name in lower case with dashes."""
    known = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return (known.group(1) if known else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "unknown").lower()


def summary(records: dict[str, dict], command: str, smoke: bool, bucket: dict) -> dict:
    def figure(arm: str, key: str):
        return records.get(arm, {}).get(key)

    bench = figure("bench_eager_128", "target_tokens_per_s")
    recipes = {variant: records[f"recipe_{variant}"] for variant in RECIPE_VARIANTS
               if "recipe_update_s_never_seen" in records.get(f"recipe_{variant}", {})}
    ratio = {variant: r["never_seen_s_per_target_token"] * bench for variant, r in recipes.items() if bench}
    bench_compiled = figure("bench_compiled_128", "target_tokens_per_s")
    compiled_ratio = (recipes["compiled"]["never_seen_s_per_target_token"] * bench_compiled
                      if bench_compiled and "compiled" in recipes else None)

    def best(prefix: str) -> float | None:
        values = [r["mfu"] for name, r in records.items() if name and name.startswith(prefix) and r.get("mfu")]
        return max(values) if values else None

    keys = ("recipe_update_s_seen", "recipe_update_s_never_seen", "attention_shapes", "new_attention_shapes_never_seen")
    name = next((r["device"] for r in records.values() if r.get("device")), "unknown")
    return {"device": name, "torch": torch.__version__, "date": datetime.date.today().isoformat(), "smoke": smoke,
            "recipe_update_s_seen": figure("recipe_default", "recipe_update_s_seen"),
            "recipe_update_s_never_seen": figure("recipe_default", "recipe_update_s_never_seen"),
            "bench_target_tokens_per_s": bench, "recipe_over_bench_never_seen": ratio.get("default"),
            "recipe_over_bench_never_seen_by_variant": ratio,
            "recipe_compiled_over_bench_compiled_never_seen": compiled_ratio,
            "base_mfu_bf16": best("bench_"), "paper_mfu_bf16": best("paper_"),
            "ddp_2_ranks_passed": figure("ddp_2_ranks", "passed"),
            "recipe_by_variant": {variant: {k: r.get(k) for k in keys} for variant, r in recipes.items()},
            "recipe_bucket_settings": bucket, "command": command, "arms": records}


def launch(args: argparse.Namespace, arm: Arm, box: float) -> str | None:
    """Runs one arm in a fresh process, killed (with what it spawned) after `box` seconds; None or why it gave no
    record."""
    command = [sys.executable, str(Path(__file__).resolve()), "--arm", arm.name, "--out", str(args.out),
               "--deadline", str(time.time() + box - 5), "--bucket-rows", str(args.bucket_rows),
               "--bucket-width", str(args.bucket_width)] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ)
    cache = None
    if "compiled" in arm.name:  # a cold compile: no kernels from an earlier arm or run
        cache = tempfile.mkdtemp(prefix="gpu-speed-compile-")
        env.update(TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"), TRITON_CACHE_DIR=str(Path(cache) / "triton"))
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        code = process.wait(timeout=box)
        return None if code == 0 else f"its process exited with {code}"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the arm and the ranks it spawned
        process.wait()
        return f"no record within its box of {box:.0f} s (killed)"
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def paired_ratio(base: dict, other: dict, key: str, draws: int = 10000) -> dict:
    """The median over updates of `other`'s seconds over `base`'s for the same update (each arm trains the same
    batches in the same order), and a 95% bootstrap interval of that median over the updates (seed 0). It covers
    the update-to-update spread within one run, not the run-to-run spread of separate machines."""
    a, b = np.asarray(base[key], dtype=float), np.asarray(other[key], dtype=float)
    n = min(len(a), len(b))
    ratios = b[:n] / a[:n]
    rng = np.random.default_rng(0)
    medians = [float(np.median(ratios[rng.integers(0, n, n)])) for _ in range(draws)]
    low, high = np.percentile(medians, [2.5, 97.5])
    return {"median_ratio": float(np.median(ratios)), "ci95": [float(low), float(high)], "updates": int(n)}


def compare(result: Path, base_arm: str, other_arm: str) -> dict:
    arms = json.loads(Path(result).read_text(encoding="utf-8"))["arms"]
    missing = [a for a in (base_arm, other_arm) if a not in arms or "update_s_never_seen" not in arms[a]]
    if missing:
        raise SystemExit(f"{result}: no recipe arm {missing} with per-update seconds; it has {sorted(arms)}")
    return {"result": str(result), "base": base_arm, "other": other_arm,
            **{key: paired_ratio(arms[base_arm], arms[other_arm], f"update_s_{key}") for key in ("never_seen", "seen")}}


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.compare:
        print(json.dumps(compare(Path(args.compare[0]), args.compare[1], args.compare[2])))
        return 0
    if args.out is None:
        raise SystemExit("gpu_speed.py: --out FOLDER is required (or --compare RESULT BASE_ARM OTHER_ARM)")
    if not args.arm:
        device_of(args)  # no GPU and no --smoke: say so once, not once an arm
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        return run_arm(args)
    start = time.perf_counter()
    command = "python " + " ".join(["benchmarks/gpu_speed.py", *(sys.argv[1:] if argv is None else argv)])
    bucket = {"bucket_rows": args.bucket_rows, "bucket_width": args.bucket_width}
    first_line = len(lines_in(args.out))
    written: Path | None = None
    result: dict = {}
    budget = args.budget_s or (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    for arm in (a for a in ARMS if a.name in args.arms):
        left = budget - (time.perf_counter() - start)
        if left < arm.min_s:
            emit(args.out, {"arm": arm.name, "skipped": f"{left:.0f} s left, the arm needs at least {arm.min_s:.0f}"})
        else:
            before = len(lines_in(args.out))
            why = launch(args, arm, min(arm.box_s * (SMOKE_BOX_FACTOR if args.smoke else 1), left))
            if arm.name not in records_since(args.out, before):
                emit(args.out, {"arm": arm.name, "error": why or "its process wrote no record"})
        result = summary(records_since(args.out, first_line), command, args.smoke, bucket)
        path = args.out / f"gpu-speed-{device_slug(result['device'])}-{result['date']}.json"
        path.write_text(json.dumps(result, indent=1, default=float) + "\n", encoding="utf-8")
        if written is not None and written != path:  # the device became known after a first arm failed
            written.unlink(missing_ok=True)
        written = path
    print(json.dumps({"summary": str(written), "seconds": time.perf_counter() - start,
                      **{k: v for k, v in result.items() if k not in ("arms", "command")}}, default=float), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
