"""A serving index of the whole corpus, built offline from one snapshot (`marge index build`), for the retrieval
service to load instead of the newest training index version, which holds only the shards its refresh embedded
(`indexer.shards_per_version`: 128 of 5,000 shards at the paper's setting) and every vector in float32.

    RUN/serving/
      LATEST                   {"build": 2, "dir": "b000002"}   (atomic rename; only moves forward)
      b000002/
        index.faiss            an inverted-file index (inner product) over g(z) - mean of every corpus document,
                               coded with 8-bit scalar quantisation (`sq8`: d bytes a document against 4 d for
                               float32) or product quantisation (`pq`: d / 4 bytes), doc ids as FAISS ids: the
                               coarse quantiser and the lists' sizes and offsets, naming its lists' file by its
                               bare name (FAISS `OnDiskInvertedLists`)
        index.ivfdata          the inverted lists: each list's codes then its doc ids, list after list; the
                               service maps it read-only instead of loading it
        mean.npy               the mean the vectors are stored from (float32, d)
        manifest.json          the snapshot step, codec, lists, the nprobe chosen, documents, the recall@10
                               measured at build, the layout, sha256 of every file, the engine that built it
      .work-<host>-<pid>-<id>/ a Ray build's scratch (sample vectors, parts), removed when it ends

Builds of format version 1 hold the lists inside index.faiss (one file, loaded whole); they still open.

Vectors are stored minus their mean: for a query q, q . (z - mean) + q . mean = q . z, so the ranking is exactly
inner-product search over g(z) (the score returned adds q . mean back), while the codes spend their 8 bits on how
documents differ rather than on what they share (an untrained or uncentred g puts every document within a few
degrees of the mean). It is built in two passes over the shards, one shard in memory at a time: the coarse
quantiser (and the codec) is trained on the vectors of a seeded sample of shards, then every shard is embedded and added. Recall@10 against exact
inner-product search is measured at build, on `recall_queries` documents' own vectors as queries, the exact top 10
computed shard by shard as the shards stream past; `nprobe` is the smallest power of two whose recall reaches
`target_recall`, and the service searches with it.

`build_serving_index` builds in this process; `build_serving_index_ray` (`marge index build --engine ray`) builds the
same index, byte for byte, on a Ray cluster: tasks embed the training sample's shards and then groups of
consecutive shards, each group added to a copy of the trained index and written to a scratch folder under
RUN/serving as a part (tmp + rename; only the queries' top 10 travel back through Ray), and the driver merges the
parts' lists in shard order straight into the build's lists file (FAISS `OnDiskInvertedLists.merge_from_multiple`,
the parts memory-mapped): no process holds the whole index. Either way nothing is visible under RUN/serving until
the build's folder is renamed into place with its manifest, and LATEST moves after that.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from marge.contracts import artifacts
from marge.contracts.corpus import Corpus
from marge.model.embedding import embed_documents, unit_vector
from marge.model.snapshot import SnapshotInfo, load_relevance_encoder
from marge.util.files import sha256_file
from marge.util.progress import Progress, track

log = logging.getLogger(__name__)

SERVING = "serving"
INDEX_FILE = "index.faiss"
DATA_FILE = "index.ivfdata"
MEAN_FILE = "mean.npy"
FORMAT = "marge-serving-index"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""1: the lists inside index.faiss (`layout` absent); 2: the lists in their own file beside it (`layout` ON_DISK)."""
SINGLE_FILE = "single-file"
ON_DISK = "on-disk-lists"
CODECS = ("sq8", "pq")
MIN_POINTS_PER_LIST = 39
"""FAISS's k-means wants at least 39 training points a centroid (it warns below)."""


class ServingIndexError(artifacts.ArtifactError):
    pass


def _build_of(name: str) -> int:
    if not name.startswith("b") or not name[1:].isdigit():
        raise ValueError(name)
    return int(name[1:])


BUILDS = artifacts.Series("b*", _build_of, pointer_field="build", what="serving index", error=ServingIndexError)


