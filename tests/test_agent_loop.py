"""The agent loop against the real embedded engine and the tiny model, plus scripted turn sequences.

Two kinds of episodes, on purpose:

- **Real**: every assistant turn comes from the embedded engine (a subprocess on 127.0.0.1) at
  temperature 1. These check that the behaviour logprob of every loss-masked token equals a
  teacher-forced forward of the tiny model over the stored token ids.
- **Scripted**: the untrained tiny model never writes a tool call, so the multi-turn tests feed the
  loop a fixed sequence of assistant turns (``ScriptedEngine``: test data shaped like SGLang's
  /generate reply, tokenised with the real tokenizer and honouring ``max_new_tokens``). Tools,
  chat template, parser, rewards and metrics are all real. One test hands the scripted episode's
  multi-turn context (tool turns included) to the real engine for its last turn and checks the
  logprobs there too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from net_helpers import refused_port
from transformers import AutoModelForCausalLM

from buffer.schema import TrajectoryGroup, decode_group, encode_group
from core.config import RolloutConfig
from core.rewards import RewardComputer
from core.tasks import Task, load_tasks
from core.trajectory import ChatRenderer, TrajectoryBuilder, masked_spans
from rollout_server.agent_loop import AgentLoop, EngineReplyError, parse_version, turn_from_reply
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import Tool, ToolRegistry, ToolResult
from rollout_server.tools.calculator import CalculatorTool
from rollout_server.tools.check_answer import CheckAnswerTool
from rollout_server.tools.python_tool import PythonTool

CALC = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
CHECK = '<tool_call>\n{{"name": "check_answer", "arguments": {{"answer": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, max_batch_size=16, max_context=1024, threads=1) as engine:
        yield engine.url


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


class ScriptedEngine:
    """Test data in the engine's reply shape: scripted assistant turns, then (optionally) the real engine.

    A scripted turn is ``(text, finish)``; ``finish`` is ``"stop"`` (eos appended), ``"endoftext"`` (the model's
    other stop token, ``<|endoftext|>``, appended: Qwen's generation config stops on both), ``"open"`` (stops
    without a stop token, as on a stop string) or ``"abort"``. Output that reaches ``max_new_tokens`` is cut there
    with finish ``length``, even when its last token is eos: SGLang's ``Req.check_finished`` tests the length
    before the stop token.
    Scripted tokens carry logprob -0.5 and versions "3" then "4" (a switch after two tokens), marked
    approximate with ``approximate`` (as ``EngineClient`` marks an engine that gives no spans). One
    script serves one episode (``n=1``): turns are handed out in call order.
    """

    def __init__(self, tokenizer: Any, script: list[tuple[str, str]], fallback: EngineClient | None = None,
                 approximate: bool = False):
        self.tokenizer = tokenizer
        self.script = list(script)
        self.fallback = fallback
        self.approximate = approximate
        self.calls: list[dict[str, Any]] = []

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True, rid=None):
        self.calls.append({"input_ids": list(input_ids), "sampling_params": dict(sampling_params), "rid": rid})
        if not self.script:
            assert self.fallback is not None, "script exhausted"
            return await self.fallback.generate(input_ids, sampling_params, return_logprob, rid)
        text, finish = self.script.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        eos = self.tokenizer.eos_token_id
        end = {"stop": [eos], "endoftext": [self.tokenizer.convert_tokens_to_ids("<|endoftext|>")]}
        ids += end.get(finish, [])
        limit = sampling_params["max_new_tokens"]
        reason: dict[str, Any] = {"type": "stop", "matched": ids[-1] if finish in end else text[-1:]}
        if len(ids) >= limit:
            ids, reason = ids[:limit], {"type": "length", "length": limit}
        elif finish == "abort":
            reason = {"type": "abort", "message": "Aborted"}
        meta: dict[str, Any] = {
            "finish_reason": reason,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "weight_version": "4",
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": len(ids)}],
        }
        if self.approximate:
            meta["weight_versions_approximate"] = True
        return {"text": text, "output_ids": ids, "meta_info": meta}


def _task(tools: list[str], ground_truth: str | None = "42", **reward: Any) -> Task:
    kwargs = {"check_answer": {"create_kwargs": {"ground_truth": ground_truth}}} if ground_truth else {}
    return Task(
        task_id="t-1",
        messages=[
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 6 times 7?"},
        ],
        tools=tools,
        tools_kwargs=kwargs,
        reward=reward or {"kind": "gsm8k", "ground_truth": "42"},
    )


def _config(**overrides: Any) -> RolloutConfig:
    base = {"n_samples": 1, "max_turns": 4, "max_new_tokens": 64, "max_total_tokens": 512, "temperature": 1.0}
    return RolloutConfig(**{**base, **overrides})


def _loop(engine: Any, tokenizer: Any, tools: list[Tool] | None = None, **cfg: Any) -> AgentLoop:
    registry = ToolRegistry(tools if tools is not None else [CalculatorTool(), CheckAnswerTool()])
    return AgentLoop(engine, tokenizer, registry, _config(**cfg), metrics=RolloutMetrics())


def _group(loop: AgentLoop, task: Task, n: int = 1) -> TrajectoryGroup:
    group = asyncio.run(loop.run_group(task, run="test", job_id="job-1", n=n))
    return decode_group(encode_group(group))  # every group must survive the wire


def _decoded_spans(sample: Any, tokenizer: Any) -> list[tuple[int, str]]:
    ids = sample.token_ids.tolist()
    return [(v, tokenizer.decode(ids[a:b], skip_special_tokens=False)) for a, b, v in masked_spans(sample.loss_mask)]


def _teacher_forced_gap(model: Any, sample: Any, temperature: float = 1.0, only: np.ndarray | None = None) -> float:
    """max |behaviour logprob - log_softmax(logits / T)| over loss-masked tokens (or the ``only`` positions)."""
    ids = torch.tensor(sample.token_ids, dtype=torch.long)[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    positions = np.flatnonzero(sample.loss_mask) if only is None else only
    assert positions.size and positions.min() >= sample.prompt_len
    forced = logprobs[positions - 1, ids[0, positions]].numpy()
    return float(np.abs(forced - sample.behaviour_logprobs[positions]).max())


def test_turn_versions_approximate_flag_and_refusals() -> None:
    ids = [5, 6, 7]
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids], "weight_version": "4",
            "weight_versions": [{"version": "3", "start": 0, "end": 3}], "weight_versions_approximate": True}
    turn = turn_from_reply({"output_ids": ids, "meta_info": meta})
    assert turn.versions == [3, 3, 3] and turn.approximate
    builder = TrajectoryBuilder([1, 2])
    builder.add_generated(turn)
    assert builder.versions_approximate
    with pytest.raises(EngineReplyError, match="weight version 'step0' is not an integer"):
        turn_from_reply({"output_ids": ids, "meta_info": {
            **meta, "weight_versions": [{"version": "step0", "start": 0, "end": 3}]}})
    with pytest.raises(EngineReplyError, match="SGLang >= 0.5.6 is required"):
        turn_from_reply({"output_ids": ids, "meta_info": {**meta, "weight_versions": None}})
    with pytest.raises(EngineReplyError, match="do not cover the 3 output tokens"):
        turn_from_reply({"output_ids": ids, "meta_info": {
            **meta, "weight_versions": [{"version": "3", "start": 0, "end": 2}]}})
    with pytest.raises(EngineReplyError, match="logits were not finite .*'matched': 'NaN happened'"):  # SGLang's
        turn_from_reply({"output_ids": ids, "meta_info": {**meta, "finish_reason": {
            "type": "stop", "matched": "NaN happened"}}})
    with pytest.raises(EngineReplyError, match=r"logits were not finite .*logprobs \[nan, -inf\]"):
        turn_from_reply({"output_ids": ids, "meta_info": {**meta, "output_token_logprobs": [
            [-0.5, 5, None], [math.nan, 6, None], [-math.inf, 7, None]]}})


def test_parse_version() -> None:
    assert [parse_version(v) for v in ("7", 3, " 12 ")] == [7, 3, 12]
    for bad in ("default", "step7", None, "1.5"):
        with pytest.raises(ValueError, match=f"weight version {bad!r} is not an integer"):
            parse_version(bad)


def test_real_episodes_logprobs_match_a_teacher_forced_forward(engine_url: str, tokenizer: Any, model: Any) -> None:
    """A real arith group at temperature 1: masks, versions and logprobs of every generated token."""
    task = load_tasks("arith", split="test", limit=1)[0]

    async def roll() -> TrajectoryGroup:
        async with EngineClient(engine_url) as client:
            return await _loop(client, tokenizer, max_new_tokens=24).run_group(task, run="r", job_id="j", n=4)

    group = decode_group(encode_group(asyncio.run(roll())))
    prompt = ChatRenderer(tokenizer).prompt_ids(task.messages, [CalculatorTool().schema])
    assert (group.run, group.job_id, group.group_id, len(group.samples)) == ("r", "j", task.task_id, 4)
    for i, s in enumerate(group.samples):
        assert s.sample_index == i and s.prompt_len == len(prompt)
        assert s.token_ids[: s.prompt_len].tolist() == prompt
        mask = s.loss_mask.astype(bool)
        assert s.num_generated > 0 and not mask[: s.prompt_len].any()
        assert (s.token_versions[mask] == 0).all() and (s.token_versions[~mask] == -1).all()
        assert (s.behaviour_logprobs[~mask] == 0).all() and (s.behaviour_logprobs[mask] < 0).all()
        assert s.finish_reason in {"stop", "length", "max_turns"}, s.reward_info
        if s.finish_reason == "length":
            assert s.token_ids[-1] != tokenizer.eos_token_id and s.num_turns >= 1
        assert s.reward_info["ground_truth"] == task.reward["ground_truth"]
        assert s.queued <= s.started <= s.finished
        assert _teacher_forced_gap(model, s) <= 1e-4


def test_multi_turn_loss_mask_decodes_to_the_policy_turns(tokenizer: Any) -> None:
    """Scripted calculator + check_answer + final answer: each mask span decodes to exactly what it should."""
    script = [
        (f"Let me compute.\n{CALC.format('6*7')}", "stop"),
        (CHECK.format("42"), "stop"),
        ("The answer is 42.", "stop"),
    ]
    engine = ScriptedEngine(tokenizer, script)
    loop = _loop(engine, tokenizer, temperature=0.6)
    task = _task(["calculator", "check_answer"])
    group = _group(loop, task)
    (s,) = group.samples
    assert group.temperature == 0.6  # the trainer scales this group's logits by it

    assert (s.finish_reason, s.num_turns, s.reward) == ("stop", 3, 1.0)
    assert [(t.name, t.ok) for t in s.tool_calls] == [("calculator", True), ("check_answer", True)]
    tool_turn = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert _decoded_spans(s, tokenizer)[1:] == [
        (1, f"Let me compute.\n{CALC.format('6*7')}<|im_end|>"),
        (0, tool_turn.format("42")),
        (1, f"{CHECK.format('42')}<|im_end|>"),
        (0, tool_turn.format("Answer 42 is correct.")),
        (1, "The answer is 42.<|im_end|>"),
    ]
    assert _decoded_spans(s, tokenizer)[0][1].endswith("What is 6 times 7?<|im_end|>\n<|im_start|>assistant\n")
    # the stored tokens are the chat template's rendering of the whole conversation (bar the final "\n")
    renderer = ChatRenderer(tokenizer)
    schemas = loop.tools.schemas(task.tools)
    rendered = tokenizer.apply_chat_template(s.messages, tools=schemas, tokenize=True, return_dict=False)
    assert s.token_ids.tolist() == list(rendered)[: -len(renderer.turn_end_suffix)]
    # the engine saw exactly the stored tokens, turn after turn; budgets shrink with the context
    for call in engine.calls:
        n = len(call["input_ids"])
        assert s.token_ids[:n].tolist() == call["input_ids"]
        assert call["sampling_params"]["max_new_tokens"] == min(64, 512 - n)
        assert call["sampling_params"]["temperature"] == 0.6
    # behaviour logprobs and the version switch inside each turn
    mask = s.loss_mask.astype(bool)
    assert (s.behaviour_logprobs[mask] == -0.5).all()
    for start, end, value in masked_spans(s.loss_mask):
        if value:
            assert s.token_versions[start:end].tolist() == [3, 3] + [4] * (end - start - 2)
    assert s.oldest_version() == 3
    assert s.messages[2] == {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}],
    }
    metrics = loop.metrics.registry
    assert metrics.get_sample_value("rollwave_rollout_tool_calls_total", {"tool": "check_answer", "outcome": "ok"}) == 1
    assert metrics.get_sample_value("rollwave_rollout_finish_reasons_total", {"reason": "stop"}) == 1
    assert metrics.get_sample_value("rollwave_rollout_generated_tokens_total") == s.num_generated
    assert metrics.get_sample_value("rollwave_rollout_groups_completed_total") == 1
    assert metrics.get_sample_value("rollwave_rollout_inflight_requests") == 0


def test_renders_are_kept_by_their_messages_and_tools(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The samples of an agent group open their episodes with the same request: a render is kept, keyed by the
    messages and tools as JSON (key order included, which a template may show), the last RENDERS_KEPT of them,
    and what a caller does to the ids it got does not reach the kept ones."""
    render = tokenizer.apply_chat_template
    calls: list[int] = []
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or render(*a, **k))
    renderer = ChatRenderer(tokenizer)
    messages, tools = [{"role": "user", "content": "What is 6 times 7?"}], [CalculatorTool().schema]
    first = renderer.prompt_ids(messages, tools)
    assert first == list(render(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False))
    first.append(-1)
    n = len(calls)
    assert renderer.prompt_ids([dict(m) for m in messages], tools) == first[:-1] and len(calls) == n
    assert renderer.prompt_ids(messages, None) != first[:-1] and len(calls) == n + 1  # no tools: another render
    renderer.prompt_ids([{"content": "What is 6 times 7?", "role": "user"}], tools)
    assert len(calls) == n + 2
    monkeypatch.setattr("core.trajectory.RENDERS_KEPT", 2)
    renderer.prompt_ids([{"role": "user", "content": "What is 1 plus 1?"}], tools)  # the first render leaves
    assert renderer.prompt_ids(messages, tools) == first[:-1] and len(calls) == n + 4


