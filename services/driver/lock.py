"""One driver per run: `<run>/driver.lock`, held with an exclusive `flock` for as long as the driver lives.

Two drivers on one run would both resume it, reset its queue and train the same slots twice. The lock is
released by the kernel when the holder dies in any way (SIGKILL included), so a crashed driver never leaves a
stale lock; the file's contents (pid, host, start time) only say who holds it. The run folder must be on a
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


class DriverLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "driver.lock"
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
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}) + "\n")
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
