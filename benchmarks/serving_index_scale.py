"""The serving index of the whole corpus (`marge index build`) at 1x, 4x and 16x the demo corpus: its memory
against the vectors' own bytes, its recall@10 against exact search, and what building it costs.

For each size the demo corpus is replicated in the corpus format (benchmarks/serve_scale.py's `replicate_corpus`:
replica k renumbers doc ids and shards and maps token ids through a vocabulary permutation seeded by k, so its
documents get vectors of their own), and a serving index is built with the newest snapshot of a trained run
(`--run`, e.g. the one `bash scripts/demo.sh` leaves in runs/). Measured per size:

  * the build: seconds, documents, lists, the nprobe chosen and the recall@10 it reached (exact top 10 computed
    shard by shard at build, on 200 documents' own vectors as queries);
  * memory: the resident memory a fresh process gains loading the index for serving (`FullCorpusIndex`: the codes,
    the lists, one bit a document per language), after the service's document table and the snapshot's encoder
    (reported beside it: the model, the same whatever the corpus size), against the vectors' float32 bytes, the
    memory a flat index of the same documents needs (the layout of the training index versions, which the service
    loads otherwise);
  * the index file's bytes.

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

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO), str(REPO / "benchmarks")]

LOAD_PROBE = """
import json, resource, sys
from pathlib import Path
sys.path[:0] = [sys.argv[4], sys.argv[5]]
from marge.corpus import Corpus

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

corpus = Corpus.open(sys.argv[2], verify_checksums=False)
tokenizer = corpus.tokenizer()
import faiss, numpy, torch  # imported before the baseline: their code is not the index
from marge.snapshot import latest_snapshot, load_relevance_encoder
from services.retrieval.full_index import FullCorpusIndex
from services.retrieval.index import DocumentTable
docs = DocumentTable(corpus)  # the service's own table (18 bytes a document), there with any index
before = rss_mb()
encoder = load_relevance_encoder(latest_snapshot(Path(sys.argv[3]) / "snapshots"))  # the model, not the index
with_encoder = rss_mb()
index = FullCorpusIndex(Path(sys.argv[1]), Path(sys.argv[3]), corpus, tokenizer, docs=docs, encoder=encoder)
after = rss_mb()
print(json.dumps({"rss_gain_mb": after - with_encoder, "encoder_mb": with_encoder - before,
                  "documents": int(index.index.ntotal)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a trained run: its newest snapshot and its corpus")
    p.add_argument("--times", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--codec", default="sq8", choices=("sq8", "pq"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import yaml

    from marge.corpus import Corpus
    from marge.snapshot import latest_snapshot, read_snapshot
    from serve_scale import replicate_corpus
    from services.retrieval.full_index import BuildOptions, build_serving_index, read_build

    source = Path(yaml.safe_load((args.run / "config.yaml").read_text())["data"]["corpus"])
    snapshot = latest_snapshot(args.run / "snapshots")
    if snapshot is None:
        raise SystemExit(f"{args.run / 'snapshots'} holds no snapshot: train first (bash scripts/demo.sh)")
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for times in args.times:
            corpus_dir = replicate_corpus(source, Path(tmp) / f"corpus-{times}x", times) if times > 1 else source
            run = Path(tmp) / f"run-{times}x"
            shutil.copytree(snapshot.path, run / "snapshots" / snapshot.path.name)
            (run / "snapshots" / "LATEST").write_text(json.dumps({"step": snapshot.step, "dir": snapshot.path.name}))
            started = time.perf_counter()
            built = build_serving_index(run, Corpus.open(corpus_dir, verify_checksums=False), read_snapshot(
                run / "snapshots" / snapshot.path.name), BuildOptions(codec=args.codec))
            seconds = time.perf_counter() - started
            manifest = read_build(built)
            probe = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(built), str(corpus_dir), str(run),
                                    str(REPO / "shared"), str(REPO)], capture_output=True, text=True, check=True)
            loaded = json.loads(probe.stdout.strip().splitlines()[-1])
            vector_mb = manifest["vector_bytes"] / 2**20
            sizes[f"{times}x"] = {
                "documents": manifest["documents"], "factory": manifest["factory"], "nprobe": manifest["nprobe"],
                "recall_at_10": manifest["recall_at_10"], "recall_by_nprobe": manifest["recall_by_nprobe"],
                "build_seconds": round(seconds, 1), "index_file_mb": manifest["index_bytes"] / 2**20,
                "vectors_mb": vector_mb, "loaded_rss_gain_mb": loaded["rss_gain_mb"], "encoder_mb": loaded["encoder_mb"],
                "loaded_over_vectors": loaded["rss_gain_mb"] / vector_mb}
            print(f"{times:3d}x: {manifest['documents']:>9,} documents, {manifest['factory']} nprobe {manifest['nprobe']}: "
                  f"recall@10 {manifest['recall_at_10']:.3f}; loaded {loaded['rss_gain_mb']:.1f} MiB against "
                  f"{vector_mb:.1f} MiB of vectors ({loaded['rss_gain_mb'] / vector_mb:.2f}x); built in {seconds:.0f} s",
                  flush=True)
    report = {"command": "python benchmarks/serving_index_scale.py --run RUN"
                         + (f" --out {args.out}" if args.out else ""),
              "snapshot_step": snapshot.step, "codec": args.codec,
              "machine": {"cpus": os.cpu_count(), "platform": platform.machine()}, "sizes": sizes}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
