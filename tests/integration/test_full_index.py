"""The serving index of the whole corpus built on Ray (`marge index build --engine ray`): the same index as the
one-process build, its lists merged into a file of their own without the merging process holding them, the
service mapping that file instead of loading it, older single-file builds still served, nothing left behind by a
build that fails, and the doc-id search's token reads."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving_index_merge  # noqa: E402  (benchmarks/ is not a package)


@pytest.fixture(scope="module")
def full_run(small_corpus, tmp_path_factory):
    from marge.contracts.corpus import Corpus

    run = tmp_path_factory.mktemp("full-index") / "run"
    centred_run(run, small_corpus, seed=5)
    return run, Corpus.open(small_corpus, verify_checksums=False)


@pytest.fixture(scope="module")
def ray_workers():
    """A private local Ray for this module (2 CPUs on loopback), stopped after: never anybody else's."""
    from services.retrieval.serving_index import ray_for_index_build

    with ray_for_index_build(workers=2) as workers:
        yield workers


def snapshot_of(run: Path):
    from marge.model.snapshot import latest_snapshot

    return latest_snapshot(run / "snapshots")


def serving_leftovers(run: Path) -> list[str]:
    """What a build leaves under RUN/serving besides committed builds and LATEST: scratch and temporary folders."""
    root = run / "serving"
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.exists() else []


def build_options(corpus):
    from services.retrieval.serving_index import BuildOptions

    return BuildOptions(nlist=4, train_documents=2 * corpus.shards[0].rows - 1, recall_queries=50, target_recall=0.9)


@pytest.fixture(scope="module")
def two_builds(full_run, ray_workers, tmp_path_factory):
    """The one-process build and the Ray build (2 workers, 4 groups) of the small corpus, each in a run of its own."""
    from services.retrieval.serving_index import build_serving_index, build_serving_index_ray

    run, corpus = full_run
    assert corpus.num_shards >= 3
    root = tmp_path_factory.mktemp("two-builds")
    local = build_serving_index(root / "local", corpus, snapshot_of(run), build_options(corpus))
    on_ray = build_serving_index_ray(root / "ray", corpus, snapshot_of(run), build_options(corpus),
                                     workers=ray_workers, groups_per_worker=2)
    return local, on_ray


def search_everything(full, queries: np.ndarray, languages: list[str]) -> list:
    """Every query's top 10, unfiltered and in each language: (doc id, score) as the service returns them."""
    return [full.search(q, 10, lang=lang) for q in queries for lang in [None, *languages]]


def test_the_ray_build_writes_the_same_index_as_the_one_process_build(full_run, two_builds, tmp_path):
    """Groups of shards embedded by Ray tasks, the quantisers trained on the driver, the parts' lists merged in shard
    order into the build's lists file: index.faiss and index.ivfdata are byte for byte the one-process build's, with
    shards both inside the training sample (read back from the scratch folder) and outside it (embedded in pass 2),
    and more groups than workers; both are served mapped, and give the same hits and scores for every query, with
    and without a language filter."""
    import faiss

    from services.retrieval.serving_index import DATA_FILE, INDEX_FILE, ON_DISK, FullCorpusIndex, read_build
    from services.retrieval.version_index import DocumentTable

    run, corpus = full_run
    local_path, ray_path = two_builds
    local, on_ray = read_build(local_path), read_build(ray_path)  # checksums verified, the lists file's too
    assert on_ray["engine"]["name"] == "ray" and on_ray["engine"]["workers"] == 2
    assert on_ray["engine"]["tasks"] == min(4, corpus.num_shards) and on_ray["engine"]["worker_peak_rss_mb"] > 0
    assert local["engine"] == {"name": "local"}
    assert local["layout"] == on_ray["layout"] == ON_DISK and local["version"] == on_ray["version"] == 2
    for name in (INDEX_FILE, DATA_FILE, "mean.npy"):
        assert (local_path / name).read_bytes() == (ray_path / name).read_bytes(), name
    assert on_ray["data_bytes"] == (ray_path / DATA_FILE).stat().st_size > on_ray["documents"] * on_ray["dim"]
    assert on_ray["index_bytes"] == (ray_path / INDEX_FILE).stat().st_size + on_ray["data_bytes"]
    header = (ray_path / INDEX_FILE).read_bytes()  # names its lists file by its bare name, not where it was written
    assert DATA_FILE.encode() in header and b".tmp-" not in header and str(ray_path.parent).encode() not in header
    assert on_ray["documents"] == local["documents"] == corpus.manifest["num_documents"]
    assert (on_ray["recall_by_nprobe"], on_ray["nprobe"]) == (local["recall_by_nprobe"], local["nprobe"])
    assert serving_leftovers(ray_path.parent.parent) == []  # the scratch folder went with the build

    docs = DocumentTable(corpus)
    served = [FullCorpusIndex(path, run, corpus, corpus.tokenizer(), docs) for path in (local_path, ray_path)]
    for full, path in zip(served, (local_path, ray_path)):
        lists = faiss.downcast_InvertedLists(full.index.invlists)
        assert isinstance(lists, faiss.OnDiskInvertedLists) and lists.read_only
        mapped = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()
                  if line.endswith(str(path / DATA_FILE))]
        assert mapped and all(fields[1].startswith("r-") for fields in mapped)  # read-only, never written
    rng = np.random.default_rng(0)
    picked = rng.choice(docs.ids, size=40, replace=False)
    noise = rng.standard_normal((20, served[0].dim)).astype(np.float32)
    queries = np.concatenate([np.stack([served[0].vector_of(int(d)) for d in picked]),
                              noise / np.linalg.norm(noise, axis=1, keepdims=True)])
    local_hits, ray_hits = (search_everything(full, queries, list(docs.lang_names)) for full in served)
    assert local_hits == ray_hits and sum(len(hits) for hits in local_hits) > 10 * len(queries)


