"""A task whose prompt leaves no room to generate within ``rollout.max_total_tokens`` is bad input: the in-process
``RolloutWorker`` (real Redis, the real embedded engine with the tiny model, the real episode endpoint and agent
runner) dead-letters it at once with an error naming the task, the prompt's tokens and the limit, counts it, and
writes nothing for it, while a task that fits beside it is rolled out and written as usual."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import openai
import pytest
from buffer_helpers import client
from worker_helpers import serve_until

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, RolloutConfig
from core.jobs import JobSpec, TaskSource
from core.tasks import Task, load_tasks
from core.tasks.arith import CALCULATOR_SCHEMA
from core.trajectory import ChatRenderer
from rollout_server.engine_client import EngineClient
from rollout_server.metrics import RolloutMetrics
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker
from tests.test_agent_loop import ScriptedEngine
from tests.test_openai_api import MESSAGES, TOOLS, _run

KEYS = Keys("pb")
CALC_AGENT = "rollout_server.agents.calculator_agent:run"
DEAD = "rollwave_rollout_tasks_dead_lettered_total"
NORMAL = load_tasks("arith", split="train", limit=1)[0]


def padded(task_id: str, words: int) -> Task:
    """The arith task with ``words`` more words in its question."""
    system, user = NORMAL.messages
    question = {**user, "content": user["content"] + " Please." * words}
    return NORMAL.model_copy(update={"task_id": task_id, "messages": [system, question]})


def error(group_id: str, prompt_tokens: int, limit: int) -> str:
    return (f"task {group_id}: its prompt is {prompt_tokens} tokens, which leaves no room to generate a token within "
            f"rollout.max_total_tokens ({limit})")


def roll_out(server: EmbeddedRedis, rollout: RolloutConfig, engine_url: str, tokenizer: Any,
             done: Callable[[], bool]) -> RolloutMetrics:
    """An in-process worker (its episode endpoint on 127.0.0.1) serves until ``done``, then stops."""
    metrics = RolloutMetrics()
    engine = EngineClient(engine_url)
    worker = RolloutWorker(client(server), KEYS.run, rollout, BufferConfig(), [engine], tokenizer,
                           ToolRegistry.builtin(), metrics)

    async def run() -> None:
        async with worker.episodes.serving("127.0.0.1", 0):
            await serve_until(worker, done, "the job was done")

    asyncio.run(run())
    return metrics


def dead_letters(server: EmbeddedRedis) -> dict[str, tuple[str, str]]:
    """gid -> (deliveries, error) of every dead letter."""
    return {f[b"gid"].decode(): (f[b"deliveries"].decode(), f[b"error"].decode())
            for _, f in client(server).xrange(KEYS.tasks_dead)}


def test_a_prompt_without_room_to_generate_dead_letters_its_task_and_the_rest_trains(
    redis_server: EmbeddedRedis, engine_url: str, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two bad tasks beside a good one, under a small ``max_total_tokens``: one whose prompt is exactly the limit
    (it fits, with no room for a token) and one past it. Each is dead-lettered on its first delivery (not rolled
    out again: ``buffer.max_attempts`` is 3) and counted; no sample of them reaches the buffer as a
    ``max_total_tokens`` episode with reward 0."""
    renderer, tools = ChatRenderer(tokenizer), ToolRegistry.builtin()
    full, over = padded("full", 20), padded("over", 60)

    def prompt_tokens(task: Task) -> int:
        return len(renderer.prompt_ids(task.messages, tools.schemas(task.tools)))

    limit = prompt_tokens(full)
    assert prompt_tokens(NORMAL) + 8 < limit < prompt_tokens(over)
    queue = TaskQueue(client(redis_server), KEYS, BufferConfig())
    queue.ensure_groups()
    gids = queue.submit("job", [t.model_dump(mode="json") for t in (over, NORMAL, full)], "train")
    rollout = RolloutConfig(n_samples=2, max_new_tokens=8, max_turns=1, max_total_tokens=limit)
    with caplog.at_level(logging.WARNING, logger="buffer.task_queue"):
        metrics = roll_out(redis_server, rollout, engine_url, tokenizer, lambda: queue.job("job")["state"] == "done")

    assert dead_letters(redis_server) == {
        gids[0]: ("1", error(gids[0], prompt_tokens(over), limit)),
        gids[2]: ("1", error(gids[2], limit, limit)),
    }
    assert error(gids[0], prompt_tokens(over), limit) in caplog.text
    job = queue.job("job")
    assert (job["completed"], job["dead_lettered"]) == ("1", "2")
    [(_, group)] = ReplayBuffer(client(redis_server), KEYS, BufferConfig()).take(2, 1)
    assert group.group_id == gids[1] and len(group.samples) == 2
    assert all(s.finish_reason in ("stop", "length") and s.num_generated > 0 for s in group.samples)
    value = metrics.registry.get_sample_value
    assert value(DEAD, {"reason": "prompt_too_long"}) == 2
    assert value("rollwave_rollout_finish_reasons_total", {"reason": "max_total_tokens"}) is None


