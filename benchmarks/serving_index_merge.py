"""The serving index's merge on Ray (`marge index build --engine ray`): the peak anonymous memory of the process
that merges the parts' inverted lists, against the index's bytes, for the on-disk merge the build does
(`merge_lists_on_disk`: the parts mapped, the lists copied into the build's lists file) and for the in-memory
merge it replaced (each part read, FAISS `merge_from` into one index, then the index written whole).

Parts are made as the build's tasks make them (`write_part`): an IVF index with 8-bit scalar-quantised codes
(inner product) whose quantiser holds random unit centroids and whose codec is trained on a sample, copies of it
each given consecutive documents (random unit vectors, doc ids in order). Each merge runs in a fresh process that
does nothing else; this process samples that process's RssAnon from /proc every 2 ms and reports its peak, and
the growth over the baseline the merging process measures just before it merges (the interpreter, FAISS, the
trained index, the parts opened). The anonymous memory is what a process holds of its own: a mapped file's pages
are the page cache's, which the kernel writes back and drops as it needs.

    python benchmarks/serving_index_merge.py --documents 250000 1000000 --dim 1024 --parts 16 \\
        --out benchmarks/results/serving-index-merge-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]

TRAINED_FILE = "trained.faiss"

MERGE = """
import hashlib, json, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import faiss
from services.retrieval.serving_index import DATA_FILE, INDEX_FILE, merge_lists_on_disk, opened_parts

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024

mode, folder, out, check = sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]), sys.argv[6] == "check"
parts = sorted(folder.glob("part-*.ivlists"))
index = faiss.read_index(str(folder / "trained.faiss"))
baseline, started = status("RssAnon"), time.perf_counter()
if mode == "on-disk":
    with opened_parts(parts) as lists:
        baseline, started = status("RssAnon"), time.perf_counter()
        merge_lists_on_disk(index, lists, out / DATA_FILE)
    faiss.write_index(index, str(out / INDEX_FILE))
else:  # the previous layout: each part read whole, appended to the one index in memory, the index written whole
    for p in parts:
        reader = faiss.FileIOReader(str(p))
        part = faiss.read_InvertedLists(reader, 0)
        del reader
        added = part.compute_ntotal()
        index.invlists.merge_from(part, 0)
        index.ntotal += added
        type(part).__swig_destroy__(part)
    faiss.write_index(index, str(out / INDEX_FILE))
seconds = time.perf_counter() - started
result = {"baseline_anon_bytes": baseline, "merge_s": seconds, "documents": int(index.ntotal),
          "vmhwm_bytes": status("VmHWM"), "end_anon_bytes": status("RssAnon")}
if check:  # every list's codes and ids, in list order: the same bytes whichever merge made them
    digest, invlists = hashlib.sha256(), index.invlists
    for j in range(index.nlist):
        n = invlists.list_size(j)
        if n:
            digest.update(faiss.rev_swig_ptr(invlists.get_codes(j), n * invlists.code_size))
            digest.update(faiss.rev_swig_ptr(invlists.get_ids(j), n).view("uint8"))
    result["lists_sha256"] = digest.hexdigest()
print(json.dumps(result))
"""


def make_parts(folder: Path, documents: int, dim: int, nlist: int, parts: int, seed: int = 0,
               chunk: int = 50_000) -> int:
    """A trained index and `parts` parts of consecutive documents under `folder`. Returns the codes' size."""
    import faiss

    from services.retrieval.serving_index import write_part

    rng = np.random.default_rng(seed)

    def unit(rows: int) -> np.ndarray:
        x = rng.standard_normal((rows, dim), dtype=np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    quantizer = faiss.IndexFlatIP(dim)
    quantizer.add(unit(nlist))  # as trained: k-means costs time and changes nothing the merge does
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit,
                                          faiss.METRIC_INNER_PRODUCT)
    index.own_fields = True
    quantizer.this.disown()
    index.train(unit(min(documents, 20_000)))  # the codec only: the quantiser holds nlist centroids already
    folder.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(folder / TRAINED_FILE))
    bounds = np.linspace(0, documents, parts + 1).round().astype(int)
    for p, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = faiss.clone_index(index)
        for start in range(a, b, chunk):
            stop = min(b, start + chunk)
            part.add_with_ids(unit(stop - start), np.arange(start, stop, dtype=np.int64))
        write_part(folder / f"part-{p:06d}.ivlists", part)
        del part
    return int(index.code_size)


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024
    except (OSError, StopIteration):  # gone
        return None


