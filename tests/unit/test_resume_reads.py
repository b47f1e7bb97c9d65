"""What a (re)started run reads of its checkpoint before the ranks restore it: the driver hashes every part of the
checkpoint it resumes from once (`resume_checkpoint`), not once to check the config and again to choose it."""

from __future__ import annotations

from pathlib import Path

import yaml
from tiny_training import stand_in_tokenizer, tiny_training  # tests/tiny_training.py

import marge.model.checkpoint as checkpoint_module
from marge.model.checkpoint import CheckpointWrite
from services.driver.config import load_config
from services.driver.pipeline import resume_checkpoint


def test_the_driver_hashes_the_checkpoint_it_resumes_from_once(tmp_path: Path, monkeypatch):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    paths = cfg.paths()
    paths.run_dir.mkdir(parents=True)
    (paths.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_saved_dict(), sort_keys=False))
    written = CheckpointWrite(paths.checkpoints / "step-00000002", *tiny_training(), 2,
                              stand_in_tokenizer(tmp_path / "tok"), {"tokens_seen": 7}).wait()
    hashed: list[Path] = []
    verify = checkpoint_module.verify_state_tensors
    monkeypatch.setattr(checkpoint_module, "verify_state_tensors",
                        lambda directory, manifest, **kw: (hashed.append(Path(directory)), verify(directory, manifest,
                                                                                                  **kw)))
    assert resume_checkpoint(cfg, paths) == written
    assert hashed == [written]
