"""The REST API over real HTTP against a real Redis: jobs, validation, auth, status, metrics."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerInfo, ServerRegistry
from buffer.replay import ReplayBuffer
from buffer.task_queue import TRAIN_ENDS, TaskQueue
from core.config import BufferConfig, ConfigError, load_config
from core.jobs import MAX_INLINE_TASKS
from core.tasks.gsm8k import BUNDLED
from rollout_server.checkpoint_receiver import CheckpointMetrics
from rollout_server.metrics import RolloutMetrics
from services.api import create_app
from services.api.app import LOGGED_DETAIL_CHARS
from services.api.cluster import ClusterView
from services.api.sampler import MetricsSampler
from tests.buffer_helpers import make_group
from tests.http_harness import serve_app
from trainer.metrics import RedisStatus

TOKEN = secrets.token_urlsafe(32)


@contextmanager
def serve(redis_url: str, run: str, *overrides: str, client: redis.Redis | None = None) -> Iterator[httpx.Client]:
    """The API of run ``run`` (token ``TOKEN`` unless overridden) and an authorized client of it."""
    cfg = load_config(None, [f"run.name={run}", f"redis.url={redis_url}", f"api.token={TOKEN}", *overrides], env={})
    with serve_app(create_app(cfg, client)) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
            api.run = run  # type: ignore[attr-defined]
            yield api


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "gsm8k").mkdir(parents=True)
    shutil.copy(BUNDLED / "test.jsonl", root / "gsm8k" / "test.jsonl")
    return root


@pytest.fixture
def api(redis_url: str, data_root: Path, request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    run = f"api-{request.node.name}".replace("[", "-").replace("]", "")[:60]
    with serve(redis_url, run, f"api.data_root={data_root}") as client:
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
    assert _refused(api, "not_found") == 1


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
def test_invalid_jobs_get_422_naming_the_field_and_leave_nothing(
    api: httpx.Client, body: dict, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 422, reply.text
    assert field in reply.text
    assert api.get("/v1/jobs").json()["jobs"] == []
    assert "rollwave_api_jobs_rejected_total 1.0" in api.get("/metrics").text  # each case has its own API
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(field.split(".")[-1] in message for message in warned), warned


def test_malformed_jsonl_names_file_and_line(api: httpx.Client, data_root: Path) -> None:
    path = data_root / "tasks.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}\n{oops\n')
    reply = api.post("/v1/jobs", json={"source": {"kind": "jsonl", "path": str(path)}})
    assert reply.status_code == 422
    assert f"{path}:2" in reply.text
    assert api.get("/v1/jobs").json()["jobs"] == []


def _refused(api: httpx.Client, reason: str) -> float:
    for line in api.get("/metrics").text.splitlines():
        if line.startswith(f'rollwave_api_requests_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_auth(api: httpx.Client) -> None:
    base = str(api.base_url)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}):  # "Bearer " arrives as "Bearer": HTTP trims the space
        assert httpx.get(f"{base}/v1/jobs", headers=headers).status_code == 401, headers
    assert _refused(api, "auth") == 5
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert api.get("/v1/jobs").status_code == 200


def test_a_refusal_is_logged_on_one_line_whatever_the_client_sent(api: httpx.Client,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A path's ``%0a`` decodes to a newline and a JSON key or tool name may hold any character: logged as they are,
    anyone who reaches the port could forge log lines (here one that looks like the API's own) or send escape
    sequences to the operator's terminal. Control characters are logged escaped."""
    forged = "2026-01-01 00:00:00 INFO services.api: serving on http://0.0.0.0:8000"
    reply = httpx.get(f"{api.base_url}/v1/jobs%0a{forged.replace(' ', '%20')}%1b[2J")
    assert reply.status_code == 401
    body = {"source": {"kind": "arith", "limit": 1}}
    assert api.post("/v1/jobs", json={**body, f"x\n{forged}": 1}).status_code == 422
    assert api.post("/v1/jobs", json={**body, "tools": [f"x\n{forged}"]}).status_code == 422
    warned = [r.getMessage() for r in caplog.records if r.name == "services.api.app"]
    assert len(warned) == 3 and all(forged in message for message in warned), warned
    assert not [message for message in warned if "\n" in message or "\x1b" in message], warned
    assert "\\x0a" + forged in warned[0] and "\\x1b[2J" in warned[0], warned[0]
    caplog.clear()  # what the client sent is quoted up to a bound: a name of the body's size was logged whole
    assert api.post("/v1/jobs", json={**body, "reward": "r" * 100_000}).status_code == 422
    [message] = [r.getMessage() for r in caplog.records if r.name == "services.api.app"]
    assert len(message) < LOGGED_DETAIL_CHARS + 200 and message.endswith(" more characters)"), message[-300:]


def test_a_non_loopback_api_needs_a_token(redis_url: str) -> None:
    cfg = load_config(None, [f"redis.url={redis_url}", "api.host=0.0.0.0"], env={})
    with pytest.raises(ConfigError, match="api.token is not set and api.host=0.0.0.0 is not loopback"):
        create_app(cfg)
    create_app(load_config(None, [f"redis.url={redis_url}", "api.host=127.0.0.1"], env={}))


