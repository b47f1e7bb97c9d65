"""MARGE across a real multi-node Ray cluster on one machine: three hosts in network namespaces (tests/netns.py).

The head's namespace holds the Ray head (GCS, dashboard, the job's driver and its two batch builders, one per
trainer rank: `batcher.builders=2`) and the run's Redis
(password-protected, bound to the head's address); one worker node holds both trainer ranks (custom resource
`marge_trainer`), the other the indexer (`marge_indexer`); a fourth namespace joins as a node while the first
job trains, for the second indexer worker `marge scale` asks for; a fifth joins for the test whose ranks run on
two nodes (`marge_trainer_split`: one on the trainer node, one there). The GCS checks nodes' health every 2 s
(2 s timeout) and declares a node dead after 5 failed checks (Ray's defaults: 3 s, 10 s, 5), so that a cut the
GCS must notice and one it must not can both be chosen with a margin. The tiny run is submitted with `ray job submit`
from inside the head's namespace, as a user on the cluster would; the machine's filesystem plays the shared run
folder.
Everything the cluster started is stopped by PID and every namespace and link removed at teardown.

The test process itself stays in the machine's namespace, which has no route into the cluster's subnet: it watches
the run through the shared folder (train_log.jsonl, index manifests), injects faults with `ip` and `kill`, and
asks the cluster (job status, actor placement, `marge audit`) through commands run inside the head's namespace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from netns import NamespacedNetwork, NamespacesUnavailable, NetNode, remove_stale  # tests/netns.py
from processes import listening_addresses  # tests/processes.py

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
GCS_PORT, DASHBOARD_PORT, REDIS_PORT = 6380, 8265, 6390
HEALTH_CHECKS = {"health_check_period_ms": 2000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 5}
"""The GCS declares a node dead 10 to 20 s after it stops answering."""
RUN = "multinode"
STEPS = 40
TRAINER_NODE = {"marge_trainer": 2, "marge_trainer_split": 1}
"""Both ranks of a run that asks for `marge_trainer`, one of a run that asks for `marge_trainer_split`."""
UNINTERRUPTED: dict[int, list[str]] = {}
"""Update -> batch ids of the uninterrupted run (the first test): every faulted run must train the same."""

pytestmark = pytest.mark.slow


@dataclass
class NamespacedCluster:
    net: NamespacedNetwork
    temp: Path
    env: dict[str, str]
    redis_url: str
    redis_argv: list[str]
    jobs: list[str] = dataclasses.field(default_factory=list)  # submitted; stopped after each test if still running
    redis_process: subprocess.Popen | None = None

    @property
    def head(self) -> NetNode:
        return self.net.nodes[0]

    @property
    def trainer_node(self) -> NetNode:
        return self.net.nodes[1]

    @property
    def indexer_node(self) -> NetNode:
        return self.net.nodes[2]

    @property
    def spare_node(self) -> NetNode:
        """Joins the cluster when `marge scale` asks for a second indexer worker."""
        return self.net.nodes[3]

    @property
    def second_trainer_node(self) -> NetNode:
        """Holds one of the two ranks of the run whose ranks are on two nodes."""
        return self.net.nodes[4]

    def start_redis(self) -> None:
        self.redis_process = self.net.popen(self.head, self.redis_argv, self.env, self.temp / "redis.log")
        password = self.redis_url.split(":")[2].split("@")[0]
        wait_for(lambda: self.net.run(self.head, ["redis-cli", "-h", self.head.address, "-p", str(REDIS_PORT),
                                                  "--no-auth-warning", "-a", password, "ping"],
                                      self.env).stdout.strip() == "PONG", 20, "Redis answered")

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    def on_head(self, argv: list[str], timeout: float = 180) -> str:
        done = self.net.run(self.head, argv, self.env, timeout=timeout)
        assert done.returncode == 0, f"{argv[:3]} on the head failed ({done.returncode}):\n{done.stderr[-3000:]}"
        return done.stdout

    def python_on_head(self, code: str, timeout: float = 180) -> str:
        return self.on_head([sys.executable, "-c", code], timeout)

    def start_worker(self, node: NetNode, resources: dict[str, float], cpus: int) -> None:
        self.net.popen(node, [str(VENV_BIN / "ray"), "start", "--block", f"--address={self.head.address}:{GCS_PORT}",
                              f"--node-ip-address={node.address}", f"--num-cpus={cpus}",
                              f"--resources={json.dumps(resources)}", "--object-store-memory=200000000",
                              f"--temp-dir={self.temp / node.name}", "--disable-usage-stats"],
                       self.env, self.temp / f"{node.name}.log")

    def alive_nodes(self) -> dict[str, str]:
        """node id -> node address of every alive node, from Ray's state API."""
        out = self.python_on_head(
            "import json; from ray.util.state import list_nodes; "
            f"print(json.dumps({{n.node_id: n.node_ip for n in list_nodes(address={self.dashboard!r}, "
            "filters=[('state', '=', 'ALIVE')], raise_on_missing_output=False)}))")  # dead nodes count as "missing"
        return json.loads(out.strip().splitlines()[-1])

    def wait_nodes(self, addresses: set[str], timeout_s: float = 120) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if set(self.alive_nodes().values()) >= addresses:
                    return
            except AssertionError:
                pass
            time.sleep(2)
        raise TimeoutError(f"nodes {sorted(addresses)} did not all join the cluster within {timeout_s} s")


