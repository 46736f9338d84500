"""Serve an ASGI app with a real uvicorn server on 127.0.0.1 in a thread, for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core.net import listen_socket


@contextmanager
def serve_app(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Yield the base URL while the server runs; shut it down (lifespan included) on exit."""
    sock = listen_socket(host, 0, "test server")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",  # as the app's own server does
                                           http=getattr(app.state, "http_protocol", "auto")))
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


class LostReply(Response):
    """The start of a reply (``status``) and part of its body, then the connection closed: the client never gets the
    answer."""

    def __init__(self, status: int = 200) -> None:
        super().__init__(status_code=status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
