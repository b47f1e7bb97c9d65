"""What a GPU will feel, measured on a CPU: the trainer's update before and after it was made GPU-ready, in one run.

A GPU idles whenever the host reads a value back (every kernel launched before it must finish first) and whenever
the host is busy launching small kernels one by one. Neither needs a GPU to count. For the same batches, this
measures, per update of `train_step` (the single process's and the reference loop's update; the DDP ranks run the
same `run_update`):

* device reads: operations that make the host wait for the device (a scalar read: `.item()`, `bool(t)`,
  `float(t)`, `int(t)`; a value-dependent size: `nonzero`, `masked_select`, `unique`), plus the update's one batched
  copy of its figures where the code has it (`read_to_host`);
* kernel-launching operations: aten operations that compute (views and metadata excluded);
* graphs: frames `torch.compile` compiles over 50 batches of varied sizes (dynamic shapes), forward and loss;
* host time per update at width 8 (`tiny`'s depth, d_model 8): compute is nothing there, host work is everything;
  median of 30 updates after 5 of warm-up, eager and, after, under `torch.compile` (what `trainer.compile` runs).

"Before" is a given commit of this repository (default: the one before the GPU path), exported with `git archive`
and measured in a subprocess by this same file; "after" is the working tree.

    python benchmarks/host_overhead.py --before c4f2f44 --out benchmarks/results/host-overhead-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
SYNCHRONISING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
                 "aten::_unique2"}
NO_KERNEL = ("aten::view", "aten::_reshape", "aten::as_strided", "aten::t", "aten::transpose", "aten::expand",
             "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::alias",
             "aten::detach", "aten::_unsafe_view", "aten::unbind", "aten::split", "aten::empty", "profiler::")
"""aten operations that only make a view, change metadata or allocate (`empty`, `empty_like`, `empty_strided`: the
caching allocator, no kernel): no kernel on any device (and the profiler's marks, `profiler::`, which `torch.optim`
steps dispatch)."""


class Launches(TorchDispatchMode):
    """Counts the aten operations that compute (launch a kernel on a GPU): views and metadata excluded."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.view_copy not in getattr(func, "tags", ()) and not func._schema.name.startswith(NO_KERNEL):
            self.count += 1
        return func(*args, **(kwargs or {}))


