"""`python -m experiments.learning --single-process` (`services.driver.single_process`): the stage cores in one process, without Ray, Redis or FAISS.

These need a server or take long; the quick tests of this subject are in tests/unit/test_single_process_checks.py (no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from single_process_inputs import WITHOUT_SERVICES, overrides

REPO = Path(__file__).resolve().parents[2]

# Run the study's module from the working tree (shared/ and the checkout on the import path, as
# scripts/marge_from_tree.py puts them) with Ray, Redis, FAISS and FastAPI made unimportable.


def losses(out: Path) -> list[tuple[int, float, list[str]]]:
    lines = (out / "run" / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    return [(r["step"], r["loss"], r["batch_ids"]) for r in map(json.loads, lines)]


@pytest.mark.slow
def test_two_resumed_chunks_equal_one_run_and_need_no_ray_redis_or_faiss(small_corpus, few_pairs, tmp_path):
    from services.driver.single_process import run_single_process

    args = overrides(small_corpus, few_pairs)
    chunked, whole = tmp_path / "chunked", tmp_path / "whole"
    cli = [sys.executable, "-c", WITHOUT_SERVICES, "experiments.learning", "--single-process", "--device", "cpu",
           "--minutes", "5", "--out", str(chunked)]
    first = subprocess.run([*cli, "--", *args, "run.max_steps=5"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["checkpoint"].endswith("step-00000005")
    second = subprocess.run([*cli, "--resume", "--", "run.max_steps=10"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step 5" in second.stderr

    report = run_single_process(None, [*args, "run.max_steps=10"], minutes=5, out_dir=whole, device="cpu")

    # the same updates on the same batches with the same losses, logged once: one run, one curve
    resumed, uninterrupted = losses(chunked), losses(whole)
    assert [s for s, _, _ in resumed] == list(range(1, 11)) == [s for s, _, _ in uninterrupted]
    assert [b for _, _, b in resumed] == [b for _, _, b in uninterrupted]
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in uninterrupted], rel=1e-5)
    chunked_report = json.loads((chunked / "report.json").read_text())
    assert [c["steps"] for c in chunked_report["chunks"]] == [5, 10]
    assert [p["step"] for p in chunked_report["p_at_1_over_time"]] == [3, 5, 6, 9, 10]
    assert [p["step"] for p in report["p_at_1_over_time"]] == [3, 6, 9, 10]
    assert [b["version"] for b in chunked_report["index_builds"]] == [0, 1, 2] == [b["version"] for b in report["index_builds"]]
    assert chunked_report["p_at_1"]["random_init"] == report["p_at_1"]["random_init"]  # baselines measured once, alike
    for name in ("trained", "random_init", "tfidf"):
        assert len(chunked_report["p_at_1"][name]) == 14
    assert chunked_report["mode"] == "single-process" and chunked_report["device"].startswith("cpu")
    assert (chunked / "curves.png").stat().st_size > 0
    index = json.loads((chunked / "run" / "index" / "LATEST").read_text())
    manifest = json.loads((chunked / "run" / "index" / index["dir"] / "manifest.json").read_text())
    assert manifest["search"] == "torch-exact" and all(s["index_file"] is None for s in manifest["shards"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", [(), ("trainer.bf16=true", "trainer.bf16_params=true")], ids=["fp32", "bf16_params"])
def test_single_process_losses_equal_the_ddp_trainers_on_the_same_batches(ray_cluster, small_corpus, few_pairs, tmp_path,
                                                                           precision):
    """The same batches through the pipeline's trainer loop (2 DDP ranks on Ray Train, fed from memory) give the
    single process's per-step losses: self-evidence and the denoising loss included. With bf16 parameters the
    ranks' gradients are all-reduced in fp32 and the single process adds its two batches' in bf16, so only the
    first update's loss (before any step) is the same to the bit; it is not fp32's (7.617829 against 7.617779 on
    this corpus): the ranks computed in bf16."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import read_version, version_dirname
    from services.batcher.core import DocumentStore, epoch_batches
    from services.driver.config import load_config
    from services.driver.pipeline import make_trainer
    from services.driver.single_process import run_single_process
    from services.driver.spec import compile_spec
    from services.trainer.init import ensure_initial_model

    args = overrides(small_corpus, few_pairs, "trainer.num_workers=2", "run.max_steps=6", "trainer.snapshot_every=100",
                     "indexer.reindex_every=100", "trainer.checkpoint_every=100",
                     "objectives.self_evidence={prob: 0.5, until: 6}",
                     "objectives.denoising_contrastive={weight: 0.3, extra_documents: 4}", *precision)
    run_single_process(REPO / "deploy/configs/learning.yaml", args, minutes=5, out_dir=tmp_path / "single", device="cpu")
    single = losses(tmp_path / "single")
    assert len(single) == 6 and all(len(b) == 2 for _, _, b in single)  # two batches per update: the ranks' slots

    cfg = load_config(REPO / "deploy/configs/learning.yaml", [*args, "run.name=ddp", f"run.dir={tmp_path / 'ddp'}",
                                                              f"faults.trace_collectives={tmp_path / 'trace'}"])
    corpus = Corpus.open(small_corpus)
    ensure_initial_model(cfg.model_config(corpus.tokenizer().vocab_size), cfg.paths(), corpus, cfg.run.seed)  # seeded
    index = read_version(tmp_path / "single" / "run" / "index" / version_dirname(0))
    by_id = {b.batch_id: b for epoch in range(3)
             for b in epoch_batches(index, DocumentStore(corpus), cfg.batcher, epoch, cfg.run.seed,
                                    shape=cfg.batch_shape())}  # the batcher's shape: the denoising loss's negatives
    per_rank = [[by_id[ids[rank]] for _, _, ids in single] for rank in range(2)]  # slot = rank on the DDP side
    make_trainer(cfg, compile_spec(cfg).trainer_job(None, memory_batches=per_rank)).fit()

    ddp = [json.loads(line) for line in (tmp_path / "ddp" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ddp] == [s for s, _, _ in single]
    assert [r["batch_ids"] for r in ddp] == [b for _, _, b in single]
    assert ddp[0]["loss"] == single[0][1]  # the same weights read the same batch: no update yet
    assert [r["loss"] for r in ddp] == pytest.approx([loss for _, loss, _ in single], rel=1e-4, abs=1e-5)
    assert np.isfinite([loss for _, loss, _ in single]).all()

    # every collective the ranks called: each tensor on the rank's model device (on GPUs: CUDA tensors for NCCL,
    # never a CPU tensor an NCCL-only group would refuse), objects gathered through a group with a CPU backend
    from services.trainer.rank import process_group_backend

    for rank in range(2):
        calls = [json.loads(line) for line in (tmp_path / "trace" / f"rank-{rank}.jsonl").read_text().splitlines()]
        assert {"all_reduce", "all_gather_object", "barrier"} <= {c["name"] for c in calls}
        assert all(c["backend"] == process_group_backend(use_gpu=False) for c in calls)
        assert all(set(c["tensor_devices"]) <= {c["model_device"]} for c in calls)
        assert sum(c["name"] == "all_reduce" for c in calls) >= 6  # every update agrees readiness and statistics


@pytest.mark.slow
def test_bf16_params_resume_to_the_uninterrupted_run_and_publish_fp32(small_corpus, few_pairs, tmp_path):
    """`trainer.bf16_params` through the single process: a run cut at its checkpoint and resumed (the restore writes
    the fp32 parameters, then they become the masters) trains the uninterrupted run's losses to the bit, and what
    it publishes (g's snapshots, checkpoints) is fp32."""
    from safetensors import safe_open

    from services.driver.single_process import run_single_process

    args = overrides(small_corpus, few_pairs, "trainer.bf16=true", "trainer.bf16_params=true")
    chunked, whole = tmp_path / "chunked", tmp_path / "whole"
    run_single_process(None, [*args, "run.max_steps=3"], minutes=5, out_dir=chunked, device="cpu")
    run_single_process(None, ["run.max_steps=5"], minutes=5, out_dir=chunked, device="cpu", resume=True)
    run_single_process(None, [*args, "run.max_steps=5"], minutes=5, out_dir=whole, device="cpu")
    resumed, uninterrupted = losses(chunked), losses(whole)
    assert [s for s, _, _ in resumed] == list(range(1, 6)) == [s for s, _, _ in uninterrupted]
    assert [loss for _, loss, _ in resumed] == [loss for _, loss, _ in uninterrupted]
    published = sorted((chunked / "run").rglob("*.safetensors"))
    assert published
    for path in published:
        with safe_open(str(path), "pt") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} <= {"F32", "I64"}, path
