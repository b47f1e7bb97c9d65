"""Shared fixtures. Ray and Redis fixtures start real processes (a local Ray cluster, a redis-server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray settings measured on this project's machines (see README "Running on a laptop"): no token auth
# for the local test cluster, every socket on loopback, no usage stats, fast shutdown.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")

REPO = Path(__file__).resolve().parents[1]
DEMO_RAW = REPO / "data" / "demo" / "libreoffice-help"


@pytest.fixture(scope="session")
def demo_raw() -> Path:
    return DEMO_RAW


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A prepared corpus from 40 pages of the demo fixture in all its languages (fast to build)."""
    import gzip
    import json

    from marge.prepare import PrepareOptions, prepare

    rows = [json.loads(line) for line in gzip.open(DEMO_RAW / "documents.jsonl.gz", "rt", encoding="utf-8")]
    groups = sorted({r["group"] for r in rows})[:40]
    keep = [r for r in rows if r["group"] in set(groups)]
    raw = tmp_path_factory.mktemp("raw") / "small.jsonl"
    raw.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep), encoding="utf-8")
    out = tmp_path_factory.mktemp("prepared") / "small"
    prepare(PrepareOptions(inputs=[raw], out=out, vocab_size=2000, docs_per_shard=120, max_chunk_tokens=128))
    return out
