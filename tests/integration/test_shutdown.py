"""A SIGTERM at any point of a run's start-up (`ray job stop`, `kill`, a CI time-out) leaves no process behind: the
driver stops the redis-server and the local Ray it started, whatever it was doing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
STARTED_BY_A_RUN = ("redis-server", "gcs_server", "raylet", "ray::", "default_worker", "dashboard", "log_monitor",
                    "runtime_env", "monitor.py")


def ray_and_redis_processes() -> dict[int, str]:
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if any(name in line for name in STARTED_BY_A_RUN):
            out[p.info["pid"]] = line[:160]
    return out


def descendants(pid: int) -> list[str]:
    """The command lines of `pid`'s descendants."""
    out = []
    try:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                out.append(" ".join(child.cmdline()))
            except psutil.Error:  # it ended while we looked
                continue
    except psutil.NoSuchProcess:
        pass
    return out


def descends_from(pid: int, ancestors: set[int]) -> bool:
    try:
        return any(parent.pid in ancestors for parent in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(("when", "then"), [("importing", None), ("redis-server pid", None),
                                            ("starting a local Ray", "agent"), ("[indexer]", None),
                                            ("[trainer] step", None)])
def test_a_sigterm_during_start_up_leaves_no_process_behind(small_corpus, tmp_path, when, then):
    """`then`: after the line, wait until a process of the run's own whose command line holds it is running: for
    "agent", `ray.init`'s raylet has started its agents (dashboard, runtime env), which a cut-short start once left
    running for a minute."""
    before = ray_and_redis_processes()  # the test session's own cluster keeps running: not this run's
    run_dir = tmp_path / "run"
    # "importing": python's own report of each import (-X importtime) says when the CLI is half-way through its
    # imports, whatever the machine's speed
    proc = subprocess.Popen(
        [sys.executable, *(["-X", "importtime"] if when == "importing" else []), "-m", "services.cli", "pretrain",
         "--config", str(REPO / "deploy/configs/tiny.yaml"),
         f"run.dir={run_dir}", "run.name=sigterm", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
         "model.max_positions=128", "batcher.max_tokens=400", "health.aligned_probe_size=8", "run.progress_every_s=1",
         "run.max_steps=1000"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        if when == "importing":
            for line in proc.stdout:  # the first module of the command line imported, the rest still to come
                seen.append(line)
                if line.startswith("import time:") and "services.cli." in line:
                    break
            assert proc.poll() is None, "".join(seen[-40:])
        else:
            deadline = time.time() + 240
            for line in proc.stdout:
                seen.append(line)
                if when in line:
                    break
                assert time.time() < deadline and proc.poll() is None, "".join(seen[-40:])
            while then and not any(then in line for line in descendants(proc.pid)):  # a phase seen, not a time
                assert time.time() < deadline and proc.poll() is None, f"no {then!r} process started: {seen[-40:]}"
                time.sleep(0.05)
        ours = {pid for pid in ray_and_redis_processes() if pid not in before}
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 or when == "importing", "".join(seen[-20:]) + rest[-3000:]
    if when != "importing":
        assert ours, f"nothing had started by {when!r}"
    deadline = time.time() + 20  # processes told to stop may take a moment to exit
    while True:
        left = {pid: line for pid, line in ray_and_redis_processes().items()
                if pid not in before and not descends_from(pid, set(before))}
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    assert left == {}, f"left behind after a SIGTERM at {when!r}: {left}"
    assert not (run_dir / "redis" / "redis-server.pid").exists()


def test_a_redis_server_the_driver_stopped_is_not_started_again_by_its_watchdog(tmp_path):
    from services.driver.redis_server import LocalRedis
    from services.driver.resources import RedisEndpoint

    server = LocalRedis(tmp_path / "redis").start()
    endpoint = RedisEndpoint(server.url, server)
    server.stop()
    endpoint.keep_alive()
    assert not server.alive() and endpoint.restarts == 0 and not server.pid_file.exists()


def test_a_sigterm_while_the_watchdog_starts_stops_the_watchdog(tmp_path, monkeypatch):
    """The handler's SystemExit raised inside `Thread.start` (which waits for the thread to run) once left the
    watchdog running after the driver stopped the server: it started a new one that outlived the run."""
    import threading

    from services.driver.redis_server import LocalRedis
    from services.driver.resources import RedisEndpoint

    real_start = threading.Thread.start
    started = []

    def start_then_sigterm(thread):
        real_start(thread)
        started.append(thread)
        raise SystemExit(128 + signal.SIGTERM)

    server = LocalRedis(tmp_path / "redis").start()
    endpoint = RedisEndpoint(server.url, server)
    try:
        monkeypatch.setattr(threading.Thread, "start", start_then_sigterm)
        with pytest.raises(SystemExit):
            with endpoint.watched(every_s=0.01):
                pass
        monkeypatch.undo()
        [watchdog] = started
        watchdog.join(timeout=5)
        assert watchdog.name == "redis-watchdog" and not watchdog.is_alive()
    finally:
        server.stop()
    assert not server.alive()


def test_a_sigterm_that_rays_start_swallows_still_reaches_the_programs_handler():
    """Ray's handlers during `ray.init` raise SystemExit wherever the main thread is, where Ray code may swallow
    it: the SIGTERM must still stop the program once Ray is up. A handler that does nothing stands in for Ray's
    swallowed one (a real ray.init cannot be made to swallow on cue)."""
    from marge.util.local_ray import keeping_sigterm_handler

    handled = []

    def programs_handler(signum, frame):
        handled.append(signum)
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, programs_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            with keeping_sigterm_handler():
                signal.signal(signal.SIGTERM, lambda signum, frame: None)  # what ray.init does, then eats the exit
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler runs at the next bytecode boundary
        assert stopped.value.code == 128 + signal.SIGTERM and handled == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is programs_handler
        with keeping_sigterm_handler():  # without a SIGTERM nothing is raised
            pass
        assert handled == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
