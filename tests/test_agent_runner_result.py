"""The agent runner: what an agent's entrypoint returns reaches the sample as the runner documents."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import time
import types
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from core.tasks import Task
from rollout_server.agent_runner import OUTPUT_TAIL, run_agent

TASK = Task(task_id="t-1", messages=[{"role": "user", "content": "hi"}], reward={})


def big_reward(task: dict[str, Any], base_url: str, api_key: str) -> Any:
    """Returns something that is not a reward, and larger than a pipe's buffer."""
    return ["not a reward"] * 100_000


def test_a_large_non_reward_result_is_an_agent_error_not_a_timeout() -> None:
    """An entrypoint that returns a large non-float fails its sample at once as ``agent_error`` naming what it
    returned; the child never blocks on sending it back (which ran the sample into its time limit)."""
    start = time.monotonic()
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:big_reward", TASK, "http://127.0.0.1:9/v1", "k",
                                    timeout_s=20, memory_mb=2048, max_processes=64))
    assert outcome.failure == "agent_error", outcome
    assert "returned ['not a reward', " in outcome.error and outcome.error.endswith("; want a finite float or None")
    assert time.monotonic() - start < 15


def nan_reward(task: dict[str, Any], base_url: str, api_key: str) -> float:
    return float("nan")


def test_a_reward_that_is_not_finite_is_an_agent_error() -> None:
    """An entrypoint that returns NaN fails its sample as ``agent_error`` naming it: a NaN reward would poison its
    group's advantages (the built-in reward functions are held to the same)."""
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:nan_reward", TASK, "http://127.0.0.1:9/v1", "k",
                                    timeout_s=20, memory_mb=2048, max_processes=64))
    assert (outcome.failure, outcome.reward) == ("agent_error", None), outcome
    assert outcome.error == "agent tests.test_agent_runner_result:nan_reward returned nan; want a finite float or None"


def leaves_a_process(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Starts a process it never stops; its pid is the reward, so the test can look for it."""
    return float(subprocess.Popen(["sleep", "600"]).pid)


def test_what_an_agent_started_ends_with_its_sample() -> None:
    """A process the agent started and left running is killed when the agent returns (its process group), not left
    behind by every sample of the run."""
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:leaves_a_process", TASK, "http://127.0.0.1:9/v1",
                                    "k", timeout_s=20, memory_mb=2048, max_processes=64))
    assert outcome.failure is None and outcome.reward is not None, outcome
    pid = int(outcome.reward)
    deadline = time.monotonic() + 5
    try:
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
        assert not _running(pid), f"the agent's process {pid} outlived its sample"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: a container's init may be slow to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def prints_a_lot(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Prints 8 MiB to stdout, then a line to each of stdout and stderr, and one through a process it starts."""
    for _ in range(8):
        print("x" * (1 << 20), end="")
    print("\nlast on stdout")
    print("last on stderr", file=sys.stderr)
    subprocess.run(["echo", "from a child"], check=True)
    return 1.0


def test_what_an_agent_prints_is_kept_and_logged_only_as_its_last_16_kib(caplog: pytest.LogCaptureFixture) -> None:
    """An agent's prints went to the rollout server's stderr without bound; only the last OUTPUT_TAIL bytes are kept
    and logged, saying how many came before them, and printing never blocks the agent."""
    with caplog.at_level(logging.INFO, logger="rollout_server.agent_runner"):
        outcome = asyncio.run(run_agent("tests.test_agent_runner_result:prints_a_lot", TASK, "http://127.0.0.1:9/v1",
                                        "k", timeout_s=60, memory_mb=2048, max_processes=64))
    assert (outcome.failure, outcome.reward) == (None, 1.0), outcome
    [record] = [r for r in caplog.records if r.name == "rollout_server.agent_runner"]
    tail = "\nlast on stdout\nlast on stderr\nfrom a child\n"
    printed = (8 << 20) + len(tail)
    head, kept = record.getMessage().split("\n", 1)
    assert head == (f"agent tests.test_agent_runner_result:prints_a_lot, task t-1, printed {printed} bytes; the first "
                    f"{printed - OUTPUT_TAIL} bytes dropped:")
    assert kept == "x" * (OUTPUT_TAIL - len(tail)) + tail


class _Planted(float):
    """A reward whose pickle runs code where it is unpickled: it writes that process's pid to the task's file."""

    path = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"import os; open({self.path!r}, 'w').write(str(os.getpid()))",)


def planted_reward(task: dict[str, Any], base_url: str, api_key: str) -> float:
    reward = _Planted(0.5)
    reward.path = task["messages"][0]["content"]
    return reward


def test_a_reward_runs_no_code_in_the_rollout_server(tmp_path: Path) -> None:
    """The agent's result was unpickled in the rollout server: a reward's ``__reduce__`` ran the agent's code there,
    in the process that holds the secrets (which agent code must not reach); it crosses as JSON, the number it is."""
    planted = tmp_path / "planted"
    task = Task(task_id="t-1", messages=[{"role": "user", "content": str(planted)}], reward={})
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:planted_reward", task, "http://127.0.0.1:9/v1",
                                    "k", timeout_s=20, memory_mb=2048, max_processes=64))
    assert not planted.exists(), f"the reward's code ran in process {planted.read_text()} (the test's: {os.getpid()})"
    assert (outcome.failure, outcome.reward) == (None, 0.5), outcome


def reward_of_a_class_only_its_process_has(task: dict[str, Any], base_url: str, api_key: str) -> int:
    """An int subclass of a module that exists only in the agent's process (an IntEnum of a module it made)."""
    module = types.ModuleType("rollwave_agent_only")
    module.Score = type("Score", (int,), {"__module__": module.__name__})
    sys.modules[module.__name__] = module
    return module.Score(1)


def test_a_reward_of_a_class_the_rollout_server_cannot_import_is_the_number() -> None:
    """Unpickling a reward whose class the rollout server cannot import raised out of ``run_agent`` (which never
    raises for the agent's faults) and failed the whole group; it is the number it is."""
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:reward_of_a_class_only_its_process_has", TASK,
                                    "http://127.0.0.1:9/v1", "k", timeout_s=20, memory_mb=2048, max_processes=64))
    assert (outcome.failure, outcome.reward) == (None, 1.0), outcome
    assert "rollwave_agent_only" not in sys.modules


def sends_garbage(task: dict[str, Any], base_url: str, api_key: str) -> None:
    """Writes bytes that are no result to the pipe its result goes back on, and exits before the runner sends one."""
    [pipe] = [c for c in gc.get_objects() if isinstance(c, Connection) and not c.closed and c.writable]
    pipe.send_bytes(b"\x80garbage")
    os._exit(0)


def test_garbage_on_the_result_pipe_is_an_agent_error() -> None:
    """Bytes on the result pipe that are no result (unpickled, they raised out of ``run_agent`` and failed the group)
    fail only the sample, as ``agent_error`` saying so."""
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:sends_garbage", TASK, "http://127.0.0.1:9/v1",
                                    "k", timeout_s=20, memory_mb=2048, max_processes=64))
    assert outcome.failure == "agent_error", outcome
    assert outcome.error.startswith("agent tests.test_agent_runner_result:sends_garbage failed: its process sent a "
                                    "result that cannot be read: "), outcome
