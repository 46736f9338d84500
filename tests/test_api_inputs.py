"""Bad input to the REST API over real HTTP against a real Redis: each gets a 4xx naming what is wrong (the URL, the
method, the query parameter, the header, the field's path in the body), leaves nothing behind, and is logged and
counted (``rollwave_api_requests_refused_total{reason}``; a refused submit also in
``rollwave_api_jobs_rejected_total``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import redis

from buffer.keys import Keys
from core.jobs import JobSpec
from core.tasks.base import MAX_TASK_ID_CHARS
from services.api.app import MAX_TASK_NESTING
from tests.test_api import serve

TASK = {"task_id": "a", "messages": [{"role": "user", "content": "q"}], "reward": {"ground_truth": "1"}}
ARITH = {"source": {"kind": "arith", "limit": 2}}


def _counted(api: httpx.Client, name: str) -> float:
    """The value of the sample ``name`` (with its labels, as /metrics writes them), 0 before it was counted."""
    samples = dict(line.rsplit(" ", 1) for line in api.get("/metrics").text.splitlines() if not line.startswith("#"))
    return float(samples.get(name, 0.0))


def _refused(api: httpx.Client, reason: str) -> float:
    return _counted(api, f'rollwave_api_requests_refused_total{{reason="{reason}"}}')


def _nested(depth: int) -> dict[str, Any]:
    """An object holding objects ``depth`` levels within each other."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _error(reply: httpx.Response, status: int = 422) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    [error] = reply.json()["detail"]
    return error


def test_urls_methods_and_query_parameters_not_served_are_refused_naming_them(redis_url: str) -> None:
    """A URL or method the API does not serve is a JSON 404 or 405 naming the request (the 405's Allow lists every
    method of the path: FastAPI's named one route's, ``POST`` for ``/v1/jobs``, and none for the dashboard's files),
    counted. Every ``/v1`` route (as the
    schema lists them) refuses a request without the token before it reads the body, and a query parameter it does
    not take or is given twice: FastAPI ignored the one (``POST /v1/jobs?dry_run=1`` made a job) and took the last of
    the other."""
    with serve(redis_url, "inputs-routes") as api:
        job_id = api.post("/v1/jobs", json=ARITH).json()["job_id"]
        reply = api.get("/v2/jobs")
        assert reply.status_code == 404 and "nothing is served at GET /v2/jobs" in reply.json()["detail"], reply.text
        assert api.get("/static/nosuch.js").status_code == 404
        reply = api.put("/v1/jobs", json=ARITH)
        assert reply.status_code == 405 and reply.headers["allow"] == "GET, POST", (reply.headers, reply.text)
        assert reply.json()["detail"] == "PUT /v1/jobs: /v1/jobs serves GET, POST only"
        reply = api.get(f"/v1/jobs/{job_id}/cancel")
        assert reply.status_code == 405 and reply.headers["allow"] == "POST", reply.text
        reply = api.post("/static/app.js")  # a mount of files has no route methods: it named none
        assert reply.status_code == 405 and reply.headers["allow"] == "GET, HEAD", (reply.headers, reply.text)
        assert reply.json()["detail"] == "POST /static/app.js: /static/app.js serves GET, HEAD only"
        assert (_refused(api, "route"), _refused(api, "method")) == (2, 3)

        routes = [(method.upper(), path.replace("{job_id}", job_id)) for path, ops in
                  api.get("/openapi.json").json()["paths"].items() if path.startswith("/v1/") for method in ops]
        assert len(routes) == 8, routes
        for method, path in routes:
            stranger = httpx.request(method, f"{api.base_url}{path}", content=b"{oops",
                                     headers={"Content-Type": "application/json"})
            assert stranger.status_code == 401, (method, path, stranger.text)
            body = ARITH if (method, path) == ("POST", "/v1/jobs") else None
            error = _error(api.request(method, path, params={"dry_run": "1"}, json=body))
            assert error["loc"] == ["query", "dry_run"], (method, path, error)
            assert f"{path.replace(job_id, '{job_id}')} takes no query parameter 'dry_run'" in error["msg"], error
        assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "running"  # the DELETE and the cancel did nothing
        error = _error(api.get("/v1/jobs", params=[("limit", "1"), ("limit", "200")]))
        assert error["loc"] == ["query", "limit"] and "given 2 times" in error["msg"], error
        assert [job["job_id"] for job in api.get("/v1/jobs", params={"limit": 1}).json()["jobs"]] == [job_id]
        twice = api.post("/v1/jobs", json=ARITH, headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")])
        error = _error(twice)
        assert error["loc"] == ["header", "Idempotency-Key"] and "is given 2 times; give it once" in error["msg"]
        assert [job["job_id"] for job in api.get("/v1/jobs").json()["jobs"]] == [job_id]  # no job made
        assert (_refused(api, "validation"), _refused(api, "auth")) == (10, 8)
        assert _counted(api, "rollwave_api_jobs_rejected_total") == 2  # the dry run's and the key's


def test_a_job_not_sent_as_json_gets_415_naming_the_content_type(redis_url: str) -> None:
    """A JSON object sent without a Content-Type, as ``curl -d`` sends it (a form) or as text was validated as bytes:
    the 422 said the object "should be a valid dictionary". It is a 415 naming the header and what was sent."""
    with serve(redis_url, "inputs-content-type") as api:
        raw = json.dumps(ARITH).encode()
        for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
            request = api.build_request("POST", "/v1/jobs", content=raw + b"\xff")
            if content_type is not None:
                request.headers["Content-Type"] = content_type
            error = _error(api.send(request), 415)
            assert error["loc"] == ["header", "Content-Type"], error
            assert error["msg"].endswith(f"application/json, not {content_type or 'no Content-Type'}"), error
        assert (_refused(api, "content_type"), _counted(api, "rollwave_api_jobs_rejected_total")) == (3, 3)
        assert api.get("/v1/jobs").json()["jobs"] == []
        reply = api.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json; charset=utf-8"})
        assert reply.status_code == 201, reply.text


def test_job_refusals_name_the_path_and_each_counts_as_a_refused_request(redis_url: str) -> None:
    """Refusals the handler makes after the schema (a reward the run does not allow, a tool the job names twice, a task
    nested too deep to store, a job Redis does not take) count in ``requests_refused`` as the schema's do: they were
    in ``jobs_rejected`` only. A job's ``tools`` naming one twice was taken (a task's own list is refused so: the
    second instance is never released); an inline task's field nested 255 levels got a 500 (the spec could not be
    written as JSON), 200 was stored but the rollout servers' parser could not read the spec back."""
    keys = Keys("inputs-jobs")
    with serve(redis_url, keys.run) as api:
        assert _error(api.post("/v1/jobs", json={**ARITH, "reward": "nosuch"}))["loc"] == ["body", "reward"]
        error = _error(api.post("/v1/jobs", json={**ARITH, "tools": ["calculator", "python", "calculator"]}))
        assert error["loc"] == ["body", "tools"], error
        assert error["msg"] == "field 'tools[2]': tool 'calculator' is named twice (first at tools[0])", error
        tasks = [{**TASK, "task_id": f"t{i}"} for i in range(4)]
        for field, value, depth in (("meta", _nested(300), 300),
                                    ("messages", [{**TASK["messages"][0], "x": _nested(218)}], 220)):
            deep = {**tasks[3], field: value}
            error = _error(api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [*tasks[:3], deep]}}))
            assert error["loc"] == ["body", "source"], error
            assert error["msg"] == (f"field 'source.tasks[3].{field}' holds objects and lists {depth} levels within "
                                    f"each other; at most {MAX_TASK_NESTING}"), error
        r = redis.Redis.from_url(redis_url)
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        try:
            reply = api.post("/v1/jobs", json=ARITH)
        finally:
            r.config_set("maxmemory", 0)
        assert reply.status_code == 503 and "OutOfMemoryError" in reply.text, reply.text
        assert api.get("/v1/jobs").json()["jobs"] == []
        assert (_refused(api, "validation"), _refused(api, "redis")) == (4, 1)
        assert _counted(api, "rollwave_api_jobs_rejected_total") == 5

        deepest = {**TASK, "meta": _nested(MAX_TASK_NESTING)}
        reply = api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [deepest]}})
        assert reply.status_code == 201, reply.text
        stored = r.hget(keys.job(reply.json()["job_id"]), "spec")
        assert JobSpec.model_validate_json(stored).source.tasks[0].meta == deepest["meta"]  # as the servers read it
        error = _error(api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [
            TASK, {**TASK, "task_id": "x" * (MAX_TASK_ID_CHARS + 1)}]}}))
        assert error["loc"] == ["body", "source", "tasks", 1, "task_id"] and "at most 512 characters" in error["msg"]


