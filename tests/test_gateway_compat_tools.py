"""Tool calls at the episode endpoint as openai-client agent code meets them: the arguments of a ``strict`` tool's calls
are checked against its schema (generation is not constrained), a schema that cannot be checked is refused, and the
arguments come back as SGLang writes them. Driven by the real ``openai`` client over HTTP on 127.0.0.1; the calls are
scripted (``ScriptedEngine``), as the untrained tiny model never writes one."""

from __future__ import annotations

import json
from typing import Any

import openai
import pydantic
import pytest

from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, _run

BAD_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 42}}\n</tool_call>'


class calculator(pydantic.BaseModel):  # noqa: N801 - the tool's name is the model's name
    """Evaluate an arithmetic expression."""

    expression: str


def _strict(parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": parameters, "strict": True}}]


def test_a_strict_call_that_breaks_its_schema_comes_back_as_content(tokenizer: Any) -> None:
    """``strict`` was accepted and not enforced: a call whose arguments break the schema came back as a call, and the
    client's ``parse`` helper, which OpenAI's guarantee lets rely on the schema, raised on it in the agent. Such a
    turn now comes back whole as content (finish ``stop``), counted and recorded as a failed call, with its tokens
    the policy's; a conforming call comes back parsed, and without ``strict`` the same call comes back as before."""
    text = "Sure. " + BAD_CALL
    engine = ScriptedEngine(tokenizer, [(text, "stop"), ("Sure. " + CALC.format("6*7"), "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        tools = [openai.pydantic_function_tool(calculator)]
        for _ in range(2):
            reply = await client.chat.completions.parse(model="rollwave", messages=messages, tools=tools)
            got.append(reply.choices[0])
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "Use the calculator."})

    async def loose_agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        got.append((await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS)).choices[0])

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    _run(tokenizer, ScriptedEngine(tokenizer, [(text, "stop")]), loose_agent, max_new_tokens=64)
    broken, kept, loose = got
    assert (broken.finish_reason, broken.message.content, broken.message.tool_calls) == ("stop", text, None)
    assert (kept.finish_reason, kept.message.content) == ("tool_calls", "Sure.")
    assert kept.message.tool_calls[0].function.parsed_arguments == calculator(expression="6*7")
    assert (loose.finish_reason, loose.message.tool_calls[0].function.arguments) == (
        "tool_calls", '{"expression": 42}')
    assert store.metrics.total("rollwave_rollout_tool_calls_total", tool="calculator", outcome="parse_error") == 1
    record = sample.tool_calls[0]
    assert (record.name, record.ok) == ("calculator", False)
    assert record.error == "arguments break the strict schema at $.expression: 42 is not of type 'string'"
    assert sample.messages[2] == {"role": "assistant", "content": text}
    assert (sample.finish_reason, sample.num_turns) == ("stop", 2)
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0
    first_turn = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    prompt = engine.calls[0]["input_ids"]
    assert engine.calls[1]["input_ids"][len(prompt):len(prompt) + len(first_turn)] == first_turn


def _nested(depth: int, inner: dict[str, Any], key: str) -> dict[str, Any]:
    for _ in range(depth):
        inner = {key: inner} if key == "a" else {"type": "array", key: inner}
    return inner


@pytest.mark.parametrize(("parameters", "why"), [
    ({"type": "objekt"}, "'objekt' is not valid under any of the given schemas"),
    ({"type": "object", "properties": {"expression": {"$ref": "#/$defs/expr"}}}, "unresolvable $ref: "),
    ({"$schema": 5, "type": "object"}, "$schema must be the URI of a JSON Schema draft"),
    ({"type": "object", "properties": {"a": _nested(300, {"type": "string"}, "items")}}, "nested too deep to check"),
])
def test_a_strict_schema_that_cannot_be_checked_is_a_400_naming_it(tokenizer: Any, parameters: dict[str, Any],
                                                                    why: str) -> None:
    """A strict tool whose ``parameters`` are no JSON Schema, refer to a definition they do not hold, or are nested past
    what can be checked was accepted (and a dangling reference would have failed the episode once a call reached it).
    It is a 400 naming the parameters, before anything is generated or recorded; without ``strict`` the same tool is
    answered."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    refused: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=_strict(parameters))
        refused.append(info.value)
        assert ep.builder is None and engine.calls == []
        loose = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": parameters}}]
        await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=loose)

    # the deep schema renders long: room for it in the context
    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64, max_total_tokens=8192)
    (error,) = refused
    assert (error.code, error.body["param"]) == ("invalid_tools", "tools[0].function.parameters")
    prefix = "tools[0].function.parameters: not a JSON Schema strict can be checked against: "
    assert error.body["message"].startswith(prefix + why), error.body["message"]
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="invalid_tools") == 1
    assert sample.num_turns == 1


def test_call_arguments_keep_their_text_as_sglang_writes_them(tokenizer: Any) -> None:
    """A call's ``arguments`` were JSON with every non-ASCII character escaped (``"6\\u00d77"``), where SGLang (and
    OpenAI) give the text as written (``"6×7"``): an agent comparing or showing them saw something else than under
    SGLang. Plain and streamed alike, and re-sent, the history still matches the recorded turn."""
    engine = ScriptedEngine(tokenizer, [(CALC.format("6×7"), "stop"), (CALC.format("6×7"), "stop"),
                                        ("The answer is 42.", "stop")])
    got: list[str] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        reply = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        got.append(reply.choices[0].message.tool_calls[0].function.arguments)
        messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": "a", "content": "42"}]
        async with client.chat.completions.stream(model="rollwave", messages=messages, tools=TOOLS) as stream:
            message = (await stream.get_final_completion()).choices[0].message
        got.append(message.tool_calls[0].function.arguments)
        messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "b", "content": "42"}]
        await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert got == ['{"expression": "6×7"}'] * 2
    assert (sample.num_turns, sample.finish_reason) == (3, "stop")
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_a_strict_schema_is_checked_through_its_references(tokenizer: Any) -> None:
    """A strict schema with ``$defs`` (as pydantic writes nested models) is accepted, a ``$ref``-like object in its data
    (``const``) or a property named ``enum`` no obstacle, and a call is checked through the references."""
    parameters = {"type": "object", "additionalProperties": False, "required": ["expression", "enum"],
                  "$defs": {"expr": {"type": "string"}},
                  "properties": {"expression": {"$ref": "#/$defs/expr"},
                                 "enum": {"const": {"$ref": "not a reference"}}}}
    call = ('<tool_call>\n{{"name": "calculator", "arguments": {{"expression": {}, '
            '"enum": {{"$ref": "not a reference"}}}}}}\n</tool_call>')
    engine = ScriptedEngine(tokenizer, [(call.format('"6*7"'), "stop"), (call.format("42"), "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        for _ in range(2):
            reply = await client.chat.completions.create(model="rollwave", messages=messages,
                                                         tools=_strict(parameters))
            got.append(reply.choices[0])
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "Again."})

    _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [c.finish_reason for c in got] == ["tool_calls", "stop"]
    assert got[1].message.content == call.format("42")


def test_a_strict_call_nested_past_what_can_be_checked_comes_back_as_content(tokenizer: Any) -> None:
    """A schema that refers to itself checks arguments as deep as they go: a call nested past Python's recursion limit
    for the check comes back as content, as one that breaks the schema, not as a 500 that ends the episode."""
    parameters = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    deep = json.dumps(_nested(300, {}, "a"))
    text = f'<tool_call>\n{{"name": "calculator", "arguments": {deep}}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [(text, "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        got.append(await client.chat.completions.create(model="rollwave", messages=MESSAGES,
                                                        tools=_strict(parameters)))

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=4096, max_total_tokens=8192)
    choice = got[0].choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", text)
    assert sample.tool_calls[0].error == "arguments nested too deep to check against the strict schema"