def wait_for(check, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} within {timeout_s} s")


@pytest.fixture(scope="module")
def cluster():
    try:
        remove_stale()  # a run killed before its teardown (SIGKILL) left these
        # head, trainer node, indexer node, one more for `marge scale`, a second trainer node
        net = NamespacedNetwork(5).create()
    except NamespacesUnavailable as e:
        pytest.skip(f"no network namespaces here: {e}")

    def interrupted(signum, frame):  # a SIGTERM runs the teardown below, as Ctrl-C does
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupted)
    temp = Path(tempfile.mkdtemp(prefix="mn", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MARGE_REDIS_URL", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
    password = secrets.token_urlsafe(16)
    head = net.nodes[0]
    c = NamespacedCluster(net, temp, env, f"redis://:{password}@{head.address}:{REDIS_PORT}/0",
                          ["redis-server", "--bind", head.address, "--port", str(REDIS_PORT), "--requirepass", password,
                           "--dir", str(temp / "redis"), "--appendonly", "yes", "--save", "", "--protected-mode", "yes"])
    try:
        (temp / "redis").mkdir()
        c.start_redis()
        net.popen(head, [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--node-ip-address={head.address}",
                         f"--port={GCS_PORT}", f"--dashboard-host={head.address}", f"--dashboard-port={DASHBOARD_PORT}",
                         "--num-cpus=2", '--resources={"marge_head": 1}', "--object-store-memory=200000000",
                         f"--system-config={json.dumps(HEALTH_CHECKS)}",
                         f"--temp-dir={temp / head.name}", "--include-dashboard=true", "--disable-usage-stats"],
                  env, temp / f"{head.name}.log")
        c.start_worker(c.trainer_node, TRAINER_NODE, cpus=2)
        c.start_worker(c.indexer_node, {"marge_indexer": 1}, cpus=1)
        c.wait_nodes({n.address for n in net.nodes[:3]})
        yield c
    finally:
        net.teardown()
        shutil.rmtree(temp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    assert not net.leftovers(), net.leftovers()


def submit(c: NamespacedCluster, run_dir: Path, corpus: Path, steps: int, extra: list[str] = ()) -> str:
    runtime_env = {**yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text()), "working_dir": str(REPO)}
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "MARGE_REDIS_URL": c.redis_url}
    argv = [str(VENV_BIN / "ray"), "job", "submit", "--address", c.dashboard, "--no-wait",
            "--runtime-env-json", json.dumps(runtime_env), "--",
            "marge", "pretrain", "--config", "deploy/configs/tiny.yaml", f"run.name={RUN}", f"run.dir={run_dir}",
            f"run.max_steps={steps}", f"data.corpus={corpus}", "data.max_chunk_tokens=128",
            "model.max_positions=128", "batcher.max_tokens=400", "indexer.reindex_every=10",
            "trainer.snapshot_every=10", "trainer.checkpoint_every=10", "trainer.warmup_steps=2",
            "run.progress_every_s=5", "health.probe_size=4", "health.aligned_probe_size=8",
            "trainer.resources={marge_trainer: 1}", "indexer.resources={marge_indexer: 1}",
            "indexer.num_workers=1", "trainer.max_failures=3", "batcher.builders=2", *extra]
    deadline = time.time() + 120
    while True:  # the dashboard's job agent starts after the dashboard answers, later on a loaded machine
        done = c.net.run(c.head, argv, c.env, timeout=180)
        if done.returncode == 0 or "No available agent" not in done.stdout + done.stderr or time.time() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, f"ray job submit failed ({done.returncode}):\n{done.stderr[-3000:]}"
    out = done.stdout
    job = next(word.strip("'") for line in out.splitlines() for word in line.split() if word.strip("'").startswith("raysubmit_"))
    c.jobs.append(job)
    return job


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request):
    """A test that failed mid-run leaves its job running, and the next job of the same run name would meet its
    actors and Redis keys: stop it."""
    yield
    if "cluster" not in request.fixturenames:
        return
    c = request.getfixturevalue("cluster")
    while c.jobs:
        job = c.jobs.pop()
        if job_status(c, job) in ("PENDING", "RUNNING"):
            c.net.run(c.head, [str(VENV_BIN / "ray"), "job", "stop", "--address", c.dashboard, job], c.env, timeout=120)
            wait_for(lambda: job_status(c, job) in ("STOPPED", "FAILED", "SUCCEEDED"), 120, f"job {job} stopped")


