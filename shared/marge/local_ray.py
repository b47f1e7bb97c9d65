"""A private local Ray for one program (`marge pretrain` on the embedded default, `marge finetune` on N workers):
started on loopback and stopped by the program that started it, never `ray stop`.

Ray reads its environment when it is first imported, so `LOCAL_RAY_ENV` is applied (`apply_local_ray_env`) before
any `import ray` of a program that will start its own cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

LOCAL_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
}
"""Measured on 2-core machines (docs/testing.md): every socket on loopback, no token auth on a private cluster
(nobody else can reach it), no usage stats, a quick shutdown and a lighter Ray Train V2 controller."""

SETUP_HOOK = "services.trainer.loopback.install"
"""Run in every worker process: the DDP ranks' rendezvous store binds to loopback too."""


@contextlib.contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Keep this program's SIGTERM handler across `ray.init`, and never lose a SIGTERM that arrives during it.

    Ray replaces the handler while it starts: its own Python handlers (`sys.exit` from wherever the main thread is;
    once in CI that exit was lost inside `ray.init` and the run trained to its end with exit code 0 — where it was
    lost is not known, tests/test_shutdown.py) and its core worker's C++ failure handler, which aborts the process
    (exit -6) without running Python's `finally` blocks. So the program's handler is put back as soon as Ray is up,
    and a SIGTERM that arrived in between (seen on a wakeup fd, which records every signal Python's own C handler
    receives whatever Python handler is set) is handed to it then."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield  # nothing of ours to keep, or no way to set handlers from here
        return
    seen_fd, wakeup_fd = os.pipe()
    os.set_blocking(seen_fd, False)
    os.set_blocking(wakeup_fd, False)
    earlier_wakeup_fd = signal.set_wakeup_fd(wakeup_fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(earlier_wakeup_fd)
        try:
            received = os.read(seen_fd, 4096)
        except BlockingIOError:
            received = b""
        os.close(seen_fd)
        os.close(wakeup_fd)
        if signal.SIGTERM in received:
            previous(signal.SIGTERM, None)  # the program's own answer (`marge`: exit through the normal path)


def apply_local_ray_env() -> None:
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def local_ray(num_cpus: int, namespace: str | None = None, include_dashboard: bool = False,
              object_store_memory: int | None = None, log_to_driver: bool = False,
              check: Callable[[], None] | None = None) -> Iterator[None]:
    """A new Ray cluster on this machine for the block (`address="local"`: never a stale cluster's), checked by
    `check` once it is up, and shut down after, also when its start is interrupted half-way (a SIGTERM during
    `ray.init`), waiting for its processes to exit."""
    apply_local_ray_env()
    import ray

    try:
        with keeping_sigterm_handler():
            ray.init(address="local", namespace=namespace, num_cpus=num_cpus, include_dashboard=include_dashboard,
                     dashboard_host="127.0.0.1", object_store_memory=object_store_memory, log_to_driver=log_to_driver,
                     runtime_env={"worker_process_setup_hook": SETUP_HOOK})
        if check is not None:
            check()
        yield
    finally:
        ray.shutdown(wait_for_processes=True)
