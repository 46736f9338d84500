"""Agent jobs through the real ``python -m rollout_server`` worker, Redis and the embedded engine: the job's
allowlisted ``module:function`` runs once per sample in its own process against the episode endpoint; its
episodes become the group; crashes, timeouts, the memory limit and agents the operator did not allow fail
the sample or the task, and failed samples are never written for training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import test_rollout_worker as worker_tests
from buffer_helpers import client
from transformers import AutoTokenizer

from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.replay import ReplayBuffer
from buffer.task_queue import TaskQueue
from core.config import BufferConfig
from core.jobs import JobSpec, SamplingSpec, TaskSource
from core.tasks import load_tasks
from core.tasks.arith import CALCULATOR_SCHEMA
from core.trajectory import ChatRenderer, masked_spans
from tests.stack_helpers import affinities

KEYS, wait_for = worker_tests.KEYS, worker_tests.wait_for
engine_url, workers = worker_tests.engine_url, worker_tests.workers  # the worker tests' fixtures
CALC_AGENT = "rollout_server.agents.calculator_agent:run"
USABLE = sorted(os.sched_getaffinity(0))
ALLOW = [CALC_AGENT, "tests.agent_fixtures:first_fails", "tests.agent_fixtures:crash",
         "tests.agent_fixtures:sleep", "tests.agent_fixtures:hog", "tests.agent_fixtures:environment",
         "tests.agent_fixtures:warmed", "tests.agent_fixtures:cpus"]


def submit_agent(server: EmbeddedRedis, job: str, agent: str, n: int = 1, offset: int = 0,
                 sampling: SamplingSpec | None = None) -> list[str]:
    q = TaskQueue(client(server), KEYS, BufferConfig())
    q.ensure_groups()
    spec = JobSpec(source=TaskSource(kind="arith", limit=n, offset=offset), agent=agent,
                   sampling=sampling or SamplingSpec())
    tasks = [t.model_dump(mode="json") for t in spec.source.load()]
    return q.submit(job, tasks, "train", spec.model_dump_json())


def dead_letters(server: EmbeddedRedis) -> dict[str, str]:
    entries = client(server).xrange(KEYS.tasks_dead)
    return {f[b"job_id"].decode(): f[b"error"].decode() for _, f in entries}


def test_agent_job_trains_through_the_endpoint(redis_server: EmbeddedRedis, workers, tiny_model_dir: Path,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_FIXTURE_DIR", str(tmp_path))
    w = workers("srv-agent", "rollout.openai_port=0", "rollout.openai_model=policy",
                f"rollout.agent_allowlist={json.dumps(ALLOW)}", "rollout.max_new_tokens=16")
    [flaky_gid] = submit_agent(redis_server, "flaky", "tests.agent_fixtures:first_fails", offset=1)
    r = client(redis_server)
    wait_for(lambda: r.xlen(KEYS.groups) == 1, w)
    [info] = ServerRegistry(r, KEYS).live_servers()
    assert info.openai_url.startswith("http://127.0.0.1:") and not info.openai_url.endswith(":0")
    [(_, flaky)] = ReplayBuffer(r, KEYS, BufferConfig()).take(1, 5)

    # One sample crashed: the group holds only the other one (it asked for model "policy", this
    # server's rollout.openai_model), with the reward the agent returned.
    assert flaky.group_id == flaky_gid
    [sample] = flaky.samples
    assert sample.reward == 0.25
    assert sample.reward_info == {"source": "agent"} and sample.finish_reason in ("stop", "length")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = load_tasks("arith", split="train", limit=1, offset=1)[0]
    prompt = ChatRenderer(tokenizer).prompt_ids(task.messages, None)
    assert sample.token_ids.tolist()[: sample.prompt_len] == prompt
    assert masked_spans(sample.loss_mask) == [(0, len(prompt), 0), (len(prompt), len(sample.token_ids), 1)]
    assert sample.num_generated <= 4


def test_calculator_agent_job(redis_server: EmbeddedRedis, workers, tiny_model_dir: Path) -> None:
    """The example agent end to end: its prompt carries its calculator tool, the final answer is scored by
    the job's reward function, both samples are written, and the group records the job's temperature (the one
    the endpoint sampled at, which the trainer scales the logits by), not the server's."""
    w = workers("srv-calc", f"rollout.agent_allowlist={json.dumps([CALC_AGENT])}", "rollout.max_new_tokens=16")
    [gid] = submit_agent(redis_server, "calc", CALC_AGENT, sampling=SamplingSpec(temperature=0.7))
    r = client(redis_server)
    wait_for(lambda: r.xlen(KEYS.groups) == 1, w)
    [(_, group)] = ReplayBuffer(r, KEYS, BufferConfig()).take(1, 5)
    assert group.group_id == gid and len(group.samples) == 2
    assert group.temperature == 0.7
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = load_tasks("arith", split="train", limit=1)[0]
    prompt = ChatRenderer(tokenizer).prompt_ids(task.messages, [CALCULATOR_SCHEMA])
    for sample in group.samples:
        assert sample.token_ids.tolist()[: sample.prompt_len] == prompt
        assert sample.num_turns >= 1 and sample.loss_mask[sample.prompt_len]
        assert "ground_truth" in sample.reward_info  # the gsm8k reward function scored it


def test_agent_faults_fail_the_task(redis_server: EmbeddedRedis, workers) -> None:
    """Also: the agents run on ``placement.agent_cpus``, not on the rollout server's CPUs."""
    server_cpu, agent_cpu = USABLE[0], USABLE[-1]
    w = workers("srv-faults", f"rollout.agent_allowlist={json.dumps(ALLOW[2:])}", "rollout.agent_timeout_s=8",
                "rollout.agent_memory_mb=300", "buffer.max_attempts=1", f"placement.rollout_cpus=[{server_cpu}]",
                f"placement.agent_cpus=[{agent_cpu}]")
    for job in ("crash", "sleep", "hog", "environment", "warmed", "cpus"):
        submit_agent(redis_server, job, f"tests.agent_fixtures:{job}")
    submit_agent(redis_server, "unlisted", CALC_AGENT)
    wait_for(lambda: len(dead_letters(redis_server)) == 7, w)
    errors = dead_letters(redis_server)
    assert f"cpus: [{agent_cpu}]" in errors["cpus"]
    assert set(affinities(w.proc.pid).values()) == {str(server_cpu)}  # the worker and its fork server
    assert "the agent crashed" in errors["crash"]
    assert "visible: []" in errors["environment"]  # the worker got a checkpoint token; its agents do not
    assert "warmed: True" in errors["warmed"]  # forked from the fork server after its openai warm-up
    assert "ran past 8s" in errors["sleep"]
    assert "MemoryError" in errors["hog"]
    assert "not in this server's rollout.agent_allowlist" in errors["unlisted"]
    assert client(redis_server).xlen(KEYS.groups) == 0
