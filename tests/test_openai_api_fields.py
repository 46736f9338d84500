"""The episode endpoint's OpenAI compatibility, driven by the real ``openai`` client: ``stop``,
``logprobs``, ``tool_choice``, and the shape of refusals of bodies that are not a chat request at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from core.tiny_model import CHAT_TEMPLATE
from core.trajectory import ChatRenderer
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, RecordingEngine, _run


def _generated(sample: Any) -> list[int]:
    return [t for t, m in zip(sample.token_ids.tolist(), sample.loss_mask.tolist(), strict=True) if m]


def test_stop_sequences_end_the_turn_and_are_trimmed(tokenizer: Any, engine_url: str) -> None:
    """``stop`` (a list, or a string) reaches the engine: the turn ends at the first match with finish_reason
    ``stop``, the content stops before it (as OpenAI's does), the recorded tokens are exactly those the engine
    generated, and the agent's next turn (its history re-sent with the trimmed content) continues the episode."""
    stops = ["a", "e", "i", "o"]
    seen: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES, stop=stops)
        messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go on"}]
        second = await client.chat.completions.create(model="rollwave", messages=messages, stop="e")
        seen[:] = [first.choices[0], second.choices[0]]

    for _ in range(10):  # at temperature 1 the tiny model may end its turn before any of them comes
        real = RecordingEngine(engine_url)
        sample, store = _run(tokenizer, real, agent, max_new_tokens=64)
        matched = real.replies[0]["meta_info"]["finish_reason"].get("matched")
        if isinstance(matched, str):
            break
    assert matched in stops, real.replies[0]["meta_info"]["finish_reason"]
    text = tokenizer.decode(real.replies[0]["output_ids"], skip_special_tokens=False)
    assert (seen[0].finish_reason, seen[0].message.content) == ("stop", text[: text.find(matched)])
    assert "e" not in (seen[1].message.content or "")
    assert _generated(sample) == [t for r in real.replies for t in r["output_ids"]]
    assert sample.num_turns == 2 and sample.finish_reason != "history_mismatch"
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_a_stop_sequence_after_a_tool_call_still_yields_the_call(tokenizer: Any) -> None:
    """A turn ended by a stop sequence is finished, not cut off: its tool call is parsed."""
    engine = ScriptedEngine(tokenizer, [("Let me compute. " + CALC.format("6*7") + "\nObservation", "open")])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                     stop="Observation")
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "calculator"

    # the scripted engine does not match stop strings: it answers as the engine would for this stop
    original = engine.generate

    async def generate(input_ids: list[int], sampling_params: dict, *args: Any, **kwargs: Any) -> Any:
        assert sampling_params["stop"] == ["Observation"]
        reply = await original(input_ids, sampling_params, *args, **kwargs)
        reply["meta_info"]["finish_reason"] = {"type": "stop", "matched": "Observation"}
        return reply

    engine.generate = generate  # type: ignore[method-assign]
    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [t.name for t in sample.tool_calls] == ["calculator"]


