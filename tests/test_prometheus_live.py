"""Every Grafana panel query returns data from a running stack, evaluated by a real Prometheus.

The stack runs as real processes (``services.launcher``): one rollout server with its embedded
engine and checkpoint receiver, one trainer rank pushing a version every step, and the API, on the
embedded Redis. Prometheus (Debian's ``/usr/bin/prometheus``) scrapes them with the jobs of
``deploy/prometheus/prometheus.yml``, targets replaced by the stack's 127.0.0.1 ports. The policy is
the tiny model after a short SFT warm start, so it really calls the calculator and the tool panels
have samples. Each query of ``deploy/grafana/dashboards/rollwave.json`` must return at least one
finite sample through ``/api/v1/query``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_harness import PrometheusHarness, load_dashboard, panel_queries

from buffer.redis_server import EmbeddedRedis
from core.config import dump_config, load_config
from core.net import free_port
from core.tasks import load_tasks
from services.launcher import LocalStack, components
from tests.stack_helpers import port_of
from trainer.sft import warm_start

N_TASKS = 400  # far more than the test consumes: the trainer must still be running when Prometheus is asked


def _sample_values(prom: PrometheusHarness, expr: str) -> list[float]:
    return [float(sample["value"][1]) for sample in prom.query(expr)]


def _wait(what: str, cond: Callable[[], bool], stack: LocalStack, prom: PrometheusHarness, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            health = [(t["labels"]["job"], t["health"], t["lastError"]) for t in prom.targets()]
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                             for p in sorted(stack.log_dir.glob("*.log")))
            raise AssertionError(f"timed out waiting for {what}; targets {health}\n{logs}")
        time.sleep(0.5)


def _no_data(prom: PrometheusHarness, queries: list[str]) -> dict[str, list[float]]:
    """The queries that return no sample, or a NaN/inf one, with what they returned."""
    bad = {}
    for expr in queries:
        values = _sample_values(prom, expr)
        if not values or not all(math.isfinite(v) for v in values):
            bad[expr] = values
    return bad


def test_only_trainer_rank_0_gets_a_metrics_port(tmp_path: Path) -> None:
    specs = {s.name: s for s in components(load_config(), tmp_path / "c.yaml", "redis://127.0.0.1:1/0",
                                           trainer_ranks=2, api=False)}
    assert port_of(specs["trainer-0"], "trainer.metrics_port") > 0
    assert not [a for a in specs["trainer-1"].argv if a.startswith("trainer.metrics_port=")]


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
        "trainer.total_steps=1000", "trainer.stop_when_drained=true", "trainer.take_timeout_s=1",
        "trainer.threads=1", "engine.threads=1", "engine.max_batch_size=8", f"checkpoint.stage_dir={tmp_path}/stage",
        f"api.port={free_port()}",
    ])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(cfg))
    specs = components(cfg, config_path, redis_server.url, rollout_servers=1, trainer_ranks=1, api=True)
    by_name = {s.name: s for s in specs}
    targets = {
        "rollwave-api": [f"127.0.0.1:{cfg.api.port}"],
        "rollwave-trainer": [f"127.0.0.1:{port_of(by_name['trainer-0'], 'trainer.metrics_port')}"],
        "rollwave-rollout": [f"127.0.0.1:{port_of(by_name['rollout-0'], 'rollout.metrics_port')}"],
        "rollwave-engine": [f"127.0.0.1:{port_of(by_name['rollout-0'], 'engine.port')}"],
    }
    with LocalStack(specs, tmp_path / "logs") as stack, \
            PrometheusHarness(targets, tmp_path / "prometheus") as prom, \
            httpx.Client(base_url=f"http://127.0.0.1:{cfg.api.port}", timeout=30) as api:

        def api_ready() -> bool:
            try:
                return api.get("/readyz").status_code == 200
            except httpx.TransportError:
                return False

        _wait("the API", api_ready, stack, prom, timeout_s=90)
        job = {"kind": "train", "name": "prom", "source": {"kind": "arith", "split": "train", "limit": N_TASKS,
                                                           "seed": 7}}
        assert api.post("/v1/jobs", json=job).status_code == 201

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
        assert stack.restarts == {name: 0 for name in by_name}
