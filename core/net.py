"""Network helpers shared by every component: servers bind loopback unless configured otherwise."""

from __future__ import annotations

import ipaddress
import random
import socket

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_outside_ephemeral(host: str = "127.0.0.1", low: int = 20_000, high: int = 32_000) -> int:
    """A free port below the kernel's ephemeral range (32768+) and above Ray's worker ports (10002-19999).

    For a port handed to a process that binds it only later, alongside others that bind port 0 (Ray's
    own servers): an ephemeral port from ``free_port`` could be taken in between, one from here cannot.
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
