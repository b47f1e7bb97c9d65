"""`train_log.jsonl`: one line per optimizer update, the run's record of what it trained.

The training loop (`services.trainer.loop`) writes it, on DDP rank 0 and in the single process alike, and every
figure over a whole run is read back from it: `marge report`, `marge audit` (which slot trained which batch), the
pipeline's summary, the experiments, TensorBoard. Redis keeps only the newest records, for progress lines.

A line is an `UpdateRecord` as JSON. Its `schema` field says which layout wrote it; a reader refuses a newer one it
does not know (saying so), and reads every older one (lines written before the field existed are schema 1). A
crash can tear the last line of the file in half: readers skip a torn *last* line of the live file; any other line
that does not parse is an error naming the file and the line.

A long run's log is segmented, so that nothing that reads or trims it needs memory or time that grows with the run
(a line is at most about 3.2 KB, 1 KB at 512 x 8 with its ids in runs: under 1.5 GB over 450k updates):

    train_log.jsonl                                  the live file: the newest updates, fewer than `segment_updates`
    train_log.segments/steps-00000001-00010000.jsonl the older ones, `segment_updates` a file, named by the first and
    train_log.segments/steps-00010001-00020000.jsonl last update they hold, never written again once rolled

When the live file holds `segment_updates` records the writer renames it into the segments folder (atomically) and
starts a new one, so a run shorter than that has only `train_log.jsonl`, as before segments existed, and every
reader of one file still reads it. Readers go through the segments in update order, then the live file, one file
at a time (`TrainLog.iter_records`). A resumed run drops the updates its checkpoint does not hold
(`TrainLog.truncate_after`), touching only the files that hold later updates: usually the live file alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, overload

from marge.contracts.paths import TRAIN_LOG
from marge.contracts.slots import BatchId, trained_digest
from marge.util.files import atomic_write_text, fsync_dir

__all__ = ["TRAIN_LOG", "SCHEMA_VERSION", "SEGMENT_UPDATES", "RunFigures", "Segment", "TrainLog", "TrainLogError",
           "UpdateRecord", "feed", "read_train_log"]
SCHEMA_VERSION = 2
"""The layout `UpdateRecord.to_dict` writes. A new optional field keeps the version; removing or renaming a field, or
changing what one means, raises it (and `from_dict` keeps reading the old one). Version 2: every line carries the
update's `trained_digest`; a line of more than FULL_IDS_MAX_BATCHES batches holds them as runs (`compact_ids`)."""
FULL_IDS_MAX_BATCHES = 64
"""Up to this many batches an update (8 ranks x 8), a line lists every slot and batch id in full (about 3.2 KB);
above it, the batches are runs of consecutive positions (`compact_ids`), so a line stays about 1 KB whatever the
world: 200 KB at 512 x 8 in full. A compact line leaves the ids' content digests out; its `trained_digest` covers
them."""


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
    """The update's slots (marge.contracts.slots.Slots), every rank's, sorted."""
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
    trained_digest: str = field(default="", compare=False)
    """`marge.contracts.slots.trained_digest` of the update's trained (slot, batch id), content digests included:
    the audit adds the lines of a checkpoint interval up and compares them with the ranks' commits. Computed when
    the line is written (empty: not yet, or a schema 1 line); derived, so not compared."""
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for optional in ("mfu", "health"):
            if out[optional] is None:
                del out[optional]
        if self.schema >= 2:
            out["trained_digest"] = self.trained_digest or trained_digest(self.trained_slots().items())
            runs = compact_ids(self.slots, self.batch_ids) if len(self.batch_ids) > FULL_IDS_MAX_BATCHES else None
            if runs is not None:
                del out["slots"], out["batch_ids"]
                out["first_slot"], out["slot_count"], out["batches"] = self.slots[0], len(self.slots), runs
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
        values = {**values, "schema": schema}  # a line written before the field existed is schema 1
        if "batches" in values and "batch_ids" not in values:  # a compact line (schema 2)
            try:
                values = {**values, "slots": list(range(values["first_slot"], values["first_slot"]
                                                        + values["slot_count"])),
                          "batch_ids": expand_ids(values["batches"])}
            except (KeyError, TypeError, ValueError) as e:
                raise TrainLogError(f"{where}: a compact update record's batches cannot be read ({e!r})") from None
            if len(values["batch_ids"]) != len(values["slots"]):
                raise TrainLogError(f"{where}: a compact update record names {len(values['batch_ids'])} batches for "
                                    f"{len(values['slots'])} slots")
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


