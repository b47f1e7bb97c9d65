"""Index refresh time against corpus size: the sampled refresh (`indexer.shards_per_version: k`) against the full one.

The paper's refresh (§2.4) embeds a sample of k shards per index version, drawn from the run's seed and the version
(`services.indexer.core.sampled_shards`), so its cost should not depend on how many shards the corpus has. This
benchmark builds corpora of 1x, 4x and 16x a base corpus in the real formats (Parquet shards and manifest:
`replicate_corpus` of benchmarks/serve_scale.py, whose replica k renumbers doc ids and shards and permutes the
vocabulary, so every replica's documents get vectors of their own) and times refreshes on each, two ways in the
same run:

  sampled   `indexer.shards_per_version: k` (default k=8): each version embeds and links its k sampled shards
  full      `indexer.shards_per_version: 0` (the default): every version embeds and links every shard
            (at 1x and 4x by default; 16x with `--full-sizes 1,4,16`, several minutes per version on 2 cores)

The 1x corpus is the prepared demo corpus of deploy/configs/tiny.yaml (`data.corpus`; prepared from `data.raw`
first when missing), replicated as many times as it takes to have `--min-shards` shards (once when it has that
many already), and rewritten by `replicate_corpus` like the larger ones, so every size is written the same way.

One refresh is what the Ray indexer does for a version (services/indexer/actor.py), in one process and one worker:
open the corpus (its manifest and the listing of its shard files; the Ray workers and coordinator do this once
when they start), then `build_version` (the coordinator's call: plan the version's shards, index them, commit the
FAISS files, link graphs and manifest, append the build record) with `index_shards` doing what an
`IndexerWorker.index_shards` call does (read the snapshot, load g, then `index_shard` for every shard: read and
check it, embed, link, write). The snapshot is a freshly initialised model of tiny.yaml's architecture, published
at the version's update (v * `indexer.reindex_every`), with tiny.yaml's `indexer:` section (so versions after the
first link by cos(g) + lambda * tfidf) and, like a worker, `indexer.num_cpus_per_worker` torch threads. Versions
1..repeats are built in turn (a different sample each, as in a run), after `--warmup` untimed ones; sizes take turns
within each repeat, so drift of a shared machine spreads over all of them. Reported per size and way: every
refresh's seconds and their median, documents embedded, shards in the version's manifest, and where the time went
(opening the corpus, embedding, linking, the rest). About 5 minutes on a 2-core CPU:

    python benchmarks/refresh_scale.py --out benchmarks/results/refresh-scale-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "deploy/configs/tiny.yaml"


def relative(path: Path) -> str:
    """`path` as the output names it: relative to the repository, never an absolute machine path."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def base_corpus(cfg, corpus: Path | None) -> Path:
    """The corpus to replicate: `corpus`, else tiny.yaml's `data.corpus`, prepared from `data.raw` when missing (the
    driver's `ensure_corpus`)."""
    if corpus is not None:
        return corpus.resolve()
    if not (REPO / cfg.data.corpus / "manifest.json").exists():
        from services.driver.pipeline import ensure_corpus

        cwd = os.getcwd()
        os.chdir(REPO)  # the config's paths are relative to the repository
        try:
            ensure_corpus(cfg)
        finally:
            os.chdir(cwd)
    return (REPO / cfg.data.corpus).resolve()


