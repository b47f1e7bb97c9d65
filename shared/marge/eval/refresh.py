"""What refreshing the index costs the trainers: per index version and over the run.

The figures users of retrieval-augmented trainers ask for first (an index rebuild stalling or starving training):
for each version, how long it took, how many trainer updates passed while it was built, and how stale its
snapshot was when the trainers first used it; over the run, the share of training time during which a build
ran and the trainers' tokens/s with and without one running (on shared cores the indexer competes with them).

Inputs are what the run writes anyway: the indexer's build records (`index_builds.jsonl` in the run folder, one
line per committed version: `started_unix`, `finished_unix`, `snapshot_step`, ...) and `train_log.jsonl` (one
line per update: `time` at its end, `step_seconds`, `tokens`, `index_versions`).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from marge.contracts.slots import BatchId
from marge.contracts.train_log import UpdateRecord

INDEX_BUILDS = "index_builds.jsonl"


def append_build(run_dir: Path, record: dict[str, Any]) -> None:
    """One line per committed version (a version built again after a resume appends a newer line)."""
    with open(Path(run_dir) / INDEX_BUILDS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_builds(run_dir: Path) -> list[dict[str, Any]]:
    """The newest record of each version, by version."""
    path = Path(run_dir) / INDEX_BUILDS
    if not path.exists():
        return []
    newest: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            newest[record["version"]] = record
    return [newest[v] for v in sorted(newest)]


def overlaps(start: float, end: float, intervals: list[tuple[float, float]]) -> bool:
    return any(s < end and start < e for s, e in intervals)


def union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the intervals."""
    total, cursor = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= cursor or e <= s:  # already counted, or outside [lo, hi]
            continue
        total += e - max(s, cursor)
        cursor = e
    return total


def refresh_cost(builds: list[dict[str, Any]], records: Iterable[UpdateRecord]) -> dict[str, Any]:
    """Per version: `steps_during_build`, `first_use_step`, `staleness_at_first_use` (updates between the
    snapshot it was built from and its first use); over the run: `build_share` of the trainers' wall time,
    tokens/s of updates that overlapped a build and of those that did not. `records` is read once, in order
    (a whole run's `TrainLog.iter_records()`; `RefreshCost` to fold it together with other figures)."""
    cost = RefreshCost(builds)
    for record in records:
        cost.add(record)
    return cost.result()


class RefreshCost:
    """`refresh_cost` folded one update record at a time: what it holds grows with the builds and the index
    versions' shards, not with the updates."""

    def __init__(self, builds: list[dict[str, Any]]):
        self.builds = builds
        self.intervals = [(b["started_unix"], b["finished_unix"]) for b in builds]
        # builds by start, so that an update is compared only with the builds that can overlap it: those started
        # before it ends and less than the longest build before it starts
        self.by_start = sorted(range(len(builds)), key=lambda i: self.intervals[i][0])
        self.starts = [self.intervals[i][0] for i in self.by_start]
        self.longest = max((e - s for s, e in self.intervals), default=0.0)
        self.steps_during = [0] * len(builds)
        self.first_use: dict[int, int] = {}
        self.trained_shards: dict[int, set[int]] = {}
        self.first_start: float | None = None
        """Start of the first update with a time, and end of the last: the trainers' wall time."""
        self.last_end: float | None = None
        self.building = _Throughput()
        self.idle = _Throughput()

    def add(self, r: UpdateRecord) -> None:
        for v in r.index_versions:
            self.first_use.setdefault(v, r.step)
        for batch_id in r.trained_slots().values():
            parsed = BatchId.parse(batch_id) if batch_id else None
            if parsed is not None:
                self.trained_shards.setdefault(parsed.version, set()).add(parsed.shard)
        if not r.time > 0:  # written before updates carried their time
            return
        start, end = r.time - r.step_seconds, r.time
        if self.first_start is None:
            self.first_start = start
        self.last_end = end
        during_a_build = False
        # a second of slack below the bound for rounding: every candidate is then checked exactly
        lo = bisect.bisect_left(self.starts, start - self.longest - 1.0)
        for i in self.by_start[lo:bisect.bisect_left(self.starts, end)]:
            if overlaps(start, end, [self.intervals[i]]):
                self.steps_during[i] += 1
                during_a_build = True
        (self.building if during_a_build else self.idle).add(r)

    def result(self) -> dict[str, Any]:
        per_version = []
        for b, during in zip(self.builds, self.steps_during):
            used = self.first_use.get(b["version"])
            per_version.append({"version": b["version"], "snapshot_step": b["snapshot_step"],
                                "build_seconds": b.get("seconds"), "indexer_workers": b.get("indexer_workers"),
                                "steps_during_build": during, "first_use_step": used,
                                "shards_embedded": b.get("shards_rebuilt"),
                                "shards_trained": len(self.trained_shards.get(b["version"], ())),
                                "staleness_at_first_use": None if used is None else used - b["snapshot_step"]})
        first, last = self.first_start, self.last_end  # both set by the first step, or neither
        wall = (last - first) if first is not None and last is not None else 0.0
        share = union_seconds(self.intervals, first, last) / wall if wall > 0 and first is not None and \
            last is not None else None
        return {"per_version": per_version, "build_share": share,
                "steps_building": self.building.updates, "steps_idle": self.idle.updates,
                "tokens_per_s_building": self.building.tokens_per_s(), "tokens_per_s_idle": self.idle.tokens_per_s()}


class _Throughput:
    """Tokens and seconds of a set of updates, summed in update order."""

    def __init__(self):
        self.updates, self.tokens = 0, 0
        self.seconds: float = 0

    def add(self, r: UpdateRecord) -> None:
        self.updates += 1
        self.tokens += r.tokens
        self.seconds += r.step_seconds

    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.updates and self.seconds > 0 else None