def compact_ids(slots: list[int], batch_ids: list[str | None]) -> list[list] | None:
    """The batches of an update as runs [offset, count, first position]: consecutive slots whose batches are
    consecutive numbers of one shard's pass (`BatchId.position`, content digest left out) make one run; an id that
    is not a `BatchId` (or None) is a run of one holding it as it is. None when the slots are not one contiguous
    range (then the line lists them in full)."""
    if not slots or slots != list(range(slots[0], slots[0] + len(slots))) or len(batch_ids) != len(slots):
        return None
    runs: list[list] = []
    previous = None
    for offset, text in enumerate(batch_ids):
        parsed = BatchId.parse(text) if text else None
        if (parsed is not None and previous is not None and runs and
                dataclasses.replace(previous, number=previous.number + 1, content="") ==
                dataclasses.replace(parsed, content="")):
            runs[-1][1] += 1
        else:
            runs.append([offset, 1, parsed.position if parsed is not None else text])
        previous = parsed
    return runs


def expand_ids(runs: list[list]) -> list[str | None]:
    """The batch ids (positions) `compact_ids` made runs of."""
    ids: list[str | None] = []
    for offset, count, text in runs:
        if offset != len(ids):
            raise ValueError(f"run at offset {offset} after {len(ids)} batches")
        parsed = BatchId.parse(text) if text else None
        if parsed is None:
            ids.extend([text] * count)
        else:
            ids.extend(str(dataclasses.replace(parsed, number=parsed.number + k)) for k in range(count))
    return ids


SEGMENT_UPDATES = 10_000
"""Records in a rolled segment (`TrainLog`): at most about 3.2 KB an update, about 32 MB a file."""

SEGMENT_NAME = re.compile(r"steps-(\d+)-(\d+)\.jsonl")


@dataclass(frozen=True)
class Segment:
    """A rolled file of the log: updates `first`..`last`, both included."""

    path: Path
    first: int
    last: int

    @classmethod
    def name_for(cls, first: int, last: int) -> str:
        return f"steps-{first:08d}-{last:08d}.jsonl"