def test_logprobs_are_the_behaviour_logprobs(tokenizer: Any, engine_url: str) -> None:
    """``logprobs=True`` answers ``choices[0].logprobs.content``: one entry per generated token (its end token
    excepted), each the engine's behaviour logprob, streamed or not; ``top_logprobs`` above 0, which the engines
    are not asked for, is refused (400 naming it) and records nothing."""
    real = RecordingEngine(engine_url)
    got: list[list[Any]] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=MESSAGES, logprobs=True, top_logprobs=2)
        assert info.value.body["param"] == "top_logprobs" and "top_logprobs" in info.value.body["message"]
        assert ep.builder is None and real.replies == []
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES, logprobs=True)
        assert first.choices[0].logprobs is not None
        got.append(first.choices[0].logprobs.content)
        messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go on"}]
        stream = await client.chat.completions.create(model="rollwave", messages=messages, logprobs=True,
                                                      stream=True)
        entries: list[Any] = []
        parts: list[str] = []
        async for chunk in stream:
            for choice in chunk.choices:
                entries += (choice.logprobs.content or []) if choice.logprobs else []
                parts.append(choice.delta.content or "")
        got.append(entries)
        plain = await client.chat.completions.create(model="rollwave", messages=[
            *messages, {"role": "assistant", "content": "".join(parts)}, {"role": "user", "content": "more"}])
        assert plain.choices[0].logprobs is None

    _run(tokenizer, real, agent, max_new_tokens=16)
    eos = tokenizer.eos_token_id
    for entries, reply in zip(got, real.replies, strict=False):
        lps = [e for e in reply["meta_info"]["output_token_logprobs"] if e[1] != eos]
        assert [e.logprob for e in entries] == pytest.approx([e[0] for e in lps])
        assert [e.token for e in entries] == [tokenizer.decode([e[1]]) for e in lps]
        assert all(e.top_logprobs == [] for e in entries)


def test_a_body_that_is_not_a_chat_request_is_refused_plainly(tokenizer: Any) -> None:
    """Invalid JSON and a body that is not an object are 400s whose message says so and whose ``param`` is
    null; an invalid ``tool_choice`` names ``tool_choice``, not pydantic's union branch."""
    engine = ScriptedEngine(tokenizer, [])
    answers: list[tuple[int, dict[str, Any]]] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        url = store.base_url(ep) + "/chat/completions"
        headers = {"Authorization": f"Bearer {ep.key}", "Content-Type": "application/json"}
        async with httpx.AsyncClient() as http:
            for body in ('{"model": "rollwave", "messages": [', '[]'):
                resp = await http.post(url, content=body, headers=headers)
                answers.append((resp.status_code, resp.json()["error"]))
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="sometimes")  # type: ignore[arg-type]
        answers.append((info.value.status_code, info.value.body))

    _run(tokenizer, engine, agent)
    (s1, invalid), (s2, not_object), (s3, choice) = answers
    assert (s1, s2, s3) == (400, 400, 400)
    assert invalid["param"] is None and invalid["message"].startswith("the body is not valid JSON"), invalid
    assert not_object["param"] is None and not_object["message"].startswith("the body must be a JSON object")
    assert choice["param"] == "tool_choice" and choice["message"].startswith("tool_choice: "), choice
    assert engine.calls == []


def test_a_developer_message_is_rendered_as_a_system_message(tokenizer: Any, engine_url: str) -> None:
    """``developer`` (the openai client's newer name for ``system``) is accepted, and the prompt it makes is the
    one a system message makes: chat templates know only ``system``."""
    prompts: list[list[int]] = []

    class Prompts(RecordingEngine):
        async def generate(self, input_ids: list[int], *args: Any, **kwargs: Any) -> Any:
            prompts.append(list(input_ids))
            return await super().generate(input_ids, *args, **kwargs)

    for role in ("system", "developer"):
        messages = [{"role": role, "content": MESSAGES[0]["content"]}, MESSAGES[1]]

        async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore,
                        messages: list[dict[str, str]] = messages) -> None:
            await client.chat.completions.create(model="rollwave", messages=messages)

        _run(tokenizer, Prompts(engine_url), agent, max_new_tokens=4)
    assert len(prompts) == 2 and prompts[0] == prompts[1]
    assert MESSAGES[0]["content"] in tokenizer.decode(prompts[1])


