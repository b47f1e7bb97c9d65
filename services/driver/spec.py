"""A run's spec: its config compiled once, the facts every stage shares computed in one place, and each stage's
slice of it.

    config.yaml        what the user asked for (`PipelineConfig`, checked section by section and across sections
                       when it loads: `services.driver.config`)
      | compile_spec(cfg, vocab_size)       once per run, in the driver, after the corpus is known
      v
    RunSpec            slots, version plan, batch shape, model, execution, paths     -> run_dir/spec.json
      |- trainer_job(...)   TrainerJob   (services.trainer.job)   every DDP rank (the single process reads the spec)
      |- batcher_job(g)     BatcherJob   (services.batcher.job)   batch builder g
      |- indexer            the `indexer` section, paths, version plan, seed, faults

A stage never derives one of these facts from the config itself: the slot layout a rank numbers its batches by,
the version plan a builder waits on and the batch shape it builds are the ones the driver compiled
(tests/unit/test_boundaries.py fails if a stage or a run host builds or derives its own). `spec.json` is what the run trained with,
as plain values, for people and tools to read: `marge audit` and the reports read the config, the spec says what
it compiled to.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marge.contracts.paths import RunPaths
from marge.contracts.slots import Slots, VersionPlan
from marge.model.architecture import MargeConfig
from marge.model.veco import VecoConfig
from marge.util.files import atomic_write_text
from services.batcher.config import BatchShape
from services.batcher.job import BatcherJob
from services.driver.config import PipelineConfig
from services.trainer.job import TrainerJob

SPEC_FILE = "spec.json"
"""Where a run's compiled spec is written, in its run folder."""
SPEC_VERSION = 1
"""Bumped when a key of spec.json changes meaning."""


@dataclass(frozen=True)
class RunSpec:
    """A run's config with every fact two stages share computed once (`compile_spec`)."""

    config: PipelineConfig
    """The sections as loaded, with the run's endpoints, absolute paths and probe files filled in."""
    model: MargeConfig | VecoConfig
    """The architecture: `model.preset` plus overrides, of the objectives' model family."""
    slots: Slots
    """Where every batch of every update goes: world, gradient accumulation, batch builders."""
    version_plan: VersionPlan
    """Which index version serves which update."""
    batch_shape: BatchShape
    """What the batcher builds for the run's objectives."""
    paths: RunPaths

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: `model.vocab_size` when the config sets it, else the tokenizer's (the corpus's)."""
        return self.model.vocab_size

    @property
    def execution(self) -> dict[str, Any]:
        """How the trainers compute, not what (none of it changes a loss beyond rounding): the trainer's own
        settings (`TrainerConfig.EXECUTION`), named here so spec.json says them in one block."""
        return {name: getattr(self.config.trainer, name) for name in self.config.trainer.EXECUTION}

    def trainer_job(self, redis_url_file: Path | None, deadline_unix: float | None = None,
                    memory_batches: list[list] | None = None, resume_from: str | None = None) -> TrainerJob:
        """What every trainer rank gets: its sections, the run's paths and slots, and its batches' source (the file
        of the queue's Redis URL, or batches in memory)."""
        cfg = self.config
        return TrainerJob(cfg.trainer, cfg.objectives, cfg.health, cfg.queue, self.paths, cfg.run.seed,
                          cfg.run.max_steps, self.slots,
                          heldout_pairs=cfg.data.heldout_pairs, deadline_unix=deadline_unix,
                          redis_url_file=None if redis_url_file is None else str(redis_url_file),
                          memory_batches=memory_batches, resume_from=resume_from, faults=cfg.faults,
                          tensorboard=cfg.run.tensorboard)

    def batcher_job(self, redis_url_file: Path | str, group: int) -> BatcherJob:
        """What batch builder `group` gets."""
        cfg = self.config
        return BatcherJob(cfg.batcher, cfg.queue, self.paths, cfg.run.seed, str(redis_url_file), self.slots,
                          self.version_plan, self.batch_shape, group, cfg.faults)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: what spec.json holds (the config's secrets left out, as in the run's config.yaml)."""
        return {
            "spec_version": SPEC_VERSION,
            "objectives": list(self.config.objectives.enabled),
            "model_family": self.config.objectives.model_family,
            "model": dataclasses.asdict(self.model),
            "slots": dataclasses.asdict(self.slots) | {"per_step": self.slots.per_step},
            "version_plan": dataclasses.asdict(self.version_plan),
            "batch_shape": dataclasses.asdict(self.batch_shape),
            "execution": self.execution,
            "config": self.config.to_saved_dict(),
        }

    def write(self) -> Path:
        """run_dir/spec.json, written atomically (a reader sees the old file or the new one)."""
        path = self.paths.run_dir / SPEC_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")
        return path


def compile_spec(cfg: PipelineConfig, vocab_size: int | None = None) -> RunSpec:
    """`cfg` compiled: every fact two stages share, computed here and nowhere else. `vocab_size` is the tokenizer's
    (the corpus's); None when the corpus is not there yet (a dry run): `model.vocab_size`, else
    `data.vocab_size`, the tokenizer's size once it is trained."""
    model = cfg.model_config(vocab_size=vocab_size if vocab_size is not None else cfg.data.vocab_size)
    return RunSpec(cfg, model, cfg.slots(), cfg.version_plan(), cfg.batch_shape(), cfg.paths())


def read_spec(run_dir: str | Path) -> dict[str, Any] | None:
    """A run folder's spec.json as written (None when the run was started by a version that did not write one)."""
    path = Path(run_dir) / SPEC_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))
