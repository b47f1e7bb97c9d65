"""The fault tests' choice of victims (tests/processes.py `pids_with_title`): only the test's own processes of a
title, never another run's of the same title on the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/processes.py, as the cluster tier imports it

from processes import pids_with_title  # noqa: E402

TITLE = "ray::MargeTitleProbe"


def wait_for(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the probe processes did not appear in time")
        time.sleep(0.05)


def test_only_this_tests_own_processes_of_a_title_are_chosen(tmp_path):
    """A process of the title that this test started is chosen; one of the same title started elsewhere (here: an
    orphan, its parent gone, as another run's worker would be) is not."""
    own = subprocess.Popen(["bash", "-c", f'exec -a "{TITLE}" sleep 60'])
    orphan_pid_file = tmp_path / "orphan.pid"
    subprocess.run(["bash", "-c", f'(exec -a "{TITLE}" sleep 60) & echo $! > {orphan_pid_file}'], check=True)
    orphan = int(orphan_pid_file.read_text())
    try:
        wait_for(lambda: Path(f"/proc/{own.pid}/cmdline").read_bytes().startswith(TITLE.encode())
                 and Path(f"/proc/{orphan}/cmdline").read_bytes().startswith(TITLE.encode()))
        chosen = pids_with_title(TITLE)
        assert own.pid in chosen
        assert orphan not in chosen, "a process of the same title that is not this test's was chosen"
        assert orphan in pids_with_title(TITLE, root=1)  # it is there: chosen when every process counts
    finally:
        own.kill()
        own.wait()
        os.kill(orphan, signal.SIGKILL)
