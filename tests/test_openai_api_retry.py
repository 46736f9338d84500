"""Retries against the episode endpoint, driven by the real ``openai`` client (and a plain HTTP client) over
127.0.0.1: a request that repeats the last answered one gets that answer again, never a second generation nor a
history mismatch; an engine failure is not retried into a 409."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import openai
import pytest

from core.trajectory import ChatRenderer
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, _run

WAIT_S = 30.0  # the most a test waits for an event of its own making


class GatedEngine(ScriptedEngine):
    """Scripted turns; the first one is answered only once ``release`` is set (a generation outlasting the client)."""

    def __init__(self, tokenizer: Any, script: list[tuple[str, str]]) -> None:
        super().__init__(tokenizer, script)
        self.release = asyncio.Event()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        if not self.calls:
            await asyncio.wait_for(self.release.wait(), WAIT_S)
        return await super().generate(*args, **kwargs)


class Waits(logging.Handler):
    """Sets ``event`` when the endpoint logs that a request waits for the one in flight."""

    def __init__(self, event: asyncio.Event) -> None:
        super().__init__()
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if "waits for the one in flight" in record.getMessage():
            self.event.set()


@pytest.mark.parametrize("first", ["answered", "generating"])
def test_a_retry_after_a_lost_answer_gets_that_answer(tokenizer: Any, first: str) -> None:
    """The openai client times out while the first attempt generates, and retries (``x-stainless-retry-count: 1``)
    once that attempt is ``answered``, or while it is still ``generating`` (the retry waits for it): the agent gets
    the first attempt's answer, generated once, and its next request continues the episode, whose tokens are those
    of an episode without the retry."""
    engine = GatedEngine(tokenizer, [("Let me compute. " + CALC.format("6*7"), "stop"), ("The answer is 42.", "stop")])
    seen: dict[str, Any] = {}
    logger = logging.getLogger("rollout_server.openai_api")

    async def agent(_client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        waiting = asyncio.Event()
        handler, level = Waits(waiting), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        releases: list[asyncio.Task[None]] = []

        async def release_once_the_retry_waits() -> None:
            await asyncio.wait_for(waiting.wait(), WAIT_S)
            engine.release.set()

        async def on_request(request: httpx.Request) -> None:
            attempt = request.headers["x-stainless-retry-count"]
            seen.setdefault("attempts", []).append(attempt)
            if attempt == "0":
                return
            if first == "answered":
                engine.release.set()
                async with ep.lock:  # the first attempt holds it until it is answered
                    pass
            else:
                releases.append(asyncio.create_task(release_once_the_retry_waits()))

        http = httpx.AsyncClient(event_hooks={"request": [on_request]})
        client = openai.AsyncOpenAI(base_url=store.base_url(ep), api_key=ep.key, max_retries=2, timeout=2.0,
                                    http_client=http)
        try:
            messages: list[Any] = list(MESSAGES)
            reply = await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
            assert ep.last is not None
            seen["reply"], seen["recorded_id"] = reply, ep.last[1].id
            seen["ok"] = store.metrics.total("rollwave_rollout_openai_requests_total", outcome="ok")
            message = reply.choices[0].message
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
            await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            await client.close()
            await asyncio.gather(*releases)
        seen["waited"] = waiting.is_set()

    sample, store = _run(tokenizer, engine, agent, max_new_tokens=64)
    reply = seen["reply"]
    assert seen["attempts"] == ["0", "1", "0"]  # the first request timed out once; its retry was answered
    assert (reply.id, reply.choices[0].finish_reason) == (seen["recorded_id"], "tool_calls")
    assert reply.choices[0].message.tool_calls[0].function.name == "calculator"
    assert seen["ok"] == 1 and seen["waited"] == (first == "generating")
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="replayed") == 1
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0
    assert len(engine.calls) == 2
    renderer = ChatRenderer(tokenizer)
    out1, out2 = (tokenizer.encode(t, add_special_tokens=False) + [renderer.eos_id]
                  for t in ("Let me compute. " + CALC.format("6*7"), "The answer is 42."))
    delta = renderer.turn_end_suffix + renderer.tool_turn_ids([{"role": "tool", "content": "42"}])
    assert sample.token_ids.tolist() == renderer.prompt_ids(MESSAGES, TOOLS) + out1 + delta + out2
    assert (sample.finish_reason, sample.num_turns, sample.reward) == ("stop", 2, 1.0)


def test_a_repeated_request_from_any_client_is_answered_again(tokenizer: Any) -> None:
    """A client that sends no retry header (plain HTTP) and repeats a request, streamed or not, gets the same answer
    (same id, same bytes) without a second generation; the episode goes on as if it had sent it once."""
    engine = ScriptedEngine(tokenizer, [("The answer is 41.", "stop"), ("No, 42.", "stop")])
    answers: list[str] = []

    async def agent(_client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        url = store.base_url(ep) + "/chat/completions"
        headers = {"Authorization": f"Bearer {ep.key}"}
        first = {"model": "rollwave", "messages": MESSAGES}
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            for _ in range(2):
                answers.append((await http.post(url, json=first, headers=headers)).text)
            content = json.loads(answers[0])["choices"][0]["message"]["content"]
            second = {"model": "rollwave", "stream": True, "messages": [
                *MESSAGES, {"role": "assistant", "content": content}, {"role": "user", "content": "Sure?"}]}
            for _ in range(2):
                answers.append((await http.post(url, json=second, headers=headers)).text)

    sample, store = _run(tokenizer, engine, agent)
    assert answers[0] == answers[1] and '"The answer is 41."' in answers[0]
    assert answers[2] == answers[3] and "No, 42." in answers[2] and answers[2].endswith("data: [DONE]\n\n")
    assert len(engine.calls) == 2 and (sample.num_turns, sample.finish_reason, sample.reward) == (2, "stop", 1.0)
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="replayed") == 2
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 0


def test_an_engine_failure_is_not_retried_into_a_conflict(tokenizer: Any) -> None:
    """An engine abort ends the episode, so a retry could only be refused (409): the 503 tells the openai client not
    to retry (``x-should-retry: false``), and the agent, with the client's default retries, sees the abort itself."""
    engine = ScriptedEngine(tokenizer, [("partial", "abort")])
    errors: list[openai.APIStatusError] = []

    async def agent(_client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        client = openai.AsyncOpenAI(base_url=store.base_url(ep), api_key=ep.key, timeout=WAIT_S)  # max_retries=2
        try:
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model="rollwave", messages=MESSAGES)
        finally:
            await client.close()
        errors.append(info.value)

    sample, store = _run(tokenizer, engine, agent)
    error = errors[0]
    assert (error.status_code, error.code, error.response.headers["x-should-retry"]) == (503, "engine_aborted",
                                                                                         "false")
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="episode_closed") == 0
    assert len(engine.calls) == 1 and sample.finish_reason == "abort"


def test_an_openai_client_asking_again_on_purpose_gets_a_new_sample(tokenizer: Any) -> None:
    """The openai client marks a first attempt ``x-stainless-retry-count: 0``: an agent that sends the same request
    again on purpose (a loop until the answer is valid) gets a new sample each time, not the last answer, and its
    episode is an edited history (never trained), as any repeat of a turn it already got."""
    engine = ScriptedEngine(tokenizer, [("bad answer", "stop"), ("still bad", "stop"), ("The answer is 42.", "stop")])
    answers: list[str | None] = []

    async def agent(client: openai.AsyncOpenAI, _ep: AgentEpisode, _store: EpisodeStore) -> None:
        for _ in range(3):
            reply = await client.chat.completions.create(model="rollwave", messages=MESSAGES)
            answers.append(reply.choices[0].message.content)
            if "42" in (answers[-1] or ""):
                break

    sample, store = _run(tokenizer, engine, agent)
    assert answers == ["bad answer", "still bad", "The answer is 42."] and len(engine.calls) == 3
    assert store.metrics.total("rollwave_rollout_openai_requests_total", outcome="replayed") == 0
    assert store.metrics.total("rollwave_rollout_history_mismatches_total") == 1
    assert sample.finish_reason == "history_mismatch"
