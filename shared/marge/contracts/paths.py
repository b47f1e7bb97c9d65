"""Where one run's artifacts live: the only thing every stage of a run shares besides its own settings.

    <run>/init/model.safetensors    the seeded initial weights (step 0)
    <run>/snapshots/                relevance-encoder snapshots (`marge.model.snapshot`)
    <run>/index/                    committed index versions (`marge.contracts.index_store`)
    <run>/train_log.jsonl           one line per update (`services.trainer`)
    <run>/ray_train/<name>/         the DDP trainer's checkpoints (Ray Train's run folder)

Paths are absolute, so that Ray workers on other nodes (which do not share the driver's working
directory) find the same files on shared storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SNAPSHOTS = "snapshots"
INDEX = "index"
TRAIN_LOG = "train_log.jsonl"
"""Folder and file names inside a run folder: the only place they are spelled (readers that have a run folder but no
`RunPaths`, such as `marge report` and `marge serve`, join these)."""


@dataclass(frozen=True)
class RunPaths:
    name: str
    """The run's name: Ray Train resumes a run with the same name and folder; Redis keys carry it."""
    run_dir: Path
    corpus: Path
    """The prepared corpus (`marge prepare`)."""

    @classmethod
    def of(cls, name: str, run_dir: str | Path, corpus: str | Path) -> "RunPaths":
        return cls(name, Path(run_dir).resolve(), Path(corpus).resolve())

    @property
    def init_weights(self) -> Path:
        return self.run_dir / "init" / "model.safetensors"

    @property
    def snapshots(self) -> Path:
        return self.run_dir / SNAPSHOTS

    @property
    def index(self) -> Path:
        return self.run_dir / INDEX

    @property
    def train_log(self) -> Path:
        return self.run_dir / TRAIN_LOG

    @property
    def batch_counts(self) -> Path:
        """Each index version's shard batch counts, per builder (`services.batcher.core.BatchCounts`): what lets a
        resumed builder pass over whole shards."""
        return self.run_dir / "batch_counts"

    @property
    def ray_train(self) -> Path:
        return self.run_dir / "ray_train"

    @property
    def checkpoints(self) -> Path:
        """The DDP trainer's checkpoints, one `step-<update>` folder each (Ray Train's folder of this run)."""
        return self.ray_train / self.name
