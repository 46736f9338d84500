"""An OpenAI-client agent trains through the whole pipeline and its held-out accuracy rises.

The example calculator agent (``rollout_server/agents/calculator_agent.py``: plain ``openai`` client code,
its own calculator tool) is the job's entrypoint; the tiny model is warm-started by SFT on tool-use
demonstrations (as ``make demo`` does) so it can call tools. Real processes: embedded Redis, a rollout
server (embedded engine, episode endpoint, agent subprocesses) and the trainer. Held-out accuracy is
an eval agent job (greedy, test split) before and after RL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.task_queue import TaskQueue
from core.config import dump_config, load_config
from core.jobs import JobSpec, TaskSource
from core.tasks import load_tasks
from core.tiny_model import build_tiny_model
from services.launcher import LocalStack, components
from trainer.sft import warm_start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]
AGENT = "rollout_server.agents.calculator_agent:run"
SFT_STEPS, STEPS, GROUPS, SAMPLES, EVAL_TASKS = 500, 12, 4, 8, 48


def wait_for(what: str, cond: Callable[[], bool], stack: LocalStack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                             for p in sorted(stack.log_dir.glob("*.log")))
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.5)


def test_openai_client_agent_learns_arith(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", seed=0)
    model = warm_start(base, tmp_path / "sft", load_tasks("arith", split="train", limit=4000, seed=1), steps=SFT_STEPS)
    cfg = load_config(None, [
        "run.name=agent", f"run.dir={tmp_path}", f"model.path={model}", "model.init_if_missing=false",
        f"rollout.n_samples={SAMPLES}", "rollout.max_new_tokens=48", "rollout.max_total_tokens=384",
        "rollout.max_concurrent_groups=4", "rollout.heartbeat_s=0.5", f"rollout.agent_allowlist={json.dumps([AGENT])}",
        "rollout.agent_timeout_s=120", f"buffer.groups_per_step={GROUPS}", "buffer.max_staleness=2",
        f"trainer.total_steps={STEPS}", "trainer.lr=3e-4", "trainer.threads=1", "trainer.checkpoint_every=100",
        "engine.threads=1", f"checkpoint.stage_dir={tmp_path}/stage",
    ])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(cfg))
    keys = Keys(cfg.run.name)
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        client = redis.Redis.from_url(server.url)
        queue = TaskQueue(client, keys, cfg.buffer)
        queue.ensure_groups()

        def submit(job_id: str, kind: str, source: TaskSource) -> None:
            spec = JobSpec(kind=kind, source=source, agent=AGENT)
            queue.submit(job_id, [t.model_dump() for t in source.load()], kind, spec.model_dump_json())

        def accuracy(job_id: str) -> float:
            job = queue.job(job_id)
            return float(job["reward_sum"]) / int(job["samples"])

        held_out = TaskSource(kind="arith", split="test", limit=EVAL_TASKS, seed=5)
        with LocalStack(components(cfg, config_path, server.url, api=False), tmp_path / "logs") as stack:
            submit("before", "eval", held_out)
            wait_for("the eval before RL", lambda: queue.job("before").get("state") == "done", stack, 600)
            submit("rl", "train", TaskSource(kind="arith", split="train", limit=STEPS * GROUPS * 3, seed=2))
            wait_for(f"{STEPS} trainer steps", lambda: stack.finished("trainer-0"), stack, 1800)
            version = int(client.hget(keys.trainer, "version"))
            wait_for("the rollout server at the last version",
                     lambda: [s.version for s in ServerRegistry(client, keys).live_servers()] == [version], stack, 120)
            submit("after", "eval", held_out)
            wait_for("the eval after RL", lambda: queue.job("after").get("state") == "done", stack, 600)
        before, after = accuracy("before"), accuracy("after")
        trajectories = [json.loads(f[b"sample"]) for _, f in client.xrange(keys.trajectories("rl"))]
    assert any(t["tool_calls"] for t in trajectories), "the agent never called its tool"
    assert after > before, (before, after)