@dataclass(frozen=True)
class BuildOptions:
    codec: str = "sq8"
    """'sq8' (d bytes a document: recall close to exact) or 'pq' (d / 4 bytes a document: smaller, lower recall)."""
    nlist: int | None = None
    """Inverted lists (None: about 4 x sqrt(documents), at most documents / 39)."""
    target_recall: float = 0.95
    """recall@10 against exact search that the chosen nprobe must reach on the build's queries."""
    recall_queries: int = 200
    train_documents: int | None = None
    """Training vectors for the quantisers (None: 39 per list, at least 10,000), from a seeded sample of shards."""
    seed: int = 0
    batch_tokens: int = 16384
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {list(CODECS)}, got {self.codec!r}")
        if not 0 < self.target_recall <= 1:
            raise ValueError(f"target_recall must be in (0, 1], got {self.target_recall}")
        if self.nlist is not None and self.nlist < 1:
            raise ValueError(f"nlist must be positive, got {self.nlist}")


def default_nlist(documents: int) -> int:
    return max(1, min(int(4 * math.sqrt(documents)), documents // MIN_POINTS_PER_LIST))


def factory_string(dim: int, nlist: int, codec: str) -> str:
    if codec == "pq":
        m = max(1, dim // 4)
        while dim % m:  # PQ needs sub-vectors of equal width
            m -= 1
        return f"IVF{nlist},PQ{m}x8"
    return f"IVF{nlist},SQ8"


def _embed_shard(corpus: Corpus, shard: int, encoder, specials, opts: BuildOptions) -> tuple[np.ndarray, np.ndarray]:
    docs = corpus.read_shard(shard)
    return docs.doc_ids.astype(np.int64), embed_documents(encoder, list(docs.tokens), specials, opts.batch_tokens,
                                                         opts.device)


@dataclass
class _Plan:
    """What both builds decide before embedding anything: the lists, the training sample's shards (a seeded
    permutation's prefix holding `wanted` documents by the manifest's shard sizes) and the generator the training
    draws from next."""

    documents: int
    nlist: int
    wanted: int
    sample_shards: list[int]
    rng: np.random.Generator


def _plan(corpus: Corpus, snapshot: SnapshotInfo, opts: BuildOptions) -> _Plan:
    tokenizer = corpus.tokenizer()
    if snapshot.manifest["tokenizer_sha256"] != tokenizer.sha256:
        raise ServingIndexError(f"snapshot {snapshot.path} was trained with another tokenizer than corpus {corpus.root}")
    documents = int(corpus.manifest["num_documents"])
    nlist = opts.nlist or default_nlist(documents)
    wanted = opts.train_documents or max(MIN_POINTS_PER_LIST * nlist, 10_000)
    rng = np.random.default_rng(opts.seed)
    sample, held = [], 0
    for shard in rng.permutation(corpus.num_shards):
        sample.append(int(shard))
        held += int(corpus.shards[int(shard)].rows)
        if held >= wanted:
            break
    return _Plan(documents, nlist, wanted, sample, rng)


def _training_rows(plan: _Plan, training: np.ndarray, opts: BuildOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the rows the quantisers train on, centred in place in an array of their own; the mean the vectors are stored
    from; the recall queries, documents' own vectors), from the sample's vectors in the sample's order (`training`
    is read, not changed: a caller that lets it go before `_trained` holds the sample once)."""
    mean = training.mean(axis=0).astype(np.float32)
    queries = training[plan.rng.choice(len(training), size=min(opts.recall_queries, len(training)), replace=False)]
    rows = training[plan.rng.permutation(len(training))[:plan.wanted]]  # a new C-contiguous array
    rows -= mean
    return rows, mean, queries


def _trained(plan: _Plan, rows: np.ndarray, opts: BuildOptions) -> faiss.Index:
    """The empty index with its quantisers trained on `rows`. FAISS holds their residuals meanwhile, a second copy:
    with the sample let go first, the training holds about two samples (benchmarks/serving_index_train.py; at
    100M documents and d 1024 a sample is 6.4 GB)."""
    dim = rows.shape[1]
    index = faiss.index_factory(dim, factory_string(dim, plan.nlist, opts.codec), faiss.METRIC_INNER_PRODUCT)
    index.train(rows)
    return index


RECALL_K = 10


def _empty_top(queries: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((queries, RECALL_K), -np.inf, dtype=np.float32), np.full((queries, RECALL_K), -1, dtype=np.int64)


def _merge_top(best_scores: np.ndarray, best_ids: np.ndarray, scores: np.ndarray,
               ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The top RECALL_K of the best so far and `scores` (queries x candidates, `ids` per column or per cell), ties
    to the earlier: merging shard after shard, or groups' tops in shard order, gives the same top."""
    scores = np.concatenate([best_scores, scores], axis=1)
    both = np.concatenate([best_ids, np.broadcast_to(ids, scores[:, best_ids.shape[1]:].shape)], axis=1)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :RECALL_K]
    return np.take_along_axis(scores, top, 1), np.take_along_axis(both, top, 1)


def build_serving_index(run_dir: Path, corpus: Corpus, snapshot: SnapshotInfo, opts: BuildOptions = BuildOptions()) -> Path:
    """Embed every corpus document with `snapshot`'s g into a new serving index under RUN/serving, in this process,
    measure its recall, choose its nprobe, commit it (manifest last) and point LATEST at it. Returns its folder."""
    started = time.time()
    plan = _plan(corpus, snapshot, opts)
    specials = corpus.tokenizer().specials
    encoder = load_relevance_encoder(snapshot).to(opts.device)

    # pass 1: the quantisers, trained on the vectors of a seeded sample of shards (kept for pass 2)
    sample = {shard: _embed_shard(corpus, shard, encoder, specials, opts)
              for shard in track(plan.sample_shards, "serving index: embedding the training sample", unit="shard")}
    training = np.concatenate([vectors for _, vectors in sample.values()])
    starts = np.cumsum([0] + [len(ids) for ids, _ in sample.values()])
    sample = {shard: (ids, training[a:b]) for (shard, (ids, _)), a, b in zip(sample.items(), starts, starts[1:])}
    rows, mean, queries = _training_rows(plan, training, opts)  # the sample held once: its shards are views of it
    del training
    index = _trained(plan, rows, opts)
    del rows
    # no direct map (about 50 bytes a document): a search by doc id embeds the document again

    # pass 2: every shard added, the exact top 10 of the queries kept as the shards stream past
    best_scores, best_ids = _empty_top(len(queries))
    for shard in track(range(corpus.num_shards), "serving index: embedding shards", unit="shard"):
        ids, vectors = sample.pop(shard) if shard in sample else _embed_shard(corpus, shard, encoder, specials, opts)
        index.add_with_ids(np.ascontiguousarray(vectors - mean), ids)
        best_scores, best_ids = _merge_top(best_scores, best_ids, queries @ vectors.T, ids)
    # the lists written out through the same merge as the Ray build's parts, one source here: the same files
    return _commit(run_dir, snapshot, opts, plan, index, [index.invlists], mean, queries, best_ids, started,
                   {"name": "local"})


def _commit(run_dir: Path, snapshot: SnapshotInfo, opts: BuildOptions, plan: _Plan, index: faiss.Index,
            lists: list, mean: np.ndarray, queries: np.ndarray, best_ids: np.ndarray, started: float,
            engine: dict) -> Path:
    """Write the build under RUN/serving and move LATEST to it: `lists` (FAISS inverted lists, each list's entries
    taken from them in their order) merged into the build's lists file, which becomes `index`'s lists, nprobe chosen
    on the queries' exact top 10 by searching that file, then index.faiss, the mean and the manifest last."""
    dim, nlist, k = index.d, plan.nlist, RECALL_K
    root = Path(run_dir) / SERVING
    root.mkdir(parents=True, exist_ok=True)
    existing = BUILDS.versions(root)
    build = (_build_of(existing[-1].name) + 1) if existing else 0
    target = root / f"b{build:06d}"
    with artifacts.publish_dir(target, overwrite=False, error=ServingIndexError) as tmp:
        merge_lists_on_disk(index, lists, tmp / DATA_FILE)
        curve, nprobe = {}, index.nlist
        for probe in [2 ** i for i in range(int(math.log2(index.nlist)) + 1)] + [index.nlist]:
            index.nprobe = probe
            _, found = index.search(queries, k)
            curve[probe] = float(np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / k for a, b in zip(found, best_ids)]))
            if curve[probe] >= opts.target_recall:
                nprobe = probe
                break
        recall = curve[nprobe]
        if recall < opts.target_recall:
            log.warning("serving index: recall@10 %.3f at every list probed, below the %.2f asked for: build with "
                        "--codec sq8 (if pq) or more --nlist", recall, opts.target_recall)
        faiss.write_index(index, str(tmp / INDEX_FILE))
        np.save(tmp / MEAN_FILE, mean)
        index_bytes = (tmp / INDEX_FILE).stat().st_size + (tmp / DATA_FILE).stat().st_size
        artifacts.write_manifest(tmp, {
            "format": FORMAT, "version": FORMAT_VERSION, "build": build, "snapshot_step": snapshot.step,
            "codec": opts.codec, "factory": factory_string(dim, nlist, opts.codec), "nlist": int(index.nlist),
            "nprobe": int(nprobe), "dim": dim, "documents": int(index.ntotal), "corpus_documents": plan.documents,
            "recall_at_10": recall, "recall_by_nprobe": {str(p): r for p, r in curve.items()},
            "recall_queries": len(queries), "vector_bytes": int(index.ntotal) * dim * 4,
            "layout": ON_DISK, "index_bytes": index_bytes, "index_sha256": sha256_file(tmp / INDEX_FILE),
            "data_file": DATA_FILE, "data_bytes": (tmp / DATA_FILE).stat().st_size,
            "data_sha256": sha256_file(tmp / DATA_FILE), "mean_sha256": sha256_file(tmp / MEAN_FILE),
            "engine": engine, "build_seconds": round(time.time() - started, 1), "created_unix": time.time()})
    BUILDS.set_latest(root, target.name)
    log.info("serving index b%d: %d documents from snapshot step %d, %s, nprobe %d: recall@10 %.3f, %.0f MiB "
             "(%.2f of the vectors' bytes)", build, index.ntotal, snapshot.step, factory_string(dim, nlist, opts.codec),
             nprobe, recall, index_bytes / 2**20, index_bytes / max(1, index.ntotal * dim * 4))
    return target


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """FAISS's C++ prints to the process's stdout with printf (`resizing FILE to N bytes` as the lists file is
    sized), buffered apart from Python's: sent to stderr, with the log, so that a command's stdout stays its result
    (`marge index build` prints one JSON line last)."""
    import ctypes
    import sys

    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def merge_lists_on_disk(index: faiss.Index, lists: list, data_file: Path) -> None:
    """Replace `index`'s (an IVF index) inverted lists by a new file `data_file` holding the entries of `lists`
    (FAISS InvertedLists of the same lists and code size, the index's own among them or not), each list's entries
    from `lists` in their order: the order of adding them one after the other. FAISS's own merge
    (`OnDiskInvertedLists.merge_from_multiple`) sizes the file once and copies list by list into its mapping, so
    with `lists` memory-mapped (`opened_parts`) the codes go from file to file through the page cache, never all in
    this process's memory. The file is named by its bare name in the lists' header, which index.faiss records:
    readers find it beside index.faiss, wherever the folder was written."""
    ivf = faiss.extract_index_ivf(index)
    for i, source in enumerate(lists):
        if (source.nlist, source.code_size) != (ivf.nlist, ivf.code_size):
            raise ServingIndexError(f"merging into {data_file}: source {i} has {source.nlist} lists of "
                                    f"{source.code_size}-byte codes, the index {ivf.nlist} of {ivf.code_size}: "
                                    "a part of another build")
    on_disk = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(data_file))
    sources = faiss.InvertedListsPtrVector()
    for source in lists:
        sources.push_back(source)
    with _native_stdout_to_stderr():
        total = on_disk.merge_from_multiple(sources.data(), sources.size(), False, False)
    on_disk.filename = data_file.name  # written into index.faiss: resolved beside it when read
    ivf.replace_invlists(on_disk, True)  # the index owns it now (and frees lists it owned, a one-process build's)
    on_disk.this.disown()
    ivf.ntotal = index.ntotal = total