def test_a_group_longer_than_redis_takes_dead_letters_its_task_at_once(
    redis_server: EmbeddedRedis, engine_url: str, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose encoded payload is longer than Redis takes in one argument (proto-max-bulk-len, 512 MiB; a
    limit of 1 KB stands in for it here) is refused before anything is sent (``GroupTooLarge``): the worker dead-letters
    its task on its first delivery, naming the group and its size, and counts it, where it was rolled out again for
    every attempt, each making a group as long (and, before the refusal, retried the put for ever)."""
    monkeypatch.setattr(ReplayBuffer, "max_payload_bytes", 1024)
    queue = TaskQueue(client(redis_server), KEYS, BufferConfig())
    queue.ensure_groups()
    [gid] = queue.submit("job", [NORMAL.model_dump(mode="json")], "train")
    rollout = RolloutConfig(n_samples=2, max_new_tokens=8, max_turns=1)
    metrics = roll_out(redis_server, rollout, engine_url, tokenizer, lambda: queue.job("job")["state"] == "done")
    [(deliveries, why)] = dead_letters(redis_server).values()
    assert deliveries == "1" and why.startswith(f"group {gid} (job job): encoded payload is "), why
    assert metrics.registry.get_sample_value(DEAD, {"reason": "group_too_large"}) == 1
    assert queue.job("job")["dead_lettered"] == "1"


def test_an_agent_whose_first_request_does_not_fit_dead_letters_its_task(
    redis_server: EmbeddedRedis, engine_url: str, tokenizer: Any
) -> None:
    """An agent job: the agent's first request past the context is answered 400 ``context_length_exceeded`` (as
    SGLang and OpenAI answer it), its episode ends ``prompt_too_long``, and the task is dead-lettered as the
    built-in loop's; the agent's other task is written."""
    over = padded("over", 60)
    prompt_tokens = len(ChatRenderer(tokenizer).prompt_ids(over.messages, [CALCULATOR_SCHEMA]))
    limit = prompt_tokens - 10
    queue = TaskQueue(client(redis_server), KEYS, BufferConfig())
    queue.ensure_groups()
    spec = JobSpec(source=TaskSource(kind="arith", limit=2), agent=CALC_AGENT)
    gids = queue.submit("agent", [t.model_dump(mode="json") for t in (over, NORMAL)], "train",
                        spec.model_dump_json())
    rollout = RolloutConfig(n_samples=2, max_new_tokens=8, max_total_tokens=limit, agent_allowlist=[CALC_AGENT])
    metrics = roll_out(redis_server, rollout, engine_url, tokenizer, lambda: queue.job("agent")["state"] == "done")

    assert dead_letters(redis_server) == {gids[0]: ("1", error(gids[0], prompt_tokens, limit))}
    [(_, group)] = ReplayBuffer(client(redis_server), KEYS, BufferConfig()).take(2, 1)
    assert group.group_id == gids[1] and len(group.samples) == 2
    value = metrics.registry.get_sample_value
    assert value(DEAD, {"reason": "prompt_too_long"}) == 1
    assert value("rollwave_rollout_failed_total", {"reason": "prompt_too_long"}) == 2  # its two episodes
    assert value("rollwave_rollout_openai_requests_total", {"outcome": "context_length_exceeded"}) == 2


def test_the_endpoint_refuses_a_first_request_past_the_context_and_ends_the_episode(tokenizer: Any) -> None:
    """The 400 carries OpenAI's message; the episode is over (a later request gets 409, naming the error), and
    its sample is ``prompt_too_long`` with the error naming the task, the prompt's tokens and the limit."""
    task = Task(task_id="t-long", messages=MESSAGES, reward={"kind": "gsm8k", "ground_truth": "42"})
    prompt_tokens = len(ChatRenderer(tokenizer).prompt_ids(MESSAGES, TOOLS))
    replies: list[openai.APIStatusError] = []

    async def agent(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        for messages in (MESSAGES, MESSAGES[1:]):
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model="rollwave", messages=messages, tools=TOOLS)
            replies.append(info.value)

    sample, store = _run(tokenizer, ScriptedEngine(tokenizer, []), agent, task=task, max_total_tokens=prompt_tokens)
    first, second = replies
    assert (first.status_code, first.code) == (400, "context_length_exceeded")
    assert first.body["message"] == (f"This model's maximum context length is {prompt_tokens} tokens. However, your "
                                     f"messages resulted in {prompt_tokens} tokens.")
    message = error("t-long", prompt_tokens, prompt_tokens)
    assert (second.status_code, second.code) == (409, "episode_closed") and message in second.body["message"]
    assert (sample.finish_reason, sample.reward, sample.reward_info) == ("prompt_too_long", 0.0, {"error": message})
    assert store.metrics.total("rollwave_rollout_failed_total", reason="prompt_too_long") == 1
