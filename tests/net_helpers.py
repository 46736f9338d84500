"""Loopback sockets for tests: a port that refuses connections, one to serve on later, and a proxy that injects
network faults."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port but not listening: connections to it are refused until a server
    (uvicorn's ``sockets=``, which listens on it) takes it over, and no other process can take the port."""
    sock = socket.socket()
    sock.bind((host, 0))
    return sock


@contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port that refuses connections for the length of the block (held, never listened on)."""
    with bound_socket(host) as sock:
        yield sock.getsockname()[1]


class LoopbackProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream``, for injecting network faults: each connection is pumped
    both ways by a thread per direction, and ``passes`` decides per chunk read whether it goes on (a fault closes
    the connection there, as a dropped link). ``close()`` stops every connection and thread."""

    def __init__(self, upstream: tuple[str, int], wait_s: float = 60.0) -> None:
        self.upstream = upstream
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._spawn(self._accept)

    def opened(self, pair: tuple[socket.socket, socket.socket]) -> None:
        """A connection (client, upstream) was accepted, before any of its bytes pass."""

    def passes(self, pair: tuple[socket.socket, socket.socket], to_upstream: bool, data: bytes) -> bool:
        """Whether ``data`` read on one side of ``pair`` (client, upstream) goes on; False closes the connection
        (after whatever the override did to it). Every chunk passes here."""
        return True

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.upstream, timeout=self.wait_s)
            upstream.settimeout(None)
            with self.lock:
                self._sockets += [client, upstream]
            pair = (client, upstream)
            self.opened(pair)
            self._spawn(self._pump, pair, True)
            self._spawn(self._pump, pair, False)

    def _pump(self, pair: tuple[socket.socket, socket.socket], to_upstream: bool) -> None:
        src, dst = pair if to_upstream else pair[::-1]
        try:
            while (data := src.recv(1 << 16)) and self.passes(pair, to_upstream, data):
                dst.sendall(data)
        except OSError:
            pass
        for sock in pair:  # shutdown wakes the other direction's recv, and each peer sees the close
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self.lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(self.wait_s)
        for sock in sockets:
            sock.close()
