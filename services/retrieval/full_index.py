"""A serving index of the whole corpus, built offline from one snapshot (`marge index build`), for the retrieval
service to load instead of the newest training index version, which holds only the shards its refresh embedded
(`indexer.shards_per_version`: 128 of 5,000 shards at the paper's setting) and every vector in float32.

    RUN/serving/
      LATEST                   {"build": 2, "dir": "b000002"}   (atomic rename; only moves forward)
      b000002/
        index.faiss            an inverted-file index (inner product) over g(z) - mean of every corpus document,
                               coded with 8-bit scalar quantisation (`sq8`: d bytes a document against 4 d for
                               float32) or product quantisation (`pq`: d / 4 bytes), doc ids as FAISS ids
        mean.npy               the mean the vectors are stored from (float32, d)
        manifest.json          the snapshot step, codec, lists, the nprobe chosen, documents, the recall@10
                               measured at build, sha256 of index.faiss

Vectors are stored minus their mean: for a query q, q . (z - mean) + q . mean = q . z, so the ranking is exactly
inner-product search over g(z) (the score returned adds q . mean back), while the codes spend their 8 bits on how
documents differ rather than on what they share (an untrained or uncentred g puts every document within a few
degrees of the mean). It is built in two passes over the shards, one shard in memory at a time: the coarse
quantiser (and the codec) is trained on the vectors of a seeded sample of shards, then every shard is embedded and added. Recall@10 against exact
inner-product search is measured at build, on `recall_queries` documents' own vectors as queries, the exact top 10
computed shard by shard as the shards stream past; `nprobe` is the smallest power of two whose recall reaches
`target_recall`, and the service searches with it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from marge import artifacts
from marge.corpus import Corpus
from marge.embedding import embed_documents
from marge.progress import track
from marge.snapshot import SnapshotInfo, load_relevance_encoder
from marge.utils import sha256_file

log = logging.getLogger(__name__)

SERVING = "serving"
INDEX_FILE = "index.faiss"
MEAN_FILE = "mean.npy"
FORMAT = "marge-serving-index"
FORMAT_VERSION = 1
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


def build_serving_index(run_dir: Path, corpus: Corpus, snapshot: SnapshotInfo, opts: BuildOptions = BuildOptions()) -> Path:
    """Embed every corpus document with `snapshot`'s g into a new serving index under RUN/serving, measure its
    recall, choose its nprobe, commit it (manifest last) and point LATEST at it. Returns its folder."""
    tokenizer = corpus.tokenizer()
    if snapshot.manifest["tokenizer_sha256"] != tokenizer.sha256:
        raise ServingIndexError(f"snapshot {snapshot.path} was trained with another tokenizer than corpus {corpus.root}")
    started = time.time()
    encoder = load_relevance_encoder(snapshot).to(opts.device)
    documents = int(corpus.manifest["num_documents"])
    nlist = opts.nlist or default_nlist(documents)
    wanted = opts.train_documents or max(MIN_POINTS_PER_LIST * nlist, 10_000)
    rng = np.random.default_rng(opts.seed)

    # pass 1: the quantisers, trained on the vectors of a seeded sample of shards (kept for pass 2)
    sample: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for shard in rng.permutation(corpus.num_shards):
        sample[int(shard)] = _embed_shard(corpus, int(shard), encoder, tokenizer.specials, opts)
        if sum(len(ids) for ids, _ in sample.values()) >= wanted:
            break
    training = np.concatenate([vectors for _, vectors in sample.values()])
    dim = training.shape[1]
    mean = training.mean(axis=0).astype(np.float32)
    queries = training[rng.choice(len(training), size=min(opts.recall_queries, len(training)), replace=False)]
    index = faiss.index_factory(dim, factory_string(dim, nlist, opts.codec), faiss.METRIC_INNER_PRODUCT)
    index.train(np.ascontiguousarray(training[rng.permutation(len(training))[:wanted]] - mean))
    del training  # no direct map (about 50 bytes a document): a search by doc id embeds the document again

    # pass 2: every shard added, the exact top 10 of the queries kept as the shards stream past
    k = 10
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_ids = np.full((len(queries), k), -1, dtype=np.int64)
    for shard in track(range(corpus.num_shards), "serving index: embedding shards", unit="shard"):
        ids, vectors = sample.pop(shard, None) or _embed_shard(corpus, shard, encoder, tokenizer.specials, opts)
        index.add_with_ids(np.ascontiguousarray(vectors - mean), ids)
        scores = np.concatenate([best_scores, queries @ vectors.T], axis=1)
        both = np.concatenate([best_ids, np.broadcast_to(ids, (len(queries), len(ids)))], axis=1)
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        best_scores, best_ids = np.take_along_axis(scores, top, 1), np.take_along_axis(both, top, 1)

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

    root = Path(run_dir) / SERVING
    root.mkdir(parents=True, exist_ok=True)
    existing = BUILDS.versions(root)
    build = (_build_of(existing[-1].name) + 1) if existing else 0
    target = root / f"b{build:06d}"
    with artifacts.publish_dir(target, overwrite=False, error=ServingIndexError) as tmp:
        faiss.write_index(index, str(tmp / INDEX_FILE))
        np.save(tmp / MEAN_FILE, mean)
        artifacts.write_manifest(tmp, {
            "format": FORMAT, "version": FORMAT_VERSION, "build": build, "snapshot_step": snapshot.step,
            "codec": opts.codec, "factory": factory_string(dim, nlist, opts.codec), "nlist": int(index.nlist),
            "nprobe": int(nprobe), "dim": dim, "documents": int(index.ntotal), "corpus_documents": documents,
            "recall_at_10": recall, "recall_by_nprobe": {str(p): r for p, r in curve.items()},
            "recall_queries": len(queries), "vector_bytes": int(index.ntotal) * dim * 4,
            "index_bytes": (tmp / INDEX_FILE).stat().st_size, "index_sha256": sha256_file(tmp / INDEX_FILE),
            "mean_sha256": sha256_file(tmp / MEAN_FILE),
            "build_seconds": round(time.time() - started, 1), "created_unix": time.time()})
    BUILDS.set_latest(root, target.name)
    log.info("serving index b%d: %d documents from snapshot step %d, %s, nprobe %d: recall@10 %.3f, %.0f MiB "
             "(%.2f of the vectors' bytes)", build, index.ntotal, snapshot.step, factory_string(dim, nlist, opts.codec),
             nprobe, recall, (target / INDEX_FILE).stat().st_size / 2**20,
             (target / INDEX_FILE).stat().st_size / max(1, index.ntotal * dim * 4))
    return target


def read_build(path: Path, verify: bool = True) -> dict:
    return artifacts.read_manifest(
        Path(path), FORMAT, (FORMAT_VERSION,),
        fields=("build", "snapshot_step", "codec", "nprobe", "documents", "recall_at_10", "index_sha256"),
        checksums=(lambda m: {INDEX_FILE: m["index_sha256"], MEAN_FILE: m["mean_sha256"]}) if verify else None,
        what="serving index", error=ServingIndexError)


def latest_build(run_dir: Path) -> Path | None:
    return BUILDS.latest(Path(run_dir) / SERVING)


class FullCorpusIndex:
    """A serving index loaded for the service: the interface of `services.retrieval.index.LoadedIndex` (what the
    app calls), over every corpus document. Beyond the codes it holds one bit a document per language (the
    language filters) and no id map: a search by doc id embeds that document's tokens again, which gives its vector
    exactly (the codes give it to within the quantisation)."""

    def __init__(self, path: Path, run_dir: Path, corpus: Corpus, tokenizer, docs=None, encoder=None):
        from marge.paths import SNAPSHOTS
        from marge.snapshot import read_snapshot, snapshot_dirname

        manifest = read_build(path, verify=False)  # its size is the point: read once, by FAISS
        self.version = int(manifest["build"])
        self.snapshot_step = int(manifest["snapshot_step"])
        self.created_unix = manifest["created_unix"]
        snapshot = read_snapshot(Path(run_dir) / SNAPSHOTS / snapshot_dirname(self.snapshot_step))
        if snapshot.manifest["tokenizer_sha256"] != tokenizer.sha256:
            raise ServingIndexError(f"serving index {path} was built with another tokenizer than corpus {corpus.root}")
        self.encoder = encoder if encoder is not None else load_relevance_encoder(snapshot)
        self.tokenizer = tokenizer
        self.index = faiss.read_index(str(Path(path) / INDEX_FILE))
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
        from services.retrieval.index import unit_vector

        return unit_vector(self.encoder, self.tokenizer, self.tokenizer.encode(text))

    def vector_of(self, doc_id: int) -> np.ndarray | None:
        from services.retrieval.index import unit_vector

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
        params = (faiss.SearchParametersIVF(nprobe=self.index.nprobe) if lang is None
                  else faiss.SearchParametersIVF(sel=self.by_lang[lang], nprobe=self.index.nprobe))
        query = np.ascontiguousarray(vector[None, :], dtype=np.float32)
        scores, ids = self.index.search(query, want, params=params)
        shift = float(query[0] @ self.mean)  # q . (z - mean) + q . mean: the cosine of unit vectors
        hits = [(int(d), float(s) + shift) for d, s in zip(ids[0], scores[0]) if d >= 0 and d != exclude]
        return hits[:k]
