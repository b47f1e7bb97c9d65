"""Training checkpoints: the whole training state, in a folder of the run's checkpoint storage.

Format version 2 (written since the sharded checkpoint), every DDP rank writing its part:

    state/                torch.distributed.checkpoint: `.metadata` plus one `__<rank>_0.distcp` per saving rank. The
                          model's weights and the optimizer's per-parameter tensors, each written once: the keys are
                          spread over the ranks by size (`partition`), tensors over `part_bytes` cut into row blocks
    training_state.pt     what is not a per-parameter tensor: optimizer param groups, LR schedule, step, RNG states,
                          consumed batch ids (torch.save of plain containers; loaded with weights_only=True)
    model_config.json     the model's config (MargeConfig; a VecoConfig carries "family": "veco")
    tokenizer.model/.json the tokenizer the model was trained with
    manifest.json         written last, by rank 0, once every rank's part is durable: format, step, the trainer
                          generation that wrote it, the sha256 of every small file, the bytes of every part, the
                          sha256 of every tensor

`state/.metadata` is DCP's pickle. It is read by `_MetadataUnpickler`, which builds DCP's metadata classes, torch's
dtypes and sizes and nothing else, and a part it names must be a `__<rank>_<n>.distcp` file of state/: a crafted file
is refused, naming it, before anything in it runs (the manifest's sha256 cannot tell: whoever can write the file can
write the manifest).

Which checkpoint a run resumes from (trainer generations, abandoned checkpoints, one rule for the driver and the
ranks) is `marge.model.lineage`.

A rank restoring reads only its share of the keys (by size, for the world it runs in, whatever the world that
saved) and the ranks broadcast the rest to each other: about checkpoint size / world read from storage per rank,
plus the small files (`marge.model.restore`, which also reads the model's keys alone for `marge.load`, eval and
serve: `load_model`).

Format version 1 (read, no longer written): `model.safetensors` (weights) and `training_state.pt` holding the
optimizer and schedule too, written by rank 0 alone; every restoring rank read all of it.

`marge eval retrieval --checkpoint PATH` and friends accept either. Unlike the other artifacts, a checkpoint is
written in place, into a folder its caller provides (a temporary one `atomic_directory` renames, or the run's
checkpoint folder the ranks share); the manifest, written last (marge.contracts.artifacts), is what makes it a checkpoint.
This module keeps the schema: which files, which manifest fields.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import heapq
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from marge.contracts import artifacts
from marge.model.architecture import MargeConfig
from marge.model.network import Marge
from marge.model.veco import FAMILY, Veco, VecoConfig
from marge.util.files import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "marge-checkpoint"
FINETUNED_FORMAT = "marge-finetuned"
"""A `marge finetune` output (marge.model.finetuned): the same manifest, its own files."""
CHECKPOINT_VERSION = 2
"""The version written; `READ_VERSIONS` are the ones read."""
READ_VERSIONS = (1, 2)
FILES = ("model.safetensors", "model_config.json", "training_state.pt", "tokenizer.model", "tokenizer.json")
"""Version 1's files (a fine-tuned model folder's too)."""
STATE_DIR = "state"
SHARDED_FILES = ("model_config.json", "training_state.pt", "tokenizer.model", "tokenizer.json",
                 f"{STATE_DIR}/.metadata")
"""Version 2's small files (checksummed whole by the manifest's `sha256`); the parts are in its `parts`."""
PART_BYTES = 64 << 20
"""A tensor over this many bytes is saved as row blocks of at most this size: the unit the ranks share out, so a
rank's share of a restore is at most size / world plus one block (a 250k x 1024 fp32 embedding is 1 GB)."""


WRITER_NICE = 10
"""How much lower the writer thread's priority is than training's (Linux)."""


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


# --- the sharded training state (format 2) -----------------------------------------------------------------


LOCAL = "local"
"""`group=LOCAL`: this process alone, even where a process group is initialized (a rank loading a model for itself)."""


# DCP warns on every single-process save and load that it assumes a single process: that is what is meant here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def _distributed(group) -> bool:
    import torch.distributed as dist

    return group is not LOCAL and dist.is_available() and dist.is_initialized()


