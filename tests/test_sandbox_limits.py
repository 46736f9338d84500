"""What one episode may take of the rollout server's sandboxes and processes: its python tool calls at most
``max_per_episode`` of the tool's sandboxes at once, and an agent run at most ``rollout.agent_max_processes``
processes (a fork bomb stops there, and every process it started ends with the run)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from core.config import RolloutConfig, load_config
from core.tasks import Task
from rollout_server.agent_runner import run_agent
from rollout_server.tools import ToolRegistry, ToolResult
from rollout_server.tools.python_tool import PythonTool

REPO = Path(__file__).parents[1]
FORKS = 64  # what the fork bomb below starts at most: a bound on the test, well past the limits it is run under
SLEEP = "import time; time.sleep(60)"
WHO = ["root", "user"] if os.geteuid() == 0 else ["user"]  # who runs the rollout server: as root, both are tried


async def _hold_and_call(tool: PythonTool, calls: list[tuple[str, str]]) -> list[ToolResult]:
    """Start a call of episode ``a`` that holds its sandbox until cancelled, then ``calls`` (episode, code) at once;
    their results once they end, after which the first is cancelled."""
    holder = asyncio.create_task(tool.execute("a", {"code": SLEEP}))
    await asyncio.sleep(0)  # it takes a sandbox
    try:
        return list(await asyncio.gather(*(tool.execute(episode, {"code": code}) for episode, code in calls)))
    finally:
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holder


def test_one_episode_cannot_hold_every_sandbox() -> None:
    """An episode making parallel calls took every sandbox (``max_concurrent``), so another episode's call waited
    ``max_wait_s`` and was refused. By default an episode holds at most half of them: its call past that waits for one
    of its own and is refused, naming the limit, while the other episode's call runs."""
    tool = PythonTool(max_concurrent=2, max_wait_s=1, timeout_s=5)  # episode a's sandboxes run far past max_wait_s
    over, other = asyncio.run(_hold_and_call(tool, [("a", SLEEP), ("b", "print('b')")]))
    assert other.ok and other.text == "b\n", other
    assert not over.ok and over.outcome == "busy", over
    assert over.error == "busy: this episode's max_per_episode (1) sandboxes ran for all of the 1s this call waited " \
        "(max_wait_s); try again later"
    assert tool._episodes == {}  # none is held after its calls: an episode never released takes no memory


def test_max_per_episode_from_the_tool_config_lets_one_episode_run_more_at_once(tmp_path: Path) -> None:
    """``max_per_episode`` (a python tool kwarg of the tool config) at 2 of 2: the episode's second call runs beside
    its first, where the default (1) refused it above; past ``max_concurrent`` it is a config error."""
    config = tmp_path / "tools.yaml"
    config.write_text("- name: python\n"
                      "  kwargs: {max_concurrent: 2, max_per_episode: 2, max_wait_s: 1, timeout_s: 60}\n")
    tool = ToolRegistry.from_file(config).get("python")
    assert isinstance(tool, PythonTool) and tool.max_per_episode == 2
    (second,) = asyncio.run(_hold_and_call(tool, [("a", "print('a')")]))
    assert second.ok and second.text == "a\n", second
    with pytest.raises(ValueError, match=r"max_per_episode \(3\) must be at most max_concurrent \(2\)"):
        PythonTool(max_concurrent=2, max_per_episode=3)


