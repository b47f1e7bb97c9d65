"""Restoring a training checkpoint into a model and optimizer, with no rank holding the training state on its host.

A format 2 checkpoint (marge.model.checkpoint) holds the training state as flat keys (`model/<name>`,
`optim/<parameter>/<state>`, big tensors as row blocks `<key>#<i>`). A restore puts them straight into the tensors
they belong to, the *targets*: the model's own weights and buffers (on the device it trains on) and the optimizer's
moments, allocated on each parameter's device.

    shares     the keys are shared out over the ranks by size (`partition`, for the world that restores, whatever the
               world that saved): each rank reads about checkpoint size / world from storage
    rounds     each rank cuts its share into batches of at most `batch_bytes` (one key when a key is bigger); in
               round k every rank reads its k-th batch at once and checks each tensor's sha256 against the manifest
               (any mismatch: every rank raises CheckpointError), then each owner's batch is broadcast on `group`
               and every rank copies it into its targets
    host       a rank holds one batch it read and one broadcast buffer at a time: at most about
               2 x max(batch_bytes, the largest key) of host memory (`stats["restore_host_bytes"]`), not the
               training state (11.6 GB at the paper's 963M parameters with AdamW); the full state exists once per
               rank, where it trains

Without a process group the process is the whole world: it reads every key, a batch at a time, with the same
bound. Format 1 checkpoints (one `model.safetensors`, `training_state.pt` with the optimizer) load whole, as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from marge.model.checkpoint import (
    CHECKPOINT_FORMAT,
    FINETUNED_FORMAT,
    HINT,
    LOCAL,
    STATE_DIR,
    CheckpointError,
    _distributed,
    _load,
    _rank_world,
    _state_reader,
    build_model,
    config_from_saved,
    mismatched,
    param_names,
    partition,
    read_manifest,
    set_rng_state,
    sharded,
)

RESTORE_BATCH_BYTES = 64 << 20
"""The host bytes a rank reads (and broadcasts) at a time while restoring: with the broadcast buffer, a rank's host
memory over a restore is about twice this (or twice the largest key, `PART_BYTES` for a cut tensor)."""


@dataclass(frozen=True)
class StoredKey:
    """One key of a checkpoint's state: where its tensor goes."""

    key: str
    """`model/<name>[#<i>]` or `optim/<parameter>/<state>[#<i>]`."""
    name: str
    """The key without its block suffix: the tensor it is part of."""
    first_row: int
    """The block's first row in that tensor (0 for a key that is not a block)."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def stored_keys(metadata) -> dict[str, StoredKey]:
    """Every key of a checkpoint's `state/.metadata`, with the row at which each block starts in its tensor."""
    by_name: dict[str, list[tuple[int, str]]] = {}
    for key in metadata.state_dict_metadata:
        name, _, index = key.partition("#")
        by_name.setdefault(name, []).append((int(index or 0), key))
    out: dict[str, StoredKey] = {}
    for name, blocks in by_name.items():
        row = 0
        for _, key in sorted(blocks):
            md = metadata.state_dict_metadata[key]
            shape = tuple(md.size)
            out[key] = StoredKey(key, name, row, shape, md.properties.dtype)
            row += shape[0] if shape else 0
    return out


def full_shapes(keys: dict[str, StoredKey]) -> dict[str, tuple[int, ...]]:
    """The shape of each whole tensor (its blocks' rows added up)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for k in keys.values():
        if k.name not in shapes:
            shapes[k.name] = k.shape
        elif k.shape:
            before = shapes[k.name]
            shapes[k.name] = (max(before[0], k.first_row + k.shape[0]), *before[1:])
    return shapes


def model_targets(model: nn.Module, keys: dict[str, StoredKey], where: Path) -> dict[str, torch.Tensor]:
    """The model's own state tensor (a row block of it) for each `model/` key of `keys`. Raises CheckpointError,
    naming `where`, for a model that is not the checkpoint's."""
    shapes = {name: shape for name, shape in full_shapes(keys).items() if name.startswith("model/")}
    own = model.state_dict()
    saved = {name[len("model/"):] for name in shapes}
    if saved != set(own):
        missing, unexpected = sorted(set(own) - saved), sorted(saved - set(own))
        raise CheckpointError(f"{where}: the checkpoint's weights are not this model's (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}): use the model config it was trained with")
    wholes = {}
    for name, shape in shapes.items():
        target = own[name[len("model/"):]]
        if tuple(target.shape) != shape:
            raise CheckpointError(f"{where}: {name} is {list(shape)} in the checkpoint and {list(target.shape)} in "
                                  "this model: use the model config it was trained with")
        wholes[name] = target
    return block_views(keys, wholes)


