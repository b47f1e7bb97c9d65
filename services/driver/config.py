"""A run's configuration: one section per stage, each the stage's own dataclass, loaded from
`deploy/configs/<name>.yaml` plus `section.key=value` overrides and validated in full when loaded (unknown
keys, wrong types and bad values name the key, the value and what is allowed) -- before Ray or Redis start.

    run        RunConfig            (here)         name, folder, seed, budget
    data       DataConfig           (here)         raw input, prepared corpus, held-out pairs
    model      preset + MargeConfig fields         `marge.model.network`
    indexer    IndexerConfig        services.indexer.config
    batcher    BatcherConfig        services.batcher.config
    queue      QueueConfig          marge.contracts.protocol
    trainer    TrainerConfig        services.trainer.config
    objectives ObjectivesConfig     services.trainer.objectives
    health     HealthConfig         services.trainer.config
    redis      RedisConfig          (here)
    ray        RayConfig            (here)
    faults     FaultsConfig         marge.contracts.faults    test-only fault injection

Numbers live in the YAML files; `tiny.yaml` runs on a laptop, `paper.yaml` is the paper's setting.
Deployment endpoints (Redis URL, Ray address) may also come from the environment (MARGE_REDIS_URL,
RAY_ADDRESS) so one config file serves every cluster.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints, overload

from marge.contracts.batch import encoder_cost, max_text_tokens
from marge.contracts.config import (
    ConfigError,
    FieldError,
    at_least,
    build,
    load_tree,
    may_change_on_resume,
    one_of,
    positive,
    resumable,
    resumable_keys,
    section_type,
    within,
)
from marge.contracts.faults import FaultsConfig
from marge.contracts.paths import RunPaths
from marge.contracts.slots import QueueConfig, Slots, VersionPlan
from marge.contracts.tokenizer import DEFAULT_VOCAB_SIZE
from marge.model.architecture import EXECUTION_FIELDS, MargeConfig, preset
from marge.model.veco import VecoConfig, veco_preset
from services.batcher.config import BatcherConfig, BatchShape
from services.indexer.config import IndexerConfig
from services.trainer.config import HealthConfig, TrainerConfig
from services.trainer.objectives import ObjectivesConfig

log = logging.getLogger("marge.config")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "marge"
    """Run name: Ray Train resumes a run with the same name and folder; Redis keys and actor names carry it."""
    dir: str = "runs/marge"
    """Where snapshots, indexes, checkpoints and logs go (shared storage on a multi-node cluster)."""
    seed: int = 0
    """Seeds the initial weights, the shard order of batches, every batch's preparation and the probes: the same
    seed, data and config give the same run."""
    max_steps: int = resumable(100, comparable=True)
    """Optimizer updates to train for (the paper: 1M)."""
    max_minutes: float = resumable(0.0)
    """Stop training after this many minutes (0: no limit)."""
    progress_every_s: float = resumable(10.0, comparable=True)
    """Seconds between the driver's progress lines (one per stage)."""
    tensorboard: bool = resumable(True)
    """TensorBoard event files under run.dir/tb (`tensorboard --logdir RUN_DIR/tb`): every update's figures by
    trainer rank 0, every index version's by the driver."""

    def __post_init__(self) -> None:
        positive(self, "max_steps", "progress_every_s")
        at_least(self, "max_minutes", 0)
        if not self.name or any(c in self.name for c in " /:"):
            raise FieldError("name", self.name, "a non-empty name without spaces, '/' or ':'")
        if "://" in self.dir:
            raise FieldError("dir", self.dir,
                             "a path on a POSIX filesystem every node mounts, not an object-store URI: the run's "
                             "checkpoints are listed, hard-linked and renamed into place, and index versions, "
                             "snapshots and the train log are files read by other nodes; mount the bucket or a "
                             "shared filesystem (FSx for Lustre, EFS, Filestore, NFS) on every node and give its "
                             "mount path")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    raw: list[str] = resumable(default_factory=list)
    """Raw input for `marge prepare`, used when `corpus` does not exist yet (a missing corpus with no input named here
    is an error, never the demo corpus prepared in its place)."""
    corpus: str = "data/prepared/demo"
    """The prepared corpus folder (`marge prepare`); prepared from `raw` with the settings below when missing."""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    """SentencePiece vocabulary of a corpus prepared here (the paper: 250k); the model's vocab_size follows it."""
    max_chunk_tokens: int = 512
    """Longest document chunk in tokens, BOS and EOS included (paper: 512)."""
    document_unit: str = "chunk"
    """'chunk': paragraphs packed into documents of up to max_chunk_tokens (paper §3). Deviation 'paragraph':
    every paragraph a document, cut at max_chunk_tokens; shards still hold a page in every language."""
    min_document_tokens: int = 1
    """Documents with fewer text tokens are dropped when the corpus is prepared."""
    languages: list[str] | None = None
    """Keep only these languages of `raw` (null: all of them)."""
    docs_per_shard: int = 512
    """Documents per shard of a corpus prepared here (whole groups: a page in every language stays in one shard)."""
    heldout_permille: int = 0
    """Groups per 1000 a corpus prepared here holds out of training for the run's probes (`marge prepare
    --heldout-permille`); the probes then use them unless health.documents / data.heldout_pairs say otherwise."""
    num_shards: int | None = None
    """Exact number of shards of a corpus prepared here (null: from docs_per_shard)."""
    heldout_pairs: str | None = resumable(None)
    """Held-out translation pairs (TSV) for retrieval P@1 in the probes, the reports and g's health at the end (null:
    the corpus's own held-out pairs when it has them, else no P@1)."""
    prepare_engine: str = resumable("auto")
    """How a missing corpus is prepared from `raw` (`marge prepare --engine`): 'ray' streams it through Ray Data on the
    run's Ray cluster (`ray.address`, else a local Ray for the preparation), with memory bounded by the partition, not
    the corpus; 'local' in the driver's process, the corpus in memory; 'auto': 'local' up to 256 MiB of input."""
    prepare_workers: int | None = resumable(None)
    """Ray Data tasks per stage of a preparation on Ray (null: the cluster's CPUs)."""
    tokenizer_sample_lines: int = 2_000_000
    """Lines the tokenizer of a corpus prepared here is trained on, at most: an equal share per language, drawn at
    random (seeded), so a corpus sorted by language still gets a balanced vocabulary."""

    def __post_init__(self) -> None:
        positive(self, "vocab_size", "docs_per_shard", "min_document_tokens", "tokenizer_sample_lines")
        one_of(self, "prepare_engine", ("auto", "local", "ray"))
        if self.prepare_workers is not None:
            positive(self, "prepare_workers")
        within(self, "heldout_permille", 0, 999)
        at_least(self, "max_chunk_tokens", 3)
        one_of(self, "document_unit", ("chunk", "paragraph"))
        if self.languages is not None:
            from marge.contracts.languages import normalize_language

            if not self.languages:
                raise FieldError("languages", self.languages, "a non-empty list of ISO 639-1 codes, or null for all")
            for lang in self.languages:
                try:
                    normalize_language(lang)
                except ValueError:
                    raise FieldError("languages", self.languages, "ISO 639-1 codes (en, de, ...)") from None
        if self.num_shards is not None:
            positive(self, "num_shards")