def fork_bomb(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Starts up to ``FORKS`` processes that sleep; fails at the first fork refused, naming those it started."""
    started: list[int] = []
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:
                time.sleep(600)
                os._exit(0)
            started.append(pid)
    except BlockingIOError as exc:
        raise RuntimeError(f"started {started}") from exc
    return float(len(started))


_SERVER = """
import asyncio, dataclasses, json, sys
from core.tasks import Task
from rollout_server.agent_runner import run_agent, start_fork_server
asyncio.run(start_fork_server(["tests.test_sandbox_limits:fork_bomb"]))  # imported while it may read /root
task = Task(task_id="bomb", messages=[{"role": "user", "content": "fork"}], reward={})
outcome = asyncio.run(run_agent("tests.test_sandbox_limits:fork_bomb", task, "http://127.0.0.1:9/v1", "k", timeout_s=60,
                                memory_mb=2048, max_processes=json.loads(sys.argv[1])))
print(json.dumps(dataclasses.asdict(outcome)))
"""


def _run_bomb(who: str, max_processes: int | None) -> dict[str, Any]:
    """The fork bomb's outcome, run by a rollout server that is root (this process, if it is) or another user: a
    process of uid 65534 (which, to start this interpreter under /root, may read and search every directory)."""
    if who == "root":
        task = Task(task_id="bomb", messages=[{"role": "user", "content": "fork"}], reward={})
        outcome = asyncio.run(run_agent("tests.test_sandbox_limits:fork_bomb", task, "http://127.0.0.1:9/v1", "k",
                                        timeout_s=60, memory_mb=2048, max_processes=max_processes))
        return {"failure": outcome.failure, "error": outcome.error, "limit": outcome.limit, "reward": outcome.reward}
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search", "--"] if os.geteuid() == 0 else []
    done = subprocess.run([*user, sys.executable, "-c", _SERVER, json.dumps(max_processes)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _started(error: str) -> list[int]:
    found = re.search(r"started \[([\d, ]*)\]", error)
    assert found, error
    return [int(pid) for pid in found.group(1).split(", ") if pid]


@pytest.mark.parametrize("who", WHO)
def test_an_agents_fork_bomb_stops_at_its_process_limit(who: str) -> None:
    """An agent's processes had no limit but the user's (root: none): a fork bomb took the host's process table.
    ``rollout.agent_max_processes`` (16 here) holds the agent's process and all it starts, counted apart from the
    server's and any other agent's: the 16th fork fails, the run fails at its limit (``process_limit``), and every
    process it started is gone with it."""
    max_processes = load_config(None, ["rollout.agent_max_processes=16"], env={}).rollout.agent_max_processes
    assert max_processes != RolloutConfig().agent_max_processes
    outcome = _run_bomb(who, max_processes)
    started = _started(outcome["error"]) if "started [" in outcome["error"] else []
    try:
        assert (outcome["failure"], outcome["limit"]) == ("agent_error", "process_limit"), outcome
        assert "failed at its limit of 16 processes (rollout.agent_max_processes)" in outcome["error"]
        assert "BlockingIOError" in outcome["error"]
        assert len(started) == 15, started  # the agent's process is the 16th
        assert [pid for pid in started if Path(f"/proc/{pid}").exists()] == []
    finally:  # what a failure left: the bomb's processes, forked from the fork server, carry its command line
        for pid in started:
            with contextlib.suppress(OSError):
                if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("who", WHO)
def test_without_a_process_limit_an_agent_forks_freely(who: str) -> None:
    """``rollout.agent_max_processes: null`` (for hosts without user namespaces): no limit, the bomb's ``FORKS``
    processes all start (and end with the run), as every agent's did before the limit."""
    assert load_config(None, ["rollout.agent_max_processes=null"], env={}).rollout.agent_max_processes is None
    outcome = _run_bomb(who, None)
    assert (outcome["failure"], outcome["limit"], outcome["reward"]) == (None, None, float(FORKS)), outcome


def test_where_user_namespaces_are_not_allowed_an_agent_with_a_limit_fails_saying_so() -> None:
    """A rollout server in a user namespace that may make no further one (as under a RuntimeDefault seccomp profile):
    the agent cannot be held to its limit, so it does not run; the error names the key that lets it run unlimited."""
    forbid = "open('/proc/sys/user/max_user_namespaces', 'w').write('0')\n"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--", sys.executable, "-c", forbid + _SERVER, "16"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert (outcome["failure"], outcome["limit"], outcome["reward"]) == ("agent_error", None, None), outcome
    assert "cannot hold the agent to rollout.agent_max_processes: unshare(CLONE_NEWUSER): No space left on device; " \
        "allow user namespaces here, or set rollout.agent_max_processes to null" in outcome["error"], outcome
    assert "started [" not in outcome["error"]  # the agent never ran