def test_real_engine_continues_a_multi_turn_context(engine_url: str, tokenizer: Any, model: Any) -> None:
    """Two scripted tool turns, then the real engine writes the rest on the context with tool tokens."""

    async def roll() -> TrajectoryGroup:
        async with EngineClient(engine_url) as client:
            script = [(CALC.format("6*7"), "stop"), (CALC.format("42+0"), "stop")]
            engine = ScriptedEngine(tokenizer, script, fallback=client)
            return await _loop(engine, tokenizer, max_new_tokens=32, max_turns=3).run_group(
                _task(["calculator"]), run="r", job_id="j", n=1
            )

    for s in asyncio.run(roll()).samples:
        spans = [(a, b) for a, b, v in masked_spans(s.loss_mask) if v]
        assert s.num_turns >= 3 and len(spans) >= 3
        real = np.arange(spans[2][0], spans[2][1])
        assert (s.token_versions[real] == 0).all()
        assert _teacher_forced_gap(model, s, only=real) <= 1e-4


def test_top_k_and_top_p_reach_the_engine_and_make_sampling_greedy(engine_url: str, tokenizer: Any,
                                                                    model: Any) -> None:
    """rollout.top_k and rollout.top_p go with every request: at temperature 1 the default samples of a group
    differ, while top_k=1, or a top_p below the top token's probability, leaves only the most likely token: every
    sample is the same greedy argmax continuation."""
    task = load_tasks("arith", split="test", limit=1)[0]

    async def roll(**sampling: Any) -> list[list[int]]:
        async with EngineClient(engine_url) as client:
            group = await _loop(client, tokenizer, max_new_tokens=12, max_turns=1, **sampling).run_group(
                task, run="r", job_id="j", n=4)
        return [s.token_ids.tolist() for s in group.samples]

    default, top_k, top_p = (asyncio.run(roll(**sampling)) for sampling in ({}, {"top_k": 1}, {"top_p": 1e-6}))
    assert len({tuple(ids) for ids in default}) > 1
    assert top_k == top_p == [top_k[0]] * 4
    greedy = torch.tensor([top_k[0]])
    prompt_len = len(ChatRenderer(tokenizer).prompt_ids(task.messages, [CalculatorTool().schema]))
    with torch.no_grad():
        argmax = model(greedy).logits[0, prompt_len - 1 : -1].argmax(-1)
    assert greedy[0, prompt_len:].tolist() == argmax.tolist()


