"""The image and the deploy files: the image's install script run in a fresh virtual environment (no Docker
daemon needed), and the cluster files checked for what they name (the image the Dockerfile builds, configs and
scripts that exist, the shape KubeRay's RayJob has).

The tests of this subject that need a server or take long are in tests/integration/test_deploy_install.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
IMAGE = "marge:latest"


def strings(tree) -> list[str]:
    """Every string anywhere in a loaded YAML tree."""
    if isinstance(tree, str):
        return [tree]
    if isinstance(tree, dict):
        return [s for k, v in tree.items() for s in (*strings(k), *strings(v))]
    if isinstance(tree, list):
        return [s for v in tree for s in strings(v)]
    return []


def containers(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["template"]["spec"]["containers"]]


def test_the_deploy_files_name_the_image_the_dockerfile_builds_and_files_that_exist():
    dockerfile = (DEPLOY / "image" / "Dockerfile").read_text()
    assert f"-t {IMAGE}" in dockerfile and "deploy/image/install.sh" in dockerfile
    base = re.search(r"^ARG BASE=(\S+)", dockerfile, re.M).group(1)
    assert re.fullmatch(r"rayproject/ray:2\.60\.0-py311-(gpu|cpu)", base), base  # Ray and Python as pinned

    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    rayjob = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    assert cluster["docker"]["image"] == IMAGE
    assert {c["image"] for c in containers(rayjob)} == {IMAGE}

    # the RayJob's shape (KubeRay's ray.io/v1 CRD): what the operator reads, under the names it reads them
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    spec = rayjob["spec"]
    assert isinstance(spec["entrypoint"], str) and set(spec) <= {
        "entrypoint", "rayClusterSpec", "submissionMode", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
        "runtimeEnvYAML", "activeDeadlineSeconds", "backoffLimit", "suspend", "metadata", "jobId",
        "submitterPodTemplate", "submitterConfig", "entrypointNumCpus", "entrypointNumGpus", "entrypointResources",
        "clusterSelector", "managedBy", "deletionStrategy"}, sorted(spec)
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode")
    assert set(spec["rayClusterSpec"]) <= {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
                                           "autoscalerOptions", "authOptions", "headServiceAnnotations", "suspend",
                                           "managedBy", "gcsFaultToleranceOptions"}, sorted(spec["rayClusterSpec"])
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        assert {"groupName", "template", "rayStartParams"} <= set(group), group.keys()
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay wants strings
    assert all(isinstance(v, str) for v in spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].values())

    # every repository path the deploy files name exists (configs the entrypoints train with, scripts they run)
    named = {m for path in (DEPLOY / "cluster.yaml", DEPLOY / "kuberay" / "rayjob.yaml", DEPLOY / "runtime_env.yaml",
                            DEPLOY / "kuberay" / "redis-queue.yaml")
             for text in strings(list(yaml.safe_load_all(path.read_text())))
             for m in re.findall(r"(?<![\w/.])((?:deploy|scripts|services|shared)/[\w./-]+\.(?:yaml|sh|py|conf))", text)}
    assert named, "the deploy files name no repository file"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, missing


def test_the_deploy_files_provision_a_shared_file_system_and_keep_redis_off_the_gcs_port():
    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert "-v /mnt/shared:/mnt/shared" in cluster["docker"]["run_options"]  # into the container, on every node
    setup = " ".join(cluster["initialization_commands"])
    assert "mount -t nfs4" in setup and "mountpoint -q /mnt/shared ||" in setup  # a node without it fails its setup
    gcs_port = re.search(r"ray start --head --port=(\d+)", " ".join(cluster["head_start_ray_commands"])).group(1)
    redis_port = re.search(r"^port (\d+)", (DEPLOY / "redis" / "redis.conf").read_text(), re.M).group(1)
    assert redis_port != gcs_port, "the head's Redis queue and Ray's GCS on one port"

    kuberay = [doc for path in (DEPLOY / "kuberay").glob("*.yaml") for doc in yaml.safe_load_all(path.read_text())]
    claims = {d["metadata"]["name"]: d for d in kuberay if d and d.get("kind") == "PersistentVolumeClaim"}
    rayjob = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    used = {v["persistentVolumeClaim"]["claimName"] for text in [rayjob] for v in volumes(text)
            if "persistentVolumeClaim" in v}
    assert used and used <= set(claims), (used, sorted(claims))
    assert all(claims[name]["spec"]["accessModes"] == ["ReadWriteMany"] for name in used)


def volumes(node):
    """Every pod volume in a manifest (any depth)."""
    if isinstance(node, dict):
        yield from node.get("volumes", [])
        for value in node.values():
            yield from volumes(value)
    elif isinstance(node, list):
        for item in node:
            yield from volumes(item)
