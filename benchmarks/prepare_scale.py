"""`marge prepare` at 1x, 4x, 16x and 64x the demo corpus: peak memory, documents per second and the Ray engine's
intermediate files, on Ray Data against the single-process engine and against the Ray engine of an earlier commit.

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
    part of what a user waits for);
  * the Ray engine's intermediate files: the files under each folder of its work folder (`.<out>.work/`, on the
    filesystem `--out` is on), counted with the memory while it runs (a stage's folder only grows until the work
    folder is removed at the end; a folder that lives less than 0.2 s, at 1x, can be missed), with the partitions
    each stage writes (the manifest's `engine`);
  * with `--before REF`: the same Ray runs with the code of git commit REF (its shared/ and services/, extracted
    into a temporary folder), one after the other on the same input: the engine before a change, against after.

The tokenizer's sample is capped (`--tokenizer-sample-lines`, the same for both engines) below the 1x corpus's lines,
so that what the tokenizer holds is fixed as the corpus grows, as it is at the default cap on a corpus past 2M lines.
With `--heldout-permille N` both engines also hold out that share of the groups (`heldout/`): what the driver of the
Ray engine once collected (every held-out document) and now leaves to its workers.

    python benchmarks/prepare_scale.py --out benchmarks/results/prepare-scale-cpu-2core.json
    python benchmarks/prepare_scale.py --before 183e6e0 --local-sizes "" --one-worker-sizes "" \
        --previous benchmarks/results/prepare-scale-cpu-2core.json --out benchmarks/results/prepare-scale-cpu-2core.json
    python benchmarks/prepare_scale.py --sizes 1,4,16 --before d300ed4 --local-sizes "" --one-worker-sizes "" \
        --heldout-permille 200 --out benchmarks/results/prepare-driver-bounded-cpu-2core.json
"""

from __future__ import annotations

import argparse
import contextlib
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


FOLDER_STAGES = {
    "documents": "read and check: documents by partition",
    "clean": "de-duplicate documents: training documents",
    "heldout": "de-duplicate documents: held-out documents",
    "chunks": "tokenize and chunk: chunks by partition",
    "chunks-clean": "de-duplicate chunks: chunks",
    "by-shard": "route to shards: chunks by shard group",
    "tokenizer-sample": "sample the tokenizer's lines: a sample per document partition, and per merge",
    "heldout-pairs": "held-out documents by group: translation pairs per partition",
}
"""The folders of the Ray engine's work folder (before and after the shuffles replaced the per-block partitioned
writes: the engine now writes clean, heldout, chunks-clean, tokenizer-sample and heldout-pairs), and the stage that
writes each."""


def files_under(folder: Path) -> int:
    count = 0
    try:
        for entry in os.scandir(folder):
            count += files_under(Path(entry.path)) if entry.is_dir(follow_symlinks=False) else 1
    except FileNotFoundError:  # removed while counted
        pass
    return count