def test_host_header_guards_against_dns_rebinding(redis_url: str) -> None:
    """A tokenless API on loopback answers only Host names of this machine: a page that rebinds its own name
    to 127.0.0.1 gets 400. The unauthenticated ops probes answer any Host (kubelet uses the pod IP)."""
    cfg = load_config(None, ["run.name=api-host", f"redis.url={redis_url}"], env={})
    with serve_app(create_app(cfg)) as url:
        port = url.rsplit(":", 1)[1]
        assert httpx.get(f"{url}/v1/jobs").status_code == 200
        assert httpx.get(f"{url}/v1/jobs", headers={"Host": f"localhost:{port}"}).status_code == 200
        evil = {"Host": f"rebind.attacker.example:{port}"}
        assert httpx.get(f"{url}/v1/jobs", headers=evil).status_code == 400
        assert httpx.get(f"{url}/", headers=evil).status_code == 400
        assert httpx.get(f"{url}/healthz", headers=evil).status_code == 200
        assert httpx.get(f"{url}/metrics", headers={"Host": "10.1.2.3:8000"}).status_code == 200
        assert 'rollwave_api_requests_refused_total{reason="host"} 2.0' in httpx.get(f"{url}/metrics").text
    with serve(redis_url, "api-host2", "api.allowed_hosts=[api.internal, '*.svc.example']") as api:
        assert api.get("/v1/jobs", headers={"Host": "api.internal"}).status_code == 200
        assert api.get("/v1/jobs", headers={"Host": "rw-api.ml.svc.example"}).status_code == 200
        assert api.get("/v1/jobs").status_code == 400  # 127.0.0.1 is no longer in the list


def test_a_write_from_a_page_of_another_origin_is_refused(redis_url: str) -> None:
    """A tokenless API on loopback is reachable from any web page in the operator's browser: a form (or a no-cors
    fetch) POSTs to it with the loopback Host, which the Host check lets through, and the browser names the page's
    origin. Such a write gets 403 and changes nothing; the API's own origin, a client that sends no Origin (the CLI)
    and reads from anywhere are answered."""
    cfg = load_config(None, ["run.name=api-origin", f"redis.url={redis_url}"], env={})
    with serve_app(create_app(cfg)) as url:
        job_id = httpx.post(f"{url}/v1/jobs", json={"source": {"kind": "arith", "limit": 2}}).json()["job_id"]
        for origin in ("http://evil.example", "null", f"{url.replace('127.0.0.1', 'localhost')}"):
            headers = {"Origin": origin}
            reply = httpx.post(f"{url}/v1/jobs/{job_id}/cancel", headers=headers)
            assert reply.status_code == 403 and f"another origin ({origin})" in reply.text, (origin, reply.text)
            reply = httpx.post(f"{url}/v1/jobs", json={"source": {"kind": "arith", "limit": 1}}, headers=headers)
            assert reply.status_code == 403, (origin, reply.text)
        evil = {"Origin": "http://evil.example"}
        [job] = httpx.get(f"{url}/v1/jobs", headers=evil).json()["jobs"]
        assert (job["job_id"], job["state"]) == (job_id, "running")
        assert 'rollwave_api_requests_refused_total{reason="origin"} 6.0' in httpx.get(f"{url}/metrics").text
        reply = httpx.post(f"{url}/v1/jobs/{job_id}/cancel", headers={"Origin": url})
        assert reply.status_code == 200 and reply.json()["state"] == "cancelled", reply.text


def test_request_bodies_are_bounded(redis_url: str) -> None:
    job = {"kind": "train", "source": {"kind": "arith", "limit": 2}, "name": ""}
    with serve(redis_url, "api-body", "api.max_body_bytes=2048") as api:
        assert api.post("/v1/jobs", json=job).status_code == 201
        big = {**job, "name": "x" * 190, "source": {**job["source"], "pad": "y" * 4000}}
        reply = api.post("/v1/jobs", json=big)
        assert reply.status_code == 413 and "over 2048 bytes" in reply.text

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
            yield b'{"kind": "train", "name": "'
            for _ in range(10):
                yield b"z" * 500
            yield b'", "source": {"kind": "arith", "limit": 1}}'

        reply = api.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert reply.status_code == 413
        assert _refused(api, "body_size") == 2
        assert len(api.get("/v1/jobs").json()["jobs"]) == 1


def test_a_body_that_stalls_is_refused_at_its_deadline_and_the_api_serves_on(redis_url: str) -> None:
    """A client that sends its headers and part of the body, then nothing (or trickles it), held its connection and
    the handler's task for ever: ``api.body_timeout_s`` after the body's first read it gets 408, counted."""
    job = {"kind": "train", "source": {"kind": "arith", "limit": 2}, "name": ""}
    with serve(redis_url, "api-body-slow", "api.body_timeout_s=0.5") as api:
        url = httpx.URL(str(api.base_url))
        head = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n")
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(head.encode() + b'{"kind": "train", "na')
            reply = sock.makefile("rb").read()  # the API answers and closes: read to the end
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b"request body not received in 0.5 s (api.body_timeout_s): 21 bytes came" in reply
        assert _refused(api, "body_timeout") == 1
        assert api.post("/v1/jobs", json=job).status_code == 201  # a body sent at once is in time
        assert len(api.get("/v1/jobs").json()["jobs"]) == 1


def test_job_size_is_capped(redis_url: str) -> None:
    with serve(redis_url, "api-cap", "api.max_job_tasks=3") as api:
        reply = api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 4}})
        assert reply.status_code == 422 and "at most api.max_job_tasks=3" in reply.text
        assert reply.json()["detail"][0]["loc"] == ["body", "source", "limit"]  # refused before a task is made
        inline = [{"task_id": f"t{i}", "messages": [{"role": "user", "content": "q"}], "reward": {}} for i in range(4)]
        assert api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": inline}}).status_code == 422
        assert api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 3}}).status_code == 201
    with serve(redis_url, "api-inline") as api:  # the schema's own bound on inline tasks, whatever the config
        inline = [{"task_id": f"t{i}", "messages": [{"role": "user", "content": "q"}], "reward": {}}
                  for i in range(MAX_INLINE_TASKS + 1)]
        reply = api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": inline}})
        assert reply.status_code == 422 and "at most 10000 items" in reply.text


