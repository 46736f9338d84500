"""The agent runner leaves no process behind: what an agent started, in a session of its own and orphaned too, ends
with its sample, at the time limit, and when the rollout server running it dies.

Each agent here starts a detached grandchild (``_detach``: its parent exits, it leads a new session, so neither the
agent's process group nor its parent's death reaches it) and writes the pids to the file its task's message names.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core.tasks import Task
from rollout_server.agent_runner import run_agent

URL = "http://127.0.0.1:9/v1"
_DETACH = """
import subprocess, sys
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # ' + sys.argv[1]],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid)
"""


def _detach(task: dict[str, Any]) -> None:
    """Start the detached grandchild; write its pid and this process's to the task's file."""
    marker = task["task_id"]
    pid = int(subprocess.run([sys.executable, "-c", _DETACH, marker], capture_output=True, text=True,
                             check=True).stdout)
    path = Path(task["messages"][0]["content"])
    path.with_suffix(".tmp").write_text(f"{pid} {os.getpid()}")
    path.with_suffix(".tmp").rename(path)


def detaches(task: dict[str, Any], base_url: str, api_key: str) -> float:
    _detach(task)
    return 1.0


def detaches_and_hangs(task: dict[str, Any], base_url: str, api_key: str) -> float:
    _detach(task)
    time.sleep(600)
    return 1.0


def _task(tmp_path: Path) -> Task:
    marker = f"rollwave-agent-{os.getpid()}-{time.monotonic_ns()}"
    return Task(task_id=marker, messages=[{"role": "user", "content": str(tmp_path / "pids")}], reward={})


def _pids(tmp_path: Path) -> tuple[int, int]:
    """The detached grandchild's pid and the agent's."""
    grandchild, agent = (tmp_path / "pids").read_text().split()
    return int(grandchild), int(agent)


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process at all, a zombie included: the runner must reap what it kills."""
    return Path(f"/proc/{pid}").exists()


def _kill_if(pid: int, marker: str) -> None:
    """SIGKILL ``pid`` if it is still the process whose command line holds ``marker`` (what a failure left)."""
    try:
        if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def test_a_detached_process_the_agent_left_ends_with_its_sample(tmp_path: Path) -> None:
    """Its process group was killed, but a process in a session of its own survived every sample, and an orphan
    that was killed stayed a zombie under a rollout server that is a container's pid 1."""
    task = _task(tmp_path)
    try:
        outcome = asyncio.run(run_agent("tests.test_agent_runner_processes:detaches", task, URL, "k", timeout_s=60,
                                        memory_mb=2048, max_processes=64))
        assert (outcome.failure, outcome.reward) == (None, 1.0), outcome
        grandchild, _ = _pids(tmp_path)
        assert not _exists(grandchild), f"the agent's detached process {grandchild} outlived its sample"
    finally:
        if (tmp_path / "pids").exists():
            _kill_if(_pids(tmp_path)[0], task.task_id)


def test_a_detached_process_the_agent_left_ends_at_the_time_limit(tmp_path: Path) -> None:
    task = _task(tmp_path)
    try:
        outcome = asyncio.run(run_agent("tests.test_agent_runner_processes:detaches_and_hangs", task, URL, "k",
                                        timeout_s=3, memory_mb=2048, max_processes=64))
        assert outcome.failure == "agent_timeout", outcome
        grandchild, agent = _pids(tmp_path)
        assert not _exists(agent) and not _exists(grandchild), "the agent's processes outlived its time limit"
    finally:
        if (tmp_path / "pids").exists():
            _kill_if(_pids(tmp_path)[0], task.task_id)


_SERVER = """
import asyncio, sys
from core.tasks import Task
from rollout_server.agent_runner import run_agent
task = Task(task_id=sys.argv[1], messages=[{"role": "user", "content": sys.argv[2]}], reward={})
asyncio.run(run_agent("tests.test_agent_runner_processes:detaches_and_hangs", task, "http://127.0.0.1:9/v1", "k",
                      timeout_s=600, memory_mb=2048, max_processes=64))
"""


def test_the_agent_and_what_it_started_end_when_the_rollout_server_dies(tmp_path: Path) -> None:
    """A rollout server that was SIGKILLed (or crashed) left its agents running to their own end, if any."""
    task = _task(tmp_path)
    log = tmp_path / "server.log"
    with log.open("wb") as stderr:
        server = subprocess.Popen([sys.executable, "-c", _SERVER, task.task_id, str(tmp_path / "pids")],
                                  cwd=Path(__file__).parents[1], stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids").exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "pids").exists(), f"the agent never started: {log.read_text()[-3000:]}"
        grandchild, agent = _pids(tmp_path)
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 30
        while (_exists(agent) or _exists(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _exists(agent), f"the agent {agent} outlived the rollout server that ran it"
        assert not _exists(grandchild), f"the agent's detached process {grandchild} outlived the rollout server"
    finally:
        server.kill()
        server.wait(30)
        if (tmp_path / "pids").exists():
            grandchild, agent = _pids(tmp_path)
            _kill_if(grandchild, task.task_id)
            _kill_if(agent, "forkserver")

