"""The whole pipeline on a real local Ray cluster and a real redis-server (tiny model, small corpus)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from marge.contracts.corpus import Corpus
from marge.contracts.protocol import BatchQueue, write_url_file
from marge.contracts.slots import BatchId
from marge.model.checkpoint import load_model_weights, read_manifest
from services.batcher.config import BatcherConfig
from services.batcher.core import DocumentStore, epoch_batches
from services.driver.config import load_config
from services.driver.spec import read_spec
from services.trainer.objectives import objectives_for
from services.trainer.step import reference_train

REPO = Path(__file__).resolve().parents[2]


def small_config(tmp_path: Path, corpus: Path, redis_url: str, name: str, *extra: str):
    return load_config(REPO / "deploy/configs/tiny.yaml", [
        f"run.name={name}", f"run.dir={tmp_path / name}", f"data.corpus={corpus}", "data.max_chunk_tokens=128",
        "model.max_positions=128", "batcher.max_tokens=400", f"redis.url={redis_url}", "run.progress_every_s=2",
        "trainer.warmup_steps=2", "trainer.lr=2e-3", "health.aligned_probe_size=8",
        "health.external_probes=true", *extra])  # the demo's held-out pages: not beside the small corpus's input


@pytest.mark.slow
def test_training_through_redis_matches_the_in_process_reference(ray_cluster, redis_server, small_corpus, small_index,
                                                                 tmp_path, monkeypatch):
    from services.driver.pipeline import make_trainer
    from services.driver.spec import compile_spec
    from services.trainer.init import ensure_initial_model

    cfg = small_config(tmp_path, small_corpus, redis_server.url, "parity", "run.max_steps=6",
                       "trainer.num_workers=2", "trainer.snapshot_every=100", "indexer.reindex_every=100",
                       "trainer.checkpoint_every=100")
    corpus = Corpus.open(small_corpus)
    ensure_initial_model(cfg.model_config(corpus.tokenizer().vocab_size), cfg.paths(), corpus, cfg.run.seed)
    batches = list(epoch_batches(small_index, DocumentStore(corpus), BatcherConfig(max_tokens=400), epoch=0))[:12]
    queue = BatchQueue.connect(redis_server.url, cfg.run.name, cfg.slots())
    for slot, b in enumerate(batches):  # slot n: update n // 2, rank n % 2
        queue.put(slot, b, lookahead_steps=100)

    # the state Ray Train keeps of the run and the dashboard serves (on with RAY_TRAIN_ENABLE_STATE_TRACKING) holds no
    # password: the job names the file of the Redis URL, not the URL
    monkeypatch.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    make_trainer(cfg, compile_spec(cfg).trainer_job(write_url_file(tmp_path / "redis-url", redis_server.url))).fit()
    from ray.train.v2._internal.state.state_actor import get_state_actor

    password = redis_server.url.split(":")[2].split("@")[0]
    runs = ray_cluster.get(get_state_actor().get_train_runs.remote())
    assert cfg.run.name in repr(runs) and password not in repr(runs)

    records = queue.step_records()
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["batch_ids"] for r in records] == [[b.batch_id for b in batches[2 * s:2 * s + 2]] for s in range(6)]
    by_id = {b.batch_id: b for b in batches}
    reference = reference_train(load_model_weights(cfg.paths().init_weights),
                                [[by_id[i] for i in r["batch_ids"]] for r in records],
                                objectives_for(cfg.objectives, corpus.tokenizer()), cfg.trainer,
                                cfg.run.max_steps)
    redis_losses = [r["loss"] for r in records]
    reference_losses = [r.loss for r in reference]
    assert redis_losses == pytest.approx(reference_losses, rel=1e-4, abs=1e-5)
    assert reference_losses[-1] < reference_losses[0]
    counts = queue.counts()  # the final checkpoint (update 6) committed every batch
    assert counts["trained"] == 12 and counts["pending"] == 0 and counts["committed_step"] == 6
    assert counts.get("commit_conflicts", 0) == 0 and sum(c.trained for s in queue.committed_steps()
                                                           for c in queue.commits(s).values()) == 12


def board_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard log folder, read back the way TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_end_to_end_reindexes_and_resumes(ray_cluster, redis_server, small_corpus, tmp_path, caplog):
    from services.driver.pipeline import run_pipeline

    # version v is built from snapshot 6v and serves updates 6v+6 .. 6v+11 (batcher.index_lag = reindex_every)
    args = ("trainer.num_workers=2", "trainer.snapshot_every=6", "indexer.reindex_every=6",
            "trainer.checkpoint_every=12", "trainer.total_steps=null")  # annealing over run.max_steps
    caplog.set_level(logging.INFO, logger="marge.pipeline")
    summary = run_pipeline(small_config(tmp_path, small_corpus, redis_server.url, "e2e", "run.max_steps=24", *args))

    assert summary["steps"] == 24
    assert summary["index_versions_built"] >= 3 and len(summary["index_versions"]) >= 3
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25))
    assert [r["index_versions"] for r in records] == [[0]] * 12 + [[1]] * 6 + [[2]] * 6
    spec = read_spec(run_dir)  # what the run compiled its config to, as the stages were given it
    assert spec is not None and spec["slots"]["world"] == 2 and spec["version_plan"] == {"reindex_every": 6, "lag": 6}
    assert max(r["staleness_max"] for r in records) == 11 and records[-1]["snapshot_steps"] == [12]
    assert summary["batches_trained"] == 48 and summary["commit_conflicts"] == 0
    assert summary["batches_produced"] == (summary["batches_trained"] + summary["batches_pending"]
                                           + summary["batches_dead_lettered"])
    for key in ("tokens_per_s", "checkpoint", "snapshot", "batches_pending"):
        assert key in summary
    read_manifest(Path(summary["checkpoint"]))
    assert Path(summary["snapshot"]).name == "step-00000024"
    text = caplog.text
    assert "[indexer] v" in text and "[batcher] produced" in text and "[trainer] step" in text
    # each slow set-up phase is said, in order, before the first update's line
    at = [text.find(phase) for phase in ("[setup] corpus", "[setup] initial model", "[setup] Redis and Ray",
                                         "[setup] stages asked of Ray", "[trainer] step")]
    assert -1 not in at and at == sorted(at), at
    # the run ends with g's health: the trained g against the same model at initialisation, on held-out pairs
    g = summary["g_health"]
    assert g["snapshot_step"] == 24 and g["directions"] == 14 and g["initialisations"] == 3
    assert g["verdict"] in ("learning", "not above initialisation", "below initialisation", "collapsed")
    assert (g["warning"] is None) == (g["verdict"] == "learning") and 0 <= g["p_at_1_at_init"] <= 1
    lo, hi = g["difference_ci95"]
    assert lo <= g["difference"] <= hi
    assert g["verdict"] == "collapsed" or (g["verdict"] == "learning") == (lo > 0)
    assert f"[g] {g['verdict']} | held-out P@1 {g['p_at_1']:.3f} vs {g['p_at_1_at_init']:.3f}" in text
    # TensorBoard: every update from rank 0, every index version from the driver, the numbers of the logs
    trainer = board_scalars(run_dir / "tb" / "trainer")
    assert [s for s, _ in trainer["train/loss"]] == list(range(1, 25))
    assert [v for _, v in trainer["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"objectives/marge", "train/lr", "train/grad_norm", "train/beta", "train/wait_share"} <= set(trainer)
    assert [s for s, _ in trainer["health/aligned_evidence_gain"]] == [6, 12, 18, 24]
    index = board_scalars(run_dir / "tb" / "index")
    assert {s for s, _ in index["index/crosslingual_parallel_precision"]} >= {0, 6, 12}
    assert {"index/crosslingual_link_precision", "index/seconds", "index/crosslingual_share"} <= set(index)

    # the same run submitted again with a higher step budget resumes from its checkpoint
    resumed = run_pipeline(small_config(tmp_path, small_corpus, redis_server.url, "e2e", "run.max_steps=30", *args))
    assert resumed["steps"] == 30
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    trained = [b for r in records for b in r["batch_ids"]]
    assert len(trained) == len(set(trained)) == 60
    assert resumed["resumed_from_step"] == 24 and resumed["batches_trained"] == 60
    assert "run.max_steps 24 -> 30 with trainer.total_steps unset: the learning rate now anneals" in caplog.text
    # what it trains may not change on a resume: refused, naming the difference, before anything starts
    from marge.contracts.config import ConfigError

    with pytest.raises(ConfigError, match=r"with settings it was not trained with: trainer\.lr: 0\.002 -> 0\.001\. Put"):
        run_pipeline(small_config(tmp_path, small_corpus, redis_server.url, "e2e", "run.max_steps=36", *args,
                                  "trainer.lr=1e-3"))
    assert [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()][-1] == 30


@pytest.mark.slow
def test_learning_experiment_writes_a_complete_report(ray_cluster, redis_server, small_corpus, few_pairs, tmp_path,
                                                     capsys):
    from experiments.learning.harness import run_learning_experiment
    from services.cli import main

    pairs = few_pairs
    cfg = small_config(tmp_path, small_corpus, redis_server.url, "learning", "run.max_steps=12",
                       "trainer.num_workers=2", "trainer.snapshot_every=6", "indexer.reindex_every=6",
                       "trainer.checkpoint_every=6", f"data.heldout_pairs={pairs}", "health.external_probes=true", "health.probe_size=4",
                       "health.pairs_per_language=4", "objectives.denoising_contrastive={weight: 0.3}",
                       "model.relevance_pooling=mean")

    report = run_learning_experiment(cfg, minutes=5, out_dir=tmp_path / "out")

    assert json.loads((tmp_path / "out/report.json").read_text()) == report
    assert (tmp_path / "out/curves.png").stat().st_size > 0
    directions = set(report["p_at_1"]["tfidf"])
    assert len(directions) == 14
    for name in ("trained", "random_init"):
        assert set(report["p_at_1"][name]) == directions
        assert all(0.0 <= v <= 1.0 for v in report["p_at_1"][name].values())
    assert [r["step"] for r in report["p_at_1_over_time"]] == [6, 12]
    assert isinstance(report["evidence_gain"], float)
    assert {"evidence_gain", "relevance_gap", "g_spread", "copy_gain"} <= set(report["health"][-1])
    assert set(report["trained_by_layer"]) == {"0", "1", "2", "3", "g"}
    assert report["eval_layer"] == "g" and report["p_at_1"]["trained"] == report["trained_by_layer"]["g"]
    # the checkpoint it names is one `marge eval retrieval --checkpoint` accepts, and gives the same P@1
    assert main(["eval", "retrieval", "--pairs", str(pairs), "--checkpoint", report["checkpoint"], "--json",
                 "--layer", str(report["eval_layer"])]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == pytest.approx(report["p_at_1"]["trained"])


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["bart", "veco"])
def test_bart_and_veco_pretrain_through_the_same_pipeline_without_an_index(ray_cluster, redis_server, small_corpus,
                                                                           tmp_path, objective):
    """deploy/configs/tiny-{bart,veco}.yaml through the real pipeline: no indexer, document batches from the
    batcher, the objective's loss falling, every batch trained once, the checkpoint holding the right model."""
    from marge.model.restore import load_model
    from services.driver.pipeline import run_pipeline

    cfg = load_config(REPO / f"deploy/configs/tiny-{objective}.yaml", [
        f"run.name={objective}", f"run.dir={tmp_path / objective}", f"data.corpus={small_corpus}",
        "data.max_chunk_tokens=128", "model.max_positions=128", "batcher.max_tokens=400", f"redis.url={redis_server.url}",
        "run.progress_every_s=2", "run.max_steps=16", "trainer.checkpoint_every=8", "trainer.warmup_steps=2",
        "trainer.lr=2e-3", "health.external_probes=true"])  # the demo's held-out pages, not beside the corpus's input
    summary = run_pipeline(cfg)

    assert summary["steps"] == 16 and summary["objectives"] == [objective]
    assert summary["index_versions_built"] == 0 and summary["index_versions"] == []
    assert summary["capacity_plan"] is None
    assert summary["batches_trained"] == 32 and summary["commit_conflicts"] == 0
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert all(set(r["objectives"]) == {objective} and r["index_versions"] == [] for r in records)
    assert all(b.startswith("v0-e0-s") for r in records for b in r["batch_ids"])  # document batches, pass 0
    assert all(BatchId.parse(b).content for r in records for b in r["batch_ids"])  # each names its content
    assert np.mean([r["loss"] for r in records[-4:]]) < np.mean([r["loss"] for r in records[:4]])
    model = load_model(Path(summary["checkpoint"]))
    assert type(model).__name__ == ("Veco" if objective == "veco" else "Marge")
    assert not list((run_dir / "index").glob("v*"))


