"""Per-job overrides (``core.jobs.JobSpec``) take effect, not only get stored: jobs are submitted through the real
REST API into a real Redis and rolled out by an in-process ``RolloutWorker``; what the engine is asked for and the
groups it writes must follow each job's ``n_samples``, ``sampling.top_k``, ``sampling.top_p``,
``sampling.max_new_tokens``, ``tools``, ``source.seed`` and ``max_turns`` rather than the run's ``rollout``
section. A control job that overrides nothing, rolled out by the same worker, shows the run's values would give
something else.

The untrained tiny model never writes a tool call, so the ``max_turns`` test hands the worker an engine that
answers every turn with a calculator call (test data in the /generate reply shape); the worker, Redis, the job
spec, tools, parser and agent loop are all real there. Every other check runs against the real embedded engine.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from buffer_helpers import client
from worker_helpers import serve_until

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.schema import TrajectoryGroup
from core.config import BufferConfig, RolloutConfig, load_config
from core.jobs import JobSpec, SamplingSpec, TaskSource, rollout_settings
from core.tasks import load_tasks
from core.trajectory import ChatRenderer
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import ToolRegistry
from rollout_server.tools.calculator import CalculatorTool
from rollout_server.tools.check_answer import CheckAnswerTool
from rollout_server.worker import RolloutWorker
from services.api import create_app
from tests.http_harness import serve_app

RUN = "ov"
KEYS = Keys(RUN)
TOKEN = secrets.token_urlsafe(32)
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, threads=1) as engine:
        yield engine.url


class RecordingEngine(EngineClient):
    """The real engine; every request's rid and sampling params are kept (a spy: the engine still answers)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.requests: list[tuple[str, dict[str, Any]]] = []

    async def generate(self, input_ids: Any, sampling_params: dict[str, Any] | None = None,
                       return_logprob: bool = True, rid: Any = None) -> Any:
        self.requests.append((str(rid), dict(sampling_params or {})))
        return await super().generate(input_ids, sampling_params, return_logprob, rid)


