"""The serving index of the whole corpus (`marge index build`) at 1x, 4x and 16x the demo corpus: its memory
against the vectors' own bytes, its recall@10 against exact search, what building it costs in one process and on
Ray, and the full-corpus service's search latency.

For each size the demo corpus is replicated in the corpus format (benchmarks/serve_scale.py's `replicate_corpus`:
replica k renumbers doc ids and shards and maps token ids through a vocabulary permutation seeded by k, so its
documents get vectors of their own), and serving indexes are built with the newest snapshot of a trained run
(`--run`, e.g. the one `bash scripts/demo.sh` leaves in runs/). Measured per size:

  * the build, once per engine (`--engines`, default `local ray`), each a real `marge index build --engine E`
    process one after the other on the same run: the seconds its build took (`build_seconds` in the manifest: for
    Ray, from the cluster being up), the command's wall time (with the interpreter's imports and, for Ray, a local
    Ray's start and stop), the driver's peak resident memory (its own VmHWM, which counts the pages of the lists
    file it writes through its mapping, and its peak RssAnon, sampled every 10 ms from /proc: what it holds of its
    own; Ray's worker processes are in neither), the lists, the nprobe chosen and the recall@10 it reached (exact
    top 10 computed shard by shard at build, on 200 documents' own vectors as queries), and whether the engines'
    index files (index.faiss and the lists file) are byte for byte the same;
  * memory: what a fresh process gains opening the index for serving (`FullCorpusIndex`: the quantiser and the
    lists' headers read, the lists file mapped, one bit a document per language), after the service's document
    table and the snapshot's encoder (reported beside it: the model, the same whatever the corpus size): its
    resident memory (with the pages of the lists file it has touched: building the language bitmaps reads every
    doc id) and its anonymous memory, against the vectors' float32 bytes, the memory a flat index of the same
    documents needs (the layout of the training index versions, which the service loads otherwise);
  * the service: a real `marge serve --full-corpus` on loopback, one client sending `--requests` text searches
    (k=10, texts of corpus documents) and then searches by doc id, one after the other: p50 and p99 per request,
    through HTTP, each answer's hits described from the Parquet shards (`--no-service` skips it).

    python benchmarks/serving_index_scale.py --run runs/demo-YYYYMMDD-HHMMSS --out benchmarks/results/serving-index-scale-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO), str(REPO / "benchmarks")]

LOAD_PROBE = """
import json, resource, sys
from pathlib import Path
sys.path[:0] = [sys.argv[4], sys.argv[5]]
from marge.contracts.corpus import Corpus

