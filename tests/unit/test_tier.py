"""The unit tier's own guard works: a server start is refused and reported (tests/unit/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import no_servers  # tests/no_servers.py
import pytest


def test_a_redis_server_or_a_ray_start_is_refused_and_other_programs_run():
    for argv in (["redis-server", "--port", "0"], [sys.executable, "-m", "ray.core.src.ray.gcs.gcs_server"]):
        with pytest.raises(AssertionError, match="starts no server"):
            subprocess.Popen(argv)
    assert len(no_servers.refused) == 2 and no_servers.problems()
    no_servers.refused.clear()  # refused on purpose: the guard's after-test check must not fail this test
    # a program that is no server runs
    assert subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True).stdout == "ok\n"
