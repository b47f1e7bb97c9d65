"""Training checkpoints: the whole training state, in a folder Ray Train persists.

    model.safetensors     model weights (what eval, translate and serve load)
    model_config.json     the model's config (MargeConfig; a VecoConfig carries "family": "veco")
    training_state.pt     optimizer, LR schedule, step, RNG states, consumed batch ids (torch.save of
                          tensors and plain containers only; loaded with weights_only=True)
    tokenizer.model/.json the tokenizer the model was trained with
    manifest.json         written last: format, step, sha256 of every file

`marge eval retrieval --checkpoint PATH` and friends accept such a folder. Unlike the other artifacts, a
checkpoint is written in place, into a folder its caller provides (a temporary one `atomic_directory` renames, or
the one Ray Train uploads); the manifest, written last (marge.artifacts), is what makes it a checkpoint. This
module keeps the schema: which files, which manifest fields.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from torch import nn

from marge import artifacts
from marge.model import Marge, MargeConfig
from marge.utils import atomic_write_text
from marge.veco import FAMILY, Veco, VecoConfig

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "marge-checkpoint"
FINETUNED_FORMAT = "marge-finetuned"
"""A `marge finetune` output (marge.finetuned): the same manifest, its own files."""
CHECKPOINT_VERSION = 1
FILES = ("model.safetensors", "model_config.json", "training_state.pt", "tokenizer.model", "tokenizer.json")


HINT = "; pass the folder `marge pretrain` printed as `checkpoint`"


class CheckpointError(artifacts.ArtifactError):
    pass


def saved_config(cfg) -> dict[str, Any]:
    """A model config as model_config.json holds it: MargeConfig's fields (the format since the first release),
    or VecoConfig's plus `"family": "veco"`."""
    return {"family": FAMILY, **cfg.to_dict()} if isinstance(cfg, VecoConfig) else cfg.to_dict()


def config_from_saved(values: dict[str, Any]):
    """The MargeConfig or VecoConfig a model_config.json describes."""
    values = dict(values)
    family = values.pop("family", "marge")
    if family == FAMILY:
        return VecoConfig.from_dict(values)
    if family != "marge":
        raise CheckpointError(f"model family {family!r} is unknown to this version of marge (known: marge, veco)")
    return MargeConfig.from_dict(values)


def build_model(cfg) -> nn.Module:
    """A freshly initialised model of the config's family."""
    return Veco(cfg) if isinstance(cfg, VecoConfig) else Marge(cfg)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(int(x) for x in state["python"]), state["python_pos"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, model: Marge, optimizer, scheduler, step: int, tokenizer_dir: Path,
                    training_state: dict[str, Any], before_manifest=None) -> Path:
    """Write a complete checkpoint into `directory` (manifest last: a folder without one is not a checkpoint).

    `before_manifest` is called with every file written but the manifest (the fault suite dies there)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    atomic_write_text(directory / "model_config.json", json.dumps(saved_config(model.cfg), indent=2) + "\n")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                "rng": rng_state(), **training_state}, directory / "training_state.pt")
    for name in ("tokenizer.model", "tokenizer.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    if before_manifest is not None:
        before_manifest()
    write_manifest(directory, CHECKPOINT_FORMAT, FILES, step=step)
    return directory


def write_manifest(directory: Path, fmt: str, files: tuple[str, ...], **extra: Any) -> None:
    """The manifest that makes a folder complete, written last: its format, the sha256 of each of `files`."""
    artifacts.write_manifest(directory, {
        "format": fmt, "version": CHECKPOINT_VERSION, **extra, "created_unix": time.time(),
        "sha256": artifacts.file_sha256s(directory, files, what="checkpoint", error=CheckpointError)})


def read_manifest(directory: Path, verify: bool = True, formats: tuple[str, ...] = (CHECKPOINT_FORMAT,)) -> dict[str, Any]:
    """A folder's manifest, checked to be one of `formats` and (with `verify`) to match every file's sha256."""
    directory = Path(directory)
    manifest = artifacts.read_manifest(directory, formats, (CHECKPOINT_VERSION,), fields=("sha256",),
                                       what="MARGE checkpoint", hint=HINT, error=CheckpointError)
    if not isinstance(manifest["sha256"], dict):
        raise CheckpointError(f"{directory / artifacts.MANIFEST}: field 'sha256' is {manifest['sha256']!r}, expected "
                              "a mapping of file name to sha256")
    if verify:
        artifacts.verify_checksums(directory, manifest["sha256"], what="MARGE checkpoint", error=CheckpointError)
    return manifest


def checkpoint_order(path: Path) -> tuple[int, int]:
    """(update, attempt) of a checkpoint folder `step-<update>[-<attempt>]`: a run resumed from an older
    checkpoint writes the update again as `step-<update>-1` (then -2, ...), never over the folder it abandoned."""
    parts = Path(path).name.split("-")
    try:
        return int(parts[1]), int(parts[2]) if len(parts) > 2 else 0
    except (IndexError, ValueError):
        raise CheckpointError(f"{path}: not a checkpoint folder name (step-<update>[-<attempt>])") from None


def checkpoint_dir_name(root: Path, step: int) -> str:
    """The folder name for the checkpoint of `step` under `root`: `step-<step>`, or the next free attempt."""
    name, attempt = f"step-{step:08d}", 0
    while (Path(root) / (name if attempt == 0 else f"{name}-{attempt}")).exists():
        attempt += 1
    return name if attempt == 0 else f"{name}-{attempt}"


CHECKPOINTS = artifacts.Series("step-*", checkpoint_order, what="checkpoint", error=CheckpointError)
"""Checkpoint folders under a run's checkpoint root: no LATEST (the newest good one is searched for), and Ray
Train, or the single process, prunes them."""


def complete_checkpoints(root: Path) -> list[Path]:
    """The `step-*` checkpoints under `root` that have a manifest, oldest first (not verified); of two attempts at
    one update, the later one last."""
    return CHECKPOINTS.versions(root)


def newest_good_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose files match its manifest; older ones are tried when the newest
    is corrupt (each one skipped is logged)."""
    for path in reversed(complete_checkpoints(root)):
        try:
            read_manifest(path, verify=True)
            return path
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    return None


