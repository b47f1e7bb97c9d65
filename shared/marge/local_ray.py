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
    """Keep this program's SIGTERM handler across `ray.init`: Ray's core worker installs a C++ failure handler
    for SIGTERM that aborts the process (exit -6) without running Python's `finally` blocks, which would leave a
    private redis-server and Ray's agents behind (measured: tests/test_shutdown.py). The Python handler the program
    set (`marge` exits through its normal path) is put back as soon as Ray is up."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


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