def job_status(c: NamespacedCluster, job: str) -> str:
    out = c.python_on_head("from ray.job_submission import JobSubmissionClient; "
                           f"print(JobSubmissionClient({c.dashboard!r}).get_job_status({job!r}).value)")
    return out.strip().splitlines()[-1]


def job_logs(c: NamespacedCluster, job: str) -> str:
    return c.on_head([str(VENV_BIN / "ray"), "job", "logs", "--address", c.dashboard, job])[-4000:]


def index_manifests(run_dir: Path) -> list[dict]:
    out = []
    for path in (run_dir / "index").glob("v*/manifest.json"):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):  # being renamed into place, or pruned
            continue
    return out


def batches_by_step(run_dir: Path) -> dict[int, list[str]]:
    return {r["step"]: r["batch_ids"] for r in map(json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())}


def same_batches_as_uninterrupted(run_dir: Path) -> None:
    if not UNINTERRUPTED:
        pytest.skip("needs the uninterrupted run of test_the_job_runs_across_three_namespaced_nodes")
    assert batches_by_step(run_dir) == UNINTERRUPTED  # the slot -> batch map of an uninterrupted run


def recovery_seconds(run_dir: Path, fault_unix: float) -> float:
    """From the fault to the first update of the final train log trained after it (updates trained after the fault
    but lost with their node, trained again after the resume, do not count)."""
    times = [r["time"] for r in map(json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())
             if r["time"] > fault_unix]
    return min(times) - fault_unix


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "train_log.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line being written
    return steps


def placement(c: NamespacedCluster) -> dict[str, list[str]]:
    """Class or actor name -> the addresses of the nodes its alive actors run on."""
    out = c.python_on_head(
        "import json; from ray.util.state import list_actors, list_nodes\n"
        f"ips = {{n.node_id: n.node_ip for n in list_nodes(address={c.dashboard!r})}}\n"
        f"actors = list_actors(address={c.dashboard!r}, filters=[('state', '=', 'ALIVE')], limit=1000)\n"
        "out = {}\n"
        "for a in actors: out.setdefault(a.name or a.class_name, []).append(ips.get(a.node_id))\n"
        "print(json.dumps(out))")
    return json.loads(out.strip().splitlines()[-1])


def audit(c: NamespacedCluster, run_dir: Path) -> dict:
    out = c.on_head([str(VENV_BIN / "marge"), "audit", "--run", str(run_dir), "--redis-url", c.redis_url, "--json"])
    return json.loads(out.strip().splitlines()[-1])


def finish(c: NamespacedCluster, job: str, timeout_s: float = 900) -> str:
    return wait_for(lambda: (s := job_status(c, job)) in ("SUCCEEDED", "FAILED", "STOPPED") and s, timeout_s,
                    "the job finished", every_s=5)


def submitted_and_past_a_checkpoint(c: NamespacedCluster, run_dir: Path, corpus: Path,
                                    extra: list[str] = ()) -> tuple[str, int]:
    """The run submitted and trained past its checkpoint at 10: (its job, the newest update trained)."""
    job = submit(c, run_dir, corpus, steps=STEPS, extra=extra)
    wait_for(lambda: len(trained_steps(run_dir)) >= 15, 600, "15 updates were trained (a checkpoint at 10)")
    return job, max(trained_steps(run_dir))


