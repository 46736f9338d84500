"""The REST API over real HTTP against a real Redis: jobs, validation, auth, status, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from tests.http_harness import serve_app

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), aof=False) as server:
        yield server.url


@pytest.fixture
def api(redis_url: str, request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    run = f"api-{request.node.name}".replace("[", "-").replace("]", "")[:60]
    cfg = load_config(None, [f"run.name={run}", f"redis.url={redis_url}", f"api.token={TOKEN}"])
    with serve_app(create_app(cfg)) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            client.run = run  # type: ignore[attr-defined]
            yield client
    redis.Redis.from_url(redis_url).close()


def _run_keys(redis_url: str, run: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(redis_url).keys(f"{Keys(run).prefix}*"))


def test_create_get_list_cancel(api: httpx.Client) -> None:
    reply = api.post("/v1/jobs", json={"kind": "train", "source": {"kind": "arith", "limit": 5, "split": "train"},
                                       "n_samples": 4, "sampling": {"temperature": 0.7}, "max_turns": 3})
    assert reply.status_code == 201, reply.text
    job = reply.json()
    assert job["state"] == "running" and job["progress"]["submitted"] == 5
    assert job["spec"]["n_samples"] == 4 and job["spec"]["sampling"]["temperature"] == 0.7
    assert api.get(f"/v1/jobs/{job['job_id']}").json()["job_id"] == job["job_id"]
    assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [job["job_id"]]
    assert api.get(f"/v1/jobs/{job['job_id']}/trajectories").json() == {"items": [], "next": None}
    assert api.post(f"/v1/jobs/{job['job_id']}/cancel").json()["state"] == "cancelled"
    assert api.get("/v1/jobs/nosuchjob").status_code == 404


def test_eval_job_defaults_to_greedy_single_sample(api: httpx.Client) -> None:
    reply = api.post("/v1/jobs", json={"kind": "eval", "source": {"kind": "gsm8k", "split": "test", "limit": 3}})
    assert reply.status_code == 201, reply.text
    spec = reply.json()["spec"]
    assert reply.json()["progress"]["submitted"] == 3 and spec["source"]["path"] is None  # the bundled copy
    assert spec["n_samples"] == 1 and spec["sampling"]["temperature"] == 0.0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "train", "source": {"kind": "arith"}}, "source"),
        ({"kind": "nope", "source": {"kind": "arith", "limit": 1}}, "kind"),
        ({"source": {"kind": "arith", "limit": 0}}, "limit"),
        ({"source": {"kind": "arith", "limit": 2}, "n_samples": 0}, "n_samples"),
        ({"source": {"kind": "arith", "limit": 2}, "sampling": {"top_p": 2}}, "top_p"),
        ({"source": {"kind": "arith", "limit": 2}, "sampling": {"temperature": 0}}, "sampling.temperature"),
        ({"source": {"kind": "arith", "limit": 2}, "surprise": 1}, "surprise"),
        ({"source": {"kind": "jsonl", "path": "/nonexistent/tasks.jsonl"}}, "source"),
        ({"source": {"kind": "jsonl"}}, "path"),
        ({"source": {"kind": "inline", "tasks": [{"task_id": "a", "messages": []}]}}, "messages"),
    ],
)
def test_invalid_jobs_get_422_naming_the_field_and_leave_nothing(api: httpx.Client, body: dict, field: str) -> None:
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 422, reply.text
    assert field in reply.text
    assert api.get("/v1/jobs").json()["jobs"] == []


def test_malformed_jsonl_names_file_and_line(api: httpx.Client, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}\n{oops\n')
    reply = api.post("/v1/jobs", json={"source": {"kind": "jsonl", "path": str(path)}})
    assert reply.status_code == 422
    assert f"{path}:2" in reply.text
    assert api.get("/v1/jobs").json()["jobs"] == []


def test_auth(api: httpx.Client) -> None:
    base = str(api.base_url)
    assert httpx.get(f"{base}/v1/jobs").status_code == 401
    assert httpx.get(f"{base}/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert api.get("/v1/jobs").status_code == 200


def test_ops_endpoints(api: httpx.Client) -> None:
    assert api.get("/readyz").json() == {"status": "ready"}
    assert "rollwave_api_jobs_submitted_total" in api.get("/metrics").text
    assert api.get("/openapi.json").json()["info"]["title"] == "rollwave"
    assert api.get("/docs").status_code == 200
    status = api.get("/v1/status").json()
    assert status["version"] == 0 and status["servers"] == [] and status["buffer"]["groups"]["length"] == 0
    summary = api.get("/v1/metrics/summary").json()
    assert set(summary["series"]) >= {"reward_mean", "policy_version", "buffer_depth_groups"}
