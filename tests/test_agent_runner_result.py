"""The agent runner: what an agent's entrypoint returns reaches the sample as the runner documents."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from core.tasks import Task
from rollout_server.agent_runner import run_agent

TASK = Task(task_id="t-1", messages=[{"role": "user", "content": "hi"}], reward={})


def big_reward(task: dict[str, Any], base_url: str, api_key: str) -> Any:
    """Returns something that is not a reward, and larger than a pipe's buffer."""
    return ["not a reward"] * 100_000


def test_a_large_non_reward_result_is_an_agent_error_not_a_timeout() -> None:
    """An entrypoint that returns a large non-float fails its sample at once as ``agent_error`` naming what it
    returned; the child never blocks on sending it back (which ran the sample into its time limit)."""
    start = time.monotonic()
    outcome = asyncio.run(run_agent("tests.test_agent_runner_result:big_reward", TASK, "http://127.0.0.1:9/v1", "k",
                                    timeout_s=20, memory_mb=2048))
    assert outcome.failure == "agent_error", outcome
    assert "returned ['not a reward', " in outcome.error and outcome.error.endswith("; want a float or None")
    assert time.monotonic() - start < 15
