"""What a resumed run may not change (`services.driver.config.config_drift`): a setting added to the code since the
run was started is absent from its saved config.yaml and counts as the default the run trained with, so upgrading
never refuses a resume by itself; a changed value, or a key added where no schema describes it, is still refused."""

from __future__ import annotations

from pathlib import Path

from services.driver.config import MISSING, config_drift, default_setting, load_config

REPO = Path(__file__).resolve().parents[2]


def saved_and_new(small_corpus, *overrides: str) -> tuple[dict, dict]:
    cfg = load_config(REPO / "deploy/configs/tiny.yaml", [f"data.corpus={small_corpus}", *overrides])
    return cfg.to_saved_dict(), cfg.to_saved_dict()


def test_a_setting_the_saved_config_lacks_counts_as_its_default(small_corpus):
    saved, new = saved_and_new(small_corpus)
    assert config_drift(saved, new) == []
    for section, key in (("objectives", "imports"), ("trainer", "bf16_params"), ("trainer", "unpadded")):
        del saved[section][key]  # written before the setting existed
    assert config_drift(saved, new) == []


def test_a_changed_or_unknown_setting_is_still_drift(small_corpus):
    saved, _ = saved_and_new(small_corpus)
    _, new = saved_and_new(small_corpus, "trainer.bf16=true", "trainer.bf16_params=true")
    del saved["trainer"]["bf16_params"]  # absent, and not its default in the new run
    assert config_drift(saved, new) == ["trainer.bf16: False -> True", "trainer.bf16_params: None -> True"]
    new["objectives"]["registered"] = {"spread": {"weight": 1.0}}  # a mapping no schema describes: a change
    assert "objectives.registered.spread.weight: None -> 1.0" in config_drift(saved, new)


def test_defaults_are_read_from_the_sections_as_the_saved_config_writes_them():
    assert default_setting("objectives.imports") == [] and default_setting("trainer.bf16_params") is False
    assert default_setting("objectives.registered.spread.weight") is MISSING
    assert default_setting("trainer.no_such_key") is MISSING
    assert default_setting("objectives.denoising_contrastive.weight") is MISSING  # required in its section
