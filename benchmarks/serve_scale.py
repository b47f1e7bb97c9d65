"""The retrieval service at 1x and 16x the demo corpus: memory, latency under load, recall, before and after.

"Before" is the service as it was at a given commit (default: the one before the service stopped holding the
corpus), exported with `git archive` and started from its own files; "after" is this tree. Each service is a real
`marge serve` process on loopback, serving index version 0 of a run built here (a tiny model's snapshot and an
index of every document, built by the indexer's own `index_corpus`). The 16x corpus is the demo corpus 16 times
over in the real formats: replica k renumbers doc ids and shards and maps token ids through a permutation of the
vocabulary seeded by k, so its documents get vectors of their own (texts are the originals'). Measured per
service:

  * RSS after the index is loaded, and its peak (VmHWM) after the load test;
  * latency under a bounded load: `--clients` loopback clients, each sending `--requests` searches in turn
    (text queries from the corpus, k=10), p50 and p99 and requests/s;
  * recall@10 of the 16x service against exact search (the `flat` service on the same run), from the API's answers
    to the same queries by doc id.

    python benchmarks/serve_scale.py --out benchmarks/results/serve-scale-cpu-2core.json
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
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SPECIAL_IDS = 16
"""Token ids below this (the tokenizer's specials and language tags among them) are kept by the replica permutation."""


def replicate_corpus(source: Path, target: Path, times: int) -> Path:
    """`source` (a prepared corpus) `times` over, in the corpus format: see the module docstring."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from marge.contracts.corpus import Corpus
    from marge.util.files import sha256_file

    corpus = Corpus.open(source)
    manifest = json.loads((source / "manifest.json").read_text(encoding="utf-8"))
    vocab = int(manifest["tokenizer"]["vocab_size"])
    (target / "shards").mkdir(parents=True)
    for name in manifest["tokenizer"]["files"]:
        shutil.copy(source / name, target / name)
    max_id = max(int(pq.read_table(source / info.file, columns=["doc_id"]).column("doc_id").to_numpy().max())
                 for info in corpus.shards) + 1
    shards = []
    for k in range(times):
        mapping = np.arange(vocab, dtype=np.int32)  # replica 0 is the corpus itself
        if k:
            mapping[SPECIAL_IDS:] = SPECIAL_IDS + np.random.default_rng(k).permutation(vocab - SPECIAL_IDS)
        for info in corpus.shards:
            table = pq.read_table(source / info.file)
            number = k * corpus.num_shards + info.shard
            tokens = table.column("tokens").combine_chunks()
            mapped = pa.ListArray.from_arrays(tokens.offsets, pa.array(mapping[tokens.values.to_numpy()], pa.int32()))
            columns = {name: table.column(name) for name in table.column_names}
            columns["doc_id"] = pa.array(table.column("doc_id").to_numpy() + k * max_id, pa.int64())
            columns["shard"] = pa.array(np.full(table.num_rows, number), table.schema.field("shard").type)
            columns["tokens"] = mapped.cast(table.schema.field("tokens").type)
            out = pa.table(columns, schema=table.schema)
            name = f"shards/shard-{number:05d}.parquet"
            pq.write_table(out, target / name, compression="zstd")
            shards.append({"shard": number, "file": name, "rows": info.rows, "tokens": info.tokens,
                           "sha256": sha256_file(target / name)})
    manifest.update(shards=shards, num_shards=len(shards), num_documents=times * manifest["num_documents"],
                    num_tokens=times * manifest["num_tokens"],
                    languages={lang: times * n for lang, n in manifest["languages"].items()})
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return target


def build_run(run: Path, corpus_dir: Path, seed: int = 0) -> float:
    """A snapshot of a tiny model and index version 0 of every document with it; returns the build seconds."""
    import torch
    import yaml

    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.network import Marge
    from marge.model.snapshot import load_relevance_encoder, publish_snapshot
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus

    corpus = Corpus.open(corpus_dir)
    tok = corpus.tokenizer()
    torch.manual_seed(seed)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128, relevance_pooling="mean",
                         relevance_centering=False))
    snapshot = publish_snapshot(run / "snapshots", model, 0, tok.sha256)
    started = time.perf_counter()
    index_corpus(corpus, load_relevance_encoder(snapshot), tok.specials, run / "index", 0, 0, IndexerConfig())
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"corpus": str(corpus_dir)}}))
    return time.perf_counter() - started


def exported(ref: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="marge-before-"))
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def memory_kib(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


class Service:
    """`marge serve` from `tree` on a free loopback port, until stopped."""

    def __init__(self, tree: Path, run: Path, corpus: Path, extra: list[str]):
        from services.driver.redis_server import free_port

        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": f"{tree / 'shared'}:{tree}", "MARGE_API_TOKEN": ""}
        env.pop("MARGE_API_TOKEN")
        self.log = tempfile.TemporaryFile()
        self.started = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--run", str(run), "--corpus",
                                         str(corpus), "--port", str(self.port), "--max-k", "20", *extra],
                                        cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 900) -> float:
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"marge serve exited {self.process.returncode}:\n{self.log.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{self.base}/healthz", timeout=2).json().get("status") == "ok":
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"marge serve did not load its index within {timeout_s} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def load_test(base: str, queries: list[str], clients: int, requests: int) -> dict:
    """`clients` threads, each sending `requests` text searches one after the other."""
    import httpx

    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            for i in range(requests):
                query = queries[(c * requests + i) % len(queries)]
                t0 = time.perf_counter()
                response = http.post("/v1/search", json={"query": query, "k": 10})
                elapsed = time.perf_counter() - t0
                with lock:
                    latencies.append(elapsed)
                    failures[0] += response.status_code != 200

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {"requests": len(latencies), "failed": failures[0], "clients": clients,
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "requests_per_s": round(len(latencies) / wall, 1)}


def neighbours_by_id(base: str, doc_ids: list[int]) -> list[list[int]]:
    import httpx

    with httpx.Client(base_url=base, timeout=60) as http:
        return [[h["doc_id"] for h in http.post("/v1/search", json={"doc_id": d, "k": 10}).json()["results"]]
                for d in doc_ids]


def measure(name: str, tree: Path, run: Path, corpus: Path, extra: list[str], queries: list[str], clients: int,
            requests: int, probe_ids: list[int]) -> tuple[dict, list[list[int]]]:
    import httpx

    service = Service(tree, run, corpus, extra)
    try:
        ready_s = service.wait_ready()
        loaded = memory_kib(service.process.pid)
        info = httpx.get(f"{service.base}/v1/index", timeout=10).json()
        load = load_test(service.base, queries, clients, requests)
        found = neighbours_by_id(service.base, probe_ids)
        after = memory_kib(service.process.pid)
    finally:
        service.stop()
    print(f"{name}: ready in {ready_s:.1f} s, RSS {loaded['VmRSS'] / 1024:.0f} MiB, p50 {load['p50_ms']} ms, "
          f"p99 {load['p99_ms']} ms", flush=True)
    return {"ready_s": round(ready_s, 1), "rss_mib_loaded": round(loaded["VmRSS"] / 1024, 1),
            "rss_mib_peak": round(after["VmHWM"] / 1024, 1), "documents": info.get("documents"),
            "index_type": info.get("index_type", "flat (3 copies: all, per language, and the vectors)"),
            "recall_at_10_at_load": info.get("recall_at_10"), **load}, found


def recall(found: list[list[int]], exact: list[list[int]]) -> float:
    return float(np.mean([len(set(a) & set(b)) / max(1, len(b)) for a, b in zip(found, exact)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="c58aaa9", help="the commit whose service to compare with")
    parser.add_argument("--corpus", type=Path, default=REPO / "data/prepared/demo-paragraphs")
    parser.add_argument("--times", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=100, help="per client")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "shared"), str(REPO)]
    from marge.contracts.corpus import Corpus

    work = Path(tempfile.mkdtemp(prefix="marge-serve-scale-"))
    before = exported(args.before)
    try:
        corpora = {1: args.corpus, args.times: replicate_corpus(args.corpus, work / f"corpus-x{args.times}", args.times)}
        shard = Corpus.open(args.corpus).read_shard(0)
        queries = [t for t in shard.texts if 20 <= len(t) <= 300][:200]
        result = {"command": "python benchmarks/serve_scale.py " + " ".join(sys.argv[1:]), "before_commit": args.before,
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores", "scales": {}}
        for times, corpus in corpora.items():
            run = work / f"run-x{times}"
            build_s = build_run(run, corpus)
            ids = np.random.default_rng(0).choice(
                np.concatenate([Corpus.open(corpus).read_shard(s).doc_ids for s in range(0, Corpus.open(corpus).num_shards,
                                                                                          max(1, times))]), 100, replace=False)
            probe = [int(i) for i in ids]
            scale = {"documents": Corpus.open(corpus).manifest["num_documents"], "index_build_s": round(build_s, 1)}
            scale["before"], exact_before = measure(f"x{times} before", before, run, corpus, [], queries, args.clients,
                                                    args.requests, probe)
            scale["after_flat"], exact = measure(f"x{times} after (flat)", REPO, run, corpus, ["--index-type", "flat"],
                                                 queries, args.clients, args.requests, probe)
            scale["after_auto"], found = measure(f"x{times} after (auto)", REPO, run, corpus, ["--index-type", "auto"],
                                                 queries, args.clients, args.requests, probe)
            scale["after_auto"]["recall_at_10_vs_flat_api"] = recall(found, exact)
            scale["before_flat_vs_after_flat_same_neighbours"] = recall(exact_before, exact)
            scale["rss_before_over_after_auto"] = round(scale["before"]["rss_mib_loaded"]
                                                        / scale["after_auto"]["rss_mib_loaded"], 2)
            result["scales"][f"x{times}"] = scale
        one, many = result["scales"]["x1"], result["scales"][f"x{args.times}"]
        result["rss_growth_x1_to_x%d" % args.times] = {
            kind: round(many[kind]["rss_mib_loaded"] / one[kind]["rss_mib_loaded"], 2)
            for kind in ("before", "after_flat", "after_auto")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(before, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
