"""The embedded Redis and its owner. The standalone ``python -m rollout_server`` stops in seconds on a Ctrl-C, which
the terminal sends to its whole process group: its embedded redis-server, in a session of its own, outlives the
signal and is stopped last, after the server deregistered. A Redis that is really gone during the shutdown is said
in one line, not waited for (the 60 s outage budget a running server rides out). A killed owner's redis-server is
stopped by its guard, with its process group if it hangs. A data directory has one owner: a second is refused by
name, also while the redis-server of a killed owner still runs on it (its guard killed too); while that guard still
stops it, a new owner waits and takes the directory over."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from buffer_helpers import client

from buffer.keys import Keys
from buffer.redis_server import GUARD, DataDirInUse, EmbeddedRedis
from buffer.registry import ServerRegistry

ROOT = Path(__file__).resolve().parents[1]
STOP_BOUND_S = 20.0  # the old shutdown waited out the outage budget twice: about 120 s
GONE_BOUND_S = 30.0  # a redis-server flushing its AOF as it stops takes milliseconds
OWNER = """
import sys
import redis
from buffer.redis_server import EmbeddedRedis
server = EmbeddedRedis(sys.argv[1]).start()
redis.Redis.from_url(server.url).set("k", "v")
print(server.proc.pid, server.port, flush=True)
sys.stdin.read()
"""


class Server:
    """``python -m rollout_server`` with its own engine, alone in a new process group (as a terminal starts it)."""

    def __init__(self, tmp: Path, model: Path, *extra: str) -> None:
        self.log_path = tmp / "rollout.log"
        argv = [sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp}", f"model.path={model}",
                "model.init_if_missing=false", f"checkpoint.stage_dir={tmp / 'stage'}", "rollout.server_id=srv",
                *extra]
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        env["ROLLWAVE_CHECKPOINT_TOKEN"] = secrets.token_urlsafe(32)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         process_group=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "rollout worker srv serving" not in self.log():
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"not serving within {timeout_s:.0f} s:\n{self.log()}"
            time.sleep(0.1)

    def ctrl_c(self) -> None:
        """SIGINT to the group, as a terminal's Ctrl-C; fails unless the server exits within the bound."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {STOP_BOUND_S:.0f} s of a Ctrl-C:\n{self.log()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def server(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*extra: str) -> Server:
        started.append(Server(tmp_path, tiny_model_dir, *extra))
        return started[-1]

    yield start
    for s in started:
        s.close()


