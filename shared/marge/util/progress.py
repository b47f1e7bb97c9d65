"""Progress of the long loops a user waits on (preparing a corpus, embedding and indexing, evaluating, reporting):
a bar with an ETA on a terminal, a plain log line every `every_s` seconds otherwise (a log file, a Ray job's output,
CI), so that no command is silent for minutes.

    for shard in track(range(corpus.num_shards), "indexing shards", unit="shard"):
        ...

`MARGE_PROGRESS=bar|log|off` chooses for every command; the default is a bar when stderr is a terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

log = logging.getLogger("marge.progress")

T = TypeVar("T")


def format_seconds(seconds: float) -> str:
    """3s, 4m05s, 2h03m: how long, to a person."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_seconds(done: float, total: float | None, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far (None until there is a rate, or without a total)."""
    if not total or done <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, (total - done) * elapsed_s / done)


def mode() -> str:
    chosen = os.environ.get("MARGE_PROGRESS", "").strip().lower()
    if chosen in ("bar", "log", "off"):
        return chosen
    return "bar" if sys.stderr.isatty() else "log"


class Progress:
    """One loop's progress: `update(n)` as work is done, `close()` at the end (or use it as a context manager)."""

    def __init__(self, description: str, total: float | None = None, unit: str = "it", every_s: float = 10.0):
        self.description, self.total, self.unit, self.every_s = description, total, unit, every_s
        self.done = 0.0
        self.started = self.last_line = time.perf_counter()
        self.mode = mode()
        self.bar = None
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # a machine with torch alone: log lines instead
                self.mode = "log"
            else:
                self.bar = tqdm(total=total, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True,
                                leave=False)

    def update(self, n: float = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.mode == "log" and now - self.last_line >= self.every_s:
            self.last_line = now
            log.info("%s", self.line())

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        of = f"/{self.total:g}" if self.total else ""
        left = eta_seconds(self.done, self.total, elapsed)
        return (f"{self.description}: {self.done:g}{of} {self.unit} in {format_seconds(elapsed)}"
                + (f", ETA {format_seconds(left)}" if left is not None else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(items: Iterable[T], description: str, total: float | None = None, unit: str = "it",
          every_s: float = 10.0) -> Iterator[T]:
    """`items`, reporting progress as they are consumed."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]  # an Iterable with __len__ (checked above) is Sized
    with Progress(description, total, unit, every_s) as progress:
        for item in items:
            yield item
            progress.update()
