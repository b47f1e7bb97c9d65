"""`train_log.jsonl`: one line per optimizer update, the run's record of what it trained.

The training loop (`services.trainer.loop`) writes it, on DDP rank 0 and in the single process alike, and every
figure over a whole run is read back from it: `marge report`, `marge audit` (which slot trained which batch), the
pipeline's summary, the experiments, TensorBoard. Redis keeps only the newest records, for progress lines.

A line is an `UpdateRecord` as JSON. Its `schema` field says which layout wrote it; a reader refuses a newer one it
does not know (saying so), and reads every older one (lines written before the field existed are schema 1). A
crash can tear the last line of the file in half: readers skip a torn *last* line; any other line that does not
parse is an error naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from marge.paths import TRAIN_LOG
from marge.utils import atomic_write_text

__all__ = ["TRAIN_LOG", "SCHEMA_VERSION", "TrainLog", "TrainLogError", "UpdateRecord", "read_train_log"]
SCHEMA_VERSION = 1
"""The layout `UpdateRecord.to_dict` writes. A new optional field keeps the version; removing or renaming a field, or
changing what one means, raises it (and `from_dict` keeps reading the old one)."""


class TrainLogError(ValueError):
    pass


@dataclass
class UpdateRecord:
    """One optimizer update across every rank of the run."""

    step: int
    """Updates done, this one included (the first update is step 1)."""
    loss: float
    """Mean loss of the run's primary objective over the update's trained batches (NaN for a skipped update)."""
    lr: float
    """The learning rate the update used."""
    grad_norm: float
    """Total gradient norm before clipping; not finite for an update that was skipped."""
    batch_ids: list[str | None]
    """Batch id of each slot (`slots`, same order); None for a delivery that could not be decoded."""
    slots: list[int] = field(default_factory=list)
    """The update's slots (marge.protocol.Slots), every rank's, sorted."""
    dead_lettered: list[int] = field(default_factory=list)
    """Slots of the update that were not trained (kept in the dead-letter stream with the reason)."""
    objectives: dict[str, float] = field(default_factory=dict)
    """Each objective's mean loss over the trained batches."""
    beta: list[float] = field(default_factory=list)
    """The relevance bias weight beta per decoder layer (empty for a model without one: VECO)."""
    index_versions: list[int] = field(default_factory=list)
    """Index versions the update's batches came from (none for objectives without an index)."""
    snapshot_steps: list[int] = field(default_factory=list)
    """Snapshot updates whose g built those index versions."""
    staleness_max: int = 0
    """Largest (step - 1 - snapshot step) over the update's batches: how old the retrieval that made them is."""
    step_seconds: float = 0.0
    """Wall-clock seconds of the update itself (forward, backward, read, optimizer step)."""
    tokens: int = 0
    """Evidence + target tokens of the trained batches, every rank."""
    target_tokens: int = 0
    """Target tokens of the trained batches, every rank."""
    tokens_per_s: float = 0.0
    """Running `tokens` per second since the first update's batches were in hand."""
    target_tokens_per_s: float = 0.0
    wait_share: float = 0.0
    """Share of that time spent waiting for batches."""
    elapsed_s: float = 0.0
    startup_wait_s: float = 0.0
    """Seconds waited for the first update's batches (the first index build): not counted in `wait_share`."""
    time: float = 0.0
    """Unix time the record was made."""
    mfu: float | None = None
    """Model FLOPs utilisation of the writer's device over the updates' own time (known GPUs only)."""
    health: dict | None = None
    """Retrieval and evidence probes measured at this update (every `trainer.snapshot_every`; MARGE models)."""
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for optional in ("mfu", "health"):
            if out[optional] is None:
                del out[optional]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, values: dict, where: str = "train log") -> "UpdateRecord":
        if not isinstance(values, dict):
            raise TrainLogError(f"{where}: expected a JSON object, got {type(values).__name__}")
        schema = values.get("schema", 1)
        if not isinstance(schema, int) or schema > SCHEMA_VERSION:
            raise TrainLogError(f"{where}: train-log schema {schema!r} is newer than this marge reads "
                                f"(up to {SCHEMA_VERSION}): upgrade marge to read this run")
        missing = [name for name in REQUIRED if name not in values]
        if missing:
            raise TrainLogError(f"{where}: an update record needs {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})  # fields a newer minor layout added: ignored

    def trained_slots(self) -> dict[int, str | None]:
        """slot -> batch id of the batches this update trained."""
        dead = set(self.dead_lettered)
        return {n: b for n, b in zip(self.slots, self.batch_ids) if n not in dead}

    @property
    def skipped(self) -> bool:
        """Every rank skipped the optimizer step (its gradient was not finite): no batch of it counts."""
        return not math.isfinite(self.grad_norm)


REQUIRED = ("step", "loss", "lr", "grad_norm", "batch_ids")


class TrainLog:
    """A run's train log: append one record per update, read them back, drop the ones a checkpoint does not hold."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def of_run(cls, run_dir: Path) -> "TrainLog":
        return cls(Path(run_dir) / TRAIN_LOG)

    def append(self, record: UpdateRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(record.to_json() + "\n")

    def _lines(self) -> list[str]:
        if not self.path.exists():
            return []
        return [line for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def read(self, through_step: int | None = None) -> list[UpdateRecord]:
        """Every record (up to `through_step`), in file order; a torn last line is skipped."""
        lines = self._lines()
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                values = json.loads(line)
            except ValueError as e:
                if number == len(lines):  # a crash mid-write: the resumed run writes that update again
                    break
                raise TrainLogError(f"{self.path}:{number}: not JSON ({e})") from None
            record = UpdateRecord.from_dict(values, f"{self.path}:{number}")
            if through_step is None or record.step <= through_step:
                records.append(record)
        return records

    def truncate_after(self, step: int) -> None:
        """Drop the lines of updates after `step` (a crash left them; the resumed run writes them again), and a torn
        last line. Atomic: a crash here leaves the old file or the new one."""
        lines = self._lines()
        kept = []
        for line in lines:
            try:
                if int(json.loads(line)["step"]) <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        if len(kept) != len(lines):
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))


def read_train_log(run_dir: Path, through_step: int | None = None) -> list[UpdateRecord]:
    """The records of the run in `run_dir` (none when it has not trained yet)."""
    return TrainLog.of_run(run_dir).read(through_step)
