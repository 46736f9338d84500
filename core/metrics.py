"""Prometheus helpers: every component owns a CollectorRegistry and serves it on its own port."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> WSGIServer:
    """Serve ``registry`` on ``http://host:port/metrics``; port 0 picks a free one (``server.server_port``).

    Stop it with ``server.shutdown()``.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