def measure_merge(folder: Path, mode: str, check: bool = False, interval_s: float = 0.002) -> dict:
    """One merge of `folder`'s parts (`mode` 'on-disk' or 'in-memory') in a fresh process, its RssAnon sampled."""
    with tempfile.TemporaryDirectory(dir=folder) as out:
        proc = subprocess.Popen([sys.executable, "-c", MERGE, str(REPO / "shared"), str(REPO), mode, str(folder), out,
                                 "check" if check else "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, rss_anon(proc.pid) or 0)
            time.sleep(interval_s)
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"the {mode} merge exited {proc.returncode}:\n{stderr[-3000:]}")
        result = json.loads(stdout.strip().splitlines()[-1])
        data = Path(out) / "index.ivfdata"
        result["lists_file_bytes"] = data.stat().st_size if data.exists() else 0
        result["index_file_bytes"] = (Path(out) / "index.faiss").stat().st_size
    peak = max(peak, result["end_anon_bytes"])
    return {**result, "peak_anon_bytes": peak, "peak_anon_growth_bytes": peak - result["baseline_anon_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, nargs="+", default=[250_000, 1_000_000])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--parts", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["on-disk", "in-memory"], choices=("on-disk", "in-memory"))
    p.add_argument("--scratch", type=Path, default=None, help="where the parts are written (a temporary folder)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from services.retrieval.serving_index import default_nlist

    sizes = {}
    for documents in args.documents:
        nlist = default_nlist(documents)
        with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
            started = time.perf_counter()
            code_size = make_parts(Path(tmp), documents, args.dim, nlist, args.parts)
            made_s = time.perf_counter() - started
            load = os.getloadavg()[0]
            merges = {mode: measure_merge(Path(tmp), mode, check=True) for mode in args.modes}
        index_bytes = documents * (code_size + 8)  # each document's code and its 8-byte id
        size = {"documents": documents, "dim": args.dim, "nlist": nlist, "parts": args.parts,
                "code_bytes": code_size, "index_lists_bytes": index_bytes, "quantizer_bytes": nlist * args.dim * 4,
                "parts_made_s": round(made_s, 1), "load_average_before": round(load, 2),
                "load_average_after": round(os.getloadavg()[0], 2), "merges": merges,
                "same_lists_every_merge": len({m["lists_sha256"] for m in merges.values()}) == 1}
        for mode, m in merges.items():
            size[f"{mode}_peak_anon_growth_over_index"] = m["peak_anon_growth_bytes"] / index_bytes
            print(f"{documents:>10,} documents, d {args.dim}, {nlist} lists, {args.parts} parts, index "
                  f"{index_bytes / 2**20:,.0f} MiB: {mode} merge peak RssAnon {m['peak_anon_bytes'] / 2**20:,.0f} MiB "
                  f"(+{m['peak_anon_growth_bytes'] / 2**20:,.1f} MiB over its baseline, "
                  f"{m['peak_anon_growth_bytes'] / index_bytes:.3f} of the index) in {m['merge_s']:.1f} s; "
                  f"load {load:.2f}", flush=True)
        sizes[str(documents)] = size
        largest = sizes[str(max(int(k) for k in sizes))]
        report = {
            "command": "python benchmarks/serving_index_merge.py " + " ".join(sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.machine()},
            "serving_index_peak_bytes_per_worker": largest["merges"]["on-disk"]["peak_anon_bytes"]
            if "on-disk" in largest["merges"] else None,
            "serving_index_peak_bytes_per_worker_is": "the merging process's peak RssAnon at the largest size "
                                                      "(the on-disk merge of a Ray build's driver)",
            "sizes": sizes}
        if args.out:  # after every size: a run cut short keeps the sizes it finished
            args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