def _rank_world(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not _distributed(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def param_names(model: nn.Module, optimizer) -> list[str]:
    """The parameter name of each of the optimizer's state indices (its param groups' params, in order). An
    optimizer over fp32 masters of the model's bf16 parameters (the trainer's `bf16_params`) names its own:
    `parameter_names`, id(master) -> the parameter's name."""
    names = {id(p): name for name, p in model.named_parameters()}
    names.update(getattr(optimizer, "parameter_names", {}))
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def training_tensors(model: nn.Module, optimizer, part_bytes: int = PART_BYTES) -> dict[str, torch.Tensor]:
    """The training state's tensors under flat keys: `model/<name>` for the weights and buffers,
    `optim/<parameter>/<state>` for the optimizer's (AdamW's moments and step). A tensor over `part_bytes` is cut
    into row blocks `<key>#<i>` (views, nothing copied)."""
    out: dict[str, torch.Tensor] = {}

    def add(key: str, t: torch.Tensor) -> None:
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        if t.dim() == 0 or nbytes <= part_bytes or t.shape[0] < 2:
            out[key] = t
            return
        rows = max(1, part_bytes // max(1, nbytes // t.shape[0]))
        for i, first in enumerate(range(0, t.shape[0], rows)):
            out[f"{key}#{i}"] = t[first:first + rows]

    for name, t in model.state_dict().items():
        add(f"model/{name}", t)
    names = param_names(model, optimizer)
    for index, state in optimizer.state_dict()["state"].items():
        for field, value in state.items():
            if isinstance(value, torch.Tensor):
                add(f"optim/{names[index]}/{field}", value)
    return out


def partition(sizes: dict[str, int], world: int) -> list[list[str]]:
    """`sizes`' keys shared out over `world` ranks, largest first, each to the rank with the fewest bytes so far:
    every rank's share is at most total / world plus the largest key. Depends on the keys and sizes alone, so a
    restoring world computes it from the checkpoint's metadata whatever the world that saved."""
    heap = [(0, r) for r in range(world)]
    parts: list[list[str]] = [[] for _ in range(world)]
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, r = heapq.heappop(heap)
        parts[r].append(key)
        heapq.heappush(heap, (load + sizes[key], r))
    return parts


def tensor_sha256(t: torch.Tensor) -> str:
    """The sha256 of a CPU tensor's bytes (its dtype's, row-major)."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class WriteSettings:
    """How a checkpoint is written (`CheckpointWrite`), not what it holds."""

    group: Any = None
    """The process group whose ranks each write a part (None: this process is the whole world). Not the group
    training uses meanwhile: DCP's collectives run on it from the writing thread."""
    background: bool = False
    """Write in a thread once this rank's share is copied to host memory: the training loop goes on."""
    staging: Path | None = None
    """Write here; rank 0 renames it to the checkpoint's folder once the manifest is in."""
    generation: int | None = None
    """The trainer generation writing it, recorded in the manifest (`marge.model.lineage`)."""
    before_manifest: Callable[[], None] | None = None
    """Called once every file but the manifest is written (the fault suite dies there)."""
    part_bytes: int = PART_BYTES
    """Tensors larger than this are split into parts, so that the ranks' shares balance."""


class CheckpointWrite:
    """One checkpoint being written into `directory` (format 2).

    Every rank of the process group takes part (collective: all call it at the same update; without a process
    group the process is the whole world). The constructor copies this rank's share of the training tensors to
    host memory (`blocked_s`: the training loop's only wait) and writes it, with torch.distributed.checkpoint, in
    a thread (`background`) or at once. Once every rank's part is written and synced, rank 0 writes the small files
    and the manifest, last; `wait()` returns on every rank only after that, and raises what the write raised.
    DCP's collectives run on `group`, which must not be the one training uses meanwhile (a second gloo group).

    With `staging`, every rank writes there and rank 0 renames the folder to `directory` once the manifest is in
    it (`artifacts.commit_staged`): a checkpoint cut short leaves no `step-*` folder behind, only the staging one,
    which the next attempt at that folder replaces.

    `generation`: the trainer generation writing it (`marge.model.lineage.start_generation`), recorded in the manifest; None for a
    writer outside any group (the single process, tools), whose checkpoints no generation abandons.

    Durable before the manifest is written: every part and `.metadata` (DCP, `sync_files`), the state/ folder's
    entries, the small files and the folder's entries; the manifest, then the rename into place, each synced too."""

    def __init__(self, directory: Path, model: nn.Module, optimizer, scheduler, step: int, tokenizer_dir: Path,
                 training_state: dict[str, Any], how: WriteSettings = WriteSettings()):
        started = time.perf_counter()
        group, background, before_manifest, part_bytes, staging, generation = (
            how.group, how.background, how.before_manifest, how.part_bytes, how.staging, how.generation)
        self.directory, self.step, self.group, self.generation = Path(directory), step, group, generation
        self.staging = Path(staging) if staging is not None else None
        self.folder = self.staging or self.directory
        """Where the files are written."""
        self.rank, self.world = _rank_world(group)
        self.before_manifest, self.part_bytes = before_manifest, part_bytes
        tensors = training_tensors(model, optimizer, part_bytes)
        mine = partition({k: t.numel() * t.element_size() for k, t in tensors.items()}, self.world)[self.rank]
        # copy=True: a host tensor is copied too, so the update that follows cannot change what is written
        self.staged = {k: tensors[k].to("cpu", copy=True) for k in mine}
        self.bytes_staged = sum(t.numel() * t.element_size() for t in self.staged.values())
        self.small = None
        if self.rank == 0:
            opt = optimizer.state_dict()
            self.small = {
                "param_groups": copy.deepcopy(opt["param_groups"]), "param_names": param_names(model, optimizer),
                "optimizer_other": {int(i): {k: copy.deepcopy(v) for k, v in st.items()
                                             if not isinstance(v, torch.Tensor)} for i, st in opt["state"].items()},
                "scheduler": copy.deepcopy(scheduler.state_dict()), "step": step, "rng": rng_state(),
                **training_state}
            self.model_config = saved_config(model.cfg)
            self.tokenizer_dir = Path(tokenizer_dir)
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.thread: threading.Thread | None = None
        self.blocked_s = time.perf_counter() - started
        if background:
            self.thread = threading.Thread(target=self._run, name=f"marge-checkpoint-{step}", daemon=True)
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        if self.thread is not None and sys.platform == "linux":
            # Linux nices a thread by its id: where training keeps every core busy (CPU runs), the write takes the
            # time training leaves; on GPUs the host cores are mostly idle and it runs at once anyway
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            self._write()
        except BaseException as e:  # raised by wait(), in the caller's thread
            self.error = e

    def _write(self) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        distributed = _distributed(self.group)
        state_dir = self.folder / STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        dcp.save(self.staged, storage_writer=dcp.FileSystemWriter(str(state_dir), sync_files=True),
                 process_group=self.group if distributed else None, no_dist=not distributed)
        fsync_dir(state_dir)  # DCP syncs the files, not the folder's entries for them (rank 0's: `.metadata` too)
        # the parts' bytes, not their sha256: every tensor's own sha256 (hashed from host memory, no read back)
        # checks them, as each reader loads its share or as `marge.model.lineage.newest_good_checkpoint` reads them all
        parts = {f"{STATE_DIR}/{p.name}": {"bytes": p.stat().st_size}
                 for p in sorted(state_dir.glob(f"__{self.rank}_*.distcp"))}
        self.bytes_written = sum(p["bytes"] for p in parts.values())
        mine = {"parts": parts, "tensors": {k: tensor_sha256(t) for k, t in self.staged.items()}}
        self.staged = {}
        gathered: list[Any] = [None] * self.world  # all_gather_object fills each rank's slot with its dict
        if distributed:
            dist.all_gather_object(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        if self.rank == 0:
            self._commit(gathered)
        if distributed:
            dist.barrier(group=self.group)  # no rank's wait() returns before the manifest is written

    def _commit(self, gathered: list[dict]) -> None:
        # the manifest says the checkpoint is durable, and the batches it covers are committed on its word: every
        # file it lists is synced, and the folder's entries for them, before it is written
        d = self.folder
        with open(d / "training_state.pt", "wb") as f:
            torch.save(self.small, f)
            f.flush()
            os.fsync(f.fileno())
        atomic_write_text(d / "model_config.json", json.dumps(self.model_config, indent=2) + "\n")
        for name in ("tokenizer.model", "tokenizer.json"):
            copy_synced(self.tokenizer_dir / name, d / name)
        fsync_dir(d)
        if self.before_manifest is not None:
            self.before_manifest()
        parts = {name: info for part in gathered for name, info in part["parts"].items()}
        tensors = {key: digest for part in gathered for key, digest in part["tensors"].items()}
        lineage = {} if self.generation is None else {"generation": self.generation}
        write_manifest(d, CHECKPOINT_FORMAT, SHARDED_FILES, version=CHECKPOINT_VERSION, step=self.step, world=self.world,
                       **lineage, part_bytes=self.part_bytes, parts=dict(sorted(parts.items())),
                       tensors=dict(sorted(tensors.items())))
        if self.staging is not None:  # renamed into place, the rename synced
            artifacts.commit_staged(self.staging, self.directory, error=CheckpointError)
        else:  # written in place: the entry of the folder itself
            fsync_dir(self.directory.parent)

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> Path:
        """The checkpoint folder, once complete on every rank (raises the write's error, if any)."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.directory


def copy_synced(source: Path, target: Path) -> None:
    """Copy a file and fsync the copy."""
    shutil.copyfile(source, target)
    with open(target, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(directory: Path, model: Marge, optimizer, scheduler, step: int, tokenizer_dir: Path,
                    training_state: dict[str, Any], before_manifest=None, group=None) -> Path:
    """Write a complete checkpoint into `directory` (manifest last: a folder without one is not a checkpoint),
    before returning. Within a process group, every rank calls it and writes its part (`CheckpointWrite`).

    `before_manifest` is called with every file written but the manifest (the fault suite dies there)."""
    return CheckpointWrite(directory, model, optimizer, scheduler, step, tokenizer_dir, training_state,
                           WriteSettings(group=group, before_manifest=before_manifest)).wait()


def save_checkpoint_v1(directory: Path, model: Marge, optimizer, scheduler, step: int, tokenizer_dir: Path,
                       training_state: dict[str, Any]) -> Path:
    """A format 1 checkpoint (one process writes everything), as releases before format 2 wrote it: for the tests
    and benchmarks that check it is still read, and the synchronous save the sharded one is measured against."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    atomic_write_text(directory / "model_config.json", json.dumps(saved_config(model.cfg), indent=2) + "\n")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                "rng": rng_state(), **training_state}, directory / "training_state.pt")
    for name in ("tokenizer.model", "tokenizer.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    write_manifest(directory, CHECKPOINT_FORMAT, FILES, version=1, step=step)
    return directory


def write_manifest(directory: Path, fmt: str, files: tuple[str, ...], version: int = 1, **extra: Any) -> None:
    """The manifest that makes a folder complete, written last: its format and version, the sha256 of each of
    `files`. Version 1 unless told (a fine-tuned model folder's, a format 1 checkpoint's)."""
    artifacts.write_manifest(directory, {
        "format": fmt, "version": version, **extra, "created_unix": time.time(),
        "sha256": artifacts.file_sha256s(directory, files, what="checkpoint", error=CheckpointError)})


def sharded(manifest: dict[str, Any]) -> bool:
    """Whether a manifest is a format 2 checkpoint's (its training state under state/, in parts)."""
    return manifest["format"] == CHECKPOINT_FORMAT and manifest["version"] >= 2


def read_manifest(directory: Path, verify: bool = True, formats: tuple[str, ...] = (CHECKPOINT_FORMAT,),
                  parts: bool = False) -> dict[str, Any]:
    """A folder's manifest, checked to be one of `formats` and (with `verify`) to match every file's sha256. Of a
    format 2 checkpoint, `verify` checks the small files' sha256 and that every part is there with its size (a
    part missing or cut short: not a checkpoint); `parts` loads every tensor as well and checks its sha256 (reads
    everything, `batch_bytes` at a time). The tensors a reader loads are checked as they are loaded."""
    directory = Path(directory)
    manifest = artifacts.read_manifest(directory, formats, READ_VERSIONS, fields=("sha256",),
                                       what="MARGE checkpoint", hint=HINT, error=CheckpointError)
    if not isinstance(manifest["sha256"], dict):
        raise CheckpointError(f"{directory / artifacts.MANIFEST}: field 'sha256' is {manifest['sha256']!r}, expected "
                              "a mapping of file name to sha256")
    if manifest["format"] == FINETUNED_FORMAT and manifest["version"] != 1:
        raise CheckpointError(f"{directory / artifacts.MANIFEST}: field 'version' is {manifest['version']!r}; this "
                              "marge reads fine-tuned model folders of version 1")
    if sharded(manifest):
        for field in ("parts", "tensors"):
            if not isinstance(manifest.get(field), dict):
                raise CheckpointError(f"{directory / artifacts.MANIFEST}: field {field!r} is {manifest.get(field)!r}, "
                                      "expected a mapping (a format 2 checkpoint's parts and tensor digests)")
    if verify:
        artifacts.verify_checksums(directory, manifest["sha256"], what="MARGE checkpoint", error=CheckpointError)
        for name, info in manifest.get("parts", {}).items() if sharded(manifest) else ():
            path = directory / name
            size = path.stat().st_size if path.is_file() else None
            if size != info["bytes"]:
                raise CheckpointError(f"{path}: {'missing' if size is None else f'{size} bytes'}, the manifest says "
                                      f"{info['bytes']} bytes: the checkpoint is incomplete{HINT}")
        if parts and sharded(manifest):
            verify_state_tensors(directory, manifest)
    return manifest


def checkpoint_order(path: Path | str) -> tuple[int, int]:
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


PART_NAME = re.compile(r"__\d+_\d+\.distcp")
"""The name of a part in state/ (DCP's `__<rank>_<n>.distcp`); `.metadata` names no other file."""


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a `.metadata` DCP wrote for this module's checkpoints refers to: DCP's metadata classes, the torch
    types they hold (a size, a dtype, a layout by name) and the folder's path."""
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.serialization

    allowed: dict[tuple[str, str], Any] = {
        (dcp_md.__name__, name): getattr(dcp_md, name)
        for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
                     "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    allowed[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout by its name
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be restricted, the C one's not
    """Reads a `.metadata` without running anything it names: it may refer only to `_metadata_globals`, and set
    the state only of instances of DCP's metadata classes (not of a class or a shared object)."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path
        self.allowed = _metadata_globals()
        self.buildable = {v for (module, name), v in self.allowed.items()
                          if module.startswith("torch.distributed.checkpoint.") and name != "_MEM_FORMAT_ENCODING"}
        """Classes whose fresh instances BUILD may fill in (not the enum: its members are shared)."""

    def refuse(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}, which no checkpoint metadata this marge writes holds; the file "
                               "was not loaded (unpickling it could run any code). This checkpoint was not written "
                               "by this marge's torch.distributed.checkpoint: do not resume from it; move it aside "
                               "and resume from one you trust")

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise self.refuse(f"refers to {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise self.refuse("holds a persistent id")

    def load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]  # the Python unpickler's stack; typeshed omits it
        if type(target) not in self.buildable:
            raise self.refuse(f"sets the state of a {type(target).__name__}")
        super().load_build()  # type: ignore[misc]  # typeshed omits the opcode methods

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}  # type: ignore[dict-item]


def read_metadata_file(path: Path):
    """A `state/.metadata` (DCP's `Metadata`), read by `_MetadataUnpickler` and checked: every item a tensor,
    every part it names a `__<rank>_<n>.distcp` of its own folder. Raises CheckpointError naming the file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = Path(path)
    with open(path, "rb") as f:
        unpickler = _MetadataUnpickler(f, path)
        try:
            metadata = unpickler.load()
        except CheckpointError:
            raise
        except Exception as e:  # a torn or foreign file: whatever the unpickler raised
            raise CheckpointError(f"{path}: not a checkpoint's metadata ({type(e).__name__}: {e}): the checkpoint is "
                                  f"corrupt{HINT}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) or \
            not isinstance(metadata.storage_data, dict):
        raise unpickler.refuse(f"holds a {type(metadata).__name__} where DCP's Metadata belongs")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise unpickler.refuse(f"holds {key!r} as a {type(entry).__name__}, not a tensor")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) or \
                not PART_NAME.fullmatch(info.relative_path):
            raise unpickler.refuse(f"names the part {getattr(info, 'relative_path', info)!r}, not a "
                                   "`__<rank>_<n>.distcp` of its own folder")
    return metadata


def _state_reader(directory: Path):
    """A DCP reader of a checkpoint's state/ that reads `.metadata` with `read_metadata_file` (no pickle runs) and
    counts the bytes it reads from storage (`bytes_read`): the metadata once, then each item's byte range
    (FileSystemReader reads exactly those)."""
    import torch.distributed.checkpoint as dcp

    class CheckedReader(dcp.FileSystemReader):
        def __init__(self, path):
            super().__init__(path)
            self.bytes_read, self._metadata = 0, None

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                path = Path(self._get_metadata_path(kwargs.get("rank")))
                metadata = read_metadata_file(path)
                from torch.distributed.checkpoint.metadata import StorageMeta

                if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._metadata = metadata
                self.bytes_read += path.stat().st_size
            return self._metadata

        def read_data(self, plan, planner):
            self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
            return super().read_data(plan, planner)

    return CheckedReader(str(Path(directory) / STATE_DIR))


def _load(tensors: dict[str, torch.Tensor], reader, directory: Path, group, distributed: bool) -> None:
    """dcp.load into `tensors`; a part that cannot be read raises CheckpointError (on every rank: DCP gathers any
    rank's error to all)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.load(tensors, storage_reader=reader, process_group=group if distributed else None, no_dist=not distributed)
    except CheckpointException as e:
        raise CheckpointError(f"{Path(directory) / STATE_DIR}: a part cannot be read ({e}): the checkpoint is "
                              f"corrupt{HINT}") from None


def mismatched(tensors: dict[str, torch.Tensor], digests: dict[str, str]) -> list[str]:
    """The keys of `tensors` whose sha256 is not the manifest's."""
    return [k for k, t in tensors.items() if digests.get(k) != tensor_sha256(t)]


def verify_state_tensors(directory: Path, manifest: dict[str, Any], batch_bytes: int = 256 << 20) -> None:
    """Every tensor of a format 2 checkpoint read and checked against its sha256, in this process, `batch_bytes`
    of them at a time (the memory it takes); raises CheckpointError naming the first that differs or is missing."""

    reader = _state_reader(directory)
    entries = reader.read_metadata().state_dict_metadata
    if set(entries) != set(manifest["tensors"]):
        missing = sorted(set(manifest["tensors"]) ^ set(entries))
        raise CheckpointError(f"{Path(directory) / STATE_DIR}: its tensors are not the manifest's ({missing[:3]}): the "
                              f"checkpoint is incomplete{HINT}")
    batch: list[str] = []
    size = 0
    keys = sorted(entries)
    for i, key in enumerate(keys):
        batch.append(key)
        size += entries[key].size.numel() * entries[key].properties.dtype.itemsize
        if size < batch_bytes and i + 1 < len(keys):
            continue
        loaded = {k: torch.empty(entries[k].size, dtype=entries[k].properties.dtype) for k in batch}
        _load(loaded, reader, directory, None, False)
        bad = mismatched(loaded, manifest["tensors"])
        if bad:
            raise CheckpointError(f"{Path(directory) / STATE_DIR}: tensor {bad[0]!r} does not match the manifest's "
                                  f"sha256: the checkpoint is corrupt{HINT}")
        batch, size = [], 0


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


def load_model_shell(path: Path, device: str | torch.device = "cpu") -> nn.Module:
    """The model `path` (a `model.safetensors` beside its `model.json`) holds, built from its config on `device` with
    freshly initialised weights and without reading the weights file: for a rank that loads a checkpoint over it
    (built on its GPU, it never has a host copy)."""
    cfg = config_from_saved(json.loads(Path(path).with_suffix(".json").read_text(encoding="utf-8")))
    with torch.device(device):
        return build_model(cfg)
