"""The pipeline configuration: one typed tree, loaded from `deploy/configs/<name>.yaml` plus
`section.field=value` overrides, validated when built (unknown keys and bad values are errors that
name the key).

Numbers live in the YAML files; `tiny.yaml` runs on a laptop, `paper.yaml` is the paper's setting.
Deployment endpoints (Redis URL, Ray address) may also come from the environment
(MARGE_REDIS_URL, RAY_ADDRESS) so one config file serves every cluster.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from marge.model import MargeConfig, preset


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class RunSection:
    name: str = "marge"
    """Run name: Ray Train resumes a run with the same name and directory."""
    dir: str = "runs/marge"
    """Where snapshots, indexes, checkpoints and logs go (shared storage on a multi-node cluster)."""
    seed: int = 0
    max_steps: int = 100
    """Optimizer updates to train for (the paper: 1M)."""
    max_minutes: float = 0.0
    """Stop training after this many minutes (0: no limit)."""
    progress_every_s: float = 10.0


@dataclass(frozen=True, kw_only=True)
class DataSection:
    raw: list[str] = field(default_factory=lambda: ["data/demo/libreoffice-help/documents.jsonl.gz"])
    """Raw input for `marge prepare`, used when `corpus` does not exist yet."""
    corpus: str = "data/prepared/demo"
    vocab_size: int = 8000
    max_chunk_tokens: int = 512
    docs_per_shard: int = 512
    num_shards: int | None = None
    heldout_pairs: str | None = "data/demo/libreoffice-help/heldout_pairs.tsv"


@dataclass(frozen=True, kw_only=True)
class IndexerSection:
    num_workers: int = 1
    """Indexer actors; scale independently of the trainers."""
    reindex_every: int = 10000
    """Re-index when the newest snapshot is this many updates past the indexed one (paper: 10k)."""
    batch_tokens: int = 4096
    links_monolingual: float = 4.0
    links_crosslingual: float = 4.0
    candidates_per_language: int = 32
    min_score: float = -1.0
    link_rule: str = "shard"
    """'shard': top pairs across the shard (paper); 'document': each document's own top links (deviation)."""
    keep_versions: int = 3
    use_gpu: bool = False
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per worker, e.g. {marge_indexer: 1} to place indexers on their own node group."""
    nice: int = 0
    """OS niceness of indexer workers (0-19). Where indexers share CPUs with trainers, a positive value
    lets re-indexing use the trainers' slack instead of their time (at the cost of staler indexes)."""


@dataclass(frozen=True, kw_only=True)
class BatcherSection:
    max_tokens: int = 2048
    crosslingual_weight: float = 100.0
    monolingual_weight: float = 1.0
    seed_lookahead: int = 16
    attend_to: str = "all"
    """'all': each target cross-attends to every evidence document in its batch (paper Eq. 2); 'linked': only to linked ones."""
    epochs_per_version: int = 0
    """Passes over one index version's graph before waiting for the next (0: unlimited)."""


@dataclass(frozen=True, kw_only=True)
class QueueSection:
    max_depth: int = 32
    """Batches waiting in the stream at most; the batcher waits (nothing is trimmed or dropped)."""
    block_ms: int = 1000
    claim_idle_ms: int = 60000
    """A delivered batch not acknowledged for this long is claimed by another trainer."""
    max_deliveries: int = 3
    """A batch delivered more often than this goes to the dead-letter stream."""


@dataclass(frozen=True, kw_only=True)
class TrainerSection:
    num_workers: int = 2
    use_gpu: bool = False
    lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int | None = None
    """Steps of the linear annealing schedule (default: run.max_steps)."""
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    grad_accum: int = 1
    bf16: bool = False
    snapshot_every: int = 10000
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    num_cpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per worker, e.g. {marge_trainer: 1}."""
    torch_threads: int = 1
    max_staleness: int = 0
    """Batches whose snapshot is more than this many updates old are dead-lettered (0: no limit)."""
    self_evidence_prob: float = 0.0
    """Deviation (0 in `paper`): share of targets that also get a noised copy of themselves as evidence
    at step 0, annealed linearly to 0 at `self_evidence_until` (see marge.augment)."""
    self_evidence_until: int = 0
    self_evidence_deletion: float = 0.3
    denoise_weight: float = 0.0
    """Deviation (0 in `paper`): weight of the denoising contrastive loss on g (marge.training.DenoisingContrastive)."""
    denoise_deletion: float = 0.6
    denoise_temperature: float = 0.05
    denoise_extra_documents: int = 32
    """Random corpus documents added to each batch's denoising loss as negatives."""


@dataclass(frozen=True, kw_only=True)
class HealthSection:
    """Retrieval-health probes, measured by trainer rank 0 at every snapshot (see marge.health)."""

    documents: str | None = "data/demo/libreoffice-help/heldout_documents.jsonl.gz"
    """Held-out pages (documents JSONL with `group`) for the evidence-gain probe; null turns probes off."""
    probe_size: int = 32
    max_evidence: int = 3
    max_tokens: int = 128
    pairs: str | None = None
    """Held-out pairs TSV for retrieval P@1 at every snapshot (null: data.heldout_pairs)."""
    pairs_per_language: int = 200
    """Pairs per language pair used for the per-snapshot P@1 (0: skip it)."""
    eval_layer: int | None = None
    """Encoder layer mean-pooled for P@1 (null: the paper's 5, or the deepest the model has)."""


@dataclass(frozen=True, kw_only=True)
class RedisSection:
    url: str | None = None
    """redis://... of an existing server; None starts a private redis-server (loopback, random password)."""
    appendfsync: str = "everysec"
    maxmemory: str = "1gb"


