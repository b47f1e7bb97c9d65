"""When Ray cannot start, schedule or keep a stage, `marge pretrain` ends with one line on stderr that names the
stage, the likely cause and what to try, stops what it started (Ray's processes, its redis-server) and exits
non-zero. Each failure is provoked for real: a stage asking for what no node offers, a raylet that never
registers, an actor killed while it starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import pids_in_session

REPO = Path(__file__).resolve().parents[2]


def run_args(small_corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", "--config", str(REPO / "deploy/configs/tiny.yaml"), f"run.dir={run_dir}",
            f"run.name={run_dir.name}", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
            "model.max_positions=128", "batcher.max_tokens=400", "health.aligned_probe_size=8",
            "run.progress_every_s=1", "run.max_steps=1000", *extra]


def processes_naming(folder: Path) -> list[str]:
    """Live processes whose command line or working folder is inside `folder` (a run's redis-server runs in its own
    session, so the session check alone would not see it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(folder) in cmdline or cwd.startswith(str(folder)):
            found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def run_marge(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout_s: float = 240):
    """`marge ARGS` in a session of its own; killed with its session if it outlives `timeout_s` (the test fails)."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for found in processes_naming(tmp_path):  # its redis-server, in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(found.split(":")[0]), signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"marge {args[0]} still ran after {timeout_s:g} s: {err[-2000:]}")
    deadline = time.time() + 10  # processes a clean exit stopped may take a moment to be reaped
    while (pids_in_session(proc.pid) or processes_naming(tmp_path)) and time.time() < deadline:
        time.sleep(0.2)
    assert pids_in_session(proc.pid) == [], "processes of the run's session left behind"
    assert processes_naming(tmp_path) == []
    return proc.returncode, out, err


def one_error_line(err: str, command: str = "pretrain") -> str:
    errors = [line for line in err.splitlines() if line.startswith(f"marge {command}: error: ")]
    assert len(errors) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return errors[0]


def test_a_stage_asking_for_resources_no_node_offers_is_refused_before_anything_starts(small_corpus, tmp_path):
    """A local Ray offers no custom resources: an indexer that asks for one would wait for ever, never scheduled."""
    code, _, err = run_marge(run_args(small_corpus, tmp_path / "run", "indexer.resources={marge_indexer: 1}"),
                             tmp_path, timeout_s=120)
    line = one_error_line(err)
    assert code == 2
    assert "indexer.resources asks for {'marge_indexer': 1.0} per worker, which a local Ray does not offer" in line
    assert "set indexer.resources={}" in line
    assert "starting a local Ray" not in err and not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_a_raylet_that_never_registers_ends_the_run_in_one_line_and_leaves_nothing(small_corpus, tmp_path):
    """Ray's own wait for its node (30 s, "The current node timed out during startup"), provoked by starting the
    raylet under a `valgrind` that never runs it (Ray's RAY_RAYLET_VALGRIND): what a machine too loaded for the
    raylet to register looks like to the driver."""
    wrapper = tmp_path / "bin"
    wrapper.mkdir()
    (wrapper / "valgrind").write_text("#!/bin/sh\nexec sleep 600\n")
    (wrapper / "valgrind").chmod(0o755)
    code, _, err = run_marge(run_args(small_corpus, tmp_path / "run"), tmp_path, timeout_s=300,
                             env={"RAY_RAYLET_VALGRIND": "1", "PATH": f"{wrapper}:{os.environ['PATH']}"})
    line = one_error_line(err)
    assert code == 1
    assert "a local Ray did not start: its node did not register within Ray's 30 s" in line
    assert "too loaded" in line and "ray.address" in line


@pytest.mark.slow
def test_a_stage_actor_killed_while_it_starts_ends_the_run_in_one_line(ray_cluster, small_corpus, tmp_path, capsys):
    """The batcher's actor killed for good (no restart) as soon as it exists: Ray's ActorDiedError, which the
    driver sees through the stage's `run`, becomes one line naming the batcher; the run's redis-server stops."""
    import ray

    from services.cli import main

    run_dir = tmp_path / "run"
    killed = threading.Event()

    def kill_the_batcher() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not killed.is_set():
            try:
                actor = ray.get_actor("marge-batcher-0", namespace=f"marge-{run_dir.name}")
            except ValueError:
                time.sleep(0.05)
                continue
            ray.kill(actor, no_restart=True)
            killed.set()

    killer = threading.Thread(target=kill_the_batcher, daemon=True)
    killer.start()
    code = main(run_args(small_corpus, run_dir))
    killed.set()
    killer.join(timeout=5)
    err = capsys.readouterr().err
    line = one_error_line(err)
    assert code == 1
    assert line.startswith("marge pretrain: error: the batcher stage's actor died (")
    assert "start the run again to resume it" in line
    assert processes_naming(tmp_path) == []  # the run's redis-server


@pytest.mark.slow
def test_a_stage_that_stops_answering_ends_the_run_in_one_line(ray_cluster, small_corpus, tmp_path, capsys,
                                                               monkeypatch):
    """The batcher's process stopped (SIGSTOP: alive, so Ray restarts nothing, and silent): after
    MARGE_STAGE_SILENCE_LIMIT_S of unanswered progress reports the run ends with a line naming the batcher,
    instead of a warning every report until `run.max_minutes`."""
    from processes import pids_with_title

    from services.cli import main

    monkeypatch.setenv("MARGE_STAGE_SILENCE_LIMIT_S", "8")
    stopped: list[int] = []

    def stop_the_batcher() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not stopped:
            pids = pids_with_title("ray::Batcher")
            if pids:
                os.kill(pids[0], signal.SIGSTOP)
                stopped.append(pids[0])
            time.sleep(0.2)

    stopper = threading.Thread(target=stop_the_batcher, daemon=True)
    stopper.start()
    try:
        started = time.time()
        code = main(run_args(small_corpus, tmp_path / "run", "run.max_minutes=3"))
        took = time.time() - started
    finally:
        for pid in stopped:  # killed with the run's actors; resumed in case it was not
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    err = capsys.readouterr().err
    line = one_error_line(err)
    assert stopped and code == 1, err[-3000:]
    assert line.startswith("marge pretrain: error: the batcher stage did not answer for ")
    assert "MARGE_STAGE_SILENCE_LIMIT_S" in line and "start the run again to resume it" in line
    assert took < 150  # not run.max_minutes
    assert processes_naming(tmp_path) == []
