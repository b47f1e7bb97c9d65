"""What a run needs running besides its stages: Ray and a Redis server, each a context manager that stops
only what it started (by handle and PID: never `ray stop`); and more or fewer indexer workers for a running run
(`marge scale`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import marge.util.local_ray
from marge.contracts.config import ConfigError
from marge.util import loopback
from marge.util.local_ray import RayStartError
from services.driver.config import PipelineConfig
from services.driver.redis_server import LocalRedis, private_conf_dir

log = logging.getLogger("marge.pipeline")

def apply_local_ray_env(cfg: PipelineConfig) -> None:
    """Ray reads its environment when it is first imported: set it before any `import ray` for a local cluster."""
    if not cfg.ray.address:
        marge.util.local_ray.apply_local_ray_env()


@dataclass
class RedisEndpoint:
    """The run's Redis: its URL, and the private server behind it when the driver runs one."""

    url: str
    server: LocalRedis | None = None
    restarts: int = 0

    def keep_alive(self) -> None:
        """Start the private server again if it died (same port, password and AOF: clients reconnect); one the
        driver stopped stays stopped."""
        if self.server is not None and not self.server.stopped and not self.server.alive():
            log.warning("redis-server (pid %s) died; starting it again on the same port from its AOF", self.server.pid)
            self.server.restart()
            self.restarts += 1

    @contextlib.contextmanager
    def watched(self, every_s: float = 0.2) -> Iterator["RedisEndpoint"]:
        """`keep_alive` in a thread for the block: the driver's own Redis calls wait (retrying) while it is down."""
        import threading

        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(every_s):
                try:
                    self.keep_alive()
                except Exception:  # noqa: BLE001 - logged; tried again at the next tick
                    log.exception("restarting redis-server failed; trying again")

        thread = threading.Thread(target=watch, name="redis-watchdog", daemon=True)
        try:  # a SIGTERM handled inside start() must still stop the thread: it would start the server again
            thread.start()
            yield self
        finally:
            stop.set()
            if thread.is_alive():  # not if the SIGTERM came before it ran: join would raise over the exit
                thread.join(timeout=5)


@contextlib.contextmanager
def redis_for(cfg: PipelineConfig) -> Iterator[RedisEndpoint]:
    """The run's Redis: `redis.url` as given, or a private redis-server in the run folder (loopback, random
    password, AOF) for as long as the block runs."""
    if cfg.redis.url:
        yield RedisEndpoint(cfg.redis.url)
        return
    server = LocalRedis.reopen(Path(cfg.run.dir) / "redis", private_conf_dir(Path(cfg.run.dir)),
                               appendfsync=cfg.redis.appendfsync, maxmemory=cfg.redis.maxmemory)
    with server:
        yield RedisEndpoint(server.url, server)


@contextlib.contextmanager
def ray_for(cfg: PipelineConfig) -> Iterator[None]:
    """Ray for the block: the configured cluster, a program's own Ray (tests), or a local one we start and stop."""
    apply_local_ray_env(cfg)
    import ray

    namespace = f"marge-{cfg.run.name}"
    def check_cluster() -> None:
        resources = ray.cluster_resources()
        cfg.check_fits(resources.get("CPU", 0.0), resources.get("GPU", 0.0))
        try:
            check_custom_resources(cfg, resources, "the Ray cluster")
        except ConfigError as e:  # a cluster may grow (an autoscaler starts such nodes when actors wait for them)
            log.warning("%s; until a node offering them joins, Ray keeps that stage waiting", e)

    if ray.is_initialized():  # embedded in a program (or a test) that already runs Ray
        check_cluster()
        yield
        return
    if cfg.ray.address:
        try:
            with marge.util.local_ray.keeping_sigterm_handler():
                ray.init(address=cfg.ray.address, namespace=namespace, log_to_driver=True)
        except Exception as e:  # noqa: BLE001 - one line for every way joining fails (the cause is chained)
            raise RayStartError(f"could not join the Ray cluster at ray.address {cfg.ray.address}: "
                                f"{' '.join(str(e).split())[:300]} ({type(e).__name__}); is it running there "
                                f"(`ray status --address {cfg.ray.address}`)? Or drop ray.address to start a "
                                "local Ray") from e
        try:
            check_cluster()
        except BaseException:
            ray.shutdown()  # the connection only: a cluster we joined keeps running
            raise
        yield
        return
    num_cpus = check_local_fit(cfg)  # before Ray starts: an explicit ray.num_cpus too small, GPUs absent
    with marge.util.local_ray.local_ray(num_cpus, namespace, cfg.ray.include_dashboard, cfg.ray.object_store_memory,
                                        check=check_cluster, setup_hook=loopback.SETUP_HOOK):
        yield


def check_local_fit(cfg: PipelineConfig) -> int:
    """The logical CPUs a local Ray started for `cfg` gets, after refusing a run it could not hold (too few CPUs
    in an explicit `ray.num_cpus`, GPUs asked for where there are none): checked before anything starts."""
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(cfg.cpus_needed() + 0.999))
    cfg.check_fits(num_cpus, local_gpus())
    check_custom_resources(cfg, {}, "a local Ray")
    return num_cpus


