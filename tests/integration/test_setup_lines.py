"""What a user sees before the first update: a `[setup]` line as each slow set-up phase starts and ends (the corpus,
the initial model, the baselines, the model and optimizer, the first index with its docs/s), in order."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from single_process_inputs import overrides

REPO = Path(__file__).resolve().parents[2]


def test_single_process_says_each_set_up_phase_before_the_first_update(small_corpus, few_pairs, tmp_path, caplog):
    from services.driver.config import load_config
    from services.driver.single_process import pretrain_single_process

    cfg = load_config(REPO / "deploy/configs/learning.yaml",
                      overrides(small_corpus, few_pairs, f"run.dir={tmp_path / 'run'}", "run.max_steps=2",
                                "run.progress_every_s=0.001"))
    with caplog.at_level(logging.INFO):
        pretrain_single_process(cfg, "cpu")
    lines = [r.getMessage() for r in caplog.records]
    ended = [re.compile(r"^\[setup\] corpus .*: \d+ documents in \d+ languages, \d+ shards \| \d+"),
             re.compile(r"^\[setup\] initial model: .* \| \d+"),
             re.compile(r"^\[setup\] baselines on \d+ held-out pairs .* \| \d+"),
             re.compile(r"^\[setup\] model and optimizer on cpu.*: [\d.]+M parameters \| \d+"),
             re.compile(r"^\[setup\] index v0 from snapshot 0 \(\d+ documents\): \d+ docs/s \| \d+"),
             re.compile(r"^step 1 \| loss ")]
    where = [next((i for i, line in enumerate(lines) if pattern.search(line)), None) for pattern in ended]
    assert None not in where, [p.pattern for p, i in zip(ended, where) if i is None]
    assert where == sorted(where), lines
    began = ["[setup] corpus ", "[setup] initial model ", "[setup] baselines on ", "[setup] model and optimizer on ",
             "[setup] index v0 from snapshot 0 "]
    for prefix, end in zip(began, where):  # each phase also said when it began, before it ended
        assert any(line.startswith(prefix) and line.endswith(" ...") for line in lines[:end]), prefix
