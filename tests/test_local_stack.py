"""LocalStack's supervision: a crashed component is restarted, once what it left is killed; one that refused its
config (exit 2) is not; a restart that cannot be made is tried again; fault injection and close at any moment (a
component waiting out its backoff) raise nothing and leave nothing; spawning is safe beside gRPC; a component, and
the engine a rollout server starts, dies with its launcher."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from core.config import CONFIG_ERROR_EXIT
from core.process import stop_process
from services.launcher import ComponentSpec, LocalStack, spawn


def test_a_crash_restarts_but_a_config_refusal_does_not(tmp_path: Path) -> None:
    crashes = ComponentSpec("crashes", [sys.executable, "-c", "import sys; sys.exit(1)"],
                            max_restarts=0)  # never given up
    refuses = ComponentSpec("refuses", [sys.executable, "-c",
                                        f"import sys; print('error: x.y is bad'); sys.exit({CONFIG_ERROR_EXIT})"])
    with LocalStack([crashes, refuses], tmp_path / "logs", poll_s=0.05, max_backoff_s=0.05) as stack:
        deadline = time.monotonic() + 60
        while stack.restarts["crashes"] < 2 or "refuses" not in stack.refused:
            assert time.monotonic() < deadline, (stack.restarts, stack.refused)
            time.sleep(0.05)
        seen = stack.restarts["crashes"]
        time.sleep(1.0)
        assert stack.restarts["refuses"] == 0 and stack.refused == {"refuses"}
        assert stack.restarts["crashes"] > seen  # still restarting the crashing one
    assert (tmp_path / "logs" / "refuses.log").read_text().count("error: x.y is bad") == 1


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


# A component that starts a child in its own process group (as a rollout server starts its engine), records the
# child's pid, and the first time SIGKILLs itself (as the OOM killer would), leaving the child behind.
CRASHES_WITH_A_CHILD = """
import os, signal, subprocess, sys, time
from pathlib import Path
pids = Path(sys.argv[1])
first = not pids.exists()
child = subprocess.Popen(["sleep", "120"])
with pids.open("a") as f:
    f.write(f"{child.pid}\\n")