def load_training_state(directory: Path, verify: bool = True) -> dict[str, Any]:
    read_manifest(directory, verify=verify)
    return torch.load(Path(directory) / "training_state.pt", map_location="cpu", weights_only=True)


def restore_training(directory: Path, model: Marge, optimizer, scheduler, device: str | torch.device = "cpu",
                     verify: bool = True) -> dict[str, Any]:
    """Put a checkpoint's weights, optimizer, schedule and RNG back (verified against the manifest unless `verify`
    is False: a DDP rank whose rank 0 verified it); returns the rest of its training state (step, consumed batches,
    and whatever the trainer saved)."""
    state = load_training_state(directory, verify)
    model.load_state_dict(load_file(str(Path(directory) / "model.safetensors"), device=str(device)))
    optimizer.load_state_dict(state.pop("optimizer"))
    scheduler.load_state_dict(state.pop("scheduler"))
    set_rng_state(state.pop("rng"))
    return state


def load_model(directory: Path, device: str | torch.device = "cpu") -> nn.Module:
    """The trained model in a checkpoint folder (eval mode): a `Marge`, or a `Veco` for a VECO run.

    A fine-tuned model folder (`marge finetune`) loads too, as its MARGE model without a classifier head
    (`marge.finetuned.load` gives the whole fine-tuned model)."""
    directory = Path(directory)
    manifest = read_manifest(directory, formats=(CHECKPOINT_FORMAT, FINETUNED_FORMAT))
    model = build_model(config_from_saved(json.loads((directory / "model_config.json").read_text(encoding="utf-8"))))
    weights = load_file(str(directory / "model.safetensors"), device="cpu")
    if manifest["format"] == FINETUNED_FORMAT:
        weights = {k: v for k, v in weights.items() if not k.startswith("classifier.")}
    model.load_state_dict(weights)
    return model.to(device).eval()


def save_model_weights(path: Path, model: nn.Module) -> None:
    """Weights alone plus config next to them (the run's initial model)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(path))
    atomic_write_text(path.with_suffix(".json"), json.dumps(saved_config(model.cfg), indent=2) + "\n")


def load_model_weights(path: Path) -> nn.Module:
    path = Path(path)
    model = load_model_shell(path)
    model.load_state_dict(load_file(str(path), device="cpu"))
    return model


def load_model_shell(path: Path) -> nn.Module:
    """The model `path` (a `model.safetensors` beside its `model.json`) holds, built from its config with freshly
    initialised weights and without reading the weights file: for a rank that loads a checkpoint over it."""
    return build_model(config_from_saved(json.loads(Path(path).with_suffix(".json").read_text(encoding="utf-8"))))
