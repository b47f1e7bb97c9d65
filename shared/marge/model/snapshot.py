"""Relevance-encoder snapshots: how the trainer publishes weights for the indexer and the retrieval service.

    snapshots/
      LATEST                     {"step": 200, "dir": "step-00000200"}   (atomic rename; only moves forward)
      step-00000200/
        relevance.safetensors    the RelevanceEncoder tensors (no pickle)
        manifest.json            format, step, model config, tokenizer sha256, weights sha256

A snapshot is published the way every artifact is (marge.contracts.artifacts): built under a temporary name, manifest
last, renamed into place, and LATEST moved after it, so a reader that follows LATEST always finds a complete
snapshot. This module keeps the schema: which files, which manifest fields.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from marge.contracts import artifacts
from marge.model.architecture import MargeConfig
from marge.model.network import Marge, RelevanceEncoder, relevance_state_dict
from marge.util.files import sha256_file

SNAPSHOT_FORMAT = "marge-relevance-snapshot"
SNAPSHOT_VERSION = 1
WEIGHTS_FILE = "relevance.safetensors"
MANIFEST_FIELDS = ("step", "model_config", "tokenizer_sha256", "weights_sha256")


class SnapshotError(artifacts.ArtifactError):
    pass


class SnapshotInfo(artifacts.Artifact):
    """A committed snapshot: `number` is the update it was taken at."""

    @property
    def step(self) -> int:
        return self.number

    @property
    def model_config(self) -> MargeConfig:
        return MargeConfig.from_dict(self.manifest["model_config"])


def snapshot_dirname(step: int) -> str:
    return f"step-{step:08d}"


def _step_of(name: str) -> int:
    return int(name.split("-")[1])


SNAPSHOTS = artifacts.Series("step-*", _step_of, pointer_field="step", what="snapshot", error=SnapshotError)


def publish_snapshot(root: Path, model: Marge, step: int, tokenizer_sha256: str) -> SnapshotInfo:
    """Write the relevance encoder of `model` as snapshot `step` and point LATEST at it."""
    root = Path(root)
    target = root / snapshot_dirname(step)
    tensors = {k: v.float().contiguous().cpu() for k, v in relevance_state_dict(model).items()}
    with artifacts.publish_dir(target, overwrite=True, error=SnapshotError) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        manifest = artifacts.write_manifest(tmp, {
            "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "step": step, "model_config": model.cfg.to_dict(),
            "tokenizer_sha256": tokenizer_sha256, "weights_sha256": sha256_file(tmp / WEIGHTS_FILE),
            "created_unix": time.time()})
    SNAPSHOTS.set_latest(root, target.name)
    return SnapshotInfo(step, target, manifest)


def read_snapshot(path: Path, verify: bool = True) -> SnapshotInfo:
    path = Path(path)
    manifest = artifacts.read_manifest(
        path, SNAPSHOT_FORMAT, (SNAPSHOT_VERSION,), fields=MANIFEST_FIELDS,
        checksums=(lambda m: {WEIGHTS_FILE: m["weights_sha256"]}) if verify else None,
        what="snapshot", error=SnapshotError)
    return SnapshotInfo(int(manifest["step"]), path, manifest)


def latest_snapshot(root: Path) -> SnapshotInfo | None:
    """The snapshot LATEST points at, or None when nothing has been published yet."""
    path = SNAPSHOTS.latest(root)
    return None if path is None else read_snapshot(path, verify=False)


def prune_snapshots(root: Path, keep_steps: set[int], keep_last: int) -> list[int]:
    """Delete the committed snapshots that are neither in `keep_steps` nor among the newest `keep_last` (nor the one
    LATEST names). Returns the steps deleted."""
    committed = SNAPSHOTS.versions(root)
    newest = {_step_of(p.name) for p in committed[-keep_last:]} if keep_last > 0 else set()
    pointed = SNAPSHOTS.latest(root)
    doomed = [p for p in committed if _step_of(p.name) not in keep_steps | newest
              and (pointed is None or p.name != pointed.name)]
    for path in doomed:
        artifacts.remove(path, ignore_errors=True)  # a reader still holding it may keep its files busy
    return [_step_of(p.name) for p in doomed]


def drop_snapshots_after(root: Path, step: int) -> list[int]:
    """Delete snapshots of updates after `step` (a resumed run's discarded lineage) and point LATEST at the newest
    one left. Returns the steps deleted."""
    return SNAPSHOTS.drop_after(root, step)


def load_relevance_encoder(info: SnapshotInfo, device: str | torch.device = "cpu") -> RelevanceEncoder:
    encoder = RelevanceEncoder(info.model_config)
    state = load_file(str(info.path / WEIGHTS_FILE), device=str(device))
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SnapshotError(f"{info.path}: snapshot tensors do not fit the relevance encoder "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return encoder.to(device).eval()
