"""Configs load and validate in full before anything starts; deployment manifests keep every control port inside
the cluster.

These need a server or take long; the quick tests of this subject are in tests/unit/test_config.py (no server)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from marge.contracts.config import ConfigError
from marge.contracts.corpus import Corpus
from services.driver.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def test_marge_pretrain_refuses_a_bad_setting_within_seconds_before_ray_or_redis_start(tmp_path):
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "pretrain", "--config",
                           str(DEPLOY / "configs" / "tiny.yaml"), "indexer.link_rule=bogus", f"run.dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "indexer.link_rule" in last and "'bogus'" in last and "['shard', 'document']" in last
    assert time.time() - started < 20
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_run_the_ray_cluster_cannot_hold_is_refused_naming_what_it_needs_and_what_there_is(small_corpus, tmp_path):
    """With too few logical CPUs Ray Train would time out (WorkerGroupStartupTimeoutError): refused up front."""
    cfg = load_config(DEPLOY / "configs" / "tiny.yaml")
    assert cfg.cpus_needed() == 3 and load_config(DEPLOY / "configs" / "tiny-bart.yaml").cpus_needed() == 2
    cfg.check_fits(3)
    with pytest.raises(ConfigError, match=r"needs 3 logical CPUs \(trainer 2 x 1 \+ indexer 1 x 1\) but the Ray "
                                          r"cluster has 2: add nodes"):
        cfg.check_fits(2)
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "pretrain", "--config",
                           str(DEPLOY / "configs" / "tiny.yaml"), "ray.num_cpus=2", f"run.dir={tmp_path / 'run'}",
                           f"data.corpus={small_corpus}", "data.max_chunk_tokens=128", "model.max_positions=128",
                           "batcher.max_tokens=400"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs 3 logical CPUs" in proc.stderr and "has 2" in proc.stderr
    assert time.time() - started < 60  # refused before Ray starts, not after Ray Train's start-up timeout


def test_pretrain_prints_the_resolved_config_and_dry_runs_without_starting_or_writing_anything(small_corpus, tmp_path):
    cli = [sys.executable, "-m", "services.cli", "pretrain", "--config", str(DEPLOY / "configs" / "tiny.yaml")]
    run_dir = tmp_path / "run"
    printed = subprocess.run([*cli, "--print-config", "run.max_steps=7", f"run.dir={run_dir}"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr[-2000:]
    resolved = yaml.safe_load(printed.stdout)
    assert resolved["run"]["max_steps"] == 7 and resolved["trainer"]["loss_chunk_tokens"] == 0  # defaults included
    assert load_config(DEPLOY / "configs" / "tiny.yaml", ["run.max_steps=7", f"run.dir={run_dir}"]).to_saved_dict() == resolved

    on_corpus = [f"run.dir={run_dir}", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
                 "model.max_positions=128", "batcher.max_tokens=400", "ray.num_cpus=3"]
    planned = subprocess.run([*cli, "--dry-run", *on_corpus], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    assert plan["corpus"]["shards"] == Corpus.open(small_corpus).num_shards and plan["resumes_from_step"] == 0
    assert plan["model"]["d_model"] == 64 and "refresh_interval_s" in plan["capacity_plan"]
    assert plan["slots"]["per_step"] == 2 and plan["execution"]["key_bias"] == "folded"  # what spec.json would hold
    assert not (run_dir / "spec.json").exists()

    # a corpus of one's own: the config file's probe files (its demo corpus's) are not used for it
    assert plan["probes"] == {"health.documents": None, "data.heldout_pairs": None}, plan["probes"]
    missing_probe = subprocess.run([*cli, "--dry-run", *on_corpus, f"health.documents={tmp_path / 'probes.jsonl'}"],
                                   cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing_probe.returncode != 0 and "health.documents names" in missing_probe.stderr, missing_probe.stderr[-2000:]
    # a probe file from another corpus is refused unless asked for, and one in none of its languages always
    elsewhere = tmp_path / "elsewhere" / "pairs.tsv"
    elsewhere.parent.mkdir()
    elsewhere.write_text("en\tThe sum of the cells.\tde\tDie Summe der Zellen.\n", encoding="utf-8")
    foreign = subprocess.run([*cli, "--dry-run", *on_corpus, f"data.heldout_pairs={elsewhere}"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert foreign.returncode != 0 and "neither" in foreign.stderr and "health.external_probes=true" in foreign.stderr
    allowed = subprocess.run([*cli, "--dry-run", *on_corpus, f"data.heldout_pairs={elsewhere}",
                              "health.external_probes=true"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert json.loads(allowed.stdout)["probes"]["data.heldout_pairs"] == str(elsewhere)
    elsewhere.write_text("xx\tone\tyy\ttwo\n", encoding="utf-8")
    unspoken = subprocess.run([*cli, "--dry-run", *on_corpus, f"data.heldout_pairs={elsewhere}",
                               "health.external_probes=true"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert unspoken.returncode != 0 and "data.heldout_pairs:" in unspoken.stderr, unspoken.stderr[-2000:]

    # a corpus path that does not exist (a typo) is not prepared from the config file's data.raw
    for extra in ([], ["data.raw=[]"]):
        typo = subprocess.run([*cli, "--dry-run", f"run.dir={run_dir}", f"data.corpus={tmp_path / 'absent'}", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert typo.returncode != 0 and "no prepared corpus is there" in typo.stderr, typo.stderr[-2000:]
        assert "data.raw=[INPUT]" in typo.stderr
    raw = REPO / "data" / "demo" / "libreoffice-help" / "documents.jsonl.gz"
    unprepared = subprocess.run([*cli, "--dry-run", f"run.dir={run_dir}", f"data.corpus={tmp_path / 'absent'}",
                                 f"data.raw=[{raw}]"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert unprepared.returncode == 0, unprepared.stderr[-2000:]
    assert "to be prepared from" in json.loads(unprepared.stdout)["corpus"]
    assert not run_dir.exists() and not (tmp_path / "absent").exists()  # nothing was written


def start_shipped_redis(tmp_path: Path, port: int, env: dict[str, str]):
    """deploy/redis/start.sh on loopback, its data and ACL file under tmp_path; returns once `marge` gets in."""
    import os

    import redis

    proc = subprocess.Popen(["sh", str(DEPLOY / "redis" / "start.sh"), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)],
                            env={**os.environ, "MARGE_REDIS_ACLFILE": str(tmp_path / "users.acl"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"redis://marge:{env['MARGE_REDIS_PASSWORD']}@127.0.0.1:{port}/0"
    deadline = time.time() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc
        except redis.ConnectionError:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline
            time.sleep(0.05)


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def one_batch(batch_id: str = "v0-e0-s0-0"):
    import numpy as np

    from marge.contracts.batch import Batch

    tokens = (np.arange(4, 9, dtype=np.int32), np.arange(9, 14, dtype=np.int32))
    return Batch(batch_id, 0, 0, np.array([1, 2]), ("en", "de"), tokens, np.array([0], dtype=np.int32),
                 np.array([1], dtype=np.int32), np.array([[0, 0]], dtype=np.int32), np.ones(1, dtype=np.float32))


def test_the_shipped_redis_conf_loads_and_limits_the_pipeline_user_to_its_keys(tmp_path):
    """deploy/redis/start.sh with deploy/redis/redis.conf on a real redis-server: the queue works as user marge
    (every command the pipeline uses), other keys and dangerous commands are refused, nobody gets in without a
    password."""
    import redis

    from marge.contracts.protocol import BatchQueue
    from marge.contracts.slots import CommitRecord, Slots
    from services.driver.redis_server import free_port

    port, password = free_port(), "pipeline-password-123"
    proc = start_shipped_redis(tmp_path, port, {"MARGE_REDIS_PASSWORD": password})
    try:
        url = f"redis://marge:{password}@127.0.0.1:{port}/0"
        q = BatchQueue.connect(url, "acl", Slots(1, 1))
        assert q.put(0, one_batch(), 10) and q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0"
        q.progress(0, 1)
        assert q.commit(0, 1, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")]))]) == []
        assert q.dead_letter(1, {b"header": b"{}"}, "test")  # a Lua script on the run's keys
        q.request_replay(q.dead_letters()[0]["entry"])
        q.publish_step({"step": 1})
        q.reset_from(1)
        assert q.counts()["committed_step"] == 1 and q.last_step() == {"step": 1}
        client = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("not-marge", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("dir")
        with pytest.raises((redis.AuthenticationError, redis.exceptions.NoPermissionError)):
            redis.Redis(host="127.0.0.1", port=port).set("marge:x", 1)
    finally:
        stop(proc)


def test_a_run_gets_its_own_redis_user_which_reaches_its_keys_alone_and_outlives_a_restart(tmp_path, capsys):
    """`marge redis-user create` on the shipped server (an operator's account from a file): the run's URL lands in a
    0600 file, runs the whole queue protocol on the run's keys, is refused another run's keys, the shared `marge:`
    keys and dangerous commands, still gets in after redis-server restarts (the ACL file keeps it), and is shut
    out once `marge redis-user delete` removed it."""
    import stat

    import redis

    from marge.contracts.protocol import BatchQueue
    from marge.contracts.slots import CommitRecord, Slots
    from services.cli import main
    from services.driver.redis_server import free_port
    from services.ops.redis_users import PIPELINE_COMMANDS

    assert f'commands="{PIPELINE_COMMANDS}"' in (DEPLOY / "redis" / "start.sh").read_text()  # one set of rights
    port = free_port()
    env = {"MARGE_REDIS_PASSWORD": "pipeline-password-123", "MARGE_REDIS_ADMIN_PASSWORD": "operator-password-456"}
    admin_file = tmp_path / "admin.url"
    admin_file.write_text(f"redis://default:{env['MARGE_REDIS_ADMIN_PASSWORD']}@127.0.0.1:{port}/0\n")
    proc = start_shipped_redis(tmp_path, port, env)
    try:
        assert main(["redis-user", "create", "--run", "r1", "--admin-url-file", str(admin_file),
                     "--out", str(tmp_path / "r1.url")]) == 0
        made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert made["user"] == "marge-r1" and made["saved_to_aclfile"], made
        assert stat.S_IMODE((tmp_path / "r1.url").stat().st_mode) == 0o600
        url = (tmp_path / "r1.url").read_text().strip()
        assert url.startswith("redis://marge-r1:") and url.endswith(f"@127.0.0.1:{port}/0")
        q = BatchQueue.connect(url, "r1", Slots(1, 1))
        assert q.put(0, one_batch(), 10) and q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0"
        assert q.commit(0, 1, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")]))]) == [] and q.counts()["committed_step"] == 1
        other = BatchQueue.connect(url, "r2", Slots(1, 1))
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.put(0, one_batch(), 10)
        client = redis.Redis.from_url(url)
        for refused in (lambda: client.set("marge:r1x:k", 1), lambda: client.get("marge:shared"),
                        client.flushall, lambda: client.config_get("dir")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        stop(proc)
    proc = start_shipped_redis(tmp_path, port, env)  # a restart: the ACL file and the AOF are read again
    try:
        q = BatchQueue.connect(url, "r1", Slots(1, 1))
        assert q.counts()["committed_step"] == 1
        assert main(["redis-user", "delete", "--run", "r1", "--admin-url-file", str(admin_file)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["deleted"]
        with pytest.raises((redis.AuthenticationError, redis.exceptions.ResponseError)):
            redis.Redis.from_url(url).ping()
    finally:
        stop(proc)


def test_marge_cli_small_things(capsys):
    """--version; an unknown model field in `marge info --set` is one line naming the fields; `marge info | head`
    closing the pipe early is not an error."""
    from services.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("marge ")
    assert main(["info", "--preset", "tiny", "--set", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "--set bogus" in err and "'d_model'" in err and "Traceback" not in err
    # the reader is gone before marge writes a line (`| true`): marge's own exit status and no traceback
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m services.cli info --preset tiny | true; "
                                         "echo status ${PIPESTATUS[0]}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "status 0" and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
