"""Config keys read at a site no other test reaches (the Ray specs the launcher makes, the registry's liveness
key): each is set to a non-default value and the behaviour that site gives it is asserted, beside the default's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from buffer_helpers import client

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from core.config import BufferConfig, RolloutConfig, load_config
from rollout_server.engine_client import EngineClient
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker
from services.launcher import components


def test_trainer_device_cuda_asks_ray_for_a_gpu_per_trainer_rank(tmp_path: Path) -> None:
    """``trainer.device=cuda``: each trainer rank's spec asks Ray for one GPU (so ranks land on GPU nodes, one GPU
    each); by default (auto) none is asked for, and the rollout servers and the API never ask whatever the key."""
    def gpus(*overrides: str) -> dict[str, float]:
        specs = components(load_config(None, list(overrides), env={}), tmp_path / "config.yaml", None,
                           rollout_servers=1, trainer_ranks=2)
        return {spec.name: spec.num_gpus for spec in specs}

    assert gpus("trainer.device=cuda") == {"trainer-0": 1.0, "trainer-1": 1.0, "rollout-0": 0.0, "api": 0.0}
    assert gpus() == gpus("trainer.device=cpu") == {"trainer-0": 0.0, "trainer-1": 0.0, "rollout-0": 0.0, "api": 0.0}


def test_api_allowed_hosts_survive_the_ray_node_override(tmp_path: Path) -> None:
    """On Ray the API binds its node's address, so the launcher re-sets ``api.allowed_hosts`` there: to the
    configured hosts plus that address. A configured ingress host must stay in the list (a Ray run would answer
    its requests 400), and the defaults only where none is configured."""
    def hosts_override(*overrides: str) -> list[str]:
        [api] = [spec for spec in components(load_config(None, list(overrides), env={}), tmp_path / "config.yaml",
                                             None) if spec.name == "api"]
        [override] = [o for o in api.node_overrides if o.startswith("api.allowed_hosts=")]
        return json.loads(override.partition("=")[2])

    assert hosts_override("api.allowed_hosts=[rl.example.com]") == ["rl.example.com", "{address}"]
    assert hosts_override() == ["127.0.0.1", "localhost", "[::1]", "{address}"]


def _worker(redis_server: EmbeddedRedis, tokenizer: Any, rollout: RolloutConfig) -> RolloutWorker:
    return RolloutWorker(client(redis_server), "t", rollout, BufferConfig(), [EngineClient("http://127.0.0.1:9")],
                         tokenizer, ToolRegistry.from_file(None))


@pytest.mark.parametrize(("heartbeat_s", "ttl_ms"), [(7.0, 21_000), (RolloutConfig().heartbeat_s, 6_000)])
def test_rollout_heartbeat_s_sets_how_long_a_server_stays_live(
    redis_server: EmbeddedRedis, tokenizer: Any, heartbeat_s: float, ttl_ms: int
) -> None:
    """``rollout.heartbeat_s``: a server's liveness key lives three heartbeats (a beat or two late is not a dead
    server), so at 7 s it outlives the default's 6 s by far; its heartbeat loop runs every beat while the task
    lease (claim_idle_ms / 3, 10 s by default) allows."""
    worker = _worker(redis_server, tokenizer, RolloutConfig(server_id="srv-beat", heartbeat_s=heartbeat_s))
    worker.servers.register(worker.info)
    left_ms = client(redis_server).pttl(Keys("t").server_alive("srv-beat"))
    assert ttl_ms - 2_000 < left_ms <= ttl_ms
    assert worker.lease_s == heartbeat_s
