"""The unit tier's guard (tests/unit/conftest.py): no server starts there, and no process outlives its test."""

from __future__ import annotations

import sys

import psutil

SERVERS = ("redis-server", "gcs_server", "raylet", "uvicorn")
"""What a server start runs, whoever starts it: LocalRedis, `ray.init` (it spawns the GCS and a raylet), the API."""

refused: list[str] = []
"""Server starts refused since the current test began: a test that caught the refusal still fails."""


def guarded_popen_init(original):
    """`subprocess.Popen.__init__` that refuses to run a server."""

    def init(self, args, *rest, **kwargs):
        line = str(args if isinstance(args, (str, bytes)) else " ".join(map(str, args)))
        named = next((name for name in SERVERS if name in line), None)
        if named:
            refused.append(f"{named}: {line[:160]}")
            raise AssertionError(f"the unit tier starts no server, and this test started {named} ({line[:160]}): "
                                 "it belongs in tests/integration")
        original(self, args, *rest, **kwargs)

    return init


def problems() -> list[str]:
    """What the test that just ended left wrong: a server start, a Ray connection, a process still running."""
    out = [f"started a server: {line}" for line in refused]
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        out.append("connected to Ray")
    for child in psutil.Process().children(recursive=True):
        try:
            out.append(f"left a process running: {' '.join(child.cmdline())[:160]}")
        except psutil.Error:  # it ended while we looked
            continue
    return out
