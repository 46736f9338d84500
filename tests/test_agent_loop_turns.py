"""The built-in agent loop's turn boundaries, tool-reward order and tool setup. Scripted turns as in
``test_agent_loop`` (the untrained tiny model writes no tool call); tokenizer, chat template, parser, tools, rewards
and metrics are real."""

from __future__ import annotations

import asyncio
from typing import Any

from test_agent_loop import CALC, ScriptedEngine, _decoded_spans, _group, _loop, _task

from rollout_server.tools import Tool, ToolResult
from rollout_server.tools.calculator import CalculatorTool


def test_a_turn_ended_by_the_models_other_stop_token_runs_its_tool_call(tokenizer: Any) -> None:
    """The engine stops on every end token the model declares (Qwen: ``<|im_end|>`` and ``<|endoftext|>``). A tool
    call closed by ``<|endoftext|>`` used to end the episode as if it were the answer: the call silently dropped
    (never run, never recorded), and the reward read off the call's JSON. It is a finished turn: the call runs."""
    answer = "The answer is 42."
    script = [(f"Let me compute.\n{CALC.format('6*7')}", "endoftext"), (answer, "endoftext")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[CalculatorTool()])
    (s,) = _group(loop, _task(["calculator"], ground_truth=None)).samples
    assert (s.finish_reason, s.num_turns, s.reward) == ("stop", 2, 1.0)
    assert [(t.name, t.ok) for t in s.tool_calls] == [("calculator", True)]
    assert s.messages[2]["content"] == "Let me compute." and s.messages[3]["content"] == "42"
    assert s.messages[-1] == {"role": "assistant", "content": answer}  # no end token in the text
    tool_turn = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert _decoded_spans(s, tokenizer)[1:] == [  # the policy's tokens, its end token too, trained as sampled
        (1, f"Let me compute.\n{CALC.format('6*7')}<|endoftext|>"),
        (0, tool_turn),
        (1, f"{answer}<|endoftext|>"),
    ]


class DelayedAnswer(Tool):
    """Answers ``reward`` after ``delay_s``: a judge over the network, whose calls finish in any order."""

    default_name = "judge"
    default_schema = {"type": "function", "function": {"name": "judge", "parameters": {"type": "object"}}}

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(arguments["delay_s"])
        return ToolResult(f"scored {arguments['reward']}", reward=arguments["reward"])


def test_tool_last_is_the_models_last_call_not_the_last_to_finish(tokenizer: Any) -> None:
    """The calls of one turn run concurrently; tool rewards used to be kept in the order the calls finished, so
    ``tool_last`` scored whichever call was slowest, not the one the model made last."""
    call = '<tool_call>\n{{"name": "judge", "arguments": {{"delay_s": {}, "reward": {}}}}}\n</tool_call>'
    script = [(f"{call.format(0.3, 1.0)}\n{call.format(0.0, 0.0)}", "stop"), ("done", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[DelayedAnswer()], reward="tool_last",
                 max_new_tokens=256)
    (s,) = _group(loop, _task(["judge"], ground_truth=None, kind="tool_last")).samples
    assert [m["content"] for m in s.messages if m["role"] == "tool"] == ["scored 1.0", "scored 0.0"]
    assert (s.finish_reason, s.reward, s.reward_info) == ("stop", 0.0, {"tool_rewards": [1.0, 0.0]})


def test_check_answer_with_a_ground_truth_that_is_no_number_fails_the_episode(tokenizer: Any) -> None:
    """A task whose check_answer ground truth gsm8k cannot read (``"forty-two"``) used to run: every call answered
    the model with the tool's own ValueError and the episode was trained on reward 0 for the task's fault. The
    create refuses it, so the episode fails (never trained) naming the field."""
    script = [('<tool_call>\n{"name": "check_answer", "arguments": {"answer": "42"}}\n</tool_call>', "stop"),
              ("done", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, reward="tool")
    (s,) = _group(loop, _task(["check_answer"], ground_truth="forty-two", kind="tool")).samples
    assert (s.finish_reason, s.failed, s.num_turns) == ("error", True, 0)
    assert s.reward_info == {"error": "tool check_answer: create failed: ValueError: check_answer: ground_truth "
                                      "'forty-two' is not a number (task tools_kwargs)"}
    assert loop.metrics.registry.get_sample_value("rollwave_rollout_failed_total", {"reason": "tool"}) == 1
