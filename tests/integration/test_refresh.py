"""`marge.eval.refresh`: what each index refresh cost the trainers, from build records and the train log."""

from __future__ import annotations

from pathlib import Path

import pytest

from marge.contracts.train_log import UpdateRecord
from marge.eval.refresh import append_build, read_builds, refresh_cost, union_seconds


def step(n: int, end: float, seconds: float, tokens: int, versions: list[int]) -> UpdateRecord:
    return UpdateRecord(step=n, loss=1.0, lr=1e-4, grad_norm=1.0, batch_ids=[], time=end, step_seconds=seconds,
                        tokens=tokens, index_versions=versions)


def test_updates_during_a_build_staleness_at_first_use_and_throughput_with_and_without_a_build():
    # ten 1-second updates from t=100; version 1 (snapshot of update 2) is built over t=[102.5, 105.5] and used
    # from update 7 on; version 0 was built before training started
    builds = [{"version": 0, "snapshot_step": 0, "started_unix": 90.0, "finished_unix": 95.0, "seconds": 5.0},
              {"version": 1, "snapshot_step": 2, "started_unix": 102.5, "finished_unix": 105.5, "seconds": 3.0,
               "indexer_workers": 2}]
    records = [step(n, 100.0 + n, 1.0, 100 if n in (3, 4, 5, 6) else 200, [0] if n < 7 else [1]) for n in range(1, 11)]
    cost = refresh_cost(builds, records)
    v0, v1 = cost["per_version"]
    assert v0 == {"version": 0, "snapshot_step": 0, "build_seconds": 5.0, "indexer_workers": None,
                  "steps_during_build": 0, "first_use_step": 1, "staleness_at_first_use": 1,
                  "shards_embedded": None, "shards_trained": 0}
    # updates 3 (ends 103), 4, 5 and 6 (runs 105-106) overlap [102.5, 105.5]
    assert v1["steps_during_build"] == 4 and v1["first_use_step"] == 7 and v1["staleness_at_first_use"] == 5
    assert v1["indexer_workers"] == 2
    assert cost["steps_building"] == 4 and cost["steps_idle"] == 6
    assert cost["tokens_per_s_building"] == pytest.approx(100.0) and cost["tokens_per_s_idle"] == pytest.approx(200.0)
    assert cost["build_share"] == pytest.approx(3.0 / 10.0)  # training ran over t=[100, 110]


def test_a_version_never_used_and_a_run_without_builds():
    cost = refresh_cost([{"version": 3, "snapshot_step": 30, "started_unix": 0.0, "finished_unix": 1.0}],
                        [step(1, 5.0, 1.0, 10, [2])])
    assert cost["per_version"][0]["first_use_step"] is None and cost["per_version"][0]["staleness_at_first_use"] is None
    empty = refresh_cost([], [step(1, 5.0, 1.0, 10, [])])
    assert empty["build_share"] == 0.0 and empty["tokens_per_s_building"] is None and empty["tokens_per_s_idle"] == 10.0


def test_overlapping_builds_are_counted_once():
    assert union_seconds([(0, 4), (2, 6), (8, 9), (20, 30)], 1, 10) == pytest.approx(5 + 1)


def test_the_newest_record_of_a_version_rebuilt_after_a_resume_wins(tmp_path):
    append_build(tmp_path, {"version": 1, "seconds": 9.0})
    append_build(tmp_path, {"version": 0, "seconds": 1.0})
    append_build(tmp_path, {"version": 1, "seconds": 2.0})
    assert read_builds(tmp_path) == [{"version": 0, "seconds": 1.0}, {"version": 1, "seconds": 2.0}]
    assert read_builds(tmp_path / "nowhere") == []


def test_the_rotating_window_of_a_sampled_refresh_depends_on_the_version_alone():
    from services.indexer.core import shards_to_rebuild

    assert shards_to_rebuild(5, 10, 0, True) == list(range(10))  # full refresh
    assert shards_to_rebuild(5, 10, 3, False) == list(range(10))  # nothing to carry from
    assert shards_to_rebuild(5, 10, 10, True) == list(range(10))
    windows = [shards_to_rebuild(v, 10, 3, True) for v in range(1, 5)]
    assert windows == [[3, 4, 5], [6, 7, 8], [0, 1, 9], [2, 3, 4]]
    covered: set[int] = set()
    for v in range(1, 5):
        covered |= set(shards_to_rebuild(v, 10, 3, True))
    assert covered == set(range(10))  # every shard refreshed within ceil(10 / 3) versions


def test_a_sampled_refresh_re_embeds_its_window_and_carries_the_other_shards_with_their_snapshot_step(
        small_corpus, small_index, tmp_path):
    import shutil

    import torch

    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import commit_version, read_version, staging_dir
    from marge.model.architecture import preset
    from marge.model.network import Marge, RelevanceEncoder
    from services.indexer.config import IndexerConfig
    from services.indexer.core import carry_shards, index_shard, plan_refresh

    root = tmp_path / "index"
    shutil.copytree(small_index.path.parent, root)  # the session's index stays as it is
    corpus = Corpus.open(small_corpus)
    assert corpus.num_shards >= 2
    previous, rebuild, carried = plan_refresh(root, 1, corpus.num_shards, IndexerConfig(shards_per_refresh=1))
    assert previous.version == 0 and rebuild == [1] and carried == [s for s in range(corpus.num_shards) if s != 1]

    torch.manual_seed(1)  # a different encoder than version 0's
    encoder = RelevanceEncoder.from_model(Marge(preset("tiny", vocab_size=corpus.tokenizer().vocab_size,
                                                       max_positions=128))).eval()
    staging = staging_dir(root, 1)
    staging.mkdir(parents=True)
    entries = [{**index_shard(corpus.read_shard(s), encoder, corpus.tokenizer().specials, staging,
                              IndexerConfig()).as_manifest_entry(), "snapshot_step": 10} for s in rebuild]
    entries += carry_shards(previous, carried, staging)
    committed = commit_version(root, 1, 10, entries)

    v1 = read_version(committed.path)
    assert sorted(e["shard"] for e in v1.shards) == list(range(corpus.num_shards))
    steps = {e["shard"]: e["snapshot_step"] for e in v1.shards}
    assert steps == {s: 10 if s == 1 else 0 for s in range(corpus.num_shards)}
    for s in carried:  # the same links as in version 0
        assert v1.read_graph(s).equals(previous.read_graph(s))
        entry = next(e for e in v1.shards if e["shard"] == s)
        assert entry["carried_from_version"] == 0 and entry["embed_seconds"] == 0.0
    assert not v1.read_graph(1).equals(previous.read_graph(1))  # re-embedded with the new encoder


