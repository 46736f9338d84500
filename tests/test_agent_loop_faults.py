"""The agent loop's edges: operator code (tools, reward functions) that misbehaves, and what an episode
that fails leaves behind. Scripted turns as in ``test_agent_loop`` (the untrained tiny model writes no tool call);
tokenizer, chat template, parser, tools, rewards and metrics are real."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
from test_agent_loop import HANG, ScriptedEngine, _config, _group, _loop, _task

from core.rewards import RewardComputer, RewardError
from core.tasks import Task
from rollout_server.agent_loop import AgentLoop
from rollout_server.tools import Tool, ToolRegistry, ToolResult


async def nan_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]) -> float:
    """A judge whose score came out as NaN (0/0 in its arithmetic)."""
    return math.nan


def _reward_task(kind: str) -> Task:
    return Task(task_id="t1", messages=[{"role": "user", "content": "q"}], reward={"kind": kind})


def test_a_reward_that_is_not_finite_fails_the_episode_not_the_metrics(tokenizer: Any) -> None:
    """NaN or inf is no reward: the episode fails as ``reward_error`` (counted as a reward failure), where it used to
    finish ``stop`` with reward NaN, and the group then failed only at the buffer's put with an error that names
    neither the reward function nor the episode."""
    computer = RewardComputer("nan", allowlist={"nan": f"{__name__}:nan_reward"})
    with pytest.raises(RewardError, match="not finite"):
        asyncio.run(computer.score(_reward_task("nan"), [], "", []))
    with pytest.raises(RewardError, match="not finite"):
        asyncio.run(RewardComputer("tool").score(_reward_task("tool"), [], "", [math.inf]))

    loop = _loop(ScriptedEngine(tokenizer, [("The answer is 42.", "stop")]), tokenizer, reward="nan",
                 reward_allowlist={"nan": f"{__name__}:nan_reward"})
    (s,) = _group(loop, _task([], kind="nan")).samples
    assert (s.finish_reason, s.failed, s.reward) == ("reward_error", True, 0.0)
    value = loop.metrics.registry.get_sample_value
    assert value("rollwave_rollout_failed_total", {"reason": "reward"}) == 1
    assert value("rollwave_rollout_reward_count") == 0


class HalfCreatedTool(Tool):
    """A tool whose create takes its resource first, then fails (``fail``) or hangs past the limit (``hang``)."""

    default_name = "half"
    default_schema = {"type": "function", "function": {"name": "half", "parameters": {"type": "object"}}}

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.released: list[str] = []

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        await super().create(instance_id, **create_kwargs)
        if self.how == "hang":
            await asyncio.Event().wait()
        raise RuntimeError("quota exceeded")

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult("done")

    async def release(self, instance_id: str) -> None:
        self.released.append(instance_id)
        await super().release(instance_id)


@pytest.mark.parametrize("how", ["fail", "hang"])
def test_a_create_that_fails_or_times_out_is_still_released(tokenizer: Any, how: str) -> None:
    """What a create took before it failed, or before the limit cancelled it, is handed back: the episode fails,
    and release runs for its instance all the same."""
    tool = HalfCreatedTool(how)
    loop = _loop(ScriptedEngine(tokenizer, []), tokenizer, tools=[tool], tool_timeout_s=0.2)
    (s,) = _group(loop, _task(["half"], ground_truth=None)).samples
    assert (s.finish_reason, s.failed) == ("error", True)
    assert "tool half: create failed" in s.reward_info["error"]
    assert len(tool.released) == 1 and tool.released[0].startswith("t-1/0/")
    assert tool._instances == {}


class SloppyTool(Tool):
    """Returns what a ``ToolResult`` is not: ``arguments["give"]`` picks what."""

    default_name = "sloppy"
    default_schema = {"type": "function", "function": {"name": "sloppy", "parameters": {"type": "object"}}}

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> Any:
        return {"text": "a plain string", "reward": ToolResult("ok", reward="high"),
                "nan": ToolResult("ok", reward=math.nan), "bool": ToolResult("ok", reward=True),
                "numpy": ToolResult("ok", reward=np.float32(0.5))}[arguments["give"]]


def _sloppy(give: str) -> str:
    return f'<tool_call>\n{{"name": "sloppy", "arguments": {{"give": "{give}"}}}}\n</tool_call>'


def test_a_tool_that_returns_no_tool_result_is_answered_as_an_error(tokenizer: Any) -> None:
    """A tool's return value is the operator's code as much as its exceptions: something that is not a
    ``ToolResult`` with text and a finite reward is answered to the model as that tool's error and counted, and the
    episode (and its group) goes on, where it used to raise out of the episode and fail the whole group."""
    calls = "\n".join(_sloppy(give) for give in ("text", "reward", "nan", "bool", "numpy"))
    script = [(calls, "stop"), ("The answer is 42.", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[SloppyTool()], max_new_tokens=256)
    (s,) = _group(loop, _task(["sloppy"], ground_truth=None)).samples
    assert (s.finish_reason, s.num_turns, s.reward) == ("stop", 2, 1.0)
    texts = [m["content"] for m in s.messages if m["role"] == "tool"]
    assert texts == [
        "Error: sloppy failed: TypeError: it returned a str, not a ToolResult",
        "Error: sloppy failed: TypeError: its reward is 'high', not a finite number",
        "Error: sloppy failed: TypeError: its reward is nan, not a finite number",
        "Error: sloppy failed: TypeError: its reward is True, not a finite number",
        "ok",  # a numpy number is the number it is (it failed as not a float)
    ]
    assert [t.ok for t in s.tool_calls] == [False] * 4 + [True]
    value = loop.metrics.registry.get_sample_value
    assert value("rollwave_rollout_tool_calls_total", {"tool": "sloppy", "outcome": "error"}) == 4


class SplitEngine:
    """Sample 0 gets ``HANG`` (a tool call that never answers); sample 1's request raises an exception the engine
    client should never raise (a bug): one episode ends the group while its sibling is inside a tool."""

    def __init__(self, tokenizer: Any) -> None:
        self.sample0 = ScriptedEngine(tokenizer, [(HANG, "stop")])

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True, rid=None):
        if rid.startswith("t-1-0-"):  # task t-1, sample 0
            return await self.sample0.generate(input_ids, sampling_params, return_logprob, rid)
        await asyncio.sleep(0.2)  # sample 0 is in its tool call by now
        raise RuntimeError("client bug")


class CountingHangTool(Tool):
    default_name = "hang"
    default_schema = {"type": "function", "function": {"name": "hang", "parameters": {"type": "object"}}}

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return ToolResult("never")


def test_an_episode_that_raises_stops_its_siblings_and_they_release_their_tools(tokenizer: Any) -> None:
    """When one episode raises, the group has failed: its siblings are cancelled and release their tools before
    the error reaches the worker, instead of going on unowned (generating, holding tool instances) while the
    worker rolls the task out again."""
    tool = CountingHangTool()
    loop = AgentLoop(SplitEngine(tokenizer), tokenizer, ToolRegistry([tool]), _config(tool_timeout_s=60))

    async def run() -> None:
        with pytest.raises(RuntimeError, match="client bug"):
            await loop.run_group(_task(["hang"], ground_truth=None), run="r", job_id="j", n=2)
        assert tool.cancelled == 1 and tool._instances == {}  # no sibling left running
        assert loop.metrics.registry.get_sample_value("rollwave_rollout_inflight_requests") == 0

    asyncio.run(asyncio.wait_for(run(), 10))