def test_jobs_read_files_only_under_the_data_root(api: httpx.Client, data_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"prompt": [{"role": "user", "content": "secret"}], "reward_model": {"ground_truth": "1"}}\n')
    (data_root / "link.jsonl").symlink_to(outside)
    escapes = (str(outside), "../outside.jsonl", "link.jsonl", "/etc/passwd", str(data_root / ".." / "outside.jsonl"))
    for path in escapes:
        reply = api.post("/v1/jobs", json={"source": {"kind": "jsonl", "path": path}})
        assert reply.status_code == 422 and "outside the data root" in reply.text, (path, reply.text)
    assert api.get("/v1/jobs").json()["jobs"] == []
    (data_root / "ok.jsonl").write_bytes(outside.read_bytes())
    for path in ("ok.jsonl", str(data_root / "ok.jsonl")):
        assert api.post("/v1/jobs", json={"source": {"kind": "jsonl", "path": path}}).status_code == 201, path


def test_jobs_name_only_rewards_the_run_allows(redis_url: str) -> None:
    with serve(redis_url, "api-rewards", "rollout.reward_allowlist={judge: 'tests.test_rewards:good_reward'}") as api:
        source = {"kind": "arith", "limit": 1}
        for reward, status in (("judge", 201), ("tool", 201), ("nope", 422), ("os:system", 422),
                               ("tests.test_rewards:good_reward", 422)):
            reply = api.post("/v1/jobs", json={"source": source, "reward": reward})
            assert reply.status_code == status, (reward, reply.text)
            if status == 422:
                assert "reward" in reply.text


def test_jobs_are_listed_a_page_at_a_time_in_two_round_trips(redis_url: str) -> None:
    client = CountingRedis.from_url(redis_url)
    with serve(redis_url, "api-pages", client=client) as api:
        ids = [api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 1}}).json()["job_id"]
               for _ in range(25)]
        newest_first = ids[::-1]
        client.calls = 0
        page = api.get("/v1/jobs", params={"limit": 10}).json()
        assert client.calls == 2  # the job index, then every job of the page in one pipeline
        listed = [j["job_id"] for j in page["jobs"]]
        while page["next"]:
            page = api.get("/v1/jobs", params={"limit": 10, "cursor": page["next"]}).json()
            listed += [j["job_id"] for j in page["jobs"]]
        assert listed == newest_first
        assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == newest_first
        for bad in ("nosuchjob", "nan:abc", "12.5:"):
            assert api.get("/v1/jobs", params={"cursor": bad}).status_code == 422
        assert api.get("/v1/jobs", params={"limit": 201}).status_code == 422
        assert (_refused(api, "cursor"), _refused(api, "validation")) == (3, 1)

        # a job that ends a page is deleted before the next page is asked for: the next page goes on after it
        first = api.get("/v1/jobs", params={"limit": 10}).json()
        queue = TaskQueue(client, Keys("api-pages"), BufferConfig())
        [entry] = [e for e in queue.read("server-1", 25) if e.job_id == newest_first[9]]
        queue.dead_letter(entry, "fails every time")
        assert api.delete(f"/v1/jobs/{newest_first[9]}").status_code == 200
        after = api.get("/v1/jobs", params={"limit": 10, "cursor": first["next"]}).json()
        assert [j["job_id"] for j in after["jobs"]] == newest_first[10:20]


class CountingRedis(redis.Redis):
    """redis-py's client, counting round trips (a pipeline is one)."""

    calls = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls += 1
        return super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().pipeline(*args, **kwargs)


def test_ops_endpoints(api: httpx.Client, redis_url: str) -> None:
    """The status shows every stream of the run, those only an operator reads too: entries moved aside, groups kept
    for a newer trainer."""
    assert api.get("/readyz").json() == {"status": "ready"}
    assert "rollwave_api_jobs_submitted_total" in api.get("/metrics").text
    assert api.get("/openapi.json").json()["info"]["title"] == "rollwave"
    assert api.get("/docs").status_code == 404  # its page loads a CDN's script: see test_api_pages
    keys, r = Keys("api-test_ops_endpoints"), redis.Redis.from_url(redis_url)
    r.xadd(keys.tasks_malformed, {"error": "damaged"})
    for _ in range(2):
        r.xadd(keys.groups_newer, {"v": "9"})
    status = api.get("/v1/status").json()
    assert status["version"] == 0 and status["servers"] == []
    assert status["buffer"] == {
        "tasks": {"length": 0, "pending": 0}, "tasks_eval": {"length": 0, "pending": 0},
        "groups": {"length": 0, "pending": 0}, "tasks_dead": {"length": 0, "pending": 0},
        "tasks_malformed": {"length": 1, "pending": 0}, "groups_malformed": {"length": 0, "pending": 0},
        "groups_newer": {"length": 2, "pending": 0}}
    summary = api.get("/v1/metrics/summary").json()
    assert set(summary["series"]) >= {"reward_mean", "policy_version", "buffer_depth_groups"}


def _rejected(api: httpx.Client, body: dict[str, Any], *expected: str) -> None:
    """A 422 whose detail names ``source`` and carries each of ``expected``; the job leaves nothing behind."""
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"][0]
    assert detail["loc"] == ["body", "source"], detail
    for text in expected:
        assert text in detail["msg"], (text, detail["msg"])
    assert api.get("/v1/jobs").json()["jobs"] == []