# --- the same build on Ray ------------------------------------------------------------------------------------------

WORK_PREFIX = ".work-"
"""Scratch folders of Ray builds under RUN/serving (`.work-<host>-<pid>-<hex>`): the training sample's vectors and
the tasks' partial indexes, written by the tasks, read by the driver, removed when the build ends. No `b*` name, so
no reader ever takes one for a build."""
TRAINED_FILE = "trained.faiss"
QUERIES_FILE = "queries.npy"


def _write_atomic(path: Path, write) -> None:
    """`write(file object)` into a temporary name beside `path`, then one rename: a reader (or a retried task) sees
    the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _new_work_dir(root: Path) -> Path:
    work = root / f"{WORK_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    return work


def clear_stale_work(root: Path) -> list[Path]:
    """Remove the scratch folders of Ray builds started on this host by processes that are gone (a build killed
    before its own cleanup ran). Returns what it removed."""
    removed = []
    for path in Path(root).glob(f"{WORK_PREFIX}*"):
        host, _, rest = path.name[len(WORK_PREFIX):].rpartition("-")[0].rpartition("-")
        if host != socket.gethostname() or not rest.isdigit():
            continue
        try:
            os.kill(int(rest), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except PermissionError:  # alive, someone else's
            pass
    return removed


def _task_inputs(corpus_root: str, snapshot_path: str, opts: BuildOptions):
    from marge.model.snapshot import read_snapshot

    corpus = Corpus.open(corpus_root, verify_checksums=False)
    encoder = load_relevance_encoder(read_snapshot(Path(snapshot_path))).to(opts.device)
    return corpus, encoder, corpus.tokenizer().specials


def _sample_file(work: Path, shard: int) -> Path:
    return work / f"sample-{shard:06d}.npz"


def _part_file(work: Path, group: int) -> Path:
    return work / f"part-{group:06d}.ivlists"


def write_part(path: Path, index: faiss.Index) -> None:
    """`index`'s inverted lists alone (FAISS `write_InvertedLists`: the lists' sizes, then each list's codes and
    ids), atomically: the quantiser, the same in every part, is not written, so mapping a part costs the merge its
    lists' sizes, not a copy of the quantiser (nlist x d floats) per part."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        writer = faiss.FileIOWriter(str(tmp))
        faiss.write_InvertedLists(faiss.extract_index_ivf(index).invlists, writer)
        del writer  # closes the file
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def opened_parts(paths: list[Path]) -> Iterator[list]:
    """Parts' inverted lists (`write_part`) mapped read-only from their files (FAISS `IO_FLAG_MMAP`), not read;
    unmapped when the block ends."""
    parts: list = []
    try:
        for path in paths:
            reader = faiss.FileIOReader(str(path))
            parts.append(faiss.read_InvertedLists(reader, faiss.IO_FLAG_MMAP))
            del reader  # closes the file; the mapping stays
        yield parts
    finally:
        for part in parts:
            # FAISS returns the lists unowned, and SWIG finds no destructor when told to own them: freed here
            type(part).__swig_destroy__(part)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return 0.0


