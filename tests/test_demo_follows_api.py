"""The demo follows the run's API across a restart: the launcher restarts an API that crashed, on another port
(``api.port=0``), and the demo's requests go to the URL it publishes then; one that never comes back ends the wait
naming the API and the demo's stage.

A real API process under a real ``LocalStack`` and a real Redis on 127.0.0.1; no trainer, no rollout server.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest
import redis
from net_helpers import refused_port
from pydantic import SecretStr

from buffer.keys import Keys
from services.demo import ApiClient
from services.launcher import LocalStack, components
from tests.stack_helpers import stack_config, wait_for


def test_a_request_after_the_api_restarted_goes_to_the_url_it_published(tmp_path: Path, redis_url: str,
                                                                       tiny_model_dir: Path) -> None:
    """The API is killed and restarted by the stack: the demo kept its first URL, and its next poll failed with a
    refused connection (``make demo`` ended there). Now the poll is sent again to the restarted API's URL."""
    cfg, config = stack_config(tmp_path, "follow", tiny_model_dir, "api.port=0")
    cfg.api.token = SecretStr(secrets.token_urlsafe(32))
    (api_spec,) = [s for s in components(cfg, config, redis_url) if s.name == "api"]
    keys = Keys(cfg.run.name)
    auth = {"Authorization": f"Bearer {cfg.api.token.get_secret_value()}"}
    with LocalStack([api_spec], tmp_path / "logs", poll_s=0.05, backoff_s=0.05) as stack, \
            redis.Redis.from_url(redis_url) as client, \
            ApiClient(client, keys, stack.check_refused, headers=auth, timeout=30) as api:
        api.stage = "the test's polls"
        assert api.get("/v1/status").status_code == 200
        first_pid = int(client.hget(keys.api, "pid"))
        assert stack.kill("api")
        wait_for("the API restarted", lambda: stack.restarts["api"] == 1, stack)  # the killed one is gone
        reply = api.get("/v1/status")
        assert reply.status_code == 200, reply.text
        assert int(client.hget(keys.api, "pid")) != first_pid  # the restarted API answered, at the URL it published
        assert str(api.base_url).rstrip("/") == client.hget(keys.api, "url").decode()


@pytest.mark.parametrize(("follow_s", "timeout", "error", "ends"), [
    (1.0, None, TimeoutError, "within 1 s (see its log)"),
    (60.0, 0.5, httpx.ConnectTimeout, "within 0.5 s: the request's connect timeout"),
], ids=["follow_s", "request_timeout"])
def test_an_api_that_publishes_no_address_that_answers_ends_the_wait_naming_it_and_the_stage(
        redis_url: str, follow_s: float, timeout: float | None, error: type[Exception], ends: str) -> None:
    """The published address refuses connections and no other comes: the request fails naming the run's API, its
    address and what the demo was doing, after ``follow_s`` (``TimeoutError``), or sooner after the request's own
    connect timeout (``httpx.ConnectTimeout``, as a connect would: ``wait_for_job`` bounds each poll by what is left
    of its deadline so, and rides that out as an outage; the follow used to wait out the whole ``follow_s``)."""
    keys = Keys("gone")
    with refused_port() as port, redis.Redis.from_url(redis_url) as client:
        client.hset(keys.api, mapping={"url": f"http://127.0.0.1:{port}", "pid": 1})
        try:
            with ApiClient(client, keys, follow_s=follow_s, timeout=5) as api:
                api.stage = "the held-out eval before RL"
                with pytest.raises(error) as exc:
                    api.get("/v1/status", **({} if timeout is None else {"timeout": timeout}))
        finally:
            client.delete(keys.api)
    assert str(exc.value) == (f"the API of run gone refused connections at http://127.0.0.1:{port} during the "
                              f"held-out eval before RL, and published no address that takes one {ends}")