def test_the_merge_holds_the_lists_in_files_not_in_the_merging_process(tmp_path):
    """The Ray build's driver merges the parts' lists (mapped, `opened_parts`) into the build's lists file
    (`merge_lists_on_disk`): its anonymous memory grows by a small part of the index while the merge that kept the
    index in memory (each part read, `merge_from` into one index) grows by the whole index, which shows the
    measure sees a merge that holds it. Both give the same lists, byte for byte."""
    documents, dim, nlist = 600_000, 64, 256
    code_size = serving_index_merge.make_parts(tmp_path, documents, dim, nlist, parts=5)
    index_bytes = documents * (code_size + 8)
    on_disk = serving_index_merge.measure_merge(tmp_path, "on-disk", check=True)
    in_memory = serving_index_merge.measure_merge(tmp_path, "in-memory", check=True)
    assert on_disk["documents"] == in_memory["documents"] == documents
    assert on_disk["lists_sha256"] == in_memory["lists_sha256"] and on_disk["lists_file_bytes"] == index_bytes
    assert in_memory["peak_anon_growth_bytes"] > 0.8 * index_bytes, in_memory
    assert on_disk["peak_anon_growth_bytes"] < 0.1 * index_bytes, on_disk


def test_parts_with_empty_lists_merge_into_the_lists_of_adding_in_order(tmp_path):
    """Parts of a few documents (most lists empty: FAISS writes them sparse), an empty part, and large ones: the
    merged lists hold exactly the ids and codes, list by list, of one index that added every part's documents in
    order; the index searches the same."""
    import faiss

    from services.retrieval.serving_index import DATA_FILE, merge_lists_on_disk, opened_parts, write_part

    rng = np.random.default_rng(1)
    dim, nlist = 16, 64
    x = rng.standard_normal((5000, dim)).astype(np.float32)
    trained = faiss.index_factory(dim, f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    trained.train(x)
    whole = faiss.clone_index(trained)
    paths = []
    for p, (a, b) in enumerate([(0, 3), (3, 3), (3, 2000), (2000, 2010), (2010, 5000)]):
        part = faiss.clone_index(trained)
        part.add_with_ids(x[a:b], np.arange(a, b, dtype=np.int64) * 7)
        whole.add_with_ids(x[a:b], np.arange(a, b, dtype=np.int64) * 7)
        paths.append(tmp_path / f"part-{p}.ivlists")
        write_part(paths[-1], part)
    merged = faiss.clone_index(trained)
    with opened_parts(paths) as parts:
        assert [part.compute_ntotal() for part in parts] == [3, 0, 1997, 10, 2990]
        merge_lists_on_disk(merged, parts, tmp_path / DATA_FILE)
    assert isinstance(faiss.downcast_InvertedLists(merged.invlists), faiss.OnDiskInvertedLists)
    assert merged.ntotal == whole.ntotal == 5000
    for j in range(nlist):
        n = whole.invlists.list_size(j)
        assert merged.invlists.list_size(j) == n
        if n:
            for get, count in ((lambda lists: lists.get_ids(j), n), (lambda lists: lists.get_codes(j), n * dim)):
                assert np.array_equal(faiss.rev_swig_ptr(get(merged.invlists), count),
                                      faiss.rev_swig_ptr(get(whole.invlists), count))
    merged.nprobe = whole.nprobe = 8
    assert all(np.array_equal(a, b) for a, b in zip(merged.search(x[:50], 10), whole.search(x[:50], 10)))


def copy_build(build: Path, where: Path) -> Path:
    """A committed build copied into a run of its own, as `b000000`, with LATEST pointing at it."""
    import shutil

    target = where / "serving" / "b000000"
    shutil.copytree(build, target)
    (where / "serving" / "LATEST").write_text(json.dumps({"build": 0, "dir": "b000000"}))
    return target


def test_an_old_single_file_build_still_opens_and_answers_as_the_new_layout(full_run, two_builds, tmp_path):
    """A build of format version 1 (the lists inside index.faiss, no layout field, no lists file), as builds were
    written before: its checksums verify, it is read whole, and it answers as the on-disk build of the same lists."""
    import faiss

    from marge.util.files import sha256_file
    from services.retrieval.serving_index import INDEX_FILE, SINGLE_FILE, FullCorpusIndex, open_index, read_build
    from services.retrieval.version_index import DocumentTable

    run, corpus = full_run
    local_path = two_builds[0]
    manifest = read_build(local_path)
    index = open_index(local_path, manifest)  # the same lists, copied into memory and written as one file
    ivf, on_disk = faiss.extract_index_ivf(index), index.invlists
    in_memory = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
    for j in range(ivf.nlist):
        if on_disk.list_size(j):
            in_memory.add_entries(j, on_disk.list_size(j), on_disk.get_ids(j), on_disk.get_codes(j))
    ivf.replace_invlists(in_memory, True)
    in_memory.this.disown()
    old = tmp_path / "old" / "serving" / "b000000"
    old.mkdir(parents=True)
    faiss.write_index(index, str(old / INDEX_FILE))
    (old / "mean.npy").write_bytes((local_path / "mean.npy").read_bytes())
    v1 = {k: v for k, v in manifest.items() if k not in ("layout", "data_file", "data_bytes", "data_sha256")}
    v1.update(version=1, index_bytes=(old / INDEX_FILE).stat().st_size, index_sha256=sha256_file(old / INDEX_FILE))
    (old / "manifest.json").write_text(json.dumps(v1, indent=2))

    assert read_build(old)["version"] == 1  # checksums verified
    docs = DocumentTable(corpus)
    single, mapped = (FullCorpusIndex(path, run, corpus, corpus.tokenizer(), docs) for path in (old, local_path))
    assert single.layout == SINGLE_FILE and isinstance(faiss.downcast_InvertedLists(single.index.invlists),
                                                       faiss.ArrayInvertedLists)
    queries = np.stack([single.vector_of(int(d)) for d in docs.ids[::97][:30]])
    assert search_everything(single, queries, list(docs.lang_names)) == search_everything(
        mapped, queries, list(docs.lang_names))


def test_a_damaged_or_moved_lists_file(full_run, two_builds, tmp_path):
    """The build's folder moved elsewhere opens from where it is (its lists file found beside index.faiss, not
    where it was written); a lists file changed in place is refused by its checksum, one cut short or missing by
    its size before FAISS maps it (a read past its end would kill the service), each naming the file."""
    import shutil

    from services.retrieval.serving_index import DATA_FILE, FullCorpusIndex, ServingIndexError, read_build

    run, corpus = full_run
    moved = copy_build(two_builds[1], tmp_path / "moved")
    full = FullCorpusIndex(moved, run, corpus, corpus.tokenizer())
    query = np.ascontiguousarray(np.eye(full.dim, dtype=np.float32)[0])
    assert len(full.search(query, 5)) == 5 and full.documents == read_build(moved)["documents"]
    assert any(line.endswith(str(moved / DATA_FILE)) for line in Path("/proc/self/maps").read_text().splitlines())

    changed = copy_build(two_builds[1], tmp_path / "changed")
    with open(changed / DATA_FILE, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ServingIndexError, match=rf"{DATA_FILE}.*(sha256|checksum)"):
        read_build(changed)

    short = copy_build(two_builds[1], tmp_path / "short")
    with open(short / DATA_FILE, "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(ServingIndexError, match=rf"{DATA_FILE}: \d+ bytes, the manifest says \d+"):
        FullCorpusIndex(short, run, corpus, corpus.tokenizer())
    shutil.rmtree(short)
    gone = copy_build(two_builds[1], tmp_path / "gone")
    (gone / DATA_FILE).unlink()
    with pytest.raises(ServingIndexError, match=rf"{DATA_FILE}: missing"):
        FullCorpusIndex(gone, run, corpus, corpus.tokenizer())


def test_a_ray_build_that_fails_half_way_commits_nothing_and_leaves_nothing(full_run, ray_workers, tmp_path):
    """A task that cannot read its shard fails the build: no build folder, no LATEST (the service keeps what it
    served), no scratch folder; a scratch folder of a build killed before its cleanup (its process gone) is
    removed by the next build on the host and is never taken for a build."""
    import shutil

    from marge.contracts.corpus import Corpus
    from services.retrieval.serving_index import (
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
    from services.retrieval.serving_index import latest_build, read_build

    first, second = (read_build(Path(r["path"])) for r in results)
    assert first["index_sha256"] == second["index_sha256"] and latest_build(copy) == Path(results[1]["path"])
    assert serving_leftovers(copy) == []
    assert index_engine("auto", None) in ("local", "ray") and index_engine("auto", "10.0.0.1:6379") == "ray"
    assert index_engine("local", "10.0.0.1:6379") == "local"


def test_a_search_by_doc_id_reads_its_shards_tokens_once(full_run):
    """The full-corpus index embeds a document again for a search by its doc id: its shard's tokens column is read
    once and kept (bounded), not read again for every request."""
    from services.retrieval.version_index import DocumentTable

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

    from services.retrieval.serving_index import BuildOptions, FullCorpusIndex, build_serving_index
    from services.retrieval.version_index import DocumentTable

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