class ToolCallingEngine:
    """Test data in the /generate reply shape: every assistant turn is one calculator call (then eos), within
    ``max_new_tokens``; weight version 0. Records each request's rid and sampling params."""

    base_url = "http://127.0.0.1:9"  # never called: only published in the server registry

    def __init__(self, tokenizer: Any) -> None:
        self.ids = tokenizer.encode(CALC, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.requests: list[tuple[str, dict[str, Any]]] = []

    async def weight_version(self) -> str:
        return "0"

    async def generate(self, input_ids: Any, sampling_params: dict[str, Any], return_logprob: bool = True,
                       rid: Any = None) -> dict[str, Any]:
        self.requests.append((str(rid), dict(sampling_params)))
        assert len(self.ids) < sampling_params["max_new_tokens"]
        meta = {
            "finish_reason": {"type": "stop", "matched": self.ids[-1]},
            "output_token_logprobs": [[-0.5, t, None] for t in self.ids],
            "weight_version": "0",
            "weight_versions": [{"version": "0", "start": 0, "end": len(self.ids)}],
        }
        return {"text": CALC, "output_ids": list(self.ids), "meta_info": meta}

    async def aclose(self) -> None:
        pass


@contextmanager
def api_of(server: EmbeddedRedis) -> Iterator[httpx.Client]:
    """The run's REST API on 127.0.0.1 (stopped on exit) and an authorized client of it."""
    cfg = load_config(None, [f"run.name={RUN}", f"redis.url={server.url}", f"api.token={TOKEN}"], env={})
    with serve_app(create_app(cfg)) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
            yield api


def submit(api: httpx.Client, body: dict[str, Any]) -> str:
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 201, reply.text
    return reply.json()["job_id"]


def roll_out(server: EmbeddedRedis, api: httpx.Client, rollout: RolloutConfig, engine: Any, tokenizer: Any,
             jobs: list[str]) -> None:
    """An in-process worker with ``rollout`` as the run's section serves until every job is done, then stops."""
    worker = RolloutWorker(client(server), RUN, rollout, BufferConfig(), [engine], tokenizer,
                           ToolRegistry.builtin(), RolloutMetrics())

    def done() -> bool:
        return all(api.get(f"/v1/jobs/{job}").json()["state"] == "done" for job in jobs)

    asyncio.run(serve_until(worker, done, "the jobs were done"))
    for job in jobs:
        progress = api.get(f"/v1/jobs/{job}").json()["progress"]
        assert progress["dead_lettered"] == 0 and progress["completed"] == progress["submitted"], (job, progress)


def train_groups(server: EmbeddedRedis, count: int) -> dict[str, list[TrajectoryGroup]]:
    """The ``count`` train groups written, by job."""
    buffer, groups = ReplayBuffer(client(server), KEYS, BufferConfig()), []
    while len(groups) < count:
        batch = buffer.take(count - len(groups), 5)
        assert batch, f"only {len(groups)} of {count} groups in the buffer"
        groups += [g for _, g in batch]
    by_job: dict[str, list[TrajectoryGroup]] = {}
    for group in groups:
        by_job.setdefault(group.job_id, []).append(group)
    return by_job


def requests_of(engine: Any, job: str) -> list[dict[str, Any]]:
    """The sampling params of a job's requests (a rid starts with the group id, ``<job>:<n>:<task>``)."""
    return [params for rid, params in engine.requests if rid.startswith(f"{job}:")]


def user_prompts(groups: list[TrajectoryGroup]) -> set[str]:
    return {s.messages[1]["content"] for g in groups for s in g.samples}


def generated(sample: Any) -> list[int]:
    return sample.token_ids.tolist()[sample.prompt_len:]


@pytest.mark.parametrize(("field", "job", "expected"), [
    ("n_samples", {"n_samples": 3}, 3),
    ("max_turns", {"max_turns": 2}, 2),
    ("reward", {"reward": "tool"}, "tool"),
    ("temperature", {"sampling": SamplingSpec(temperature=0.5)}, 0.5),
    ("top_p", {"sampling": SamplingSpec(top_p=0.9)}, 0.9),
    ("top_k", {"sampling": SamplingSpec(top_k=5)}, 5),
    ("max_new_tokens", {"sampling": SamplingSpec(max_new_tokens=7)}, 7),
])
def test_rollout_settings_lays_each_job_field_over_the_run_and_only_it(field: str, job: dict[str, Any],
                                                                      expected: Any) -> None:
    run = RolloutConfig(n_samples=8, max_turns=4, max_new_tokens=64, max_total_tokens=300, temperature=1.0,
                        top_p=1.0, top_k=-1, reward="gsm8k")
    before = run.model_dump()
    spec = JobSpec(source=TaskSource(kind="arith", limit=1), **job)
    settings = rollout_settings(spec, run)
    assert getattr(settings, field) == expected != getattr(run, field)
    assert {k: v for k, v in settings.model_dump().items() if k != field} == {
        k: v for k, v in before.items() if k != field}  # the run's values for everything the job leaves out
    assert run.model_dump() == before  # the run's section itself is untouched
    assert rollout_settings(JobSpec(source=TaskSource(kind="arith", limit=1)), run).model_dump() == before
    evaluation = rollout_settings(JobSpec(kind="eval", source=TaskSource(kind="arith", limit=1)), run)
    assert (evaluation.n_samples, evaluation.temperature) == (1, 0.0)  # eval: one greedy sample by default


def test_job_overrides_reach_the_engine_and_shape_the_groups(redis_server: EmbeddedRedis, engine_url: str,
                                                             tokenizer: Any) -> None:
    """Against the real engine at temperature 1 (the run's), with the run at n_samples=4, max_new_tokens=24:

    - ``greedy_k`` (seed 7, n_samples=3, top_k=1, max_new_tokens=4, tools=[check_answer]): 3 samples per group,
      every request asks for top_k=1 and 4 new tokens; the samples of a group are the same (top_k=1 is greedy)
      and 4 tokens long where the run's 24 would give more;
    - ``greedy_p`` (seed 7, n_samples=2, top_p=1e-6, tools=[check_answer]): 2 samples, top_p=1e-6 requested,
      the samples are the same greedy continuation (24 tokens), whose first 4 are ``greedy_k``'s;
    - ``control`` (seed 0, nothing else): 4 samples, the run's params, the prompts of other tasks (seed 0's),
      with the calculator tool of the tasks themselves, and samples that differ;
    - ``eval`` (seed 7, n_samples=3): 3 samples in its one group, where an eval job defaults to 1.
    """
    rollout = RolloutConfig(n_samples=4, max_new_tokens=24, max_turns=3, temperature=1.0, max_concurrent_groups=8)
    engine = RecordingEngine(engine_url)
    check_only = ["check_answer"]
    with api_of(redis_server) as api:
        greedy_k = submit(api, {"source": {"kind": "arith", "limit": 2, "seed": 7}, "n_samples": 3,
                                "sampling": {"top_k": 1, "max_new_tokens": 4}, "tools": check_only})
        greedy_p = submit(api, {"source": {"kind": "arith", "limit": 2, "seed": 7}, "n_samples": 2,
                                "sampling": {"top_p": 1e-6}, "tools": check_only})
        control = submit(api, {"source": {"kind": "arith", "limit": 2}})
        evaluation = submit(api, {"kind": "eval", "source": {"kind": "arith", "limit": 1, "seed": 7, "split": "test"},
                                  "n_samples": 3, "sampling": {"max_new_tokens": 2}})
        roll_out(redis_server, api, rollout, engine, tokenizer, [greedy_k, greedy_p, control, evaluation])
        eval_items = api.get(f"/v1/jobs/{evaluation}/trajectories").json()["items"]
    groups = train_groups(redis_server, 6)
    assert {job: len(gs) for job, gs in groups.items()} == {greedy_k: 2, greedy_p: 2, control: 2}

    # n_samples: the job's, in the groups and in what the engine was asked (one turn per sample: no tool calls)
    for job, n in ((greedy_k, 3), (greedy_p, 2), (control, 4)):
        assert [len(g.samples) for g in groups[job]] == [n, n], job
        assert len(requests_of(engine, job)) == 2 * n, job
    assert sorted(item["sample_index"] for item in eval_items) == [0, 1, 2]
    assert len({item["group_id"] for item in eval_items}) == 1
    assert all(item["num_generated"] == 2 for item in eval_items)  # its max_new_tokens too

    # top_k, top_p, max_new_tokens: what each request carried
    wanted = {greedy_k: {"top_k": 1, "top_p": 1.0, "max_new_tokens": 4, "temperature": 1.0},
              greedy_p: {"top_k": -1, "top_p": 1e-6, "max_new_tokens": 24, "temperature": 1.0},
              control: {"top_k": -1, "top_p": 1.0, "max_new_tokens": 24, "temperature": 1.0}}
    for job, params in wanted.items():
        assert all(p == params for p in requests_of(engine, job)), (job, requests_of(engine, job))

    # source.seed: the same seed gives the same tasks, another seed other tasks
    seed7 = {t.messages[1]["content"]: t for t in load_tasks("arith", limit=2, seed=7)}
    seed0 = {t.messages[1]["content"]: t for t in load_tasks("arith", limit=2, seed=0)}
    assert not set(seed7) & set(seed0)
    assert user_prompts(groups[greedy_k]) == user_prompts(groups[greedy_p]) == set(seed7)
    assert user_prompts(groups[control]) == set(seed0)

    # tools: the job's list replaces the task's in the rendered prompt
    renderer = ChatRenderer(tokenizer)
    for job, schema, tasks in ((greedy_k, CheckAnswerTool().schema, seed7), (greedy_p, CheckAnswerTool().schema, seed7),
                               (control, CalculatorTool().schema, seed0)):
        for group in groups[job]:
            for sample in group.samples:
                task = tasks[sample.messages[1]["content"]]
                assert sample.token_ids.tolist()[: sample.prompt_len] == renderer.prompt_ids(task.messages, [schema])
    for task in seed7.values():  # and it is a different prompt from the task's own tools
        assert renderer.prompt_ids(task.messages, [CheckAnswerTool().schema]) != renderer.prompt_ids(
            task.messages, [CalculatorTool().schema])

    # top_k=1 and top_p=1e-6 at temperature 1: every sample of a group is the one greedy continuation; the job's
    # max_new_tokens=4 cuts it where the run's 24 goes on
    greedy = {}
    for group in groups[greedy_p]:
        [continuation] = {tuple(generated(s)) for s in group.samples}
        assert len(continuation) == 24 and {s.finish_reason for s in group.samples} == {"length"}
        greedy[group.samples[0].messages[1]["content"]] = list(continuation)
    for group in groups[greedy_k]:
        [continuation] = {tuple(generated(s)) for s in group.samples}
        assert list(continuation) == greedy[group.samples[0].messages[1]["content"]][:4]
        assert all(s.num_generated == 4 and s.finish_reason == "length" for s in group.samples)
    assert any(len({tuple(generated(s)) for s in g.samples}) > 1 for g in groups[control])  # not greedy by itself
    assert max(s.num_generated for g in groups[control] for s in g.samples) > 4


def test_job_max_turns_ends_episodes_before_the_runs_limit(redis_server: EmbeddedRedis, tokenizer: Any) -> None:
    """Every assistant turn is a calculator call, so only the turn limit ends an episode: the job's max_turns=2
    against the run's 5 (the control job, which sets none, gets 5 turns)."""
    rollout = RolloutConfig(n_samples=2, max_new_tokens=64, max_total_tokens=1024, max_turns=5)
    engine = ToolCallingEngine(tokenizer)
    with api_of(redis_server) as api:
        short = submit(api, {"source": {"kind": "arith", "limit": 1}, "max_turns": 2})
        control = submit(api, {"source": {"kind": "arith", "limit": 1}})
        roll_out(redis_server, api, rollout, engine, tokenizer, [short, control])
        items = {job: api.get(f"/v1/jobs/{job}/trajectories").json()["items"] for job in (short, control)}
    for job, turns in ((short, 2), (control, 5)):
        assert len(items[job]) == 2, job
        for item in items[job]:
            roles = [m["role"] for m in item["messages"]]
            assert (item["num_turns"], item["finish_reason"]) == (turns, "max_turns"), (job, item)
            assert roles == ["system", "user"] + ["assistant", "tool"] * turns, (job, roles)
            assert [c["ok"] for c in item["tool_calls"]] == [True] * turns
        assert len(requests_of(engine, job)) == 2 * turns, job


def test_a_job_spec_is_read_once_per_server_however_many_tasks_it_has(redis_server: EmbeddedRedis,
                                                                       tokenizer: Any) -> None:
    """An inline job's stored spec holds every task: a worker reads and validates it once, then reads only the job's
    state for each task (it read the whole hash, megabytes for a big inline job, and validated every task in it,
    for each of its tasks). Its settings still reach every task."""
    rollout = RolloutConfig(n_samples=2, max_new_tokens=64, max_total_tokens=1024, max_turns=5)
    engine = ToolCallingEngine(tokenizer)
    tasks = [{"task_id": f"t{i}", "messages": [{"role": "user", "content": f"What is {i}*7?"}],
              "reward": {"ground_truth": str(7 * i)}}
             for i in range(4)]
    with api_of(redis_server) as api:
        job = submit(api, {"source": {"kind": "inline", "tasks": tasks}, "max_turns": 1})
        worker = RolloutWorker(client(redis_server), RUN, rollout, BufferConfig(), [engine], tokenizer,
                               ToolRegistry.builtin(), RolloutMetrics())
        reads: list[str] = []
        read_job = worker.tasks.job

        def spied(job_id: str) -> dict[str, str]:  # a spy: the queue still answers
            reads.append(job_id)
            return read_job(job_id)

        worker.tasks.job = spied  # type: ignore[method-assign]
        asyncio.run(serve_until(worker, lambda: api.get(f"/v1/jobs/{job}").json()["state"] == "done", "job done"))
    assert reads == [job]
    assert len(requests_of(engine, job)) == 4 * 2  # max_turns 1: one request per sample