def source_tree(ref: str, into: Path) -> Path:
    """The code that `marge prepare` runs (shared/, services/) at git commit `ref`, extracted into `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, "shared", "services"], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(raw: Path, documents: int, engine: str, workers: int | None, sample_lines: int, work: Path,
            code: Path = REPO, heldout_permille: int = 0) -> dict:
    out = work / f"out-{engine}-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "services.cli", "prepare", str(raw), "--out", str(out), "--vocab-size", "8000",
           "--tokenizer-sample-lines", str(sample_lines), "--engine", engine, "--skip-bad-documents"]
    if workers:
        cmd += ["--workers", str(workers)]
    if heldout_permille:
        cmd += ["--heldout-permille", str(heldout_permille)]
    env = {**os.environ, "MARGE_PROGRESS": "0", "PYTHONPATH": f"{code}:{code / 'shared'}"}
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    peak = {"total": 0, "driver": 0, "at_peak": {}}
    files: dict[str, int] = {}
    work_folder = out.parent / f".{out.name}.work"
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
            with contextlib.suppress(FileNotFoundError):  # the work folder comes and goes
                for folder in (f for f in work_folder.iterdir() if f.is_dir()):
                    files[folder.name] = max(files.get(folder.name, 0), files_under(folder))
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
    partitions = {k: manifest["engine"][k] for k in ("document_partitions", "chunk_partitions", "shard_groups")
                  if k in manifest["engine"]}
    return {"engine": engine, "workers": workers, "documents_read": manifest["stats"]["documents_read"],
            "documents_skipped_bad": manifest["stats"].get("documents_skipped_bad", 0),
            "chunks_written": summary["num_documents"], "shards": summary["num_shards"], "wall_s": round(wall, 1),
            "documents_per_s": round(manifest["stats"]["documents_read"] / wall, 1),
            "peak_pss_mib": round(peak["total"] / 2**20, 1), "peak_driver_pss_mib": round(peak["driver"] / 2**20, 1),
            "pss_at_peak_mib": {name: round(b / 2**20, 1) for name, b in sorted(peak["at_peak"].items(),
                                                                              key=lambda kv: -kv[1])},
            "input_documents": documents, "stage_seconds": manifest["engine"].get("stage_seconds"),
            **({"heldout": {k: manifest["heldout"][k] for k in ("groups", "documents", "pairs")}}
               if "heldout" in manifest else {}),
            **({"partitions": partitions, "intermediate_files": dict(sorted(files.items())),
                "intermediate_files_total": sum(files.values())} if engine == "ray" else {})}


def files_per_partition(row: dict) -> dict[str, float]:
    """Each work folder's files over the partitions of the stage that writes it (`FOLDER_STAGES`)."""
    per = {"documents": "document_partitions", "clean": "document_partitions", "heldout": "document_partitions",
           "chunks": "chunk_partitions", "chunks-clean": "chunk_partitions", "by-shard": "shard_groups"}
    return {folder: round(n / row["partitions"][per[folder]], 2) for folder, n in row["intermediate_files"].items()
            if folder in per}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--local-sizes", default="1,4,16,64", help="sizes the single-process engine runs at")
    parser.add_argument("--one-worker-sizes", default="4,16", help="sizes the Ray engine also runs at with 1 worker")
    parser.add_argument("--tokenizer-sample-lines", type=int, default=40_000,
                        help="the tokenizer's sample cap for both engines (the 1x corpus has about 75k lines)")
    parser.add_argument("--before", metavar="REF", default=None,
                        help="also run the Ray engine (2 workers) of git commit REF at every size, before this one's")
    parser.add_argument("--heldout-permille", type=int, default=0,
                        help="hold out this share of the groups in every run (0: none)")
    parser.add_argument("--previous", type=Path, default=None,
                        help="a results file of an earlier run, kept in this one's under `previous_run`")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    one_worker = {int(s) for s in args.one_worker_sizes.split(",") if s}
    local = {int(s) for s in args.local_sizes.split(",") if s}
    previous = json.loads(args.previous.read_text(encoding="utf-8")) if args.previous else None
    work = Path(tempfile.mkdtemp(prefix="marge-prepare-scale-"))
    before = source_tree(args.before, work / "before") if args.before else None
    rows = []
    try:
        for times in sizes:
            raw, documents = replicated_input(work, times)
            runs = ([("local", None, "current")] if times in local else []) + (
                [("ray", 2, "before")] if before else []) + [("ray", 2, "current")] + (
                [("ray", 1, "current")] if times in one_worker else [])
            for engine, workers, code in runs:
                row = {"size": f"{times}x", "input_mib": round(raw.stat().st_size / 2**20, 2), "code": code,
                       **measure(raw, documents, engine, workers, args.tokenizer_sample_lines, work,
                                 before if code == "before" else REPO, args.heldout_permille)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            raw.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def peak(engine: str, workers: int | None, size: int, code: str = "current") -> float | None:
        return next((r["peak_pss_mib"] for r in rows if r["engine"] == engine and r["workers"] == workers
                     and r["size"] == f"{size}x" and r["code"] == code), None)

    growth = {f"{engine}{'' if workers is None else f'-{workers}'}": {
        f"{lo}x_to_{hi}x": round(peak(engine, workers, hi) / peak(engine, workers, lo), 2)
        for lo in sizes for hi in sizes if lo < hi and peak(engine, workers, lo) and peak(engine, workers, hi)}
        for engine, workers in (("local", None), ("ray", 2))}
    speed = {r["size"]: r["documents_per_s"] for r in rows if r["engine"] == "ray" and r["workers"] == 1}
    two = {r["size"]: r["documents_per_s"] for r in rows if r["engine"] == "ray" and r["workers"] == 2
           and r["code"] == "current"}
    result = {"machine": f"{os.cpu_count()}-core CPU", "python": platform.python_version(),
              "command": "python benchmarks/prepare_scale.py " + " ".join(sys.argv[1:]),
              "tokenizer_sample_lines": args.tokenizer_sample_lines, "heldout_permille": args.heldout_permille,
              "before": ({"ref": args.before, "commit": subprocess.run(
                  ["git", "rev-parse", args.before], cwd=REPO, capture_output=True, text=True).stdout.strip()}
                  if args.before else None),
              "folder_stages": FOLDER_STAGES, "runs": rows,
              "intermediate_files": {r["size"]: {**{r2["code"]: {
                  "files": r2["intermediate_files"], "total": r2["intermediate_files_total"],
                  "partitions": r2["partitions"], "files_per_partition": files_per_partition(r2),
                  "peak_driver_pss_mib": r2["peak_driver_pss_mib"], "peak_pss_mib": r2["peak_pss_mib"],
                  "wall_s": r2["wall_s"]}
                  for r2 in rows if r2["size"] == r["size"] and r2["engine"] == "ray" and r2["workers"] == 2}}
                  for r in rows if r["engine"] == "ray"},
              "peak_growth": growth,
              "two_workers_over_one": {size: round(two[size] / speed[size], 2) for size in speed if size in two}}
    if previous is not None:
        result["previous_run"] = previous
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "previous_run")}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
