"""The episode endpoint's limits and tool rendering, driven by the real ``openai`` client against scripted turns: a
``max_tokens`` above the job's cap (or the context left) is lowered visibly (counted, ``length`` when cut there), and
the tools the prompt shows follow ``tool_choice`` as SGLang renders them where one recorded prompt allows it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from core.trajectory import ChatRenderer
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, _run

LONG = "The answer is forty two, and here is why it is forty two."
LOWERED = "rollwave_rollout_openai_max_tokens_lowered_total"
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def test_a_max_tokens_above_the_jobs_cap_is_lowered_counted_and_cut_as_length(tokenizer: Any) -> None:
    """At a cap of 5 (not the default), max_tokens=100 and max_completion_tokens=100 generate 5 tokens, each counted
    under ``limit="max_new_tokens"``; a turn cut there is ``length`` to the agent (5 completion tokens) and truncates
    the sample. A max_tokens at or below the cap, or none, is no lowering and is not counted."""
    engine = ScriptedEngine(tokenizer, [(LONG, "stop"), (LONG, "stop"), ("42", "stop"), ("42", "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        for limits in ({"max_tokens": 100}, {"max_completion_tokens": 100}, {"max_tokens": 5}, {}):
            reply = await client.chat.completions.create(model="rollwave", messages=messages, **limits)
            got.append(reply)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=5)
    assert [c["sampling_params"]["max_new_tokens"] for c in engine.calls] == [5, 5, 5, 5]
    assert [r.choices[0].finish_reason for r in got] == ["length", "length", "stop", "stop"]
    assert [r.usage.completion_tokens for r in got[:2]] == [5, 5]
    assert got[0].choices[0].message.content == tokenizer.decode(tokenizer.encode(LONG, add_special_tokens=False)[:5])
    assert store.metrics.total(LOWERED, limit="max_new_tokens") == 2
    assert store.metrics.total(LOWERED) == 2
    assert sample.num_turns == 4 and sample.finish_reason == "stop"


def test_a_max_tokens_above_the_context_left_is_lowered_counted_and_ends_the_episode_truncated(
        tokenizer: Any) -> None:
    """With 4 tokens left in max_total_tokens (under the cap of 64), max_tokens=50 generates 4, counted under
    ``limit="context"``; the turn is ``length`` and the episode ends ``max_total_tokens``."""
    prompt = ChatRenderer(tokenizer).prompt_ids(MESSAGES, None)
    engine = ScriptedEngine(tokenizer, [(LONG, "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        got.append(await client.chat.completions.create(model="rollwave", messages=MESSAGES, max_tokens=50))

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64, max_total_tokens=len(prompt) + 4)
    assert engine.calls[0]["sampling_params"]["max_new_tokens"] == 4
    assert (got[0].choices[0].finish_reason, got[0].usage.completion_tokens) == ("length", 4)
    assert store.metrics.total(LOWERED, limit="context") == 1 and store.metrics.total(LOWERED) == 1
    assert sample.finish_reason == "max_total_tokens" and sample.truncated


@pytest.mark.parametrize(("first", "shown"), [("none", None), ("auto", TOOLS)])
def test_tool_choice_none_leaves_the_tools_out_of_the_prompt_and_a_later_none_keeps_them(
        tokenizer: Any, first: str, shown: list[dict[str, Any]] | None) -> None:
    """As SGLang renders it, a first request with ``tool_choice="none"`` gets a prompt without the tools (it held
    them); in an episode whose prompt shows them, a later ``none`` continues on the recorded tokens (the prompt cannot
    change) and parses no call, without a history mismatch."""
    renderer = ChatRenderer(tokenizer)
    engine = ScriptedEngine(tokenizer, [("Let me think.", "stop"), (CALC.format("6*7"), "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice=first)  # type: ignore[arg-type]
        messages = [*MESSAGES, reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go on"}]
        got.append(await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS,
                                                         tool_choice="none"))

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    prompt = renderer.prompt_ids(MESSAGES, shown)
    assert engine.calls[0]["input_ids"] == prompt
    out1 = tokenizer.encode("Let me think.", add_special_tokens=False) + [renderer.eos_id]
    delta = renderer.turn_end_suffix + renderer.tool_turn_ids([{"role": "user", "content": "go on"}])
    assert engine.calls[1]["input_ids"] == prompt + out1 + delta
    choice = got[0].choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == (
        "stop", CALC.format("6*7"), None)
    assert sample.finish_reason == "stop" and sample.tool_calls == []
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_calling_tools_after_a_prompt_rendered_under_none_is_a_history_mismatch(tokenizer: Any) -> None:
    """A prompt rendered under ``none`` does not show the tools; a later request that lets the model call them
    (``auto``) is answered from the whole history rendered anew with the tools (as SGLang renders it), its call
    parsed, but the episode is a counted history mismatch, never trained: the policy would learn to call tools its
    prompt does not show."""
    renderer = ChatRenderer(tokenizer)
    engine = ScriptedEngine(tokenizer, [("Let me think.", "stop"), (CALC.format("6*7"), "stop")])
    got: list[Any] = []
    sent: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice="none")
        sent[:] = [*MESSAGES, reply.choices[0].message.model_dump(exclude_none=True),
                   {"role": "user", "content": "go on"}]
        got.append(await client.chat.completions.create(model="rollwave", messages=sent, tools=TOOLS))

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert engine.calls[1]["input_ids"] == renderer.prompt_ids(sent, TOOLS)
    assert got[0].choices[0].finish_reason == "tool_calls"
    assert sample.finish_reason == "history_mismatch"
    assert "tool_choice" in sample.reward_info["error"], sample.reward_info
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 1


def test_a_named_tool_choice_shows_every_tool_for_the_turns_after_it(tokenizer: Any) -> None:
    """Unlike SGLang (only the named tool), a named first request renders every tool: the episode's later ``auto``
    turns (the openai-agents SDK resets to it after the first call) continue on that prompt, no mismatch."""
    renderer = ChatRenderer(tokenizer)
    tools = [*TOOLS, SEARCH]
    body = ' {"expression": "6*7"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [(body, "stop"), ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}'
                                                         "\n</tool_call>", "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        for choice in ({"type": "function", "function": {"name": "calculator"}}, "auto"):
            reply = await client.chat.completions.create(model="rollwave", messages=messages, tools=tools,
                                                         tool_choice=choice)  # type: ignore[arg-type]
            message = reply.choices[0].message
            got.append(reply.choices[0])
            messages += [message.model_dump(exclude_none=True),
                         *({"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls or [])]

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    prompt = renderer.prompt_ids(MESSAGES, tools)
    assert engine.calls[0]["input_ids"][: len(prompt)] == prompt
    assert [c.message.tool_calls[0].function.name for c in got] == ["calculator", "search"]
    assert [t.name for t in sample.tool_calls] == ["calculator", "search"]
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


# vLLM's and SGLang's extensions (sent as extra_body) that the endpoint would otherwise silently ignore, answering the
# agent with another prompt or reply than it asked for, or sampling otherwise than it asked
EXTENSIONS: dict[str, Any] = {
    "continue_final_message": True, "add_generation_prompt": False, "echo": True, "input_ids": [1, 2, 3],
    "lora_path": "adapter", "stop_token_ids": [17], "include_stop_str_in_output": True, "no_stop_trim": True,
    "use_beam_search": True, "best_of": 2, "allowed_token_ids": [1, 2], "bad_words": ["no"]}


def test_engine_extensions_that_change_the_prompt_or_reply_are_refused_naming_them(tokenizer: Any) -> None:
    """Each is a 400 naming the field (code unsupported_parameter), counted, with nothing recorded; their defaults, as
    some clients send them, are accepted."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    refused: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for name, value in EXTENSIONS.items():
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="rollwave", messages=MESSAGES, extra_body={name: value})
            refused.append(info.value)
        assert ep.builder is None and engine.calls == []
        await client.chat.completions.create(model="rollwave", messages=MESSAGES, extra_body={
            "continue_final_message": False, "add_generation_prompt": True, "echo": False, "stop_token_ids": [],
            "include_stop_str_in_output": False, "no_stop_trim": False, "use_beam_search": False, "best_of": 1,
            "allowed_token_ids": None, "bad_words": []})

    sample, store = _run(tokenizer, engine, agent)
    assert [(e.status_code, e.code, e.body["param"]) for e in refused] == [
        (400, "unsupported_parameter", name) for name in EXTENSIONS]
    assert all(name in e.body["message"] for name, e in zip(EXTENSIONS, refused, strict=True))
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="unsupported_parameter") == len(
        EXTENSIONS)
    assert (sample.num_turns, sample.finish_reason) == (1, "stop")
