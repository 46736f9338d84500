"""The OpenAI-compatible episode endpoint, driven by the real ``openai`` client over HTTP on 127.0.0.1.

Episodes run against the real embedded engine (tiny model), or against scripted assistant turns
(``ScriptedEngine``, test data in the engine's reply shape) where a tool call is needed: the untrained
tiny model never writes one. Chat template, tool parser, trajectory builder and rewards are real.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from core.config import RolloutConfig
from core.rewards import RewardComputer, RewardError
from core.tasks import Task
from core.trajectory import ChatRenderer, masked_spans
from rollout_server.engine_client import EngineClient
from rollout_server.metrics import RolloutMetrics
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MESSAGES = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 6 times 7?"}]
TASK = Task(task_id="t-1", messages=MESSAGES, reward={"kind": "gsm8k", "ground_truth": "42"})


class RecordingEngine(EngineClient):
    """The real engine client, keeping every /generate reply so a test can compare the recorded tokens."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.replies: list[dict[str, Any]] = []

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().generate(*args, **kwargs)
        self.replies.append(reply)
        return reply


def _config(**overrides: Any) -> RolloutConfig:
    return RolloutConfig(**{"max_new_tokens": 24, "max_total_tokens": 512, "temperature": 1.0, **overrides})


def _run(tokenizer: Any, engine: Any, agent: Callable[[openai.AsyncOpenAI, AgentEpisode, EpisodeStore], Awaitable[Any]],
         model_name: str = "rollwave", reward: RewardComputer | None = None, task: Task = TASK,
         host: str = "127.0.0.1", **cfg: Any) -> tuple[Any, EpisodeStore]:
    """Open one episode of ``task``, serve it on ``host``, run ``agent`` with an openai client on its base URL, close
    it (scored by ``reward``, default gsm8k)."""
    store = EpisodeStore(tokenizer, model_name, RolloutMetrics())

    async def main() -> Any:
        async with store.serving(host, 0):
            ep = store.open(task, 0, _config(**cfg), engine, reward or RewardComputer("gsm8k"))
            client = openai.AsyncOpenAI(base_url=store.base_url(ep), api_key=ep.key, max_retries=0, timeout=60)
            try:
                await agent(client, ep, store)
            finally:
                await client.close()
                sample = await store.close(ep)
            if isinstance(engine, EngineClient):
                await engine.aclose()
            return sample

    return asyncio.run(main()), store


