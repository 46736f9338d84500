"""The episode endpoint as unmodified openai-client agent code meets it: nulls for optional fields, malformed fields,
fields asking for output it cannot give, ``parallel_tool_calls``, the plain ``/v1`` base URL's models, and URLs it
does not serve. Driven by the real ``openai`` client over HTTP on 127.0.0.1; assistant turns are scripted
(``ScriptedEngine``) where a tool call is needed, as the untrained tiny model never writes one."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from core.trajectory import ChatRenderer, masked_spans
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, _run

TWO_CALLS = "Sure. " + CALC.format("6*7") + "\n" + CALC.format("1+1")


class StoppingEngine(ScriptedEngine):
    """Scripted turns ended as the engine ends a turn on its stop strings: through the first match, which the reply
    names (``ScriptedEngine`` matches none)."""

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       rid: Any = None) -> Any:
        text, _finish = self.script[0]
        hits = sorted((text.find(s) + len(s), s) for s in sampling_params.get("stop", []) if s in text)
        if hits:
            self.script[0] = (text[: hits[0][0]], "open")
        reply = await super().generate(input_ids, sampling_params, return_logprob, rid)
        if hits:
            reply["meta_info"]["finish_reason"] = {"type": "stop", "matched": hits[0][1]}
        return reply


def test_a_null_optional_field_is_taken_as_absent(tokenizer: Any) -> None:
    """OpenAI takes ``null`` for every optional field (the openai client sends ``n=None`` as ``"n": null``, as do
    frameworks that pass their settings through): ``n``, ``stream`` and the rest answer as if left out, a tool's
    ``parameters`` too (it was a 400): the prompt is that of a function without parameters."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    got: list[Any] = []
    tool = {"type": "function", "function": {"name": "calculator", "description": None, "parameters": None,
                                             "strict": None}}

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        got.append(await client.chat.completions.create(
            model="rollwave", messages=MESSAGES, n=None, stream=None, stream_options=None, stop=None, max_tokens=None,
            logprobs=None, top_logprobs=None, temperature=None, seed=None, tool_choice=None,
            parallel_tool_calls=None, tools=[tool], reasoning_effort=None))  # type: ignore[arg-type,list-item]

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    choice = got[0].choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", "The answer is 42.")
    assert (sample.num_turns, sample.reward) == (1, 1.0)
    no_parameters = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    assert engine.calls[0]["input_ids"] == ChatRenderer(tokenizer).prompt_ids(MESSAGES, no_parameters)