@pytest.mark.slow
def test_your_own_corpus_end_to_end_with_its_own_held_out_probes(ray_cluster, redis_server, demo_raw, tmp_path, caplog):
    """A corpus of one's own (three languages, written here) from `data.raw` through the pipeline, its probes and P@1
    from the held-out split `marge prepare` made of it, never the demo's files."""
    import gzip

    from services.driver.pipeline import run_pipeline

    rows = [json.loads(line) for line in gzip.open(demo_raw / "documents.jsonl.gz", "rt", encoding="utf-8")]
    short = sorted({r["group"] for r in rows if r["language"] == "en" and len(r["text"]) < 1500})[:60]
    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps({**r, "id": f"mine:{r['id']}"}, ensure_ascii=False) + "\n" for r in rows
                           if r["group"] in set(short) and r["language"] in ("en", "de", "fr")), encoding="utf-8")
    caplog.set_level(logging.INFO, logger="marge.pipeline")
    cfg = small_config(tmp_path, tmp_path / "prepared", redis_server.url, "mine", f"data.raw=[{own}]",
                       "data.vocab_size=1200", "data.heldout_permille=250", "data.heldout_pairs=null",
                       "health.documents=null", "data.languages=null", "run.max_steps=6", "trainer.snapshot_every=6",
                       "indexer.reindex_every=6", "trainer.checkpoint_every=6", "health.pairs_per_language=20")
    summary = run_pipeline(cfg)

    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["heldout"]["groups"] > 5 and manifest["heldout"]["pairs"] > 20 and set(manifest["languages"]) == {"en", "de", "fr"}
    heldout_groups = {json.loads(line)["group"] for line in
                      gzip.open(tmp_path / "prepared" / "heldout" / "documents.jsonl.gz", "rt", encoding="utf-8")}
    trained_groups = set()
    corpus = Corpus.open(tmp_path / "prepared")
    for s in range(corpus.num_shards):
        trained_groups |= set(corpus.read_shard(s).groups)
    assert heldout_groups and not heldout_groups & trained_groups  # held out of training, by group
    assert "evidence-gain probes: from the corpus's held-out split" in caplog.text
    assert "held-out retrieval P@1: from the corpus's held-out split" in caplog.text
    health = [json.loads(line)["health"] for line in (tmp_path / "mine" / "train_log.jsonl").read_text().splitlines()
              if "health" in json.loads(line)][0]
    assert health["aligned_targets"] == 8
    directions = {tuple(d.split("->")) for d in health["p_at_1"]}  # both ways between every two of its languages
    assert directions == {(a, b) for a in ("en", "de", "fr") for b in ("en", "de", "fr") if a != b}
    assert summary["g_health"]["directions"] == len(health["p_at_1"]) == 6