def ends_as_uninterrupted(c: NamespacedCluster, job: str, run_dir: Path, fault_at: float, record: dict) -> None:
    """The faulted run finished, trained every update once with the uninterrupted run's batches, and audits
    clean; prints `record` with its recovery and audit (docs/cluster.md's table)."""
    assert finish(c, job) == "SUCCEEDED", job_logs(c, job)
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))  # updates after the checkpoint: trained again, logged once
    same_batches_as_uninterrupted(run_dir)
    result = audit(c, run_dir)
    assert result["ok"] and result["batches_lost"] == 0 and result["trained_twice"] == 0, result
    print(json.dumps({**record, "recovery_s": round(recovery_seconds(run_dir, fault_at), 1), "audit": result}))


def test_the_job_runs_across_three_namespaced_nodes(cluster, small_corpus, tmp_path):
    c = cluster
    root_listening = set(listening_addresses([os.getpid()]))
    run_dir = tmp_path / "run"
    # 0.5 s an update (the same batches): versions are left to build when the scaled pool takes effect
    job = submit(c, run_dir, small_corpus, steps=STEPS, extra=["faults.slow_update_s=0.5"])
    # early, so that index versions are left to build when the scaled pool takes effect (the run builds one every 10)
    wait_for(lambda: len(trained_steps(run_dir)) >= 2, 600, "2 updates were trained")
    where = placement(c)
    trainers = where.get("RayTrainWorker", [])
    assert sorted(trainers) == [c.trainer_node.address] * 2, where
    assert where.get("marge-indexer-0") == [c.indexer_node.address], where
    assert c.indexer_node.address not in trainers  # the indexer is on another node than rank 0 (and rank 1)
    assert where.get("marge-batcher-0") and where.get("marge-batcher-1")  # a builder for each rank; num_cpus=0: any node
    assert where.get("marge-indexer-coordinator")
    # a second indexer worker on a node that joins now, while the job trains; the next version records it
    c.start_worker(c.spare_node, {"marge_indexer": 1}, cpus=1)
    c.wait_nodes({n.address for n in c.net.nodes[:4]})
    scaled = json.loads(c.on_head([str(VENV_BIN / "marge"), "scale", "--run", RUN, "--indexer-workers", "2",
                                   "--address", f"{c.head.address}:{GCS_PORT}"]).strip().splitlines()[-1])
    assert scaled["wanted"] == 2, scaled
    second = wait_for(lambda: placement(c).get("marge-indexer-1"), 600, "marge-indexer-1 started", every_s=1)
    assert second == [c.spare_node.address], second
    built_by_two = wait_for(lambda: [m for m in index_manifests(run_dir) if m.get("indexer_workers") == 2], 600,
                            "an index version built by two workers")
    assert min(m["version"] for m in built_by_two) >= scaled["from_version"]
    listening = [entry for node in c.net.nodes for entry in listening_addresses(c.net.pids(node))]
    assert listening
    own = {node.address for node in c.net.nodes} | {"127.0.0.1", "::1", "0.0.0.0", "::"}
    assert all(host in own for host, _, _ in listening), [e for e in listening if e[0] not in own]
    assert any(host == c.head.address and port == REDIS_PORT for host, port, _ in listening)  # Redis on the head only
    assert finish(c, job) == "SUCCEEDED", job_logs(c, job)
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))
    result = audit(c, run_dir)
    assert result["ok"] and result["batches_lost"] == 0 and result["trained_twice"] == 0, result
    assert result["steps"] == STEPS
    UNINTERRUPTED.update(batches_by_step(run_dir))
    # the test's own namespace gained no listening socket: the run's servers are all inside the cluster
    assert set(listening_addresses([os.getpid()])) == root_listening


def test_a_lost_trainer_node_is_replaced_and_the_run_resumes_with_nothing_lost(cluster, small_corpus, tmp_path):
    c = cluster
    run_dir = tmp_path / "run"
    job, before = submitted_and_past_a_checkpoint(c, run_dir, small_corpus)
    fault_at = time.time()
    victims = c.net.kill(c.trainer_node, signal.SIGKILL)  # the node's raylet, its agents and both trainer ranks
    assert victims
    time.sleep(DOWN_S)
    c.start_worker(c.trainer_node, TRAINER_NODE, cpus=2)  # a replacement node at the same address
    wait_for(lambda: (steps := trained_steps(run_dir)) and max(steps) > before and steps, 600,
             "training went on after the node was lost")
    ends_as_uninterrupted(c, job, run_dir, fault_at, {
        "fault": "trainer node lost (raylet and both ranks killed), replaced after 5 s", "updates_before_fault": before})


