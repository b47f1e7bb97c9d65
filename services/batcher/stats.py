"""The batch builders' figures as one: what the driver's progress line and run summary show."""

from __future__ import annotations


def combined_stats(stats: list[dict]) -> dict:
    """One figure set from every builder's `Batcher.stats()`: counts summed, shares weighted by batches produced,
    the lowest cursor (every slot below it is written), and the oldest index version a builder waits for."""
    produced = sum(s["produced"] for s in stats)
    by_version: dict[int, int] = {}
    for s in stats:
        for version, n in s["produced_by_version"].items():
            by_version[version] = by_version.get(version, 0) + n
    waiting = [s["waiting_for_version"] for s in stats if s["waiting_for_version"] is not None]

    def weighted(key: str) -> float:
        return sum(s[key] * s["produced"] for s in stats) / max(1, produced)

    return {"produced": produced, "produced_by_version": by_version, "builders": len(stats),
            "crosslingual_share": weighted("crosslingual_share"), "mean_batch_tokens": weighted("mean_batch_tokens"),
            "next_slot": min(s["next_slot"] for s in stats), "waiting_for_version": min(waiting) if waiting else None,
            "time": max(s["time"] for s in stats)}
