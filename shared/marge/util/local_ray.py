"""A private local Ray for one program (`marge pretrain` on the embedded default, `marge finetune` on N workers):
started on loopback and stopped by the program that started it, never `ray stop`.

Ray reads its environment when it is first imported, so `LOCAL_RAY_ENV` is applied (`apply_local_ray_env`) before
any `import ray` of a program that will start its own cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from marge.util.progress import format_seconds

log = logging.getLogger(__name__)

LOCAL_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
}
"""Measured on 2-core machines (docs/testing.md): every socket on loopback, no token auth on a private cluster
(nobody else can reach it), no usage stats, a quick shutdown and a lighter Ray Train V2 controller."""


@contextlib.contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Keep this program's SIGTERM handler across `ray.init`, and never lose a SIGTERM that arrives during it.

    Ray replaces the handler while it starts: its own Python handlers (`sys.exit` from wherever the main thread is;
    once in CI that exit was lost inside `ray.init` and the run trained to its end with exit code 0 — where it was
    lost is not known, tests/integration/test_shutdown.py) and its core worker's C++ failure handler, which aborts the process
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


class RayStartError(RuntimeError):
    """Ray could not be started or reached: the message is one line, with the likely cause and what to try."""


def machine_load() -> str:
    """`load 12.3 on 2 CPUs`: how busy this machine is, the usual reason Ray's processes start too slowly."""
    try:
        return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count() or 1} CPUs"
    except OSError:
        return f"{os.cpu_count() or 1} CPUs"


def ray_start_cause(error: BaseException) -> str:
    """What `ray.init` raised, said in one line with its likely cause and what to try."""
    text = " ".join(str(error).split()) or type(error).__name__
    if "timed out during startup" in text:
        return (f"its node did not register within Ray's 30 s (the raylet did not start in time; {machine_load()}): "
                "the machine is probably too loaded; try again when it is quieter, or start Ray yourself "
                "(`ray start --head`) and pass ray.address")
    return (f"{type(error).__name__}: {text[:300]} ({machine_load()}); the Ray logs (`session_*/logs` under Ray's "
            "temporary folder) say more")


def apply_local_ray_env() -> None:
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def local_ray(num_cpus: int, namespace: str | None = None, include_dashboard: bool = False,
              object_store_memory: int | None = None, log_to_driver: bool = False,
              check: Callable[[], None] | None = None, setup_hook: str | None = None) -> Iterator[None]:
    """A new Ray cluster on this machine for the block (`address="local"`: never a stale cluster's), checked by
    `check` once it is up, and shut down after, also when its start is interrupted half-way (a SIGTERM during
    `ray.init`), waiting for its processes to exit. `setup_hook`: a function's dotted path that Ray runs in every
    worker process (`worker_process_setup_hook`), given by the program that knows what its workers need."""
    apply_local_ray_env()
    import ray

    children_before = set(process_tree({os.getpid()}))
    rays_own: set[int] = set()
    try:
        try:
            log.info("starting a local Ray (%d CPUs)", num_cpus)
            began = time.monotonic()
            with keeping_sigterm_handler():
                ray.init(address="local", namespace=namespace, num_cpus=num_cpus, include_dashboard=include_dashboard,
                         dashboard_host="127.0.0.1", object_store_memory=object_store_memory,
                         log_to_driver=log_to_driver,
                         runtime_env={"worker_process_setup_hook": setup_hook} if setup_hook else None)
            log.info("[setup] local Ray up in %s (%d logical CPUs)", format_seconds(time.monotonic() - began),
                     num_cpus)
        except Exception as e:  # noqa: BLE001 - every way Ray's start fails becomes one line (the cause is chained)
            raise RayStartError(f"a local Ray did not start: {ray_start_cause(e)}") from e
        finally:  # what ray.init started (gcs_server, raylet, ...), also when its start was cut short
            rays_own = set(process_tree({os.getpid()})) - children_before
        if check is not None:
            check()
        yield
    finally:
        started = process_tree(rays_own, include_roots=True)
        ray.shutdown(wait_for_processes=True)
        stop_survivors(started)


@contextlib.contextmanager
def ray_for_tasks(address: str | None, workers: int | None, object_store_memory: int) -> Iterator[int]:
    """Ray for a program that runs tasks (a preparation, a serving-index build): the one this process is already
    connected to, the cluster at `address` (or RAY_ADDRESS), or a private local Ray on loopback with `workers` CPUs
    (default: this machine's) and `object_store_memory`, stopped afterwards. Yields the tasks to run at once."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        yield workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    elif address:
        apply_local_ray_env()
        with keeping_sigterm_handler():
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            yield workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        finally:
            ray.shutdown()  # this process's connection only: the cluster keeps running
    else:
        cpus = workers or os.cpu_count() or 1
        with local_ray(cpus, object_store_memory=object_store_memory):
            yield cpus


def process_tree(roots: set[int], include_roots: bool = False) -> dict[int, int]:
    """The live descendants of `roots` (and the roots themselves if asked) as pid -> start time (clock ticks since boot,
    which tells a process from a later one that reuses its pid). Read from /proc: empty where there is none."""
    parent_of, start_of = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        found = read_stat(int(stat.parent.name))
        if found is not None:
            parent_of[int(stat.parent.name)], start_of[int(stat.parent.name)] = found
    children: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    tree = {pid: start_of[pid] for pid in roots if include_roots and pid in start_of}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            tree[child] = start_of[child]
            todo.append(child)
    return tree


def read_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None for one that exited or is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()  # the name may hold spaces
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def stop_survivors(started: dict[int, int], grace_s: float = 5.0) -> None:
    """Stop the processes of `started` (pid -> start time) still running: a Ray whose start a SIGTERM cut short
    leaves its raylet's agents behind after `ray.shutdown`, orphaned, for a minute until they give up on the GCS
    (measured on a 2-core CPU). SIGTERM, then SIGKILL after `grace_s`."""

    def alive() -> list[int]:
        return [pid for pid, start in started.items() if (read_stat(pid) or (0, None))[1] == start]

    left = alive()
    if not left:
        return
    log.warning("Ray left %d of its processes running after shutdown (pids %s): stopping them", len(left), left)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while (left := alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not left:
            return