def node_raylet_alive(c: NamespacedCluster, node: NetNode) -> bool:
    return any(b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in c.net.pids(node)
               if Path(f"/proc/{pid}/cmdline").exists())


def trainer_actor_ids(c: NamespacedCluster) -> set[str]:
    out = c.python_on_head(
        "import json; from ray.util.state import list_actors\n"
        f"actors = list_actors(address={c.dashboard!r}, filters=[('state', '=', 'ALIVE'), "
        "('class_name', '=', 'RayTrainWorker')], limit=1000)\n"
        "print(json.dumps([a.actor_id for a in actors]))")
    return set(json.loads(out.strip().splitlines()[-1]))


DOWN_S = 5
"""How long a lost node (or the queue's Redis) stays down before its replacement starts: the fault's length,
not a wait for something to happen (what follows waits on conditions)."""
SHORT_CUT_S, LONG_CUT_S = 3, 35
"""A cut the GCS cannot notice (at most 2 failed checks of 5) and one it must (10 to 20 s: HEALTH_CHECKS)."""


def test_a_short_cut_goes_unnoticed_and_a_long_one_loses_the_node_and_nothing_else(cluster, small_corpus, tmp_path):
    """A trainer node cut off for SHORT_CUT_S keeps its raylet and its ranks, which go on training; cut off for
    LONG_CUT_S it is declared dead (once the link is back its raylet hears so and exits), a node agent (an
    autoscaler, KubeRay; the test plays it) starts it again, and the run resumes from its checkpoint."""
    c = cluster
    run_dir = tmp_path / "run"
    # 1 s an update (the same batches), so that the run still trains when the second cut comes
    job = submit(c, run_dir, small_corpus, steps=STEPS, extra=["faults.slow_update_s=1"])
    wait_for(lambda: len(trained_steps(run_dir)) >= 12, 600, "12 updates were trained (a checkpoint at 10)")
    ranks = trainer_actor_ids(c)
    assert len(ranks) == 2, ranks
    short_at = max(trained_steps(run_dir))
    c.net.cut(c.trainer_node)
    time.sleep(SHORT_CUT_S)
    c.net.restore(c.trainer_node)
    wait_for(lambda: max(trained_steps(run_dir)) >= short_at + 3, 300, "training went on after the short cut")
    assert node_raylet_alive(c, c.trainer_node)
    assert trainer_actor_ids(c) == ranks  # the same two ranks: nothing was restarted
    assert c.trainer_node.address in set(c.alive_nodes().values())

    long_at = max(trained_steps(run_dir))
    fault_at = time.time()
    c.net.cut(c.trainer_node)
    time.sleep(LONG_CUT_S)
    c.net.restore(c.trainer_node)
    wait_for(lambda: not node_raylet_alive(c, c.trainer_node), 60, "the cut-off node's raylet exited", every_s=1)
    c.net.kill(c.trainer_node, signal.SIGKILL)  # what the lost node left behind (its workers)
    c.start_worker(c.trainer_node, TRAINER_NODE, cpus=2)
    wait_for(lambda: max(trained_steps(run_dir) or [0]) > long_at, 600, "training went on after the node came back")
    ends_as_uninterrupted(c, job, run_dir, fault_at, {
        "fault": f"trainer node cut off for {SHORT_CUT_S} s (unnoticed), later for {LONG_CUT_S} s (declared dead, "
                 "restarted)", "updates_before_short_cut": short_at, "updates_before_long_cut": long_at})
    assert not trainer_actor_ids(c) & ranks


def shard_records(run_dir: Path) -> list[dict]:
    path = run_dir / "faults" / "index-shards.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def shard_in_progress(run_dir: Path) -> dict | None:
    """A shard of a version after the bootstrap that a worker started and has not finished (its record names the
    worker's node)."""
    records = shard_records(run_dir)
    done = {(r["version"], r["shard"], r["pid"]) for r in records if r["event"] == "indexed"}
    return next((r for r in records if r["event"] == "started" and r["version"] >= 1
                 and (r["version"], r["shard"], r["pid"]) not in done), None)