class TrainLog:
    """A run's train log: append one record per update, read them back, drop the ones a checkpoint does not hold
    (the module docstring says how it is laid out). One writer at a time: rank 0, or the single process."""

    def __init__(self, path: Path, segment_updates: int = SEGMENT_UPDATES):
        if segment_updates < 1:
            raise ValueError(f"segment_updates must be at least 1, not {segment_updates}")
        self.path = Path(path)
        self.segments_dir = self.path.with_name(self.path.stem + ".segments")
        """`train_log.segments/` beside `train_log.jsonl`."""
        self.segment_updates = segment_updates
        self._live_count: int | None = None
        """Records in the live file, counted once when this writer first appends (None: not counted yet)."""
        self._live_first: int | None = None
        """The first update in the live file (names the segment it becomes)."""

    @classmethod
    def of_run(cls, run_dir: Path, segment_updates: int = SEGMENT_UPDATES) -> "TrainLog":
        return cls(Path(run_dir) / TRAIN_LOG, segment_updates)

    # -- writing

    def append(self, record: UpdateRecord) -> None:
        """Append one update's line; roll the live file into a segment once it holds `segment_updates` records."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._live_count is None:
            self._live_count = self._count_live()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(record.to_json() + "\n")
        if self._live_count == 0:
            self._live_first = record.step
        self._live_count += 1
        if self._live_count >= self.segment_updates:
            self._roll(record.step)

    def sync(self) -> None:
        """Make every record appended so far durable (fsync the live file and its folder): rank 0 calls it before
        the checkpoint of the update last appended, whose batches count on the checkpoint's word and are audited
        against these lines. Rolled segments are synced as they roll."""
        if self.path.exists():
            with open(self.path, "rb") as f:
                os.fsync(f.fileno())
            fsync_dir(self.path.parent)

    def _count_live(self) -> int:
        """Count the live file's records and note its first update: bounded by the segment size, read once."""
        count, self._live_first = 0, None
        for _, line in self._numbered_lines(self.path):
            if self._live_first is None:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self._live_first = int(json.loads(line)["step"])
            count += 1
        return count

    def _roll(self, last_step: int) -> None:
        first = self._live_first if self._live_first is not None else last_step
        target = self.segments_dir / Segment.name_for(first, last_step)
        if target.exists():
            raise TrainLogError(f"{self.path}: cannot roll updates {first}..{last_step} into {target}, which exists: "
                                "two writers share this log, or a segment was copied in by hand; move one of them "
                                "aside and start the run again")
        self.segments_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "rb") as f:  # durable before the rename makes it a segment
            os.fsync(f.fileno())
        os.replace(self.path, target)  # atomic: a reader sees the records in the live file or in the segment
        fsync_dir(self.segments_dir)
        fsync_dir(self.path.parent)
        self._live_count, self._live_first = 0, None

    # -- reading

    def segments(self) -> list[Segment]:
        """The rolled segments, in update order; two that overlap are an error (files a crash cannot leave)."""
        if not self.segments_dir.is_dir():
            return []
        found = []
        for path in self.segments_dir.iterdir():
            match = SEGMENT_NAME.fullmatch(path.name)
            if match:  # anything else (an atomic write's temporary file) is not part of the log
                found.append(Segment(path, int(match[1]), int(match[2])))
        found.sort(key=lambda s: (s.first, s.last))
        for before, after in zip(found, found[1:]):
            if after.first <= before.last:
                raise TrainLogError(f"{after.path} (updates {after.first}..{after.last}) overlaps {before.path} "
                                    f"(updates {before.first}..{before.last}): a log holds each update once; one of "
                                    "them was copied in from another run or another copy of this one: move it aside")
        return found

    def iter_records(self, through_step: int | None = None) -> Iterator[UpdateRecord]:
        """Every record (up to `through_step`), in update order, read a line at a time: the segments, then the
        live file, whose torn last line is skipped.

        The writer may roll the live file while this reads: before the live file is read, the segments are listed
        again and any rolled since are read first, so a reader sees every record once, up to some update."""
        done = 0  # the last update of the segments read so far
        for segment in self.segments():
            if through_step is not None and segment.first > through_step:
                return
            yield from self._segment_records(segment, through_step)
            done = segment.last
        while True:
            try:
                live = open(self.path, encoding="utf-8")
            except FileNotFoundError:
                live = None
            rolled_since = [s for s in self.segments() if s.first > done]
            if not rolled_since:
                break
            if live is not None:
                live.close()
            for segment in rolled_since:
                if through_step is not None and segment.first > through_step:
                    return
                yield from self._segment_records(segment, through_step)
                done = segment.last
        if live is None:
            return
        with live:
            yield from self._file_records(self.path, live, through_step, torn_last_line_allowed=True)

    def read(self, through_step: int | None = None) -> list[UpdateRecord]:
        """Every record (up to `through_step`) as one list: for short runs; a whole run's log is read with
        `iter_records`, which holds one file at a time."""
        return list(self.iter_records(through_step))

    def _segment_records(self, segment: Segment, through_step: int | None) -> Iterator[UpdateRecord]:
        with open(segment.path, encoding="utf-8") as f:
            for record in self._file_records(segment.path, f, through_step, torn_last_line_allowed=False):
                if not segment.first <= record.step <= segment.last:
                    raise TrainLogError(f"{segment.path}: holds update {record.step}, outside the updates its name "
                                        f"says ({segment.first}..{segment.last}): it was edited or renamed by hand; "
                                        "restore its name or move it aside")
                yield record

    @staticmethod
    def _file_records(path: Path, lines: Iterable[str], through_step: int | None,
                      torn_last_line_allowed: bool) -> Iterator[UpdateRecord]:
        """The records of one file's lines. A line that is not JSON is an error unless it is the last one of the
        live file (a crash mid-write: the resumed run writes that update again); so each line is parsed only once
        the next one is known to exist."""
        pending: tuple[int, str] | None = None
        for numbered in TrainLog._numbered_lines(path, lines):
            if pending is not None:
                record = TrainLog._parse(path, *pending, last=False)
                if through_step is None or record.step <= through_step:
                    yield record
            pending = numbered
        if pending is not None:
            last = TrainLog._parse(path, *pending, last=torn_last_line_allowed)
            if last is not None and (through_step is None or last.step <= through_step):
                yield last

    @overload
    @staticmethod
    def _parse(path: Path, number: int, line: str, last: Literal[False]) -> UpdateRecord: ...

    @overload
    @staticmethod
    def _parse(path: Path, number: int, line: str, last: bool) -> UpdateRecord | None: ...

    @staticmethod
    def _parse(path: Path, number: int, line: str, last: bool) -> UpdateRecord | None:
        try:
            values = json.loads(line)
        except ValueError as e:
            if last:
                return None
            raise TrainLogError(f"{path}:{number}: not JSON ({e}); only the live file's last line may be torn (a "
                                "crash mid-write): restore the file from a copy, or cut the log at this line with "
                                "TrainLog.truncate_after") from None
        return UpdateRecord.from_dict(values, f"{path}:{number}")

    @staticmethod
    def _numbered_lines(path: Path, lines: Iterable[str] | None = None) -> Iterator[tuple[int, str]]:
        """(line number, line) of the lines that are not blank; a file that does not exist has none."""
        if lines is None:
            if not path.exists():
                return
            with open(path, encoding="utf-8") as f:
                yield from TrainLog._numbered_lines(path, f)
            return
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield number, line.rstrip("\n")

    # -- trimming

    def truncate_after(self, step: int) -> None:
        """Drop the records of updates after `step` (a crash left them; the resumed run writes them again), and a
        torn last line. Only files that hold a later update are touched: in the common case (a checkpoint newer
        than the last roll) the live file alone. Every change is atomic and they are made newest first, so a crash
        here leaves the log cut at some update after `step`, and calling this again finishes the job."""
        later = [s for s in self.segments() if s.last > step]
        if later:
            self.path.unlink(missing_ok=True)  # newer than every segment, so all of it is after `step`
            holding = later[0] if later[0].first <= step else None
            for segment in reversed(later):
                if segment is not holding:
                    segment.path.unlink()
            if holding is not None:  # it becomes the live file again, cut at `step`, and fills up to a segment
                os.replace(holding.path, self.path)
            fsync_dir(self.segments_dir)
            fsync_dir(self.path.parent)  # the live file's removal or its return from the segments
        kept, dropped = [], False
        for _, line in self._numbered_lines(self.path):
            try:
                if int(json.loads(line)["step"]) <= step:
                    kept.append(line)
                    continue
            except (ValueError, KeyError, TypeError):
                pass
            dropped = True
        if dropped:
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self._live_count = None  # counted again by the next append


