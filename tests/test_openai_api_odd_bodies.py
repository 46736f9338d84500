"""The episode endpoint's answers to odd requests: ``logprobs`` of a turn the model's other end token closed, a body
that is not UTF-8, text that no tokenizer takes (a lone surrogate, which JSON's ``\\ud800`` escapes allow) and an
ignored field nested deep. Driven over HTTP on 127.0.0.1 by the real ``openai`` client, or by httpx where the body is
one the client cannot send; assistant turns are scripted (``ScriptedEngine``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, _run


def test_logprobs_leave_out_the_models_other_end_token(tokenizer: Any) -> None:
    """A turn closed by ``<|endoftext|>`` (Qwen's other stop token) has it in no content, so not in ``logprobs``
    either: one entry per content token, as for a turn closed by the template's end token, streamed or not."""
    engine = ScriptedEngine(tokenizer, [("42", "endoftext"), ("43", "endoftext")])
    got: list[tuple[str | None, list[str]]] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, logprobs=True)
        choice = reply.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        got.append((choice.message.content, [e.token for e in choice.logprobs.content]))
        messages = [*MESSAGES, choice.message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        stream = await client.chat.completions.create(model="rollwave", messages=messages, logprobs=True, stream=True)
        parts: list[str] = []
        tokens: list[str] = []
        async for chunk in stream:
            for streamed in chunk.choices:
                parts.append(streamed.delta.content or "")
                tokens += [e.token for e in (streamed.logprobs.content or [])] if streamed.logprobs else []
        got.append(("".join(parts), tokens))

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert got == [("42", ["4", "2"]), ("43", ["4", "3"])]
    assert sample.finish_reason == "stop" and sample.num_turns == 2


def test_a_turn_closed_by_the_models_other_end_token_at_the_limit_is_not_cut_off(tokenizer: Any) -> None:
    """SGLang reports a turn whose end token is the last one allowed as ``length``. Closed by ``<|endoftext|>`` (in
    the model's generation config), the gateway took it for cut off: finish ``length``, the end token's text in the
    content, its tool call never parsed. It is closed, as one closed by the template's end token is."""
    call = CALC.format("6*7")
    limit = len(tokenizer.encode(call, add_special_tokens=False)) + 1
    engine = ScriptedEngine(tokenizer, [(call, "endoftext")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        got.append((await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                         max_tokens=limit)).choices[0])

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    [choice] = got
    assert engine.calls[0]["sampling_params"]["max_new_tokens"] == limit
    assert choice.finish_reason == "tool_calls", choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("calculator", {"expression": "6*7"})]
    assert not sample.truncated


def test_a_body_that_is_not_utf8_is_refused_as_such_not_as_an_unknown_url(tokenizer: Any) -> None:
    """A body in another encoding (Latin-1 here) is a 400 saying the body cannot be read, code ``invalid_request``,
    counted under it; it was answered ``Invalid URL`` with code ``unknown_url``, which sent the agent's author to
    check the base URL. Nothing is recorded, and the episode goes on."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    answers: list[httpx.Response] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        body = json.dumps({"model": "rollwave", "messages": [{"role": "user", "content": "caf\u00e9"}]},
                          ensure_ascii=False).encode("latin-1")
        async with httpx.AsyncClient(timeout=30) as http:
            answers.append(await http.post(f"{store.base_url(ep)}/chat/completions", content=body, headers={
                "Authorization": f"Bearer {ep.key}", "Content-Type": "application/json"}))
        assert ep.builder is None and engine.calls == []
        await client.chat.completions.create(model="rollwave", messages=MESSAGES)

    sample, store = _run(tokenizer, engine, agent)
    (answer,) = answers
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["type"], error["param"]) == (
        400, "invalid_request", "invalid_request_error", None), answer.text
    assert error["message"].startswith("the body cannot be read"), error["message"]
    assert answer.headers["x-should-retry"] == "false"
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="invalid_request") == 1
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="unknown_url") == 0
    assert (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 1, 1.0)


def test_a_lone_surrogate_is_a_400_naming_where_it_is_not_a_500(tokenizer: Any) -> None:
    """JSON may escape half a UTF-16 pair (a JavaScript tool's output cut inside an emoji): no tokenizer takes it.
    Such a string in a message, a tool (a key too) or another field is a 400 naming its path, and the episode is
    unchanged, so the agent's request without it continues it; it was a 500 ``internal_error`` that ended the
    episode."""
    engine = ScriptedEngine(tokenizer, [(CALC.format("6*7"), "stop"), ("The answer is 42.", "stop")])
    refused: list[tuple[str, httpx.Response]] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True)]
        result = {"role": "tool", "tool_call_id": call.id, "content": "42"}
        recorded = (len(ep.builder or []), list(ep.messages))
        odd_tools = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
            "type": "object", "properties": {"expr\ud83d": {"type": "string"}}}}}]
        bodies = [
            ("messages[3].content", {"messages": [*history, {**result, "content": "4\ud83d"}], "tools": TOOLS}),
            ("messages[3].content[0].text", {"messages": [*history, {**result, "content": [
                {"type": "text", "text": "\udcff"}]}], "tools": TOOLS}),
            ("tools[0].function.parameters.properties", {"messages": [*history, result], "tools": odd_tools}),
            ("stop", {"messages": [*history, result], "tools": TOOLS, "stop": "\ud800"}),
        ]
        async with httpx.AsyncClient(timeout=30) as http:
            for where, body in bodies:  # ensure_ascii: the surrogate travels as its escape, as JSON allows
                refused.append((where, await http.post(
                    f"{store.base_url(ep)}/chat/completions", content=json.dumps({"model": "rollwave", **body}),
                    headers={"Authorization": f"Bearer {ep.key}", "Content-Type": "application/json"})))
        assert (len(ep.builder or []), ep.messages) == recorded and ep.failure is None
        await client.chat.completions.create(model="rollwave", messages=[*history, result], tools=TOOLS)

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    for where, answer in refused:
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (400, where), answer.text
        assert error["message"].startswith(f"{where}: not valid Unicode text"), error["message"]
    assert [answer.json()["error"]["code"] for _, answer in refused] == [
        "invalid_messages", "invalid_messages", "invalid_tools", "invalid_request"]
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="internal_error") == 0
    assert len(engine.calls) == 2 and (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 2, 1.0)
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_an_ignored_field_nested_deep_is_still_ignored(tokenizer: Any) -> None:
    """A field the endpoint ignores (``metadata`` here) nested 500 deep, which the JSON parser takes, is ignored like
    any other: the turn is answered. It was a plain-text 500 (pydantic's serializer stops at 400 levels), which the
    openai client retried into the same 500."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    answers: list[httpx.Response] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        body = json.dumps({"model": "rollwave", "messages": MESSAGES, "metadata": "@"}).replace(
            '"@"', "[" * 500 + '"x"' + "]" * 500)
        async with httpx.AsyncClient(timeout=30) as http:
            answers.append(await http.post(f"{store.base_url(ep)}/chat/completions", content=body, headers={
                "Authorization": f"Bearer {ep.key}", "Content-Type": "application/json"}))

    sample, _ = _run(tokenizer, engine, agent)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "The answer is 42."
    assert (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 1, 1.0)