if first:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def _gone(pid: int, what: str, timeout_s: float = 10.0) -> None:
    """Wait for ``pid`` to end (or be a zombie): a process signalled a moment ago may still be running."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"{what}: {pid}"
        time.sleep(0.05)


def test_a_restart_first_kills_what_the_dead_component_left(tmp_path: Path) -> None:
    """A SIGKILLed rollout server leaves its engine: the restart kills it, rather than start a second beside it
    that outlives the run."""
    pids = tmp_path / "children"
    spec = ComponentSpec("rollout-0", [sys.executable, "-c", CRASHES_WITH_A_CHILD, str(pids)])
    children: list[int] = []
    try:
        with LocalStack([spec], tmp_path / "logs", poll_s=0.05) as stack:
            deadline = time.monotonic() + 60
            while len(children := [int(p) for p in (pids.read_text() if pids.exists() else "").split()]) < 2:
                assert time.monotonic() < deadline, (stack.restarts, children)
                time.sleep(0.05)
            first, second = children
            assert stack.restarts["rollout-0"] == 1
            _gone(first, "the first generation's child outlived it")
            assert _alive(second)  # the live generation's child is left alone
        _gone(second, "close() left the live generation's child")  # a signalled process takes a moment to die
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _logged(caplog: pytest.LogCaptureFixture, message: str, timeout_s: float = 60.0) -> None:
    """Wait for a line of what ``services.launcher`` logged to hold ``message``."""
    deadline = time.monotonic() + timeout_s
    while not any(message in r.getMessage() for r in caplog.records if r.name == "services.launcher"):
        assert time.monotonic() < deadline, f"never logged: {message}"
        time.sleep(0.01)


def test_kill_and_close_while_a_component_waits_out_its_backoff(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A component that died has no process until its restart is due: ``kill`` says so (it signalled the dead
    one's group, gone, and raised ProcessLookupError), and ``close`` stops the rest, leaving nothing running."""
    caplog.set_level(logging.INFO, "services.launcher")
    pids = tmp_path / "children"
    dies = ComponentSpec("dies", ["sh", "-c", "exit 1"])
    lives = ComponentSpec("lives", [sys.executable, "-c", CRASHES_WITH_A_CHILD, str(pids)])
    pids.write_text("")  # not its first run: it does not kill itself
    children: list[int] = []
    try:
        with LocalStack([dies, lives], tmp_path / "logs", poll_s=0.01, backoff_s=60,
                        max_backoff_s=60) as stack:
            _logged(caplog, "s up; restarting it in 60 s")  # what dies logs as it dies
            assert stack.kill("dies") is False
            deadline = time.monotonic() + 60
            while not (children := [int(p) for p in pids.read_text().split()]):
                assert time.monotonic() < deadline, "lives never started its child"
                time.sleep(0.05)
            leader = stack.pid("lives")
        assert stack.restarts == {"dies": 0, "lives": 0}
        _gone(leader, "close() left a running component")
        _gone(children[0], "close() left a running component's child")
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_restart_that_cannot_be_made_is_tried_again_and_the_rest_stay_supervised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A component whose program is gone when its restart is due (as a process or file limit would make the spawn
    fail): the failure is logged and the restart tried again after the next delay; the spawn's OSError used to end
    the supervisor, and no component was restarted again."""
    caplog.set_level(logging.INFO, "services.launcher")
    program = tmp_path / "program"
    program.write_text('#!/bin/sh\nrm -f "$0"\nexit 1\n')  # it removes itself, then fails
    program.chmod(0o755)
    gone = ComponentSpec("gone", [str(program)])
    crashes = ComponentSpec("crashes", ["sh", "-c", "exit 1"], max_restarts=0)  # never given up
    with LocalStack([gone, crashes], tmp_path / "logs", poll_s=0.01, backoff_s=0.05, max_backoff_s=0.2) as stack:
        _logged(caplog, f"gone could not be restarted ([Errno 2] No such file or directory: '{program}'); trying "
                        "again in 0.1 s")
        seen = stack.restarts["crashes"]
        deadline = time.monotonic() + 60
        while stack.restarts["crashes"] <= seen:
            assert time.monotonic() < deadline, "the other component is no longer restarted"
            time.sleep(0.01)
        assert stack.restarts["gone"] == 0
        back = tmp_path / "program.new"
        back.write_text("#!/bin/sh\nexec sleep 120\n")
        back.chmod(0o755)
        back.rename(program)  # whole, at once: an exec never sees it half written
        while stack.restarts["gone"] < 1:
            assert time.monotonic() < deadline, "gone was not restarted once its program was back"
            time.sleep(0.01)
        pid = stack.pid("gone")
        assert stack.kill("gone", signal.SIGCONT) is True  # it runs
    _gone(pid, "close() left the restarted component")


def test_spawning_beside_grpc_never_kills_the_child_before_exec(tmp_path: Path) -> None:
    """A launcher that has used gRPC (the test process, the demo) spawns hundreds of children: none aborts.

    With a ``preexec_fn`` the child was forked, gRPC's fork handler restarted its poller there, and the
    poller aborted on the descriptors the child closes before exec: about one spawn in seventy died with -6.
    """
    server = grpc.server(ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=30)  # the poller is live
        codes = [spawn(ComponentSpec("true", ["true"]), tmp_path / "logs", os.environ).wait(timeout=30)
                 for _ in range(300)]
    finally:
        channel.close()
        server.stop(None)
    assert codes == [0] * len(codes), sorted(set(codes))


def test_a_component_dies_with_its_launcher(tmp_path: Path) -> None:
    child = ("import os, time; from core.process import PARENT_PID_ENV, die_with_parent; die_with_parent(); "
             "print('armed', PARENT_PID_ENV in os.environ, flush=True); time.sleep(120)")
    launcher = ("import os, pathlib, sys, time; from services.launcher import ComponentSpec, spawn; "
                f"p = spawn(ComponentSpec('child', [sys.executable, '-c', {child!r}]), "
                f"pathlib.Path({str(tmp_path)!r}), os.environ); "
                "print(p.pid, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parent.parent)
    pid = 0
    try:
        pid = int(proc.stdout.readline())
        log = tmp_path / "child.log"
        deadline = time.monotonic() + 60
        while "armed" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, "the child never armed its death signal"
            time.sleep(0.05)
        assert log.read_text().split() == ["armed", "False"]  # its own children do not inherit the launcher's pid
        _kill_and_outlive_not(proc, pid, "its launcher")
    finally:
        stop_process(proc, 10)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _kill_and_outlive_not(parent: subprocess.Popen, pid: int, what: str) -> None:
    """SIGKILL ``parent``: its child ``pid`` must be gone within 30 s."""
    parent.kill()
    parent.wait(timeout=30)
    _gone(pid, f"outlived {what}", timeout_s=30)


def test_the_engine_dies_with_the_rollout_server_that_started_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A rollout server killed outright (SIGKILL, OOM) takes its engine with it, wherever it runs (Ray, compose,
    by hand), not only under a launcher that kills its process group. It launches the engine on its main thread
    and waits for it on a worker thread, which ends without taking the engine along."""
    server = ("import sys, threading, time; from rollout_server.engine.process import EngineProcess; "
              "engine = EngineProcess(sys.argv[1], threads=1, log_path=sys.argv[2]).launch(); "
              "waiter = threading.Thread(target=engine.wait_ready, args=(120,)); waiter.start(); waiter.join(); "
              "print(engine.pid, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", server, str(tiny_model_dir), str(tmp_path / "engine.log")],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    pid = 0
    try:
        pid = int(proc.stdout.readline())
        time.sleep(0.5)
        assert _alive(pid), "the engine stopped when the thread that waited for it ended"
        _kill_and_outlive_not(proc, pid, "the rollout server that started it")
    finally:
        stop_process(proc, 10)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
