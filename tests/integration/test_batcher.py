"""Indexer links and batcher properties on a real (small) index built at random init."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from marge.contracts.corpus import Corpus
from marge.contracts.index_store import IndexStoreError, latest_version
from marge.contracts.slots import BatchId
from services.batcher.config import BatcherConfig
from services.batcher.core import DocumentStore, epoch_batches


@pytest.fixture(scope="module")
def docs(small_corpus):
    return DocumentStore(Corpus.open(small_corpus))


def batches(index, docs, seed=0, **kw):
    return list(epoch_batches(index, docs, BatcherConfig(**{"max_tokens": 400, **kw}), epoch=0, seed=seed))


def test_index_links_follow_the_top_k_rule(small_index, small_corpus):
    corpus = Corpus.open(small_corpus)
    assert latest_version(small_index.path.parent).version == 0
    for entry in small_index.shards:
        shard = corpus.read_shard(entry["shard"])
        graph = small_index.read_graph(entry["shard"])
        n = len(shard)
        cross = graph.column("cross_lingual").to_numpy(zero_copy_only=False)
        # 4 monolingual and 4 cross-lingual links per document on average (paper §3), or every pair of
        # that kind when the shard has fewer
        _, per_lang = np.unique(shard.langs, return_counts=True)
        mono_pairs = int((per_lang * (per_lang - 1)).sum())
        assert (~cross).sum() == min(4 * n, mono_pairs)
        assert cross.sum() == min(4 * n, n * (n - 1) - mono_pairs)
        t, e = graph.column("target_id").to_numpy(), graph.column("evidence_id").to_numpy()
        assert not np.any(t == e), "a document linked to itself"
        members = set(shard.doc_ids.tolist())
        assert set(t.tolist()) <= members and set(e.tolist()) <= members, "a link leaves its shard"
        lang = dict(zip(shard.doc_ids.tolist(), shard.langs))
        assert all((lang[a] != lang[b]) == c for a, b, c in zip(t.tolist(), e.tolist(), cross))
        # the kept links are the strongest pairs of their kind across the whole shard: recompute every
        # pair's cosine from the vectors in the shard's FAISS index
        index = small_index.read_faiss(entry["shard"])
        ids = shard.doc_ids
        unit = np.stack([index.reconstruct(int(i)) for i in ids])
        sims = unit @ unit.T
        same = shard.langs[:, None] == shard.langs[None, :]
        np.fill_diagonal(sims, np.nan)
        scores = graph.column("score").to_numpy()
        for kind_mask, kept in ((same, scores[~cross]), (~same, scores[cross])):
            pairs = np.sort(sims[kind_mask & ~np.isnan(sims)])[::-1]
            np.testing.assert_allclose(np.sort(kept)[::-1], pairs[: len(kept)], rtol=1e-5, atol=1e-6)


def test_every_batch_is_within_budget_and_every_target_has_its_evidence(small_index, docs):
    out = batches(small_index, docs)
    assert len(out) > 5
    seen_targets = []
    for b in out:
        assert b.cost_tokens() <= 400
        linked = set(b.edges[:, 0].tolist())
        assert linked == set(range(b.num_targets)), "a target without evidence in its batch"
        for t, e in b.edges:
            assert b.doc_ids[b.targets[t]] != b.doc_ids[b.evidence[e]]
        seen_targets.extend(b.doc_ids[b.targets].tolist())
    assert len(seen_targets) == len(set(seen_targets)), "a target used twice in one pass"
    graph_targets = set(small_index.read_graph().column("target_id").to_pylist())
    assert len(set(seen_targets)) >= 0.9 * len(graph_targets)


def test_same_seed_same_batches_and_another_seed_other_batches(small_index, docs):
    a, b = batches(small_index, docs, seed=3), batches(small_index, docs, seed=3)
    assert [x.batch_id for x in a] == [x.batch_id for x in b]
    assert all(np.array_equal(x.doc_ids, y.doc_ids) and np.array_equal(x.edges, y.edges) for x, y in zip(a, b))
    c = batches(small_index, docs, seed=4)
    assert [x.doc_ids.tolist() for x in a] != [x.doc_ids.tolist() for x in c]


def test_raising_the_crosslingual_weight_raises_the_crosslingual_share(small_index, docs):
    def share(weight):
        out = batches(small_index, docs, crosslingual_weight=weight)
        edges = sum(len(b.edges) for b in out)
        return sum(b.cross_lingual_edge_share() * len(b.edges) for b in out) / edges

    low, high = share(0.01), share(100.0)
    assert high > low + 0.2, (low, high)


def test_a_corrupt_index_file_is_detected(small_index, tmp_path):
    import shutil

    copy = tmp_path / "v"
    shutil.copytree(small_index.path, copy)
    from marge.contracts.index_store import read_version

    version = read_version(copy)
    version.verify()
    graph = copy / version.shards[0]["graph_file"]
    graph.write_bytes(graph.read_bytes()[:-10])
    with pytest.raises(IndexStoreError, match="sha256"):
        version.verify()


def test_document_link_rule_gives_every_document_its_own_links(small_corpus):
    from services.indexer.config import IndexerConfig
    from services.indexer.links import shard_links

    corpus = Corpus.open(small_corpus)
    shard = corpus.read_shard(0)
    rng = np.random.default_rng(0)
    # every language but one shares a common direction (high cosines); that one is isotropic (cosines near 0)
    raw = rng.normal(size=(len(shard), 16)).astype(np.float32)
    raw[shard.langs != shard.langs[0]] += 4.0
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)

    def link_counts(rule):
        links = shard_links(shard.doc_ids, shard.langs, unit, IndexerConfig(link_rule=rule, links_monolingual=2,
                                                                             links_crosslingual=2))
        return {d: int((links["target_id"] == d).sum()) for d in shard.doc_ids.tolist()}

    assert min(link_counts("shard").values()) == 0  # the paper's shard-wide rule leaves documents without links
    counts = link_counts("document")
    assert min(counts.values()) >= 2 and max(counts.values()) <= 4  # every document keeps links of its own


def test_the_schedule_is_a_function_of_the_slot_and_switches_versions_at_fixed_steps(small_index, small_corpus, docs,
                                                                                      tmp_path):
    import threading

    import torch

    from marge.contracts.slots import Slots, VersionPlan
    from marge.model.architecture import preset
    from marge.model.network import Marge, RelevanceEncoder
    from services.batcher.schedule import BatchSchedule, wait_for_version
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus

    corpus = Corpus.open(small_corpus)
    torch.manual_seed(1)
    encoder = RelevanceEncoder.from_model(Marge(preset("tiny", vocab_size=corpus.tokenizer().vocab_size,
                                                       max_positions=128))).eval()
    root = small_index.path.parent
    v1 = index_corpus(corpus, encoder, corpus.tokenizer().specials, tmp_path, 1, 4, IndexerConfig())
    versions = {0: small_index, 1: v1}
    slots, plan = Slots(world=2, grad_accum=1), VersionPlan(reindex_every=4, lag=2)

    def schedule():
        return BatchSchedule(docs, BatcherConfig(max_tokens=400), 0, slots, plan, versions.get)

    whole = list(zip(range(20), (b for _, b in schedule().batches(0))))
    # version 0 serves updates 0..5 (slots 0..11), version 1 updates 6..9, each from its own first batch on
    assert [b.index_version for _, b in whole] == [0] * 12 + [1] * 8
    assert whole[12][1].batch_id == next(iter(epoch_batches(v1, docs, BatcherConfig(max_tokens=400), 0, 0))).batch_id
    # started anywhere (a resumed run, a restarted batcher), a slot gets the same batch
    resumed = schedule().batches(7)
    assert [next(resumed)[1].batch_id for _ in range(13)] == [b.batch_id for _, b in whole[7:]]
    # a requeued batch written into slot 3 moves the version's scheduled batches one slot on, up to its end
    s = schedule()
    assert s.batch(4, s.replays_before(4, [3])).batch_id == whole[3][1].batch_id
    assert s.batch(12, s.replays_before(12, [3])).batch_id == whole[12][1].batch_id
    # a version that is not committed yet is waited for, and the wait ends when asked to
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert wait_for_version(root, 7, stop, poll_s=0.05) is None
    assert wait_for_version(root, 0, stop).version == 0
    # an index built from another snapshot does not belong to the schedule
    wrong = BatchSchedule(docs, BatcherConfig(max_tokens=400), 0, slots, VersionPlan(reindex_every=5, lag=2),
                          versions.get)
    with pytest.raises(RuntimeError, match="built from snapshot 4, not 5"):
        wrong.batch(14)


def test_builders_share_no_shard_and_a_resumed_builder_passes_over_shards_by_their_counts(small_index, small_corpus,
                                                                                          tmp_path):
    """With two builders each takes every other shard of a pass, so their batches never overlap and together
    they are the one builder's; a builder started deep inside a version (a resume) gives its slots the same
    batches as one that ran from the start, and with the shard counts on the run's storage it reads only the
    shard it resumes in."""
    from marge.contracts.slots import Slots, VersionPlan
    from services.batcher.schedule import BatchSchedule, RunSchedule

    corpus, cfg = Corpus.open(small_corpus), BatcherConfig(max_tokens=400, plan_ahead=False)  # reads counted exactly
    plan, versions = VersionPlan(reindex_every=1000, lag=0), {0: small_index}
    one_pass = batches(small_index, DocumentStore(corpus))
    two = Slots(world=4, grad_accum=1, builders=2)

    def schedule(group, store, counts_root=None):
        return BatchSchedule(store, cfg, 0, two, plan, versions.get, group=group, counts_root=counts_root)

    per_group = {}
    for group in (0, 1):
        sequence = schedule(group, DocumentStore(corpus), tmp_path / "counts").batches(0)
        per_group[group] = [next(sequence) for _ in range(len(one_pass) + 4)]
        assert all(two.group_of(slot) == group for slot, _ in per_group[group])
    shards = {g: {BatchId.parse(b.batch_id).shard for _, b in pairs if BatchId.parse(b.batch_id).epoch == 0}
              for g, pairs in per_group.items()}
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    first_pass = sorted(b.batch_id for pairs in per_group.values() for _, b in pairs if b.batch_id.split("-")[1] == "e0")
    assert first_pass == sorted(b.batch_id for b in one_pass)  # between them, the one builder's pass, once
    with pytest.raises(ValueError, match="belongs to builder 1"):
        schedule(0, DocumentStore(corpus)).batch(2)
    # a host that trains every slot itself (the single process) trains what the builders write
    every = RunSchedule(DocumentStore(corpus), cfg, 0, two, plan, versions.get).batches(0)
    by_slot = {slot: b.batch_id for pairs in per_group.values() for slot, b in pairs}
    assert [next(every)[1].batch_id for _ in range(24)] == [by_slot[n] for n in range(24)]

    late = len(per_group[0]) - 3  # past the end of the first pass: a resume inside the second
    start = per_group[0][late][0]
    for counts_root in (tmp_path / "counts", None):
        store = DocumentStore(corpus, cache_mb=0)
        resumed = schedule(0, store, counts_root).batches(start)
        assert [next(resumed)[1].batch_id for _ in range(3)] == [b.batch_id for _, b in per_group[0][late:]]
        needed = len({BatchId.parse(b.batch_id).position.rsplit("-", 1)[0] for _, b in per_group[0][late:]})
        if counts_root is not None:  # known counts: only the shards of the batches it builds were read
            assert store.reads == needed and list(counts_root.glob("v000000-g0-*.jsonl"))
        else:  # planned its way there: the shards before it as well
            assert store.reads > len(shards[0]) + needed


# --- the document store: one shard at a time ------------------------------------------------------------


def test_a_store_holding_one_shard_builds_the_batches_of_one_holding_the_corpus(small_index, small_corpus):
    corpus = Corpus.open(small_corpus)
    bounded, whole = DocumentStore(corpus, cache_mb=0), DocumentStore(corpus, cache_mb=1024)
    cfg = BatcherConfig(max_tokens=400)
    for epoch in (0, 1):
        for a, b in zip(epoch_batches(small_index, bounded, cfg, epoch), epoch_batches(small_index, whole, cfg, epoch),
                        strict=True):
            assert a.batch_id == b.batch_id and a.doc_langs == b.doc_langs
            assert np.array_equal(a.doc_ids, b.doc_ids) and np.array_equal(a.edges, b.edges)
            assert all(np.array_equal(x, y) for x, y in zip(a.doc_tokens, b.doc_tokens, strict=True))
            assert len(bounded._cache) == 1, "the bounded store held more than the shard in use"
    shards_with_links = sum(1 for s in small_index.shards if s["num_edges"])
    assert bounded.reads == 2 * shards_with_links  # every shard read again on the second pass
    assert whole.reads == shards_with_links  # within the budget: each shard read once
    assert whole.cached_bytes > bounded.cached_bytes


def test_planning_the_next_shard_ahead_changes_no_batch(small_index, small_corpus):
    corpus = Corpus.open(small_corpus)
    for epoch in (0, 1):
        ahead = list(epoch_batches(small_index, DocumentStore(corpus, cache_mb=0), BatcherConfig(max_tokens=400), epoch))
        inline = list(epoch_batches(small_index, DocumentStore(corpus, cache_mb=0),
                                    BatcherConfig(max_tokens=400, plan_ahead=False), epoch))
        assert [b.batch_id for b in ahead] == [b.batch_id for b in inline] and len(ahead) > 10
        for a, b in zip(ahead, inline, strict=True):
            assert np.array_equal(a.doc_ids, b.doc_ids) and np.array_equal(a.edges, b.edges)
            assert np.array_equal(a.edge_weights, b.edge_weights)
    # a sequence abandoned mid-way (the schedule moved its cursor) leaves no planning thread behind
    def planners() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("plan-ahead")}

    before = planners()  # the suspended sequences of other tests' schedules keep theirs
    sequence = epoch_batches(small_index, DocumentStore(corpus), BatcherConfig(max_tokens=400), 0)
    next(sequence)
    assert planners() - before
    sequence.close()
    deadline = time.time() + 10
    while planners() - before and time.time() < deadline:
        time.sleep(0.05)
    assert not planners() - before


def test_the_store_budget_counts_every_byte_a_cached_shard_holds(small_corpus):
    import gc
    import tracemalloc

    from services.batcher.core import PER_DOCUMENT_BYTES

    corpus = Corpus.open(small_corpus)
    DocumentStore(corpus).shard(0)  # the first read imports and caches what every later read shares
    store = DocumentStore(corpus)
    gc.collect()
    tracemalloc.start()
    try:
        for s in store.shard_numbers:
            store.shard(s)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    cached = list(store._cache.values())
    documents = sum(len(t.doc_ids) for t in cached)
    per_document = (held - sum(t.flat.nbytes + t.offsets.nbytes for t in cached)) / documents
    assert 0 < per_document <= PER_DOCUMENT_BYTES, per_document
    assert held <= store.cached_bytes


def test_links_to_documents_outside_their_shard_are_refused_naming_the_index(tmp_path, small_corpus):
    from marge.contracts.index_store import IndexVersion, write_graph

    corpus = Corpus.open(small_corpus)
    ids = corpus.read_shard(0).doc_ids
    stranger = int(corpus.read_shard(1).doc_ids[0])
    write_graph(tmp_path / "graph-0.parquet", np.array([ids[0]]), np.array([stranger]), np.array([0.5]), np.array([True]))
    index = IndexVersion(4, tmp_path, {"snapshot_step": 0, "shards": [{"shard": 0, "graph_file": "graph-0.parquet"}]})
    with pytest.raises(ValueError, match=rf"index v4 .*doc id {stranger}, which corpus shard 0 does not hold"):
        list(epoch_batches(index, DocumentStore(corpus), BatcherConfig(max_tokens=400), 0))
