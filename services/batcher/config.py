"""The batcher stage's settings (the `batcher:` section of a run's config)."""

from __future__ import annotations

from dataclasses import dataclass

from marge.config import at_least, positive


@dataclass(frozen=True, kw_only=True)
class BatcherConfig:
    max_tokens: int = 2048
    """Token budget of one batch (one rank's sub-batch): evidence encoder tokens + target decoder tokens."""
    crosslingual_weight: float = 100.0
    """Weight of an edge between documents in different languages (paper: 100)."""
    monolingual_weight: float = 1.0
    """Weight of an edge between documents in the same language (paper: 1)."""
    seed_lookahead: int = 16
    """Unused seeds tried before a batch is closed as full (bounds the search per batch)."""
    index_lag: int | None = None
    """Updates after the snapshot an index version is built from at which its batches are trained (default:
    indexer.reindex_every). The indexer's head start: if the version is not built by then, the trainers wait."""

    def __post_init__(self) -> None:
        at_least(self, "max_tokens", 16)
        at_least(self, "crosslingual_weight", 0)
        at_least(self, "monolingual_weight", 0)
        positive(self, "seed_lookahead")
        if self.index_lag is not None:
            at_least(self, "index_lag", 0)
