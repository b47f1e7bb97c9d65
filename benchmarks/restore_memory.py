"""Host memory a rank holds while restoring a checkpoint: the batched restore (`marge.model.restore`, 64 MiB batches)
against the named alternative in the same run, each rank reading and broadcasting its whole share at once (one
batch as big as the share, the memory shape of a restore that stages the state on the host).

Real gloo ranks (spawned processes) restore a format 2 checkpoint of a MARGE model of `--preset` (AdamW state after
one update) saved by one process. Per rank and arm:

    host_bytes_planned   what the restore says it held at once (`stats["restore_host_bytes"]`: its batch and the
                         largest broadcast buffer)
    transient_rss_bytes  the kernel's peak resident memory over the restore (VmHWM, reset through
                         /proc/self/clear_refs before it) minus the resident memory after it: memory the restore held
                         and gave back (the model and the optimizer's moments stay, and are not counted)

Both arms are checked to restore the same state (a sha256 over every tensor). The figure `marge plan --json` uses is
the planned bound, 2 x max(batch, the largest key), which this measures against the kernel's count.

    python benchmarks/restore_memory.py --out benchmarks/results/restore-memory-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO), str(REPO / "benchmarks")]

from checkpoint_scale import free_port, state_digest, training  # noqa: E402


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def restore_rank(rank: int, world: int, port: int, args: dict, directory: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from marge.model.restore import RESTORE_BATCH_BYTES, restore_training

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    results = {}
    arms = {"batched": RESTORE_BATCH_BYTES, "whole_share": 1 << 62}
    for arm in args["order"]:
        model, optimizer, scheduler = training(args["preset"], seed=1 + rank)
        stats: dict = {}
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident size
        t = time.perf_counter()
        restore_training(Path(directory), model, optimizer, scheduler, verify=False, group=group, stats=stats,
                         batch_bytes=arms[arm])
        seconds = time.perf_counter() - t
        peak, after = status_bytes("VmHWM"), status_bytes("VmRSS")
        dist.barrier()
        results[arm] = {"seconds": seconds, "host_bytes_planned": stats["restore_host_bytes"],
                        "transient_rss_bytes": peak - after, "state_bytes": stats["state_bytes"],
                        "digest": state_digest(model, optimizer)}
        del model, optimizer, scheduler
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base", help="the model preset (default: base, 80M parameters)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    from marge.model.checkpoint import PART_BYTES, CheckpointWrite
    from marge.model.restore import RESTORE_BATCH_BYTES

    root = Path(tempfile.mkdtemp(prefix="marge-restore-memory-"))
    (root / "tok").mkdir()
    for name in ("tokenizer.model", "tokenizer.json"):
        (root / "tok" / name).write_text("x")
    model, optimizer, scheduler = training(ns.preset)
    directory = CheckpointWrite(root / "step-00000001", model, optimizer, scheduler, 1, root / "tok", {}).wait()
    expected = state_digest(model, optimizer)
    del model, optimizer, scheduler
    report: dict = {"date": time.strftime("%Y-%m-%d"),
                    "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                "torch": torch.__version__},
                    "command": "python benchmarks/restore_memory.py " + " ".join(sys.argv[1:]),
                    "preset": ns.preset, "world": ns.world, "batch_bytes": RESTORE_BATCH_BYTES,
                    "part_bytes": PART_BYTES, "arms": {}}
    for order in (["batched", "whole_share"], ["whole_share", "batched"]):  # each arm first once
        out = root / ("results-" + "-".join(order))
        out.mkdir()
        mp.start_processes(restore_rank, args=(ns.world, free_port(), {"preset": ns.preset, "order": order},
                                               str(directory), str(out)), nprocs=ns.world, join=True,
                           start_method="spawn")
        for r in range(ns.world):
            for arm, figures in json.loads((out / f"rank{r}.json").read_text()).items():
                if figures.pop("digest") != expected:
                    raise SystemExit(f"{arm}: rank {r} restored another state")
                report["arms"].setdefault(arm, []).append({"rank": r, "first": order[0] == arm, **figures})
    worst = {arm: max(f["transient_rss_bytes"] for f in figures) for arm, figures in report["arms"].items()}
    report["transient_rss_bytes_max"] = worst
    report["whole_share_over_batched"] = worst["whole_share"] / worst["batched"]
    report["planned_bound_bytes"] = 2 * max(RESTORE_BATCH_BYTES, PART_BYTES)
    report["batched_within_bound"] = all(f["host_bytes_planned"] <= report["planned_bound_bytes"]
                                         for f in report["arms"]["batched"])
    Path(ns.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("transient_rss_bytes_max", "whole_share_over_batched",
                                             "planned_bound_bytes", "batched_within_bound")}, indent=1))


if __name__ == "__main__":
    main()