def test_bad_inline_tasks_and_jsonl_rewards_are_refused_naming_the_field(api: httpx.Client, data_root: Path) -> None:
    task = {"task_id": "a", "messages": [{"role": "user", "content": "q"}], "reward": {"ground_truth": "1"}}
    inline = {"kind": "inline", "tasks": [task | {"messages": [{"role": "bot", "content": "q"}]}]}
    _rejected(api, {"source": inline}, "source.tasks[0].messages[0].role", "'bot'")
    _rejected(api, {"source": {"kind": "inline", "tasks": [task, task]}}, "duplicate task id 'a'")
    _rejected(api, {"source": {"kind": "inline", "tasks": [task | {"reward": {}}]}},  # the run's reward: gsm8k
              "source.tasks[0].reward.ground_truth")
    row = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}
    for name, reward_model, field in (("gt_list", {"ground_truth": [1, 2]}, "reward_model.ground_truth"),
                                      ("kind", {"ground_truth": "1", "kind": "tool_first"}, "reward_model.kind"),
                                      ("mode", {"ground_truth": "1", "mode": "fuzzy"}, "reward_model.mode")):
        path = data_root / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n" + json.dumps(row | {"reward_model": reward_model}) + "\n")
        _rejected(api, {"source": {"kind": "jsonl", "path": path.name}, "reward": "gsm8k"}, f"{path}:2: ", field)
    (data_root / "empty.jsonl").write_text("")
    _rejected(api, {"source": {"kind": "jsonl", "path": "empty.jsonl"}}, f"{data_root / 'empty.jsonl'}: no rows")
    (data_root / "three.jsonl").write_text("".join(json.dumps(row | {"id": i}) + "\n" for i in range(3)))
    _rejected(api, {"source": {"kind": "jsonl", "path": "three.jsonl", "offset": 5}},
              f"offset 5 is past the 3 rows of {data_root / 'three.jsonl'}")
    assert api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [task]}}).status_code == 201


def test_rows_for_the_jobs_allowlisted_reward_are_accepted(redis_url: str) -> None:
    allowlist = "rollout.reward_allowlist={judge: 'tests.test_rewards:good_reward'}"
    with serve(redis_url, "api-row-rewards", allowlist) as api:
        task = {"task_id": "a", "messages": [{"role": "user", "content": "q"}],
                "reward": {"kind": "judge", "x": [1]}}
        source = {"kind": "inline", "tasks": [task]}
        assert api.post("/v1/jobs", json={"source": source, "reward": "judge"}).status_code == 201
        reply = api.post("/v1/jobs", json={"source": source, "reward": "tool"})  # no rollout could score it
        assert reply.status_code == 422 and "source.tasks[0].reward.kind" in reply.text, reply.text
        assert len(api.get("/v1/jobs").json()["jobs"]) == 1


def test_a_job_naming_a_tool_the_run_does_not_have_is_refused(api: httpx.Client, tmp_path: Path,
                                                               redis_url: str) -> None:
    """The tools a job or its tasks name must be the run's (rollout.tools; here the built-in ones): otherwise every
    group would fail at rollout, and be dead-lettered, for a typo."""
    reply = api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 1}, "tools": ["calculator", "nosuch"]})
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "tools"], reply.text
    assert "unknown tool(s) nosuch; this run's tools (rollout.tools): calculator, python, check_answer" in reply.text
    task = {"task_id": "a", "messages": [{"role": "user", "content": "q"}], "tools": ["shell"],
            "reward": {"ground_truth": "1"}}
    reply = api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [task]}})
    assert reply.status_code == 422 and "unknown tool(s) shell" in reply.text, reply.text
    assert api.get("/v1/jobs").json()["jobs"] == []
    own = tmp_path / "tools.yaml"
    own.write_text("- name: shell\n  class: rollout_server.tools.calculator:CalculatorTool\n")
    with serve(redis_url, "api-own-tools", f"rollout.tools={own}") as custom:
        assert custom.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [task]}}).status_code == 201


def test_a_task_that_cannot_start_a_tool_it_gets_is_refused(api: httpx.Client, data_root: Path) -> None:
    """A job's ``tools`` replace each task's, not its ``tools_kwargs``: a task that gives a tool it gets no create
    kwargs the tool requires (check_answer: ground_truth) would fail every episode at create and be dead-lettered."""
    task = {"task_id": "a", "messages": [{"role": "user", "content": "q"}], "reward": {"ground_truth": "1"}}
    gold = task | {"task_id": "b", "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": "1"}}}}
    reply = api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [gold, task]}, "tools": ["check_answer"]})
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "tools"], reply.text
    assert ("source.tasks[1]: tool check_answer needs create_kwargs ground_truth "
            "(tools_kwargs.check_answer.create_kwargs)") in reply.text, reply.text
    own = task | {"tools": ["calculator", "check_answer"], "tools_kwargs": {"check_answer": {"create_kwargs": {}}}}
    _rejected(api, {"source": {"kind": "inline", "tasks": [own]}},
              "source.tasks[0]: tool check_answer needs create_kwargs ground_truth")
    row = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"},
           "tools_kwargs": {"check_answer": {"create_kwargs": {"answer": "1"}}}}
    (data_root / "no_gold.jsonl").write_text(json.dumps(row) + "\n")
    _rejected(api, {"source": {"kind": "jsonl", "path": "no_gold.jsonl"}},
              f"{data_root / 'no_gold.jsonl'}:1: tool check_answer needs create_kwargs ground_truth")
    bad = task | {"tools": ["calculator"], "tools_kwargs": {"calculator": {"create_kwargs": [1]}}}
    _rejected(api, {"source": {"kind": "inline", "tasks": [bad]}},
              "field 'source.tasks[0].tools_kwargs.calculator.create_kwargs' must be dict, got list")
    assert "rollwave_api_jobs_rejected_total 4.0" in api.get("/metrics").text
    for body in ({"source": {"kind": "inline", "tasks": [gold]}, "tools": ["check_answer"]},
                 {"source": {"kind": "inline", "tasks": [gold | {"tools": ["check_answer"]}]}},
                 {"source": {"kind": "inline", "tasks": [task]}, "tools": ["calculator"]},
                 {"source": {"kind": "arith", "limit": 2}, "tools": ["calculator", "check_answer"]},
                 {"kind": "eval", "source": {"kind": "gsm8k", "path": "gsm8k", "split": "test", "limit": 2},
                  "tools": ["check_answer"]}):
        reply = api.post("/v1/jobs", json=body)
        assert reply.status_code == 201, (body, reply.text)
    assert len(api.get("/v1/jobs").json()["jobs"]) == 5


