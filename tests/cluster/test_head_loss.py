"""Losing the Ray head mid-run, as a lost head pod loses it: every process the head started (GCS, raylet, dashboard,
the job supervisor, the job's driver, the trainer ranks, the indexer and the batch builders: this cluster is one
node) SIGKILLed at once, the queue's redis-server and the shared run folder surviving outside it. A new head starts
on the same port, knowing nothing of the old one (no GCS fault tolerance), and the same job is submitted again, as
a RayJob's `backoffLimit` does (deploy/kuberay/rayjob.yaml): the run resumes from its newest checkpoint, trains the
updates after it again with the same batches, and `marge audit` finds nothing lost and nothing trained twice.

The cluster runs in its own session and temp dir and every process is stopped by PID (never `ray stop`), also when
the test fails half-way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from processes import pids_in_session  # tests/processes.py

from marge.model.checkpoint import complete_checkpoints, read_manifest
from marge.util.local_ray import LOCAL_RAY_ENV, process_tree, read_stat
from services.driver.redis_server import LocalRedis, free_port

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RUN = "headloss"
STEPS = 24
CHECKPOINT_EVERY = 6


class Heads:
    """`ray start --head --block` processes on one GCS and dashboard port, one after another, and every process
    they started (remembered with its start time, so that a reused pid is never signalled)."""

    def __init__(self, temp: Path, env: dict[str, str], redis: LocalRedis):
        self.temp, self.env, self.redis = temp, env, redis
        # every fixed port of the head chosen free: Ray's default for the dashboard agent (52365) is one port for
        # every cluster on the machine, and a second cluster's agent that finds it taken takes no jobs
        self.gcs_port, self.dashboard_port, self.agent_port = free_port(), free_port(), free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.started: list[subprocess.Popen] = []
        self.seen: dict[int, int] = {}  # pid -> start time of every process a head started

    def start(self, timeout_s: float = 120) -> subprocess.Popen:
        head = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
             f"--dashboard-agent-listen-port={self.agent_port}",
             "--num-cpus=4", f"--temp-dir={self.temp / f'ray{len(self.started)}'}", "--include-dashboard=true",
             "--disable-usage-stats"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.started.append(head)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if head.poll() is not None:
                raise RuntimeError(f"`ray start --head` on port {self.gcs_port} exited with {head.returncode}")
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return head
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"the dashboard of the head on port {self.gcs_port} did not answer in {timeout_s} s")

    def processes(self, head: subprocess.Popen) -> dict[int, int]:
        """The head and every live process it started: its descendants (the job's driver among them: Ray runs it in
        a session of its own) and its session (children whose parent died)."""
        tree = process_tree({head.pid}, include_roots=True)
        for pid in pids_in_session(head.pid):
            stat = read_stat(pid)
            if stat is not None:
                tree[pid] = stat[1]
        self.seen.update(tree)
        return tree

    def alive(self, processes: dict[int, int]) -> list[int]:
        return [pid for pid, start in processes.items() if (read_stat(pid) or (0, None))[1] == start]

    def kill(self, processes: dict[int, int], sig: int) -> None:
        for pid in self.alive(processes):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        """SIGTERM every head and what it started, SIGKILL what is left after 20 s."""
        for head in self.started:
            self.processes(head)
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            self.kill(self.seen, sig)
            deadline = time.time() + wait_s
            while self.alive(self.seen) and time.time() < deadline:
                time.sleep(0.2)
        for head in self.started:
            head.wait(timeout=10)


@pytest.fixture
def heads():
    temp = Path(tempfile.mkdtemp(prefix="mh", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 bytes
    redis = LocalRedis(temp / "redis").start()  # the queue's Redis: its own pod in the deploy files, not the head
    url_file = temp / "redis-url"  # as the Secret mounted on every node: the password in no runtime env or argv
    url_file.touch(mode=0o600)
    url_file.write_text(redis.url + "\n")
    env = {**os.environ, **LOCAL_RAY_ENV, "MARGE_REDIS_URL_FILE": str(url_file),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    env.pop("MARGE_REDIS_URL", None)
    h = Heads(temp, env, redis)
    try:
        yield h
    finally:
        try:
            h.stop_all()
        finally:
            redis.stop()
            shutil.rmtree(temp, ignore_errors=True)
    assert not h.alive(h.seen), f"processes of the heads still running: {h.alive(h.seen)}"


def submit(heads: Heads, entrypoint: str, timeout_s: float = 180) -> str:
    """Submit with the shipped runtime env and the repository as working dir, retrying while the dashboard has no job
    agent yet (it starts after the dashboard answers: "No available agent to submit job, please try again later")."""
    from ray.job_submission import JobSubmissionClient

    runtime_env = {**yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text()), "working_dir": str(REPO)}
    client = JobSubmissionClient(heads.dashboard)
    deadline = time.time() + timeout_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as e:
            if "No available agent" not in str(e):
                raise
            if time.time() > deadline:
                logs = sorted(heads.temp.glob(f"ray{len(heads.started) - 1}/session_*/logs/dashboard_agent*"))
                tail = "\n".join(f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in logs)
                raise AssertionError(f"no job agent after {timeout_s} s; the agent's logs:\n{tail}") from e
            time.sleep(2)


def train_log(run_dir: Path) -> list[dict]:
    path = run_dir / "train_log.jsonl"
    records = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return records


def newest_checkpoint_step(run_dir: Path) -> int:
    done = complete_checkpoints(run_dir / "ray_train" / RUN)
    return read_manifest(done[-1], verify=False)["step"] if done else 0


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_a_lost_head_and_a_resubmitted_job_resume_from_the_newest_checkpoint_with_nothing_lost(
        heads, small_corpus, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    t0 = time.monotonic()
    run_dir = tmp_path / RUN
    entrypoint = " ".join([
        "marge pretrain --config deploy/configs/tiny.yaml", f"run.name={RUN}", f"run.dir={run_dir}",
        f"run.max_steps={STEPS}", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
        "model.max_positions=128", "batcher.max_tokens=400", "trainer.num_workers=2", "indexer.reindex_every=6",
        "trainer.snapshot_every=6", f"trainer.checkpoint_every={CHECKPOINT_EVERY}", "trainer.warmup_steps=2",
        "trainer.lr=2e-3", "run.progress_every_s=2", "health.probe_size=4", "health.aligned_probe_size=8",
        "faults.slow_update_s=0.5"])  # 0.5 s an update (the same batches): the kill lands between two checkpoints
    first = heads.start()
    job = submit(heads, entrypoint)

    # past the first checkpoint, and at least 3 updates beyond it (trained, never checkpointed)
    deadline = time.time() + 600
    while not (newest_checkpoint_step(run_dir) >= CHECKPOINT_EVERY
               and len(train_log(run_dir)) >= newest_checkpoint_step(run_dir) + 3):
        status = JobSubmissionClient(heads.dashboard).get_job_status(job)
        assert status in (JobStatus.PENDING, JobStatus.RUNNING), JobSubmissionClient(heads.dashboard).get_job_logs(job)[-4000:]
        assert time.time() < deadline, "the job did not train past its first checkpoint in 600 s"
        time.sleep(0.2)

    # the head pod is lost: everything it ran, at once
    victims = heads.processes(first)
    lock = json.loads((run_dir / "driver.lock").read_text())
    assert lock["pid"] in victims, (lock, sorted(victims))  # the job's driver ran on the head
    commands = " ".join(command_of(pid) for pid in victims)
    heads.kill(victims, signal.SIGKILL)
    killed_at = time.time()
    checkpoint_at_kill = newest_checkpoint_step(run_dir)
    before = {r["step"]: r["batch_ids"] for r in train_log(run_dir)}
    trained_at_kill = max(before)
    for part in ("gcs_server", "raylet", "dashboard", "marge pretrain", "ray::RayTrainWorker"):
        assert part in commands, f"no {part} among the head's processes"
    first.wait(timeout=30)
    deadline = time.time() + 30
    while heads.alive(victims) and time.time() < deadline:
        time.sleep(0.1)
    assert not heads.alive(victims), [command_of(p)[:80] for p in heads.alive(victims)]
    assert heads.redis.alive()  # the queue is outside the head
    assert trained_at_kill > checkpoint_at_kill >= CHECKPOINT_EVERY

    # a new head on the same port: a new cluster, with no record of the lost job (its GCS kept it in memory)
    heads.start()
    client = JobSubmissionClient(heads.dashboard)
    assert client.list_jobs() == []
    again = submit(heads, entrypoint)
    deadline = time.time() + 900
    while (status := client.get_job_status(again)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.time() < deadline, "the resubmitted job did not finish in 900 s"
        time.sleep(1)
    logs = client.get_job_logs(again)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]

    summary = json.loads([line for line in logs.splitlines() if line.startswith('{"steps"')][-1])
    assert summary["steps"] == STEPS and summary["resumed_from_step"] == checkpoint_at_kill, summary
    records = train_log(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the lost updates' lines are replaced
    # the updates after the checkpoint were trained again (after the kill), with the batches they had before it
    again_trained = [r["step"] for r in records if r["time"] > killed_at]
    assert again_trained == list(range(checkpoint_at_kill + 1, STEPS + 1)), again_trained
    assert {r["step"]: r["batch_ids"] for r in records if r["step"] <= trained_at_kill} == before

    audit = subprocess.run([str(VENV_BIN / "marge"), "audit", "--run", str(run_dir), "--json"], env=heads.env,
                           capture_output=True, text=True, timeout=120)
    result = json.loads(audit.stdout.strip().splitlines()[-1])
    assert audit.returncode == 0 and result["ok"], result
    assert (result["batches_lost"], result["trained_twice"], result["steps"]) == (0, 0, STEPS), result
    print("HEAD-LOSS " + json.dumps({
        "checkpoint_at_kill": checkpoint_at_kill, "trained_at_kill": trained_at_kill,
        "trained_again": trained_at_kill - checkpoint_at_kill, "processes_killed": len(victims),
        "recovery_s": round(min(r["time"] for r in records if r["time"] > killed_at) - killed_at, 1),
        "test_s": round(time.monotonic() - t0, 1), "audit": {k: result[k] for k in (
            "steps", "batches_trained", "batches_lost", "trained_twice")}}))
