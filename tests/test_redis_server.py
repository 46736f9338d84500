"""The embedded redis-server: starts, serves, persists with AOF, and stops; ``connect`` picks the server."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from buffer_helpers import client

from buffer.redis_server import EmbeddedRedis, RedisStartError, client_for, connect, find_redis_server
from core.config import ConfigError, RedisConfig, load_config
from core.net import PortBusyError


def test_finds_a_redis_server_binary() -> None:
    assert find_redis_server().is_file()


def test_tcp_server_serves_on_loopback_and_stops(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r", aof=False).start()
    try:
        assert server.url.startswith("redis://127.0.0.1:")
        r = client(server)
        assert r.ping()
        assert r.config_get("bind")["bind"] == "127.0.0.1"
        assert r.config_get("appendonly")["appendonly"] == "no"
        r.close()
        pid = server.proc.pid
    finally:
        server.stop()
    assert server.proc is None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", server.port)) != 0


def test_unix_socket_server(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r", unix_socket=True) as server:
        assert server.url.startswith("unix://")
        r = client(server)
        r.set("k", "v")
        assert r.get("k") == b"v"
        assert r.config_get("port")["port"] == "0"  # no TCP listener at all
        r.close()


@pytest.mark.parametrize("crash", [False, True], ids=["sigterm", "sigkill"])
def test_aof_keeps_acknowledged_writes_across_restart(tmp_path: Path, crash: bool) -> None:
    server = EmbeddedRedis(tmp_path / "r", aof=True, appendfsync="always").start()
    try:
        r = client(server)
        r.xadd("s", {"f": b"\x00" * 1000})
        r.set("counter", 41)
        r.incr("counter")
        server.kill() if crash else server.stop()
        server.start()  # same data dir, same port
        r = client(server)
        assert r.get("counter") == b"42"
        assert r.xlen("s") == 1
        r.close()
    finally:
        server.stop()


def test_a_busy_fixed_port_is_waited_for_then_named(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(PortBusyError, match=f"redis-server: port {port} on 127.0.0.1 still in use after 2 s"):
            EmbeddedRedis(tmp_path / "r", port=port, bind_timeout_s=2).start()
        assert time.monotonic() - started >= 2
        threading.Timer(1.0, busy.close).start()  # freed while the server retries: it comes up on that port
        server = EmbeddedRedis(tmp_path / "r", port=port, bind_timeout_s=30).start()
    try:
        assert server.port == port and client(server).ping()
    finally:
        server.stop()


def test_start_failure_reports_the_log(tmp_path: Path) -> None:
    with pytest.raises(RedisStartError, match="did not start"):
        EmbeddedRedis(tmp_path / "r", binary=Path(sys.executable), start_timeout_s=5).start()


def test_connect_uses_url_env_or_starts_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    r, server = connect(RedisConfig(aof=False), tmp_path)
    try:
        assert server is not None and server.data_dir == (tmp_path / "redis").absolute()
        assert r.ping()
        mine, elsewhere = connect(RedisConfig(data_dir=tmp_path / "mine"), tmp_path / "other")
        try:  # redis.data_dir: the embedded server keeps its AOF there, not under the run directory
            assert elsewhere is not None and mine.set("k", "v")
            assert list((tmp_path / "mine").rglob("*.aof*")) and not (tmp_path / "other").exists()
        finally:
            mine.close()
            assert elsewhere is not None
            elsewhere.stop()
        r2, none = connect(RedisConfig(url=server.url), tmp_path / "other")
        assert none is None and r2.ping()
        r2.close()
        monkeypatch.setenv("REDIS_URL", server.url)
        r3, none = connect(RedisConfig(), tmp_path / "other")
        assert none is None and r3.ping()
        r3.close()
        assert not (tmp_path / "other").exists()
    finally:
        r.close()
        server.stop()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, retry=None, socket_connect_timeout=1).ping()


def _ephemeral_port() -> int:
    """A free port from a bind to 0: in the kernel's ephemeral range (32768+), where ``redis.port=0``'s own pick
    (20000-32000) never lands, so a server found on it was put there by the key."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("key", "value", "changed"), [
    ("unix_socket", "true", True),
    ("port", None, True),  # None: a free port picked at run time
    ("appendfsync", "always", "always"),
    ("aof", "false", "no"),
])
def test_embedded_server_keys_take_effect_through_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: str | None, changed: object
) -> None:
    """Each embedded-server key, set as a user sets it, changes the server ``connect`` starts, and only its own
    setting: the others stay at their defaults (TCP on a port of its own choosing, AOF on, fsync every second)."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    port, sock = _ephemeral_port(), tmp_path / "redis" / "redis.sock"
    cfg = load_config(None, [f"redis.{key}={port if value is None else value}"], env={}).redis
    r, server = connect(cfg, tmp_path)
    assert server is not None
    try:
        assert r.ping()  # the client connect hands back reaches the server, however it listens
        via = r.connection_pool.connection_kwargs
        config = {name: r.config_get(name)[name] for name in ("port", "bind", "unixsocket", "appendfsync",
                                                             "appendonly")}
        observed = {
            "unix_socket": via.get("path") == str(sock) and config["unixsocket"] == str(sock) and config["port"] == "0",
            "port": via.get("port") == port and config["port"] == str(port),
            "appendfsync": config["appendfsync"],
            "aof": config["appendonly"],
        }
        assert observed == {"unix_socket": False, "port": False, "appendfsync": "everysec", "aof": "yes", key: changed}
        if key != "unix_socket":
            assert config["bind"] == "127.0.0.1"
    finally:
        r.close()
        server.stop()


def test_a_password_never_rides_in_a_redis_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL is passed on command lines, printed and dumped with the config; redis.password is none of these."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    for url in ("redis://:hunter2hunter2@10.0.0.9:6379/0", "redis://10.0.0.9:6379/0?password=hunter2hunter2"):
        with pytest.raises(ConfigError, match=r"redis.url: .*carries a password: give it in redis.password") as err:
            load_config(None, [f"redis.url={url}"], env={})
        assert "hunter2" not in str(err.value)  # nor printed in the refusal
    monkeypatch.setenv("REDIS_URL", "redis://rollwave:hunter2hunter2@10.0.0.9:6379/0")
    with pytest.raises(ConfigError, match=r"^REDIS_URL: carries a password"):
        connect(RedisConfig(), tmp_path)
    assert not (tmp_path / "redis").exists()


@pytest.mark.parametrize("answers", [False, True], ids=["refused", "silent"])
def test_a_dead_or_silent_redis_is_an_error_naming_it_after_the_outage(answers: bool) -> None:
    """A refused connection is retried for ``outage_s``; a server that accepts and never replies fails each try
    after ``redis.timeout_s`` (here 1.2 s, not the default 5): either way the error names the server, no hang."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        if answers:
            sock.listen(64)  # the kernel accepts; nothing ever replies
        port = sock.getsockname()[1]
        url = f"redis://127.0.0.1:{port}"
        error = redis.TimeoutError if answers else redis.ConnectionError
        start = time.monotonic()
        with pytest.raises(error, match=rf"Redis at 127.0.0.1:{port}: .*retried for 2 s"):
            client_for(url, RedisConfig(url=url, timeout_s=1.2), outage_s=2.0).ping()
        elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 4.5  # the default timeout_s (5 s) would have taken longer for one try alone