def check_custom_resources(cfg: PipelineConfig, cluster: dict[str, float], where: str) -> None:
    """Refuse up front a stage whose custom Ray resources (`indexer.resources`, `trainer.resources`) `where` does
    not offer: on a local Ray nothing can add them, so Ray would keep its actors pending for ever and the run would
    wait in silence. On a joined cluster `ray_for` logs it instead: an autoscaler may yet start such nodes."""
    asked = {"trainer.resources": dict(cfg.trainer.resources)}
    if cfg.objectives.needs_index:
        asked["indexer.resources"] = dict(cfg.indexer.resources)
    for key, resources in asked.items():
        missing = {name: amount for name, amount in resources.items() if amount > cluster.get(name, 0.0) + 1e-9}
        if missing:
            offered = sorted(name for name in cluster if name not in ("CPU", "GPU", "memory", "object_store_memory")
                             and not name.startswith(("node:", "accelerator_type:")))
            raise ConfigError(f"{key} asks for {missing} per worker, which {where} does not offer (custom resources "
                              f"there: {offered or 'none'}): start nodes that offer them (`ray start --resources "
                              f"'{{...}}'`) and pass ray.address, or set {key}={{}}")


class StageFailure(RuntimeError):
    """A stage of the run failed for good or stopped answering: the message is one line naming the stage, the
    likely cause and what to try (`describe_stage_failure`)."""


def is_ray_failure(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is Ray failing to schedule, start or keep a stage's actor, as
    opposed to the stage's own code failing (whose traceback is the useful report)."""
    import ray.exceptions

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (ray.exceptions.ActorUnschedulableError, ray.exceptions.ActorDiedError,
                             ray.exceptions.TaskUnschedulableError, ray.exceptions.RuntimeEnvSetupError)) or \
                type(seen).__name__ == "WorkerGroupStartupTimeoutError":
            return True
        seen = seen.__cause__
    return False


def describe_stage_failure(stage: str | None, error: BaseException) -> StageFailure:
    """What a stage's Ray error means for the run, in one line: unschedulable (Ray could not start its worker
    process or find the resources it asks for), dead (killed, or crashed while starting), or another failure."""
    import ray.exceptions

    load = marge.util.local_ray.machine_load()
    who = f"the {stage} stage" if stage else "a stage"
    found = error
    while found.__cause__ is not None and not isinstance(found, ray.exceptions.RayError):
        found = found.__cause__
    if isinstance(found, ray.exceptions.ActorUnschedulableError):
        text = str(found)
        cause = ("Ray could not start a worker process for it in time, again and again: the machine is probably too "
                 f"loaded ({load}); try again when it is quieter, or give the run fewer workers"
                 if "worker startup" in text else
                 "no node offers what it asks for (num_cpus, memory or custom resources): lower its num_cpus or "
                 f"resources, or add a node that has them ({load})")
        return StageFailure(f"{who} could not be scheduled: {cause} (Ray: {' '.join(text.split())[:200]})")
    if isinstance(found, ray.exceptions.ActorDiedError):
        return StageFailure(f"{who}'s actor died ({' '.join(str(found).split())[:200]}): killed, out of "
                            f"memory, or crashed while starting ({load}); its worker log under the Ray session's "
                            "logs folder says which; start the run again to resume it")
    return StageFailure(f"{who} failed: {type(found).__name__}: {' '.join(str(found).split())[:300]}")


def ray_running() -> bool:
    """Whether this process is already connected to Ray (a program or a test embedding the pipeline)."""
    import ray

    return ray.is_initialized()


def local_gpus() -> int:
    """GPUs a local Ray started here would offer (what torch sees; 0 on a CPU build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def scale_indexer_pool(run_name: str, workers: int, address: str) -> dict:
    """Ask the indexer coordinator of the run named `run_name` on the Ray cluster at `address` for `workers`
    workers, from its next index version; refused when the cluster lacks the logical CPUs the extra workers take.
    Returns what the coordinator answers. Only this process's connection to the cluster is closed afterwards."""
    import ray

    namespace = f"marge-{run_name}"
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)
    try:
        try:
            coordinator = ray.get_actor("marge-indexer-coordinator")
        except ValueError:
            raise ValueError(f"no indexer of a run named {run_name!r} on {address} (namespace {namespace}): is it "
                             "training, and does it build an index (BART alone has none)? `ray list actors` shows "
                             "the running ones") from None
        pool = ray.get(coordinator.pool.remote())
        extra_cpus = (workers - pool["wanted"]) * pool["cpus_per_worker"]
        free = ray.available_resources().get("CPU", 0.0)
        if extra_cpus > free + 1e-9:
            raise ValueError(f"{workers} indexer workers need {extra_cpus:g} more logical CPUs "
                             f"({pool['cpus_per_worker']:g} each) but the cluster has {free:g} free: add a node "
                             "or ask for fewer workers")
        return ray.get(coordinator.scale.remote(workers))
    finally:
        ray.shutdown()  # the connection only