def test_a_malformed_field_is_a_400_naming_it_not_a_crash(tokenizer: Any) -> None:
    """A named ``tool_choice`` whose ``function`` is not an object, or a ``stream_options`` that is not one, is a 400
    naming the field before anything is generated (they were a 500, and a stream cut off after its first bytes)."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    refused: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        create = client.chat.completions.create
        for call in (create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                            tool_choice={"type": "function", "function": "calculator"}),  # type: ignore[typeddict-item]
                     create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                            tool_choice={"type": "function"}),  # type: ignore[typeddict-item]
                     create(model="rollwave", messages=MESSAGES, stream=True,
                            stream_options="usage")):  # type: ignore[arg-type]
            with pytest.raises(openai.BadRequestError) as info:
                await call
            refused.append(info.value)
        assert ep.builder is None and engine.calls == []
        await create(model="rollwave", messages=MESSAGES, tools=TOOLS)

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [e.body["param"] for e in refused] == ["tool_choice", "tool_choice", "stream_options"]
    assert all(e.body["message"].startswith(e.body["param"] + ": ") for e in refused), [e.body for e in refused]
    assert refused[0].body["message"] == 'tool_choice: expected "none", "auto", "required" or ' \
                                         '{"type": "function", "function": {"name": ...}}'
    assert (sample.num_turns, sample.reward) == (1, 1.0)


# vLLM's and SGLang's extensions an agent written for them sends as extra_body: another prompt, a turn past its end
# token, constrained generation
EXTENSIONS: list[dict[str, Any]] = [
    {"chat_template": "{{ messages }}"}, {"chat_template_kwargs": {"enable_thinking": False}}, {"ignore_eos": True},
    {"guided_json": {"type": "object"}}, {"guided_regex": "[0-9]+"}, {"guided_choice": ["a", "b"]},
    {"guided_grammar": "root ::= 'a'"}, {"structured_outputs": {"json": {"type": "object"}}}, {"regex": "[0-9]+"},
    {"ebnf": "root ::= 'a'"}]


def test_a_request_for_output_the_endpoint_cannot_give_is_refused_naming_the_field(tokenizer: Any) -> None:
    """The legacy ``functions``/``function_call``, audio output, ``web_search_options``, ``moderation``,
    ``reasoning_effort``, ``verbosity`` and the engines' extensions that change the prompt or constrain generation
    were ignored: the agent got a call written as content (finish ``stop``), no audio, no search, no moderation, the
    default reasoning, unconstrained text. Each is now a 400 naming it, counted, with nothing generated, as is
    ``min_tokens`` (a sampling value). ``modalities=["text"]``, the extensions' defaults and the fields that change
    nothing the agent gets (``prediction``, ``service_tier``, ``store``, ...) are answered."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    refused: list[openai.BadRequestError] = []
    asks: list[dict[str, Any]] = [
        {"functions": [TOOLS[0]["function"]]}, {"function_call": "auto"}, {"modalities": ["text", "audio"]},
        {"modalities": 5}, {"audio": {"voice": "alloy", "format": "wav"}}, {"web_search_options": {}},
        {"moderation": {"model": "omni-moderation-latest"}}, {"reasoning_effort": "low"}, {"verbosity": "low"},
        *({"extra_body": ask} for ask in EXTENSIONS)]

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for ask in [*asks, {"extra_body": {"min_tokens": 5}}]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="rollwave", messages=MESSAGES, **ask)
            refused.append(info.value)
        assert ep.builder is None and engine.calls == []
        await client.chat.completions.create(
            model="rollwave", messages=MESSAGES, modalities=["text"], response_format={"type": "text"},
            prediction={"type": "content", "content": "42"}, service_tier="auto", store=True, metadata={"k": "v"},
            user="u", extra_body={"chat_template_kwargs": {}, "ignore_eos": False, "min_tokens": 0})

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    *unsupported, min_tokens = refused
    for ask, error in zip(asks, unsupported, strict=True):
        name = next(iter(ask.get("extra_body", ask)))
        assert (error.status_code, error.code, error.body["param"]) == (400, "unsupported_parameter", name)
        assert error.body["message"].startswith(f"{name} is not supported: "), error.body["message"]
    assert (min_tokens.code, min_tokens.body["param"]) == ("unsupported_value", "min_tokens")
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="unsupported_parameter") == len(asks)
    assert (sample.num_turns, sample.reward) == (1, 1.0)


