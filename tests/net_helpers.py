"""Loopback sockets for tests: a port that refuses connections, and one to serve on later."""

from __future__ import annotations

import socket
from collections.abc import Iterator
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