def test_a_split_is_a_plain_name_never_a_path(api: httpx.Client, data_root: Path, tmp_path: Path) -> None:
    """A split names ``{split}.jsonl`` in a source's directory: with ``../`` in it a job could read any file the API
    can, through the bundled gsm8k copy (read for a job without a path) as through a directory of the data root."""
    victim = tmp_path / "victim.jsonl"
    victim.write_text(json.dumps({"question": "secret?", "answer": "#### 1"}) + "\n")
    escape = os.path.relpath(victim.with_suffix(""), BUNDLED)
    for source in ({"kind": "gsm8k", "split": escape, "limit": 1}, {"kind": "gsm8k", "path": "gsm8k", "split": ".."},
                   {"kind": "jsonl", "path": "gsm8k", "split": "../../victim"}, {"kind": "arith", "split": "../test",
                                                                                "limit": 1}):
        reply = api.post("/v1/jobs", json={"kind": "eval", "source": source})
        assert reply.status_code == 422, (source, reply.text)
        detail = reply.json()["detail"][0]
        assert detail["loc"] == ["body", "source", "split"] and "is not a plain name" in detail["msg"], detail
    assert api.get("/v1/jobs").json()["jobs"] == []
    assert "rollwave_api_jobs_rejected_total 4.0" in api.get("/metrics").text
    reply = api.post("/v1/jobs", json={"kind": "eval", "source": {"kind": "gsm8k", "path": "gsm8k", "split": "test"}})
    assert reply.status_code == 201 and reply.json()["progress"]["submitted"] == 1319, reply.text


def test_a_job_redis_cannot_take_whole_leaves_nothing_behind(tmp_path: Path) -> None:
    """Redis refusing a write partway through a job (here: out of memory after its first 1000-task chunk, as the
    chunks were written one call at a time) must not leave a job running with part of its tasks: the client gets
    a 503 naming Redis and no job, the run no trace of one, and the rejection is counted."""
    tasks = [{"task_id": f"t{i}", "messages": [{"role": "user", "content": "x" * 2000}],
              "reward": {"ground_truth": "1"}} for i in range(3000)]
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server, serve(server.url, "api-oom") as api:
        r = redis.Redis.from_url(server.url)
        before = _run_keys(server.url, "api-oom")
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 4_000_000)  # room for one chunk, not three
        try:
            reply = api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": tasks}})
        finally:
            r.config_set("maxmemory", 0)
        assert reply.status_code == 503, reply.text
        assert "Redis did not take the job's 3000 tasks (OutOfMemoryError" in reply.text
        assert "written whole or not at all" in reply.text
        assert api.get("/v1/jobs").json()["jobs"] == []
        assert _run_keys(server.url, "api-oom") == before and r.xlen(Keys("api-oom").tasks("train")) == 0
        assert "rollwave_api_jobs_rejected_total 1.0" in api.get("/metrics").text
        reply = api.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": tasks}})  # with room again
        assert reply.status_code == 201 and reply.json()["progress"]["submitted"] == 3000, reply.text
        assert r.xlen(Keys("api-oom").tasks("train")) == 3000


def test_jobs_name_only_agents_the_run_allows(api: httpx.Client, redis_url: str) -> None:
    """Servers run only ``rollout.agent_allowlist`` entrypoints: a job naming another would be accepted and then
    have every task dead-lettered, so the API refuses it as it does a reward the run does not allow."""
    for agent in ("os:system", "tests.agent_fixtures:crash"):
        reply = api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 3}, "agent": agent})
        assert reply.status_code == 422, reply.text
        detail = reply.json()["detail"][0]
        assert detail["loc"] == ["body", "agent"] and "rollout.agent_allowlist: none" in detail["msg"], detail
    assert api.get("/v1/jobs").json()["jobs"] == []
    assert "rollwave_api_jobs_rejected_total 2.0" in api.get("/metrics").text
    allowed = "rollout_server.agents.calculator_agent:run"
    with serve(redis_url, "api-agents", f"rollout.agent_allowlist=['{allowed}']") as custom:
        assert custom.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 1}, "agent": allowed}).status_code \
            == 201
        reply = custom.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 1}, "agent": "os:system"})
        assert reply.status_code == 422 and f"rollout.agent_allowlist: {allowed}" in reply.text, reply.text
        task = {"task_id": "a", "messages": [{"role": "user", "content": "q"}], "reward": {"ground_truth": "1"},
                "tools": ["check_answer"]}  # no create kwargs: an agent calls its tools itself, none is created
        reply = custom.post("/v1/jobs", json={"source": {"kind": "inline", "tasks": [task]}, "agent": allowed})
        assert reply.status_code == 201, reply.text


def _refused_loc(api: httpx.Client, body: dict[str, Any]) -> list[str]:
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 422, reply.text
    return reply.json()["detail"][0]["loc"]


