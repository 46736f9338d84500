"""Launchers at the edges of a component's life: a component stopped by a SIGTERM its launcher did not send (an
operator's ``kill``, a stray ``pkill``) is a failure to restart, whatever it exits with; only one whose work is done
(a trainer rank at its last step, exit 0) is left stopped."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from buffer.colocation import DeviceTurns
from buffer.keys import Keys
from buffer.registry import ServerRegistry
from core.config import load_config
from core.net import free_port_outside_ephemeral
from services.launcher import LocalStack, components
from tests.stack_helpers import stack_config


def _until(what: str, cond: Callable[[], object], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_only_the_trainer_ranks_end_their_work() -> None:
    """A rollout server or the API exits 0 at any SIGTERM (they only ever stop when told): were that an end, one
    stopped by a SIGTERM its launcher did not send would be left stopped, the run stalled without a word."""
    cfg = load_config(None, ["run.name=edges"])
    specs = components(cfg, Path("run.yaml"), None, rollout_servers=2, trainer_ranks=2)
    assert {s.name: s.ends for s in specs} == {"trainer-0": True, "trainer-1": True, "rollout-0": False,
                                               "rollout-1": False, "api": False}


@pytest.mark.parametrize("launcher", ["local", "ray_actor"])
def test_a_rollout_server_stopped_by_a_sigterm_the_launcher_did_not_send_is_restarted(
        launcher: str, tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> None:
    """A rollout server exits 0 at a SIGTERM (it stops gracefully, handing its tasks back); ``LocalStack`` and the Ray
    launcher's actor (its class, run here without Ray) left it stopped, as they leave a trainer that finished its run:
    the run went on without it, and with its only server, stalled, nothing logged."""
    from services.ray_launcher import ComponentProcess

    cfg, config = stack_config(tmp_path, f"edges-{launcher}", tiny_model_dir)
    (server,) = [s for s in components(cfg, config, redis_url, api=False) if s.name == "rollout-0"]
    with redis.Redis.from_url(redis_url) as client:
        registry = ServerRegistry(client, Keys(cfg.run.name))
        if launcher == "local":
            stack = LocalStack([server], tmp_path / "logs", poll_s=0.05, backoff_s=0.05)
            stack.start()
            pid, restarts, stop = (lambda: stack.pid("rollout-0")), (lambda: stack.restarts["rollout-0"]), stack.close
        else:
            here = dataclasses.replace(server, node_overrides=())  # no Ray node: it listens where the config says
            component = ComponentProcess(here, str(tmp_path / "logs"))
            pid, restarts, stop = component.pid, component.restarts, component.stop
        try:
            _until("the server registered", registry.live_servers)
            first = registry.live_servers()[0].started
            os.killpg(pid(), signal.SIGTERM)
            _until("the server restarted", lambda: restarts() >= 1)
            _until("the restarted server registered", lambda: [s for s in registry.live_servers() if s.started > first])
        finally:
            stop()


def test_a_colocated_server_that_starts_its_engine_clears_a_record_an_earlier_one_left(
        tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> None:
    """A colocated server that died with its engine released leaves ``device:engines`` saying so, keyed by the engine's
    URL. Its restart, with a fixed ``engine.port``, starts a new engine at that URL, which holds all its memory: it
    read the old record, took its engine for released and, in a trainer's turn, reported it released without
    pausing or releasing it (the device used by both). The record is cleared as the new engine starts."""
    port = free_port_outside_ephemeral("127.0.0.1")
    cfg, config = stack_config(tmp_path, "edges-colocated", tiny_model_dir, "placement.mode=colocated",
                               f"engine.port={port}")
    (server,) = [s for s in components(cfg, config, redis_url, api=False) if s.name == "rollout-0"]
    keys = Keys(cfg.run.name)
    url = f"http://127.0.0.1:{port}"
    with redis.Redis.from_url(redis_url) as client:
        turns = DeviceTurns(client, keys)
        turns.record_engines([url], ["weights", "kv_cache"])  # what the dead server left
        stack = LocalStack([server], tmp_path / "logs", poll_s=0.05, backoff_s=0.05)
        stack.start()
        try:
            _until("the server to register", lambda: ServerRegistry(client, keys).live_servers(), 240)
            assert turns.engines_released([url]) == []
        finally:
            stack.close()