def test_parallel_tool_calls_false_ends_the_turn_after_the_first_call(tokenizer: Any) -> None:
    """``parallel_tool_calls=false`` answers at most one call, as OpenAI's: the call's closing tag is a stop string
    (after the agent's own, which alone are cut from the content), so the turn ends after the first call. Its tokens
    through the tag are the policy's, the end token after them a template token, and the re-sent history matches.
    Left out, both calls the model writes come back."""
    renderer = ChatRenderer(tokenizer)
    engine = StoppingEngine(tokenizer, [(TWO_CALLS, "stop"), ("The answer is 42.", "stop"), (TWO_CALLS, "stop")])
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        for _ in range(2):
            reply = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS,
                                                         parallel_tool_calls=False, stop=["Observation:"])
            replies.append(reply)
            messages.append(reply.choices[0].message)  # as agents do: the client sends it as it came
            for call in reply.choices[0].message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=96)
    assert [c["sampling_params"]["stop"] for c in engine.calls] == [["Observation:", "</tool_call>"]] * 2
    first, second = (r.choices[0] for r in replies)
    assert (first.finish_reason, first.message.content, len(first.message.tool_calls)) == ("tool_calls", "Sure.", 1)
    assert first.message.tool_calls[0].function.arguments == '{"expression": "6*7"}'
    assert (second.finish_reason, second.message.content) == ("stop", "The answer is 42.")

    out1 = tokenizer.encode("Sure. " + CALC.format("6*7"), add_special_tokens=False)
    delta = [renderer.eos_id, *renderer.turn_end_suffix, *renderer.tool_turn_ids([{"role": "tool", "content": "42"}])]
    out2 = [*tokenizer.encode("The answer is 42.", add_special_tokens=False), renderer.eos_id]
    prompt = renderer.prompt_ids(MESSAGES, TOOLS)
    assert sample.token_ids.tolist() == prompt + out1 + delta + out2
    n1 = len(prompt) + len(out1)
    assert masked_spans(sample.loss_mask) == [(0, len(prompt), 0), (len(prompt), n1, 1), (n1, n1 + len(delta), 0),
                                              (n1 + len(delta), len(sample.token_ids), 1)]
    assert (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 2, 1.0)
    assert [t.name for t in sample.tool_calls] == ["calculator"]
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0

    parallel: list[Any] = []

    async def default(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        parallel.append(await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS))

    engine = StoppingEngine(tokenizer, [(TWO_CALLS, "stop")])
    _run(tokenizer, engine, default, max_new_tokens=96)
    assert "stop" not in engine.calls[0]["sampling_params"]
    assert [c.function.arguments for c in parallel[0].choices[0].message.tool_calls] == [
        '{"expression": "6*7"}', '{"expression": "1+1"}']


def test_the_closing_tag_counts_against_the_stop_limit(tokenizer: Any) -> None:
    """The engines take at most 32 stop strings: 32 of the agent's are sent, but with ``parallel_tool_calls=false``
    (one more, the call's closing tag) they are a 400 naming ``stop``, before anything is generated or recorded."""
    engine = StoppingEngine(tokenizer, [("The answer is 42.", "stop")])
    stops = [f"<stop {i}>" for i in range(32)]

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS, stop=stops,
                                                 parallel_tool_calls=False)
        assert info.value.body["param"] == "stop" and "parallel_tool_calls" in info.value.body["message"]
        assert ep.builder is None and engine.calls == []
        await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS, stop=stops)

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert engine.calls[0]["sampling_params"]["stop"] == stops
    assert sample.num_turns == 1


def test_the_plain_base_url_serves_the_models_too(tokenizer: Any) -> None:
    """An agent on the plain ``/v1`` base URL with the ``X-Episode-Id`` header can list and retrieve the model, as
    on the episode's URL (it got FastAPI's bare 404), behind the same key check."""
    engine = ScriptedEngine(tokenizer, [])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for key in (ep.key, "wrong"):
            plain = openai.AsyncOpenAI(base_url=f"{store.url}/v1", api_key=key, max_retries=0, timeout=60,
                                       default_headers={"X-Episode-Id": ep.episode_id})
            try:
                if key == ep.key:
                    assert [m.id async for m in plain.models.list()] == ["rollwave"]
                    assert (await plain.models.retrieve("rollwave")).id == "rollwave"
                    with pytest.raises(openai.NotFoundError) as info:
                        await plain.models.retrieve("gpt-4o")
                    assert info.value.code == "model_not_found"
                else:
                    with pytest.raises(openai.AuthenticationError):
                        await plain.models.list()
            finally:
                await plain.close()

    _run(tokenizer, engine, agent)