def test_a_job_setting_what_the_run_cannot_honour_is_refused_naming_it(redis_url: str) -> None:
    """A job's override that the rollout servers would drop without a word is refused, naming the field: max_turns
    on an agent job (its agent decides its turns), max_new_tokens no turn can reach within rollout.max_total_tokens,
    and a train group of one sample, whose group-relative advantage is 0. The same settings where they apply are
    taken."""
    allowed = "rollout_server.agents.calculator_agent:run"
    source = {"kind": "arith", "limit": 1}
    with serve(redis_url, "api-inapplicable", f"rollout.agent_allowlist=['{allowed}']",
               "rollout.max_total_tokens=256") as api:
        assert _refused_loc(api, {"source": source, "agent": allowed, "max_turns": 2}) == ["body", "max_turns"]
        for kind in ("train", "eval"):
            body = {"kind": kind, "source": source, "sampling": {"max_new_tokens": 256}}
            assert _refused_loc(api, body) == ["body", "sampling", "max_new_tokens"]
        reply = api.post("/v1/jobs", json={"source": source, "n_samples": 1})
        assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "n_samples"], reply.text
        assert "advantage 0 under trainer.advantage=grpo" in reply.text
        assert api.get("/v1/jobs").json()["jobs"] == []
        assert "rollwave_api_jobs_rejected_total 4.0" in api.get("/metrics").text
        for body in ({"source": source, "agent": allowed}, {"source": source, "max_turns": 2},
                     {"source": source, "sampling": {"max_new_tokens": 255}}, {"source": source, "n_samples": 2},
                     {"kind": "eval", "source": source, "n_samples": 1}):
            assert api.post("/v1/jobs", json=body).status_code == 201, body
    with serve(redis_url, "api-inapplicable-gae", "trainer.advantage=gae") as api:  # a critic's baseline: n=1 trains
        assert api.post("/v1/jobs", json={"source": source, "n_samples": 1}).status_code == 201


def test_a_body_that_json_cannot_echo_as_it_is_gets_a_422_not_a_500(api: httpx.Client) -> None:
    """Python's JSON parser takes NaN and Infinity: the 422 echoes such an input (as a string) and names the field;
    FastAPI's own handler could not write it into JSON and the client got a 500. (A body not sent as JSON is a 415:
    tests/test_api_inputs.py.)"""
    json_body = {"Content-Type": "application/json"}
    for raw, loc, echoed in ((b'{"source": {"kind": "arith", "limit": 2}, "sampling": {"temperature": NaN}}',
                              ["body", "sampling", "temperature"], "NaN"),
                             (b'{"source": {"kind": "arith", "limit": 2, "seed": 1e400}}',
                              ["body", "source", "seed"], "Infinity"),
                             (b'{"source": {"kind": "arith", "limit": -Infinity}}',
                              ["body", "source", "limit"], "-Infinity")):
        reply = api.post("/v1/jobs", content=raw, headers=json_body)
        assert reply.status_code == 422, reply.text
        [error] = reply.json()["detail"]
        assert (error["loc"], error["input"]) == (loc, echoed), error
    assert _refused(api, "validation") == 3
    assert api.get("/v1/jobs").json()["jobs"] == []


def test_a_body_the_parser_cannot_read_gets_a_422_saying_why(api: httpx.Client) -> None:
    """JSON nested deeper than Python's parser goes, or not UTF-8: FastAPI's bare 400 ("There was an error parsing
    the body") said neither why nor was logged and counted; it is a 422 naming the cause, and a rejected job."""
    json_body = {"Content-Type": "application/json"}
    for raw, why in ((b"[" * 100_000, "RecursionError: maximum recursion depth exceeded"),
                     (b'{"source": {"kind": "arith", "limit": 1}, "name": "\xff"}', "UnicodeDecodeError: 'utf-8'")):
        reply = api.post("/v1/jobs", content=raw, headers=json_body)
        assert reply.status_code == 422, reply.text
        [error] = reply.json()["detail"]
        assert error["loc"] == ["body"] and why in error["msg"], error
    assert _refused(api, "validation") == 2
    assert "rollwave_api_jobs_rejected_total 2.0" in api.get("/metrics").text
    assert api.post("/v1/jobs/nosuchjob/cancel", content=b"[" * 100_000).status_code == 404  # a body it never reads


class FinishesBeforeWrite(redis.Redis):
    """redis-py's client. Armed (``finish``, ``job_key``), it runs ``finish`` just before the first command it sends
    that names the job's hash and is no plain read of it: the job's last task finishes between a read and a write."""

    finish: Callable[[], object] | None = None
    job_key = ""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.finish is not None and self.job_key in args and args[0] not in ("HGET", "HGETALL", "HMGET"):
            finish, self.finish = self.finish, None
            finish()
        return super().execute_command(*args, **options)


def test_cancel_leaves_a_job_done_meanwhile_done(redis_url: str) -> None:
    """Cancel checks that a job has something left and marks it cancelled in one step: a train job whose last group
    is trained just before the mark (written by a rollout server and acked by the trainer, here a real put, take and
    ack) stays done, its result kept, and the cancel gets 409 saying so."""
    client = FinishesBeforeWrite.from_url(redis_url)
    keys = Keys("api-cancel-race")
    with serve(redis_url, keys.run, client=client) as api:
        job_id = api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 1}}).json()["job_id"]
        r = redis.Redis.from_url(redis_url)
        [entry] = TaskQueue(r, keys, BufferConfig()).read("server-1", 1)
        replay = ReplayBuffer(r, keys, BufferConfig())
        replay.ensure_group()

        def train() -> None:
            assert replay.put(make_group(job_id, entry.group_id, run=keys.run), task=entry)
            [(entry_id, group)] = replay.take(1, 5.0)
            assert replay.ack([entry_id], [group.group_id]) == 1

        client.job_key = keys.job(job_id)
        client.finish = train
        reply = api.post(f"/v1/jobs/{job_id}/cancel")
        assert client.finish is None  # the group was written and trained during the cancel
        assert reply.status_code == 409 and reply.json()["detail"].startswith(f"job {job_id} is done: "), reply.text
        assert api.get(f"/v1/jobs/{job_id}").json()["progress"]["trained"] == 1
        assert r.hget(keys.job(job_id), "state") == b"running"  # never marked cancelled
        running = api.post("/v1/jobs", json={"source": {"kind": "arith", "limit": 2}}).json()["job_id"]
        assert api.post(f"/v1/jobs/{running}/cancel").json()["state"] == "cancelled"
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
        assert api.post("/v1/jobs/nosuchjob/cancel").status_code == 404
        assert not r.exists(keys.job("nosuchjob"))