def test_tool_calling_episode_is_token_exact(tokenizer: Any, engine_url: str) -> None:
    """A scripted tool call, then the real engine: OpenAI tool_calls out, the tool result in as a template
    delta, and the stored tokens are exactly prompt + generated + template, the mask on generated only."""
    real = RecordingEngine(engine_url)
    engine = ScriptedEngine(tokenizer, [("Let me compute. " + CALC.format("6*7"), "stop")], fallback=real)
    seen: dict[str, Any] = {}

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        first = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        seen["first"] = choice
        messages.append(choice.message.model_dump(exclude_none=True))
        call = choice.message.tool_calls[0]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        second = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        seen["second"] = second

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    first = seen["first"]
    assert first.finish_reason == "tool_calls"
    assert first.message.content == "Let me compute."
    assert first.message.tool_calls[0].function.name == "calculator"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"expression": "6*7"}

    renderer = ChatRenderer(tokenizer)
    prompt = renderer.prompt_ids(MESSAGES, TOOLS)
    out1 = tokenizer.encode("Let me compute. " + CALC.format("6*7"), add_special_tokens=False) + [renderer.eos_id]
    delta = renderer.turn_end_suffix + renderer.tool_turn_ids([{"role": "tool", "content": "42"}])
    out2 = real.replies[0]["output_ids"]
    assert engine.calls[1]["input_ids"] == prompt + out1 + delta  # the engine continued from the recorded tokens
    assert sample.token_ids.tolist() == prompt + out1 + delta + out2
    assert sample.prompt_len == len(prompt)
    n1 = len(prompt) + len(out1)
    expected_spans = [(0, len(prompt), 0), (len(prompt), n1, 1), (n1, n1 + len(delta), 0)]
    if out2:
        expected_spans.append((n1 + len(delta), len(sample.token_ids), 1))
    assert masked_spans(sample.loss_mask) == expected_spans
    generated = sample.behaviour_logprobs[len(sample.token_ids) - len(out2):].tolist()
    assert generated == pytest.approx([e[0] for e in real.replies[0]["meta_info"]["output_token_logprobs"]])
    assert sample.token_versions[len(prompt):len(prompt) + 2].tolist() == [3, 3]
    assert sample.num_turns == 2 and sample.finish_reason in ("stop", "length")
    assert [t.name for t in sample.tool_calls] == ["calculator"]
    assert seen["second"].usage.total_tokens == len(sample.token_ids)
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_streaming_multi_turn_matches_engine(tokenizer: Any, engine_url: str) -> None:
    """Streaming and non-streaming calls with a user follow-up: the recorded generated tokens and behaviour
    logprobs are those the engine returned, turn by turn."""
    real = RecordingEngine(engine_url)
    texts: list[str] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        stream = await client.chat.completions.create(model="rollwave", messages=messages, stream=True,
                                                      stream_options={"include_usage": True})
        parts, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert finish in ("stop", "length")
        texts.append("".join(parts))
        messages += [{"role": "assistant", "content": texts[0]}, {"role": "user", "content": "And 2+2?"}]
        reply = await client.chat.completions.create(model="rollwave", messages=messages, max_tokens=5)
        assert reply.usage.completion_tokens <= 5
        texts.append(reply.choices[0].message.content)

    sample, store = _run(tokenizer, real, agent)
    renderer = ChatRenderer(tokenizer)
    generated = [i for i, m in zip(sample.token_ids.tolist(), sample.loss_mask.tolist(), strict=True) if m]
    logprobs = [p for p, m in zip(sample.behaviour_logprobs.tolist(), sample.loss_mask.tolist(), strict=True) if m]
    engine_ids = [t for r in real.replies for t in r["output_ids"]]
    assert generated == engine_ids
    assert logprobs == pytest.approx([e[0] for r in real.replies for e in r["meta_info"]["output_token_logprobs"]])
    assert sample.token_ids.tolist()[: sample.prompt_len] == renderer.prompt_ids(MESSAGES, None)
    assert real.replies[1]["meta_info"]["completion_tokens"] <= 5
    assert sample.num_turns == 2 and sample.finish_reason != "history_mismatch"
    assert texts[0] == renderer.decode([t for t in real.replies[0]["output_ids"] if t != renderer.eos_id])


def test_edited_history_is_marked_and_counted(tokenizer: Any, engine_url: str) -> None:
    """An agent that rewrites an earlier assistant turn is still answered, but the episode is not trainable."""
    real = RecordingEngine(engine_url)

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES)
        edited = (first.choices[0].message.content or "") + " (edited)"
        messages = [*MESSAGES, {"role": "assistant", "content": edited}, {"role": "user", "content": "go on"}]
        second = await client.chat.completions.create(model="rollwave", messages=messages)
        assert second.choices[0].message.role == "assistant"

    sample, store = _run(tokenizer, real, agent)
    assert sample.finish_reason == "history_mismatch"
    assert sample.reward == 0.0 and "edited its history" in sample.reward_info["error"]
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 1


def test_top_k_and_top_p_reach_the_engine(tokenizer: Any, engine_url: str) -> None:
    """The episode's rollout.top_k / rollout.top_p go with the agent's requests to the engine: at temperature 1
    episodes differ by default, and are all the same greedy completion with top_k=1 or a tiny top_p."""

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        await client.chat.completions.create(model="rollwave", messages=MESSAGES)

    def completion(**sampling: Any) -> tuple[int, ...]:
        sample, _ = _run(tokenizer, EngineClient(engine_url), agent, **sampling)
        return tuple(sample.token_ids.tolist()[sample.prompt_len:])

    assert len({completion() for _ in range(3)}) > 1
    assert len({completion(top_k=1), completion(top_k=1), completion(top_p=1e-6), completion(top_p=1e-6)}) == 1