@dataclass(frozen=True, kw_only=True)
class RaySection:
    address: str | None = None
    """An existing cluster ('auto', 'ray://...'); None starts a local one (or joins RAY_ADDRESS when set)."""
    num_cpus: int | None = None
    include_dashboard: bool = False
    object_store_memory: int = 256 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    """`preset` plus any MargeConfig field to override; vocab_size defaults to the tokenizer's."""
    indexer: IndexerSection = field(default_factory=IndexerSection)
    batcher: BatcherSection = field(default_factory=BatcherSection)
    queue: QueueSection = field(default_factory=QueueSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    health: HealthSection = field(default_factory=HealthSection)
    redis: RedisSection = field(default_factory=RedisSection)
    ray: RaySection = field(default_factory=RaySection)

    def __post_init__(self) -> None:
        check = _Checker()
        check.positive("run.max_steps", self.run.max_steps)
        check.nonneg("run.max_minutes", self.run.max_minutes)
        check.positive("data.vocab_size", self.data.vocab_size)
        check.positive("data.max_chunk_tokens", self.data.max_chunk_tokens)
        check.positive("indexer.num_workers", self.indexer.num_workers)
        check.positive("indexer.reindex_every", self.indexer.reindex_every)
        if not 0 <= self.indexer.nice <= 19:
            raise ConfigError(f"indexer.nice must be in 0..19, got {self.indexer.nice}")
        check.positive("trainer.num_workers", self.trainer.num_workers)
        check.positive("trainer.grad_accum", self.trainer.grad_accum)
        check.positive("trainer.snapshot_every", self.trainer.snapshot_every)
        check.positive("trainer.checkpoint_every", self.trainer.checkpoint_every)
        check.positive("queue.max_depth", self.queue.max_depth)
        check.positive("queue.max_deliveries", self.queue.max_deliveries)
        if self.batcher.attend_to not in ("all", "linked"):
            raise ConfigError(f"batcher.attend_to must be 'all' or 'linked', got {self.batcher.attend_to!r}")
        if self.batcher.max_tokens < 2 * self.data.max_chunk_tokens + 3:
            raise ConfigError(f"batcher.max_tokens ({self.batcher.max_tokens}) must fit one target and one evidence "
                              f"document of data.max_chunk_tokens ({self.data.max_chunk_tokens}): at least "
                              f"{2 * self.data.max_chunk_tokens + 3}")
        if self.indexer.reindex_every % self.trainer.snapshot_every:
            raise ConfigError(f"indexer.reindex_every ({self.indexer.reindex_every}) must be a multiple of "
                              f"trainer.snapshot_every ({self.trainer.snapshot_every}): the indexer can only use published snapshots")
        if self.redis.appendfsync not in ("always", "everysec", "no"):
            raise ConfigError(f"redis.appendfsync must be always, everysec or no, got {self.redis.appendfsync!r}")
        if "preset" not in self.model:
            raise ConfigError("model.preset is required (tiny, base or paper)")
        self.model_config(vocab_size=self.model.get("vocab_size", self.data.vocab_size))  # validates model fields

    def model_config(self, vocab_size: int | None = None) -> MargeConfig:
        """The architecture; `vocab_size` (normally the tokenizer's) fills in an unset model.vocab_size."""
        overrides = {k: v for k, v in self.model.items() if k != "preset"}
        known = {f.name for f in fields(MargeConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {unknown}; model fields are {sorted(known)}")
        if vocab_size is not None:
            overrides.setdefault("vocab_size", vocab_size)
        try:
            return preset(self.model["preset"], **overrides)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def total_steps(self) -> int:
        return self.trainer.total_steps or self.run.max_steps

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


class _Checker:
    def positive(self, key: str, value: float) -> None:
        if not value > 0:
            raise ConfigError(f"{key} must be positive, got {value!r}")

    def nonneg(self, key: str, value: float) -> None:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value!r}")


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check a YAML value against a field's annotated type (ints accepted for floats)."""
    origin = getattr(typ, "__origin__", None)
    args = getattr(typ, "__args__", ())
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{key} may not be null")
    if origin is None and typ in (int, float, str, bool):
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typ is float and isinstance(value, str):
            try:  # PyYAML (YAML 1.1) reads 2e-3 as a string; accept what float() accepts
                return float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if typ is int and isinstance(value, bool) or not isinstance(value, typ):
            raise ConfigError(f"{key} must be a {typ.__name__}, got {value!r}")
        return value
    if args and type(None) in args:  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        return _coerce(key, value, inner)
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {values!r}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"section {prefix!r}" if prefix else "the top level"
        raise ConfigError(f"unknown key(s) {unknown} in {where}; known keys: {sorted(known)}")
    kwargs = {}
    defaults = {f.name: f for f in fields(cls)}
    for name, value in values.items():
        typ = hints[name]
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value or {}, key)
        else:
            kwargs[name] = _coerce(key, value, typ)
            factory = defaults[name].default_factory
            if isinstance(kwargs[name], dict) and factory is not dataclasses.MISSING:
                kwargs[name] = {**factory(), **kwargs[name]}  # e.g. model overrides keep the default preset
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for text in overrides:
        if "=" not in text:
            raise ConfigError(f"override {text!r} must look like section.key=value (e.g. run.max_steps=200)")
        key, raw = text.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} not found (the shipped configs are in deploy/configs/)")
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    try:
        return _build(PipelineConfig, tree, "")
    except ConfigError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None


def environment_endpoints(cfg: PipelineConfig) -> PipelineConfig:
    """Fill unset endpoints from MARGE_REDIS_URL / RAY_ADDRESS (how `ray job submit` passes them)."""
    redis_url = cfg.redis.url or os.environ.get("MARGE_REDIS_URL")
    ray_address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    return dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, url=redis_url),
                               ray=dataclasses.replace(cfg.ray, address=ray_address))
