"""The batcher stage's settings (the `batcher:` section of a run's config)."""

from __future__ import annotations

from dataclasses import dataclass

from marge.contracts.batch import decoder_cost, encoder_cost
from marge.contracts.config import at_least, positive

BATCH_KINDS = ("retrieval", "documents")


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

    shard_cache_mb: float = 512.0
    """Memory for corpus shards kept between their batches (links stay within a shard, so the batcher reads one
    shard at a time; shards that fit stay cached, and a corpus within the budget is read once). 0 keeps only the
    shard in use: the batcher's memory is then bounded by the largest shard, whatever the corpus's size."""
    builders: int = 1
    """Batch builders (actors `marge-batcher-<n>`): builder n writes the slots of the n-th of `builders` equal groups
    of trainer ranks, from every `builders`-th shard of each index version (in the version's seeded shard order),
    so the builders share no state and any of them can be restarted anywhere. `marge plan` says how many a run
    needs, from the measured rate of one builder (docs/benchmarks.md). Changing it changes which batch each slot
    holds."""
    plan_ahead: bool = True
    """Plan the next shard's batches in a background thread while this shard's are written, so the trainers do
    not wait for a shard's planning at each shard switch (its measured time: docs/benchmarks.md); the batcher then holds two
    shards' plans and documents instead of one. The batches are the same either way."""

    def __post_init__(self) -> None:
        at_least(self, "max_tokens", 16)
        at_least(self, "shard_cache_mb", 0)
        at_least(self, "crosslingual_weight", 0)
        at_least(self, "monolingual_weight", 0)
        positive(self, "seed_lookahead", "builders")
        if self.index_lag is not None:
            at_least(self, "index_lag", 0)


@dataclass(frozen=True)
class BatchShape:
    """What the run's objectives need from the batcher (`ObjectivesConfig.batches`, derived by the driver, not
    configured)."""

    kind: str = "retrieval"
    """'retrieval': greedy subgraphs of the index graph (targets and their evidence, MARGE); 'documents':
    documents packed in a seeded order without an index (every document a target and its own source:
    BART, VECO's halves)."""
    extra_target_passes: int = 0
    """Extra encoder + decoder passes each target of a retrieval batch costs (a BART objective on MARGE's
    targets): counted in the token budget, so every objective's examples share one budget."""
    negatives: int = 0
    """Unlinked documents of its shard each retrieval batch carries besides its targets and evidence (neither
    target nor evidence): the denoising loss's extra negatives (`objectives.denoising_contrastive.extra_documents`),
    read from the batcher's bounded store instead of a whole corpus on every trainer. Not in the token budget: they
    pass through g alone."""

    def __post_init__(self) -> None:
        if self.kind not in BATCH_KINDS:
            raise ValueError(f"batch kind must be one of {list(BATCH_KINDS)}, got {self.kind!r}")
        if self.extra_target_passes < 0:
            raise ValueError(f"extra_target_passes must be >= 0, got {self.extra_target_passes}")
        if self.negatives < 0 or (self.negatives and self.kind != "retrieval"):
            raise ValueError(f"negatives must be >= 0, and only retrieval batches carry them; got {self.negatives} "
                             f"for {self.kind!r} batches")

    def target_cost(self, text_tokens: int) -> int:
        """Budget tokens of a target: decoded once, plus its extra passes (encoded and decoded again)."""
        return decoder_cost(text_tokens) + self.extra_target_passes * (encoder_cost(text_tokens) + decoder_cost(text_tokens))

    def document_cost(self, text_tokens: int) -> int:
        """Budget tokens of a document in a 'documents' batch: encoded once (its noised copy, or VECO's two
        segments twice over half the length) and decoded once."""
        return encoder_cost(text_tokens) + decoder_cost(text_tokens)
