"""Prometheus helpers: every component owns a CollectorRegistry and serves it on its own port."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from core.net import bind_retrying


def serve_metrics(registry: CollectorRegistry, component: str, host: str = "127.0.0.1", port: int = 0) -> WSGIServer:
    """Serve ``registry`` on ``http://host:port/metrics``; port 0 picks a free one (``server.server_port``),
    which the caller publishes. A busy fixed port is retried (``bind_retrying``).

    Stop it with ``server.shutdown()``.
    """
    server, _thread = bind_retrying(
        lambda p: start_http_server(p, addr=host, registry=registry), f"{component} metrics", host, port
    )
    return server
