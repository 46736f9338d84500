"""End to end under faults: a rollout server SIGKILLed, the trainer SIGKILLed, Redis restarted (AOF on).

The whole pipeline runs as real processes (two rollout servers with their embedded engines and
checkpoint receivers, one trainer pushing a version every step, the embedded Redis). The run must
complete and the accounting hold exactly: tasks submitted = groups trained + groups dropped as stale
+ tasks dead-lettered + tasks cancelled (none here), with no group id trained twice, and every rollout
server (the restarted one included) serving the trainer's last version. A feeder keeps tasks coming until
the trainer is back from its kill (so the run outlasts the restarts, however slow the machine), then the
run drains.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.task_queue import TaskQueue
from services.launcher import LocalStack, components
from tests.stack_helpers import Feeder, stack_config, trained_group_ids, wait_for

pytestmark = pytest.mark.slow


def test_faults_lose_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync="always").start()
    port = server.port  # the components know this URL: Redis comes back on it
    cfg, config_path = stack_config(tmp_path, "faults", tiny_model_dir, "rollout.heartbeat_s=0.5",
                                    "trainer.total_steps=1000", "trainer.checkpoint_every=2")
    keys = Keys(cfg.run.name)
    client = redis.Redis.from_url(server.url)
    queue = TaskQueue(client, keys, cfg.buffer)
    queue.ensure_groups()
    registry = ServerRegistry(client, keys)

    def step() -> int:
        try:
            return int(client.hget(keys.trainer, "step") or 0)
        except redis.ConnectionError:
            return 0

    specs = components(cfg, config_path, server.url, rollout_servers=2, api=False)
    registry = ServerRegistry(client, keys)
    try:
        with LocalStack(specs, tmp_path / "logs") as stack:
            with Feeder(client, keys, queue, "faults") as feeder:  # the run lasts until the faults are done
                wait_for("trainer step 2", lambda: step() >= 2, stack)
                stack.kill("rollout-0")
                killed = time.time()
                wait_for("trainer step 5", lambda: step() >= 5, stack)
                wait_for("rollout-0 back", lambda: any(s.server_id == "rollout-0" and s.started > killed
                                                       for s in registry.live_servers()), stack)
                killed_at = step()
                stack.kill("trainer-0")
                wait_for("the trainer back, two steps further", lambda: step() >= killed_at + 2, stack)
            server.stop()
            server = EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync="always", port=port).start()
            client = redis.Redis.from_url(server.url)
            registry = ServerRegistry(client, keys)
            wait_for("the trainer to drain the job", lambda: stack.finished("trainer-0"), stack, timeout_s=300)
            assert stack.restarts["rollout-0"] >= 1 and stack.restarts["trainer-0"] >= 1
            final_version = int(client.hget(keys.trainer, "version"))
            wait_for("both servers at the last version", lambda: sorted(
                s.version for s in registry.live_servers()) == [final_version] * 2, stack, 60)

        job = TaskQueue(client, keys, cfg.buffer).job("faults")
        submitted, trained = int(job["submitted"]), int(job.get("trained", 0))
        stale, dead = int(job.get("stale_dropped", 0)), int(job.get("dead_lettered", 0))
        cancelled = int(job.get("cancelled", 0))
        assert submitted == feeder.submitted
        assert submitted == trained + stale + dead + cancelled, job
        trained_ids = trained_group_ids(tmp_path / "faults")
        assert len(trained_ids) == len(set(trained_ids)) == trained
    finally:
        server.stop()
