"""Binding ports: 0 takes any free port; a busy fixed port is retried for a bounded time, then named;
the launcher hands no component a port."""

from __future__ import annotations

import errno
import socket
import threading
import time
from pathlib import Path

import pytest

from core.config import load_config
from core.net import PortBusyError, bind_retrying, listen_socket
from services.launcher import components


def _busy() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_port_0_binds_a_free_port_beside_a_busy_one() -> None:
    with _busy() as busy, listen_socket("127.0.0.1", 0, "test") as sock:
        assert sock.getsockname()[1] not in (0, busy.getsockname()[1])


def test_a_busy_fixed_port_is_retried_until_it_is_freed() -> None:
    busy = _busy()
    port = busy.getsockname()[1]
    threading.Timer(0.5, busy.close).start()
    started = time.monotonic()
    with listen_socket("127.0.0.1", port, "test", timeout_s=30) as sock:
        assert sock.getsockname()[1] == port
    assert time.monotonic() - started >= 0.5


def test_a_port_busy_for_the_whole_window_is_an_error_naming_component_and_port() -> None:
    with _busy() as busy:
        port = busy.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(PortBusyError, match=f"engine: port {port} on 127.0.0.1 still in use after 1 s") as exc:
            listen_socket("127.0.0.1", port, "engine", timeout_s=1.0)
        assert exc.value.errno == errno.EADDRINUSE
        assert 1.0 <= time.monotonic() - started < 5.0


def test_other_errors_and_port_0_are_not_retried() -> None:
    calls: list[int] = []

    def refuse(port: int) -> None:
        calls.append(port)
        raise OSError(errno.EADDRINUSE if port == 0 else errno.EACCES, "no")

    for port in (0, 80):
        with pytest.raises(OSError) as exc:
            bind_retrying(refuse, "test", "127.0.0.1", port, timeout_s=30)
        assert not isinstance(exc.value, PortBusyError)
    assert calls == [0, 80]


def test_the_launcher_hands_components_no_ports(tmp_path: Path) -> None:
    """Each component binds what its config says (0: any free port) and publishes it; only a pool of
    trainer ranks shares a rendezvous port, from below the ephemeral range that port-0 binds draw from."""
    for ranks in (1, 2):
        specs = components(load_config(), tmp_path / "c.yaml", "redis://127.0.0.1:1/0", rollout_servers=2,
                           trainer_ranks=ranks)
        assert not [a for s in specs for a in s.argv if "port=" in a]
        masters = {s.env.get("MASTER_PORT") for s in specs if s.name.startswith("trainer-")}
        if ranks == 1:
            assert masters == {None}
        else:
            [master] = masters
            assert 20_000 <= int(master) < 32_000