class Run:
    """A run folder for one corpus and one way of refreshing: the snapshots, the index, the build log."""

    def __init__(self, folder: Path, corpus_dir: Path, cfg, model, tokenizer_sha256: str, versions: list[int]):
        from marge.model.snapshot import publish_snapshot

        self.folder, self.corpus_dir, self.cfg = folder, corpus_dir, cfg
        self.snapshots, self.index = folder / "snapshots", folder / "index"
        for version in versions:  # the snapshot each version is built from (publishing is the trainer's cost)
            publish_snapshot(self.snapshots, model, version * cfg.indexer.reindex_every, tokenizer_sha256)

    def refresh(self, version: int) -> dict:
        """Build index version `version` the way the indexer does (see the module docstring); its figures."""
        from marge.contracts.corpus import Corpus
        from marge.model.snapshot import load_relevance_encoder, read_snapshot, snapshot_dirname
        from services.indexer.core import build_version, index_shard

        cfg = self.cfg
        step = version * cfg.indexer.reindex_every
        started = time.perf_counter()
        corpus = Corpus.open(self.corpus_dir)  # the worker's __init__
        specials = corpus.tokenizer().specials
        opened = time.perf_counter()

        def index_shards(shards: list[int], staging: Path) -> list[dict]:  # IndexerWorker.index_shards
            encoder = load_relevance_encoder(read_snapshot(self.snapshots / snapshot_dirname(step)), "cpu")
            return [index_shard(corpus.read_shard(s), encoder, specials, staging, cfg.indexer, device="cpu",
                                seed=cfg.run.seed + s, snapshot_step=step).as_manifest_entry() for s in shards]

        committed, record = build_version(self.index, self.folder, version, step, corpus.num_shards, cfg.indexer,
                                          index_shards, workers=1, seed=cfg.run.seed)
        seconds = time.perf_counter() - started
        manifest = json.loads((committed.path / "manifest.json").read_text(encoding="utf-8"))
        return {"version": version, "seconds": round(seconds, 3), "open_corpus_s": round(opened - started, 3),
                "embed_s": record["embed_seconds"], "link_s": record["link_seconds"],
                "other_s": round(seconds - (opened - started) - record["embed_seconds"] - record["link_seconds"], 3),
                "documents_embedded": record["documents_embedded"], "shards_in_manifest": len(manifest["shards"]),
                "shards_rebuilt": record["shards_rebuilt"], "link_sources": record["link_sources"]}


