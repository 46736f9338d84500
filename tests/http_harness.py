"""Serve an ASGI app with a real uvicorn server on 127.0.0.1 in a thread, for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from core.net import listen_socket


@contextmanager
def serve_app(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Yield the base URL while the server runs; shut it down (lifespan included) on exit."""
    sock = listen_socket(host, 0, "test server")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
