"""End to end: three of four rollout servers frozen with SIGSTOP while the trainer pushes every step (issue 22).

The whole pipeline runs as real processes (four rollout servers with their embedded engines and checkpoint
receivers, one trainer, the API, the embedded Redis). A feeder keeps the task queue topped up until the
frozen servers' fates are settled, then the run drains. During the freeze the trainer must keep stepping at no
less than half its rate before the freeze, and each frozen server must show as a straggler (API, CLI). Then each
frozen server meets one fate, all in the same run:

- ``sigcont``: the server resumes and serves the trainer's newest version within one push, without being
  sent the versions it missed;
- ``sigkill``: the server is killed instead; its restart gets the newest version the same way;
- ``never``: it stays frozen; it leaves the live set and the run completes without it.

The accounting is exact: tasks submitted = groups trained + dropped as stale + dead-lettered, no group is
trained twice, and no admission slot is left held.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.task_queue import TaskQueue
from services.launcher import LocalStack, components, published_api_url
from tests.stack_helpers import Feeder, stack_config, trained_group_ids, wait_for

pytestmark = pytest.mark.slow
FREEZE_S = 60.0  # how long the servers stay frozen (the probe: one minute)
BEFORE_S = 10.0  # the window before the freeze that sets the trainer's reference rate: 4.3-5.2 steps/s in it here
# (four engines share the two cores), and 6.6 during the freeze (2026-11-28; 4.2-5.1 against 3.4-3.9 beside two CPU
# hogs), far above the half asserted
FATES = {"rollout-1": "sigcont", "rollout-2": "sigkill", "rollout-3": "never"}  # what ends each server's freeze
RESUMED = [name for name, fate in FATES.items() if fate != "never"]
ROOT = Path(__file__).resolve().parents[1]


def commits(address: str) -> float:
    """Commits the rollout server made since it started (its pause histogram's count)."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    [line] = [x for x in text.splitlines() if x.startswith("rollwave_rollout_pause_duration_seconds_count")]
    return float(line.split()[1])


def test_frozen_servers_never_stop_training(tmp_path: Path, tiny_model_dir: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", aof=False).start()
    cfg, config_path = stack_config(
        tmp_path, "frozen", tiny_model_dir, "rollout.heartbeat_s=2", "trainer.total_steps=100000",
        "trainer.checkpoint_every=5", "checkpoint.connect_timeout_s=2", "checkpoint.stage_timeout_s=5",
        "checkpoint.commit_timeout_s=10", "api.port=0",
        # Admission (η + 1 = 3 steps of 4 groups) shares 12 groups among the live servers; each has room for all 12,
        # so the one left running can take the frozen ones' share (its engine batches 24 sequences). With η = 1 the
        # pipeline is two steps deep and the run latency-bound: one server then kept 0.48-0.59 of the rate, the
        # bound itself; with η = 2 it keeps 0.66, the freeze's few seconds without a quorum included.
        "buffer.max_staleness=2", "rollout.max_concurrent_groups=12", "engine.max_batch_size=24",
    )
    keys = Keys(cfg.run.name)
    client = redis.Redis.from_url(server.url)
    queue = TaskQueue(client, keys, cfg.buffer)
    queue.ensure_groups()
    registry = ServerRegistry(client, keys)

    def trainer(field: str) -> int:
        return int(client.hget(keys.trainer, field) or 0)

    def served() -> dict[str, int]:
        return {s.server_id: s.version for s in registry.live_servers()}

    def steps_in(seconds: float) -> float:
        start, t0 = trainer("step"), time.monotonic()
        time.sleep(seconds)
        return (trainer("step") - start) / (time.monotonic() - t0)

    def metrics_address(server_id: str) -> str:
        return {s.server_id: s.metrics_address for s in registry.live_servers()}[server_id]

    def status() -> dict:
        return httpx.get(f"{api}/v1/status", timeout=10).json()

    stack = LocalStack(components(cfg, config_path, server.url, rollout_servers=4, api=True), tmp_path / "logs")
    frozen: set[str] = set()
    try:
        stack.start()
        api = published_api_url(client, keys)
        with Feeder(client, keys, queue, "frozen") as feeder:
            wait_for("every server at a pushed version", lambda: sorted(served()) == ["rollout-0", *FATES]
                     and min(served().values()) >= 1 and trainer("step") >= 2, stack)
            before = steps_in(BEFORE_S)
            pushed_before = trainer("pushed_version")  # a version pushed from here to its freeze may land before it
            commits_before = {name: commits(metrics_address(name)) for name in FATES}
            for name in FATES:
                stack.kill(name, signal.SIGSTOP)
                frozen.add(name)
            frozen_at, step_at_freeze = time.monotonic(), trainer("step")
            pushed_at_freeze = trainer("pushed_version")
            wait_for("the frozen servers marked stragglers", lambda: set(FATES) <= set(status()["stragglers"]),
                     stack, 30)
            for s in status()["servers"]:
                if s["server_id"] in FATES:
                    record = s["last_push"]
                    assert record["reason"] == "timeout" and record["stage"] in ("connect", "stage", "commit"), s
            cli = subprocess.run([sys.executable, "-m", "services.cli", "status", "--api", api], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60, check=True).stdout
            for name in FATES:
                assert f"straggler {name}: serves v" in cli, cli
            wait_for("the frozen servers to leave the live set", lambda: sorted(served()) == ["rollout-0"], stack,
                     30)
            time.sleep(max(0.0, frozen_at + FREEZE_S - time.monotonic()))
            during = (trainer("step") - step_at_freeze) / (time.monotonic() - frozen_at)
            assert during >= before / 2, (before, during)
            assert trainer("pushed_version") >= pushed_at_freeze + 10  # versions they missed
            assert sorted(served()) == ["rollout-0"]
            resumed = trainer("pushed_version")
            for name in RESUMED:
                stack.kill(name, signal.SIGCONT if FATES[name] == "sigcont" else signal.SIGKILL)
                frozen.discard(name)
            wait_for("the resumed servers back in the live set", lambda: set(RESUMED) <= set(served()), stack, 120)
            newest = trainer("pushed_version")
            wait_for("the resumed servers at the newest version",
                     lambda: min(served().get(name, 0) for name in RESUMED) >= newest, stack, 60)
            missed = resumed - pushed_at_freeze
            for name in RESUMED:
                sigcont = FATES[name] == "sigcont"
                landed = commits(metrics_address(name)) - (commits_before[name] if sigcont else 0)
                newer = trainer("pushed_version") - resumed  # versions the trainer pushed since (it never waits)
                # the versions pushed between its count before the freeze and the freeze (under load some may land
                # there: 115 landed against 111 newer once, 3 allowed), the catch-up, a commit cut by the freeze, the
                # versions pushed since, and one the server committed before the trainer recorded it (its commit
                # counts at once): no replay of the missed ones
                window = pushed_at_freeze - pushed_before if sigcont else 0
                assert landed <= 3 + window + newer and landed < missed, (name, landed, window, newer, missed)
            wait_for("the next version published", lambda: int(client.get(keys.version) or 0) > newest, stack, 60)
            assert status()["stragglers"] == list(frozen)  # the server that never came back, and only it
        wait_for("the trainer to drain the job", lambda: stack.finished("trainer-0"), stack, timeout_s=300)
        assert sorted(served()) == ["rollout-0", *RESUMED]
        assert stack.restarts["trainer-0"] == 0

        job = queue.job("frozen")
        trained, stale = int(job.get("trained", 0)), int(job.get("stale_dropped", 0))
        dead = int(job.get("dead_lettered", 0))
        assert int(job["submitted"]) == feeder.submitted
        assert feeder.submitted == trained + stale + dead, job
        trained_ids = trained_group_ids(tmp_path / "frozen")
        assert len(trained_ids) == len(set(trained_ids)) == trained
        # every admission slot went to a trained group or was given back: none is held by a task long done
        assert client.hlen(keys.admitted_ids) == 0
        assert int(client.get(keys.admitted)) == int(client.get(keys.trained)) == trained
    finally:
        for name in frozen:  # a stopped process would sit on its SIGTERM until the stack's kill timeout
            os.killpg(stack.pid(name), signal.SIGCONT)
        stack.close()
        server.stop()
