"""A request that is not valid HTTP is answered 400 by uvicorn itself, and one whose head runs past
``core.net.MAX_HEAD_BYTES`` by our protocol (``guarded_http``), before the app sees either: the API, the rollout
server's episode endpoint and the embedded engine still log and count them as refusals (``bad_http``,
``header_size``), each server only its own. No reply names the server's software (uvicorn's ``server`` header)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from buffer_helpers import client
from prometheus_client.parser import text_string_to_metric_families

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from core.metrics import serve_metrics
from core.net import MAX_HEAD_BYTES
from rollout_server.metrics import RolloutMetrics
from rollout_server.openai_api import EpisodeStore
from tests.test_bind_addresses import component, wait_for

RUN = "badhttp"
NOT_HTTP = {
    "garbage": b"GARBAGE\r\n\r\n",
    "request_line": b"GET / HTTP/9.9\r\n\r\n",
    "header_name": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
    "header_value": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad: a\x01b\r\n\r\n",
}
# a head one byte over the limit, its end never sent: the server refuses it at its last byte, and then has read all
# of it (so it closes with a FIN, not a reset that could lose its reply)
_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
TOO_BIG_HEAD = _HEAD + b"a" * (MAX_HEAD_BYTES + 1 - len(_HEAD))
IO_TIMEOUT_S = 30.0


def counted(metrics_url: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` that ``metrics_url`` serves; 0 while the label set has none."""
    text = httpx.get(metrics_url, timeout=IO_TIMEOUT_S).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and sample.labels == labels)


def job_in_one_write(body_bytes: int) -> bytes:
    """A POST of an inline job whose body is about ``body_bytes`` (one task's long prompt), head and body together, as
    one write: the server reads them in one piece, and only the head counts against the head's limit."""
    task = {"task_id": "long", "messages": [{"role": "user", "content": "q" * body_bytes}],
            "reward": {"ground_truth": "1"}}
    body = json.dumps({"source": {"kind": "inline", "tasks": [task]}}).encode()
    return (b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def send_raw(url: str, data: bytes) -> bytes:
    """``data`` as it is over a new connection to ``url`` (http://host:port); the whole reply, until the server
    closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def names_server(reply: bytes) -> bool:
    """Whether a raw reply's head has a ``server`` header (uvicorn's, naming its software, unless turned off)."""
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    return any(line.startswith(b"server:") for line in head.split(b"\r\n"))


async def send_raw_async(url: str, data: bytes) -> bytes:
    """``send_raw`` from inside the event loop that serves ``url``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), IO_TIMEOUT_S)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), IO_TIMEOUT_S)
    finally:
        writer.close()


def test_the_api_counts_what_it_refuses_before_its_app(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    """``python -m services.api``: each request uvicorn cannot parse (bytes that are not HTTP, a bad request line, an
    invalid header name or value) gets uvicorn's 400 and adds exactly 1 to
    ``rollwave_api_requests_refused_total{reason="bad_http"}``; uvicorn's warning and the API's refusal line, naming
    the client, are both in the log. A head of 63 KiB is served, and so is a job of 100 KB whose head and body come in
    one read; a head over 64 KiB (unbounded before: the API held every byte of an endless header) is a 400 counted
    ``header_size``."""
    log = tmp_path / "api.log"
    overrides = [f"run.name={RUN}", f"run.dir={tmp_path}", f"redis.url={redis_server.url}", "api.port=0"]
    r = client(redis_server)
    with component("services.api", log, *overrides) as proc:
        url = wait_for("the API's published URL", lambda: r.hget(Keys(RUN).api, "url"), proc, log,
                       timeout_s=60).decode()
        name, labels = "rollwave_api_requests_refused_total", {"reason": "bad_http"}
        for case, data in NOT_HTTP.items():
            before = counted(f"{url}/metrics", name, **labels)
            reply = send_raw(url, data)
            assert reply.startswith(b"HTTP/1.1 400 "), (case, reply)
            assert not names_server(reply), reply
            assert counted(f"{url}/metrics", name, **labels) == before + 1, case
        healthz = httpx.get(f"{url}/healthz", timeout=IO_TIMEOUT_S)
        assert healthz.status_code == 200 and "server" not in healthz.headers, healthz.headers
        assert counted(f"{url}/metrics", name, **labels) == len(NOT_HTTP)
        big = {"X-Big": "a" * (MAX_HEAD_BYTES - 1024)}  # a head under the limit is served
        assert httpx.get(f"{url}/healthz", headers=big, timeout=IO_TIMEOUT_S).status_code == 200
        reply = send_raw(url, job_in_one_write(100_000))  # a small head and a big body in one read: served
        assert reply.startswith(b"HTTP/1.1 201 "), reply[:300]
        reply = send_raw(url, TOO_BIG_HEAD)
        assert reply.startswith(b"HTTP/1.1 400 ") and b"over 65536 bytes" in reply, reply
        assert counted(f"{url}/metrics", name, reason="header_size") == 1
        text = log.read_text(errors="replace")
    assert text.count("Invalid HTTP request received.") == len(NOT_HTTP), text
    assert text.count("refused - - from 127.0.0.1: bad_http") == len(NOT_HTTP), text
    assert text.count("refused - - from 127.0.0.1: header_size: a request line and headers over 65536 bytes") == 1


def test_the_episode_endpoint_counts_what_uvicorn_refuses_as_bad_http(
        tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Two episode endpoints served in one process: garbage bytes sent to one get uvicorn's 400 and add exactly 1 to
    its ``rollwave_rollout_openai_requests_total{outcome="bad_http"}`` on its /metrics, logged, and nothing to the
    other's."""
    stores = [EpisodeStore(tokenizer, "rollwave", RolloutMetrics()) for _ in range(2)]
    servers = [serve_metrics(store.metrics.registry, "rollout") for store in stores]
    name, labels = "rollwave_rollout_openai_requests_total", {"outcome": "bad_http"}

    async def main() -> bytes:
        async with stores[0].serving("127.0.0.1", 0) as url, stores[1].serving("127.0.0.1", 0):
            return await send_raw_async(url, NOT_HTTP["garbage"])

    try:
        with caplog.at_level(logging.WARNING, logger="rollout_server.openai_api"):
            reply = asyncio.run(main())
        scraped = [counted(f"http://127.0.0.1:{server.server_port}/metrics", name, **labels) for server in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert reply.startswith(b"HTTP/1.1 400 ") and not names_server(reply), reply
    assert scraped == [1, 0]
    assert [m for m in caplog.messages if "bad_http" in m] == [
        "refused a request from 127.0.0.1 (400 bad_http): not valid HTTP, answered 400 by uvicorn"]
