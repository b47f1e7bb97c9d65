"""One driver per run: `<run>/driver.lock`, held with an exclusive `flock` for as long as the driver lives.

Two drivers on one run would both resume it, reset its queue and train the same slots twice. The lock is
released by the kernel when the holder dies in any way (SIGKILL included), so a crashed driver never leaves a
stale lock; the file's contents (pid, host, start time, mode) say who holds it, and which mode drove the run last.
A run folder belongs to the mode that wrote it (`marge pretrain` on Ray, or `--single-process`): the lock refuses a
folder of the other mode unless told to reuse it (`reuse_folder`). The run folder must be on a
file system with working `flock` (local disks, NFSv4, Lustre, CephFS): where a shared cluster file system
lacks it, run one driver per run by other means (one Ray job per run name).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import TextIO


class RunLocked(RuntimeError):
    pass


class RunOfAnotherMode(RunLocked):
    """The run folder holds a run of the other mode (Ray pipeline or single process)."""


PIPELINE, SINGLE_PROCESS = "pipeline", "single-process"
MODE_FLAGS = {PIPELINE: "`marge pretrain` on Ray", SINGLE_PROCESS: "`marge pretrain --single-process`"}
SINGLE_PROCESS_MARK = "experiment.json"
"""What a single-process run writes in its folder (and a pipeline run never does)."""
PIPELINE_MARKS = ("train_log.jsonl", "ray_train", "init/model.safetensors")
"""Files a run writes in its folder (the initial weights before Ray starts, the train log, Ray Train's checkpoints):
without the single-process mark, the traces of a pipeline run whose lock file records no mode."""


def recorded_mode(run_dir: Path) -> str | None:
    """The mode the run folder's last driver wrote into its lock file (None: no lock, or one written before modes
    were recorded)."""
    try:
        mode = json.loads((Path(run_dir) / "driver.lock").read_text(encoding="utf-8") or "{}").get("mode")
    except (OSError, ValueError, AttributeError):
        return None
    return mode if mode in MODE_FLAGS else None


def folder_mode(run_dir: Path) -> str | None:
    """The mode of the run in `run_dir`: the one its last driver recorded, else what its files say (a folder
    written before the lock recorded modes); None when it holds no run."""
    run_dir = Path(run_dir)
    recorded = recorded_mode(run_dir)
    if recorded is not None:
        return recorded
    if (run_dir / SINGLE_PROCESS_MARK).exists():
        return SINGLE_PROCESS
    if any((run_dir / name).exists() for name in PIPELINE_MARKS):
        return PIPELINE
    return None


def check_folder_mode(run_dir: Path, mode: str, reuse_folder: bool = False) -> None:
    """Refuse to drive `run_dir` in `mode` when it holds a run of the other mode, unless `reuse_folder`."""
    found = folder_mode(run_dir)
    if found is None or found == mode or reuse_folder:
        return
    raise RunOfAnotherMode(f"run.dir {run_dir} holds a run of {MODE_FLAGS[found]}: resume it that way, choose "
                           f"another run.dir, or pass --reuse-folder to run {MODE_FLAGS[mode]} over its files")


class DriverLock:
    def __init__(self, run_dir: Path, mode: str = PIPELINE, reuse_folder: bool = False):
        self.path = Path(run_dir) / "driver.lock"
        self.mode, self.reuse_folder = mode, reuse_folder
        """Which mode drives the run, and whether a folder of the other mode may be taken (`check_folder_mode`)."""
        self._file: TextIO | None = None

    def acquire(self) -> "DriverLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "{}"
            f.close()
            raise RunLocked(f"{self.path.parent} is being driven by another `marge pretrain` ({holder}); wait for it "
                            f"to end, stop it (Ctrl-C, or kill its pid), or give this run another run.name") from None
        try:  # before this driver's record replaces the last one's
            check_folder_mode(self.path.parent, self.mode, self.reuse_folder)
        except RunOfAnotherMode:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
            raise
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time(),
                            "mode": self.mode}) + "\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> "DriverLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
