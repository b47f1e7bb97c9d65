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

import json
from pathlib import Path
from typing import Any

from marge.protocol import BatchId
from marge.train_log import UpdateRecord

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


def refresh_cost(builds: list[dict[str, Any]], records: list[UpdateRecord]) -> dict[str, Any]:
    """Per version: `steps_during_build`, `first_use_step`, `staleness_at_first_use` (updates between the
    snapshot it was built from and its first use); over the run: `build_share` of the trainers' wall time,
    tokens/s of updates that overlapped a build and of those that did not."""
    intervals = [(b["started_unix"], b["finished_unix"]) for b in builds]
    steps = [(r.time - r.step_seconds, r.time, r) for r in records if r.time > 0]
    first_use: dict[int, int] = {}
    trained_shards: dict[int, set[int]] = {}
    for r in records:
        for v in r.index_versions:
            first_use.setdefault(v, r.step)
        for batch_id in r.trained_slots().values():
            parsed = BatchId.parse(batch_id) if batch_id else None
            if parsed is not None:
                trained_shards.setdefault(parsed.version, set()).add(parsed.shard)
    per_version = []
    for b in builds:
        during = sum(1 for start, end, _ in steps if overlaps(start, end, [(b["started_unix"], b["finished_unix"])]))
        used = first_use.get(b["version"])
        per_version.append({"version": b["version"], "snapshot_step": b["snapshot_step"],
                            "build_seconds": b.get("seconds"), "indexer_workers": b.get("indexer_workers"),
                            "steps_during_build": during, "first_use_step": used,
                            "shards_embedded": b.get("shards_rebuilt"),
                            "shards_trained": len(trained_shards.get(b["version"], ())),
                            "staleness_at_first_use": None if used is None else used - b["snapshot_step"]})
    building = [r for start, end, r in steps if overlaps(start, end, intervals)]
    idle = [r for start, end, r in steps if not overlaps(start, end, intervals)]

    def tokens_per_s(rs: list[UpdateRecord]) -> float | None:
        seconds = sum(r.step_seconds for r in rs)
        return sum(r.tokens for r in rs) / seconds if rs and seconds > 0 else None

    wall = (steps[-1][1] - steps[0][0]) if steps else 0.0
    share = union_seconds(intervals, steps[0][0], steps[-1][1]) / wall if wall > 0 else None
    return {"per_version": per_version, "build_share": share,
            "steps_building": len(building), "steps_idle": len(idle),
            "tokens_per_s_building": tokens_per_s(building), "tokens_per_s_idle": tokens_per_s(idle)}
