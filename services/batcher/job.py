"""What one batch builder is given: its settings, the run's paths and slice of the run's spec, and which builder it
is (the batcher's `TrainerJob`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from marge.contracts.faults import FaultsConfig
from marge.contracts.paths import RunPaths
from marge.contracts.slots import QueueConfig, Slots, VersionPlan
from services.batcher.config import BatcherConfig, BatchShape


@dataclass(frozen=True)
class BatcherJob:
    batcher: BatcherConfig
    queue: QueueConfig
    paths: RunPaths
    seed: int
    redis_url_file: str
    """The file holding the queue's Redis URL (`services.driver.pipeline.stage_url_file`): a path, not the URL,
    because Ray keeps an actor's arguments where its dashboard serves them."""
    slots: Slots
    """The run's slot layout, compiled once by the driver (`services.driver.spec.RunSpec`)."""
    plan: VersionPlan
    """Which index version serves which update."""
    shape: BatchShape
    """What the run's objectives need built."""
    group: int
    """Which builder this is, of `slots.builders`: it writes the slots of its own group of ranks."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """Test-only fault injection (marge.contracts.faults)."""