def test_a_request_without_the_token_is_refused_before_its_body_is_read(redis_url: str) -> None:
    """A stranger's body is never parsed: a malformed, invalid or oversized one gets 401 like any other request
    without the token, and none counts as a rejected job or a validation failure."""
    with serve(redis_url, "api-auth-first", "api.max_body_bytes=2048") as api:
        url = f"{api.base_url}/v1/jobs"
        json_body = {"Content-Type": "application/json"}
        for body in (b"{oops", b'{"source": {"kind": "arith"}}', b'{"name": "' + b"x" * 4000 + b'"}'):
            for headers in (json_body, {**json_body, "Authorization": "Bearer wrong"}):
                reply = httpx.post(url, content=body, headers=headers)
                assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", reply.text
        assert _refused(api, "auth") == 6
        assert (_refused(api, "validation"), _refused(api, "body_size")) == (0, 0)
        assert "rollwave_api_jobs_rejected_total 0.0" in api.get("/metrics").text
        reply = api.post("/v1/jobs", content=b"{oops", headers=json_body)  # with the token: parsed, and refused
        assert reply.status_code == 422 and _refused(api, "validation") == 1
        assert "rollwave_api_jobs_rejected_total 1.0" in api.get("/metrics").text


def _server_metrics() -> tuple[RolloutMetrics, CheckpointMetrics]:
    """A rollout server's metrics as ``rollout_server.__main__`` makes them: one registry for both."""
    metrics = RolloutMetrics()
    return metrics, CheckpointMetrics(metrics.registry)


def test_dashboard_pause_is_the_latest_updates_not_a_lifetime_mean(redis_url: str) -> None:
    """Each point is the mean pause of the commits since the last sample (each server differenced on its own, a
    restarted one from zero), held while no commit comes; a server up before the API is first seen as a baseline."""
    client, keys = redis.Redis.from_url(redis_url), Keys("pauses")
    registry = ServerRegistry(client, keys)
    sampler = MetricsSampler(ClusterView(client, keys, registry, TaskQueue(client, keys, BufferConfig())))
    servers = {name: _server_metrics() for name in ("a", "b")}
    started = {"a": time.time() - 60, "b": time.time() - 60}  # both up before the API

    def sample(t: float, **pauses_ms: list[float]) -> float | None:
        for name, ms in pauses_ms.items():
            for value in ms:
                servers[name][1].pause_seconds.observe(value / 1000)
        for name, (metrics, _) in servers.items():  # each server's heartbeat carries its stats
            registry.heartbeat(ServerInfo(name, "http://127.0.0.1:1", started=started[name], stats=metrics.stats()))
        sampler.record(t, sampler.cluster.sample())
        return sampler.points[-1][1]["pause_ms"]

    assert sample(0.0, a=[400.0] * 10) is None  # ten pauses before the API looked: a baseline, not charted
    assert sample(1.0, a=[10.0, 30.0]) == pytest.approx(20.0)
    assert sample(2.0) == pytest.approx(20.0)  # no commit since: the last updates' mean is held
    assert sample(3.0, b=[50.0]) == pytest.approx(50.0)
    servers["b"], started["b"] = _server_metrics(), time.time() + 1  # b restarted: its counters begin again
    assert sample(4.0, a=[10.0], b=[2.0]) == pytest.approx(6.0)


def test_dashboard_rates_are_what_each_server_did_since_the_last_sample(redis_url: str) -> None:
    """Tokens/s and tool errors/s differenced per server: a server that misses a heartbeat (out of the live set for a
    sample) and comes back used to add its lifetime count as one second's (a 1M tokens/s spike); a server up before
    the API is a baseline, a restarted one counts from zero."""
    client, keys = redis.Redis.from_url(redis_url), Keys("rates")
    registry = ServerRegistry(client, keys)
    sampler = MetricsSampler(ClusterView(client, keys, registry, TaskQueue(client, keys, BufferConfig())))
    tokens = {"a": 1_000_000.0, "b": 0.0}
    started = {"a": time.time() - 60, "b": time.time() - 60}

    def sample(t: float, live: tuple[str, ...] = ("a", "b")) -> float | None:
        for name in ("a", "b"):
            if name in live:
                registry.heartbeat(ServerInfo(name, "http://127.0.0.1:1", started=started[name],
                                              stats={"generated_tokens": tokens[name]}))
            else:
                registry.deregister(name)
        sampler.record(t, sampler.cluster.sample())
        return sampler.points[-1][1]["generated_tokens_per_s"]

    assert sample(0.0) is None  # the first sample: a baseline
    tokens["a"] += 100
    assert sample(1.0) == pytest.approx(100.0)
    tokens["a"] += 50
    assert sample(2.0, live=("b",)) == pytest.approx(0.0)  # a missed its heartbeat
    tokens["a"] += 50
    assert sample(3.0) == pytest.approx(100.0)  # back: what it did since it was last seen, not its lifetime
    tokens["b"], started["b"] = 30.0, time.time() + 1  # b restarted: its counters begin again, from zero
    assert sample(4.0) == pytest.approx(30.0)


def _train_job(api: httpx.Client, limit: int) -> str:
    reply = api.post("/v1/jobs", json={"kind": "train", "source": {"kind": "arith", "limit": limit}})
    assert reply.status_code == 201, reply.text
    return reply.json()["job_id"]


