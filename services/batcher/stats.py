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

    newest = max((s.get("links_version", -1) for s in stats), default=-1)
    links: dict[tuple[str, str], int] = {}
    for s in stats:  # the builders' links of the newest version any of them has built batches from
        if s.get("links_version", -1) == newest:
            for pair, n in s.get("links_by_language", {}).items():
                links[pair] = links.get(pair, 0) + n
    return {"produced": produced, "produced_by_version": by_version, "builders": len(stats),
            "links_version": newest, "links_by_language": links,
            "documents_by_language": next((s["documents_by_language"] for s in stats if "documents_by_language" in s), {}),
            "crosslingual_share": weighted("crosslingual_share"), "mean_batch_tokens": weighted("mean_batch_tokens"),
            "next_slot": min(s["next_slot"] for s in stats), "waiting_for_version": min(waiting) if waiting else None,
            "time": max(s["time"] for s in stats)}


def links_by_language(batch) -> dict[tuple[str, str], int]:
    """(target language, evidence language) -> the batch's links (its edges) between them."""
    out: dict[tuple[str, str], int] = {}
    for t, e in batch.edges.tolist():
        pair = (batch.doc_langs[batch.targets[t]], batch.doc_langs[batch.evidence[e]])
        out[pair] = out.get(pair, 0) + 1
    return out
