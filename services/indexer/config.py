"""The indexer stage's settings (the `indexer:` section of a run's config)."""

from __future__ import annotations

from dataclasses import dataclass

from marge.contracts.config import FieldError, at_least, non_negative_mapping, one_of, positive, resumable, within

LINK_RULES = ("shard", "document")
SHARD_SAMPLINGS = ("independent", "cycle")
LINK_SOURCES = ("g", "tfidf", "aligned")
ALIGNED_LAYOUTS = ("translations", "budget")
BOOTSTRAPS = ("none", "tfidf")


@dataclass(frozen=True, kw_only=True)
class IndexerConfig:
    num_workers: int = resumable(1)
    """Indexer actors; scale independently of the trainers."""
    reindex_every: int = 10000
    """Re-index when the newest snapshot is this many updates past the indexed one (paper: 10k)."""
    batch_tokens: int = resumable(4096)
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
    links: str = "g"
    """What ranks a document's candidate links. 'g': cos(g) of the version's snapshot (the paper). 'tfidf': char
    2-4-gram TF-IDF cosine within the shard at every version, g never used (a frozen lexical retriever: the
    control that says whether the learned g adds anything). 'aligned': diagnostic, not MARGE: each document's
    aligned translations (the corpus's paragraph ids) plus `aligned_distractors` random documents of its
    shard, the ceiling a retriever could give the decoder."""
    bootstrap: str = "none"
    """Deviation 'tfidf' (with links 'g'): version 0 is built from char 2-4-gram TF-IDF neighbours within each
    shard (no weights, no labels) instead of the random-init g (the paper, 'none'); later versions rank by
    cos(g) + lambda * tfidf (`lexical_weight`, `lexical_until`)."""
    lexical_weight: float = 0.0
    """lambda at update 0 in cos(g) + lambda * tfidf for versions after the first; 0: g alone (the paper)."""
    lexical_until: int = 0
    """lambda falls linearly from `lexical_weight` to 0 at this update (of the version's snapshot)."""
    aligned_distractors: int = 2
    """links 'aligned' with layout 'translations': random in-shard documents linked to each document besides its
    translations, so that beta * f has something to tell apart."""
    aligned_layout: str = "translations"
    """links 'aligned' (diagnostic): 'translations' links each document to all its aligned translations plus
    `aligned_distractors` random documents of its shard. 'budget' gives the oracle the loop's own link budget:
    `links_monolingual` same-language neighbours by char TF-IDF (as the lexical bootstrap finds them) and
    `links_crosslingual` cross-lingual slots filled with the aligned translations first, then random
    cross-lingual documents of the shard; the random ones are drawn again at every rebuild."""
    keep_versions: int = 3
    """Committed index versions kept on disk (the newest always)."""
    keep_snapshots: int = 0
    """0: every snapshot stays (`marge report` draws g's P@1 over them). N > 0: after each index version, the
    snapshots the run no longer needs are deleted, keeping step 0 (which g's verdict compares with), those the kept
    index versions were built from, every one from the index version the oldest kept checkpoint resumes with on,
    and the newest N (a 963M model's g is 1.2 GB a snapshot: 54 GB over the paper's first phase otherwise)."""
    use_gpu: bool = resumable(False)
    """Embed (and search, with faiss-gpu) on a GPU; the run is refused where the cluster has none."""
    bf16: bool= resumable(False)
    """Embed under bf16 autocast (on a GPU)."""
    num_cpus_per_worker: float = resumable(1.0)
    """Logical CPUs Ray gives each indexer worker (also its torch and FAISS threads)."""
    num_gpus_per_worker: float = resumable(0.0)
    """GPUs (or a share of one) Ray gives each indexer worker with use_gpu."""
    resources: dict[str, float] = resumable(default_factory=dict)
    """Custom Ray resources per worker, e.g. {marge_indexer: 1} to place indexers on their own node group."""
    shards_per_version: int = 0
    """The paper's refresh (§2.4: "every 10k model updates, we sample a set of shards of documents"): version v
    embeds and links a sample of this many shards, drawn from the run's seed and v, and holds only those, so the
    batcher trains v's updates on them alone and every link a batch uses comes from the snapshot v was built from.
    A refresh then costs k shards whatever the corpus size. 0: every shard, every version. `marge serve` answers
    from the newest version, that is from its k shards: `marge index build` and `marge serve --full-corpus` serve
    every document instead."""
    shard_sampling: str = "independent"
    """How `shards_per_version` draws its samples: 'independent' (each version its own draw from every shard; over
    V versions a share (1 - k/N)^V of the N shards is never drawn: about 31% at the paper's 128 of 5,000 over its
    45 refreshes) or 'cycle' (versions walk through a seeded permutation of the shards, k at a time, and draw a new
    permutation once every shard has been drawn: every shard once per N/k versions). `marge plan` prints the
    coverage of either."""
    shards_per_refresh: int = 0
    """Rotating refresh (not the paper's): each new version re-embeds this many shards, rotating (version v
    rebuilds shards v*k .. v*k+k-1 modulo the shard count), and carries the others over from the previous
    version with the older snapshot step they were built from (per shard in the manifest), so batches mostly
    come from stale shards. 0: off. Exclusive with `shards_per_version`."""
    nice: int = resumable(0)
    """OS niceness of indexer workers (0-19). Where indexers share CPUs with trainers, a positive value
    lets re-indexing use the trainers' slack instead of their time (at the cost of staler indexes)."""

    def lexical_lambda(self, snapshot_step: int) -> float:
        """lambda of a version built from the snapshot of `snapshot_step` (versions after the first)."""
        if not self.lexical_weight or snapshot_step >= self.lexical_until:
            return 0.0
        return self.lexical_weight * (1.0 - snapshot_step / self.lexical_until)

    def link_source(self, snapshot_step: int) -> tuple[str, float]:
        """How the version of `snapshot_step` ranks links: ('g' | 'tfidf' | 'hybrid' | 'aligned', lambda)."""
        if self.links != "g":
            return self.links, 0.0
        if snapshot_step == 0 and self.bootstrap == "tfidf":
            return "tfidf", 0.0
        lam = self.lexical_lambda(snapshot_step)
        return ("hybrid", lam) if lam > 0 else ("g", 0.0)

    def __post_init__(self) -> None:
        at_least(self, "keep_versions", 2)  # the version being trained on and the next one
        at_least(self, "keep_snapshots", 0)
        positive(self, "num_workers", "reindex_every", "batch_tokens", "candidates_per_language",
                 "num_cpus_per_worker")
        at_least(self, "shards_per_refresh", 0)
        at_least(self, "shards_per_version", 0)
        if self.shards_per_refresh and self.shards_per_version:
            raise FieldError("shards_per_refresh", self.shards_per_refresh,
                             "0 when indexer.shards_per_version samples the shards (choose one way to refresh)")
        at_least(self, "links_monolingual", 0)
        at_least(self, "links_crosslingual", 0)
        within(self, "min_score", -1.0, 1.0)
        one_of(self, "link_rule", LINK_RULES)
        one_of(self, "shard_sampling", SHARD_SAMPLINGS)
        one_of(self, "links", LINK_SOURCES)
        one_of(self, "bootstrap", BOOTSTRAPS)
        at_least(self, "lexical_weight", 0)
        at_least(self, "lexical_until", 0)
        at_least(self, "aligned_distractors", 0)
        one_of(self, "aligned_layout", ALIGNED_LAYOUTS)
        if self.bootstrap != "none" and self.links != "g":
            raise FieldError("bootstrap", self.bootstrap, f"'none' when links is {self.links!r} (a bootstrap hands "
                                                          "over to g; links 'g' uses one)")
        if self.lexical_weight > 0 and self.links != "g":
            raise FieldError("lexical_weight", self.lexical_weight, f"0 when links is {self.links!r}")
        if self.lexical_weight > 0 and self.lexical_until == 0:
            raise FieldError("lexical_until", 0, "> 0 when lexical_weight > 0 (the update at which lambda reaches 0)")
        at_least(self, "num_gpus_per_worker", 0)
        within(self, "nice", 0, 19)
        non_negative_mapping(self, "resources")
        if self.num_gpus_per_worker > 0 and not self.use_gpu:
            raise FieldError("use_gpu", self.use_gpu, "true when num_gpus_per_worker > 0")
