"""`marge prepare` at 1x, 4x, 16x and 64x the demo corpus: peak memory and documents per second, on Ray Data against the
single-process engine.

The inputs are the demo's raw documents (data/demo/libreoffice-help/documents.jsonl.gz) and replicas of them in the
same format: replica r shuffles the words of every paragraph (the characters of a paragraph without spaces, as in
Chinese and Japanese) with a seed of its own and suffixes ids and groups with ~r, so its documents survive
de-duplication, and tokenize like real text (the few whose shuffled characters language identification then reads
as another language are skipped and counted: `--skip-bad-documents`). Each measurement is one
`marge prepare` process, run alone; its memory is the sum of the proportional set sizes (PSS: shared pages such as
Ray's object store counted once) of the process and everything it started (a local Ray's GCS, raylet, workers),
sampled every 0.2 s. Measured:

  * the single-process engine (`--engine local`) at `--local-sizes`: the named alternative;
  * the Ray Data engine (`--engine ray`) with 2 workers at every size, and with 1 worker at `--one-worker-sizes`;
  * where the Ray engine's time went, stage by stage (the manifest's `engine.stage_seconds`);
  * documents per second: documents read over the process's wall time (start-up included: a local Ray's start is
    part of what a user waits for).

The tokenizer's sample is capped (`--tokenizer-sample-lines`, the same for both engines) below the 1x corpus's lines,
so that what the tokenizer holds is fixed as the corpus grows, as it is at the default cap on a corpus past 2M lines.

    python benchmarks/prepare_scale.py --out benchmarks/results/prepare-scale-cpu-2core.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo" / "libreoffice-help" / "documents.jsonl.gz"


def shuffled(text: str, rng: random.Random) -> str:
    paragraphs = []
    for paragraph in text.split("\n\n"):
        words = paragraph.split()
        if len(words) >= 4:
            rng.shuffle(words)
            paragraphs.append(" ".join(words))
        else:
            chars = list(paragraph)
            rng.shuffle(chars)
            paragraphs.append("".join(chars))
    return "\n\n".join(paragraphs)


def replicated_input(target: Path, times: int) -> tuple[Path, int]:
    """The demo's raw documents `times` over (replica 0 is the original); returns the file and its documents."""
    rows = [json.loads(line) for line in gzip.open(DEMO, "rt", encoding="utf-8")]
    path = target / f"demo-{times}x.jsonl.gz"
    count = 0
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        for replica in range(times):
            for row in rows:
                if replica:
                    rng = random.Random(f"{replica}:{row.get('id')}")
                    row = {**row, "id": f"{row.get('id')}~{replica}", "group": f"{row.get('group')}~{replica}",
                           "text": shuffled(row["text"], rng)}
                    row.pop("paragraph_ids", None)  # a shuffled paragraph is no longer its translations' paragraph
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += 1
    return path, count


def tree_pss(root: psutil.Process) -> dict[str, int]:
    """PSS in bytes of `root` ("driver") and of its descendants, summed by process name (Ray's names its workers
    after what they run)."""
    out: dict[str, int] = {}
    for i, proc in enumerate([root, *root.children(recursive=True)]):
        try:
            pss = proc.memory_full_info().pss
            name = "driver" if i == 0 else proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[name] = out.get(name, 0) + pss
    return out


def measure(raw: Path, documents: int, engine: str, workers: int | None, sample_lines: int, work: Path) -> dict:
    out = work / f"out-{engine}-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "services.cli", "prepare", str(raw), "--out", str(out), "--vocab-size", "8000",
           "--tokenizer-sample-lines", str(sample_lines), "--engine", engine, "--skip-bad-documents"]
    if workers:
        cmd += ["--workers", str(workers)]
    env = {**os.environ, "MARGE_PROGRESS": "0", "PYTHONPATH": f"{REPO}:{REPO / 'shared'}"}
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    peak = {"total": 0, "driver": 0, "at_peak": {}}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                by_name = tree_pss(root)
            except psutil.NoSuchProcess:
                return
            total = sum(by_name.values())
            if total > peak["total"]:
                peak["total"], peak["at_peak"] = total, by_name
            peak["driver"] = max(peak["driver"], by_name.get("driver", 0))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.time() - started
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    shutil.rmtree(out)
    return {"engine": engine, "workers": workers, "documents_read": manifest["stats"]["documents_read"],
            "documents_skipped_bad": manifest["stats"].get("documents_skipped_bad", 0),
            "chunks_written": summary["num_documents"], "shards": summary["num_shards"], "wall_s": round(wall, 1),
            "documents_per_s": round(manifest["stats"]["documents_read"] / wall, 1),
            "peak_pss_mib": round(peak["total"] / 2**20, 1), "peak_driver_pss_mib": round(peak["driver"] / 2**20, 1),
            "pss_at_peak_mib": {name: round(b / 2**20, 1) for name, b in sorted(peak["at_peak"].items(),
                                                                              key=lambda kv: -kv[1])},
            "input_documents": documents, "stage_seconds": manifest["engine"].get("stage_seconds")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--local-sizes", default="1,4,16,64", help="sizes the single-process engine runs at")
    parser.add_argument("--one-worker-sizes", default="4,16", help="sizes the Ray engine also runs at with 1 worker")
    parser.add_argument("--tokenizer-sample-lines", type=int, default=40_000,
                        help="the tokenizer's sample cap for both engines (the 1x corpus has about 75k lines)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    one_worker = {int(s) for s in args.one_worker_sizes.split(",") if s}
    local = {int(s) for s in args.local_sizes.split(",") if s}
    work = Path(tempfile.mkdtemp(prefix="marge-prepare-scale-"))
    rows = []
    try:
        for times in sizes:
            raw, documents = replicated_input(work, times)
            runs = ([("local", None)] if times in local else []) + [("ray", 2)] + (
                [("ray", 1)] if times in one_worker else [])
            for engine, workers in runs:
                row = {"size": f"{times}x", "input_mib": round(raw.stat().st_size / 2**20, 2),
                       **measure(raw, documents, engine, workers, args.tokenizer_sample_lines, work)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            raw.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def peak(engine: str, workers: int | None, size: int) -> float | None:
        return next((r["peak_pss_mib"] for r in rows if r["engine"] == engine and r["workers"] == workers
                     and r["size"] == f"{size}x"), None)

    growth = {f"{engine}{'' if workers is None else f'-{workers}'}": {
        f"{lo}x_to_{hi}x": round(peak(engine, workers, hi) / peak(engine, workers, lo), 2)
        for lo in sizes for hi in sizes if lo < hi and peak(engine, workers, lo) and peak(engine, workers, hi)}
        for engine, workers in (("local", None), ("ray", 2))}
    speed = {r["size"]: r["documents_per_s"] for r in rows if r["engine"] == "ray" and r["workers"] == 1}
    two = {r["size"]: r["documents_per_s"] for r in rows if r["engine"] == "ray" and r["workers"] == 2}
    result = {"machine": f"{os.cpu_count()}-core CPU", "python": platform.python_version(),
              "command": "python benchmarks/prepare_scale.py " + " ".join(sys.argv[1:]),
              "tokenizer_sample_lines": args.tokenizer_sample_lines, "runs": rows,
              "peak_growth": growth,
              "two_workers_over_one": {size: round(two[size] / speed[size], 2) for size in speed if size in two}}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
