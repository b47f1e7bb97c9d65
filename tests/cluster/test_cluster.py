"""MARGE as its users run it: a real `ray start --head` cluster on loopback, the pipeline submitted as a Ray job
with the shipped runtime env and an external password-protected redis-server, the indexer pool scaled 1 -> 2 -> 1
with `marge scale` while the trainers train, and every stage's metrics scraped from the cluster's endpoint.

One job serves every check (a cluster start and a job cost about a minute on 2 cores). The cluster runs in its own
session and temp dir and is stopped by PID (never `ray stop`, which would stop every cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from processes import LOOPBACK, listening_addresses, pids_in_session  # tests/processes.py

from marge.util.local_ray import LOCAL_RAY_ENV
from services.driver.redis_server import LocalRedis, free_port

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RUN = "cluster"
STEPS = 80  # index versions v0 to v7: room after the shrink for a version built by one worker


@dataclass
class LoopbackCluster:
    process: subprocess.Popen
    gcs_address: str
    dashboard: str
    metrics_port: int
    redis: LocalRedis
    env: dict[str, str]
    scrapes: list[str] = field(default_factory=list)

    def wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("the Ray dashboard did not answer in time")

    def stop(self) -> None:
        """SIGTERM the head's session (ray start and everything it started), then SIGKILL what is left."""
        session = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            pids = pids_in_session(session)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait_s
            while pids_in_session(session) and time.time() < deadline:
                time.sleep(0.2)
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def loopback_cluster():
    temp = Path(tempfile.mkdtemp(prefix="mr", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 bytes
    redis = LocalRedis(temp / "redis").start()
    gcs, dashboard, metrics = free_port(), free_port(), free_port()
    url_file = temp / "redis-url"  # as a secret mounted on every node: the password is in no runtime_env or argv
    url_file.touch(mode=0o600)
    url_file.write_text(redis.url + "\n")
    env = {**os.environ, **LOCAL_RAY_ENV, "MARGE_REDIS_URL_FILE": str(url_file),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    env.pop("MARGE_REDIS_URL", None)
    process = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--metrics-export-port={metrics}",
         "--num-cpus=4", f"--temp-dir={temp / 'ray'}", "--include-dashboard=true", "--disable-usage-stats",
         # the dashboard agent's default port (52365) is taken while another local Ray runs: no job would be accepted
         f"--dashboard-agent-listen-port={free_port()}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    cluster = LoopbackCluster(process, f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", metrics, redis, env)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()
        redis.stop()
        shutil.rmtree(temp, ignore_errors=True)


def index_manifests(index_dir: Path, seen: dict[int, dict]) -> dict[int, dict]:
    """Every committed index version's manifest, remembered before older versions are pruned."""
    for path in index_dir.glob("*/manifest.json"):
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # pruned or being renamed right now
            continue
        seen.setdefault(manifest["version"], manifest)
    return seen


def marge_scale(cluster: LoopbackCluster, workers: int) -> dict:
    done = subprocess.run([str(VENV_BIN / "marge"), "scale", "--run", RUN, "--indexer-workers", str(workers),
                           "--address", cluster.gcs_address], env=cluster.env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def submit_when_an_agent_answers(client, entrypoint: str, runtime_env: dict, timeout_s: float = 300) -> str:
    """Submit, retrying while the dashboard has no job agent yet (it starts after the dashboard answers, later on a
    loaded machine: "No available agent to submit job, please try again later")."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.time() > deadline:
                raise
            time.sleep(2)


def scrape(cluster: LoopbackCluster) -> None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5) as r:
            cluster.scrapes.append(r.read().decode("utf-8", errors="replace"))
    except OSError:
        pass


@pytest.mark.slow
def test_a_submitted_job_trains_while_the_indexer_is_scaled_and_every_stage_reports_metrics(
        loopback_cluster, small_corpus, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    cluster = loopback_cluster
    run_dir = tmp_path / RUN
    runtime_env = {**yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text()), "working_dir": str(REPO)}
    entrypoint = " ".join([
        "marge pretrain --config deploy/configs/tiny.yaml", f"run.name={RUN}", f"run.dir={run_dir}",
        f"run.max_steps={STEPS}", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
        "model.max_positions=128", "batcher.max_tokens=400", "indexer.reindex_every=10",
        "trainer.snapshot_every=10", "trainer.checkpoint_every=30", "trainer.warmup_steps=2",
        "run.progress_every_s=2", "health.probe_size=4", "health.aligned_probe_size=8"])
    client = JobSubmissionClient(cluster.dashboard)
    job = submit_when_an_agent_answers(client, entrypoint, runtime_env)

    namespace = f"marge-{RUN}"
    stages_seen: set[str] = set()
    manifests: dict[int, dict] = {}
    scaled: list[tuple[int, int]] = []  # (workers asked for, first version it applies to)
    listening: list[tuple[str, int, str]] = []
    deadline = time.time() + 600
    while time.time() < deadline:
        status = client.get_job_status(job)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            break
        index_manifests(run_dir / "index", manifests)
        newest = max(manifests, default=-1)
        # 1 -> 2 once the first version is in, 2 -> 1 once a version was built by two workers: first in the loop,
        # since versions come seconds apart and a late request applies only after the run's last version
        if not scaled and newest >= 0:
            scaled.append((2, marge_scale(cluster, 2)["from_version"]))
        elif len(scaled) == 1 and any(m.get("indexer_workers") == 2 for m in manifests.values()):
            scaled.append((1, marge_scale(cluster, 1)["from_version"]))
        alive = list_actors(address=cluster.dashboard, filters=[("ray_namespace", "=", namespace),
                                                                 ("state", "=", "ALIVE")], raise_on_missing_output=False)
        stages_seen |= {a.name for a in alive if a.name}
        if not listening and len(manifests) >= 2:  # everything is up: trainers, indexer, batcher, dashboard
            listening = listening_addresses([*pids_in_session(cluster.process.pid), cluster.redis.pid])
        scrape(cluster)
        time.sleep(0.5)
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs[-4000:]

    # the driver's summary, last on its stdout
    summary = json.loads([line for line in logs.splitlines() if line.startswith('{"steps"')][-1])
    assert summary["steps"] == STEPS and summary["commit_conflicts"] == 0 and summary["batches_dead_lettered"] == 0
    # a clean end kills no stage mid-call (Ray would log "Task IndexCoordinator.run failed", or an indexer worker's
    # "Task IndexerWorker.index_shards failed"): the loops return, and a worker's call ends at a shard boundary
    assert not [line for line in logs.splitlines()
                if re.search(r"Task (IndexCoordinator|Batcher|IndexerWorker)\.\w+ failed", line)], logs[-4000:]

    # what refreshing the index cost the trainers: per version, and over the run
    refresh = summary["refresh"]
    assert {v["version"] for v in refresh["per_version"]} == {b["version"] for b in summary["index_builds"]}
    assert 0 < refresh["build_share"] <= 1 and refresh["tokens_per_s_building"] and refresh["tokens_per_s_idle"]
    assert all(v["staleness_at_first_use"] >= 0 for v in refresh["per_version"] if v["first_use_step"] is not None)

    # the stages were named actors in the run's namespace while it ran
    assert {"marge-indexer-coordinator", "marge-indexer-0", "marge-indexer-1", "marge-batcher-0"} <= stages_seen

    # the job used the Redis of MARGE_REDIS_URL_FILE (the test's server), not a private one in the run folder, and
    # its password is nowhere the job API shows (the job's runtime env and entrypoint)
    import redis

    assert redis.Redis.from_url(cluster.redis.url).keys(f"*{RUN}*")
    assert not (run_dir / "redis").exists()
    info = client.get_job_info(job)
    assert cluster.redis.password not in json.dumps(info.runtime_env or {}) + info.entrypoint

    # scaling: the versions built after each change record their pool, every shard is in every version
    index_manifests(run_dir / "index", manifests)
    assert [w for w, _ in scaled] == [2, 1], (scaled, sorted(manifests))
    num_shards = json.loads((small_corpus / "manifest.json").read_text())["num_shards"]
    for version, manifest in manifests.items():
        assert sorted(s["shard"] for s in manifest["shards"]) == list(range(num_shards)), version
        assert manifest["build_seconds"] > 0 and manifest["embed_seconds"] > 0
    workers_of = {v: m["indexer_workers"] for v, m in manifests.items()}
    (grow_asked, grow_from), (shrink_asked, shrink_from) = scaled
    assert shrink_from <= max(workers_of), f"the shrink applies from v{shrink_from}, after the run's last version"
    assert all(w == 1 for v, w in workers_of.items() if v < grow_from), workers_of
    assert 2 in workers_of.values() and workers_of[max(workers_of)] == 1, workers_of
    assert all(w == 1 for v, w in workers_of.items() if v >= shrink_from), workers_of

    # training never stopped: one log line per update, in order
    steps = [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))

    # every stage's series on the cluster's metrics endpoint, tagged with stage, run and worker
    text = "\n".join(cluster.scrapes)
    exported = sorted({line.split("{")[0] for line in text.splitlines() if line.startswith("ray_marge")})
    for name, stage in (("ray_marge_indexer_docs_embedded_total", "indexer"), ("ray_marge_index_version", "indexer"),
                        ("ray_marge_batches_produced_total", "batcher"), ("ray_marge_trainer_step", "trainer")):
        series = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert series, f"{name} was never exported ({len(cluster.scrapes)} scrapes; exported: {exported})"
        tags = dict(re.findall(r'(\w+)="([^"]*)"', series[-1]))
        assert tags.get("stage") == stage and tags.get("run") == RUN and "worker" in tags, series[-1]

    # and everything listened on loopback only
    assert listening
    exposed = [(host, port, owner) for host, port, owner in listening if host not in LOOPBACK]
    assert not exposed, exposed


def test_gloo_binds_the_node_address_where_the_host_name_resolves_to_loopback(monkeypatch):
    """Ranks on other nodes connect to the address gloo advertises: where this host's name resolves to 127.0.0.1,
    the setup hook names the interface of the node's Ray address; a resolvable name, a loopback node (one
    machine) or a GLOO_SOCKET_IFNAME already set change nothing."""
    import socket

    import psutil
    import ray.util

    from marge.util import loopback

    interfaces = {name: a.address for name, addrs in psutil.net_if_addrs().items() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")}
    if not interfaces:
        pytest.skip("no non-loopback IPv4 interface on this machine")
    name, address = next(iter(interfaces.items()))
    # the hook writes os.environ itself: record the variable's state first, so that the test's end restores it (a
    # GLOO_SOCKET_IFNAME left behind would reach every later test's Ray workers)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "recorded")

    def bound(resolves_to: str, node_address: str, preset: str | None = None) -> str | None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
        if preset:
            monkeypatch.setenv("GLOO_SOCKET_IFNAME", preset)
        monkeypatch.setattr(socket, "gethostbyname", lambda host: resolves_to)
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node_address)
        loopback.bind_gloo_to_node_address()
        return os.environ.get("GLOO_SOCKET_IFNAME")

    assert bound("127.0.0.1", address) == name
    assert bound("127.0.1.1", address) == name
    assert bound(address, address) is None  # the name resolves to a reachable address: gloo's default is right
    assert bound("127.0.0.1", "127.0.0.1") is None  # one machine
    assert bound("127.0.0.1", address, preset="eth9") == "eth9"  # the operator's choice stands
    assert loopback.interface_of("127.0.0.1") == "lo"
    monkeypatch.undo()
    assert "GLOO_SOCKET_IFNAME" not in os.environ or os.environ["GLOO_SOCKET_IFNAME"] not in (name, "eth9")
