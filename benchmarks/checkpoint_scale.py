"""Checkpoints against the world size: bytes each rank writes and reads from storage, and the training loop's time
blocked by a save, for the sharded asynchronous checkpoint (format 2) next to the named alternative in the same
run, the synchronous format 1 save that rank 0 wrote alone and every rank read whole.

Real gloo ranks (spawned processes, torch.distributed) on this machine, a MARGE model of `--preset` with an AdamW
state after one update:

  save       world 1, 2, 4. A stand-in training loop (`--updates` updates, each `--work` matrix products and one
             all-reduce, like a DDP update's synchronisation) is timed without a checkpoint, with the format 1 save
             (rank 0 writes model.safetensors and training_state.pt into a temporary folder and copies it into
             storage, as Ray Train's report did, every rank waiting at a barrier) and with the sharded save started
             at the first update (`CheckpointWrite` in a
             thread; at each update boundary the ranks all-reduce whether it is written, as the trainer does, and
             the last update waits for it). Blocked time = the loop's time minus the loop's time without a
             checkpoint, and the call's own time. Bytes written per rank: the part files each rank wrote. Also
             measured: what DCP's default planner writes per rank when every rank passes the whole replicated
             state (its `dedup_save_plans`).
  restore    each checkpoint saved in world 1, 2, 4 restored in world 1, 2, 4 (resharding), every rank's restored
             state checked against the saved one (sha256 of every tensor); bytes read from storage per rank as the
             read plan counts them (the DCP items' byte ranges, the metadata, the small files) and as the kernel
             counts them (/proc/self/io rchar over the call, which includes the process group's socket reads, an
             upper bound); the format 1 checkpoint restored as the old resume did (rank 0 verifies every file,
             then every rank loads it whole).

    python benchmarks/checkpoint_scale.py --out benchmarks/results/checkpoint-scale-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

WORLDS = (1, 2, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rchar() -> int:
    """Bytes this process has read through read() and pread() so far (kernel's count, page cache included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def training(preset: str, seed: int = 0):
    """(model, optimizer, scheduler) of `preset` after one AdamW update (moments and a step per parameter)."""
    import torch

    from marge.model.architecture import preset as model_preset
    from marge.model.network import Marge

    torch.manual_seed(seed)
    model = Marge(model_preset(preset, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if seed == 0:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scheduler


def state_digest(model, optimizer) -> str:
    import hashlib

    from marge.model.checkpoint import tensor_sha256, training_tensors

    tensors = training_tensors(model, optimizer)
    return hashlib.sha256("".join(f"{k}={tensor_sha256(tensors[k])}" for k in sorted(tensors)).encode()).hexdigest()


def save_rank(rank: int, world: int, port: int, args: dict, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from marge.model.checkpoint import CheckpointWrite, WriteSettings, save_checkpoint_v1, training_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # the checkpoint's own group, as the trainer's
    model, optimizer, scheduler = training(args["preset"])
    tokenizer = Path(root) / "tok"
    a = torch.randn(256, 256)

    def update(written: bool) -> bool:
        """One stand-in update; its one all-reduce also carries whether this rank's part is written (the trainer
        adds that flag to the all-reduce its update boundary makes anyway)."""
        for _ in range(args["work"]):
            torch.mm(a, a)
        flags = torch.tensor([1.0, 1.0 if written else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return flags[1].item() == 1

    def loop(checkpoint=None) -> dict:
        dist.barrier()
        started = time.perf_counter()
        figures: dict = {}
        pending = None
        for u in range(args["updates"]):
            if u == 0 and checkpoint is not None:
                t = time.perf_counter()
                pending = checkpoint()
                figures["call_s"] = time.perf_counter() - t
            all_written = update(pending is None or pending.done())
            if pending is not None:  # the trainer's boundary: all ranks agree the write is done
                if all_written:
                    pending.wait()
                    dist.barrier()
                    figures["durable_after_updates"] = u + 1
                    pending = None
        if pending is not None:
            t = time.perf_counter()
            pending.wait()
            dist.barrier()
            figures["final_wait_s"] = time.perf_counter() - t
            figures["durable_after_updates"] = args["updates"]
        figures["loop_s"] = time.perf_counter() - started
        return figures

    def sync_v1():
        """The format 1 save as the trainer made it: rank 0 writes a temporary folder, Ray Train's report copies it
        into storage (pyarrow's copy_files for a local path; shutil here), every rank waits at a barrier."""
        if rank == 0:
            with tempfile.TemporaryDirectory(prefix="marge-ckpt-") as tmp:
                save_checkpoint_v1(Path(tmp), model, optimizer, scheduler, 1, tokenizer,
                                   {"tokens_seen": 0, "rng_by_rank": []})
                shutil.copytree(tmp, Path(root) / f"v1-w{world}", dirs_exist_ok=True)
        dist.barrier()
        return None

    writes: list = []

    def sharded():
        write = CheckpointWrite(Path(root) / f"v2-w{world}", model, optimizer, scheduler, 1, tokenizer,
                                {"tokens_seen": 0, "rng_by_rank": []}, WriteSettings(group=group, background=True))
        writes.append(write)
        return write

    loop()  # warm-up
    result = {"rank": rank, "digest": state_digest(model, optimizer) if rank == 0 else None}
    for arm in range(args["repeats"]):
        for name, checkpoint in (("none", None), ("sync_v1", sync_v1), ("sharded_async", sharded)):
            if arm and name != "none":
                shutil.rmtree(Path(root) / (f"v1-w{world}" if name == "sync_v1" else f"v2-w{world}"),
                              ignore_errors=True)
                dist.barrier()
            result.setdefault(name, []).append(loop(checkpoint))
    result["sharded_bytes_written"] = writes[-1].bytes_written
    result["sharded_bytes_staged"] = writes[-1].bytes_staged
    result["v1_bytes_written"] = sum(p.stat().st_size for p in (Path(root) / f"v1-w{world}").iterdir()) \
        if rank == 0 else 0
    # DCP's default planner, every rank passing the whole replicated state: what does its dedup write per rank?
    full = {k: t.detach().clone() for k, t in training_tensors(model, optimizer).items()}
    default_dir = Path(root) / f"dcp-default-w{world}"
    dcp.save(full, storage_writer=dcp.FileSystemWriter(str(default_dir)), process_group=group)
    result["dcp_default_bytes_written"] = sum(p.stat().st_size for p in default_dir.glob(f"__{rank}_*.distcp"))
    Path(out, f"save-w{world}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def restore_rank(rank: int, world: int, port: int, args: dict, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from marge.model.restore import restore_training

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    results = []
    for saved in [f"v2-w{w}" for w in WORLDS] + ["v1-w1"]:
        model, optimizer, scheduler = training(args["preset"], seed=1 + rank)
        stats: dict = {}
        dist.barrier()
        before, t = rchar(), time.perf_counter()
        restore_training(Path(root) / saved, model, optimizer, scheduler, verify=rank == 0, group=group, stats=stats)
        dist.barrier()
        seconds, read = time.perf_counter() - t, rchar() - before
        results.append({"checkpoint": saved, "rank": rank, "seconds": seconds, "rchar_bytes": read,
                        "planned_bytes": stats.get("state_bytes_read", 0) + stats.get("small_bytes_read", 0),
                        "digest": state_digest(model, optimizer)})
        del model, optimizer, scheduler
    Path(out, f"restore-w{world}-rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def spawn(target, world: int, args: dict, root: Path, out: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(target, args=(world, free_port(), args, str(root), str(out)), nprocs=world, join=True,
                       start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base", help="the model preset (default: base, 80M parameters)")
    parser.add_argument("--updates", type=int, default=30, help="updates of the stand-in loop per arm")
    parser.add_argument("--work", type=int, default=200, help="256x256 matrix products per stand-in update")
    parser.add_argument("--repeats", type=int, default=2, help="times each arm runs (the figures are the medians)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    args = {"preset": ns.preset, "updates": ns.updates, "work": ns.work, "repeats": ns.repeats}
    root = Path(ns.dir or tempfile.mkdtemp(prefix="marge-ckpt-scale-"))
    out = root / "results"
    out.mkdir(parents=True, exist_ok=True)
    (root / "tok").mkdir(exist_ok=True)
    for name in ("tokenizer.model", "tokenizer.json"):
        (root / "tok" / name).write_text("x")
    import statistics

    import torch

    from marge.model.architecture import preset as model_preset
    from marge.model.network import Marge

    params = sum(p.numel() for p in Marge(model_preset(ns.preset)).parameters())
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "load_average_at_start": os.getloadavg()},
                    "command": "python benchmarks/checkpoint_scale.py " + " ".join(sys.argv[1:]),
                    "preset": ns.preset, "parameters": params, "args": args, "save": {}, "restore": {}}
    median = statistics.median
    for world in WORLDS:
        spawn(save_rank, world, args, root, out)
        ranks = [json.loads((out / f"save-w{world}-rank{r}.json").read_text()) for r in range(world)]
        loop = {name: median(max(r[name][i]["loop_s"] for r in ranks) for i in range(ns.repeats))
                for name in ("none", "sync_v1", "sharded_async")}
        call = {name: median(max(r[name][i]["call_s"] for r in ranks) for i in range(ns.repeats))
                for name in ("sync_v1", "sharded_async")}
        blocked = {name: loop[name] - loop["none"] for name in ("sync_v1", "sharded_async")}
        report["save"][world] = {
            "loop_s": loop, "call_s": call, "blocked_s": blocked,
            "blocked_ratio_sync_over_sharded": blocked["sync_v1"] / blocked["sharded_async"]
            if blocked["sharded_async"] > 0 else None,
            "call_ratio_sync_over_sharded": call["sync_v1"] / call["sharded_async"],
            "durable_after_updates": [r["sharded_async"][-1].get("durable_after_updates") for r in ranks],
            "final_wait_s": [r["sharded_async"][-1].get("final_wait_s", 0.0) for r in ranks],
            "bytes_written_per_rank": {"sharded": [r["sharded_bytes_written"] for r in ranks],
                                       "sync_v1": [r["v1_bytes_written"] for r in ranks],
                                       "dcp_default_planner": [r["dcp_default_bytes_written"] for r in ranks]},
            "bytes_staged_per_rank": [r["sharded_bytes_staged"] for r in ranks],
            "digest": ranks[0]["digest"]}
        print(json.dumps({"save_world": world, **{k: report["save"][world][k] for k in
                                                   ("blocked_s", "call_s", "bytes_written_per_rank")}}), flush=True)
    reference = report["save"][1]["digest"]
    for world in WORLDS:
        spawn(restore_rank, world, args, root, out)
        ranks = [json.loads((out / f"restore-w{world}-rank{r}.json").read_text()) for r in range(world)]
        for i, first in enumerate(ranks[0]):
            rows = [r[i] for r in ranks]
            report["restore"][f"{first['checkpoint']}->w{world}"] = {
                "saved": first["checkpoint"], "world": world,
                "planned_bytes_per_rank": [r["planned_bytes"] for r in rows],
                "rchar_bytes_per_rank": [r["rchar_bytes"] for r in rows],
                "seconds": max(r["seconds"] for r in rows),
                "identical": all(r["digest"] == reference for r in rows)}
        print(json.dumps({"restore_world": world}), flush=True)
    sizes = {}
    for w in WORLDS:
        manifest = json.loads((root / f"v2-w{w}" / "manifest.json").read_text())
        sizes[f"v2-w{w}"] = sum(p["bytes"] for p in manifest["parts"].values()) + sum(
            (root / f"v2-w{w}" / n).stat().st_size for n in manifest["sha256"])
    sizes["v1-w1"] = sum(p.stat().st_size for p in (root / "v1-w1").iterdir())
    report["checkpoint_bytes"] = sizes
    report["machine"]["load_average_at_end"] = os.getloadavg()  # other processes on the same cores
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(report, indent=2) + "\n")
    if ns.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
