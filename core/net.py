"""Network helpers shared by every component: servers bind loopback unless configured otherwise.

Ports are never picked by one process and bound by another later (that port can be taken in
between). A component binds port 0 and publishes the address it got (registry, trainer status, API
record in Redis); a port fixed by config (compose, Helm) is bound with SO_REUSEADDR and retried while
it is busy, for a bounded time, then fails naming the component and the port.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import random
import socket
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
T = TypeVar("T")
BIND_RETRY_S = 30.0  # how long a busy configured port is waited for (a restart's old socket, a slow exit)

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 literal in brackets (RFC 3986): ``http://::1:8000`` names no port."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class PortBusyError(OSError):
    """A configured port stayed in use for the whole retry window."""


def bind_retrying(bind: Callable[[int], T], component: str, host: str, port: int,
                  timeout_s: float = BIND_RETRY_S) -> T:
    """``bind(port)``, retried with backoff while it raises EADDRINUSE on a fixed port.

    Port 0 is not retried: the kernel picks a free port, which cannot collide.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            return bind(port)
        except OSError as exc:
            if port == 0 or exc.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                raise PortBusyError(
                    errno.EADDRINUSE,
                    f"{component}: port {port} on {host} still in use after {timeout_s:.0f} s "
                    "(stop what holds it, or configure port 0 to take any free one)",
                ) from exc
            if delay == 0.05:
                log.warning("%s: port %d on %s is in use; retrying for up to %.0f s", component, port, host, timeout_s)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)


def listen_socket(host: str, port: int, component: str, timeout_s: float = BIND_RETRY_S) -> socket.socket:
    """A listening TCP socket on ``host:port`` (SO_REUSEADDR; a busy fixed port is retried, see ``bind_retrying``).

    Hand it to the server (uvicorn's ``sockets=``); ``getsockname()`` says which port it got.
    """

    def bind(p: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, p))
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
        return sock

    return bind_retrying(bind, component, host, port, timeout_s)


MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers, as a server of ours reads them (nginx's default: 32 KiB)


def guarded_http(on_refused: Callable[[tuple[str, int] | None, str, str], None],
                 max_head_bytes: int = MAX_HEAD_BYTES, headers: Mapping[str, str] | None = None
                 ) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol that refuses, before the app sees them, a request whose line and headers run past
    ``max_head_bytes``, judged once each read is parsed, so at most one read more is held (httptools sets no limit:
    one endless header held its bytes until the server ran out of memory, before any token was checked) and calls
    ``on_refused(client, reason, detail)`` for it (``header_size``) and for each request uvicorn answers with its own
    bare 400 (``bad_http``: bytes that are not HTTP, a bad request line, a header it cannot parse; it logs "Invalid
    HTTP request received." on ``uvicorn.error``), so the server counts those as refusals. Both get uvicorn's 400,
    with ``headers`` added (the app's middleware, which sets them on the app's replies, never sees these), and the
    connection is closed. Pass it as uvicorn's ``http=``; a class of its own per server, so each server counts only
    its own."""
    extra = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()]

    class GuardedHTTP(HttpToolsProtocol):
        head_bytes: int | None = 0  # of the request head being read; None while its body is

        def data_received(self, data: bytes) -> None:
            if self.head_bytes is not None:
                self.head_bytes += len(data)
            super().data_received(data)  # a head that ends in ``data`` sets None: its body's bytes never count
            if self.head_bytes is not None and self.head_bytes > max_head_bytes and not self.transport.is_closing():
                on_refused(self.client, "header_size", f"a request line and headers over {max_head_bytes} bytes")
                self._send_own_400(f"Request line and headers over {max_head_bytes} bytes.")

        def on_headers_complete(self) -> None:
            self.head_bytes = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self.head_bytes = 0
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            on_refused(self.client, "bad_http", "not valid HTTP, answered 400 by uvicorn")
            self._send_own_400(msg)

        def _send_own_400(self, msg: str) -> None:
            """uvicorn's 400 with ``headers`` among the server's own (``Config.headers``, and its date and name) for
            this reply only: a request's reply takes those as they are when it starts, and gets the app's."""
            state = self.server_state
            own = state.default_headers
            state.default_headers = [*own, *extra]
            try:
                super().send_400_response(msg)
            finally:
                state.default_headers = own

    return GuardedHTTP


def free_port_outside_ephemeral(host: str = "127.0.0.1", low: int = 20_000, high: int = 32_000) -> int:
    """A free port below the kernel's ephemeral range (32768+) and above Ray's worker ports (10002-19999).

    Only for a port every process of a group must know before any of them starts (the Ray head's, the
    trainer ranks' rendezvous): no port-0 bind can take it in between.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in [{low}, {high}) on {host}")
