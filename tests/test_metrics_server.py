"""A component's metrics server (``core.metrics.serve_metrics``) and what a rollout server passes on through it."""

from __future__ import annotations

import httpx
from net_helpers import refused_port
from prometheus_client import CollectorRegistry

from core.metrics import serve_metrics
from rollout_server.__main__ import engine_metrics


def test_an_engine_metrics_proxy_that_fails_names_the_engine() -> None:
    """A rollout server passes on its engines' /metrics: a dead engine is a 502 naming its URL and the stage (an
    httpx error's own text may be only "timed out")."""
    with refused_port() as port, httpx.Client(timeout=2) as http:
        dead = f"http://127.0.0.1:{port}"
        server = serve_metrics(CollectorRegistry(), "test", "127.0.0.1", 0,
                               proxies={"/engine/0/metrics": engine_metrics(http, dead)})
        try:
            reply = httpx.get(f"http://127.0.0.1:{server.server_port}/engine/0/metrics", timeout=10)
        finally:
            server.shutdown()
            server.server_close()
    assert reply.status_code == 502 and f"engine metrics from {dead}/metrics: ConnectError" in reply.text, reply.text
