"""Small helpers every stage uses: atomic publication of files (folders: `marge.contracts.artifacts`), logging set-up."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


QUIET_LIBRARIES = ("faiss", "matplotlib", "urllib3", "filelock", "httpx", "httpcore", "PIL", "numexpr", "asyncio")
"""Libraries whose INFO lines say nothing a user of marge acts on: logged from WARNING up."""


def setup_logging(level: str | int | None = None) -> None:
    """Log to stderr (stdout stays for machine-readable results). MARGE_LOG_LEVEL overrides the level.

    Leaves logging alone when the application (or pytest) has configured it already.
    """
    level = level or os.environ.get("MARGE_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    for name in QUIET_LIBRARIES:  # their INFO lines look like failures (faiss's "ModuleNotFoundError" on AVX512)
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write to a temporary sibling, fsync, rename over `path`: readers see the old file or the new one. `mode`
    (e.g. 0o600 for a secret): the file's permissions from its creation, before a byte is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    opener = None if mode is None else (lambda name, flags: os.open(name, flags, mode))
    try:
        with open(tmp, "wb", opener=opener) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class BudgetCache:
    """Values loaded by key, the most recently used kept while their bytes fit in `budget_bytes`; the value just
    loaded always stays, so memory is bounded by the largest value and the budget. One load at a time (a lock):
    callers in several threads share it."""

    def __init__(self, budget_bytes: int, load: Callable, size: Callable[[Any], int]):
        self.budget_bytes, self._load, self._size = budget_bytes, load, size
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0
        """Values loaded so far (everything within the budget: each once)."""

    def get(self, key):
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            value = self._load(key)
            self.reads += 1
            self._cache[key] = value
            while len(self._cache) > 1 and self.cached_bytes > self.budget_bytes:
                self._cache.popitem(last=False)
            return value

    @property
    def cached_bytes(self) -> int:
        return sum(self._size(v) for v in self._cache.values())

    def values(self) -> list:
        return list(self._cache.values())

    def __len__(self) -> int:
        return len(self._cache)
