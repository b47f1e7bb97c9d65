"""The serving index of the whole corpus built on Ray (`marge index build --engine ray`): the same index as the
one-process build, nothing left behind by a build that fails, and the doc-id search's token reads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_service import centred_run  # tests/integration/test_service.py


@pytest.fixture(scope="module")
def full_run(small_corpus, tmp_path_factory):
    from marge.contracts.corpus import Corpus

    run = tmp_path_factory.mktemp("full-index") / "run"
    centred_run(run, small_corpus, seed=5)
    return run, Corpus.open(small_corpus, verify_checksums=False)


@pytest.fixture(scope="module")
def ray_workers():
    """A private local Ray for this module (2 CPUs on loopback), stopped after: never anybody else's."""
    from services.retrieval.full_index import ray_for_index_build

    with ray_for_index_build(workers=2) as workers:
        yield workers


def snapshot_of(run: Path):
    from marge.model.snapshot import latest_snapshot

    return latest_snapshot(run / "snapshots")


def serving_leftovers(run: Path) -> list[str]:
    """What a build leaves under RUN/serving besides committed builds and LATEST: scratch and temporary folders."""
    root = run / "serving"
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.exists() else []


def test_the_ray_build_writes_the_same_index_as_the_one_process_build(full_run, ray_workers, tmp_path):
    """Groups of shards embedded by Ray tasks, the quantisers trained on the driver, the parts merged in shard order:
    the index file is byte for byte the one-process build's, with shards both inside the training sample (read back
    from the scratch folder) and outside it (embedded in pass 2), and more groups than workers."""
    from services.retrieval.full_index import BuildOptions, build_serving_index, build_serving_index_ray, read_build

    run, corpus = full_run
    assert corpus.num_shards >= 3
    opts = BuildOptions(nlist=4, train_documents=2 * corpus.shards[0].rows - 1, recall_queries=50, target_recall=0.9)
    local = read_build(build_serving_index(tmp_path / "local", corpus, snapshot_of(run), opts))
    ray_built = build_serving_index_ray(tmp_path / "ray", corpus, snapshot_of(run), opts, workers=ray_workers,
                                        groups_per_worker=2)
    on_ray = read_build(ray_built)  # checksums verified
    assert on_ray["engine"]["name"] == "ray" and on_ray["engine"]["workers"] == 2
    assert on_ray["engine"]["tasks"] == min(4, corpus.num_shards) and on_ray["engine"]["worker_peak_rss_mb"] > 0
    assert local["engine"] == {"name": "local"}
    assert on_ray["index_sha256"] == local["index_sha256"] and on_ray["mean_sha256"] == local["mean_sha256"]
    assert on_ray["documents"] == local["documents"] == corpus.manifest["num_documents"]
    assert (on_ray["recall_by_nprobe"], on_ray["nprobe"]) == (local["recall_by_nprobe"], local["nprobe"])
    assert serving_leftovers(tmp_path / "ray") == []  # the scratch folder went with the build


def test_a_ray_build_that_fails_half_way_commits_nothing_and_leaves_nothing(full_run, ray_workers, tmp_path):
    """A task that cannot read its shard fails the build: no build folder, no LATEST (the service keeps what it
    served), no scratch folder; a scratch folder of a build killed before its cleanup (its process gone) is
    removed by the next build on the host and is never taken for a build."""
    import shutil

    from marge.contracts.corpus import Corpus
    from services.retrieval.full_index import (
        BuildOptions,
        build_serving_index_ray,
        latest_build,
        read_build,
    )

    run, corpus = full_run
    broken = tmp_path / "corpus"
    shutil.copytree(corpus.root, broken)
    last = broken / corpus.shards[-1].file
    last.write_bytes(b"not parquet" * 100)
    target = tmp_path / "run"
    opts = BuildOptions(nlist=4, train_documents=corpus.shards[0].rows, recall_queries=50)
    with pytest.raises(Exception, match="not parquet|Parquet|parquet"):
        build_serving_index_ray(target, Corpus.open(broken, verify_checksums=False), snapshot_of(run), opts,
                                workers=ray_workers)
    assert latest_build(target) is None and serving_leftovers(target) == []
    assert not [p for p in (target / "serving").iterdir() if p.name.startswith("b")]

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = target / "serving" / f".work-{socket.gethostname()}-{int(dead.stdout)}-0badc0de"
    (stale / "part-000000.faiss.tmp").parent.mkdir()
    (stale / "part-000000.faiss.tmp").write_bytes(b"half")
    assert latest_build(target) is None  # `marge serve --full-corpus` finds nothing to serve, not the scratch
    alive = target / "serving" / f".work-{socket.gethostname()}-{os.getpid()}-feedf00d"  # a build still running
    alive.mkdir()
    built = build_serving_index_ray(target, corpus, snapshot_of(run), opts, workers=ray_workers)
    assert read_build(built)["build"] == 0 and latest_build(target) == built
    assert serving_leftovers(target) == [alive.name]