def test_posted_reward_replaces_the_reward_function(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [("The answer is 41.", "stop")])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        await client.chat.completions.create(model="policy", messages=MESSAGES)
        async with httpx.AsyncClient() as http:
            wrong = await http.post(f"{store.url}/episodes/{ep.episode_id}/reward", json={"reward": 0.7},
                                    headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            ok = await http.post(f"{store.url}/episodes/{ep.episode_id}/reward", json={"reward": 0.7,
                                 "info": {"judge": "agent"}}, headers={"Authorization": f"Bearer {ep.key}"})
            assert ok.status_code == 200

    sample, _ = _run(tokenizer, engine, agent, model_name="policy")
    assert sample.reward == 0.7 and sample.reward_info == {"judge": "agent"}


def test_an_ipv6_host_gives_agents_a_url_they_can_reach(tokenizer: Any) -> None:
    """Served on ``::1``, the endpoint's URL has the address in brackets (``http://::1:8000`` names no port), so
    the agent's base URL reaches it."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        assert store.base_url(ep).startswith("http://[::1]:")
        await client.chat.completions.create(model="rollwave", messages=MESSAGES)

    sample, _ = _run(tokenizer, engine, agent, host="::1")
    assert (sample.finish_reason, sample.reward, len(engine.calls)) == ("stop", 1.0, 1)


def test_reward_function_scores_the_final_answer(tokenizer: Any) -> None:
    """With no posted reward the job's reward function (gsm8k) scores the last assistant turn; the header
    form of the episode id works like the URL form."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        plain = openai.AsyncOpenAI(base_url=store.url + "/v1", api_key=ep.key, max_retries=0,
                                   default_headers={"X-Episode-Id": ep.episode_id})
        await plain.chat.completions.create(model="rollwave", messages=MESSAGES)
        await plain.close()

    sample, _ = _run(tokenizer, engine, agent)
    assert sample.reward == 1.0 and sample.reward_info["extracted"] == "42"
    assert sample.finish_reason == "stop"