def test_a_url_it_does_not_serve_is_an_openai_shaped_error(tokenizer: Any) -> None:
    """``/v1/completions``, ``/v1/embeddings`` or a GET of chat/completions answer OpenAI's error body (``code``
    ``unknown_url``, a message naming the method and path and what is served, no retry), counted; FastAPI's bare
    ``{"detail": "Not Found"}`` left the client's ``code`` and ``body["message"]`` empty."""
    engine = ScriptedEngine(tokenizer, [])
    errors: list[openai.APIStatusError] = []
    answers: list[httpx.Response] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for call in (client.completions.create(model="rollwave", prompt="hi"),
                     client.embeddings.create(model="rollwave", input="hi")):
            with pytest.raises(openai.NotFoundError) as info:
                await call
            errors.append(info.value)
        async with httpx.AsyncClient(timeout=30) as http:
            answers.append(await http.get(f"{store.base_url(ep)}/chat/completions",
                                          headers={"Authorization": f"Bearer {ep.key}"}))

    _sample, store = _run(tokenizer, engine, agent)
    for error, path in zip(errors, ("completions", "embeddings"), strict=True):
        assert error.code == "unknown_url" and error.body["type"] == "invalid_request_error"
        assert error.body["message"].startswith("Invalid URL (POST /episodes/"), error.body["message"]
        assert f"/v1/{path}): Not Found" in error.body["message"]
        assert error.response.headers["x-should-retry"] == "false"
    (get,) = answers
    assert get.status_code == 405 and get.json()["error"]["code"] == "unknown_url", get.text
    assert get.json()["error"]["message"].startswith("Invalid URL (GET /episodes/")
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="unknown_url") == 3
    assert engine.calls == []


def test_a_streamed_turn_of_calls_only_accumulates_to_the_plain_answer(tokenizer: Any) -> None:
    """A streamed turn that is only a call opens with ``content: null``, as OpenAI's: the client's stream helper
    accumulates it to the message a plain request answers (content ``None``, not ``""``), and, re-sent, it continues
    the episode."""
    engine = ScriptedEngine(tokenizer, [(CALC.format("6*7"), "stop"), (CALC.format("6*7"), "stop"),
                                        ("The answer is 42.", "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        for _ in range(2):
            async with client.chat.completions.stream(model="rollwave", messages=messages, tools=TOOLS) as stream:
                message = (await stream.get_final_completion()).choices[0].message
            got.append(message)
            messages.append(message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"})
        plain = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        got.append(plain.choices[0].message)

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [(m.content, [c.function.name for c in m.tool_calls or []]) for m in got] == [
        (None, ["calculator"]), (None, ["calculator"]), ("The answer is 42.", [])]
    assert (sample.num_turns, sample.reward) == (3, 1.0)
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


class UncheckedReplyEngine(ScriptedEngine):
    """Replies whose ``finish_reason`` is a bare string (older servers' shape), which no check of ours reads: the
    endpoint fails on it where nothing expects a failure."""

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       rid: Any = None) -> Any:
        reply = await super().generate(input_ids, sampling_params, return_logprob, rid)
        reply["meta_info"]["finish_reason"] = "stop"
        return reply


def test_an_unexpected_failure_is_an_openai_shaped_500_that_ends_the_episode(tokenizer: Any) -> None:
    """An exception nothing expects was Starlette's plain-text 500, which the openai client retries onto an episode
    it may have half-updated. It is a 500 in OpenAI's shape naming the error, told not to be retried and counted;
    the episode ends failed (never trained), so a later request gets 409."""
    engine = UncheckedReplyEngine(tokenizer, [("The answer is 42.", "stop"), ("The answer is 42.", "stop")])
    errors: list[openai.APIStatusError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model="rollwave", messages=MESSAGES)
            errors.append(info.value)

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    first, second = errors
    assert (first.status_code, first.body["type"], first.body["code"]) == (500, "server_error", "internal_error")
    assert first.body["message"].startswith("internal error: AttributeError: "), first.body["message"]
    assert first.response.headers["x-should-retry"] == "false"
    assert (second.status_code, second.body["code"]) == (409, "episode_closed")
    assert len(engine.calls) == 1
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="internal_error") == 1
    assert sample.reward == 0.0 and sample.reward_info["error"].startswith("internal error: AttributeError")
