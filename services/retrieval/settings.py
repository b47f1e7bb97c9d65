"""The retrieval service's settings (what `marge serve` takes): a plain dataclass, importable without FastAPI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeSettings:
    run_dir: Path
    corpus_dir: Path
    token: str | None = None
    max_k: int = 100
    max_query_chars: int = 2000
    max_body_bytes: int = 64 * 1024
    max_in_flight: int = 32
    snippet_chars: int = 300
    poll_s: float = 2.0
    index_type: str = "auto"
    """'flat' (exact), 'hnsw' (approximate), 'auto' (flat up to `flat_max_documents`, HNSW above)."""
    flat_max_documents: int = 200_000
    hnsw_m: int = 32
    hnsw_ef_search: int = 128
    text_cache_mb: float = 64.0
    """Memory for the text and page columns of recently read corpus shards (hits are described from them)."""
    full_corpus: bool = False
    """Serve the newest serving index of the whole corpus (`marge index build`, RUN/serving) instead of the
    training run's newest index version."""
    verify_corpus: bool = False
    """Hash every corpus shard against its manifest at start (minutes at 100M documents); without it, each shard's
    document count is checked against the manifest as its ids are read."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_k <= 2048:  # FAISS GPU indexes cannot return more than 2048 neighbours
            raise ValueError(f"max_k must be in 1..2048, got {self.max_k}")
        if self.max_query_chars < 1 or self.max_body_bytes < 256 or self.max_in_flight < 1:
            raise ValueError("max_query_chars, max_body_bytes (>= 256) and max_in_flight must be positive")
        if self.text_cache_mb < 0:
            raise ValueError(f"text_cache_mb must be >= 0, got {self.text_cache_mb}")
        self.index_choice()  # checks the index settings

    def index_choice(self):
        from services.retrieval.version_index import IndexChoice

        return IndexChoice(self.index_type, self.flat_max_documents, self.hnsw_m, self.hnsw_ef_search)
