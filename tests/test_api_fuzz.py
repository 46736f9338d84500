"""Property-based fuzz of the REST API from its own OpenAPI schema (schemathesis): no input gets a 500.

The real app runs under uvicorn on 127.0.0.1 against a real Redis, with auth on; every generated
request carries the bearer token, so the fuzz reaches the handlers rather than stopping at 401.
Schemathesis generates valid requests (accepted jobs, pages of trajectories) and invalid ones (wrong
types, out-of-range numbers, unknown fields) for every operation in the schema; only the dashboard
files, which are not in the schema, are left out. Random job ids almost never exist, so the
operations on one job are fuzzed a second time with the id of a real job whose trajectory stream has
entries: that is how cursors at the edges of the stream-id space reach Redis.

Bounds: Hypothesis runs 40 examples per operation without a deadline. The slowest valid input is an
arith job at the spec's bounds (``limit`` and ``offset`` <= 100_000: the generator makes
offset+limit problems, ~6 s per 100k here), which is why ``TaskSource.offset`` has an upper bound.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from tests.http_harness import serve_app

TOKEN = secrets.token_urlsafe(32)
RUN = "fuzz"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

schema = schemathesis.openapi.from_dict(create_app(load_config(None, [])).openapi())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, id of a job with three trajectory entries)."""
    with EmbeddedRedis(Path(tmp_path_factory.mktemp("fuzz")) / "redis", aof=False) as redis_server:
        cfg = load_config(None, [f"run.name={RUN}", f"redis.url={redis_server.url}", f"api.token={TOKEN}"])
        with serve_app(create_app(cfg)) as url:
            reply = httpx.post(f"{url}/v1/jobs", json={"kind": "eval", "source": {"kind": "arith", "limit": 3}},
                               headers=AUTH, timeout=30)
            assert reply.status_code == 201, reply.text
            job_id = reply.json()["job_id"]
            client = redis.Redis.from_url(redis_server.url)
            for index in range(3):
                sample = {"group_id": f"g{index}", "sample_index": 0, "reward": 1.0, "finish_reason": "stop",
                          "messages": [{"role": "user", "content": "1+1?"}], "tool_calls": []}
                client.xadd(Keys(RUN).trajectories(job_id), {"sample": json.dumps(sample)})
            client.close()
            yield url, job_id


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@schema.parametrize()
@FUZZ
def test_no_input_gets_a_server_error(case: schemathesis.Case, api: tuple[str, str]) -> None:
    url, _job_id = api
    case.call_and_validate(base_url=url, headers=AUTH, checks=[not_a_server_error], timeout=60)


@schema.include(path_regex=r"\{job_id\}").parametrize()
@FUZZ
def test_no_input_about_a_real_job_gets_a_server_error(case: schemathesis.Case, api: tuple[str, str]) -> None:
    url, job_id = api
    case.path_parameters = {**(case.path_parameters or {}), "job_id": job_id}
    case.call_and_validate(base_url=url, headers=AUTH, checks=[not_a_server_error], timeout=60)
