"""The REST API while its Redis is gone or stuck: each request is a prompt 503 naming Redis, never a 500 or a
request held for the whole outage budget the other components ride out; the API answers again once Redis does."""

from __future__ import annotations

import os
import secrets
import signal
import threading
from pathlib import Path

import httpx

from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from services.client_cmd import wait_for_job
from tests.http_harness import serve_app

TOKEN = secrets.token_urlsafe(32)
TIMEOUT_S = 1.5  # redis.timeout_s, under the 5 s default: the bound of each request's wait for Redis
HELD_S = 30.0  # half the outage budget of client_for: a request that waits it out is held, not answered promptly


def _refused_redis(api: httpx.Client) -> float:
    prefix = 'rollwave_api_requests_refused_total{reason="redis"} '
    return next((float(line.removeprefix(prefix)) for line in api.get("/metrics").text.splitlines()
                 if line.startswith(prefix)), 0.0)


def _assert_prompt_503(api: httpx.Client, method: str, path: str, peer: str, **kwargs: object) -> None:
    """A request held for the outage budget the components ride out (``client_for``'s 60 s) times out at half of it."""
    reply = api.request(method, path, timeout=HELD_S, **kwargs)  # type: ignore[arg-type]
    assert reply.status_code == 503, (path, reply.status_code, reply.text)
    assert f"Redis at {peer}" in reply.text, (path, reply.text)


def test_redis_down_or_stuck_is_a_prompt_503_naming_redis(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        peer = f"{server.host}:{server.port}"
        cfg = load_config(None, ["run.name=api-down", f"redis.url={server.url}", f"redis.timeout_s={TIMEOUT_S}",
                                 f"api.token={TOKEN}"], env={})
        with serve_app(create_app(cfg)) as url, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
            assert api.get("/v1/status").status_code == 200
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)  # stuck: connections accepted, nothing answered
            try:
                _assert_prompt_503(api, "GET", "/v1/status", peer)
                _assert_prompt_503(api, "GET", "/readyz", peer)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert api.get("/v1/status").status_code == 200  # the outage is over: answered again
            server.stop()  # gone: connections refused
            _assert_prompt_503(api, "GET", "/v1/jobs", peer)
            _assert_prompt_503(api, "GET", "/v1/jobs/abc", peer)
            _assert_prompt_503(api, "POST", "/v1/jobs", peer, json={"source": {"kind": "arith", "limit": 1}})
            assert _refused_redis(api) == 4  # /readyz is a probe: its 503 is its answer, not a refusal


def test_a_wait_rides_out_the_apis_503s_while_its_redis_is_away(tmp_path: Path) -> None:
    """``rollwave submit --wait`` can run for hours: a Redis restart meanwhile (the API answering 503) keeps the
    wait going, and the job's end after it is seen. Redis stops right after the wait's first poll."""
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        cfg = load_config(None, ["run.name=api-wait", f"redis.url={server.url}", f"redis.timeout_s={TIMEOUT_S}",
                                 f"api.token={TOKEN}"], env={})
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with serve_app(create_app(cfg)) as url:
            job_id = httpx.post(f"{url}/v1/jobs", json={"source": {"kind": "arith", "limit": 2}}, headers=auth,
                                timeout=30).json()["job_id"]
            assert server.proc is not None
            pid, polls = server.proc.pid, []

            def back_and_cancel() -> None:
                os.kill(pid, signal.SIGCONT)
                httpx.post(f"{url}/v1/jobs/{job_id}/cancel", headers=auth, timeout=30).raise_for_status()

            def stop_redis_after_first_poll(reply: httpx.Response) -> None:
                polls.append(reply.status_code)
                if len(polls) == 1:
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(3 * TIMEOUT_S, back_and_cancel).start()

            with httpx.Client(base_url=url, headers=auth, timeout=30,
                              event_hooks={"response": [stop_redis_after_first_poll]}) as client:
                job = wait_for_job(client, job_id, timeout_s=60, poll_s=0.1)
        assert job["state"] == "cancelled" and 503 in polls, (job, polls)