def test_connect_logs_in_with_the_configured_user_and_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``redis.password`` (here from ROLLWAVE_REDIS_PASSWORD) makes the embedded server require it and every
    client send it; ``redis.username`` logs in as an ACL user, which sees only the keys its ACL grants."""
    password, user_password = "p" * 40, "u" * 40
    monkeypatch.delenv("REDIS_URL", raising=False)
    cfg = load_config(None, ["redis.aof=false"], env={"ROLLWAVE_REDIS_PASSWORD": password}).redis
    admin, server = connect(cfg, tmp_path)
    assert server is not None
    try:
        assert admin.ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, retry=None).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, retry=None, password="w" * 40).ping()
        admin.acl_setuser("rollwave", enabled=True, passwords=[f"+{user_password}"], keys=["rw:*"],
                          commands=["+@all"])
        (tmp_path / "pw").write_text(user_password + "\n")
        user_cfg = load_config(None, [f"redis.url={server.url}", "redis.username=rollwave",
                                      f"redis.password_file={tmp_path / 'pw'}"], env={})
        user, none = connect(user_cfg.redis, tmp_path / "other")
        assert none is None
        assert user.acl_whoami() == "rollwave"
        user.set("rw:x", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.set("other", 1)
        user.close()
    finally:
        admin.close()
        server.stop()