def embed_sample_task(corpus_root: str, snapshot_path: str, shards: list[int], work: str,
                      opts: BuildOptions) -> float:
    """A Ray task: the training sample's shards of one group embedded, each shard's ids and vectors written to the
    work folder (pass 2 adds them from there instead of embedding them again). Returns the worker's peak RSS."""
    corpus, encoder, specials = _task_inputs(corpus_root, snapshot_path, opts)
    for shard in shards:
        ids, vectors = _embed_shard(corpus, shard, encoder, specials, opts)
        _write_atomic(_sample_file(Path(work), shard), lambda f: np.savez(f, ids=ids, vectors=vectors))
    return peak_rss_mb()


def add_shards_task(corpus_root: str, snapshot_path: str, group: int, shards: list[int], work: str,
                    opts: BuildOptions) -> tuple[int, int, np.ndarray, np.ndarray, float]:
    """A Ray task: a group of consecutive shards embedded (or read back from the training sample) and added to a
    copy of the trained, empty index, its lists written to the work folder as the group's part; returns the group,
    its documents, the exact top 10 of the recall queries among them (queries x 10: the only arrays that travel
    through Ray) and the worker's peak RSS."""
    work_dir = Path(work)
    corpus, encoder, specials = _task_inputs(corpus_root, snapshot_path, opts)
    index = faiss.read_index(str(work_dir / TRAINED_FILE))
    mean, queries = np.load(work_dir / MEAN_FILE), np.load(work_dir / QUERIES_FILE)
    best_scores, best_ids = _empty_top(len(queries))
    for shard in shards:
        if _sample_file(work_dir, shard).exists():
            with np.load(_sample_file(work_dir, shard)) as saved:
                ids, vectors = saved["ids"], saved["vectors"]
        else:
            ids, vectors = _embed_shard(corpus, shard, encoder, specials, opts)
        index.add_with_ids(np.ascontiguousarray(vectors - mean), ids)
        best_scores, best_ids = _merge_top(best_scores, best_ids, queries @ vectors.T, ids)
    write_part(_part_file(work_dir, group), index)
    return group, int(index.ntotal), best_scores, best_ids, peak_rss_mb()


