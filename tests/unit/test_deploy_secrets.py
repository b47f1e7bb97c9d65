"""No password in a command line of the deploy files: `ps` shows every process's arguments to every user of a node,
and Kubernetes expands `$(VAR)` from a container's environment into its arguments, so a Secret passed that way is in
redis-server's argv. Secrets reach a process as files (a Kubernetes Secret mounted as a file, a 0600 file on a host).

tests/integration/test_redis_users.py starts the Kubernetes redis container's command on a real redis-server."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

PASSWORD_IN_ARGUMENT = re.compile(
    r"requirepass|masterauth|tls-key-file-pass"  # redis-server's password options
    r"|(?:^|\s)>(?![&>/\s])"  # an ACL rule that sets a password (`--user marge on >P`), not a shell redirection
    r"|\w+://[^/@\s]*:[^/@\s]+@"  # a URL with a password (redis://user:P@host)
    r"|\$\(|\$\{?[A-Z_]*(?:PASSWORD|SECRET|TOKEN)")  # a variable expanded into the argument (Kubernetes' $(VAR), sh)


def pod_specs(node):
    """Every pod spec in a manifest, at any depth (Deployment, StatefulSet, RayJob's groups, ...)."""
    if isinstance(node, dict):
        if "containers" in node:
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for item in node:
            yield from pod_specs(item)


def manifests() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(DEPLOY.rglob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if isinstance(doc, dict)]


def test_no_command_line_of_the_deploy_files_holds_a_password():
    """Every container (init containers too) of every deploy manifest: no argument that holds a password or expands a
    variable, and no environment variable filled from a Secret (a process's environment passes to its children;
    the Secret is mounted as a file and the variable names the file). deploy/cluster.yaml's commands run on the
    hosts: none holds a password either (the Redis URL reaches the containers as a file, MARGE_REDIS_URL_FILE)."""
    containers = [(path, c) for path, doc in manifests() for pod in pod_specs(doc)
                  for c in (*pod["containers"], *pod.get("initContainers", []))]
    assert {path.name for path, _ in containers} >= {"redis-queue.yaml", "rayjob.yaml"}
    for path, container in containers:
        where = f"{path.relative_to(REPO)}: container {container['name']}"
        for argument in (*container.get("command", []), *container.get("args", [])):
            assert not PASSWORD_IN_ARGUMENT.search(str(argument)), f"{where}: argument {argument!r}"
        for variable in container.get("env", []):
            assert "secretKeyRef" not in (variable.get("valueFrom") or {}), f"{where}: env {variable['name']}"
            assert not PASSWORD_IN_ARGUMENT.search(str(variable.get("value", ""))), f"{where}: env {variable['name']}"
    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    commands = [str(line) for key, value in cluster.items() if key.endswith("_commands") for line in value or []]
    assert any("ray start --head" in c for c in commands)
    for command in (*commands, *cluster["docker"]["run_options"]):
        assert not PASSWORD_IN_ARGUMENT.search(command), f"deploy/cluster.yaml: {command}"


def test_the_kuberay_redis_reads_its_passwords_from_the_secret_mounted_as_files():
    """redis-queue.yaml starts redis-server through deploy/redis/start.sh (from a ConfigMap the header says how to
    make), with the password files in the mounted Secret and the ACL file on the persistent volume."""
    text = (DEPLOY / "kuberay" / "redis-queue.yaml").read_text()
    assert ("kubectl create configmap marge-redis-start --from-file=deploy/redis/start.sh "
            "--from-file=deploy/redis/redis.conf") in text
    (statefulset,) = [doc for doc in yaml.safe_load_all(text) if doc["kind"] == "StatefulSet"]
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    start = next(a for a in container["command"] if a.endswith("/start.sh"))
    (start_volume,) = [n for n, v in volumes.items() if v.get("configMap", {}).get("name") == "marge-redis-start"]
    assert start == f"{mounts[start_volume]}/start.sh"
    (secret_volume,) = [n for n, v in volumes.items() if v.get("secret", {}).get("secretName") == "marge-redis"]
    assert env["MARGE_REDIS_PASSWORD_FILE"].startswith(mounts[secret_volume] + "/")
    assert volumes[secret_volume]["secret"]["defaultMode"] & 0o007 == 0  # not readable by other users of the node
    data = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    assert any(env["MARGE_REDIS_ACLFILE"].startswith(mounts[name] + "/") for name in data)  # outlives the pod
    assert "MARGE_REDIS_PASSWORD" not in env and "MARGE_REDIS_ADMIN_PASSWORD" not in env
