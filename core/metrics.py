"""Prometheus helpers: every component owns a CollectorRegistry and serves it on its own port."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from core.net import bind_retrying

log = logging.getLogger(__name__)
SHUTDOWN_POLL_S = 0.05
Proxy = Callable[[], tuple[str, bytes]]  # -> (content type, body)



class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


def serve_metrics(
    registry: CollectorRegistry,
    component: str,
    host: str = "127.0.0.1",
    port: int = 0,
    proxies: Mapping[str, Proxy] | None = None,
) -> WSGIServer:
    """Serve ``registry`` on ``http://host:port/metrics``; port 0 picks a free one (``server.server_port``),
    which the caller publishes. A busy fixed port is retried (``bind_retrying``).

    ``proxies`` maps further paths to a function that fetches what to serve there (a rollout server passes
    on its loopback engine's metrics); its failure is a 502 naming the error. Stop it with ``server.shutdown()``.
    """
    metrics_app = make_wsgi_app(registry)
    routes = dict(proxies or {})

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        fetch = routes.get(path)
        if fetch is None:
            return metrics_app(environ, start_response)
        try:
            content_type, body = fetch()
        except Exception as exc:  # an engine down or refusing: tell Prometheus, keep serving
            log.warning("metrics proxy %s failed: %s", path, exc)
            start_response("502 Bad Gateway", [("Content-Type", "text/plain")])
            return [f"{path}: {type(exc).__name__}: {exc}\n".encode()]
        start_response("200 OK", [("Content-Type", content_type)])
        return [body]

    server = bind_retrying(
        lambda p: make_server(host, p, app, ThreadingWSGIServer, handler_class=_QuietHandler),
        f"{component} metrics", host, port,
    )
    # shutdown() waits for the loop's next poll: 0.5 s by default, on every component's way out
    threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), name=f"metrics-{server.server_port}",
                     daemon=True).start()
    return server
