"""Where the learning recipe's update spends its time on one GPU, next to the bench step, in under 8 minutes.

    python benchmarks/gpu_probe.py --out "$OUT"                     # one GPU: every part
    python benchmarks/gpu_probe.py --out "$OUT" --skip compile      # a rerun without the compile part
    python benchmarks/gpu_probe.py --out probe-out --smoke          # a CPU, tiny widths: checks that it runs

Needs only torch and numpy (no prepared corpus, Ray, FAISS or Redis): recipe-shaped batches come from
benchmarks/recipe_batches.py, the model is learning-gpu.yaml's (`base`, 128 positions, g = 1 mean-pooled layer,
centred, untied encoder embedding), an update is 2 batches (its `grad_accum`), trained by the trainer's own
`train_step` in bf16. Each part prints one JSON line (also appended to OUT/probe.jsonl) and is skipped when the
time left would not cover it:

  A.env       the card, torch, flash attention
  B.batches   shapes, padding and host preparation time, padded and unpadded
  C.bench     the bench step (benchmarks/trainer_vs_hf_bart.py `base`, 128 targets, bf16): the same-card baseline
  D.recipe    the recipe's update, eager, padded (`trainer.unpadded: false`), unpadded, and unpadded with
              `trainer.key_bias: mask` (SDPA's mask, heads 64 wide, not folded to 72): seconds, target
              tokens/s, executed and credited TFLOP (FlopCounterMode on the meta device), MFU, allocator retries
  E.prefetch  D (unpadded) with a thread preparing batches without rest beside it (the prefetcher's worst case)
  G.profile   torch.profiler over 2 updates (unpadded): top kernels, GPU-busy vs wall seconds, runtime call counts,
              a gzipped Chrome trace in OUT
  F.ablations D (unpadded) with dropout 0, without self-evidence, without the denoising loss
  H.compile   in subprocesses, time-boxed: `trainer.compile` by layer (`compile_scope: layers`), by layer with
              `trainer.key_bias: flex` (beta * f in FlexAttention's score_mod, heads 64 wide), and the whole model
              (`model`, dynamic): first-update and steady seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO), str(REPO / "benchmarks")]

from recipe_batches import LANGUAGES, recipe_batches  # noqa: E402
from recipe_efficiency import executed_and_credited  # noqa: E402

from marge.contracts.batch import SpecialTokens  # noqa: E402
from marge.model.architecture import preset  # noqa: E402
from marge.model.network import Marge  # noqa: E402
from marge.model.sizes import build_on_meta  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.objectives import (  # noqa: E402
    DenoisingContrastiveConfig,
    MargeObjectiveConfig,
    Objectives,
    ObjectivesConfig,
    SelfEvidenceConfig,
)
from services.trainer.step import (  # noqa: E402
    Trainee,
    apply_execution_settings,
    build_optimizer,
    build_scheduler,
    compiled,
    train_step,
)

PARTS = ("bench", "recipe", "prefetch", "profile", "ablations", "compile")
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM
BUDGET_S = 470
PER_UPDATE = 2
SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={lang: 4 + k for k, lang in enumerate(LANGUAGES)})


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny widths, few batches")
    p.add_argument("--skip", nargs="*", default=[], choices=PARTS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one compile probe, in a subprocess
    return p.parse_args()


ARGS = arguments()
DEVICE = torch.device("cpu" if ARGS.smoke else "cuda")
ARGS.out.mkdir(parents=True, exist_ok=True)
START = time.perf_counter()
MODEL = preset("base", vocab_size=4000 if ARGS.smoke else 32000, max_positions=128, relevance_layers=1,
               relevance_pooling="mean", relevance_centering=True, tie_encoder_embeddings=False,
               **(dict(d_model=64, num_heads=4, encoder_ffn=128, decoder_local_ffn=128, decoder_ffn=128)
                  if ARGS.smoke else {}))
TRAINER = TrainerConfig(lr=5e-4, warmup_steps=500, bf16=not ARGS.smoke, grad_accum=PER_UPDATE, num_workers=1)


def emit(part: str, **figures) -> None:
    line = json.dumps({"part": part, "seconds_since_start": round(time.perf_counter() - START, 1), **figures},
                      default=float)
    print(line, flush=True)
    with open(ARGS.out / "probe.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def left() -> float:
    return BUDGET_S - (time.perf_counter() - START)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def objectives(unpadded: bool, self_evidence: bool = True, contrastive: bool = True) -> Objectives:
    return Objectives(ObjectivesConfig(
        marge=MargeObjectiveConfig(attend_to="linked"),
        self_evidence=SelfEvidenceConfig(prob=0.5, until=1500, deletion=0.3) if self_evidence else None,
        denoising_contrastive=DenoisingContrastiveConfig(weight=0.3, extra_documents=64) if contrastive else None),
        SPECIALS, unpadded=unpadded)


def prepare_all(obj: Objectives, batches: list) -> tuple[list, float]:
    t0 = time.perf_counter()
    prepared = [obj.prepare(b, (0, 10, k % PER_UPDATE)) for k, b in enumerate(batches)]
    return prepared, (time.perf_counter() - t0) / len(batches)


def shapes(prepared: list) -> dict:
    marge = [p.parts["marge"] for p in prepared]

    def real(t) -> int:
        return int((t != 0).sum())

    def run_positions(m) -> int:  # decoder positions its projections and feed-forward layers run on
        return m.labels_NT.numel() if m.layout is None else real(m.labels_NT)
    return {"targets": [m.labels_NT.shape[0] for m in marge], "evidence": [m.evidence_MS.shape[0] for m in marge],
            "decoder_run_over_real": sum(map(run_positions, marge)) / sum(real(m.labels_NT) for m in marge)}


def new_model(dropout: float | None = None, key_bias: str = "folded"):
    torch.manual_seed(0)
    cfg = MODEL if dropout is None else MODEL.with_overrides(dropout=dropout)
    model = apply_execution_settings(Marge(cfg).to(DEVICE).train(), dataclasses.replace(TRAINER, key_bias=key_bias))
    optimizer = build_optimizer(model, TRAINER)
    return model, optimizer, build_scheduler(optimizer, TRAINER, 5000)


def run_updates(model, optimizer, scheduler, obj, batches, prepared, updates, trained=None, step0=10):
    pinned = [p.pin_memory() for p in prepared] if DEVICE.type == "cuda" else prepared
    times, tokens = [], 0
    trainee = Trainee.in_process(model if trained is None else trained, optimizer, scheduler, obj, TRAINER, DEVICE)
    for u in range(updates):
        k = (u * PER_UPDATE) % (len(batches) - PER_UPDATE + 1)
        sync()
        t0 = time.perf_counter()
        record = train_step(trainee, batches[k:k + PER_UPDATE], step0 + u, pinned[k:k + PER_UPDATE])
        sync()
        times.append(time.perf_counter() - t0)
        tokens += record.target_tokens
    return times, tokens


def memory() -> dict:
    if DEVICE.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {"peak_allocated_gb": stats["allocated_bytes.all.peak"] / 2**30, "alloc_retries": stats["num_alloc_retries"]}


def peak_tflops() -> float | None:
    if DEVICE.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def timed_update(name: str, obj, batches, prepared, timed: int, dropout: float | None = None,
                 key_bias: str = "folded", **extra) -> dict:
    model, optimizer, scheduler = new_model(dropout, key_bias)
    run_updates(model, optimizer, scheduler, obj, batches, prepared, 2)  # warm-up
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, tokens = run_updates(model, optimizer, scheduler, obj, batches, prepared, timed)
    executed, credited = executed_and_credited(build_on_meta(MODEL).train(), obj, prepared[:PER_UPDATE], SPECIALS.pad_id)
    seconds = float(np.median(times))
    peak = peak_tflops()
    figures = {"update_s": seconds, "target_tokens_per_s": tokens / sum(times), "executed_tflop": executed / 1e12,
               "credited_tflop": credited / 1e12, "executed_over_credited": executed / credited,
               "mfu_credited": None if peak is None else credited / seconds / (peak * 1e12), **memory(), **extra}
    emit(name, **figures)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, **figures}


def compile_part(kind: str) -> None:
    """One compile probe (run in its own process): the first update (cold compile) and the steady update."""
    made = recipe_batches(8, max_tokens=2048 if ARGS.smoke else 16384)
    obj = objectives(True)
    prepared, _ = prepare_all(obj, made.batches)
    model, optimizer, scheduler = new_model(key_bias="flex" if kind == "regional_flex" else "folded")
    trained = compiled(model, True, "model" if kind == "whole_dynamic" else "layers")
    t0 = time.perf_counter()
    run_updates(model, optimizer, scheduler, obj, made.batches, prepared, 1, trained)
    cold = time.perf_counter() - t0
    times, tokens = run_updates(model, optimizer, scheduler, obj, made.batches, prepared, 3, trained)
    emit(f"H.compile_{kind}", first_update_s=cold, steady_update_s=float(np.median(times)),
         target_tokens_per_s=tokens / sum(times))


def main() -> int:
    if ARGS.part:
        try:
            compile_part(ARGS.part)
        except Exception as e:  # noqa: BLE001 - one JSON line says why (flex has no CPU backward: the smoke run)
            emit(f"H.compile_{ARGS.part}", error=f"{type(e).__name__}: {str(e)[:300]}")
        return 0
    cuda = DEVICE.type == "cuda"
    emit("A.env", torch=torch.__version__, device=torch.cuda.get_device_name() if cuda else "cpu",
         cpus=os.cpu_count(), flash=torch.backends.cuda.flash_sdp_enabled() if cuda else None,
         model=dict(d_model=MODEL.d_model, vocab=MODEL.vocab_size), per_update=PER_UPDATE)
    made = recipe_batches(4 if ARGS.smoke else 12, max_tokens=2048 if ARGS.smoke else 16384)
    batches = made.batches
    padded_obj, unpadded_obj = objectives(False), objectives(True)
    padded, padded_s = prepare_all(padded_obj, batches)
    unpadded, unpadded_s = prepare_all(unpadded_obj, batches)
    emit("B.batches", batches=len(batches), planner_ms_per_batch=1e3 * made.plan_seconds_per_batch,
         prepare_ms_padded=1e3 * padded_s, prepare_ms_unpadded=1e3 * unpadded_s, padded=shapes(padded),
         unpadded=shapes(unpadded))
    timed = 2 if ARGS.smoke else 6

    if "bench" not in ARGS.skip and cuda and left() > 60:
        from trainer_vs_hf_bart import OurStep, shape, synthetic_batch, time_steps
        s = shape("base")
        s = type(s)(s.name, s.model, 128, s.target_tokens, s.evidence_tokens)
        bench = [synthetic_batch(s, np.random.default_rng(0), f"b{i}") for i in range(8)]
        step = OurStep(s, DEVICE, True)
        for b in bench[:3]:
            step(b)
        emit("C.bench_step_bf16_128_targets", target_tokens_per_s=time_steps(step, bench, DEVICE))
        del step

    main_run = None
    if "recipe" not in ARGS.skip:
        for name, obj, prepared, key_bias in (("D.recipe_update_padded", padded_obj, padded, "folded"),
                                              ("D.recipe_update_unpadded", unpadded_obj, unpadded, "folded"),
                                              ("D.recipe_update_unpadded_key_bias_mask", unpadded_obj, unpadded, "mask")):
            if left() < 45:
                emit(name, skipped=f"{left():.0f} s left")
                continue
            run = timed_update(name, obj, batches, prepared, timed, key_bias=key_bias)
            if name == "D.recipe_update_unpadded":
                main_run = run
            else:
                del run
            if cuda:
                torch.cuda.empty_cache()

    if "prefetch" not in ARGS.skip and main_run is not None and left() > 30:
        stop = threading.Event()

        def prefetch():
            k = 0
            while not stop.is_set():
                unpadded_obj.prepare(batches[k % len(batches)], (0, 11, k % PER_UPDATE))
                k += 1
        thread = threading.Thread(target=prefetch, daemon=True)
        thread.start()
        times, tokens = run_updates(main_run["model"], main_run["optimizer"], main_run["scheduler"], unpadded_obj,
                                    batches, unpadded, timed)
        stop.set()
        thread.join()
        emit("E.recipe_update_with_prefetch_thread", update_s=float(np.median(times)),
             target_tokens_per_s=tokens / sum(times), alone_update_s=main_run["update_s"])

    if "profile" not in ARGS.skip and main_run is not None and left() > 40:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            run_updates(main_run["model"], main_run["optimizer"], main_run["scheduler"], unpadded_obj, batches,
                        unpadded, 2)
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:25]
        busy = sum(getattr(e, key, 0) for e in events if e.device_type.name == "CUDA") / 1e6 if cuda else None
        runtime = {e.key: e.count for e in events if e.key.startswith("cuda") and e.key[4:5].isupper()}
        emit("G.profile_2_updates", wall_s=wall, gpu_kernel_s=busy,
             top=[(e.key[:70], e.count, round(getattr(e, key, 0) / 1e3, 1)) for e in top], cuda_runtime_calls=runtime)
        trace = ARGS.out / "recipe_update_trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
    main_run = None
    if cuda:
        torch.cuda.empty_cache()

    if "ablations" not in ARGS.skip:
        for name, kwargs, dropout in (("F.dropout_0", {}, 0.0), ("F.no_self_evidence", {"self_evidence": False}, None),
                                      ("F.no_denoising_loss", {"contrastive": False}, None)):
            if left() < 40:
                emit(name, skipped=f"{left():.0f} s left")
                continue
            obj = objectives(True, **kwargs)
            prepared, _ = prepare_all(obj, batches)
            timed_update(name, obj, batches, prepared, max(2, timed // 2), dropout)
            if cuda:
                torch.cuda.empty_cache()

    if "compile" not in ARGS.skip:
        for kind in ("regional", "regional_flex", "whole_dynamic"):
            if kind == "regional_flex" and not cuda:
                emit(f"H.compile_{kind}", skipped="FlexAttention has no CPU backward")
                continue
            limit = min(150.0, left() - 10)
            if limit < 60:
                emit(f"H.compile_{kind}", skipped=f"{left():.0f} s left")
                continue
            command = [sys.executable, __file__, "--out", str(ARGS.out), "--part", kind] + (["--smoke"] if ARGS.smoke else [])
            try:
                subprocess.run(command, timeout=limit, check=False)
            except subprocess.TimeoutExpired:
                emit(f"H.compile_{kind}", error=f"no update finished within {limit:.0f} s (cold compile)")
    emit("done", seconds=time.perf_counter() - START)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
