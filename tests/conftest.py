"""Shared fixtures. Ray and Redis fixtures start real processes (a local Ray cluster, a redis-server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray settings measured on this project's machines (docs/testing.md): no token auth
# for the local test cluster, every socket on loopback, no usage stats, fast shutdown.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")

# The private redis-servers' configs (passwords) go here, not into the developer's ~/.local/state/marge.
os.environ.setdefault("MARGE_STATE_DIR", __import__("tempfile").mkdtemp(prefix="marge-test-state-"))

REPO = Path(__file__).resolve().parents[1]
DEMO_RAW = REPO / "data" / "demo" / "libreoffice-help"


TIERS = ("unit", "integration", "cluster")


def pytest_collection_modifyitems(items):
    """Each test carries its tier's marker (its folder under tests/), so `-m "not cluster"` selects across tiers."""
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(item.path.parent.name)


@pytest.fixture(scope="session")
def demo_raw() -> Path:
    return DEMO_RAW


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A prepared corpus from 40 pages of the demo fixture in all its languages (fast to build)."""
    import gzip
    import json

    from services.prepare.options import PrepareOptions
    from services.prepare.run import prepare

    rows = [json.loads(line) for line in gzip.open(DEMO_RAW / "documents.jsonl.gz", "rt", encoding="utf-8")]
    groups = sorted({r["group"] for r in rows})[:40]
    keep = [r for r in rows if r["group"] in set(groups)]
    raw = tmp_path_factory.mktemp("raw") / "small.jsonl"
    raw.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep), encoding="utf-8")
    out = tmp_path_factory.mktemp("prepared") / "small"
    prepare(PrepareOptions(inputs=[raw], out=out, vocab_size=2000, docs_per_shard=120, max_chunk_tokens=128))
    return out

@pytest.fixture(scope="session")
def paragraph_corpus(tmp_path_factory) -> Path:
    """The learning recipe's corpus in small: 12 pages of the demo fixture in its 5 Latin-script languages, one
    paragraph per document (with the paragraph ids that say which documents are translations)."""
    import gzip
    import json

    from services.prepare.options import PrepareOptions
    from services.prepare.run import prepare

    rows = [json.loads(line) for line in gzip.open(DEMO_RAW / "documents.jsonl.gz", "rt", encoding="utf-8")]
    short = {r["group"] for r in rows if r["language"] == "en" and len(r["text"]) < 3000}  # no giant page
    groups = sorted(short)[:12]
    keep = [r for r in rows if r["group"] in set(groups)]
    raw = tmp_path_factory.mktemp("raw") / "paragraphs.jsonl"
    raw.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep), encoding="utf-8")
    out = tmp_path_factory.mktemp("prepared") / "paragraphs"
    prepare(PrepareOptions(inputs=[raw], out=out, vocab_size=1500, docs_per_shard=150, max_chunk_tokens=64,
                           document_unit="paragraph", min_document_tokens=4, languages=("en", "de", "fr", "es", "it")))
    return out


@pytest.fixture(scope="session")
def few_pairs(tmp_path_factory) -> Path:
    """The demo's held-out pairs cut to 6 per language pair (14 directions): evaluations stay short."""
    rows, per_pair = [], {}
    for line in (DEMO_RAW / "heldout_pairs.tsv").read_text(encoding="utf-8").splitlines():
        key = tuple(line.split("\t")[0::2])
        if per_pair.setdefault(key, 0) < 6:
            per_pair[key] += 1
            rows.append(line)
    path = tmp_path_factory.mktemp("pairs") / "pairs.tsv"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path

# Ray Train V2 controller settings for a small machine (measured: about 9-14 s per fit instead of 13-22 s)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION", "0")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray cluster for the whole session (4 logical CPUs: 2 trainers + indexer + spare)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024 * 1024,
             log_to_driver=False, namespace="marge-tests")
    yield ray
    ray.shutdown()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, with the project's persistence settings."""
    from services.driver.redis_server import LocalRedis

    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_index(small_corpus, tmp_path_factory):
    """Index version 0 of the small corpus, built at random init with the tiny model."""
    import torch

    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.network import Marge, RelevanceEncoder
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus

    corpus = Corpus.open(small_corpus)
    tok = corpus.tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128))
    root = tmp_path_factory.mktemp("index")
    return index_corpus(corpus, RelevanceEncoder.from_model(model).eval(), tok.specials, root, 0, 0, IndexerConfig())


@pytest.fixture(scope="module")
def latin_tokenizer(paragraph_corpus):
    """The tokenizer of the paragraph corpus (its languages are Latin-script)."""
    from marge.contracts.corpus import Corpus

    return Corpus.open(paragraph_corpus).tokenizer()


@pytest.fixture(scope="module")
def aligned_items(latin_tokenizer, demo_raw):
    """The aligned probe built from the demo's held-out documents (24 items of up to 64 tokens)."""
    from services.trainer.health import build_aligned_probe

    return build_aligned_probe(demo_raw / "heldout_documents.jsonl.gz", latin_tokenizer, size=24, max_tokens=64)