def test_marge_index_build_on_ray_from_the_command_line(full_run, tmp_path):
    """`marge index build --engine ray --workers 2` starts its own local Ray, builds the index the one-process
    command builds (same bytes), commits it as the next build and stops its Ray; --engine auto is the one-process
    build where no cluster is named."""
    import shutil

    from services.cli.serve import index_engine

    run, corpus = full_run
    copy = tmp_path / "run"
    shutil.copytree(run / "snapshots", copy / "snapshots")
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    results = []
    for engine in ("auto", "ray"):
        built = subprocess.run([sys.executable, "-m", "services.cli", "index", "build", "--run", str(copy),
                                "--engine", engine, "--workers", "2", "--target-recall", "0.9"],
                               capture_output=True, text=True, timeout=300, env=env)
        assert built.returncode == 0, built.stderr[-3000:]
        results.append(json.loads(built.stdout.strip().splitlines()[-1]))
    assert [r["engine"]["name"] for r in results] == ["local", "ray"] and [r["build"] for r in results] == [0, 1]
    from services.retrieval.full_index import latest_build, read_build

    first, second = (read_build(Path(r["path"])) for r in results)
    assert first["index_sha256"] == second["index_sha256"] and latest_build(copy) == Path(results[1]["path"])
    assert serving_leftovers(copy) == []
    assert index_engine("auto", None) in ("local", "ray") and index_engine("auto", "10.0.0.1:6379") == "ray"
    assert index_engine("local", "10.0.0.1:6379") == "local"


def test_a_search_by_doc_id_reads_its_shards_tokens_once(full_run):
    """The full-corpus index embeds a document again for a search by its doc id: its shard's tokens column is read
    once and kept (bounded), not read again for every request."""
    from services.retrieval.index import DocumentTable

    _, corpus = full_run
    docs = DocumentTable(corpus)
    shard = corpus.read_shard(0)
    for _ in range(3):
        for doc_id, tokens in list(zip(shard.doc_ids, shard.tokens))[:5]:
            got = docs.tokens_of(int(doc_id))
            assert got.dtype == np.int64 and np.array_equal(got, tokens)
    assert docs.tokens.reads == 1
    other = corpus.read_shard(1)
    assert np.array_equal(docs.tokens_of(int(other.doc_ids[-1])), other.tokens[-1]) and docs.tokens.reads == 2
    with pytest.raises(KeyError):
        docs.tokens_of(10**9)
    tiny = DocumentTable(corpus, tokens_cache_mb=0)  # a budget below one shard: the newest shard only
    tiny.tokens_of(int(shard.doc_ids[0]))
    tiny.tokens_of(int(other.doc_ids[0]))
    tiny.tokens_of(int(shard.doc_ids[1]))
    assert tiny.tokens.reads == 3 and len(tiny.tokens) == 1


def test_a_language_filtered_search_returns_k_when_the_language_has_k(full_run, tmp_path):
    """A language's documents sit in few of the IVF lists a query probes, and the filter applies inside them: with
    one list probed, asking for every document of a language found only some. The search probes more lists until
    it has k (or all there are)."""
    import faiss

    from services.retrieval.full_index import BuildOptions, FullCorpusIndex, build_serving_index
    from services.retrieval.index import DocumentTable

    run, corpus = full_run
    opts = BuildOptions(nlist=4, train_documents=2 * corpus.shards[0].rows - 1, recall_queries=50, target_recall=0.9)
    built = build_serving_index(tmp_path / "build", corpus, snapshot_of(run), opts)
    docs = DocumentTable(corpus)
    full = FullCorpusIndex(built, run, corpus, corpus.tokenizer(), docs)
    full.index.nprobe = 1
    lang = min(full._lang_size, key=full._lang_size.get)  # the smallest language: spread thin over the lists
    size = full._lang_size[lang]
    query = full.vector_of(int(docs.ids[0]))
    one_probe = full.index.search(np.ascontiguousarray(query[None, :], dtype=np.float32), size,
                                  params=faiss.SearchParametersIVF(nprobe=1, sel=full.by_lang[lang]))[1]
    assert int((one_probe[0] >= 0).sum()) < size  # what one probed list gives: the case under test
    hits = full.search(query, size, lang=lang)
    assert len(hits) == size and len({d for d, _ in hits}) == size
    assert all(docs.lang_names[docs.langs_of(np.array([d]))[0]] == lang for d, _ in hits)
    assert len(full.search(query, 3, lang=lang)) == 3