def test_the_key_is_checked_before_the_body_and_the_model_can_be_retrieved(tokenizer: Any) -> None:
    """A caller without the episode's key gets 401 (an unknown episode 404) whatever its body, never a 400 that
    describes a valid one; ``client.models.retrieve`` answers the served model and a 404 for any other."""
    engine = ScriptedEngine(tokenizer, [])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        base = store.base_url(ep)
        async with httpx.AsyncClient(timeout=30) as http:
            for url, key, status in ((base, "wrong", 401), (base.replace(ep.episode_id, "nope"), ep.key, 404),
                                     (base, ep.key, 400)):
                reply = await http.post(f"{url}/chat/completions", json={"messages": 3},
                                        headers={"Authorization": f"Bearer {key}"})
                assert reply.status_code == status, (url, key, reply.text)
            reply = await http.post(f"{store.url}/v1/chat/completions", json={"messages": 3},
                                    headers={"Authorization": "Bearer wrong", "X-Episode-Id": ep.episode_id})
            assert reply.status_code == 401, reply.text
        assert (await client.models.retrieve("rollwave")).id == "rollwave"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")

    _run(tokenizer, engine, agent)


def test_a_turn_ended_by_the_models_other_stop_token_is_finished_without_it(tokenizer: Any) -> None:
    """The engine stops on every end token the model declares (Qwen: ``<|endoftext|>`` beside ``<|im_end|>``): a
    turn ended by the other one is finished as the built-in loop finishes it, its tool call parsed, and the token
    is no part of the content (it was, literally, and the call was lost in it)."""
    engine = ScriptedEngine(tokenizer, [("Let me compute. " + CALC.format("6*7"), "endoftext"), ("42", "endoftext")])

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS)
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me compute.")
        assert choice.message.tool_calls[0].function.name == "calculator"
        messages = [*MESSAGES, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "42"}]
        reply = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == ("stop", "42")

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [t.name for t in sample.tool_calls] == ["calculator"]
    assert (sample.finish_reason, sample.num_turns) == ("stop", 2)


NAMED = {"type": "function", "function": {"name": "calculator"}}
OPENING = "<tool_call>\n"  # what the chat template writes before a call's JSON
NAMED_OPENING = OPENING + '{"name": "calculator", "arguments":'


def test_required_and_named_tool_choice_prefill_the_call_opening(tokenizer: Any) -> None:
    """``required`` and a named function make the turn a call: the template's call opening (through the name for a
    named one) is prefilled after the assistant header, so the engine continues from it; the agent gets OpenAI's
    tool_calls, and the episode records the forced tokens as template tokens (loss_mask 0, behaviour logprob 0,
    prompt tokens in ``usage``) and only the engine's as the policy's; re-sent, the history matches."""
    renderer = ChatRenderer(tokenizer)
    body = '{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [(body, "stop"), (' {"expression": "42*1"}}\n</tool_call>', "stop"),
                                        ("The answer is 42.", "stop")])
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        messages: list[Any] = list(MESSAGES)
        for choice in ("required", NAMED, "auto"):
            reply = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS,
                                                         tool_choice=choice)  # type: ignore[arg-type]
            replies.append(reply)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert [r.choices[0].finish_reason for r in replies] == ["tool_calls", "tool_calls", "stop"]
    assert [json.loads(r.choices[0].message.tool_calls[0].function.arguments) for r in replies[:2]] == [
        {"expression": "6*7"}, {"expression": "42*1"}]
    assert all(r.choices[0].message.tool_calls[0].function.name == "calculator" for r in replies[:2])
    assert replies[0].choices[0].message.content is None

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = renderer.prompt_ids(MESSAGES, TOOLS)
    forced1, forced2 = ids(OPENING), ids(NAMED_OPENING)
    out1, out2, out3 = ([*ids(t), renderer.eos_id] for t in (body, ' {"expression": "42*1"}}\n</tool_call>',
                                                             "The answer is 42."))
    delta = renderer.turn_end_suffix + renderer.tool_turn_ids([{"role": "tool", "content": "42"}])
    assert engine.calls[0]["input_ids"] == prompt + forced1
    assert engine.calls[1]["input_ids"] == prompt + forced1 + out1 + delta + forced2
    assert sample.token_ids.tolist() == prompt + forced1 + out1 + delta + forced2 + out2 + delta + out3
    mask = [0] * len(prompt + forced1) + [1] * len(out1) + [0] * len(delta + forced2) + [1] * len(out2) + \
        [0] * len(delta) + [1] * len(out3)
    assert sample.loss_mask.tolist() == mask
    assert sample.behaviour_logprobs.tolist() == [-0.5 if m else 0.0 for m in mask]
    assert replies[0].usage.prompt_tokens == len(prompt + forced1)
    assert replies[0].usage.completion_tokens == len(out1)
    assert (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 3, 1.0)
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_a_forced_call_opening_is_what_the_real_engine_continues(tokenizer: Any, engine_url: str) -> None:
    """With the real engine, a named tool_choice's turn is the prefilled opening (not trained) followed by exactly the
    engine's output ids and behaviour logprobs; its text, a call or not, starts with the opening."""
    real = RecordingEngine(engine_url)
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice=NAMED)  # type: ignore[arg-type]
        got.append(reply.choices[0])

    sample, _ = _run(tokenizer, real, agent, max_new_tokens=16)
    forced = tokenizer.encode(NAMED_OPENING, add_special_tokens=False)
    start = sample.prompt_len
    turn = sample.token_ids.tolist()[start:]
    out = real.replies[0]["output_ids"]
    assert turn == forced + out
    assert sample.loss_mask.tolist()[start:] == [0] * len(forced) + [1] * len(out)
    assert sample.behaviour_logprobs.tolist()[start:] == pytest.approx(
        [0.0] * len(forced) + [e[0] for e in real.replies[0]["meta_info"]["output_token_logprobs"]])
    message = got[0].message
    if message.tool_calls:
        assert message.tool_calls[0].function.name == "calculator"
    else:
        assert (message.content or "").startswith(NAMED_OPENING)