def rss_mb(key="VmRSS"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024

corpus = Corpus.open(sys.argv[2], verify_checksums=False)
tokenizer = corpus.tokenizer()
import faiss, numpy, torch  # imported before the baseline: their code is not the index
from marge.model.snapshot import latest_snapshot, load_relevance_encoder
from services.retrieval.serving_index import FullCorpusIndex
from services.retrieval.version_index import DocumentTable
docs = DocumentTable(corpus)  # the service's own table (18 bytes a document), there with any index
before = rss_mb()
encoder = load_relevance_encoder(latest_snapshot(Path(sys.argv[3]) / "snapshots"))  # the model, not the index
with_encoder, anon_with_encoder = rss_mb(), rss_mb("RssAnon")
index = FullCorpusIndex(Path(sys.argv[1]), Path(sys.argv[3]), corpus, tokenizer, docs=docs, encoder=encoder)
after = rss_mb()
print(json.dumps({"rss_gain_mb": after - with_encoder, "anon_gain_mb": rss_mb("RssAnon") - anon_with_encoder,
                  "encoder_mb": with_encoder - before, "documents": int(index.index.ntotal), "layout": index.layout}))
"""

BUILD = """
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
started = time.perf_counter()
from services.cli import main
code = main(sys.argv[3:])
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
print(json.dumps({"code": code, "wall_s": time.perf_counter() - started, "driver_peak_mb": peak}), file=sys.stderr)
"""


def build(run: Path, corpus_dir: Path, engine: str, workers: int, codec: str) -> dict:
    """One `marge index build --engine ENGINE` process: its JSON line, its wall time, its driver's peak RSS and its
    peak anonymous memory (sampled from here)."""
    from serving_index_merge import rss_anon

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", BUILD, str(REPO / "shared"), str(REPO), "index", "build",
                                 "--run", str(run), "--corpus", str(corpus_dir), "--codec", codec, "--engine", engine,
                                 "--workers", str(workers)], stdout=out, stderr=err, text=True, env=env, cwd=REPO)
        peak_anon = 0
        while proc.poll() is None:
            peak_anon = max(peak_anon, rss_anon(proc.pid) or 0)
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"marge index build --engine {engine} exited {proc.returncode}:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    measured = json.loads(stderr.strip().splitlines()[-1])
    return {**result, **measured, "driver_peak_anon_mb": peak_anon / 2**20, "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0]}


def percentiles(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1000
    return {"requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "mean_ms": round(float(ms.mean()), 2)}


def service_latency(run: Path, corpus_dir: Path, queries: list[str], doc_ids: list[int]) -> dict:
    """A real `marge serve --full-corpus`: one client, text searches then searches by doc id, one at a time."""
    import httpx
    from serve_scale import Service, memory_kib

    service = Service(REPO, run, corpus_dir, ["--full-corpus"])
    try:
        ready_s = service.wait_ready()
        loaded = memory_kib(service.process.pid)
        out = {"ready_s": round(ready_s, 1), "rss_mib_loaded": round(loaded["VmRSS"] / 1024, 1)}
        with httpx.Client(base_url=service.base, timeout=60) as http:
            for name, bodies in (("text", [{"query": q, "k": 10} for q in queries]),
                                 ("doc_id", [{"doc_id": d, "k": 10} for d in doc_ids])):
                http.post("/v1/search", json=bodies[0]).raise_for_status()  # warm
                seconds = []
                for body in bodies:
                    t0 = time.perf_counter()
                    http.post("/v1/search", json=body).raise_for_status()
                    seconds.append(time.perf_counter() - t0)
                out[name] = percentiles(seconds)
        out["rss_mib_peak"] = round(memory_kib(service.process.pid)["VmHWM"] / 1024, 1)
    finally:
        service.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a trained run: its newest snapshot and its corpus")
    p.add_argument("--times", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--codec", default="sq8", choices=("sq8", "pq"))
    p.add_argument("--engines", nargs="+", default=["local", "ray"], choices=("local", "ray"))
    p.add_argument("--workers", type=int, default=2, help="Ray tasks at once (a local Ray of as many CPUs)")
    p.add_argument("--repeats", type=int, default=1,
                   help="builds per engine, the engines' order alternating (local ray, ray local, ...)")
    p.add_argument("--requests", type=int, default=200, help="text searches, and searches by doc id, per service")
    p.add_argument("--no-service", action="store_true", help="skip the service's latency")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import yaml
    from serve_scale import replicate_corpus

    from marge.contracts.corpus import Corpus
    from marge.model.snapshot import latest_snapshot
    from services.retrieval.serving_index import read_build

    source = Path(yaml.safe_load((args.run / "config.yaml").read_text())["data"]["corpus"])
    snapshot = latest_snapshot(args.run / "snapshots")
    if snapshot is None:
        raise SystemExit(f"{args.run / 'snapshots'} holds no snapshot: train first (bash scripts/demo.sh)")
    shard = Corpus.open(source, verify_checksums=False).read_shard(0)
    queries = [t for t in shard.texts if 20 <= len(t) <= 300][:args.requests]
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for times in args.times:
            corpus_dir = replicate_corpus(source, Path(tmp) / f"corpus-{times}x", times) if times > 1 else source
            run = Path(tmp) / f"run-{times}x"
            shutil.copytree(snapshot.path, run / "snapshots" / snapshot.path.name)
            (run / "snapshots" / "LATEST").write_text(json.dumps({"step": snapshot.step, "dir": snapshot.path.name}))
            (run / "config.yaml").write_text(yaml.safe_dump({"data": {"corpus": str(corpus_dir)}}))
            builds: dict[str, list[dict]] = {engine: [] for engine in args.engines}
            for repeat in range(args.repeats):  # ABBA...: the load other processes put on the machine hits both
                for engine in (args.engines if repeat % 2 == 0 else args.engines[::-1]):
                    built = build(run, corpus_dir, engine, args.workers, args.codec)
                    manifest = read_build(Path(built["path"]))
                    builds[engine].append({
                        "build_seconds": manifest["build_seconds"], "wall_s": round(built["wall_s"], 1),
                        "outside_build_s": round(built["wall_s"] - manifest["build_seconds"], 1),
                        "driver_peak_mb": round(built["driver_peak_mb"], 1),
                        "driver_peak_anon_mb": round(built["driver_peak_anon_mb"], 1), "engine": manifest["engine"],
                        "nprobe": manifest["nprobe"], "recall_at_10": manifest["recall_at_10"],
                        "index_sha256": manifest["index_sha256"], "data_sha256": manifest.get("data_sha256"),
                        "load_average_before_after": [round(built["load_average_before"], 2),
                                                      round(built["load_average_after"], 2)]})
                    print(f"{times:3d}x {engine:>5}: built in {manifest['build_seconds']:.1f} s (command "
                          f"{built['wall_s']:.1f} s), driver peak {built['driver_peak_mb']:.0f} MiB (anonymous "
                          f"{built['driver_peak_anon_mb']:.0f} MiB), recall@10 "
                          f"{manifest['recall_at_10']:.3f}, load {built['load_average_before']:.1f} -> "
                          f"{built['load_average_after']:.1f}", flush=True)
            manifest = read_build(Path(built["path"]))
            probe = subprocess.run([sys.executable, "-c", LOAD_PROBE, built["path"], str(corpus_dir), str(run),
                                    str(REPO / "shared"), str(REPO)], capture_output=True, text=True, check=True)
            loaded = json.loads(probe.stdout.strip().splitlines()[-1])
            vector_mb = manifest["vector_bytes"] / 2**20
            size = {
                "documents": manifest["documents"], "factory": manifest["factory"], "nprobe": manifest["nprobe"],
                "recall_at_10": manifest["recall_at_10"], "recall_by_nprobe": manifest["recall_by_nprobe"],
                "builds": builds, "layout": loaded["layout"], "index_file_mb": manifest["index_bytes"] / 2**20,
                "vectors_mb": vector_mb, "loaded_rss_gain_mb": loaded["rss_gain_mb"],
                "loaded_anon_gain_mb": loaded["anon_gain_mb"], "encoder_mb": loaded["encoder_mb"],
                "loaded_over_vectors": loaded["rss_gain_mb"] / vector_mb}
            size["same_index_bytes_every_build"] = len({(b["index_sha256"], b["data_sha256"])
                                                        for runs in builds.values() for b in runs}) == 1
            if len(builds) == 2:
                for name, reduce in (("median", np.median), ("best", np.min)):  # best: the least disturbed run
                    summary = {engine: {key: float(reduce([b[key] for b in runs])) for key in
                                        ("build_seconds", "wall_s", "driver_peak_mb", "driver_peak_anon_mb")}
                               for engine, runs in builds.items()}
                    size[name] = summary
                    size[f"ray_over_local_build_seconds_{name}"] = (summary["ray"]["build_seconds"]
                                                                    / summary["local"]["build_seconds"])
                    size[f"ray_over_local_wall_{name}"] = summary["ray"]["wall_s"] / summary["local"]["wall_s"]
            print(f"{times:3d}x: {manifest['documents']:>9,} documents, {manifest['factory']} nprobe {manifest['nprobe']}: "
                  f"recall@10 {manifest['recall_at_10']:.3f}; loaded {loaded['rss_gain_mb']:.1f} MiB (anonymous "
                  f"{loaded['anon_gain_mb']:.1f} MiB) against "
                  f"{vector_mb:.1f} MiB of vectors ({loaded['rss_gain_mb'] / vector_mb:.2f}x)", flush=True)
            if not args.no_service:
                corpus = Corpus.open(corpus_dir, verify_checksums=False)
                ids = np.concatenate([corpus.read_shard(s).doc_ids for s in range(0, corpus.num_shards, max(1, times))])
                doc_ids = [int(i) for i in np.random.default_rng(0).choice(ids, args.requests, replace=False)]
                size["service"] = service_latency(run, corpus_dir, queries, doc_ids)
                print(f"{times:3d}x service: text p50 {size['service']['text']['p50_ms']} ms p99 "
                      f"{size['service']['text']['p99_ms']} ms; doc id p50 {size['service']['doc_id']['p50_ms']} ms "
                      f"p99 {size['service']['doc_id']['p99_ms']} ms; RSS {size['service']['rss_mib_loaded']} MiB",
                      flush=True)
            sizes[f"{times}x"] = size
            argv = ["RUN" if a == str(args.run) else a for a in sys.argv[1:]]
            report = {"command": "python benchmarks/serving_index_scale.py " + " ".join(argv),
                      "snapshot_step": snapshot.step, "codec": args.codec, "workers": args.workers,
                      "machine": {"cpus": os.cpu_count(), "platform": platform.machine()}, "sizes": sizes}
            if args.out:  # after every size: a run cut short keeps the sizes it finished
                args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
