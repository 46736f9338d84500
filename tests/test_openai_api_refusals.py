"""What the episode endpoint refuses rather than silently ignores, driven by the real ``openai`` client: sampling
other than the job's (which would train off-policy, or answer the agent with what it did not ask for), a reward
that is not a finite number, and messages the chat template cannot render."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import ScriptedEngine
from tests.test_openai_api import MESSAGES, _run

# (the request's extra arguments, the param and code of the 400): the job samples at temperature 0.7, top_k 5
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"temperature": 0}, "temperature", "unsupported_value"),
    ({"temperature": 1.0}, "temperature", "unsupported_value"),
    ({"top_p": 0.9}, "top_p", "unsupported_value"),
    ({"extra_body": {"top_k": 40}}, "top_k", "unsupported_value"),
    ({"extra_body": {"min_p": 0.1}}, "min_p", "unsupported_value"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value"),
    ({"frequency_penalty": -1}, "frequency_penalty", "unsupported_value"),
    ({"extra_body": {"repetition_penalty": 1.1}}, "repetition_penalty", "unsupported_value"),
    ({"seed": 7}, "seed", "unsupported_parameter"),
    ({"logit_bias": {"17": 5}}, "logit_bias", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
]


def test_sampling_other_than_the_jobs_is_refused_naming_the_field(tokenizer: Any) -> None:
    """Each request asking for other sampling than the job's is a 400 naming the field (and, for the job's own
    settings, the value it samples at), counted, and records nothing; the job's own values, the engine's defaults
    and a text response_format are accepted, and the engine samples at the job's settings."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    refused: list[tuple[dict[str, Any], str, openai.BadRequestError]] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for kwargs, param, _code in REFUSED:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="rollwave", messages=MESSAGES, **kwargs)
            refused.append((kwargs, param, info.value))
        assert ep.builder is None and engine.calls == []
        await client.chat.completions.create(
            model="rollwave", messages=MESSAGES, temperature=0.7, top_p=1, presence_penalty=0, frequency_penalty=0,
            logit_bias={}, response_format={"type": "text"},
            extra_body={"top_k": 5, "min_p": 0, "repetition_penalty": 1})

    sample, store = _run(tokenizer, engine, agent, temperature=0.7, top_k=5)
    for (kwargs, param, code), (_, _, error) in zip(REFUSED, refused, strict=True):
        assert (error.status_code, error.body["param"], error.code) == (400, param, code), kwargs
        assert param in error.body["message"], error.body["message"]
    assert "temperature=0.7" in refused[0][2].body["message"] and "top_k=5" in refused[3][2].body["message"]
    for code in ("unsupported_value", "unsupported_parameter"):
        assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome=code) == sum(
            c == code for _, _, c in REFUSED)
    assert [(c["sampling_params"]["temperature"], c["sampling_params"]["top_k"]) for c in engine.calls] == [(0.7, 5)]
    assert (sample.finish_reason, sample.reward, sample.num_turns) == ("stop", 1.0, 1)


def test_a_reward_that_is_not_finite_is_refused(tokenizer: Any) -> None:
    """A posted reward of NaN or Infinity (JSON as Python writes it) is a 400 naming ``reward``: it would poison
    the group's advantages. The reward function then scores the episode."""
    engine = ScriptedEngine(tokenizer, [("The answer is 42.", "stop")])
    statuses: list[tuple[int, Any]] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        await client.chat.completions.create(model="rollwave", messages=MESSAGES)
        headers = {"Authorization": f"Bearer {ep.key}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(timeout=30) as http:
            for value in ("NaN", "Infinity", "-Infinity"):
                reply = await http.post(f"{store.url}/episodes/{ep.episode_id}/reward",
                                        content=f'{{"reward": {value}}}', headers=headers)
                statuses.append((reply.status_code, reply.json()["error"]["param"]))
        assert ep.reward is None

    sample, _ = _run(tokenizer, engine, agent)
    assert statuses == [(400, "reward")] * 3
    assert sample.reward == 1.0 and sample.reward_info["extracted"] == "42"


def test_messages_the_chat_template_refuses_are_a_400_that_records_nothing(tiny_model_dir: Path) -> None:
    """A chat template that raises on some messages (as many do, e.g. "roles must alternate") answers 400
    ``invalid_messages`` quoting it, not a 500 the client retries: on the first request and on a later one,
    whose episode stays as it was, so the agent can go on without those messages."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{%- for m in messages %}{%- if m.role == 'tool' %}"
                               "{{ raise_exception('this template has no tool role') }}{%- endif %}{%- endfor %}"
                               + tokenizer.chat_template)
    engine = ScriptedEngine(tokenizer, [("Let me see.", "stop"), ("The answer is 42.", "stop")])
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    errors: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=[*MESSAGES, tool])
        errors.append(info.value)
        assert ep.builder is None
        first = await client.chat.completions.create(model="rollwave", messages=MESSAGES)
        history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True)]
        recorded = (len(ep.builder), list(ep.messages))
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="rollwave", messages=[*history, tool])
        errors.append(info.value)
        assert (len(ep.builder), ep.messages) == recorded
        await client.chat.completions.create(model="rollwave", messages=[*history, {"role": "user", "content": "so?"}])

    sample, store = _run(tokenizer, engine, agent)
    for error in errors:
        assert (error.status_code, error.code, error.body["param"]) == (400, "invalid_messages", "messages")
        assert "this template has no tool role" in error.body["message"], error.body["message"]
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="invalid_messages") == 2
    assert (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 2, 1.0)


def test_a_request_waiting_on_an_episode_that_ends_is_refused_not_generated(tokenizer: Any) -> None:
    """A request queued behind another of its episode when the episode ends (its task cancelled) is a 404 naming
    the episode, counted, and never reaches the engine; the request in flight is answered."""
    release, started = asyncio.Event(), asyncio.Event()

    class Held(ScriptedEngine):
        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            started.set()
            await release.wait()
            return await super().generate(*args, **kwargs)

    engine = Held(tokenizer, [("The answer is 42.", "stop"), ("again", "stop")])
    outcomes: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        first = asyncio.create_task(client.chat.completions.create(model="rollwave", messages=MESSAGES))
        await asyncio.wait_for(started.wait(), 30)
        queued = asyncio.create_task(client.chat.completions.create(model="rollwave", messages=MESSAGES))
        await asyncio.sleep(0.5)  # its request waits on the episode's lock
        store.discard(ep)
        release.set()
        outcomes.extend(await asyncio.gather(first, queued, return_exceptions=True))

    _, store = _run(tokenizer, engine, agent)
    answered, refused = outcomes
    assert answered.choices[0].message.content == "The answer is 42."
    assert isinstance(refused, openai.NotFoundError) and refused.code == "episode_not_found", refused
    assert "does not exist or is closed" in refused.body["message"]
    assert len(engine.calls) == 1
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="episode_not_found") == 1
