"""What the retrieval service searches: the newest committed index version, swapped in whole.

A `LoadedIndex` is immutable once built: the relevance encoder of the snapshot the version was built
from (so query text is embedded exactly like the documents were), one exact inner-product index over
every document, and one per language. The `IndexHolder` polls `index/LATEST`; when a newer version is
committed it builds a new `LoadedIndex` beside the old one and replaces the reference in one
assignment. A request takes the reference once, so it is answered entirely by one version, and
requests in flight during a swap finish on the version they started with.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import torch

from marge.batch import as_encoder_input, max_text_tokens
from marge.corpus import Corpus
from marge.index_store import IndexVersion, flat_ip_index, latest_version
from marge.paths import INDEX, SNAPSHOTS
from marge.model import pad_rows
from marge.snapshot import load_relevance_encoder, read_snapshot, snapshot_dirname

log = logging.getLogger(__name__)


@dataclass
class DocumentTable:
    """Metadata of every corpus document, by doc id (the corpus does not change between versions)."""

    position: dict[int, int]
    langs: list[str]
    groups: list[str]
    texts: list[str]

    @classmethod
    def load(cls, corpus: Corpus) -> "DocumentTable":
        ids, langs, groups, texts = [], [], [], []
        for s in range(corpus.num_shards):
            table = corpus.read_table(s).select(["doc_id", "lang", "group", "text"])
            ids += table.column("doc_id").to_pylist()
            langs += table.column("lang").to_pylist()
            groups += table.column("group").to_pylist()
            texts += table.column("text").to_pylist()
        return cls({d: i for i, d in enumerate(ids)}, langs, groups, texts)

    def describe(self, doc_id: int, snippet_chars: int) -> dict:
        i = self.position[doc_id]
        text = self.texts[i]
        return {"doc_id": doc_id, "lang": self.langs[i], "group": self.groups[i],
                "text": text if len(text) <= snippet_chars else text[:snippet_chars] + "…"}


class LoadedIndex:
    def __init__(self, version: IndexVersion, run_dir: Path, corpus: Corpus, tokenizer):
        self.version = version.version
        self.snapshot_step = version.snapshot_step
        self.created_unix = version.manifest["created_unix"]
        snapshot_path = str(run_dir / SNAPSHOTS / snapshot_dirname(version.snapshot_step))  # the run's own, wherever it lives
        snapshot = read_snapshot(Path(snapshot_path))
        if snapshot.manifest["tokenizer_sha256"] != tokenizer.sha256:
            raise ValueError(f"snapshot {snapshot_path} was trained with another tokenizer than corpus {corpus.root}")
        self.encoder = load_relevance_encoder(snapshot)
        self.tokenizer = tokenizer
        ids, vectors = [], []
        for entry in version.shards:
            shard_index = version.read_faiss(entry["shard"])
            flat = faiss.downcast_index(shard_index.index)
            vectors.append(flat.reconstruct_n(0, flat.ntotal))
            ids.append(faiss.vector_to_array(shard_index.id_map))
        self.ids = np.concatenate(ids).astype(np.int64)
        self.vectors = np.concatenate(vectors).astype(np.float32)
        self.dim = self.vectors.shape[1]
        self.all = flat_ip_index(self.vectors, self.ids)
        self.position = {int(d): i for i, d in enumerate(self.ids)}
        self.by_lang: dict[str, faiss.Index] = {}

    def build_language_indexes(self, docs: DocumentTable) -> None:
        langs = np.array([docs.langs[docs.position[int(d)]] for d in self.ids])
        for lang in np.unique(langs):
            mask = langs == lang
            self.by_lang[str(lang)] = flat_ip_index(self.vectors[mask], self.ids[mask])

    @torch.no_grad()
    def embed(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text)[: max_text_tokens(self.encoder.cfg.max_positions)]
        tokens = pad_rows([as_encoder_input(ids, self.tokenizer.specials)], self.tokenizer.specials.pad_id)
        return self.encoder.unit_vectors(tokens)[0].numpy()  # as the indexer stored the documents

    def vector_of(self, doc_id: int) -> np.ndarray | None:
        i = self.position.get(doc_id)
        return None if i is None else self.vectors[i]

    def search(self, vector: np.ndarray, k: int, lang: str | None = None,
               exclude: int | None = None) -> list[tuple[int, float]]:
        index = self.all if lang is None else self.by_lang.get(lang)
        if index is None or index.ntotal == 0:
            return []
        want = min(index.ntotal, k + (1 if exclude is not None else 0))
        scores, ids = index.search(vector[None, :], want)
        hits = [(int(d), float(s)) for d, s in zip(ids[0], scores[0]) if d >= 0 and d != exclude]
        return hits[:k]


class IndexHolder:
    """The current LoadedIndex, replaced by newer committed versions as they appear."""

    def __init__(self, run_dir: Path, corpus_dir: Path, poll_s: float = 2.0):
        self.run_dir = Path(run_dir)
        self.index_root = self.run_dir / INDEX
        self.corpus = Corpus.open(corpus_dir)
        self.tokenizer = self.corpus.tokenizer()
        self.docs = DocumentTable.load(self.corpus)
        self.languages = sorted(set(self.docs.langs))
        self.poll_s = poll_s
        self.current: LoadedIndex | None = None
        self.swaps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Load a newer committed version if there is one. True when a swap happened."""
        with self._lock:
            latest = latest_version(self.index_root)
            if latest is None:
                if self.current is None:
                    raise FileNotFoundError(f"{self.index_root} has no committed index yet: run `marge pretrain` "
                                            "(the indexer publishes index/LATEST) and start the service again")
                return False
            if self.current is not None and latest.version <= self.current.version:
                return False
            started = time.perf_counter()
            loaded = LoadedIndex(latest, self.run_dir, self.corpus, self.tokenizer)
            loaded.build_language_indexes(self.docs)
            self.current = loaded  # one reference assignment: requests see the old or the new, never a mix
            self.swaps += 1
            log.info("serving index v%d (snapshot step %d, %d documents), loaded in %.2fs",
                     loaded.version, loaded.snapshot_step, len(loaded.ids), time.perf_counter() - started)
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
