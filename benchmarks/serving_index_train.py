"""The serving index's quantiser training (`marge index build`, both engines): the peak anonymous memory of the
process that trains, as a multiple of the training sample's bytes, for the build's own path against the named
alternative in the same run, the path before it (the per-shard arrays kept beside their concatenation, the rows
trained on centred into a new array).

The sample is `--documents` random unit vectors of `--dim` float32 in shards of `--shard-rows`, as the Ray build's
driver reads them from its tasks' files. Each arm runs in a fresh process that does nothing else; this process
samples that process's RssAnon every 2 ms and reports its peak over the baseline the training process measured just
before it read the shards (the interpreter, FAISS, numpy). `copies` = that growth / the sample's bytes: what the
training holds at once, in samples, FAISS's own work included. The build trains on `39 x nlist` vectors (nlist
about 4 x sqrt(documents)), so at 100M documents and d 1024 the sample is 1.56M vectors, 6.4 GB; the figure
`marge plan` gives for it is `copies` x that.

    python benchmarks/serving_index_train.py --out benchmarks/results/serving-index-train-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRAIN = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import numpy as np
from services.retrieval.serving_index import BuildOptions, _Plan, _trained, _training_rows, factory_string
import faiss

arm, documents, dim, shard_rows, nlist = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])


def anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


baseline = anon()
print(json.dumps({"baseline": baseline}), flush=True)
rng = np.random.default_rng(0)
parts = []
for start in range(0, documents, shard_rows):  # the shards' arrays, as the driver reads them
    x = rng.standard_normal((min(shard_rows, documents - start), dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    parts.append(x)
plan = _Plan(documents, nlist, documents, list(range(len(parts))), np.random.default_rng(1))
opts = BuildOptions(nlist=nlist, recall_queries=200)
if arm == "build":  # the Ray build's path: the shards concatenated and let go, the rows taken, the sample let go
    training = np.concatenate(parts)
    del parts
    rows, mean, queries = _training_rows(plan, training, opts)
    del training
    index = _trained(plan, rows, opts)
else:  # before: the shards kept beside their concatenation, the rows centred into a new array
    training = np.concatenate(parts)
    mean = training.mean(axis=0).astype(np.float32)
    queries = training[plan.rng.choice(len(training), size=200, replace=False)]
    index = faiss.index_factory(dim, factory_string(dim, nlist, "sq8"), faiss.METRIC_INNER_PRODUCT)
    index.train(np.ascontiguousarray(training[plan.rng.permutation(len(training))[:plan.wanted]] - mean))
print(json.dumps({"trained": bool(index.is_trained), "sample_bytes": documents * dim * 4}), flush=True)
"""


def run_arm(arm: str, documents: int, dim: int, shard_rows: int, nlist: int) -> dict:
    """One arm in a fresh process, its RssAnon sampled every 2 ms."""
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(REPO / "shared"), str(REPO), arm, str(documents),
                             str(dim), str(shard_rows), str(nlist)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    baseline = json.loads(proc.stdout.readline())["baseline"]
    status = Path(f"/proc/{proc.pid}/status")
    peak, started = 0, time.perf_counter()
    while proc.poll() is None:
        try:
            text = status.read_text()
        except OSError:
            break
        peak = max(peak, next((int(line.split()[1]) * 1024 for line in text.splitlines()
                               if line.startswith("RssAnon")), 0))
        time.sleep(0.002)
    seconds = time.perf_counter() - started
    out = json.loads(proc.stdout.readline())
    if proc.wait() != 0 or not out["trained"]:
        raise SystemExit(f"arm {arm}: the training process failed")
    growth = peak - baseline
    return {"arm": arm, "seconds": round(seconds, 1), "peak_anon_growth_bytes": growth,
            "sample_bytes": out["sample_bytes"], "copies": round(growth / out["sample_bytes"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--shard-rows", type=int, default=20_000)
    p.add_argument("--nlist", type=int, default=64, help="lists (small: the k-means' time, not its memory, grows "
                                                         "with them on this CPU)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    arms = [run_arm(arm, args.documents, args.dim, args.shard_rows, args.nlist)
            for arm in ("build", "before", "build", "before")]  # each twice, alternating
    best = {arm: min(a["copies"] for a in arms if a["arm"] == arm) for arm in ("build", "before")}
    report = {"command": "python benchmarks/serving_index_train.py" + (f" --out {args.out}" if args.out else ""),
              "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.machine()},
              "settings": {"documents": args.documents, "dim": args.dim, "shard_rows": args.shard_rows,
                           "nlist": args.nlist},
              "arms": arms, "copies": best, "before_over_build": round(best["before"] / best["build"], 2),
              "serving_index_train_copies": max(a["copies"] for a in arms if a["arm"] == "build")}
    print(json.dumps({k: report[k] for k in ("copies", "before_over_build", "serving_index_train_copies")}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