def test_a_train_job_is_cancelled_while_its_groups_wait_untrained_and_they_are_never_trained(redis_url: str) -> None:
    """Every task rolled out, the trainer running and the job's groups still in the buffer: the cancel takes (it was
    refused 409 "nothing is left to cancel" until the trainer had finished), and the trainer acks the groups it had not
    taken away unread, counted ``cancelled``; the one a step already held is trained. The job adds up. Only a job
    whose every group is trained or dropped is done (409). Real API, real Redis, a real trainer-side take."""
    keys, cfg = Keys("api-cancel-untrained"), BufferConfig()
    with serve(redis_url, keys.run) as api:
        r = redis.Redis.from_url(redis_url)
        queue, writer = TaskQueue(r, keys, cfg), ReplayBuffer(r, keys, cfg, consumer="rollout-0")
        trainer = ReplayBuffer(r, keys, cfg, consumer="trainer")
        trainer.ensure_group()

        def roll_out(job_id: str, n: int) -> None:
            for entry in queue.read("rollout-0", n):
                assert entry.job_id == job_id and writer.put(make_group(job_id, entry.group_id, run=keys.run),
                                                              task=entry)

        job_id = _train_job(api, 3)
        roll_out(job_id, 3)
        [(held, group)] = trainer.take(1, 5.0)  # a step holds one of its groups
        reply = api.post(f"/v1/jobs/{job_id}/cancel")
        assert reply.status_code == 200 and reply.json()["state"] == "cancelled", reply.text
        assert trainer.take(2, 0.5) == []  # the two left are acked away, never delivered for training
        assert trainer.ack([held], [group.group_id]) == 1  # the step that held one trains it
        progress = api.get(f"/v1/jobs/{job_id}").json()["progress"]
        assert (progress["trained"], progress["cancelled"]) == (1, 2), progress
        assert progress["submitted"] == sum(progress[name] for name in TRAIN_ENDS) == 3
        assert trainer.metrics.cancelled.labels(stream="groups")._value.get() == 2
        assert api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"  # again: as it is

        done = _train_job(api, 2)
        roll_out(done, 2)
        taken = trainer.take(2, 5.0)
        stale = taken[1][1].group_id
        assert trainer.ack([e for e, _ in taken], [g.group_id for _, g in taken], stale_group_ids=[stale]) == 2
        reply = api.post(f"/v1/jobs/{done}/cancel")  # one group trained, one dropped: nothing is left
        assert reply.status_code == 409 and reply.json()["detail"].startswith(f"job {done} is done: "), reply.text
        assert r.hget(keys.job(done), "state") == b"running"
        assert _refused(api, "not_cancellable") == 1


class ChecksThenCompetes(redis.Redis):
    """A Redis client that, once, lets ``compete`` run right after the API read an idempotency key (and found it
    unused): another submit under the key slips in between that check and the API's own submit."""

    compete: Callable[[], object] | None = None
    prefix = ""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        result = super().execute_command(*args, **options)
        if self.compete is not None and args[0] == "GET" and str(args[1]).startswith(self.prefix):
            compete, self.compete = self.compete, None
            compete()
        return result


def _metric(api: httpx.Client, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in api.get("/metrics").text.splitlines() if line.startswith(name)]
    return value


def test_a_submit_retried_with_its_idempotency_key_makes_one_job(redis_url: str) -> None:
    """A client that lost the reply to its submit sends it again with the same Idempotency-Key: it gets the job the
    first made (200, its id, no new tasks), counted; also once the trainer finished, which refuses a new train job. The
    key with another spec is a 422 naming the header; without a key each submit is a job of its own."""
    keys = Keys("api-idempotent")
    body = {"kind": "train", "source": {"kind": "arith", "limit": 3}}
    with serve(redis_url, keys.run) as api:
        r = redis.Redis.from_url(redis_url)
        first = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "retry-1"})
        assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers, first.text
        job_id = first.json()["job_id"]
        RedisStatus(r, keys).finished(4, "trainer.total_steps", 0, 0)
        again = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "retry-1"})
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true", again.text
        assert again.json()["job_id"] == job_id and again.json()["progress"]["submitted"] == 3
        assert _metric(api, "rollwave_api_jobs_replayed_total") == 1
        RedisStatus(r, keys).started()

        other = api.post("/v1/jobs", json={**body, "n_samples": 8}, headers={"Idempotency-Key": "retry-1"})
        assert other.status_code == 422, other.text
        [error] = other.json()["detail"]
        assert error["loc"] == ["header", "Idempotency-Key"] and f"used for job {job_id}" in error["msg"], error
        assert _refused(api, "idempotency_key") == 1 and _metric(api, "rollwave_api_jobs_rejected_total") == 1
        long = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k" * 256})
        assert long.status_code == 422 and long.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]

        assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [job_id]
        assert r.xlen(keys.tasks("train")) == 3
        unkeyed = {api.post("/v1/jobs", json=body).json()["job_id"] for _ in range(2)}
        assert len(unkeyed) == 2 and r.xlen(keys.tasks("train")) == 9


def test_two_submits_under_one_key_make_one_job_whichever_checks_first(redis_url: str) -> None:
    """The key is claimed in the Redis call that adds the tasks, not by a read before it: a submit under the key that
    lands between the API's read of the key and its submit makes the job, and the API answers with that job."""
    client = ChecksThenCompetes.from_url(redis_url)
    keys = Keys("api-idempotent-race")
    body = {"kind": "eval", "source": {"kind": "arith", "limit": 2}}
    with serve(redis_url, keys.run, client=client) as api:
        competed: list[httpx.Response] = []
        client.prefix = f"{keys.prefix}idempotency:"
        client.compete = lambda: competed.append(api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k"}))
        reply = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k"})
        [winner] = competed
        assert winner.status_code == 201, winner.text
        assert reply.status_code == 200 and reply.json()["job_id"] == winner.json()["job_id"], reply.text
        assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [winner.json()["job_id"]]
        assert redis.Redis.from_url(redis_url).xlen(keys.tasks("eval")) == 2
