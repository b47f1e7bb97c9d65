"""MARGE across a real multi-node Ray cluster on one machine: three hosts in network namespaces (tests/netns.py).

The head's namespace holds the Ray head (GCS, dashboard, the job's driver and batcher) and the run's Redis
(password-protected, bound to the head's address); one worker node holds both trainer ranks (custom resource
`marge_trainer`), the other the indexer (`marge_indexer`); a fourth namespace joins as a node while the first
job trains, for the second indexer worker `marge scale` asks for. The tiny run is submitted with `ray job submit`
from inside the head's namespace, as a user on the cluster would; the machine's filesystem plays the shared run
folder.
Everything the cluster started is stopped by PID and every namespace and link removed at teardown.

The test process itself stays in the machine's namespace, which has no route into the cluster's subnet: it watches
the run through the shared folder (train_log.jsonl, index manifests), injects faults with `ip` and `kill`, and
asks the cluster (job status, actor placement, `marge audit`) through commands run inside the head's namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from netns import NamespacedNetwork, NamespacesUnavailable, NetNode, remove_stale  # tests/netns.py
from processes import listening_addresses  # tests/processes.py

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
GCS_PORT, DASHBOARD_PORT, REDIS_PORT = 6380, 8265, 6390
RUN = "multinode"
STEPS = 40
UNINTERRUPTED: dict[int, list[str]] = {}
"""Update -> batch ids of the uninterrupted run (the first test): every faulted run must train the same."""

pytestmark = pytest.mark.slow


@dataclass
class NamespacedCluster:
    net: NamespacedNetwork
    temp: Path
    env: dict[str, str]
    redis_url: str

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
            "filters=[('state', '=', 'ALIVE')])}))")
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
        net = NamespacedNetwork(4).create()  # head, trainer node, indexer node, and one more for `marge scale`
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
    c = NamespacedCluster(net, temp, env, f"redis://:{password}@{head.address}:{REDIS_PORT}/0")
    try:
        (temp / "redis").mkdir()
        net.popen(head, ["redis-server", "--bind", head.address, "--port", str(REDIS_PORT), "--requirepass", password,
                         "--dir", str(temp / "redis"), "--appendonly", "yes", "--save", "", "--protected-mode", "yes"],
                  env, temp / "redis.log")
        wait_for(lambda: net.run(head, ["redis-cli", "-h", head.address, "-p", str(REDIS_PORT), "--no-auth-warning",
                                        "-a", password, "ping"], env).stdout.strip() == "PONG", 20, "Redis answered")
        net.popen(head, [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--node-ip-address={head.address}",
                         f"--port={GCS_PORT}", f"--dashboard-host={head.address}", f"--dashboard-port={DASHBOARD_PORT}",
                         "--num-cpus=2", '--resources={"marge_head": 1}', "--object-store-memory=200000000",
                         f"--temp-dir={temp / head.name}", "--include-dashboard=true", "--disable-usage-stats"],
                  env, temp / f"{head.name}.log")
        c.start_worker(c.trainer_node, {"marge_trainer": 2}, cpus=2)
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
            "indexer.num_workers=1", "trainer.max_failures=3", *extra]
    deadline = time.time() + 120
    while True:  # the dashboard's job agent starts after the dashboard answers, later on a loaded machine
        done = c.net.run(c.head, argv, c.env, timeout=180)
        if done.returncode == 0 or "No available agent" not in done.stdout + done.stderr or time.time() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, f"ray job submit failed ({done.returncode}):\n{done.stderr[-3000:]}"
    out = done.stdout
    return next(word.strip("'") for line in out.splitlines() for word in line.split() if word.strip("'").startswith("raysubmit_"))


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


def test_the_job_runs_across_three_namespaced_nodes(cluster, small_corpus, tmp_path):
    c = cluster
    root_listening = set(listening_addresses([os.getpid()]))
    run_dir = tmp_path / "run"
    job = submit(c, run_dir, small_corpus, steps=STEPS)
    # early, so that index versions are left to build when the scaled pool takes effect (the run builds one every 10)
    wait_for(lambda: len(trained_steps(run_dir)) >= 2, 600, "2 updates were trained")
    where = placement(c)
    trainers = where.get("RayTrainWorker", [])
    assert sorted(trainers) == [c.trainer_node.address] * 2, where
    assert where.get("marge-indexer-0") == [c.indexer_node.address], where
    assert c.indexer_node.address not in trainers  # the indexer is on another node than rank 0 (and rank 1)
    assert where.get("marge-batcher") and where.get("marge-indexer-coordinator")  # num_cpus=0: any node
    # a second indexer worker on a node that joins now, while the job trains; the next version records it
    c.start_worker(c.spare_node, {"marge_indexer": 1}, cpus=1)
    c.wait_nodes({n.address for n in c.net.nodes})
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
    job = submit(c, run_dir, small_corpus, steps=STEPS)
    wait_for(lambda: len(trained_steps(run_dir)) >= 15, 600, "15 updates were trained (a checkpoint at 10)")
    before = max(trained_steps(run_dir))
    fault_at = time.time()
    victims = c.net.kill(c.trainer_node, signal.SIGKILL)  # the node's raylet, its agents and both trainer ranks
    assert victims
    time.sleep(5)
    c.start_worker(c.trainer_node, {"marge_trainer": 2}, cpus=2)  # a replacement node at the same address
    wait_for(lambda: (steps := trained_steps(run_dir)) and max(steps) > before and steps, 600,
             "training went on after the node was lost")
    assert finish(c, job) == "SUCCEEDED", job_logs(c, job)
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))  # updates after the checkpoint: trained again, logged once
    same_batches_as_uninterrupted(run_dir)
    result = audit(c, run_dir)
    assert result["ok"] and result["batches_lost"] == 0 and result["trained_twice"] == 0, result
    print(json.dumps({"fault": "trainer node lost (raylet and both ranks killed), replaced after 5 s",
                      "updates_before_fault": before, "recovery_s": round(recovery_seconds(run_dir, fault_at), 1),
                      "audit": result}))


def node_raylet_alive(c: NamespacedCluster, node: NetNode) -> bool:
    return any(b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in c.net.pids(node)
               if Path(f"/proc/{pid}/cmdline").exists())


def test_a_trainer_node_cut_off_for_30_s_and_restored_loses_nothing(cluster, small_corpus, tmp_path):
    """Ray's GCS declares a node dead after about 15 s without health checks; once the link is back its raylet is
    told so and exits, and a node agent (an autoscaler, KubeRay) starts it again: the test plays that part."""
    c = cluster
    run_dir = tmp_path / "run"
    job = submit(c, run_dir, small_corpus, steps=STEPS)
    wait_for(lambda: len(trained_steps(run_dir)) >= 15, 600, "15 updates were trained (a checkpoint at 10)")
    before = max(trained_steps(run_dir))
    fault_at = time.time()
    c.net.cut(c.trainer_node)
    time.sleep(30)
    c.net.restore(c.trainer_node)
    # Ray's GCS declares a node dead after 5 failed health checks (about 15-30 s); once the link is back its raylet
    # hears so and exits. Give it a minute to do that, then start the node again, as a node agent would.
    restarted = False
    try:
        wait_for(lambda: not node_raylet_alive(c, c.trainer_node), 60, "the cut-off node's raylet exited", every_s=1)
    except TimeoutError:
        pass  # the node survived the cut: the wait below says whether training goes on with it
    if not node_raylet_alive(c, c.trainer_node):
        c.net.kill(c.trainer_node, signal.SIGKILL)  # what the lost node left behind (its workers)
        c.start_worker(c.trainer_node, {"marge_trainer": 2}, cpus=2)
        restarted = True
    wait_for(lambda: max(trained_steps(run_dir) or [0]) > before, 600, "training went on after the link came back")
    assert finish(c, job) == "SUCCEEDED", job_logs(c, job)
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))
    same_batches_as_uninterrupted(run_dir)
    result = audit(c, run_dir)
    assert result["ok"] and result["batches_lost"] == 0 and result["trained_twice"] == 0, result
    print(json.dumps({"fault": "trainer node cut off for 30 s, then restored", "node_restarted": restarted,
                      "updates_before_fault": before, "recovery_s": round(recovery_seconds(run_dir, fault_at), 1),
                      "audit": result}))


def test_the_indexer_node_lost_during_an_index_build_loses_nothing(cluster, small_corpus, tmp_path):
    c = cluster
    run_dir = tmp_path / "run"
    job = submit(c, run_dir, small_corpus, steps=STEPS)
    staging = lambda: list((run_dir / "index").glob(".staging-*")) if (run_dir / "index").exists() else []  # noqa: E731
    wait_for(lambda: max(trained_steps(run_dir) or [0]) >= 8, 600, "8 updates were trained")
    wait_for(staging, 300, "an index build was in progress", every_s=0.05)
    building = [p.name for p in staging()]
    before = max(trained_steps(run_dir) or [0])
    fault_at = time.time()
    assert c.net.kill(c.indexer_node, signal.SIGKILL)
    time.sleep(5)
    c.start_worker(c.indexer_node, {"marge_indexer": 1}, cpus=1)
    wait_for(lambda: max(trained_steps(run_dir) or [0]) > max(before, 21), 600,
             "training went past the version being built when the indexer node was lost")
    assert finish(c, job) == "SUCCEEDED", job_logs(c, job)
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))
    same_batches_as_uninterrupted(run_dir)
    result = audit(c, run_dir)
    assert result["ok"] and result["batches_lost"] == 0 and result["trained_twice"] == 0, result
    print(json.dumps({"fault": "indexer node lost during an index build, replaced after 5 s", "building": building,
                      "updates_before_fault": before, "recovery_s": round(recovery_seconds(run_dir, fault_at), 1),
                      "audit": result}))