def measure(compile_host: bool) -> dict:
    """Every figure for the `marge` importable here (this tree's, or the exported commit's)."""
    import numpy as np
    from in_process_update import update_fn

    from marge.contracts.batch import Batch, SpecialTokens
    from marge.contracts.slots import Slots
    from marge.model.architecture import preset
    from marge.model.network import Marge
    from services.trainer.config import TrainerConfig
    from services.trainer.inputs import to_model_inputs
    from services.trainer.objectives import (
        DenoisingContrastiveConfig,
        MargeObjectiveConfig,
        Objectives,
        ObjectivesConfig,
        SelfEvidenceConfig,
    )
    from services.trainer.step import build_optimizer, build_scheduler, seed_key

    torch.set_num_threads(1)
    specials = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 5, "de": 6, "fr": 7})
    langs = ("en", "de", "fr")

    import inspect

    # the denoising loss's 16 negatives: unlinked documents in the batch, or drawn from a corpus by a tree's objectives
    # before batches carried them
    from_corpus = "corpus_tokens" in inspect.signature(Objectives).parameters

    def batch(rng) -> Batch:
        n_docs = int(rng.integers(6, 12))
        n_linked, n_docs = n_docs, n_docs + (0 if from_corpus else 16)
        tokens = tuple(rng.integers(10, 60, size=int(n)).astype(np.int32) for n in rng.integers(4, 40, size=n_docs))
        n_targets = int(rng.integers(2, 4))
        edges = [[t, e] for t in range(n_targets) for e in range(n_linked - n_targets) if rng.random() < 0.5]
        edges += [[t, 0] for t in range(n_targets) if not any(e[0] == t for e in edges)]  # every target reads some
        return Batch(f"b{rng.integers(1 << 30)}", 0, 0, np.arange(n_docs, dtype=np.int64),
                     tuple(langs[i % 3] for i in range(n_docs)), tokens, np.arange(n_targets, dtype=np.int32),
                     np.arange(n_targets, n_linked, dtype=np.int32), np.array(edges, dtype=np.int32),
                     np.ones(len(edges), dtype=np.float32))

    def model_of(d_model: int) -> Marge:
        torch.manual_seed(0)
        return Marge(preset("tiny", vocab_size=64, max_positions=64, d_model=d_model, num_heads=4,
                            encoder_ffn=4 * d_model, decoder_local_ffn=4 * d_model, decoder_ffn=8 * d_model,
                            relevance_pooling="mean", relevance_centering=True)).train()

    rng = np.random.default_rng(0)
    corpus_tokens = [rng.integers(10, 60, size=int(n)).astype(np.int32) for n in rng.integers(4, 40, size=64)]
    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                             self_evidence=SelfEvidenceConfig(prob=0.5, until=1000),
                                             denoising_contrastive=DenoisingContrastiveConfig(weight=0.3,
                                                                                              extra_documents=16)),
                            specials, **({"corpus_tokens": corpus_tokens} if from_corpus else {}))
    cfg = TrainerConfig(lr=1e-3, warmup_steps=0)
    slots = Slots(1, 2)

    def update_inputs(step: int, rng) -> tuple[list, list]:
        batches = [batch(rng) for _ in range(2)]
        return batches, [objectives.prepare(b, seed_key(0, slots, slots.slot(step, 0, k))) for k, b in enumerate(batches)]

    def optimizer_for(model):
        try:  # the GPU path's fused AdamW where the code offers it on the CPU
            return build_optimizer(model, cfg, fused=True)
        except TypeError:
            return torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)

    class Reads(TorchDispatchMode):
        """Operations that make the host wait for the device: a scalar read (`.item()`, `bool(t)`, `float(t)`,
        `int(t)` all dispatch `aten::_local_scalar_dense`) or an operation whose output size depends on values
        (`nonzero`, `masked_select`, `unique`). Host-side input tensors are never read through these (they are
        numpy until they are moved), so on a CPU this counts what a GPU would wait on."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in SYNCHRONISING:
                self.count += 1
            return func(*args, **(kwargs or {}))

    out: dict = {}
    model = model_of(64)
    optimizer = optimizer_for(model)
    scheduler = build_scheduler(optimizer, cfg, 1000)
    reads, launches, batched = [], [], []
    from services.trainer import step as step_module

    original = getattr(step_module, "read_to_host", None)  # the update's figures in one copy (a no-op on a CPU)
    if original is not None:
        def counted(values):
            batched.append(1)
            return original(values)

        step_module.read_to_host = counted
    update = update_fn(model, optimizer, scheduler, objectives, cfg, torch.device("cpu"))
    try:
        for step in range(5):
            batches, prepared = update_inputs(step, rng)
            batched.clear()
            with Reads() as r:
                update(batches, step, prepared)
            reads.append(r.count + len(batched))
            batches, prepared = update_inputs(step + 100, rng)
            with Launches() as launch:
                update(batches, step, prepared)
            launches.append(launch.count)
    finally:
        if original is not None:
            step_module.read_to_host = original
    out["device_reads_per_update"] = statistics.median(reads)
    out["kernel_launching_ops_per_update"] = statistics.median(launches)

    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = model_of(64)
    forward = torch.compile(model, dynamic=True, backend=counter)
    for _ in range(50):
        inputs = to_model_inputs(batch(rng), specials, "linked")
        kwargs = inputs.as_kwargs()
        if getattr(inputs, "width", None) is not None:
            kwargs["width"] = inputs.width
        forward(**kwargs).loss.backward()
    out["compiled_frames_over_50_batches"] = counter.frame_count

    def host_seconds(compiled_model: bool) -> float:
        model = model_of(8)
        optimizer = optimizer_for(model)
        scheduler = build_scheduler(optimizer, cfg, 1000)
        trained = torch.compile(model, dynamic=True) if compiled_model else model
        update = update_fn(trained, optimizer, scheduler, objectives, cfg, torch.device("cpu"))
        seconds = []
        for step in range(35):
            batches, prepared = update_inputs(step, rng)
            t0 = time.perf_counter()
            update(batches, step, prepared)
            if step >= 5:
                seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    out["host_seconds_per_update_d8_eager"] = host_seconds(False)
    if compile_host:
        torch._dynamo.reset()
        out["host_seconds_per_update_d8_compiled"] = host_seconds(True)
    return out


def write_result(out: Path | None, result: dict) -> None:
    """A benchmark's result as indented JSON at `out` (its folder made), when one is given."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def exported(ref: str) -> Path:
    """The repository at `ref`, as files (no .git)."""
    folder = Path(tempfile.mkdtemp(prefix="marge-before-"))
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def run_in(tree: Path, compile_host: bool) -> dict:
    code = (f"import sys, json; sys.path[:0] = [{str(tree / 'shared')!r}, {str(tree)!r}, {str(REPO / 'benchmarks')!r}]; "
            f"import host_overhead; print(json.dumps(host_overhead.measure({compile_host})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"measuring {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="c4f2f44", help="the commit to compare with (default: before the GPU path)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    before = run_in(exported(args.before), compile_host=False)
    print(json.dumps({"before": before}), flush=True)
    after = run_in(REPO, compile_host=True)
    print(json.dumps({"after": after}), flush=True)
    ratios = {"device_reads": before["device_reads_per_update"] / max(after["device_reads_per_update"], 1),
              "kernel_launching_ops": before["kernel_launching_ops_per_update"] / after["kernel_launching_ops_per_update"],
              "compiled_frames": before["compiled_frames_over_50_batches"] / after["compiled_frames_over_50_batches"],
              "host_seconds_d8_eager": before["host_seconds_per_update_d8_eager"] / after["host_seconds_per_update_d8_eager"],
              "host_seconds_d8_before_eager_vs_after_compiled":
                  before["host_seconds_per_update_d8_eager"] / after["host_seconds_per_update_d8_compiled"]}
    result = {"command": "python benchmarks/host_overhead.py " + " ".join(sys.argv[1:]), "before_commit": args.before,
              "before": before, "after": after, "before_over_after": ratios}
    print(json.dumps(ratios, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
