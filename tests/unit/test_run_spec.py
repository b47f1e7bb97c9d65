"""A run's spec (`services.driver.spec`): the config compiled once, each stage's slice taken from it, and spec.json as
what the run trained with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from services.driver.config import load_config
from services.driver.spec import SPEC_FILE, compile_spec, read_spec
from services.ops.config_reference import field_docs
from services.trainer.config import TrainerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def config(tmp_path: Path, *overrides: str):
    return load_config(DEPLOY / "tiny.yaml", [f"run.dir={tmp_path / 'run'}", "trainer.num_workers=4",
                                              "trainer.grad_accum=2", "batcher.builders=2",
                                              "redis.url=redis://:secret@127.0.0.1:6390/0", *overrides])


def test_every_stage_takes_the_facts_the_spec_compiled(tmp_path):
    spec = compile_spec(config(tmp_path), vocab_size=1234)
    assert (spec.slots.world, spec.slots.grad_accum, spec.slots.builders) == (4, 2, 2)
    assert spec.model.vocab_size == spec.vocab_size == 1234  # the tokenizer's, not data.vocab_size
    trainer = spec.trainer_job(None)
    builders = [spec.batcher_job("url-file", group) for group in range(spec.slots.builders)]
    assert trainer.slots is spec.slots and all(b.slots is spec.slots for b in builders)
    assert all(b.plan is spec.version_plan and b.shape is spec.batch_shape for b in builders)
    assert [b.group for b in builders] == [0, 1]
    assert trainer.paths == spec.paths == builders[0].paths


def test_without_a_vocabulary_the_model_takes_the_configs(tmp_path):
    cfg = config(tmp_path)
    assert compile_spec(cfg).vocab_size == cfg.data.vocab_size
    assert compile_spec(config(tmp_path, "model.vocab_size=999")).vocab_size == 999


def test_spec_json_says_what_the_run_compiled_to_and_no_secret(tmp_path):
    spec = compile_spec(config(tmp_path, "trainer.key_bias=mask"), vocab_size=1234)
    path = spec.write()
    assert path == tmp_path / "run" / SPEC_FILE and not list(path.parent.glob("*.tmp*"))
    saved = read_spec(path.parent)
    assert saved == json.loads(json.dumps(spec.to_dict()))
    assert saved["slots"] == {"world": 4, "grad_accum": 2, "builders": 2, "per_step": 8}
    assert saved["model"] == dataclasses.asdict(spec.model)
    assert saved["execution"]["key_bias"] == "mask"
    assert saved["batch_shape"]["kind"] == "retrieval"
    assert "secret" not in path.read_text(encoding="utf-8")
    assert read_spec(tmp_path / "elsewhere") is None


def test_the_execution_block_is_every_execution_setting():
    """`TrainerConfig.EXECUTION` names exactly the settings whose documentation calls them execution settings, plus
    the precision and compile switches, whose documentation explains them at length instead."""
    documented = {name for name, doc in field_docs(TrainerConfig).items() if "An execution setting" in doc}
    assert documented <= set(TrainerConfig.EXECUTION)
    assert set(TrainerConfig.EXECUTION) - documented == {"bf16", "bf16_params", "prefetch", "compile"}
    assert all(hasattr(TrainerConfig(), name) for name in TrainerConfig.EXECUTION)
