"""Progress a user can see: bars on a terminal, log lines with an ETA elsewhere, an ETA on the pre-training line.

The tests of this subject that need a server or take long are in tests/integration/test_progress_ray.py."""

from __future__ import annotations

import logging
import time

import pytest

from marge.util.progress import Progress, eta_seconds, format_seconds, track


def test_durations_and_etas_read_as_a_person_says_them():
    assert [format_seconds(s) for s in (0, 4.4, 59.6, 245, 3600 + 180)] == ["0s", "4s", "1m00s", "4m05s", "1h03m"]
    assert eta_seconds(25, 100, 10.0) == pytest.approx(30.0)  # 25 done in 10 s: 75 left at 2.5/s
    assert eta_seconds(0, 100, 10.0) is None and eta_seconds(5, None, 1.0) is None


def test_without_a_terminal_a_loop_logs_its_progress_with_an_eta(monkeypatch, caplog):
    monkeypatch.setenv("MARGE_PROGRESS", "log")
    caplog.set_level(logging.INFO, logger="marge.progress")
    seen = list(track(range(4), "indexing v3", unit="shard", every_s=0.0))
    assert seen == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records if r.name == "marge.progress"]
    assert lines[0].startswith("indexing v3: 1/4 shard in ") and "ETA" in lines[0]
    assert lines[-1].startswith("indexing v3: 4/4 shard")


def test_progress_can_be_turned_off_and_a_bar_needs_no_log(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="marge.progress")
    monkeypatch.setenv("MARGE_PROGRESS", "off")
    with Progress("quiet", 3, every_s=0.0) as p:
        for _ in range(3):
            p.update()
    monkeypatch.setenv("MARGE_PROGRESS", "bar")
    with Progress("a bar", 2) as p:
        p.update(2)
        assert p.bar is not None and p.bar.n == 2
    assert not [r for r in caplog.records if r.name == "marge.progress"]


def test_the_pretraining_line_gives_the_eta_of_this_sessions_rate_or_of_the_deadline():
    from services.driver.progress import Progress as RunProgress

    run = RunProgress(max_steps=300, queue=None, coordinator=None, batchers=[], start_step=100)
    # 50 updates since the resumed update 100, in 25 s: 150 left at 2/s
    assert run.eta({"step": 150, "elapsed_s": 25.0}) == " | ETA 1m15s"
    assert run.eta({"step": 100, "elapsed_s": 0.0}) == ""  # no rate yet
    run.deadline_unix = time.time() + 30
    assert run.eta({"step": 150, "elapsed_s": 25.0}) in (" | ETA 30s", " | ETA 29s")  # run.max_minutes comes first


def test_a_joined_cluster_waits_on_silent_stages_unless_told_a_limit(monkeypatch):
    """An autoscaler may take longer than SILENCE_LIMIT_S to start the nodes a stage waits for: on a cluster the run
    joined (`ray.address`) silence ends the run only at MARGE_STAGE_SILENCE_LIMIT_S."""
    import math

    from services.driver.progress import SILENCE_LIMIT_S, stage_silence_limit_s

    monkeypatch.delenv("MARGE_STAGE_SILENCE_LIMIT_S", raising=False)
    assert stage_silence_limit_s(joined_cluster=False) == SILENCE_LIMIT_S
    assert stage_silence_limit_s(joined_cluster=True) == math.inf
    monkeypatch.setenv("MARGE_STAGE_SILENCE_LIMIT_S", "900")
    assert stage_silence_limit_s(joined_cluster=True) == stage_silence_limit_s(joined_cluster=False) == 900.0