def test_the_indexer_node_lost_during_an_index_build_loses_nothing(cluster, small_corpus, tmp_path):
    """The build is slowed (`faults.slow_index_shard_s`: each shard waits 1 s and is recorded) so that the kill of
    the indexer worker's node lands inside it; the shard the dead worker had started is indexed again by its
    restarted worker on the replacement node, the version is committed, and the run trains what the uninterrupted
    one did."""
    c = cluster
    run_dir = tmp_path / "run"
    job = submit(c, run_dir, small_corpus, steps=STEPS, extra=["faults.slow_index_shard_s=1"])
    interrupted = wait_for(lambda: shard_in_progress(run_dir), 600, "a shard was being indexed", every_s=0.2)
    # the worker's node: the indexer node, or the node the first test added for `marge scale` (it stays in the
    # cluster with the same resource, so Ray may place marge-indexer-0 there)
    node = next(n for n in (c.indexer_node, c.spare_node) if n.address == interrupted["node"])
    before = max(trained_steps(run_dir) or [0])
    fault_at = time.time()
    assert c.net.kill(node, signal.SIGKILL)
    time.sleep(DOWN_S)
    c.start_worker(node, {"marge_indexer": 1}, cpus=1)
    version, shard = interrupted["version"], interrupted["shard"]
    redone = wait_for(lambda: [r for r in shard_records(run_dir) if (r["version"], r["shard"], r["event"]) ==
                               (version, shard, "indexed")], 600, f"shard {shard} of v{version} was indexed again")
    assert all(r["pid"] != interrupted["pid"] and r["time"] > fault_at for r in redone), (interrupted, redone)
    assert not any(r["pid"] == interrupted["pid"] and r["event"] == "indexed" and r["version"] == version
                   and r["shard"] == shard for r in shard_records(run_dir))  # the dead worker never finished it
    wait_for(lambda: any(m["version"] == version for m in index_manifests(run_dir)), 600, f"v{version} was committed")
    ends_as_uninterrupted(c, job, run_dir, fault_at, {
        "fault": "indexer node lost while a shard was being indexed, replaced after 5 s",
        "interrupted": {"version": version, "shard": shard}, "updates_before_fault": before})


def test_the_queue_redis_restarted_mid_run_loses_nothing(cluster, small_corpus, tmp_path):
    """The head's redis-server (the batch queue) SIGKILLed and started again 5 s later on its append-only file:
    every stage's client retries through the gap, and nothing acknowledged is lost."""
    c = cluster
    run_dir = tmp_path / "run"
    job, before = submitted_and_past_a_checkpoint(c, run_dir, small_corpus)
    fault_at = time.time()
    try:
        c.redis_process.kill()  # SIGKILL; `ip netns exec` ran redis-server in its own place (exec)
        c.redis_process.wait(timeout=10)
        time.sleep(DOWN_S)
    finally:
        c.start_redis()  # also when the test fails here: the next tests need it
    wait_for(lambda: max(trained_steps(run_dir)) > before + 2, 600, "training went on after Redis came back")
    ends_as_uninterrupted(c, job, run_dir, fault_at, {
        "fault": "the queue's redis-server SIGKILLed, started again after 5 s", "updates_before_fault": before})


def test_ranks_on_two_nodes_lose_one_node_and_the_run_resumes_with_nothing_lost(cluster, small_corpus, tmp_path):
    """One rank on the trainer node, one on a second trainer node: their gradient all-reduce crosses nodes (gloo
    over the namespaces' link). The second node is lost (every process killed) and replaced after 5 s."""
    c = cluster
    c.start_worker(c.second_trainer_node, {"marge_trainer_split": 1}, cpus=2)
    try:
        c.wait_nodes({c.second_trainer_node.address})
        run_dir = tmp_path / "run"
        job, before = submitted_and_past_a_checkpoint(c, run_dir, small_corpus, [
            "trainer.resources={marge_trainer_split: 1}", "faults.slow_update_s=0.5"])
        assert sorted(placement(c).get("RayTrainWorker", [])) == sorted(
            [c.trainer_node.address, c.second_trainer_node.address])
        fault_at = time.time()
        assert c.net.kill(c.second_trainer_node, signal.SIGKILL)
        time.sleep(DOWN_S)
        c.start_worker(c.second_trainer_node, {"marge_trainer_split": 1}, cpus=2)
        wait_for(lambda: max(trained_steps(run_dir)) > before, 600, "training went on after the node was lost")
        ends_as_uninterrupted(c, job, run_dir, fault_at, {
            "fault": "one of two trainer nodes lost (its rank and raylet killed), replaced after 5 s",
            "updates_before_fault": before})
    finally:
        c.net.kill(c.second_trainer_node, signal.SIGKILL)  # no fifth raylet beside the next tests