@dataclass(frozen=True, kw_only=True)
class RedisConfig:
    url: str | None = None
    """redis://... of an existing server; None starts a private redis-server (loopback, random password)."""
    appendfsync: str = "always"
    """The private redis-server's AOF fsync policy. 'always' (fsync before each reply): nothing acknowledged is lost
    to a killed server or a machine crash, so a trainer generation is never issued twice and no commit or dead
    letter is lost, at a cost in the offers one Redis takes a second (docs/benchmarks.md, "The queue's fsync").
    'everysec': a machine crash, or a
    killed server while a slow disk holds back its writes, can lose about the last 2 seconds of writes (docs/cluster.md
    says what that can cost). 'no': the operating system decides."""
    maxmemory: str = "1gb"
    """The private redis-server's memory limit (noeviction: a full queue refuses writes, it never drops batches)."""

    def __post_init__(self) -> None:
        one_of(self, "appendfsync", ("always", "everysec", "no"))


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = None
    """An existing cluster ('auto', 'ray://...'); None starts a local one (or joins RAY_ADDRESS when set)."""
    num_cpus: int | None = None
    """Logical CPUs of a local Ray (null: the machine's, at least what the run needs)."""
    include_dashboard: bool = False
    """Start the Ray dashboard with a local Ray (on 127.0.0.1)."""
    object_store_memory: int = 256 * 1024 * 1024
    """Bytes of a local Ray's object store (batches travel through Redis, not Ray objects: a small store is enough)."""

    def __post_init__(self) -> None:
        positive(self, "object_store_memory")
        if self.num_cpus is not None:
            positive(self, "num_cpus")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    """`preset` plus any MargeConfig field to override; vocab_size defaults to the tokenizer's."""
    indexer: IndexerConfig = field(default_factory=IndexerConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    # QueueConfig (marge.contracts.protocol) does not mark its own fields: how long a wait lasts may change, not the depth
    queue: QueueConfig = resumable(default_factory=QueueConfig, keys=("block_ms", "stall_s"))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    objectives: ObjectivesConfig = field(default_factory=ObjectivesConfig)
    health: HealthConfig = resumable(default_factory=HealthConfig)
    redis: RedisConfig = resumable(default_factory=RedisConfig)
    ray: RayConfig = resumable(default_factory=RayConfig)
    faults: FaultsConfig = resumable(default_factory=FaultsConfig)
    """Test-only fault injection (marge.contracts.faults); null in every shipped config."""

    def __post_init__(self) -> None:
        """What involves two sections (each section checked its own fields when it was built)."""
        longest = max_text_tokens(self.data.max_chunk_tokens)
        shape = self.batch_shape()
        one_pair = (shape.target_cost(longest) + encoder_cost(longest) if shape.kind == "retrieval"
                    else shape.document_cost(longest))
        if self.batcher.max_tokens < one_pair:
            raise ConfigError(f"batcher.max_tokens must fit one target and one evidence document of "
                              f"data.max_chunk_tokens ({self.data.max_chunk_tokens}) with the objectives' work on them "
                              f"({', '.join(self.objectives.enabled)}): at least {one_pair}, got {self.batcher.max_tokens}")
        if self.batcher.builders > self.trainer.num_workers:
            raise ConfigError(f"batcher.builders must be at most trainer.num_workers ({self.trainer.num_workers}): "
                              f"each builder writes the slots of its own group of ranks; got {self.batcher.builders}")
        if self.objectives.needs_index and 0 < self.indexer.shards_per_version < self.batcher.builders:
            raise ConfigError(f"indexer.shards_per_version must be at least batcher.builders ({self.batcher.builders}): "
                              f"each builder makes its batches from shards of its own; got {self.indexer.shards_per_version}")
        if self.objectives.needs_index:
            self.check_index_schedule()
        if "preset" not in self.model:
            raise ConfigError("model.preset is required: one of ['base', 'paper', 'tiny']")
        model = self.model_config(vocab_size=self.model.get("vocab_size", self.data.vocab_size))  # validates its fields
        if self.trainer.cross_attention == "packed" and model.attention_dropout:
            raise ConfigError(f"trainer.cross_attention=packed has no attention dropout, but model.attention_dropout "
                              f"is {model.attention_dropout}: set it to 0, or trainer.cross_attention to gathered")
        if self.trainer.cross_attention == "packed" and not self.trainer.use_gpu:
            raise ConfigError("trainer.cross_attention=packed trains only on a GPU (FlexAttention has no CPU "
                              "backward): set trainer.use_gpu=true, or trainer.cross_attention to gathered")
        if self.trainer.key_bias == "flex" and model.attention_dropout:
            raise ConfigError(f"trainer.key_bias=flex has no attention dropout, but model.attention_dropout is "
                              f"{model.attention_dropout}: set it to 0, or trainer.key_bias to mask or folded")

    def check_index_schedule(self) -> None:
        """The indexer's settings against the trainer's (only for objectives that need an index)."""
        if self.indexer.reindex_every % self.trainer.snapshot_every:
            raise ConfigError(f"indexer.reindex_every must be a multiple of trainer.snapshot_every "
                              f"({self.trainer.snapshot_every}), got {self.indexer.reindex_every}: the indexer can "
                              "only use published snapshots")
        plan = self.version_plan()
        needed = math.ceil(plan.lag / plan.reindex_every) + 1
        if self.indexer.keep_versions < needed:
            raise ConfigError(f"indexer.keep_versions must be at least {needed} with batcher.index_lag {plan.lag} and "
                              f"indexer.reindex_every {plan.reindex_every}: a resumed run must find the version its "
                              f"next batches come from; got {self.indexer.keep_versions}")

    def model_config(self, vocab_size: int | None = None) -> MargeConfig | VecoConfig:
        """The architecture of the objectives' model family (`objectives.model_family`: a MargeConfig, or a
        VecoConfig for veco) from `model.preset` plus field overrides; `vocab_size` (normally the tokenizer's)
        fills in an unset model.vocab_size."""
        family = self.objectives.model_family
        config_type, build_preset = (VecoConfig, veco_preset) if family == "veco" else (MargeConfig, preset)
        overrides = {k: v for k, v in self.model.items() if k != "preset"}
        moved = sorted(set(overrides) & set(EXECUTION_FIELDS))
        if moved:
            raise ConfigError(f"model.{moved[0]} is an execution setting, not architecture: set "
                              f"{EXECUTION_FIELDS[moved[0]]} instead")
        known = {f.name for f in dataclasses.fields(config_type)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {unknown} for the {family} model; its fields are {sorted(known)}")
        if vocab_size is not None:
            overrides.setdefault("vocab_size", vocab_size)
        try:
            return build_preset(self.model["preset"], **overrides)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None

    def paths(self) -> RunPaths:
        return RunPaths.of(self.run.name, self.run.dir, self.data.corpus)

    def cpus_needed(self) -> float:
        """Logical CPUs the run's actors ask Ray for: the trainers, and the indexer workers when there is an index
        (the batcher and the indexer's coordinator ask for none)."""
        indexer = self.indexer.num_workers * self.indexer.num_cpus_per_worker if self.objectives.needs_index else 0.0
        return self.trainer.num_workers * self.trainer.num_cpus_per_worker + indexer

    def gpus_needed(self) -> float:
        """GPUs the run's actors ask Ray for: one per trainer with `trainer.use_gpu`, and the indexer workers'
        `indexer.num_gpus_per_worker` with `indexer.use_gpu` (when there is an index)."""
        trainer = self.trainer.num_workers if self.trainer.use_gpu else 0.0
        indexer = (self.indexer.num_workers * self.indexer.num_gpus_per_worker
                   if self.indexer.use_gpu and self.objectives.needs_index else 0.0)
        return trainer + indexer

    def check_fits(self, cluster_cpus: float, cluster_gpus: float | None = None) -> None:
        """Refuse up front a run the cluster cannot hold, instead of Ray Train timing out while its workers wait
        for CPUs or GPUs (WorkerGroupStartupTimeoutError, or a silent wait). `cluster_gpus` None: not checked."""
        gpus = self.gpus_needed()
        if cluster_gpus is not None and cluster_gpus + 1e-9 < gpus:
            parts = [f"trainer {self.trainer.num_workers} x 1" if self.trainer.use_gpu else "",
                     f"indexer {self.indexer.num_workers} x {self.indexer.num_gpus_per_worker:g}"
                     if self.indexer.use_gpu and self.objectives.needs_index and self.indexer.num_gpus_per_worker else ""]
            raise ConfigError(f"the run needs {gpus:g} GPUs ({' + '.join(p for p in parts if p)}) but the Ray cluster "
                              f"has {cluster_gpus:g}: start Ray on GPU nodes (`ray start --num-gpus N`), or set "
                              "trainer.use_gpu=false and indexer.use_gpu=false to train on CPUs")
        needed = self.cpus_needed()
        if cluster_cpus + 1e-9 < needed:
            indexer = (f" + indexer {self.indexer.num_workers} x {self.indexer.num_cpus_per_worker:g}"
                       if self.objectives.needs_index else "")
            raise ConfigError(f"the run needs {needed:g} logical CPUs (trainer {self.trainer.num_workers} x "
                              f"{self.trainer.num_cpus_per_worker:g}{indexer}) but the Ray cluster has {cluster_cpus:g}: "
                              "add nodes or start Ray with more --num-cpus, or lower trainer.num_workers, "
                              "trainer.num_cpus_per_worker, indexer.num_workers or indexer.num_cpus_per_worker")

    def slots(self) -> Slots:
        return Slots(self.trainer.num_workers, self.trainer.grad_accum, self.batcher.builders)

    def version_plan(self) -> VersionPlan:
        """Which index version serves which update; without an index (`objectives.needs_index` False) one
        "version" of corpus batches serves the whole run."""
        if not self.objectives.needs_index:
            return VersionPlan.without_index()
        lag = self.batcher.index_lag if self.batcher.index_lag is not None else self.indexer.reindex_every
        return VersionPlan(self.indexer.reindex_every, lag)

    def batch_shape(self) -> BatchShape:
        """What the batcher builds for the run's objectives."""
        return BatchShape(self.objectives.batches, self.objectives.extra_target_passes,
                          self.objectives.batch_negatives if self.objectives.batches == "retrieval" else 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON values (tuples as lists): what `load_config` reads back to an equal config."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_saved_dict(self) -> dict[str, Any]:
        """`to_dict` without secrets, for files other people read (the run's config.yaml, reports): the
        password of `redis.url` is replaced by ***."""
        out = self.to_dict()
        if out["redis"]["url"]:
            out["redis"]["url"] = redact_url(out["redis"]["url"])
        return out


RESUMABLE = resumable_keys(PipelineConfig)
"""What a resumed run may change (keys, or sections ending in '.'): how long it runs, how it reports, where it runs
and on what, never what it trains (the data, the model, the objectives, the schedule, the batches). Each section's
dataclass marks its own fields (`marge.contracts.config.resumable`); this is what the marks add up to."""


def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "model":
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_drift(saved: dict, new: dict) -> list[str]:
    """The settings a resumed run would change that `RESUMABLE` does not allow: 'key: saved -> new' lines. A key the
    saved config lacks (a setting added since the run was started) counts as its default, which the run trained with."""
    before, after = flat(saved), flat(new)
    changed = []
    for key in sorted(set(before) | set(after)):
        was = before[key] if key in before else default_setting(key)
        if was != after.get(key) and not may_change_on_resume(key, RESUMABLE):
            changed.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return changed


MISSING = object()


def default_setting(key: str) -> Any:
    """The default of dotted config key `key` as `to_dict` writes it (JSON values), or MISSING when it has none: a
    required key, a key of no section, or one inside a mapping (`model`, `objectives.registered`), which no schema
    here describes, so that a key added there counts as a change."""
    cls: Any = PipelineConfig
    parts = key.split(".")
    for depth, name in enumerate(parts):
        fields_by_name = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if name not in fields_by_name:
            return MISSING
        f = fields_by_name[name]
        if depth < len(parts) - 1:
            cls = section_type(get_type_hints(cls)[name])
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            return MISSING
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        return json.loads(json.dumps(value))
    return MISSING


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """The run's config from `path` plus `section.key=value` overrides, checked in full. An error names where the bad
    value came from: the override that set it, or the file."""
    try:
        return build(PipelineConfig, load_tree(path, overrides or []))
    except ConfigError as e:
        text = str(e)
        named = text.split(" ", 1)[0].rstrip(":,")  # the dotted key an error starts with
        culprits = [o for o in overrides or [] if text.startswith(o.split("=", 1)[0].strip() + " ")
                    or text.startswith(o.split("=", 1)[0].strip() + ".")
                    or (o.split("=", 1)[0].strip() + ".").startswith(named + ".")]
        where = f"command-line override {culprits[-1]!r}" if culprits else str(path or "config")
        raise ConfigError(f"{where}: {e}") from None


PROBE_KEYS = ("health.documents", "data.heldout_pairs", "health.pairs")
"""Config keys naming probe files of one corpus."""


def probe_files(cfg: PipelineConfig) -> dict[str, str]:
    """The probe files `cfg` names, by key (`PROBE_KEYS`; unset ones left out)."""
    values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in PROBE_KEYS}
    return {key: value for key, value in values.items() if value is not None}


def for_command_line_corpus(cfg: PipelineConfig, path: str | Path | None, overrides: list[str]) -> PipelineConfig:
    """`cfg` for a `data.corpus` given on the command line that is not the config file's own: what the file says
    about its corpus (the raw inputs it is prepared from, its probe files) is not about this one. A corpus that is
    not prepared yet needs its inputs on the command line too (a misspelt path would otherwise be prepared from the
    file's data); probe files the command line does not name are dropped, so the probes use the corpus's own
    held-out split (`marge prepare --heldout-permille`) or are off, never another corpus's files."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    if "data.corpus" not in given or path is None:
        return cfg
    own = load_config(path).data
    if Path(cfg.data.corpus).resolve() == Path(own.corpus).resolve():
        return cfg
    raw = cfg.data.raw if "data.raw" in given else []
    if not (Path(cfg.data.corpus) / "manifest.json").exists() and not raw:
        raise ConfigError(f"command-line override 'data.corpus={cfg.data.corpus}': no prepared corpus is there "
                          f"({Path(cfg.data.corpus) / 'manifest.json'} is missing), and the data.raw of {path} is "
                          f"the input of its own corpus ({own.corpus}), not yours. Check the path; prepare yours "
                          f"first (`marge prepare INPUT --out {cfg.data.corpus}`), or name its input on the command "
                          "line as well: data.raw=[INPUT]")
    dropped = {key: value for key, value in probe_files(cfg).items() if key not in given}
    if dropped:
        log.info("data.corpus is given on the command line: the probe files %s of %s belong to its own corpus and "
                 "are not used (the corpus's held-out split is, if it has one; name them on the command line to "
                 "choose)", dropped, path)
    unset: dict[str, dict[str, Any]] = {section: {key.split(".")[1]: None for key in dropped
                                                  if key.startswith(section + ".")} for section in ("data", "health")}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, raw=raw, **unset["data"]),
                               health=dataclasses.replace(cfg.health, **unset["health"]))


def redact_url(url: str) -> str:
    """`url` with its password (redis://user:PASSWORD@host) replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_url_from_environment() -> str | None:
    """The Redis URL the environment gives: MARGE_REDIS_URL, or the first line of the file MARGE_REDIS_URL_FILE
    names (a Kubernetes Secret or a 0600 file mounted on every node: the password then appears in no job's
    runtime_env, no process's arguments and no environment a job API lists)."""
    if os.environ.get("MARGE_REDIS_URL"):
        return os.environ["MARGE_REDIS_URL"]
    path = os.environ.get("MARGE_REDIS_URL_FILE")
    if not path:
        return None
    return read_redis_url_file(Path(path), f"MARGE_REDIS_URL_FILE={path}",
                               "mount the secret file on every node at that path")


def read_redis_url_file(path: Path, what: str, fix: str = "") -> str:
    """The Redis URL on the first line of `path` (a secret file: never the URL itself on a command line). `what`
    names the setting that gave the path, in the error."""
    from marge.contracts.protocol import first_line_url

    try:
        return first_line_url(Path(path))
    except OSError as e:
        raise ConfigError(f"{what}: cannot read a Redis URL from it ({e})" + (f": {fix}" if fix else "")) from None
    except ValueError:
        raise ConfigError(f"{what}: its first line is not a redis://, rediss:// or unix:// URL") from None


def environment_endpoints(cfg: PipelineConfig) -> PipelineConfig:
    """Fill unset endpoints from MARGE_REDIS_URL (or MARGE_REDIS_URL_FILE) / RAY_ADDRESS (how `ray job submit`
    passes them)."""
    redis_url = cfg.redis.url or redis_url_from_environment()
    ray_address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    return dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, url=redis_url),
                               ray=dataclasses.replace(cfg.ray, address=ray_address))


def with_absolute_paths(cfg: PipelineConfig) -> PipelineConfig:
    """Ray workers do not share the driver's working directory: give them absolute paths."""
    @overload
    def absolute(path: str) -> str: ...

    @overload
    def absolute(path: str | None) -> str | None: ...

    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(path).resolve())

    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=absolute(cfg.run.dir)),
        data=dataclasses.replace(cfg.data, corpus=absolute(cfg.data.corpus), raw=[absolute(p) for p in cfg.data.raw],
                                 heldout_pairs=absolute(cfg.data.heldout_pairs)),
        health=dataclasses.replace(cfg.health, documents=absolute(cfg.health.documents), pairs=absolute(cfg.health.pairs)))