def optimizer_targets(model: nn.Module, optimizer, keys: dict[str, StoredKey], where: Path
                      ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """(a fresh tensor, or a row block of one, for each `optim/` key of `keys`; the optimizer state those make up:
    parameter index -> state name -> tensor). Each on its parameter's device; a 0-dim state (AdamW's step) on the
    host, where `load_state_dict` takes it from."""
    index = {name: i for i, name in enumerate(param_names(model, optimizer))}
    params = dict(model.named_parameters())
    dtypes = {k.name: k.dtype for k in keys.values()}
    wholes: dict[str, torch.Tensor] = {}
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for name, shape in full_shapes(keys).items():
        if not name.startswith("optim/"):
            continue
        parameter, _, state = name[len("optim/"):].rpartition("/")
        if parameter not in index:
            raise CheckpointError(f"{where}: the optimizer state of parameter {parameter!r} has no parameter of that "
                                  "name in this model")
        device = params[parameter].device if shape else torch.device("cpu")
        wholes[name] = torch.empty(shape, dtype=dtypes[name], device=device)
        moments.setdefault(index[parameter], {})[state] = wholes[name]
    return block_views(keys, wholes), moments


def block_views(keys: dict[str, StoredKey], wholes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For each key whose tensor is in `wholes`: that tensor, or the rows of it the key's block holds."""
    return {k.key: wholes[k.name] if k.key == k.name else wholes[k.name].narrow(0, k.first_row, k.shape[0])
            for k in keys.values() if k.name in wholes}


def batches(share: list[str], keys: dict[str, StoredKey], batch_bytes: int) -> list[list[str]]:
    """`share` cut in order into batches of at most `batch_bytes` (a key bigger than that is a batch of its own)."""
    out: list[list[str]] = []
    size = 0
    for key in share:
        if not out or size + keys[key].nbytes > batch_bytes:
            out.append([])
            size = 0
        out[-1].append(key)
        size += keys[key].nbytes
    return out


def read_into(directory: Path, manifest: dict[str, Any], reader, targets: dict[str, torch.Tensor], group=None,
              stats: dict | None = None, batch_bytes: int = RESTORE_BATCH_BYTES) -> None:
    """The keys of a format 2 checkpoint that `targets` names, each copied into `targets[key]`, in rounds (see the
    module docstring), read through `reader` (`_state_reader` of `directory`, whose metadata is read once); every
    rank of `group` calls it (collective). Raises CheckpointError on every rank when a tensor any rank read does
    not match the manifest's sha256 (the targets are then partly written: restore them from another checkpoint)."""
    import torch.distributed as dist

    distributed = _distributed(group)
    rank, world = _rank_world(group)
    keys = {k: v for k, v in stored_keys(reader.read_metadata()).items() if k in targets}
    if len(keys) != len(targets):
        absent = sorted(set(targets) - set(keys))
        raise CheckpointError(f"{Path(directory) / STATE_DIR}: holds no {absent[:3]}: the checkpoint is incomplete"
                              f"{HINT}")
    owners = partition({k: v.nbytes for k, v in keys.items()}, world)
    plan = [batches(share, keys, batch_bytes) for share in owners]
    host_peak = 0
    for batch_keys in zip_longest_rounds(plan):
        mine = batch_keys[rank]
        read = {k: torch.empty(keys[k].shape, dtype=keys[k].dtype) for k in mine}
        if read:
            _load(read, reader, directory, None, False)
        bad = mismatched(read, manifest["tensors"])
        failed = len(bad)
        if distributed:
            flag = torch.tensor([failed])
            dist.all_reduce(flag, group=group)  # a host decision on a host tensor (gloo)
            failed = int(flag)
        if failed:
            raise CheckpointError(f"{Path(directory) / STATE_DIR}: {failed} tensor(s) do not match the manifest's "
                                  f"sha256 ({', '.join(bad[:3]) or 'on another rank'}): the checkpoint is corrupt"
                                  f"{HINT}")
        received = 0
        for owner, owned in enumerate(batch_keys):
            if owner == rank:
                with torch.no_grad():
                    for k in owned:
                        targets[k].copy_(read[k])
            if distributed and owned:  # every rank in owner order: the broadcasts pair up
                received = max(received, broadcast_into(owned, keys, targets, owner, group,
                                                        read=read if owner == rank else None))
        host_peak = max(host_peak, sum(t.numel() * t.element_size() for t in read.values()) + received)
        del read
    if stats is not None:
        stats["state_bytes_read"] = stats.get("state_bytes_read", 0) + reader.bytes_read
        stats["state_bytes"] = sum(k.nbytes for k in keys.values())
        stats["restore_host_bytes"] = max(stats.get("restore_host_bytes", 0), host_peak)


def zip_longest_rounds(plan: list[list[list[str]]]) -> Iterator[list[list[str]]]:
    """Round k: each rank's k-th batch (empty for a rank whose share has fewer)."""
    for k in range(max((len(p) for p in plan), default=0)):
        yield [p[k] if k < len(p) else [] for p in plan]


def broadcast_into(owned: list[str], keys: dict[str, StoredKey], targets: dict[str, torch.Tensor], owner: int,
                   group, read: dict[str, torch.Tensor] | None) -> int:
    """`owner`'s batch `owned` broadcast to every rank of `group` (one flat host tensor per dtype; `read` holds the
    tensors on the owner, None elsewhere) and copied into `targets` on the receivers. Returns the host bytes of the
    largest buffer it held."""
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[str]] = {}
    for k in owned:
        by_dtype.setdefault(keys[k].dtype, []).append(k)
    src = dist.get_global_rank(group, owner) if group is not None else owner
    largest = 0
    for dtype, ks in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        numel = [targets[k].numel() for k in ks]
        flat = torch.cat([read[k].reshape(-1) for k in ks]) if read is not None else \
            torch.empty(sum(numel), dtype=dtype)
        dist.broadcast(flat, src=src, group=group)
        largest = max(largest, flat.numel() * flat.element_size())
        if read is None:
            with torch.no_grad():
                for k, piece in zip(ks, torch.split(flat, numel)):
                    targets[k].copy_(piece.view(keys[k].shape))
        del flat
    return largest


def restore_training(directory: Path, model: nn.Module, optimizer, scheduler, device: str | torch.device = "cpu",
                     verify: bool = True, group=None, stats: dict | None = None,
                     batch_bytes: int = RESTORE_BATCH_BYTES) -> dict[str, Any]:
    """Put a checkpoint's weights, optimizer, schedule and RNG back (verified against the manifest unless `verify`
    is False: a DDP rank whose rank 0 verified it); returns the rest of its training state (step, consumed batches,
    and whatever the trainer saved).

    A format 2 checkpoint in a process group: every rank calls it, reads its share and gets the rest from the
    others (`read_into`), whatever the world that saved it, straight into the model (on the device it is on) and the
    optimizer; `stats` gets the bytes read from storage and the host bytes held at once."""
    directory = Path(directory)
    manifest = read_manifest(directory, verify=verify)
    if stats is not None:  # the files read whole: the manifest, the verified ones, the training state (and weights)
        files = ["manifest.json"] + (list(manifest["sha256"]) if verify else [])
        files += ["training_state.pt"] + ([] if sharded(manifest) else ["model.safetensors"])
        stats["small_bytes_read"] = sum((directory / n).stat().st_size for n in files)
    state = torch.load(directory / "training_state.pt", map_location="cpu", weights_only=True)
    if not sharded(manifest):
        model.load_state_dict(load_file(str(directory / "model.safetensors"), device=str(device)))
        optimizer.load_state_dict(state.pop("optimizer"))
        scheduler.load_state_dict(state.pop("scheduler"))
        set_rng_state(state.pop("rng"))
        return state
    saved_names = state.pop("param_names")
    if saved_names != param_names(model, optimizer):
        raise CheckpointError(f"{directory}: the optimizer's parameters differ from this model's "
                              f"({len(saved_names)} saved, {len(param_names(model, optimizer))} here)")
    reader = _state_reader(directory)
    keys = stored_keys(reader.read_metadata())
    targets, moments = optimizer_targets(model, optimizer, keys, directory)
    targets.update(model_targets(model, keys, directory))
    read_into(directory, manifest, reader, targets, group=group, stats=stats, batch_bytes=batch_bytes)
    for i, other in state.pop("optimizer_other").items():
        moments.setdefault(int(i), {}).update(other)
    optimizer.load_state_dict({"state": moments, "param_groups": state.pop("param_groups")})
    scheduler.load_state_dict(state.pop("scheduler"))
    set_rng_state(state.pop("rng"))
    return state


def load_model(directory: Path, device: str | torch.device = "cpu") -> nn.Module:
    """The trained model in a checkpoint folder (eval mode), built on `device`: a `Marge`, or a `Veco` for a VECO run.

    A fine-tuned model folder (`marge finetune`) loads too, as its MARGE model without a classifier head
    (`marge.model.finetuned.load` gives the whole fine-tuned model). Of a format 2 checkpoint, the model's keys alone
    are read (not the optimizer's), in this process, a batch at a time into the model (`read_into`)."""
    directory = Path(directory)
    manifest = read_manifest(directory, formats=(CHECKPOINT_FORMAT, FINETUNED_FORMAT))
    cfg = config_from_saved(json.loads((directory / "model_config.json").read_text(encoding="utf-8")))
    with torch.device(device):  # initialised where it is used: no second copy on the host first
        model = build_model(cfg)
    if sharded(manifest):
        reader = _state_reader(directory)
        read_into(directory, manifest, reader, model_targets(model, stored_keys(reader.read_metadata()), directory),
                  group=LOCAL)
    else:
        weights = load_file(str(directory / "model.safetensors"), device="cpu")
        if manifest["format"] == FINETUNED_FORMAT:
            weights = {k: v for k, v in weights.items() if not k.startswith("classifier.")}
        model.load_state_dict(weights)
    return model.eval()
