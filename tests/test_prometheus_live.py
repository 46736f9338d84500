"""Every Grafana panel query returns data from a running stack, evaluated by a real Prometheus.

The stack runs as real processes (``services.launcher``): one rollout server with its embedded
engine (on loopback, keyed; the server passes its metrics on at ``/engine/0/metrics``) and
checkpoint receiver, one trainer rank pushing a version every step, and the API, on the
embedded Redis, every port 0. Prometheus (Debian's package, from PATH) scrapes them with the jobs
of ``deploy/prometheus/prometheus.yml``, targets replaced by the addresses the components published in
Redis. The policy is the tiny model after a short SFT warm start, so it really calls the calculator
and the tool panels have samples. Each query of ``deploy/grafana/dashboards/rollwave.json`` must return at least one
finite sample through ``/api/v1/query``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from buffer_helpers import client
from prometheus_harness import PrometheusHarness, load_dashboard, panel_queries

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from core.config import dump_config, load_config
from core.tasks import load_tasks
from services.launcher import LocalStack, components, ensure_checkpoint_token, published_api_url
from trainer.sft import warm_start

N_TASKS = 400  # far more than the test consumes: the trainer must still be running when Prometheus is asked


def _sample_values(prom: PrometheusHarness, expr: str) -> list[float]:
    return [float(sample["value"][1]) for sample in prom.query(expr)]


def _wait(what: str, cond: Callable[[], Any], stack: LocalStack, prom: PrometheusHarness | None,
          timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            health = [(t["labels"]["job"], t["health"], t["lastError"]) for t in prom.targets()] if prom else []
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                             for p in sorted(stack.log_dir.glob("*.log")))
            raise AssertionError(f"timed out waiting for {what}; targets {health}\n{logs}")
        time.sleep(0.5)
    return got


def _no_data(prom: PrometheusHarness, queries: list[str]) -> dict[str, list[float]]:
    """The queries that return no sample, or a NaN/inf one, with what they returned."""
    bad = {}
    for expr in queries:
        values = _sample_values(prom, expr)
        if not values or not all(math.isfinite(v) for v in values):
            bad[expr] = values
    return bad


@pytest.mark.slow
def test_every_dashboard_query_returns_data(tmp_path: Path, tiny_model_dir: Path, redis_server: EmbeddedRedis) -> None:
    queries = panel_queries(load_dashboard())
    assert len(queries) >= 20
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine two threads run several times slower than one
    try:
        model = warm_start(tiny_model_dir, tmp_path / "sft", load_tasks("arith", split="train", limit=256, seed=1),
                           steps=60, batch_size=16, lr=3e-3)
    finally:
        torch.set_num_threads(threads)
    cfg = load_config(None, [
        "run.name=prom", f"run.dir={tmp_path}", f"model.path={model}", "model.init_if_missing=false",
        "rollout.n_samples=2", "rollout.max_turns=2", "rollout.max_new_tokens=40", "rollout.heartbeat_s=0.5",
        "rollout.max_concurrent_groups=2", "rollout.shutdown_grace_s=2", "buffer.groups_per_step=2",
        "trainer.total_steps=1000", "trainer.take_timeout_s=1",
        "trainer.threads=1", "engine.threads=1", "engine.max_batch_size=8", f"checkpoint.stage_dir={tmp_path}/stage",
        "api.port=0",  # every port is 0: Prometheus scrapes what the components published
    ])
    ensure_checkpoint_token(cfg)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(cfg))
    specs = components(cfg, config_path, redis_server.url, rollout_servers=1, trainer_ranks=1, api=True)
    keys = Keys(cfg.run.name)
    r = client(redis_server)
    job = {"kind": "train", "name": "prom", "source": {"kind": "arith", "split": "train", "limit": N_TASKS, "seed": 7}}
    with LocalStack(specs, tmp_path / "logs") as stack:
        api_url = published_api_url(r, keys, timeout_s=90)
        assert httpx.post(f"{api_url}/v1/jobs", json=job, timeout=30).status_code == 201
        [server] = _wait("rollout-0 registered", ServerRegistry(r, keys).live_servers, stack, None, timeout_s=120)
        trainer_metrics = _wait("the trainer's metrics address", lambda: r.hget(keys.trainer, "metrics_address"),
                                stack, None, timeout_s=120).decode()
        targets = {
            "rollwave-api": [api_url.removeprefix("http://")],
            "rollwave-trainer": [trainer_metrics],
            "rollwave-rollout": [server.metrics_address],
            # the engine listens on loopback with a key; its rollout server passes its metrics on
            "rollwave-engine": [server.metrics_address],
        }
        assert all(t[0].startswith("127.0.0.1:") and not t[0].endswith(":0") for t in targets.values()), targets
        with PrometheusHarness(targets, tmp_path / "prometheus") as prom:
            _check_panels(stack, prom, queries)
        assert stack.restarts == {spec.name: 0 for spec in specs}


def _check_panels(stack: LocalStack, prom: PrometheusHarness, queries: list[str]) -> None:
    def seen(expr: str) -> Callable[[], bool]:
        return lambda: bool(prom.query(expr))

    _wait("every target up", lambda: _sample_values(prom, "min(up)") == [1.0], stack, prom, timeout_s=120)
    _wait("trainer step 2", seen("rollwave_trainer_step >= 2"), stack, prom, timeout_s=120)
    _wait("a weight commit", seen("rollwave_rollout_policy_version >= 1"), stack, prom, timeout_s=60)
    _wait("completed groups", seen("rollwave_rollout_groups_completed_total > 0"), stack, prom, timeout_s=60)
    _wait("tool calls", seen("sum(rollwave_rollout_tool_calls_total) > 0"), stack, prom, timeout_s=60)
    deadline = time.monotonic() + 60  # rates need two scrapes of a counter that moved in their window
    while (no_data := _no_data(prom, queries)) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert no_data == {}
