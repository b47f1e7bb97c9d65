"""A run folder belongs to the mode that wrote it (`services.driver.lock`): `--single-process` refuses the folder of a
Ray run that failed to start, the Ray driver refuses a single-process run's folder, each unless told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from single_process_inputs import overrides

REPO = Path(__file__).resolve().parents[2]


def failed_pipeline_folder(small_corpus, few_pairs, run_dir: Path, legacy: bool = False):
    """What a Ray run that died while Ray started leaves (`run_pipeline` up to `ray_for`): its lock, its config and
    its initial model. `legacy`: a lock file written before the lock recorded modes."""
    import yaml

    from marge.contracts.corpus import Corpus
    from services.driver.config import load_config, with_absolute_paths
    from services.driver.lock import DriverLock
    from services.trainer.init import ensure_initial_model

    cfg = with_absolute_paths(load_config(REPO / "deploy/configs/learning.yaml",
                                          overrides(small_corpus, few_pairs, f"run.dir={run_dir}")))
    corpus = Corpus.open(small_corpus)
    with DriverLock(run_dir):
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_saved_dict(), sort_keys=False))
        ensure_initial_model(cfg.model_config(vocab_size=corpus.tokenizer().vocab_size), cfg.paths(), corpus,
                             cfg.run.seed)
    if legacy:
        lock = run_dir / "driver.lock"
        lock.write_text(json.dumps({k: v for k, v in json.loads(lock.read_text()).items() if k != "mode"}) + "\n")
    return cfg


@pytest.mark.parametrize("legacy", [False, True])
def test_single_process_refuses_a_failed_ray_runs_folder_unless_told(small_corpus, few_pairs, tmp_path, legacy):
    import dataclasses

    from services.driver.lock import RunLocked, RunOfAnotherMode
    from services.driver.single_process import pretrain_single_process

    run_dir = tmp_path / "run"
    cfg = failed_pipeline_folder(small_corpus, few_pairs, run_dir, legacy)
    before = sorted(p.name for p in run_dir.iterdir())
    # a corpus that is not there: whatever gets past the folder check fails at once, instead of training
    elsewhere = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, corpus=str(tmp_path / "no-corpus"), raw=[]))
    with pytest.raises(RunOfAnotherMode, match=r"run.dir .*/run holds a run of `marge pretrain` on Ray: resume it "
                                               r"that way, choose another run.dir, or pass --reuse-folder") as refused:
        pretrain_single_process(elsewhere, "cpu")
    assert isinstance(refused.value, RunLocked)  # the command line's one-line errors
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written
    with pytest.raises(ValueError, match="no-corpus is not a prepared corpus"):  # told: past the folder check
        pretrain_single_process(elsewhere, "cpu", reuse_folder=True)
    assert json.loads((run_dir / "driver.lock").read_text())["mode"] == "single-process"


def test_the_ray_driver_refuses_a_single_process_folder_unless_told(tmp_path):
    from services.driver.lock import PIPELINE, SINGLE_PROCESS, DriverLock, RunOfAnotherMode, folder_mode

    fresh = tmp_path / "fresh"
    with DriverLock(fresh, SINGLE_PROCESS):  # a new folder is anyone's
        (fresh / "experiment.json").write_text('{"mode": "single-process", "chunks": []}')
    assert folder_mode(fresh) == SINGLE_PROCESS
    with pytest.raises(RunOfAnotherMode, match="holds a run of `marge pretrain --single-process`.*--reuse-folder"):
        DriverLock(fresh).acquire()
    with DriverLock(fresh, SINGLE_PROCESS):  # its own mode resumes it
        pass
    legacy = tmp_path / "legacy"  # written before the lock recorded modes: experiment.json says it
    legacy.mkdir()
    (legacy / "experiment.json").write_text('{"mode": "single-process", "chunks": []}')
    with pytest.raises(RunOfAnotherMode):
        DriverLock(legacy).acquire()
    with DriverLock(legacy, reuse_folder=True) as lock:
        assert json.loads(lock.path.read_text())["mode"] == PIPELINE
    assert folder_mode(legacy) == PIPELINE  # the folder is the pipeline's now


def test_the_command_line_says_it_in_one_line(small_corpus, few_pairs, tmp_path, capsys):
    from services.cli import main

    run_dir = tmp_path / "run"
    failed_pipeline_folder(small_corpus, few_pairs, run_dir)
    code = main(["pretrain", "--config", str(REPO / "deploy/configs/learning.yaml"), "--single-process", "--device",
                 "cpu", *overrides(small_corpus, few_pairs, f"run.dir={run_dir}", "run.max_steps=1")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds a run of `marge pretrain` on Ray" in err[0], err