def test_a_hanging_reward_function_fails_the_episode_within_the_limit(tokenizer: Any) -> None:
    """A judge that never answers: closing the episode fails (its group with it) at the limit, naming the reward."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    reward = RewardComputer("hang", {"hang": "tests.test_rewards:hanging_reward"}, timeout_s=0.2)

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        await client.chat.completions.create(model="rollwave", messages=MESSAGES)

    start = time.monotonic()
    with pytest.raises(RewardError) as failure:
        _run(tokenizer, engine, agent, reward=reward, task=Task(task_id="t-1", messages=MESSAGES, reward={}))
    assert time.monotonic() - start < 3
    assert str(failure.value) == "reward 'hang' for task t-1: no answer within 0.2s (rollout.reward_timeout_s)"


def test_versions_approximate_reach_the_sample(tokenizer: Any) -> None:
    """An engine that gives no per-token versions (``EngineClient`` marks its replies approximate) makes the
    sample say so, and only then."""

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        await client.chat.completions.create(model="rollwave", messages=MESSAGES)

    for approximate in (True, False):
        sample, _ = _run(tokenizer, ScriptedEngine(tokenizer, [("The answer is 42.", "stop")], approximate=approximate),
                         agent)
        assert sample.versions_approximate == approximate


def test_an_engine_abort_fails_the_episode(tokenizer: Any) -> None:
    """An aborted reply is answered 503 (the openai client raises), the episode ends, and its sample fails:
    never trained, not even with a reward the agent posted."""
    engine = ScriptedEngine(tokenizer, [("partial", "abort")])
    errors: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="rollwave", messages=MESSAGES)
        errors.append(info.value)
        with pytest.raises(openai.ConflictError):
            await client.chat.completions.create(model="rollwave", messages=MESSAGES)
        async with httpx.AsyncClient() as http:
            posted = await http.post(f"{store.url}/episodes/{ep.episode_id}/reward", json={"reward": 1.0},
                                     headers={"Authorization": f"Bearer {ep.key}"})
            assert posted.status_code == 200

    sample, store = _run(tokenizer, engine, agent)
    assert (errors[0].status_code, errors[0].code, errors[0].type) == (503, "engine_aborted", "server_error")
    assert (sample.finish_reason, sample.failed, sample.reward) == ("abort", True, 0.0)
    assert sample.reward_info == {"error": "the engine aborted the request"}
    assert sample.messages[-1] == {"role": "assistant", "content": "partial"} and len(engine.calls) == 1
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="engine_aborted") == 1
    assert store.metrics.total("rollwave_rollout_failed_total", reason="abort") == 1  # counted, as the loop's
    assert store.metrics.total("rollwave_rollout_reward_count") == 0  # and no reward observed for it


def test_a_turn_whose_end_token_is_the_last_allowed_one_is_answered(tokenizer: Any) -> None:
    """SGLang reports a turn whose end token is the last one allowed as ``length``: such a turn is closed, so
    its tool call is parsed and the final answer is a stop, the sample not truncated."""
    call, answer = "Let me compute. " + CALC.format("6*7"), "The answer is 42."
    n_call, n_answer = (len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in (call, answer))
    engine = ScriptedEngine(tokenizer, [(call, "stop"), (answer, "stop")])
    finishes: list[str] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        first = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS,
                                                     max_tokens=n_call)
        message = first.choices[0].message
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
        second = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS,
                                                      max_tokens=n_answer)
        finishes.extend([first.choices[0].finish_reason, second.choices[0].finish_reason])

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [c["sampling_params"]["max_new_tokens"] for c in engine.calls] == [n_call, n_answer]
    assert finishes == ["tool_calls", "stop"]
    assert (sample.finish_reason, sample.truncated, sample.reward) == ("stop", False, 1.0)


def test_a_request_past_the_context_ends_the_episode_truncated(tokenizer: Any) -> None:
    """The agent's next request does not fit ``max_total_tokens``: it is refused, and the episode, cut off by
    the context, is a truncated sample (``max_total_tokens``), as in the built-in loop."""
    n_call = len(tokenizer.encode(CALC.format("6*7"), add_special_tokens=False)) + 1
    engine = ScriptedEngine(tokenizer, [(CALC.format("6*7"), "stop")])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        messages = [*MESSAGES, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        assert info.value.code == "context_length_exceeded"

    prompt_len = len(ChatRenderer(tokenizer).prompt_ids(MESSAGES, TOOLS))
    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64, max_total_tokens=prompt_len + n_call + 2)
    assert len(sample.token_ids) == prompt_len + n_call and len(engine.calls) == 1
    assert (sample.finish_reason, sample.truncated, sample.failed) == ("max_total_tokens", True, False)


def test_openai_shaped_errors(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [])
    errors: dict[str, Any] = {}

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        async def error(name: str, call: Awaitable[Any]) -> None:
            with pytest.raises(openai.APIStatusError) as info:
                await call
            errors[name] = info.value

        create = client.chat.completions.create
        await error("model", create(model="gpt-4o", messages=MESSAGES))
        await error("tools", create(model="rollwave", messages=MESSAGES, tools=[{"type": "function",
                                                                                  "function": {"name": "a b"}}]))
        await error("tool_choice", create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "nope"}}))
        await error("context", create(model="rollwave", messages=[{"role": "user", "content": "word " * 80}]))
        missing = openai.AsyncOpenAI(base_url=f"{store.url}/episodes/nope/v1", api_key=ep.key, max_retries=0)
        await error("episode", missing.chat.completions.create(model="rollwave", messages=MESSAGES))
        await missing.close()
        bad_key = openai.AsyncOpenAI(base_url=store.base_url(ep), api_key="wrong", max_retries=0)
        await error("key", bad_key.chat.completions.create(model="rollwave", messages=MESSAGES))
        await bad_key.close()

    _sample, store = _run(tokenizer, engine, agent, max_total_tokens=64)
    expected = {"model": (404, "model_not_found"), "tools": (400, "invalid_tools"),
                "tool_choice": (400, "invalid_tool_choice"), "context": (400, "context_length_exceeded"),
                "episode": (404, "episode_not_found"), "key": (401, "invalid_api_key")}
    for name, (status, code) in expected.items():
        assert (errors[name].status_code, errors[name].code) == (status, code), name
        assert errors[name].body["message"], name
    assert "64 tokens" in errors["context"].body["message"]
    assert engine.calls == []
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="model_not_found") == 1


def _call(arguments: str | None = '{"expression": "6*7"}', **function: Any) -> dict[str, Any]:
    """An assistant tool call as the openai client re-sends it; ``None`` leaves a part out."""
    fn = {"name": "calculator", **({} if arguments is None else {"arguments": arguments}), **function}
    return {"id": "call_1", "type": "function", "function": fn}


# (what replaces or follows the recorded assistant turn, the message index and path the 400 names)
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("follows", {"content": "42"}, "messages[3].role"),
    ("follows", {"role": 5, "content": "42"}, "messages[3].role"),
    ("follows", {"role": "bot", "content": "42"}, "messages[3].role"),
    ("follows", {"role": "tool", "tool_call_id": "call_1", "content": 42}, "messages[3].content"),
    ("follows", {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
     "messages[3].content"),
    ("follows", {"role": "user", "content": "hi", "tool_calls": [_call()]}, "messages[3].tool_calls"),
    ("follows", {"role": "tool", "tool_call_id": 1, "content": "42"}, "messages[3].tool_call_id"),
    ("replaces", {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function"}]},
     "messages[2].tool_calls[0].function"),
    ("replaces", {"role": "assistant", "content": None, "tool_calls": [_call(arguments=None)]},
     "messages[2].tool_calls[0].function.arguments"),
    ("replaces", {"role": "assistant", "content": None, "tool_calls": [_call(arguments={"expression": "6*7"})]},
     "messages[2].tool_calls[0].function.arguments"),
    ("replaces", {"role": "assistant", "content": None, "tool_calls": "abc"}, "messages[2].tool_calls"),
]


def test_malformed_messages_are_refused_naming_the_field_and_record_nothing(tokenizer: Any) -> None:
    """Each malformed message is a 400 in OpenAI's shape whose ``param`` is its path, counted like the other
    refusals; the episode is unchanged, so the agent's next valid request (an assistant turn with content
    None and tool_calls re-sent as the openai client dumps it, then the tool result) continues it."""
    engine = ScriptedEngine(tokenizer, [(CALC.format("6*7"), "stop"), ("The answer is 42.", "stop")])
    refused: list[tuple[str, Any]] = []
    recorded: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        async def refuse(messages: list[Any], want: str) -> None:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
            refused.append((want, info.value))

        await refuse([{"role": "bot", "content": "hi"}, *MESSAGES], "messages[0].role")
        assert ep.builder is None and ep.messages == []
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS)
        assistant = first.choices[0].message.model_dump()  # content None, tool_calls, refusal None, ...
        assert assistant["content"] is None and assistant["tool_calls"]
        assistant["tool_calls"][0]["id"] = "call_1"
        history = [*MESSAGES, assistant]
        recorded.append((len(ep.builder), list(ep.messages)))
        for where, message, want in MALFORMED:
            await refuse([*history, message] if where == "follows" else [*MESSAGES, message], want)
        assert (len(ep.builder), ep.messages) == recorded[0]
        await client.chat.completions.create(model="rollwave", tools=TOOLS, messages=[
            *history, {"role": "tool", "tool_call_id": "call_1", "content": [
                {"type": "text", "text": "the result:"}, {"type": "text", "text": "42"}]}])

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert len(refused) == len(MALFORMED) + 1
    for want, error in refused:
        assert (error.status_code, error.code, error.body["param"]) == (400, "invalid_messages", want), want
        assert error.body["message"].startswith(want + ": "), error.body["message"]
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="invalid_messages") == len(refused)
    assert len(engine.calls) == 2 and sample.num_turns == 2 and sample.finish_reason == "stop"
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert sample.messages[3]["content"] == "the result: 42"  # parts kept as their text, as the built-in loop's
    assert sample.reward == 1.0 and [t.name for t in sample.tool_calls] == ["calculator"]