def feed(records: Iterable[UpdateRecord], *folds) -> None:
    """One pass over `records`, handing each to every fold's `add` (`RunFigures`, `marge.eval.refresh.RefreshCost`):
    several figures over a whole run for one reading of its log."""
    for record in records:
        for fold in folds:
            fold.add(record)


@dataclass
class RunFigures:
    """The figures of a whole run that the pipeline's summary takes from its log, folded one record at a time."""

    updates: int = 0
    first: UpdateRecord | None = None
    last: UpdateRecord | None = None
    staleness_max: int = 0
    """Largest `staleness_max` of any update (0 for a run with none)."""
    index_versions: set[int] = field(default_factory=set)
    """Every index version an update trained from."""

    def add(self, record: UpdateRecord) -> None:
        if self.first is None:
            self.first, self.staleness_max = record, record.staleness_max
        else:
            self.staleness_max = max(self.staleness_max, record.staleness_max)
        self.last = record
        self.updates += 1
        self.index_versions.update(record.index_versions)

    @classmethod
    def of(cls, records: Iterable[UpdateRecord]) -> "RunFigures":
        figures = cls()
        feed(records, figures)
        return figures


def read_train_log(run_dir: Path, through_step: int | None = None) -> list[UpdateRecord]:
    """The records of the run in `run_dir` (none when it has not trained yet)."""
    return TrainLog.of_run(run_dir).read(through_step)
