"""The queue's Redis users on a real redis-server: what the shared user `marge` and a run's own user may run, and
where their passwords travel (files, never a process's arguments).

Both users share one server with other runs, so a command that reaches beyond a user's keys (the script cache, the
function libraries, the whole keyspace, the server's config) must be refused to them while the queue protocol still
runs."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

OPERATOR_LIBRARY = "#!lua name=operator\nredis.register_function('pong', function() return 'pong' end)"
TENANT_LIBRARY = "#!lua name=tenant\nredis.register_function('flood', function() return 1 end)"

REFUSED = [
    ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("SCRIPT", "DEBUG", "NO"),
    ("FUNCTION", "FLUSH"), ("FUNCTION", "KILL"), ("FUNCTION", "LOAD", TENANT_LIBRARY),
    ("FUNCTION", "DELETE", "operator"), ("FUNCTION", "DUMP"), ("FUNCTION", "LIST"), ("FCALL", "pong", "0"),
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "dir"), ("CONFIG", "SET", "appendonly", "no"),
    ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("MODULE", "LIST"),
    ("ACL", "LIST"), ("ACL", "SETUSER", "intruder", "on", ">x", "~*", "+@all"), ("ACL", "DELUSER", "marge-r2"),
    ("KEYS", "*"), ("SCAN", "0"), ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"), ("INFO",),
]
"""Commands that reach beyond the user's own keys (another run's scripts, functions or keys, the server itself)."""


def start_shipped_redis(tmp_path: Path, port: int, env: dict[str, str], *extra: str) -> subprocess.Popen:
    """deploy/redis/start.sh on loopback, its data and ACL file under tmp_path (the environment's passwords dropped,
    so that only `env` supplies them); returns once redis-server answers."""
    import redis

    base = {k: v for k, v in os.environ.items() if not k.startswith("MARGE_REDIS")}
    proc = subprocess.Popen(["sh", str(DEPLOY / "redis" / "start.sh"), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), *extra],
                            env={**base, "MARGE_REDIS_ACLFILE": str(tmp_path / "users.acl"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 10
    while True:
        try:
            redis.Redis(host="127.0.0.1", port=port).ping()
        except redis.AuthenticationError:
            return proc  # up; the default user is off or wants a password
        except redis.ResponseError:
            return proc
        except redis.ConnectionError:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
            assert time.time() < deadline, "deploy/redis/start.sh: redis-server did not answer within 10 s"
            time.sleep(0.05)
        else:
            return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def run_the_queue_protocol(url: str, run: str) -> None:
    """Every kind of command the pipeline sends: streams, hashes, lists, sets, sorted sets, strings, transactions and
    its Lua scripts (EVAL), on the run's keys."""
    import numpy as np

    from marge.contracts.batch import Batch
    from marge.contracts.protocol import BatchQueue
    from marge.contracts.slots import CommitRecord, Slots

    tokens = (np.arange(4, 9, dtype=np.int32), np.arange(9, 14, dtype=np.int32))
    batch = Batch("v0-e0-s0-0", 0, 0, np.array([1, 2]), ("en", "de"), tokens, np.array([0], dtype=np.int32),
                  np.array([1], dtype=np.int32), np.array([[0, 0]], dtype=np.int32), np.ones(1, dtype=np.float32))
    q = BatchQueue.connect(url, run, Slots(1, 1))
    q.start_generation()
    assert q.put(0, batch, 10) and q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0"
    q.progress(0, 1)
    assert q.commit(0, 1, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")]))]) == []
    assert q.dead_letter(1, {b"header": b"{}"}, "test")
    q.request_replay(q.dead_letters()[0]["entry"])
    q.publish_step({"step": 1})
    q.reset_from(0)  # deletes the later checkpoints' commits (keys the script names itself)
    assert q.counts()["committed_step"] == 0 and q.last_step() == {"step": 1}
    assert q.commit(0, 1, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")]))]) == []
    assert q.committed_steps() == [1] and list(q.commits(1)) == [0]  # the audit's reads: ZRANGE, HGETALL
    q.request_stop()
    assert q.stop_requested()
    echo = q.r.register_script("return redis.call('GET', KEYS[1])")  # EVALSHA, SCRIPT LOAD on NOSCRIPT
    assert echo(keys=[q.keys.stop]) == b"1" and echo(keys=[q.keys.stop]) == b"1"


def test_a_pipeline_user_runs_the_queue_but_nothing_that_reaches_other_runs_or_the_server(tmp_path):
    """The shared user `marge` and a run's own user (`marge redis-user create`) each run the whole queue protocol,
    Lua scripts included, and are refused (NOPERM) every command that reaches past their keys: flushing or killing
    the script cache or another run's script, loading, deleting or calling functions, FLUSHALL/FLUSHDB, CONFIG,
    DEBUG, SHUTDOWN, MODULE, ACL, KEYS/SCAN, CLIENT, INFO. The operator's function and script and a second run's
    cached script survive every attempt."""
    import redis

    from services.driver.redis_server import free_port
    from services.ops.redis_users import create_run_user

    port = free_port()
    env = {"MARGE_REDIS_PASSWORD": "pipeline-password-123", "MARGE_REDIS_ADMIN_PASSWORD": "operator-password-456"}
    # DEBUG is off for every client by default (an ERR before the ACL is consulted): on for loopback clients here,
    # so that the answer tested is the ACL's
    proc = start_shipped_redis(tmp_path, port, env, "--enable-debug-command", "local")
    try:
        admin_url = f"redis://default:{env['MARGE_REDIS_ADMIN_PASSWORD']}@127.0.0.1:{port}/0"
        admin = redis.Redis.from_url(admin_url)
        admin.execute_command("FUNCTION", "LOAD", OPERATOR_LIBRARY)
        operator_sha = admin.script_load("return 'operator'")
        create_run_user(admin_url, "r1", tmp_path / "r1.url")
        create_run_user(admin_url, "r2", tmp_path / "r2.url")
        r2 = redis.Redis.from_url((tmp_path / "r2.url").read_text().strip())
        r2_sha = r2.script_load("return redis.call('GET', KEYS[1])")
        users = {"marge": (f"redis://marge:{env['MARGE_REDIS_PASSWORD']}@127.0.0.1:{port}/0", "shared"),
                 "marge-r1": ((tmp_path / "r1.url").read_text().strip(), "r1")}
        for user, (url, run) in users.items():
            run_the_queue_protocol(url, run)
            client = redis.Redis.from_url(url)
            for command in REFUSED:
                # NoPermissionError is redis-py's NOPERM reply (the ACL's refusal), not the server's other errors
                with pytest.raises(redis.exceptions.NoPermissionError, match=f"no permissions to run the '{command[0].lower()}"):
                    client.execute_command(*command)
                    pytest.fail(f"{user} ran {' '.join(command[:2])}")
        assert admin.ping()  # SHUTDOWN, DEBUG, CLIENT KILL reached nothing
        assert [lib[b"library_name"] if isinstance(lib, dict) else lib[1]
                for lib in admin.execute_command("FUNCTION", "LIST")] == [b"operator"]
        assert admin.execute_command("FCALL", "pong", "0") == b"pong"
        assert admin.script_exists(operator_sha, r2_sha) == [True, True]
        assert r2.evalsha(r2_sha, 1, "marge:r2:absent") is None
        assert admin.config_get("appendonly") == {"appendonly": "yes"}
        assert admin.dbsize() > 0  # the runs' queues are all still there
    finally:
        stop(proc)


def every_cmdline() -> list[str]:
    import psutil

    return [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]


def test_no_queue_redis_has_its_password_in_a_process_argument_or_environment(tmp_path):
    """deploy/redis/start.sh reads both passwords from files (0600 locally, a Secret mounted as a file on Kubernetes)
    and the embedded default's LocalRedis from its 0600 config: no process's arguments hold a password (`ps` shows
    them to every user), nor does redis-server's environment; the users get in with the passwords from the files."""
    import psutil
    import redis

    from services.driver.redis_server import LocalRedis, free_port

    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(mode=0o700)
    passwords = {"password": "pipeline-from-file-7f3a9c", "admin-password": "operator-from-file-2b8e41"}
    for name, value in passwords.items():
        (secrets_dir / name).write_text(value)  # as `kubectl create secret --from-literal` writes it: no newline
        (secrets_dir / name).chmod(0o600)
    port = free_port()
    proc = start_shipped_redis(tmp_path, port, {"MARGE_REDIS_PASSWORD_FILE": str(secrets_dir / "password"),
                                                "MARGE_REDIS_ADMIN_PASSWORD_FILE": str(secrets_dir / "admin-password")})
    local = LocalRedis(tmp_path / "local", password="embedded-default-5d1c07").start()
    try:
        assert redis.Redis.from_url(f"redis://marge:{passwords['password']}@127.0.0.1:{port}/0").ping()
        assert redis.Redis.from_url(f"redis://default:{passwords['admin-password']}@127.0.0.1:{port}/0").ping()
        assert redis.Redis.from_url(local.url).ping()
        assert "redis-server" in " ".join(psutil.Process(proc.pid).cmdline())  # start.sh became redis-server
        for secret in (*passwords.values(), local.password):
            assert not [line for line in every_cmdline() if secret in line]
        assert not [s for s in passwords.values() if s in (tmp_path / "users.acl").read_text()]  # hashes only
        environment = psutil.Process(proc.pid).environ()
        assert not [k for k, v in environment.items() if any(s in v for s in passwords.values())], sorted(environment)
    finally:
        local.stop()
        stop(proc)


def test_start_sh_names_a_password_file_that_is_missing_or_holds_a_space(tmp_path):
    """A password file start.sh cannot use is named, with what to do, before redis-server starts."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MARGE_REDIS")}
    missing = subprocess.run(["sh", str(DEPLOY / "redis" / "start.sh"), "--port", "0"], capture_output=True, text=True,
                             env={**base, "MARGE_REDIS_PASSWORD_FILE": str(tmp_path / "absent"),
                                  "MARGE_REDIS_ACLFILE": str(tmp_path / "users.acl")}, timeout=30)
    assert missing.returncode != 0 and f"MARGE_REDIS_PASSWORD_FILE={tmp_path / 'absent'}" in missing.stderr
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    bad = subprocess.run(["sh", str(DEPLOY / "redis" / "start.sh"), "--port", "0"], capture_output=True, text=True,
                         env={**base, "MARGE_REDIS_PASSWORD_FILE": str(spaced),
                              "MARGE_REDIS_ACLFILE": str(tmp_path / "users.acl")}, timeout=30)
    assert bad.returncode != 0 and "space" in bad.stderr and str(spaced) in bad.stderr
    assert not (tmp_path / "users.acl").exists()
    # an optional admin Secret that was not created: the default user is off, and the start says so
    good = tmp_path / "good"
    good.write_text("pipeline-\\back\\nslash\n")
    off = subprocess.run(["sh", str(DEPLOY / "redis" / "start.sh")], capture_output=True, text=True, timeout=30,
                         env={**base, "MARGE_REDIS_PASSWORD_FILE": str(good), "REDIS_SERVER": "true",
                              "MARGE_REDIS_ADMIN_PASSWORD_FILE": str(tmp_path / "no-admin"),
                              "MARGE_REDIS_ACLFILE": str(tmp_path / "users.acl")})
    assert off.returncode == 0 and f"no {tmp_path / 'no-admin'}: the default user is off" in off.stderr
    users = (tmp_path / "users.acl").read_text().splitlines()
    assert users[0] == "user default off resetchannels -@all"
    digest = hashlib.sha256(b"pipeline-\\back\\nslash").hexdigest()  # the password's bytes, backslashes as written
    assert users[1].startswith(f"user marge on #{digest} ~marge:* ")  # its hash, not the password


def test_the_kuberay_redis_container_starts_from_its_mounted_files_with_the_pipeline_rights(tmp_path):
    """The redis container of deploy/kuberay/redis-queue.yaml, run here as the manifest says (its command, arguments
    and environment; each volume a folder under tmp_path holding what Kubernetes would mount: the ConfigMap's
    start.sh and redis.conf, the Secret's password file, the optional admin Secret not created, an empty data
    volume), on loopback: the pipeline user gets in with the Secret's password, runs the queue protocol and is
    refused the script cache, the default user is off, the users are kept on the data volume, and no process's
    arguments hold the password."""
    import redis

    from services.driver.redis_server import free_port

    (statefulset,) = [doc for doc in yaml.safe_load_all((DEPLOY / "kuberay" / "redis-queue.yaml").read_text())
                      if doc["kind"] == "StatefulSet"]
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    secret = {"password": "kuberay-pipeline-password-91c2"}  # the Secret marge-redis, key `password`
    folders: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        folder = folders[mount["mountPath"]] = tmp_path / mount["name"]
        folder.mkdir()
        if mount["name"] in claims:
            continue
        source = volumes[mount["name"]]
        if "configMap" in source:  # kubectl create configmap marge-redis-start --from-file=... (the header)
            for name in ("start.sh", "redis.conf"):
                shutil.copy(DEPLOY / "redis" / name, folder / name)
        elif source["secret"]["secretName"] == "marge-redis":
            for item in source["secret"]["items"]:
                (folder / item["path"]).write_text(secret[item["key"]])
        else:
            assert source["secret"].get("optional"), source  # only an optional Secret may be absent

    def here(text: str) -> str:
        for path, folder in folders.items():
            if text == path or text.startswith(path + "/"):
                return str(folder) + text[len(path):]
        return text

    argv = [here(a) for a in (*container["command"], *container.get("args", []))]
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARGE_REDIS")}
    env |= {e["name"]: here(e["value"]) for e in container["env"]}
    proc = subprocess.Popen([*argv, "--bind", "127.0.0.1"], env=env, stdout=subprocess.PIPE,  # loopback, not the pod's
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"redis://marge:{secret['password']}@127.0.0.1:{port}/0"
        deadline = time.time() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
                assert time.time() < deadline, f"{' '.join(argv)}: redis-server did not answer within 10 s"
                time.sleep(0.05)
        run_the_queue_protocol(url, "kuberay")
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url).script_flush()
        with pytest.raises((redis.AuthenticationError, redis.exceptions.NoPermissionError)):
            redis.Redis(host="127.0.0.1", port=port).set("marge:x", 1)
        acl = [folders[m["mountPath"]] for m in container["volumeMounts"] if m["name"] in claims][0] / "users.acl"
        assert acl.read_text().startswith("user default off") and "user marge on" in acl.read_text()
        assert not [line for line in every_cmdline() if secret["password"] in line]
    finally:
        stop(proc)
