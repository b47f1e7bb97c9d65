"""What the retrieval service searches: the newest committed index version, swapped in whole.

A `LoadedIndex` is immutable once built: the relevance encoder of the snapshot the version was built
from (so query text is embedded exactly like the documents were) and one FAISS index over every document of
the version, which holds the vectors once (a search in one language filters that index by the language's doc ids;
a search by doc id reconstructs the document's vector from it). The index type follows the version's size
(`IndexChoice`): exact inner product for small versions, HNSW for large ones, whose recall@10 against exact
search is measured on a sample when it is loaded. The `IndexHolder` polls `index/LATEST`; when a newer version
is committed it builds a new `LoadedIndex` beside the old one and replaces the reference in one assignment. A
request takes the reference once, so it is answered entirely by one version, and requests in flight during a swap
finish on the version they started with.

Memory does not hold the corpus: `DocumentTable` keeps doc id -> (shard, row, language) as arrays, and a
document's text and page are read from its Parquet shard when a hit is described, through a cache of recently
read shards bounded in bytes (`shard_text_cache`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marge.contracts import artifacts
from marge.contracts.corpus import Corpus, CorpusError
from marge.contracts.index_store import IndexVersion, latest_version
from marge.contracts.paths import INDEX, SNAPSHOTS
from marge.model.embedding import unit_vector
from marge.model.snapshot import load_relevance_encoder, read_snapshot, snapshot_dirname
from marge.util.files import BudgetCache

if TYPE_CHECKING:  # serving_index imports this module: the name is only an annotation here
    from services.retrieval.serving_index import FullCorpusIndex

log = logging.getLogger(__name__)

INDEX_TYPES = ("auto", "flat", "hnsw")


@dataclass(frozen=True)
class IndexChoice:
    """Which FAISS index the service builds for a version (`marge serve --index-type ...`)."""

    index_type: str = "auto"
    """'flat' (exact), 'hnsw' (approximate, graph), or 'auto': flat up to `flat_max_documents`, HNSW above."""
    flat_max_documents: int = 200_000
    """'auto' searches exactly up to this many documents (a brute-force scan of 200k 768-d vectors is about 10 ms
    on one core) and builds HNSW above it."""
    hnsw_m: int = 32
    """HNSW graph degree (FAISS `M`): more links, better recall, more memory (about 8 x M bytes a document)."""
    hnsw_ef_search: int = 128
    """HNSW candidates per search (FAISS `efSearch`): more, better recall, slower."""
    recall_queries: int = 200
    """Documents whose vectors are used as queries to measure an HNSW index's recall@10 against exact search."""

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"index_type must be one of {list(INDEX_TYPES)}, got {self.index_type!r}")
        if min(self.flat_max_documents, self.hnsw_m, self.hnsw_ef_search, self.recall_queries) < 1:
            raise ValueError("flat_max_documents, hnsw_m, hnsw_ef_search and recall_queries must be positive")

    def kind_for(self, documents: int) -> str:
        if self.index_type != "auto":
            return self.index_type
        return "flat" if documents <= self.flat_max_documents else "hnsw"


def shard_text_cache(corpus: Corpus, cache_mb: float = 64.0) -> BudgetCache:
    """The text and page columns of corpus shards, read from their Parquet file on demand (`.get(shard)`), the
    shards read most recently kept while they fit in `cache_mb`."""

    def read(shard: int) -> tuple[pa.Array, pa.Array]:
        path = corpus.root / corpus.shards[shard].file
        try:
            table = pq.read_table(path, columns=["text", "group"])
        except (pa.ArrowInvalid, OSError) as e:
            raise CorpusError(f"{path}: not a readable Parquet file ({e})") from None
        return table.column("text").combine_chunks(), table.column("group").combine_chunks()

    return BudgetCache(int(cache_mb * 2**20), read, lambda columns: columns[0].nbytes + columns[1].nbytes)