class FlakyTool(Tool):
    default_name = "flaky"
    default_schema = {"type": "function", "function": {"name": "flaky", "parameters": {"type": "object"}}}

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        raise RuntimeError("backend down")


def test_tool_errors_are_answered_counted_and_the_episode_goes_on(tokenizer: Any) -> None:
    calls = [
        "<tool_call>\n{bad json}\n</tool_call>",
        '<tool_call>\n{"name": "web", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>',
        CALC.format("1/0"),
        '<tool_call>\n{"name": "flaky", "arguments": {}}\n</tool_call>',
        CALC.format("2+2"),
    ]
    script = [("\n".join(calls), "stop"), ("The answer is 4.", "stop")]
    loop = _loop(
        ScriptedEngine(tokenizer, script), tokenizer, tools=[CalculatorTool(), FlakyTool()], max_new_tokens=256
    )
    (s,) = _group(loop, _task(["calculator", "flaky"], ground_truth=None, kind="gsm8k")).samples

    assert (s.finish_reason, s.num_turns) == ("reward_error", 2)  # answered, but the reward spec is broken
    tool_texts = [m["content"] for m in s.messages if m["role"] == "tool"]
    assert tool_texts[0].startswith("Error: invalid JSON in tool call")
    assert tool_texts[1].startswith("Error: unknown tool 'web' (available: calculator, flaky)")
    assert tool_texts[2] == "Error: calculator: missing required argument(s) expression"
    assert tool_texts[3] == "Error: division by zero"
    assert tool_texts[4] == "Error: flaky failed: RuntimeError: backend down"
    assert tool_texts[5] == "4"
    assert [(t.name, t.ok) for t in s.tool_calls] == [
        ("invalid", False),
        ("web", False),
        ("calculator", False),
        ("calculator", False),
        ("flaky", False),
        ("calculator", True),
    ]
    spans = _decoded_spans(s, tokenizer)
    assert (
        spans[2][0] == 0
        and "Error: unknown tool 'web'" in spans[2][1]
        and spans[3] == (1, "The answer is 4.<|im_end|>")
    )
    value = loop.metrics.registry.get_sample_value
    assert value("rollwave_rollout_tool_calls_total", {"tool": "invalid", "outcome": "parse_error"}) == 1
    assert value("rollwave_rollout_tool_calls_total", {"tool": "unknown", "outcome": "parse_error"}) == 1
    assert value("rollwave_rollout_tool_calls_total", {"tool": "web", "outcome": "parse_error"}) is None  # no label
    assert value("rollwave_rollout_tool_calls_total", {"tool": "calculator", "outcome": "error"}) == 2
    assert value("rollwave_rollout_tool_calls_total", {"tool": "calculator", "outcome": "ok"}) == 1
    assert value("rollwave_rollout_tool_latency_seconds_count", {"tool": "flaky"}) == 1
    # the reward spec lacks a ground truth: the sample is marked failed (never trained), counted, nothing raised
    assert s.failed and "no ground_truth" in s.reward_info["error"]
    assert value("rollwave_rollout_failed_total", {"reason": "reward"}) == 1
    assert value("rollwave_rollout_reward_count") == 0  # a failure is not a reward of 0