def gone(pid: int) -> bool:
    """The process exited with every thread of it. Its leader reads zombie while its other threads (Redis's I/O
    threads) still exit, and they hold its files until the last one has: the data directory's lock too."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # reaped
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] not in ("Z", "X"):
                    return False
        except FileNotFoundError:  # this thread left since the listing
            continue
    return True

@contextlib.contextmanager
def owner_of(data_dir: Path) -> Iterator[tuple[subprocess.Popen, int, list[psutil.Process]]]:
    """The ``OWNER`` script on ``data_dir`` once its key is written: the process, its redis-server's pid and the
    processes it started (the server, its guard); all killed on the way out (psutil checks each pid is still its)."""
    started: list[psutil.Process] = []
    with subprocess.Popen([sys.executable, "-c", OWNER, str(data_dir)], cwd=ROOT, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as owner:
        try:
            assert owner.stdout is not None
            redis_pid = int(owner.stdout.readline().split()[0])
            started = psutil.Process(owner.pid).children()
            yield owner, redis_pid, started
        finally:
            owner.kill()
            for process in started:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()



def test_ctrl_c_stops_a_server_and_its_embedded_redis_in_seconds(server, tmp_path: Path) -> None:
    s = server()
    s.wait_serving()
    [redis_pid] = [p.pid for p in psutil.Process(s.proc.pid).children() if p.name() == "redis-server"]
    s.ctrl_c()
    assert s.proc.returncode == 0, s.log()
    assert "ConnectionError" not in s.log() and "Redis at" not in s.log(), s.log()  # Redis was there to the end
    assert gone(redis_pid), f"redis-server {redis_pid} outlived its owner"
    with EmbeddedRedis(tmp_path / "t" / "redis") as again:  # the directory is free, the AOF holds the shutdown
        assert ServerRegistry(client(again), Keys("t")).all_servers() == []


def test_a_redis_gone_during_the_shutdown_is_said_once_and_not_waited_for(
    server, redis_server: EmbeddedRedis
) -> None:
    s = server(f"redis.url={redis_server.url}")
    s.wait_serving()
    redis_server.kill()
    time.sleep(1.0)  # the server rides out the outage meanwhile (its reads and heartbeat retry)
    assert s.proc.poll() is None, s.log()
    s.ctrl_c()
    assert s.proc.returncode == 0, s.log()
    said = [line for line in s.log().splitlines() if "Redis at" in line]
    assert len(said) == 1 and "stopping without Redis" in said[0] and "not retried: shutting down" in said[0], s.log()


def test_a_second_owner_of_a_data_dir_is_refused_while_the_first_or_its_server_lives(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The owner is a process with an embedded Redis in ``<run dir>/t/redis``; a rollout server on that run
    directory is refused (config error, exit 2) naming the directory, the owner and REDIS_URL. Once the owner is
    SIGKILLed, its guard first, its redis-server still runs on the files, and is named; once that is gone too, the
    directory (and its data) is free."""
    data_dir = (tmp_path / "t" / "redis").absolute()
    with owner_of(data_dir) as (owner, redis_pid, _):
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        second = subprocess.run(
            [sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp_path}",
             f"model.path={tiny_model_dir}", "model.init_if_missing=false", "engine.urls=[]"],
            cwd=ROOT, env={**env, "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}, capture_output=True,
            text=True, timeout=60,
        )
        assert second.returncode == 2, second.stderr
        assert (f"error: run.dir: {data_dir}: the data directory of another embedded Redis (owner pid {owner.pid}, "
                f"redis-server pid {redis_pid})") in second.stderr, second.stderr
        assert "give every part its REDIS_URL" in second.stderr
        for guard in psutil.Process(owner.pid).children():
            if guard.pid != redis_pid:
                guard.kill()
        owner.kill()
        owner.wait()
        with pytest.raises(DataDirInUse, match=f"owner pid {owner.pid} has exited; its redis-server pid "
                                               f"{redis_pid} still runs on it"):
            EmbeddedRedis(data_dir).start()
        os.kill(redis_pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not gone(redis_pid):
            assert time.monotonic() < deadline, f"redis-server {redis_pid} did not stop on SIGTERM"
            time.sleep(0.05)
        with EmbeddedRedis(data_dir) as taken_over:
            assert client(taken_over).get("k") == b"v"


def test_a_killed_owner_takes_its_embedded_redis_along(tmp_path: Path) -> None:
    """The owner SIGKILLed, its redis-server is SIGTERMed (its log says it shut down: the AOF flushed) and every
    process the owner started for it ends; the data directory is then free, with the data written before."""
    data_dir = (tmp_path / "redis").absolute()
    with owner_of(data_dir) as (owner, redis_pid, started):
        assert redis_pid in [p.pid for p in started]
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + GONE_BOUND_S
        while left := [p.pid for p in started if not gone(p.pid)]:
            assert time.monotonic() < deadline, f"{left} (redis-server {redis_pid}) outlived the killed owner"
            time.sleep(0.05)
        assert "ready to exit" in (data_dir / "redis.log").read_text()
        with EmbeddedRedis(data_dir) as again:
            assert client(again).get("k") == b"v"


def test_a_new_owner_takes_over_from_a_killed_one_whose_redis_server_still_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new owner starting at once on the directory of one just SIGKILLed (a Ray actor rebuilt after its worker
    died, a restarted process) finds the lock still held by the old redis-server, which its guard is stopping (held
    here in SIGSTOP, so the SIGTERM waits, until the new owner says it waits): it waits for that server to exit, saying
    so, and has its data."""
    data_dir = (tmp_path / "redis").absolute()
    with owner_of(data_dir) as (owner, redis_pid, _):
        os.kill(redis_pid, signal.SIGSTOP)
        owner.kill()
        owner.wait()
        with caplog.at_level(logging.WARNING, logger="buffer.redis_server"), \
                ThreadPoolExecutor(1) as pool:
            starting = pool.submit(EmbeddedRedis(data_dir).start)
            deadline = time.monotonic() + GONE_BOUND_S
            while f"is stopping its redis-server pid {redis_pid}; waiting up to" not in caplog.text:
                assert not starting.done() and time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
            assert f"its owner pid {owner.pid} has exited and its guard pid " in caplog.text, caplog.text
            os.kill(redis_pid, signal.SIGCONT)
            again = starting.result(GONE_BOUND_S)
            try:
                assert client(again).get("k") == b"v"
            finally:
                again.stop()


HANGS = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child:
    print(child, flush=True)
time.sleep(120)
"""


def test_a_guard_kills_the_process_group_of_a_server_that_ignores_sigterm() -> None:
    """A server that ignores SIGTERM past the guard's grace is SIGKILLed with its process group: a child it forked
    (Redis's AOF rewrite, which holds the data directory's lock too) must not outlive it. The guard runs here with
    a grace of 0.2 s on a stand-in server, alone in its session as the real one."""
    owner = subprocess.Popen(["sleep", "120"])
    server = subprocess.Popen([sys.executable, "-c", HANGS], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    fds = [os.pidfd_open(owner.pid), os.pidfd_open(server.pid)]
    child = None
    try:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", GUARD, *map(str, fds), str(server.pid), "0.2"],
                                 pass_fds=fds)
        owner.kill()
        assert guard.wait(30) == 0
        assert server.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while not gone(child):
            assert time.monotonic() < deadline, f"the server's child {child} outlived it"
            time.sleep(0.05)
    finally:
        for fd in fds:
            os.close(fd)
        for proc in (owner, server):
            proc.kill()
            proc.wait()
        if child is not None and not gone(child):
            os.kill(child, signal.SIGKILL)
