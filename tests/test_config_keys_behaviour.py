"""Config keys read at a site no other test reaches (the Ray specs the launcher makes, the registry's liveness
key, the admission bound ``rollout.mode`` sets, a rollout server's waits on its engines): each is set to a non-default
value and the behaviour that site gives it is asserted, beside the default's."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from buffer_helpers import client
from fastapi import FastAPI
from http_harness import serve_app
from net_helpers import refused_port

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, Config, ConfigError, RolloutConfig, load_config
from core.tasks import load_tasks
from rollout_server.__main__ import load_tools, serve
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


@pytest.mark.parametrize(("mode", "admitted"), [("sync", 4), ("async", 12)])
def test_rollout_mode_sync_admits_only_the_current_versions_groups(
    redis_server: EmbeddedRedis, mode: str, admitted: int
) -> None:
    """``rollout.mode=sync``: admission lets the servers generate one step of groups (groups_per_step) for the
    published version and no more until the trainer publishes the next, even with ``buffer.max_staleness`` set; the
    default (async) admits max_staleness + 1 versions' groups ahead. The next version opens one more step."""
    cfg = load_config(None, [f"rollout.mode={mode}", "buffer.groups_per_step=4", "buffer.max_staleness=2"], env={})
    admission = StalenessControl(client(redis_server), Keys(f"mode-{mode}"), cfg.buffer)
    assert sum(admission.try_admit(f"g{i}") for i in range(20)) == admitted
    assert admission.set_version(1, trained=4) == 1
    assert sum(admission.try_admit(f"h{i}") for i in range(20)) == 4


def _hanging_engine(released: threading.Event) -> FastAPI:
    """An engine that is up (``/health``, version 0) and whose ``/generate`` answers nothing until ``released``."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/model_info")
    async def model_info() -> dict:
        return {"weight_version": "0"}

    @app.post("/generate")
    async def generate() -> dict:
        while not released.is_set():
            await asyncio.sleep(0.05)
        return {}

    return app


def _server_config(redis_url: str, model: Path, run_dir: Path, *overrides: str) -> Config:
    """A rollout server's config on ``redis_url`` and the engines ``overrides`` name, with the token it needs."""
    return load_config(None, [f"run.dir={run_dir}", f"redis.url={redis_url}", f"model.path={model}",
                              "rollout.metrics_port=null", f"checkpoint.stage_dir={run_dir / 'stage'}", *overrides],
                       env={"ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)})


def test_engine_ready_timeout_s_bounds_a_rollout_servers_wait_for_its_engines(redis_url: str, tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """``engine.ready_timeout_s`` on a rollout server given ``engine.urls``: an engine that never comes up stops the
    server after that long with a config error naming the key and the engine (at the default it waits an hour)."""
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        cfg = _server_config(redis_url, tiny_model_dir, tmp_path, f"engine.urls=[{url}]", "engine.ready_timeout_s=1")
        with pytest.raises(ConfigError) as refused:  # not the hour of the default: a wait past 30 s fails
            asyncio.run(asyncio.wait_for(serve(cfg, load_tools(cfg.rollout)), 30))
    assert str(refused.value).startswith(f"engine.ready_timeout_s: {url}/health: not healthy after 1s"), refused.value


def test_engine_request_timeout_s_bounds_a_rollout_servers_engine_calls(redis_url: str, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """``engine.request_timeout_s`` on a rollout server (``serve``, as ``python -m rollout_server`` runs it; the
    ``rollwave rollout`` command's own use is tested apart): an engine that is up but never answers /generate fails
    each episode after that long, the error naming the engine, the call and the value, and the task, out of
    attempts, is dead-lettered with it. At the default the server would wait 600 s on each call."""
    run, released = "request-timeout", threading.Event()
    keys, r = Keys(run), redis.Redis.from_url(redis_url)
    queue = TaskQueue(r, keys, BufferConfig())
    queue.ensure_groups()
    queue.submit("job", [t.model_dump(mode="json") for t in load_tasks("arith", split="train", limit=1)], "train")

    async def dead_letter(url: str) -> str:
        cfg = _server_config(redis_url, tiny_model_dir, tmp_path, f"run.name={run}", f"engine.urls=[{url}]",
                             "engine.request_timeout_s=0.5", "buffer.max_attempts=1", "rollout.n_samples=2",
                             "rollout.server_id=srv-timeout")
        server = asyncio.create_task(serve(cfg, load_tools(cfg.rollout)))
        deadline = time.monotonic() + 60
        try:
            while not (dead := r.xrange(keys.tasks_dead)):
                if server.done():
                    server.result()
                    raise AssertionError("serve returned")
                assert time.monotonic() < deadline, "the task was never dead-lettered"
                await asyncio.sleep(0.05)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        [(_, fields)] = dead
        return fields[b"error"].decode()

    with serve_app(_hanging_engine(released)) as url:
        try:
            error = asyncio.run(dead_letter(url))
        finally:
            released.set()
            r.close()
    assert f"engine: EngineError: /generate: {url}: no answer within 0.5 s" in error, error