class DocumentTable:
    """Every corpus document's shard, row and language, by doc id, as arrays (about 18 bytes a document); text
    and page are read on demand (`shard_text_cache`). The corpus does not change between index versions."""

    def __init__(self, corpus: Corpus, cache_mb: float = 64.0, tokens_cache_mb: float = 16.0):
        ids, shards, rows, langs = [], [], [], []
        if corpus.verify_checksums:  # streamed: checking a shard does not hold it (`marge serve --verify-corpus`)
            artifacts.verify_checksums(corpus.root, {info.file: info.sha256 for info in corpus.shards},
                                       what="prepared corpus", error=CorpusError)
        for s, info in enumerate(corpus.shards):
            table = pq.read_table(corpus.root / info.file, columns=["doc_id", "lang"])
            if table.num_rows != info.rows:  # checked against the manifest without hashing the corpus
                raise CorpusError(f"{corpus.root / info.file}: {table.num_rows} documents, but the corpus manifest "
                                  f"lists {info.rows}; re-run `marge prepare`, or serve the corpus the run trained on")
            ids.append(table.column("doc_id").to_numpy().astype(np.int64))
            shards.append(np.full(table.num_rows, s, dtype=np.int32))
            rows.append(np.arange(table.num_rows, dtype=np.int32))
            langs.append(table.column("lang").combine_chunks().dictionary_encode())
        self.lang_names = sorted({str(x) for chunk in langs for x in chunk.dictionary.to_pylist()})
        code = {name: i for i, name in enumerate(self.lang_names)}
        lang_codes = [np.array([code[str(x)] for x in chunk.dictionary.to_pylist()], dtype=np.int16)[
            chunk.indices.to_numpy(zero_copy_only=False)] if len(chunk) else np.zeros(0, np.int16) for chunk in langs]
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        order = np.argsort(all_ids, kind="stable")
        self.ids = all_ids[order]
        self.shard = (np.concatenate(shards) if shards else np.zeros(0, np.int32))[order]
        self.row = (np.concatenate(rows) if rows else np.zeros(0, np.int32))[order]
        self.lang = (np.concatenate(lang_codes) if lang_codes else np.zeros(0, np.int16))[order]
        self.text = shard_text_cache(corpus, cache_mb)
        self.corpus_root, self.shard_files = corpus.root, [info.file for info in corpus.shards]
        # the tokens columns of the shards searched by doc id most recently (the full-corpus index embeds the
        # document again): a shard read once for its documents, not once a request
        self.tokens = BudgetCache(int(tokens_cache_mb * 2**20), self._read_tokens, lambda column: column.nbytes)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.shard.nbytes + self.row.nbytes + self.lang.nbytes

    def positions(self, doc_ids: np.ndarray) -> np.ndarray:
        """Rows of this table for `doc_ids` (KeyError naming the first unknown one)."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        at = np.searchsorted(self.ids, doc_ids)
        known = (at < len(self.ids)) & (self.ids[np.minimum(at, len(self.ids) - 1)] == doc_ids)
        if not known.all():
            raise KeyError(f"doc id {int(doc_ids[~known][0])} is not in the corpus")
        return at

    def langs_of(self, doc_ids: np.ndarray) -> np.ndarray:
        return self.lang[self.positions(doc_ids)]

    def _read_tokens(self, shard: int) -> pa.ListArray:
        return pq.read_table(self.corpus_root / self.shard_files[shard], columns=["tokens"]).column(0).combine_chunks()

    def tokens_of(self, doc_id: int) -> np.ndarray:
        """A document's token ids, from its shard's tokens column (read through `self.tokens`, a cache bounded by
        `tokens_cache_mb`; KeyError for an unknown id)."""
        i = int(self.positions(np.array([doc_id]))[0])
        column = self.tokens.get(int(self.shard[i]))
        return column[int(self.row[i])].values.to_numpy(zero_copy_only=False).astype(np.int64)

    def describe(self, doc_id: int, snippet_chars: int) -> dict:
        i = int(self.positions(np.array([doc_id]))[0])
        texts, groups = self.text.get(int(self.shard[i]))
        text = texts[int(self.row[i])].as_py()
        return {"doc_id": doc_id, "lang": self.lang_names[self.lang[i]], "group": groups[int(self.row[i])].as_py(),
                "text": text if len(text) <= snippet_chars else text[:snippet_chars] + "…"}


class LoadedIndex:
    def __init__(self, version: IndexVersion, run_dir: Path, corpus: Corpus, tokenizer, docs: DocumentTable | None = None,
                 choice: IndexChoice = IndexChoice()):
        self.version = version.version
        self.snapshot_step = version.snapshot_step
        self.created_unix = version.manifest["created_unix"]
        snapshot_path = str(run_dir / SNAPSHOTS / snapshot_dirname(version.snapshot_step))  # the run's own, wherever it lives
        snapshot = read_snapshot(Path(snapshot_path))
        if snapshot.manifest["tokenizer_sha256"] != tokenizer.sha256:
            raise ValueError(f"snapshot {snapshot_path} was trained with another tokenizer than corpus {corpus.root}")
        self.encoder = load_relevance_encoder(snapshot)
        self.tokenizer = tokenizer
        documents = sum(int(e.get("num_documents", 0)) for e in version.shards)
        self.kind = choice.kind_for(documents)
        self.index: faiss.Index | None = None
        ids = []
        for entry in version.shards:  # one shard's vectors at a time: the index is the only copy
            shard_index = version.read_faiss(entry["shard"])
            flat = faiss.downcast_index(shard_index.index)
            vectors = flat.reconstruct_n(0, flat.ntotal)
            shard_ids = faiss.vector_to_array(shard_index.id_map).astype(np.int64)
            if self.index is None:
                self.index = self._empty(vectors.shape[1], choice)
            self.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), shard_ids)
            ids.append(shard_ids)
            del vectors, flat, shard_index
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self.dim = self.index.d if self.index is not None else 0
        self.by_lang: dict[str, faiss.IDSelector] = {}
        self._lang_ids: dict[str, np.ndarray] = {}
        self.recall_at_10: float | None = None
        if docs is not None:
            self.build_language_selectors(docs)
        if self.kind == "hnsw" and len(self.ids):
            self.recall_at_10 = self.measure_recall(version, choice.recall_queries)
            say = log.warning if self.recall_at_10 < 0.9 else log.info
            say("index v%d (HNSW, M=%d, efSearch=%d): recall@10 %.3f against exact search on %d sampled documents%s",
                self.version, choice.hnsw_m, choice.hnsw_ef_search, self.recall_at_10,
                min(choice.recall_queries, len(self.ids)),
                "; raise --hnsw-ef-search or use --index-type flat" if self.recall_at_10 < 0.9 else "")
        self._ef_search = choice.hnsw_ef_search

    @property
    def documents(self) -> int:
        return len(self.ids)

    def _empty(self, dim: int, choice: IndexChoice) -> faiss.Index:
        if self.kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        hnsw = faiss.IndexHNSWFlat(dim, choice.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efSearch = choice.hnsw_ef_search
        return faiss.IndexIDMap2(hnsw)

    def build_language_selectors(self, docs: DocumentTable) -> None:
        """Per language, a selector of its doc ids (the vectors stay in the one index)."""
        codes = docs.langs_of(self.ids)
        for code in np.unique(codes):
            lang_ids = np.ascontiguousarray(self.ids[codes == code])
            self._lang_ids[docs.lang_names[code]] = lang_ids  # the selector reads this array: keep it alive
            self.by_lang[docs.lang_names[code]] = faiss.IDSelectorBatch(lang_ids)

    def measure_recall(self, version: IndexVersion, queries: int, k: int = 10, seed: int = 0) -> float:
        """recall@k of this index against exact inner-product search, `queries` documents' own vectors as queries
        (exact top-k computed shard by shard, so no second copy of the vectors is held)."""
        index = self.index
        if index is None:
            raise ValueError(f"index v{version.version} holds no vectors: there is no recall to measure")
        rng = np.random.default_rng(seed)
        picked = rng.choice(len(self.ids), size=min(queries, len(self.ids)), replace=False)
        q = np.stack([index.reconstruct(int(self.ids[i])) for i in picked]).astype(np.float32)
        best_scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        best_ids = np.full((len(q), k), -1, dtype=np.int64)
        for entry in version.shards:
            shard_index = version.read_faiss(entry["shard"])
            flat = faiss.downcast_index(shard_index.index)
            vectors = flat.reconstruct_n(0, flat.ntotal)
            shard_ids = faiss.vector_to_array(shard_index.id_map).astype(np.int64)
            scores = np.concatenate([best_scores, q @ vectors.T], axis=1)
            both = np.concatenate([best_ids, np.broadcast_to(shard_ids, (len(q), len(shard_ids)))], axis=1)
            top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            best_scores, best_ids = np.take_along_axis(scores, top, 1), np.take_along_axis(both, top, 1)
        _, found = index.search(q, k)
        return float(np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / k for a, b in zip(found, best_ids)]))

    def embed(self, text: str) -> np.ndarray:
        return unit_vector(self.encoder, self.tokenizer, self.tokenizer.encode(text))

    def vector_of(self, doc_id: int) -> np.ndarray | None:
        if self.index is None:  # a version without vectors holds no id
            return None
        try:
            return self.index.reconstruct(int(doc_id))
        except (RuntimeError, AssertionError):  # FAISS: an id this version does not hold
            return None

    def search(self, vector: np.ndarray, k: int, lang: str | None = None,
               exclude: int | None = None) -> list[tuple[int, float]]:
        if self.index is None or self.index.ntotal == 0:
            return []
        if lang is None:
            selector, size = None, self.index.ntotal
        elif lang in self.by_lang:
            selector, size = self.by_lang[lang], len(self._lang_ids[lang])
        else:
            return []
        want = min(size, k + (1 if exclude is not None else 0))
        if self.kind == "hnsw":
            params = faiss.SearchParametersHNSW(sel=selector, efSearch=max(self._ef_search, want))
        else:
            params = faiss.SearchParameters(sel=selector) if selector is not None else None
        scores, ids = self.index.search(np.ascontiguousarray(vector[None, :], dtype=np.float32), want, params=params)
        hits = [(int(d), float(s)) for d, s in zip(ids[0], scores[0]) if d >= 0 and d != exclude]
        return hits[:k]


class IndexHolder:
    """The current LoadedIndex, replaced by newer committed versions as they appear."""

    def __init__(self, run_dir: Path, corpus_dir: Path, poll_s: float = 2.0, choice: IndexChoice = IndexChoice(),
                 text_cache_mb: float = 64.0, verify_corpus: bool = False, full_corpus: bool = False):
        self.run_dir = Path(run_dir)
        self.index_root = self.run_dir / INDEX
        self.full_corpus = full_corpus
        """Serve RUN/serving's newest build (services.retrieval.serving_index) instead of the newest index version."""
        self.corpus_dir, self.text_cache_mb, self.verify_corpus = Path(corpus_dir), text_cache_mb, verify_corpus
        # opened by `start` (in the process that serves): an app built here and shipped to a Ray Serve replica
        # carries these settings, not the document table
        self.corpus: Corpus | None = None
        self.tokenizer = None
        self.docs: DocumentTable | None = None
        self.languages: list[str] = []
        self.choice = choice
        self.poll_s = poll_s
        self.current: LoadedIndex | FullCorpusIndex | None = None
        self.swaps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def open_corpus(self) -> None:
        """The corpus, its tokenizer and document table (once): checked against its manifest (row counts), its
        files hashed only with `verify_corpus`."""
        if self.corpus is not None:
            return
        self.corpus = Corpus.open(self.corpus_dir, verify_checksums=self.verify_corpus)
        self.tokenizer = self.corpus.tokenizer()
        self.docs = DocumentTable(self.corpus, self.text_cache_mb)
        self.languages = list(self.docs.lang_names)

    def _opened_corpus(self) -> Corpus:
        if self.corpus is None:
            raise RuntimeError(f"{self.corpus_dir}: the corpus is not open yet (open_corpus)")
        return self.corpus

    def refresh(self) -> bool:
        """Load a newer committed version if there is one. True when a swap happened."""
        with self._lock:
            self.open_corpus()
            if self.full_corpus:
                return self._refresh_full_corpus()
            latest = latest_version(self.index_root)
            if latest is None:
                if self.current is None:
                    raise FileNotFoundError(f"{self.index_root} has no committed index yet: run `marge pretrain` "
                                            "(the indexer publishes index/LATEST) and start the service again")
                return False
            if self.current is not None and latest.version <= self.current.version:
                return False
            started = time.perf_counter()
            loaded = LoadedIndex(latest, self.run_dir, self._opened_corpus(), self.tokenizer, self.docs, self.choice)
            self.current = loaded  # one reference assignment: requests see the old or the new, never a mix
            self.swaps += 1
            log.info("serving index v%d (snapshot step %d, %d documents, %s), loaded in %.2fs",
                     loaded.version, loaded.snapshot_step, loaded.documents, loaded.kind, time.perf_counter() - started)
            return True

    def _refresh_full_corpus(self) -> bool:
        from services.retrieval.serving_index import BUILDS, FullCorpusIndex, latest_build

        path = latest_build(self.run_dir)
        if path is None:
            if self.current is None:
                raise FileNotFoundError(f"{self.run_dir / 'serving'} has no serving index yet: build one with "
                                        f"`marge index build --run {self.run_dir}`, or serve without --full-corpus")
            return False
        if self.current is not None and BUILDS.order(path.name) <= self.current.version:
            return False
        started = time.perf_counter()
        self.current = FullCorpusIndex(path, self.run_dir, self._opened_corpus(), self.tokenizer, self.docs)
        self.swaps += 1
        log.info("serving the whole corpus: serving index b%d (snapshot step %d, %d documents, %s, recall@10 %.3f "
                 "at build), loaded in %.2fs", self.current.version, self.current.snapshot_step, self.current.documents,
                 self.current.kind, self.current.recall_at_10, time.perf_counter() - started)
        return True

    def start(self) -> None:
        """Load the newest version and watch for newer ones (a second call does nothing)."""
        if self._thread is not None:
            return
        self.refresh()
        self._thread = threading.Thread(target=self._watch, name="index-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a bad new version must not take the service down
                log.exception("could not load the newest index version; still serving v%s",
                              self.current.version if self.current else None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