class HangingTool(Tool):
    """A tool whose backend never answers at ``stage`` (create, execute or release)."""

    default_name = "hang"
    default_schema = {"type": "function", "function": {"name": "hang", "parameters": {"type": "object"}}}

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    async def _at(self, stage: str) -> None:
        if stage == self.stage:
            await asyncio.Event().wait()

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        await self._at("create")
        await super().create(instance_id, **create_kwargs)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        await self._at("execute")
        return ToolResult("done")

    async def release(self, instance_id: str) -> None:
        await self._at("release")
        await super().release(instance_id)


HANG = '<tool_call>\n{"name": "hang", "arguments": {}}\n</tool_call>'


def test_a_hanging_tool_call_is_answered_as_a_timeout_and_the_episode_goes_on(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    script = [(HANG, "stop"), ("The answer is 42.", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[HangingTool("execute")], tool_timeout_s=0.2)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rollout_server.agent_loop"):
        (s,) = _group(loop, _task(["hang"], ground_truth=None)).samples
    assert time.monotonic() - start < 3
    assert (s.finish_reason, s.num_turns, s.reward) == ("stop", 2, 1.0)
    error = "hang timed out: no answer within 0.2s"
    assert s.messages[-2] == {"role": "tool", "name": "hang", "content": f"Error: {error}"}
    assert [(t.name, t.ok, t.error) for t in s.tool_calls] == [("hang", False, error)]
    value = loop.metrics.registry.get_sample_value
    assert value("rollwave_rollout_tool_calls_total", {"tool": "hang", "outcome": "timeout"}) == 1
    assert value("rollwave_rollout_tool_calls_total", {"tool": "hang", "outcome": "error"}) is None
    assert "tool hang, task t-1 sample 0: no answer within 0.2s (rollout.tool_timeout_s)" in caplog.text


def test_a_hanging_tool_create_fails_the_episode_and_a_hanging_release_is_logged(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    loop = _loop(ScriptedEngine(tokenizer, []), tokenizer, tools=[HangingTool("create")], tool_timeout_s=0.2)
    (s,) = _group(loop, _task(["hang"], ground_truth=None)).samples
    assert (s.finish_reason, s.failed, s.num_turns) == ("error", True, 0)
    assert s.reward_info == {"error": "tool hang: create failed: Overdue: no answer within 0.2s"}
    assert loop.metrics.registry.get_sample_value("rollwave_rollout_failed_total", {"reason": "tool"}) == 1

    script = [("The answer is 42.", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[HangingTool("release")], tool_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="rollout_server.agent_loop"):
        (s,) = _group(loop, _task(["hang"], ground_truth=None)).samples
    assert (s.finish_reason, s.failed, s.reward) == ("stop", False, 1.0)  # the finished sample is kept
    assert "tool hang: release of t-1/0/" in caplog.text
    assert "failed: Overdue: no answer within 0.2s" in caplog.text
    assert time.monotonic() - start < 3


def test_a_hanging_reward_fails_the_episode_within_the_limit(tokenizer: Any) -> None:
    loop = _loop(ScriptedEngine(tokenizer, [("The answer is 42.", "stop")]), tokenizer, reward="hang",
                 reward_allowlist={"hang": "tests.test_rewards:hanging_reward"}, reward_timeout_s=0.2)
    start = time.monotonic()
    (s,) = _group(loop, _task([], kind="hang")).samples
    assert time.monotonic() - start < 3
    assert (s.finish_reason, s.failed, s.reward) == ("reward_error", True, 0.0)
    assert s.reward_info == {"error": "reward 'hang' for task t-1: no answer within 0.2s (rollout.reward_timeout_s)"}
    assert loop.metrics.registry.get_sample_value("rollwave_rollout_failed_total", {"reason": "reward"}) == 1


@pytest.mark.parametrize(
    ("script", "config", "reason", "turns"),
    [
        ([(CALC.format("1+1"), "stop")] * 5, {"max_turns": 2}, "max_turns", 2),
        ([("x " * 40, "stop")], {"max_new_tokens": 8}, "length", 1),
        ([("x " * 40, "stop")], {"max_total_tokens": "prompt+6"}, "max_total_tokens", 1),
        ([(CALC.format("1+1"), "stop")], {"max_total_tokens": "prompt+30"}, "max_total_tokens", 1),
        ([("partial", "abort")], {}, "abort", 1),
        ([(CALC.format("1+1"), "open")], {}, "stop", 1),
    ],
)
def test_each_limit_ends_the_episode_with_its_reason(
    tokenizer: Any, script: list, config: dict, reason: str, turns: int
) -> None:
    task = _task(["calculator"])
    prompt_len = len(ChatRenderer(tokenizer).prompt_ids(task.messages, [CalculatorTool().schema]))
    cfg = {k: prompt_len + int(v.split("+")[1]) if isinstance(v, str) else v for k, v in config.items()}
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, **cfg)
    (s,) = _group(loop, task).samples
    assert (s.finish_reason, s.num_turns) == (reason, turns)
    assert s.failed == (reason == "abort")
    assert loop.metrics.registry.get_sample_value("rollwave_rollout_failed_total", {"reason": "abort"}) == (
        1 if reason == "abort" else None
    )
    assert len(s.token_ids) <= cfg.get("max_total_tokens", 512)
    assert s.loss_mask[-1] == 1  # a trajectory never ends on tokens nobody will generate after
    if reason == "abort":
        assert s.reward == 0.0 and s.reward_info == {"error": "the engine aborted the request"}
    if reason == "max_turns":
        assert [m["role"] for m in s.messages[2:]] == ["assistant", "tool", "assistant", "tool"]


@pytest.mark.parametrize("end", ["stop", "endoftext"])
def test_a_turn_whose_end_token_is_the_last_allowed_one_is_answered(tokenizer: Any, end: str) -> None:
    """SGLang reports a turn whose end token is the last one allowed as ``length``: closed turns ending at
    ``max_new_tokens`` (the tool call) and at the context budget (the answer) are answered, not truncated. So are
    turns ended so by the model's other stop token (``<|endoftext|>``, in its generation config), which used to end
    the episode ``length``: the call never run, the sample counted truncated, the reward read off the call's JSON."""
    call, answer = f"Let me compute.\n{CALC.format('6*7')}", "The answer is 42."
    script = [(call, end), (answer, end)]
    task = _task(["calculator"])
    probe = ScriptedEngine(tokenizer, script)
    _group(_loop(probe, tokenizer), task)
    context = len(probe.calls[1]["input_ids"])  # the prompt, the call and its tool turn
    n_call, n_answer = (len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in (call, answer))
    engine = ScriptedEngine(tokenizer, script)
    (s,) = _group(_loop(engine, tokenizer, max_new_tokens=n_call, max_total_tokens=context + n_answer), task).samples
    assert [c["sampling_params"]["max_new_tokens"] for c in engine.calls] == [n_call, n_answer]
    assert (s.finish_reason, s.truncated, s.num_turns, s.reward) == ("stop", False, 2, 1.0)
    assert [(t.name, t.ok) for t in s.tool_calls] == [("calculator", True)]
    assert s.messages[-2] == {"role": "tool", "name": "calculator", "content": "42"}


def test_episode_failures_do_not_stop_the_group(tokenizer: Any) -> None:
    with refused_port() as port:
        dead = EngineClient(f"http://127.0.0.1:{port}", retries=0)
        try:
            loop = _loop(dead, tokenizer)
            (s,) = _group(loop, _task(["calculator"])).samples
        finally:
            asyncio.run(dead.aclose())
    assert (s.finish_reason, s.num_turns, s.num_generated, s.failed) == ("error", 0, 0, True)
    assert "cannot connect" in s.reward_info["error"]
    assert loop.metrics.registry.get_sample_value("rollwave_rollout_failed_total", {"reason": "engine"}) == 1

    loop = _loop(ScriptedEngine(tokenizer, []), tokenizer)
    (s,) = _group(loop, _task(["check_answer"], ground_truth=None)).samples
    assert s.finish_reason == "error" and s.failed and "ground_truth" in s.reward_info["error"]
    assert loop.metrics.registry.get_sample_value("rollwave_rollout_failed_total", {"reason": "tool"}) == 1

    with pytest.raises(ValueError, match="task t-1: unknown tool 'python'; configured: calculator, check_answer"):
        _group(_loop(ScriptedEngine(tokenizer, []), tokenizer), _task(["python"]))


def test_tool_reward_in_the_loop(tokenizer: Any) -> None:
    script = [(CHECK.format("41"), "stop"), (CHECK.format("42"), "stop"), ("done", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer)
    loop.reward = RewardComputer("tool_last")
    (s,) = _group(loop, _task(["check_answer"], kind="tool_last")).samples
    assert s.reward == 1.0 and s.reward_info == {"tool_rewards": [0.0, 1.0]}


def test_a_python_tool_without_its_sandbox_is_refused_and_counted(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap: the sandbox cannot be set up
    ran = tmp_path / "ran"
    call = json.dumps({"name": "python", "arguments": {"code": f"open({str(ran)!r}, 'w')"}})
    script = [(f"<tool_call>\n{call}\n</tool_call>", "stop"), ("The answer is 4.", "stop")]
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[PythonTool()], max_new_tokens=256)
    (s,) = _group(loop, _task(["python"], ground_truth=None, kind="gsm8k")).samples
    [tool_text] = [m["content"] for m in s.messages if m["role"] == "tool"]
    assert tool_text == "Error: sandbox unavailable: bwrap not found: install the Debian package bubblewrap"
    value = loop.metrics.registry.get_sample_value
    assert value("rollwave_rollout_tool_calls_total", {"tool": "python", "outcome": "refused"}) == 1
    assert not ran.exists()


def test_a_python_call_past_max_concurrent_is_refused_logged_and_counted(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two python calls of one turn run at once; with max_concurrent 1 the second waits for the first's sandbox,
    and past max_wait_s the model is told it was refused, the refusal logged and counted as ``busy`` (apart from a
    tool that cannot run here, ``refused``)."""
    calls = [json.dumps({"name": "python", "arguments": {"code": code}})
             for code in ("import time; time.sleep(60)", "print('ran')")]
    turn = "".join(f"<tool_call>\n{call}\n</tool_call>\n" for call in calls)
    script = [(turn, "stop"), ("The answer is 4.", "stop")]
    tool = PythonTool(max_concurrent=1, max_wait_s=0.2, timeout_s=2)
    loop = _loop(ScriptedEngine(tokenizer, script), tokenizer, tools=[tool], max_new_tokens=256)
    with caplog.at_level(logging.WARNING, logger="rollout_server.tools.python_tool"):
        (s,) = _group(loop, _task(["python"], ground_truth=None, kind="gsm8k")).samples
    busy = "busy: max_concurrent (1) sandboxes ran for all of the 0.2s this call waited (max_wait_s); try again later"
    assert [m["content"] for m in s.messages if m["role"] == "tool"] == [
        "Error: timed out after 2s and was killed", f"Error: {busy}"]
    assert "python: refused a call of t-1/0/" in caplog.text and busy in caplog.text, caplog.text
    value = loop.metrics.registry.get_sample_value
    assert value("rollwave_rollout_tool_calls_total", {"tool": "python", "outcome": "busy"}) == 1
    assert value("rollwave_rollout_tool_calls_total", {"tool": "python", "outcome": "refused"}) is None
    assert value("rollwave_rollout_tool_calls_total", {"tool": "python", "outcome": "sandbox_timeout"}) == 1
