"""LocalStack's supervision: a crashed component is restarted; one that refused its config (exit 2) is not;
spawning is safe beside gRPC; a component dies with its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from core.config import CONFIG_ERROR_EXIT
from core.process import stop_process
from services.launcher import ComponentSpec, LocalStack, spawn


def test_a_crash_restarts_but_a_config_refusal_does_not(tmp_path: Path) -> None:
    crashes = ComponentSpec("crashes", [sys.executable, "-c", "import sys; sys.exit(1)"])
    refuses = ComponentSpec("refuses", [sys.executable, "-c",
                                        f"import sys; print('error: x.y is bad'); sys.exit({CONFIG_ERROR_EXIT})"])
    with LocalStack([crashes, refuses], tmp_path / "logs", poll_s=0.05) as stack:
        deadline = time.monotonic() + 60
        while stack.restarts["crashes"] < 2 or "refuses" not in stack.refused:
            assert time.monotonic() < deadline, (stack.restarts, stack.refused)
            time.sleep(0.05)
        seen = stack.restarts["crashes"]
        time.sleep(1.0)
        assert stack.restarts["refuses"] == 0 and stack.refused == {"refuses"}
        assert stack.restarts["crashes"] > seen  # still restarting the crashing one
    assert (tmp_path / "logs" / "refuses.log").read_text().count("error: x.y is bad") == 1


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


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


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
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, f"child {pid} outlived its launcher"
            time.sleep(0.05)
    finally:
        stop_process(proc, 10)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
