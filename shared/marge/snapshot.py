"""Relevance-encoder snapshots: how the trainer publishes weights for the indexer and the retrieval service.

    snapshots/
      LATEST                     {"step": 200, "dir": "step-00000200"}   (atomic rename; only moves forward)
      step-00000200/
        relevance.safetensors    the RelevanceEncoder tensors (no pickle)
        manifest.json            format, step, model config, tokenizer sha256, weights sha256

A snapshot folder is built under a temporary name and renamed into place, and LATEST is written
after it, so a reader that follows LATEST always finds a complete snapshot.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from marge.model import Marge, MargeConfig, RelevanceEncoder, relevance_state_dict
from marge.utils import atomic_directory, atomic_write_text, sha256_file

SNAPSHOT_FORMAT = "marge-relevance-snapshot"
SNAPSHOT_VERSION = 1


class SnapshotError(ValueError):
    pass


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: Path
    manifest: dict[str, Any]

    @property
    def model_config(self) -> MargeConfig:
        return MargeConfig.from_dict(self.manifest["model_config"])


def snapshot_dirname(step: int) -> str:
    return f"step-{step:08d}"


def publish_snapshot(root: Path, model: Marge, step: int, tokenizer_sha256: str) -> SnapshotInfo:
    """Write the relevance encoder of `model` as snapshot `step` and point LATEST at it."""
    root = Path(root)
    target = root / snapshot_dirname(step)
    tensors = {k: v.float().contiguous().cpu() for k, v in relevance_state_dict(model).items()}
    with atomic_directory(target, overwrite=True) as tmp:
        save_file(tensors, str(tmp / "relevance.safetensors"))
        manifest = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "step": step,
                    "model_config": model.cfg.to_dict(), "tokenizer_sha256": tokenizer_sha256,
                    "weights_sha256": sha256_file(tmp / "relevance.safetensors"), "created_unix": time.time()}
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    current = latest_snapshot(root)
    if current is None or current.step < step:
        atomic_write_text(root / "LATEST", json.dumps({"step": step, "dir": target.name}) + "\n")
    return SnapshotInfo(step, target, manifest)


def read_snapshot(path: Path, verify: bool = True) -> SnapshotInfo:
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise SnapshotError(f"{manifest_path} is missing: {path} is not a complete snapshot")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if manifest.get("format") != SNAPSHOT_FORMAT or manifest.get("version") != SNAPSHOT_VERSION:
        raise SnapshotError(f"{manifest_path}: not a version-{SNAPSHOT_VERSION} {SNAPSHOT_FORMAT} manifest")
    if verify and sha256_file(path / "relevance.safetensors") != manifest["weights_sha256"]:
        raise SnapshotError(f"{path / 'relevance.safetensors'}: sha256 does not match its manifest (corrupt snapshot)")
    return SnapshotInfo(int(manifest["step"]), path, manifest)


def latest_snapshot(root: Path) -> SnapshotInfo | None:
    """The snapshot LATEST points at, or None when nothing has been published yet."""
    pointer = Path(root) / "LATEST"
    if not pointer.exists():
        return None
    latest = json.loads(pointer.read_text(encoding="utf-8"))
    return read_snapshot(Path(root) / latest["dir"], verify=False)


def drop_snapshots_after(root: Path, step: int) -> list[int]:
    """Delete snapshots of updates after `step` (a resumed run's discarded lineage) and point LATEST at the newest
    one left. Returns the steps deleted."""
    import shutil

    root = Path(root)
    dropped = []
    for path in sorted(root.glob("step-*")):
        if (path / "manifest.json").exists() and int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
            dropped.append(int(path.name.split("-")[1]))
    if dropped:
        kept = sorted(p for p in root.glob("step-*") if (p / "manifest.json").exists())
        if kept:
            atomic_write_text(root / "LATEST", json.dumps({"step": int(kept[-1].name.split("-")[1]),
                                                           "dir": kept[-1].name}) + "\n")
        else:
            (root / "LATEST").unlink(missing_ok=True)
    return dropped


def load_relevance_encoder(info: SnapshotInfo, device: str | torch.device = "cpu") -> RelevanceEncoder:
    encoder = RelevanceEncoder(info.model_config)
    state = load_file(str(info.path / "relevance.safetensors"), device=str(device))
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SnapshotError(f"{info.path}: snapshot tensors do not fit the relevance encoder "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return encoder.to(device).eval()