def test_shards_trained_per_version_come_from_the_batch_ids_of_the_trained_slots():
    builds = [{"version": 2, "snapshot_step": 20, "started_unix": 0.0, "finished_unix": 1.0, "shards_rebuilt": 3}]
    trained = UpdateRecord(step=1, loss=1.0, lr=0.0, grad_norm=1.0, slots=[0, 1, 2, 3], dead_lettered=[3], time=5.0,
                           batch_ids=["v2-e0-s4-0", "v2-e0-s4-1", "v2-e1-s7-0", "v2-e0-s9-0"], index_versions=[2])
    (v2,) = refresh_cost(builds, [trained])["per_version"]
    assert v2["shards_embedded"] == 3 and v2["shards_trained"] == 2  # shard 9's only batch was dead-lettered


def test_the_paper_refresh_samples_shards_by_seed_and_version_alone():
    from services.indexer.config import IndexerConfig
    from services.indexer.core import plan_refresh, sampled_shards

    samples = [sampled_shards(v, 50, 4, seed=3) for v in range(6)]
    assert all(len(s) == 4 == len(set(s)) and s == sorted(s) and 0 <= min(s) and max(s) < 50 for s in samples)
    assert samples == [sampled_shards(v, 50, 4, seed=3) for v in range(6)]  # a rebuild after a resume: the same
    assert len({tuple(s) for s in samples}) == 6 and sampled_shards(0, 50, 4, seed=4) != samples[0]
    assert sampled_shards(1, 3, 4, seed=0) == [0, 1, 2] and sampled_shards(1, 50, 0, seed=0) == list(range(50))
    assert plan_refresh(Path("nowhere"), 2, 50, IndexerConfig(shards_per_version=4), seed=3) == (None, samples[2], [])
    with pytest.raises(ValueError, match="shards_per_refresh"):
        IndexerConfig(shards_per_version=4, shards_per_refresh=2)


def test_a_sampled_version_holds_its_sample_and_its_batches_come_only_from_it(small_corpus, tmp_path):
    import torch

    from marge.contracts.corpus import Corpus
    from marge.contracts.slots import BatchId
    from marge.model.architecture import preset
    from marge.model.network import Marge, RelevanceEncoder
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore, epoch_batches
    from services.indexer.config import IndexerConfig
    from services.indexer.core import build_version, index_shard, sampled_shards

    corpus = Corpus.open(small_corpus)
    assert corpus.num_shards >= 4
    torch.manual_seed(0)
    encoder = RelevanceEncoder.from_model(Marge(preset("tiny", vocab_size=corpus.tokenizer().vocab_size,
                                                       max_positions=128))).eval()
    cfg = IndexerConfig(shards_per_version=2)

    def index_shards(shards, staging):
        return [index_shard(corpus.read_shard(s), encoder, corpus.tokenizer().specials, staging, cfg, seed=s,
                            snapshot_step=0).as_manifest_entry() for s in shards]

    committed, record = build_version(tmp_path / "index", tmp_path, 0, 0, corpus.num_shards, cfg, index_shards, seed=3)
    sample = sampled_shards(0, corpus.num_shards, 2, seed=3)
    assert sorted(e["shard"] for e in committed.shards) == sample
    assert record["shards_rebuilt"] == 2 and record["shards_carried"] == 0
    batches = list(epoch_batches(committed, DocumentStore(corpus), BatcherConfig(max_tokens=400), 0, seed=0))
    assert batches and {BatchId.parse(b.batch_id).shard for b in batches} <= set(sample)


def test_cycled_shard_samples_cover_every_shard_once_a_cycle_and_the_coverage_formulas_match_the_draws():
    from services.indexer.core import sampled_shards, shard_coverage

    cycle = [sampled_shards(v, 50, 5, seed=3, sampling="cycle") for v in range(10)]  # one cycle: 10 blocks of 5
    assert sorted(s for sample in cycle for s in sample) == list(range(50))
    assert cycle == [sampled_shards(v, 50, 5, seed=3, sampling="cycle") for v in range(10)]  # rebuilt: the same
    assert sampled_shards(10, 50, 5, seed=3, sampling="cycle") != cycle[0]  # the next cycle, a new permutation
    assert shard_coverage(50, 5, 10, "cycle") == 1.0 and shard_coverage(50, 5, 4, "cycle") == 0.4
    # independent draws: the expected coverage, against the draws themselves over 40 seeds
    drawn = [len({s for v in range(10) for s in sampled_shards(v, 50, 5, seed=seed)}) / 50 for seed in range(40)]
    assert abs(sum(drawn) / len(drawn) - shard_coverage(50, 5, 10)) < 0.02
    assert round(shard_coverage(5000, 128, 46), 2) == 0.70  # the paper's 128 of 5,000 over 46 versions: 30% never
