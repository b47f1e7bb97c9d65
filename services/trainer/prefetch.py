"""One update read ahead: what both training hosts (the DDP rank, `services.trainer.rank`, and the single process,
`services.driver.single_process`) use to read and prepare update s+1's batches while the device trains update s.

Preparing (augmentation, tensors, pinned copies) is Python and numpy work that would otherwise leave a GPU idle.
The look-ahead is bounded to one update and productions never overlap: `start` waits for the one in flight, so a
producer that reads a stream in order (the single process's batch schedule) sees its updates in order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Runs `produce(step)` in a background thread; `take(step)` waits for it and returns its result, raising in
    the caller what the production raised.

    A daemon thread per update: a production that waits (for a batch, for an index version) never keeps the process
    from exiting. `close` waits for the production in flight, so whoever can unblock it does so first."""

    def __init__(self, produce: Callable[[int], T]):
        self.produce = produce
        self.step: int | None = None
        self.result: T | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        """Begin producing update `step` (after the production in flight, if any, has ended)."""
        self.close()
        self.step, self.result, self.error = step, None, None
        self.thread = threading.Thread(target=self._run, args=(step,), name=f"marge-prefetch-{step}", daemon=True)
        self.thread.start()

    def _run(self, step: int) -> None:
        try:
            self.result = self.produce(step)
        except BaseException as e:  # handed to the thread that takes it, which raises it
            self.error = e

    def take(self, step: int) -> T:
        """Update `step`'s production: the one started ahead, or, when none was started for it, one made now."""
        if self.step != step:
            self.start(step)
        self.close()
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]  # set by the production just waited for: a T

    def close(self) -> None:
        """Wait for the production in flight, if any."""
        if self.thread is not None:
            self.thread.join()