def _groups(shards: list[int], count: int) -> list[list[int]]:
    """`shards` cut into at most `count` runs of consecutive items, of sizes differing by at most one."""
    count = max(1, min(count, len(shards)))
    bounds = np.linspace(0, len(shards), count + 1).round().astype(int)
    return [shards[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _run_tasks(task, calls: list[tuple], workers: int, description: str, shards_of, gpus: int = 0) -> list:
    """Each of `calls` as a Ray task of `task` (1 CPU, and `gpus` GPUs), at most `workers` at once; progress in shards
    as tasks end. Returns the results in the order of `calls`. On any error or interruption, cancels what is still
    running."""
    import ray

    remote = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=1)(task)
    results: list = [None] * len(calls)
    running: dict = {}
    todo = list(enumerate(calls))
    try:
        with Progress(description, sum(shards_of(call) for call in calls), "shard") as progress:
            while todo or running:
                while todo and len(running) < workers:
                    i, call = todo.pop(0)
                    running[remote.remote(*call)] = i
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    i = running.pop(ref)
                    results[i] = ray.get(ref)
                    progress.update(shards_of(calls[i]))
    finally:
        for ref in running:
            ray.cancel(ref, force=True)
    return results


def build_serving_index_ray(run_dir: Path, corpus: Corpus, snapshot: SnapshotInfo, opts: BuildOptions = BuildOptions(),
                            workers: int | None = None, groups_per_worker: int = 8) -> Path:
    """`build_serving_index` on the Ray cluster this process is connected to (`ray_for_index_build`), giving the
    same index: Ray tasks embed the training sample's shards (vectors written to a scratch folder under RUN/serving,
    which the tasks and the driver must both reach), the driver trains the quantisers on them as the one-process
    build does, then `workers` tasks at a time each add a group of consecutive shards to a copy of the trained index
    and write it as a part; the driver maps the parts (not loaded) and merges their lists in shard order straight
    into the build's lists file (`merge_lists_on_disk`: each list's entries in the order the one-process build
    adds them), and commits the build as the one-process build does. The driver's memory is the trained index and
    the lists' sizes, not the codes; the run folder holds the parts and the lists file at once (twice the index's
    bytes) while they merge. A build that stops half-way leaves no build and no LATEST change; its scratch folder
    is removed (or, after a kill, by the next build on the host)."""
    import ray

    if not ray.is_initialized():
        raise ServingIndexError("build_serving_index_ray runs on a Ray cluster: connect first (ray_for_index_build)")
    started = time.time()
    plan = _plan(corpus, snapshot, opts)
    workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    root = (Path(run_dir) / SERVING).absolute()
    root.mkdir(parents=True, exist_ok=True)
    for stale in clear_stale_work(root):
        log.info("serving index: removed %s, left by a build that was stopped", stale)
    work = _new_work_dir(root)
    gpus = 1 if opts.device.startswith("cuda") else 0  # each task embeds on a GPU of its own (--device cuda)
    common = (str(corpus.root.absolute()), str(snapshot.path.absolute()))
    try:
        # pass 1: the training sample embedded by the tasks, the quantisers trained here
        calls: list[tuple] = [(*common, shards, str(work), opts) for shards in _groups(plan.sample_shards, workers)]
        peaks = _run_tasks(embed_sample_task, calls, workers, "serving index: embedding the training sample",
                           lambda call: len(call[2]), gpus)
        shard_vectors = []
        for shard in plan.sample_shards:
            with np.load(_sample_file(work, shard)) as saved:
                shard_vectors.append(saved["vectors"])
        training = np.concatenate(shard_vectors)
        del shard_vectors  # the sample held once while the quantisers train
        rows, mean, queries = _training_rows(plan, training, opts)
        del training  # the rows alone while FAISS trains on them and holds their residuals
        index = _trained(plan, rows, opts)
        del rows
        _write_atomic(work / TRAINED_FILE, lambda f: f.write(faiss.serialize_index(index).tobytes()))
        _write_atomic(work / MEAN_FILE, lambda f: np.save(f, mean))
        _write_atomic(work / QUERIES_FILE, lambda f: np.save(f, queries))

        # pass 2: every shard added by the tasks, in groups of consecutive shards; the parts merged in shard order
        groups = _groups(list(range(corpus.num_shards)), workers * groups_per_worker)
        calls = [(*common, g, shards, str(work), opts) for g, shards in enumerate(groups)]
        results = _run_tasks(add_shards_task, calls, workers, "serving index: embedding shards",
                             lambda call: len(call[3]), gpus)
        best_scores, best_ids = _empty_top(len(queries))
        for group, documents, scores, ids, peak in results:
            peaks.append(peak)
            best_scores, best_ids = _merge_top(best_scores, best_ids, scores, ids)
        with opened_parts([_part_file(work, result[0]) for result in results]) as parts:
            for (group, documents, *_), part in zip(results, parts):
                if part.compute_ntotal() != documents:
                    raise ServingIndexError(f"{_part_file(work, group)}: {part.compute_ntotal()} documents, its "
                                            f"task added {documents}: a part of another build; build again")
            log.info("serving index: merging the lists of %d parts (%d documents) into the build's lists file",
                     len(parts), sum(result[1] for result in results))
            return _commit(run_dir, snapshot, opts, plan, index, parts, mean, queries, best_ids, started,
                           {"name": "ray", "workers": workers, "tasks": len(groups),
                            "worker_peak_rss_mb": round(max(peaks), 1)})
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def ray_for_index_build(address: str | None = None, workers: int | None = None) -> Iterator[int]:
    """Ray for `build_serving_index_ray` (`marge.util.local_ray.ray_for_tasks`). Yields the tasks to run at once."""
    from marge.util.local_ray import ray_for_tasks

    with ray_for_tasks(address, workers, OBJECT_STORE_BYTES) as tasks:
        yield tasks


OBJECT_STORE_BYTES = 256 * 2**20
"""A local Ray's object store for the build: only the tasks' arguments and the queries' top 10 travel through it."""


def read_build(path: Path, verify: bool = True) -> dict:
    """A build's manifest, checked (and, with `verify`, every file against its sha256: the lists file too)."""
    return artifacts.read_manifest(
        Path(path), FORMAT, READABLE_VERSIONS,
        fields=("build", "snapshot_step", "codec", "nprobe", "documents", "recall_at_10", "index_sha256"),
        checksums=_checksums if verify else None, what="serving index", error=ServingIndexError,
        hint="; build it again (`marge index build`)")


def layout_of(manifest: dict) -> str:
    """ON_DISK, or SINGLE_FILE for builds written before the lists had a file of their own."""
    return manifest.get("layout", SINGLE_FILE)


def _checksums(manifest: dict) -> dict[str, str]:
    files = {INDEX_FILE: manifest["index_sha256"], MEAN_FILE: manifest["mean_sha256"]}
    if layout_of(manifest) == ON_DISK:
        files[manifest["data_file"]] = manifest["data_sha256"]
    return files


def open_index(path: Path, manifest: dict) -> faiss.Index:
    """A build's FAISS index for searching: a single-file build read whole; an on-disk build's quantiser read and
    its lists file mapped read-only (pages read as searches touch them, shared with the page cache, never copied
    into this process), the file taken from the build's folder whatever folder it was written in."""
    path = Path(path)
    if layout_of(manifest) == SINGLE_FILE:
        return faiss.read_index(str(path / INDEX_FILE))
    if layout_of(manifest) != ON_DISK:
        raise ServingIndexError(f"{path / artifacts.MANIFEST}: layout {layout_of(manifest)!r} is not one this marge "
                                f"reads ({SINGLE_FILE!r}, {ON_DISK!r}): rebuild it with `marge index build`")
    data = path / manifest["data_file"]
    size = data.stat().st_size if data.is_file() else None
    if size != manifest["data_bytes"]:  # a shorter file would be mapped past its end: SIGBUS at the first search
        raise ServingIndexError(f"{data}: {'missing' if size is None else f'{size} bytes'}, the manifest says "
                                f"{manifest['data_bytes']}: a damaged build; rebuild it with `marge index build`")
    # IO_FLAG_SKIP_IVF_DATA: the lists' header only; the file is mapped below from this folder (what FAISS's
    # IO_FLAG_ONDISK_SAME_DIR does, without its printf on stdout)
    index = faiss.read_index(str(path / INDEX_FILE), faiss.IO_FLAG_SKIP_IVF_DATA | faiss.IO_FLAG_READ_ONLY)
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    if not isinstance(lists, faiss.OnDiskInvertedLists) or lists.totsize != size:
        raise ServingIndexError(f"{path / INDEX_FILE}: does not describe {data} ({type(lists).__name__}, "
                                f"{getattr(lists, 'totsize', '?')} bytes): a damaged build; rebuild it")
    lists.filename = str(data)
    lists.read_only = True
    lists.prefetch_nthread = 0  # else every search starts up to 32 threads to touch its lists' pages first
    lists.do_mmap()
    return index


def latest_build(run_dir: Path) -> Path | None:
    return BUILDS.latest(Path(run_dir) / SERVING)


class FullCorpusIndex:
    """A serving index opened for the service: the interface of `services.retrieval.version_index.LoadedIndex` (what the
    app calls), over every corpus document. The codes of an on-disk build stay in its lists file, mapped read-only
    (`open_index`); beyond them it holds one bit a document per language (the language filters) and no id map: a
    search by doc id embeds that document's tokens again, which gives its vector exactly (the codes give it to
    within the quantisation)."""

    def __init__(self, path: Path, run_dir: Path, corpus: Corpus, tokenizer, docs=None, encoder=None):
        from marge.contracts.paths import SNAPSHOTS
        from marge.model.snapshot import read_snapshot, snapshot_dirname

        manifest = read_build(path, verify=False)  # its size is the point: read once, by FAISS
        self.version = int(manifest["build"])
        self.snapshot_step = int(manifest["snapshot_step"])
        self.created_unix = manifest["created_unix"]
        snapshot = read_snapshot(Path(run_dir) / SNAPSHOTS / snapshot_dirname(self.snapshot_step))
        if snapshot.manifest["tokenizer_sha256"] != tokenizer.sha256:
            raise ServingIndexError(f"serving index {path} was built with another tokenizer than corpus {corpus.root}")
        self.encoder = encoder if encoder is not None else load_relevance_encoder(snapshot)
        self.tokenizer = tokenizer
        self.index = open_index(Path(path), manifest)
        self.layout = layout_of(manifest)
        self.mean = np.load(Path(path) / MEAN_FILE).astype(np.float32)
        self.index.nprobe = int(manifest["nprobe"])
        self.kind = f"full corpus, {manifest['factory']} (nprobe {manifest['nprobe']})"
        self.recall_at_10 = float(manifest["recall_at_10"])
        self.dim = self.index.d
        self.documents = int(self.index.ntotal)
        self.docs = docs
        self.by_lang: dict[str, faiss.IDSelector] = {}
        self._lang_size: dict[str, int] = {}
        self._bitmaps: dict[str, np.ndarray] = {}
        if docs is not None and self.documents:
            invlists = self.index.invlists
            ids = np.concatenate([faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
                                  for i in range(self.index.nlist) if invlists.list_size(i)])
            codes = docs.langs_of(ids)
            bits = int(ids.max()) + 1
            for code in np.unique(codes):
                mask = np.zeros(bits, dtype=bool)
                mask[ids[codes == code]] = True
                bitmap = np.packbits(mask, bitorder="little")  # FAISS reads bit (id & 7) of byte id >> 3
                name = docs.lang_names[code]
                self._bitmaps[name], self._lang_size[name] = bitmap, int(mask.sum())  # the selector reads the bitmap
                self.by_lang[name] = faiss.IDSelectorBitmap(bits, faiss.swig_ptr(bitmap))
            del ids, codes

    def embed(self, text: str) -> np.ndarray:
        return unit_vector(self.encoder, self.tokenizer, self.tokenizer.encode(text))

    def vector_of(self, doc_id: int) -> np.ndarray | None:
        if self.docs is None:
            return None
        try:
            tokens = self.docs.tokens_of(int(doc_id))
        except KeyError:  # not in the corpus
            return None
        return unit_vector(self.encoder, self.tokenizer, tokens.tolist())

    def search(self, vector: np.ndarray, k: int, lang: str | None = None,
               exclude: int | None = None) -> list[tuple[int, float]]:
        if self.index.ntotal == 0:
            return []
        if lang is not None and lang not in self.by_lang:
            return []
        size = self.index.ntotal if lang is None else self._lang_size[lang]
        want = min(size, k + (1 if exclude is not None else 0))
        query = np.ascontiguousarray(vector[None, :], dtype=np.float32)
        scores, ids = self._probe(query, want, lang)
        shift = float(query[0] @ self.mean)  # q . (z - mean) + q . mean: the cosine of unit vectors
        hits = [(int(d), float(s) + shift) for d, s in zip(ids[0], scores[0]) if d >= 0 and d != exclude]
        return hits[:k]

    def _probe(self, query: np.ndarray, want: int, lang: str | None) -> tuple[np.ndarray, np.ndarray]:
        """The index's search at its nprobe, probing 4x as many lists again while it finds fewer than `want`
        documents (a language's documents may sit in few of the lists the query is near: the filter applies
        inside the probed lists), up to every list, where it finds all there are."""
        nprobe = self.index.nprobe
        while True:
            selector = {} if lang is None else {"sel": self.by_lang[lang]}
            scores, ids = self.index.search(query, want, params=faiss.SearchParametersIVF(nprobe=nprobe, **selector))
            if int((ids[0] >= 0).sum()) >= want or nprobe >= self.index.nlist:
                return scores, ids
            nprobe = min(self.index.nlist, 4 * nprobe)
