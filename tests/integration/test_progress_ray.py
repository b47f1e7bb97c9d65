"""Progress a user can see: bars on a terminal, log lines with an ETA elsewhere, an ETA on the pre-training line.

These need a server or take long; the quick tests of this subject are in tests/unit/test_progress.py (no server)."""

from __future__ import annotations

import logging
import time


def test_a_stage_that_does_not_answer_costs_a_progress_report_not_the_run(ray_cluster, caplog):
    """A batcher on a node that is cut off answers no stats call; the driver's progress report gives up on it after
    `answer_timeout_s` and says so, and the run goes on (the stage's own `run` says whether it failed for good)."""
    import ray

    from services.driver.progress import Progress as RunProgress
    from services.driver.progress import log_progress

    @ray.remote(num_cpus=0)
    class Unresponsive:
        def stats(self) -> dict:
            time.sleep(5)
            return {}

    run = RunProgress(max_steps=10, queue=None, coordinator=None, batchers=[Unresponsive.remote()])
    run.answer_timeout_s = 0.5
    with caplog.at_level(logging.WARNING, logger="marge.pipeline"):
        assert log_progress(run) is False
    assert "did not answer within 0.5 s (GetTimeoutError); the run goes on" in caplog.text
