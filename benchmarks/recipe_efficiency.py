"""How much of the learning recipe's update is real work, measured on a CPU: before and after, in one run.

On a GPU the recipe's update ran far below the bench step (docs/gpu.md). Most of the gap is visible without a GPU:
the FLOPs a padded batch executes against those `training_flops` credits, the host's preparation of a batch and how
much it slows the update's own host work when it runs beside it (the single process's and each rank's prefetch
thread), the aten operations that launch kernels, and the host-to-device copies that block. Batches are the
recipe's shape (benchmarks/recipe_batches.py: demo paragraph lengths, the project's greedy batcher, 16k tokens,
learning-gpu.yaml's self-evidence and denoising loss), the model is learning-gpu.yaml's (`base`, 4k vocabulary,
128 positions, g = 1 mean-pooled layer); updates are 2 batches (learning-gpu.yaml's `grad_accum`).

* executed_over_credited_flops: FLOPs of the forward and backward of one update's batches (FlopCounterMode, on the
  meta device: shapes only) over `marge.model.sizes.training_flops` of the tokens they hold;
* prepare_ms_per_16k_batch: `Objectives.prepare` per batch, scaled to 16,384 budget tokens (median of 12);
  planner_ms_per_batch: the greedy batcher's time per batch it makes;
* prefetch_host_slowdown: host time of an update's forward and backward on the meta device (no arithmetic: the
  host's own work) while a thread prepares the next update's batches (as the trainer's prefetcher does), over
  without (median of 9 updates each); `_without_pause`: while a thread prepares batches without rest;
* launch_ops_per_update: aten operations that compute (views and metadata excluded) in that forward and backward;
* blocking_h2d_copies_per_update: host-to-device copies without `non_blocking` while an update moves its inputs,
  computes its losses and gathers its statistics (`update_statistics`), with the meta device as the device;
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
import inspect
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from host_overhead import REPO, Launches, exported, write_result
from torch.utils._python_dispatch import TorchDispatchMode

PER_UPDATE = 2
META = torch.device("meta")


class BlockingCopies(TorchDispatchMode):
    """Host-to-device copies that do not ask for `non_blocking`: on a GPU each waits for the stream's queued work."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in ("aten::_to_copy", "aten::copy_"):
            source = args[1] if name == "aten::copy_" else args[0]
            target = args[0] if name == "aten::copy_" else out
            non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) if name == "aten::copy_" \
                else kwargs.get("non_blocking", False)
            if source.device.type == "cpu" and target.device.type != "cpu" and not non_blocking:
                self.count += 1
        return out


def objective(model, objectives, prepared, device):
    """`Objectives.losses` without autocast (the meta device has none): the weighted sum of the plugins' losses."""
    total, tokens = None, None
    for plugin in objectives.plugins:
        inputs = prepared.parts[plugin.name]
        if inputs is None:
            continue
        loss, predicted = plugin.loss(model, inputs.to(device))
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
        for key, value in p.work(pad_id).items():
            work[key] += value
    return counter.get_total_flops(), training_flops(meta_model.cfg, work["target"], work["evidence"], work["relevance"])


def recipe_setup(unpadded: bool, narrow: bool, count: int, max_tokens: int):
    """The recipe's special tokens, `count` recipe-shaped batches of `max_tokens`, its objectives (self-evidence and
    the denoising loss of learning-gpu.yaml; `unpadded` where the tree has it) and its model's config (`base`, 4k
    vocabulary, 128 positions, g = 1 mean-pooled layer; `narrow`: d_model 64). For this tree or an exported one."""
    from recipe_batches import LANGUAGES, recipe_batches

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
    if "unpadded" in inspect.signature(Objectives).parameters:
        kwargs["unpadded"] = unpadded
    elif unpadded:
        raise SystemExit("this tree has no unpadded path")
    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                             self_evidence=SelfEvidenceConfig(prob=0.5, until=1500, deletion=0.3),
                                             denoising_contrastive=DenoisingContrastiveConfig(weight=0.3,
                                                                                              extra_documents=64)),
                            specials, made.corpus_tokens, **kwargs)
    cfg = preset("base", vocab_size=4000, max_positions=128, relevance_layers=1, relevance_pooling="mean",
                 relevance_centering=True, tie_encoder_embeddings=False,
                 **(dict(d_model=64, num_heads=4, encoder_ffn=128, decoder_local_ffn=128, decoder_ffn=128) if narrow
                    else {}))
    return specials, made, objectives, cfg


def measure(unpadded: bool, smoke: bool) -> dict:
    """Every figure for the code importable here (this tree's, or the exported commit's)."""
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

    with Launches() as launches:
        for p in update:
            objective(model, objectives, p, META)[0].backward()
    out["launch_ops_per_update"] = launches.count

    with BlockingCopies() as copies:
        losses, tokens, totals = [], [], []
        for p in update:
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

    def signature(p) -> tuple:
        m = p.parts["marge"]
        views = p.parts.get("denoising_contrastive")
        return (tuple(m.evidence_MS.shape), tuple(m.target_enc_NS.shape), tuple(m.labels_NT.shape),
                None if views is None else (tuple(views["first"].shape), tuple(views["second"].shape)))
    out["distinct_shapes_50_batches"] = len({signature(p) for p in prepared[:50]})
    views = [p.parts["denoising_contrastive"] for p in prepared[:12]]
    out["denoising_views_run_over_real"] = 1.0 if "first_real" in views[0] else \
        float(np.mean([v["first"].numel() / real(v["first"]) for v in views]))
    return out


COMPILE_TOKENS = 4096
"""Budget tokens of the compile part's batches: the graphs depend on the layers and the shapes' variety, not on the
widths or the batch size, so a narrow model (`base`'s layers, d_model 64) on small batches shows them in minutes."""


def measure_compile(scope: str, smoke: bool) -> dict:
    """`trainer.compile` over 50 recipe batches (25 updates, unpadded) in a fresh process: the first update's
    seconds (the cold compile, and one update), the median update after the first three, and what Dynamo counted:
    graphs compiled (a recompilation is one more), graph breaks. `scope`: eager (no compile), layers or model
    (`trainer.compile_scope`)."""
    from torch._dynamo.utils import counters

    from marge.model.network import Marge
    from services.trainer.config import TrainerConfig
    from services.trainer.step import build_optimizer, build_scheduler, compiled, train_step

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
    times = []
    for u in range(len(made.batches) // PER_UPDATE):
        window = slice(u * PER_UPDATE, (u + 1) * PER_UPDATE)
        t0 = time.perf_counter()
        train_step(trained, optimizer, scheduler, objectives, made.batches[window], trainer, 10 + u, torch.device("cpu"),
                   prepared=prepared[window])
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
        arms["before"] = run_in(exported(args.before), f"measure(False, {args.smoke})")
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
