"""What one trainer worker is given: its settings, the run's paths and where its batches come from."""

from __future__ import annotations

from dataclasses import dataclass, field

from marge.contracts.faults import FaultsConfig
from marge.contracts.paths import RunPaths
from marge.contracts.slots import QueueConfig, Slots
from services.trainer.config import HealthConfig, TrainerConfig
from services.trainer.objectives import ObjectivesConfig


@dataclass(frozen=True)
class TrainerJob:
    trainer: TrainerConfig
    objectives: ObjectivesConfig
    health: HealthConfig
    queue: QueueConfig
    paths: RunPaths
    seed: int
    max_steps: int
    slots: Slots
    """The run's slot layout (`PipelineConfig.slots`: world, gradient accumulation, batch builders), built once by
    the driver: every rank numbers its batches, and resets the builders' cursors, by this one."""
    heldout_pairs: str | None = None
    """Held-out pairs for the per-snapshot P@1 (health.pairs overrides it)."""
    deadline_unix: float | None = None
    """Stop at the first step boundary after this time (run.max_minutes)."""
    redis_url_file: str | None = None
    """The file holding the queue's Redis URL (`services.driver.pipeline.stage_url_file`); None with
    `memory_batches`. A path, not the URL: Ray Train keeps this job in the run state its dashboard serves."""
    memory_batches: list[list] | None = field(default=None, compare=False)
    """One list of batches per rank instead of the queue: the benchmark's and parity tests' in-process feed."""
    resume_from: str | None = None
    """The checkpoint the driver chose to resume from, used when Ray Train's newest one is missing or corrupt."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """Test-only fault injection (marge.contracts.faults)."""
    tensorboard: bool = False
    """Rank 0 writes every update's figures to TensorBoard (run.dir/tb/trainer)."""