def test_tool_choice_none_returns_a_call_the_model_writes_as_content(tokenizer: Any) -> None:
    """With ``none`` nothing is prefilled nor parsed, and the prompt leaves the tools out, as SGLang renders it: a call
    the model writes anyway comes back verbatim as content (finish ``stop``), as vLLM and SGLang answer it, and is no
    tool call of the episode."""
    engine = ScriptedEngine(tokenizer, [(CALC.format("6*7"), "stop")])
    got: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice="none")
        got.append(reply.choices[0])

    sample, _ = _run(tokenizer, engine, agent, max_new_tokens=64)
    assert (got[0].finish_reason, got[0].message.content, got[0].message.tool_calls) == (
        "stop", CALC.format("6*7"), None)
    assert engine.calls[0]["input_ids"] == ChatRenderer(tokenizer).prompt_ids(MESSAGES, None)
    assert sample.tool_calls == []


def test_a_tool_choice_the_template_cannot_prefill_is_refused(tiny_model_dir: Path) -> None:
    """A chat template that writes a call otherwise than the parser reads it (here without the newline after the tag)
    makes ``required`` and a named function a 400 naming ``tool_choice`` and its value, counted, with nothing
    recorded; ``auto`` is still answered."""
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.chat_template = CHAT_TEMPLATE.replace('<tool_call>\\n{"name"', '<tool_call>{"name"')
    assert other.chat_template != CHAT_TEMPLATE
    engine = ScriptedEngine(other, [("The answer is 42.", "stop")])
    refused: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for choice in ("required", NAMED):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice=choice)  # type: ignore[arg-type]
            refused.append(info.value)
        assert ep.builder is None and engine.calls == []
        await client.chat.completions.create(model="rollwave", messages=MESSAGES, tools=TOOLS, tool_choice="auto")

    sample, store = _run(other, engine, agent)
    for error, shown in zip(refused, ("tool_choice=required", 'tool_choice={"type": "function"'), strict=True):
        assert (error.status_code, error.code, error.body["param"]) == (400, "unsupported_value", "tool_choice")
        assert error.body["message"].startswith(shown), error.body["message"]
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="unsupported_value") == 2
    assert (sample.num_turns, sample.reward) == (1, 1.0)