def summary(refreshes: list[dict]) -> dict:
    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in refreshes), 3)

    per_k_docs = [1000 * r["seconds"] / max(1, r["documents_embedded"]) for r in refreshes]
    return {"median_s": median("seconds"), "seconds": [r["seconds"] for r in refreshes],
            "median_s_per_1k_documents": round(statistics.median(per_k_docs), 3),
            "median_open_corpus_s": median("open_corpus_s"), "median_embed_s": median("embed_s"),
            "median_link_s": median("link_s"), "median_other_s": median("other_s"),
            "documents_embedded": [r["documents_embedded"] for r in refreshes],
            "shards_in_manifest": [r["shards_in_manifest"] for r in refreshes], "refreshes": refreshes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8, help="indexer.shards_per_version of the sampled refresh")
    parser.add_argument("--sizes", default="1,4,16", help="corpus sizes, in multiples of the 1x corpus")
    parser.add_argument("--full-sizes", default="1,4", help="sizes at which to time the full refresh too ('' for none)")
    parser.add_argument("--repeats", type=int, default=5, help="sampled refreshes per size (versions 1..repeats)")
    parser.add_argument("--full-repeats", type=int, default=3, help="full refreshes per size")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed sampled refreshes of the 1x corpus first (first-call costs: imports, allocators)")
    parser.add_argument("--min-shards", type=int, default=50, help="shards the 1x corpus has at least")
    parser.add_argument("--corpus", type=Path, default=None, help=f"base corpus (default: {CONFIG}'s data.corpus)")
    parser.add_argument("--hardware", default=f"{os.cpu_count()}-core CPU", help="how the output names the machine")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out.resolve()
    sys.path[:0] = [str(REPO / "shared"), str(REPO)]
    import torch

    from benchmarks.serve_scale import replicate_corpus
    from marge.contracts.corpus import Corpus
    from marge.model.checkpoint import build_model
    from services.driver.config import load_config

    sizes = [int(s) for s in args.sizes.split(",")]
    full_sizes = [int(s) for s in args.full_sizes.split(",") if s.strip()]
    if not set(full_sizes) <= set(sizes):
        parser.error(f"--full-sizes {full_sizes} must be among --sizes {sizes}")
    configs = {"sampled": load_config(REPO / CONFIG, [f"indexer.shards_per_version={args.k}"]),
               "full": load_config(REPO / CONFIG, ["indexer.shards_per_version=0"])}
    cfg = configs["sampled"]
    source = base_corpus(cfg, args.corpus)
    base = Corpus.open(source)
    base_times = math.ceil(args.min_shards / base.num_shards)
    tok = base.tokenizer()
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model_config(tok.vocab_size))  # freshly initialised: the snapshot of every version
    torch.set_num_threads(max(1, int(cfg.indexer.num_cpus_per_worker)))  # what an IndexerWorker runs with

    wall = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="marge-refresh-scale-"))
    result = {"command": "python benchmarks/refresh_scale.py " + " ".join(sys.argv[1:]).replace(str(REPO) + "/", ""),
              "hardware": args.hardware, "platform": f"{platform.machine()}, {os.cpu_count()} cores",
              "torch_threads": torch.get_num_threads(), "config": CONFIG,
              "model": {"preset": cfg.model["preset"], "d_model": model.cfg.d_model}, "k": args.k,
              "one_x": {"base_corpus": relative(source), "base_shards": base.num_shards,
                        "base_documents": base.manifest["num_documents"], "replications_of_base": base_times,
                        "note": (f"1x = the base corpus {base_times} times over (it has fewer than {args.min_shards} "
                                 "shards)" if base_times > 1 else
                                 f"1x = the base corpus itself ({base.num_shards} >= {args.min_shards} shards)")
                                + ", rewritten by benchmarks/serve_scale.py's replicate_corpus like every size"},
              "corpora": {}}
    try:
        corpora, runs = {}, {}
        for size in sizes:
            t0 = time.perf_counter()
            corpora[size] = replicate_corpus(source, work / f"corpus-x{size}", size * base_times)
            manifest = Corpus.open(corpora[size]).manifest
            result["corpora"][f"x{size}"] = {"shards": manifest["num_shards"], "documents": manifest["num_documents"],
                                             "mb_on_disk": round(sum(f.stat().st_size for f in corpora[size].rglob("*")
                                                                     if f.is_file()) / 2**20, 1),
                                             "replicate_s": round(time.perf_counter() - t0, 1)}
            print(f"x{size}: {manifest['num_shards']} shards, {manifest['num_documents']} documents", flush=True)
        warm = Run(work / "run-warmup", corpora[sizes[0]], configs["sampled"], model, tok.sha256,
                   list(range(1, args.warmup + 1)))
        result["warmup_s"] = [warm.refresh(version)["seconds"] for version in range(1, args.warmup + 1)]
        shutil.rmtree(warm.folder)
        plans = {"sampled": (sizes, args.repeats), "full": (full_sizes, args.full_repeats)}
        measured: dict[str, dict[int, list[dict]]] = {way: {size: [] for size in way_sizes}
                                                      for way, (way_sizes, _) in plans.items()}
        for way, (way_sizes, repeats) in plans.items():
            for size in way_sizes:
                runs[way, size] = Run(work / f"run-{way}-x{size}", corpora[size], configs[way], model, tok.sha256,
                                      list(range(1, repeats + 1)))
        for way, (way_sizes, repeats) in plans.items():
            for version in range(1, repeats + 1):
                for size in way_sizes:  # sizes take turns within a repeat
                    r = runs[way, size].refresh(version)
                    measured[way][size].append(r)
                    print(f"{way} x{size} v{version}: {r['seconds']:.2f} s, {r['documents_embedded']} documents, "
                          f"{r['shards_in_manifest']} shards", flush=True)
        result["sampled"] = {f"x{size}": summary(measured["sampled"][size]) for size in sizes}
        result["full"] = {f"x{size}": summary(measured["full"][size]) for size in full_sizes}
        ratios = {}
        for way in ("sampled", "full"):
            one = result[way].get("x1")
            for size in plans[way][0]:
                if one and size != 1:
                    this = result[way][f"x{size}"]
                    ratios[f"{way}_x{size}_over_x1"] = round(this["median_s"] / one["median_s"], 2)
                    ratios[f"{way}_per_1k_documents_x{size}_over_x1"] = round(
                        this["median_s_per_1k_documents"] / one["median_s_per_1k_documents"], 2)
        for size in full_sizes:
            ratios[f"full_over_sampled_x{size}"] = round(result["full"][f"x{size}"]["median_s"]
                                                         / result["sampled"][f"x{size}"]["median_s"], 2)
        result["ratios"] = ratios
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("corpora", "ratios", "wall_s")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
