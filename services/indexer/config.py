"""The indexer stage's settings (the `indexer:` section of a run's config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from marge.config import FieldError, at_least, non_negative_mapping, one_of, positive, within

LINK_RULES = ("shard", "document")


@dataclass(frozen=True, kw_only=True)
class IndexerConfig:
    num_workers: int = 1
    """Indexer actors; scale independently of the trainers."""
    reindex_every: int = 10000
    """Re-index when the newest snapshot is this many updates past the indexed one (paper: 10k)."""
    batch_tokens: int = 4096
    """Padded tokens per embedding batch (documents are sorted by length first)."""
    links_monolingual: float = 4.0
    """Same-language links kept per document on average (paper §3: 4)."""
    links_crosslingual: float = 4.0
    """Cross-language links kept per document on average (paper §3: 4)."""
    candidates_per_language: int = 32
    """Nearest neighbours looked at per document in each language before the links are chosen."""
    min_score: float = -1.0
    """Links with a cosine below this are never kept (-1: the top-k rule alone)."""
    link_rule: str = "shard"
    """'shard': the strongest pairs across the whole shard (paper §2.4); some documents get no link.
    Deviation 'document': every document keeps its own strongest links of each kind, so no language can
    be starved of links when its cosines run lower than the others'."""
    keep_versions: int = 3
    """Committed index versions kept on disk (the newest always)."""
    use_gpu: bool = False
    bf16: bool = False
    """Embed under bf16 autocast (on a GPU)."""
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per worker, e.g. {marge_indexer: 1} to place indexers on their own node group."""
    shards_per_refresh: int = 0
    """Sampled refresh: each new version re-embeds this many shards, rotating (version v rebuilds shards
    v*k .. v*k+k-1 modulo the shard count), and carries the others over from the previous version with
    the older snapshot step they were built from (per shard in the manifest). 0: every shard, every
    version (the paper's full refresh). Trades index freshness for refresh cost on a large corpus."""
    nice: int = 0
    """OS niceness of indexer workers (0-19). Where indexers share CPUs with trainers, a positive value
    lets re-indexing use the trainers' slack instead of their time (at the cost of staler indexes)."""

    def __post_init__(self) -> None:
        at_least(self, "keep_versions", 2)  # the version being trained on and the next one
        positive(self, "num_workers", "reindex_every", "batch_tokens", "candidates_per_language",
                 "num_cpus_per_worker")
        at_least(self, "shards_per_refresh", 0)
        at_least(self, "links_monolingual", 0)
        at_least(self, "links_crosslingual", 0)
        within(self, "min_score", -1.0, 1.0)
        one_of(self, "link_rule", LINK_RULES)
        at_least(self, "num_gpus_per_worker", 0)
        within(self, "nice", 0, 19)
        non_negative_mapping(self, "resources")
        if self.num_gpus_per_worker > 0 and not self.use_gpu:
            raise FieldError("use_gpu", self.use_gpu, "true when num_gpus_per_worker > 0")
