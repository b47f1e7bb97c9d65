"""The unit tier starts no server: no redis-server, no Ray, no uvicorn, and no process outlives its test. A test that
needs a server belongs in tests/integration; this file makes the tier say so instead of quietly growing slow."""

from __future__ import annotations

import subprocess

import no_servers  # tests/no_servers.py
import pytest


@pytest.fixture(scope="session", autouse=True)
def servers_refused():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", no_servers.guarded_popen_init(subprocess.Popen.__init__))
        yield


@pytest.fixture(autouse=True)
def nothing_started_or_left():
    no_servers.refused.clear()
    yield
    problems = no_servers.problems()
    assert not problems, f"the unit tier starts no server and leaves no process: this test {problems}"


@pytest.fixture(scope="session")
def ray_cluster():
    pytest.fail("the unit tier starts no server: a test asking for ray_cluster belongs in tests/integration")


@pytest.fixture
def redis_server():
    pytest.fail("the unit tier starts no server: a test asking for redis_server belongs in tests/integration")