def test_a_file_without_a_limit_is_read_no_further_than_the_cap(redis_url: str, tmp_path: Path) -> None:
    """A source with no ``limit`` is read one row past ``api.max_job_tasks``, then refused: a file of millions of rows
    was read and checked whole first (here the bad row after the cap's would be read, and named)."""
    row = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}}
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({**row, "id": i}) + "\n" for i in range(4)) + "{oops\n")
    with serve(redis_url, "inputs-cap", "api.max_job_tasks=3", f"api.data_root={tmp_path}") as api:
        error = _error(api.post("/v1/jobs", json={"source": {"kind": "jsonl", "path": "big.jsonl"}}))
        assert error["loc"] == ["body", "source"], error
        assert error["msg"] == "over 3 tasks; a job may hold at most api.max_job_tasks=3 (source.limit picks that many)"
        reply = api.post("/v1/jobs", json={"source": {"kind": "jsonl", "path": "big.jsonl", "limit": 3}})
        assert reply.status_code == 201 and reply.json()["progress"]["submitted"] == 3, reply.text


def test_a_value_of_another_type_is_refused_not_converted(redis_url: str) -> None:
    """Pydantic's lax mode took ``"limit": true`` as 1 and ``"n_samples": "4"`` as 4: a client's mistake made a job
    other than the one it wrote. Each is a 422 naming the field; an int where a float goes is taken."""
    with serve(redis_url, "inputs-types") as api:
        for body, loc in (({"source": {"kind": "arith", "limit": True}}, ["body", "source", "limit"]),
                          ({**ARITH, "n_samples": "4"}, ["body", "n_samples"]),
                          ({**ARITH, "max_turns": 2.0}, ["body", "max_turns"])):
            assert _error(api.post("/v1/jobs", json=body))["loc"] == loc, body
        reply = api.post("/v1/jobs", json={**ARITH, "sampling": {"temperature": 1}})
        assert reply.status_code == 201 and reply.json()["spec"]["sampling"]["temperature"] == 1.0, reply.text
