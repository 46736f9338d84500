"""Runs one sample of an ``agent`` job: the job's ``module:function`` in its own process, with limits.

The entrypoint is ``fn(task, base_url, api_key)`` (sync or async): ``task`` is the task's ``task_id``,
``messages`` and ``tools`` (never its reward spec, which may hold the answer), ``base_url`` and
``api_key`` are for the ``openai`` client. It returns a float reward, or None to leave the reward to
the job's reward function. The child sets its own address-space limit (``RLIMIT_AS``) before
importing the agent; the parent kills its whole process group at the time limit. Anything the agent
prints goes to stderr; the child's stdout carries only the result.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import resource
import signal
import sys
from dataclasses import dataclass
from typing import Any

STDERR_TAIL = 2000


@dataclass
class AgentOutcome:
    """A finished run: the agent's reward (None: use the reward function), or why the sample failed."""

    reward: float | None = None
    failure: str | None = None  # finish_reason: agent_error | agent_timeout
    error: str = ""


def agent_task(task: Any) -> dict[str, Any]:
    return {"task_id": task.task_id, "messages": task.messages, "tools": task.tools}


async def run_agent(entrypoint: str, task: Any, base_url: str, api_key: str, *, timeout_s: float,
                    memory_mb: int) -> AgentOutcome:
    """Run ``entrypoint`` for one sample in a child process; never raises for the agent's faults."""
    payload = {"entrypoint": entrypoint, "task": agent_task(task), "base_url": base_url, "api_key": api_key,
               "memory_mb": memory_mb}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout_server.agent_runner",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(payload).encode()), timeout_s)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return AgentOutcome(failure="agent_timeout", error=f"agent {entrypoint} ran past {timeout_s:g}s")
    except asyncio.CancelledError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    tail = err.decode(errors="replace")[-STDERR_TAIL:]
    if proc.returncode != 0:
        return AgentOutcome(failure="agent_error", error=f"agent {entrypoint} exited {proc.returncode}: {tail}")
    try:
        reward = json.loads(out.decode().strip().splitlines()[-1])["reward"]
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise TypeError(f"the agent returned {reward!r}; want a float or None")
    except (IndexError, KeyError, ValueError, TypeError) as exc:
        return AgentOutcome(failure="agent_error", error=f"agent {entrypoint}: no result ({exc}): {tail}")
    return AgentOutcome(reward=None if reward is None else float(reward))


def _child() -> None:
    payload = json.load(sys.stdin)
    limit = payload["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the agent's prints go to stderr
    sys.stdout = sys.stderr
    module_name, _, attr = payload["entrypoint"].partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    reward = fn(payload["task"], payload["base_url"], payload["api_key"])
    if inspect.isawaitable(reward):
        reward = asyncio.run(reward)
    result.write(json.dumps({"reward": reward}) + "\n")
    result.close()


if __name__ == "__main__":
    _child()
