"""End to end under faults: a rollout server SIGKILLed, the trainer SIGKILLed, Redis restarted (AOF on).

The whole pipeline runs as real processes (two rollout servers with their embedded engines and
checkpoint receivers, one trainer pushing a version every step, the embedded Redis). The run must
complete and the accounting hold exactly: tasks submitted = groups trained + groups dropped as stale
+ tasks dead-lettered + tasks cancelled (none here), with no group id trained twice, and every rollout
server (the restarted one included) serving the trainer's last version.
"""

from __future__ import annotations

import json
import signal
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
from services.launcher import LocalStack, components, ensure_checkpoint_token

pytestmark = pytest.mark.slow
N_TASKS = 96


def wait_for(what: str, cond: Callable[[], bool], stack: LocalStack, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                             for p in sorted(stack.log_dir.glob("*.log")))
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.25)


def test_faults_lose_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync="always").start()
    port = server.port  # the components know this URL: Redis comes back on it
    cfg = load_config(None, [
        "run.name=faults", f"run.dir={tmp_path}", f"model.path={tiny_model_dir}", "model.init_if_missing=false",
        "rollout.n_samples=2", "rollout.max_turns=2", "rollout.max_new_tokens=12", "rollout.heartbeat_s=0.5",
        "rollout.max_concurrent_groups=4", "rollout.shutdown_grace_s=5", "buffer.claim_idle_ms=3000",
        "buffer.max_staleness=1", "buffer.groups_per_step=4", "trainer.total_steps=1000",
        "trainer.stop_when_drained=true", "trainer.checkpoint_every=2", "trainer.take_timeout_s=1",
        "trainer.threads=1", "engine.threads=1", "engine.max_batch_size=16", f"checkpoint.stage_dir={tmp_path}/stage",
    ])
    ensure_checkpoint_token(cfg)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(cfg))
    keys = Keys(cfg.run.name)
    client = redis.Redis.from_url(server.url)
    queue = TaskQueue(client, keys, cfg.buffer)
    queue.ensure_groups()
    spec = JobSpec(source=TaskSource(kind="arith", split="train", limit=N_TASKS, seed=3))
    queue.submit("faults", [t.model_dump() for t in spec.source.load()], "train", spec.model_dump_json())

    def step() -> int:
        try:
            return int(client.hget(keys.trainer, "step") or 0)
        except redis.ConnectionError:
            return 0

    specs = components(cfg, config_path, server.url, rollout_servers=2, api=False)
    registry = ServerRegistry(client, keys)
    try:
        with LocalStack(specs, tmp_path / "logs") as stack:
            wait_for("trainer step 2", lambda: step() >= 2, stack)
            killed = time.time()
            stack.kill("rollout-0")
            # Hold the trainer until rollout-0 is back: else, on a loaded machine, rollout-1 can drain the job
            # before the restarted server registers, and no push is left to bring it to the last version.
            stack.kill("trainer-0", signal.SIGSTOP)
            wait_for("rollout-0 back in the registry", lambda: any(
                s.server_id == "rollout-0" and s.started > killed for s in registry.live_servers()), stack)
            stack.kill("trainer-0", signal.SIGCONT)
            wait_for("trainer step 5", lambda: step() >= 5, stack)
            stack.kill("trainer-0")
            wait_for("the trainer back past step 7", lambda: step() >= 7, stack)
            server.stop()
            server = EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync="always", port=port).start()
            client = redis.Redis.from_url(server.url)
            wait_for("the trainer to drain the job", lambda: stack.finished("trainer-0"), stack, timeout_s=300)
            assert stack.restarts["rollout-0"] >= 1 and stack.restarts["trainer-0"] >= 1
            final_version = int(client.hget(keys.trainer, "version"))
            wait_for("both servers at the last version", lambda: sorted(
                s.version for s in ServerRegistry(client, keys).live_servers()) == [final_version] * 2, stack, 60)

        job = TaskQueue(client, keys, cfg.buffer).job("faults")
        submitted, trained = int(job["submitted"]), int(job.get("trained", 0))
        stale, dead = int(job.get("stale_dropped", 0)), int(job.get("dead_lettered", 0))
        cancelled = int(job.get("cancelled", 0))
        assert submitted == N_TASKS
        assert submitted == trained + stale + dead + cancelled, job
        steps: dict[int, list[str]] = {}
        for line in (tmp_path / "faults" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]] = record["group_ids"]  # a step redone after the resume replaces the lost one
        trained_ids = [g for s in sorted(steps) for g in steps[s]]
        assert len(trained_ids) == len(set(trained_ids)) == trained
    finally:
        server.stop()
