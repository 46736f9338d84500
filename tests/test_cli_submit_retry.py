"""``rollwave submit`` sends each job under an Idempotency-Key of its own and sends it again, with the same key, when
the reply is lost or the API answers 503: the installed CLI against the real API on a real Redis, through a front that
loses the first reply (after the API made the job) and answers the second with a 503."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.http_harness import LostReply, serve_app
from tests.test_cli_errors import TOKEN, live_api, rollwave

__all__ = ["live_api"]  # the fixture, used here by name


class FlakyFront:
    """A front to the API for POST /v1/jobs: each submit is passed on, but the first reply is lost and the second
    submit answered 503 without reaching the API; ``keys`` are the Idempotency-Keys of the submits it got."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url
        self.keys: list[str | None] = []
        self.app = Starlette(routes=[Route("/v1/jobs", self.jobs, methods=["POST"])])

    async def jobs(self, request: Request) -> Response:
        self.keys.append(request.headers.get("idempotency-key"))
        if len(self.keys) == 2:
            return JSONResponse({"detail": "the run's Redis failed this request (ConnectionError)"}, 503)
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "idempotency-key")}
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30) as api:
            reply = await api.post("/v1/jobs", content=await request.body(),
                                   headers={**headers, "content-type": "application/json"})
        if len(self.keys) == 1:
            return LostReply(201)
        return Response(reply.content, reply.status_code, media_type="application/json")


@pytest.fixture
def front(live_api: str) -> Iterator[tuple[FlakyFront, str]]:
    flaky = FlakyFront(live_api)
    with serve_app(flaky.app) as url:
        yield flaky, url


def test_submit_sends_a_lost_or_refused_submit_again_under_its_key_making_one_job(
    front: tuple[FlakyFront, str], live_api: str, tmp_path: Path
) -> None:
    flaky, url = front
    env = {"ROLLWAVE_API_TOKEN": TOKEN}
    proc = rollwave("submit", "--source", "arith", "--limit", "2", "--api", url, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    [key] = set(flaky.keys)
    assert key and len(flaky.keys) == 3  # lost, 503, then answered: one key for all three
    with httpx.Client(base_url=live_api, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        jobs = api.get("/v1/jobs").json()["jobs"]
        assert proc.stdout.startswith(f"job {jobs[0]['job_id']} (train): 2 tasks"), proc.stdout
        assert len(jobs) == 1  # the API made the job at the first submit; the third was answered with it
        assert 'rollwave_api_jobs_replayed_total 1.0' in api.get("/metrics").text

        proc = rollwave("submit", "--source", "arith", "--limit", "2", "--api", url, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert len(flaky.keys) == 4 and flaky.keys[3] not in (None, key)  # a new invocation: a new key, a new job
        assert len(api.get("/v1/jobs").json()["jobs"]) == 2
