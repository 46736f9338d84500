"""The REST API and its CLI at their edges, where each said something other than what happened: waits on a job
cancelled, deleted or left by a killed trainer, text no UTF-8 carries, input nested past what JSON can echo, a submit
Redis failed to read back, the dashboard's series read while they grow, trajectories that would drive a terminal.
Real API, real Redis, the installed CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.replay import ReplayBuffer
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, load_config
from services.api import create_app
from services.api.cluster import ClusterView
from services.api.sampler import MetricsSampler
from services.cli import CliError
from services.client_cmd import wait_for_job
from tests.http_harness import serve_app
from tests.test_cli_errors import rollwave
from tests.test_job_stalled import TOKEN, served_run
from trainer.metrics import TrainerLease


@pytest.fixture
def run(redis_url: str, request: pytest.FixtureRequest) -> Iterator[tuple[httpx.Client, redis.Redis, Keys]]:
    with served_run(redis_url, request) as parts:
        yield parts


def _submit(api: httpx.Client, body: dict) -> str:
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 201, reply.text
    return reply.json()["job_id"]


def test_a_wait_gives_a_trainer_whose_lease_lapsed_time_to_come_back(run) -> None:
    """A trainer killed without recording its end (SIGKILL, the OOM killer) lets its lease lapse: the API reads that
    as a crash (the job ``stalled``, its reason saying the trainer crashed), and ``--wait`` gives a restart
    ``restart_wait_s``, as for a crash the trainer recorded (README), where it ended at once."""
    api, client, keys = run
    job_id = _submit(api, {"kind": "train", "source": {"kind": "arith", "limit": 1}})
    lease = TrainerLease(client, keys, ReplayBuffer(client, keys, BufferConfig(), consumer="trainer"), 60_000)
    lease.renew()  # a trainer took its lease, and was killed: it renews it no more
    client.delete(keys.trainer_alive)  # lapsed
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "stalled" and job["reason"].startswith("the trainer crashed at step 0 (its lease "), job
    with pytest.raises(CliError) as refused:
        wait_for_job(api, job_id, timeout_s=60, poll_s=0.1, restart_wait_s=0.5)
    assert str(refused.value).endswith("(no trainer took it up within 0.5 s)"), refused.value
    assert refused.value.exit_code == 1


def test_a_lone_surrogate_in_a_job_is_a_422_naming_where_never_a_500(run) -> None:
    """JSON's ``"\\ud800"`` (a UTF-16 surrogate not paired) reads as a string Python's parser takes and no UTF-8 can
    hold: echoed in a 422 (a field the schema refuses, an unknown key) or in an inline task's free-form field (a valid
    spec, which could not be stored), each got a 500. They are 422s, the surrogate escaped where echoed, and nothing is
    written."""
    api, client, keys = run

    def post(body: str) -> httpx.Response:
        return api.post("/v1/jobs", content=body.encode(), headers={"Content-Type": "application/json"})

    def inline(content: str, reward: str = '"ground_truth": "3"') -> str:
        """An eval job of one inline task, as JSON text: ``content`` its message's (a JSON string), ``reward`` the
        members of its reward object."""
        task = f'{{"task_id": "t", "messages": [{{"role": "user", "content": {content}}}], "reward": {{{reward}}}}}'
        return f'{{"kind": "eval", "source": {{"kind": "inline", "tasks": [{task}]}}}}'

    for body, loc, text in (
        ('{"name": "\\udfff", "source": {"kind": "arith", "limit": 1}}', ["body", "name"], None),
        ('{"kind": "evil\\ud800", "source": {"kind": "arith", "limit": 1}}', ["body", "kind"], None),
        ('{"x\\ud800": 1, "source": {"kind": "arith", "limit": 1}}', ["body"], None),
        (inline('"hi \\ud83d\\ude00 \\ud800"'), ["body", "source"],
         "field 'source.tasks[0].messages[0].content' holds a lone UTF-16 surrogate"),
        (inline('"hi"', '"ground_truth": "3", "\\udc00": 1'), ["body", "source"],
         "field 'source.tasks[0].reward' holds a lone UTF-16 surrogate"),
    ):
        reply = post(body)
        assert reply.status_code == 422, (body, reply.status_code, reply.text)
        [error] = reply.json()["detail"]
        assert error["loc"] == loc, (body, error)
        assert text is None or error["msg"].startswith(text), (body, error)
    assert post('{"name": "\\udfff", "source": {"kind": "arith", "limit": 1}}').json()["detail"][0]["input"] == \
        "\\udfff"  # echoed as its escape
    assert api.get("/v1/jobs").json()["jobs"] == [] and client.keys(f"{keys.prefix}job*") == []
    refused = 'rollwave_api_requests_refused_total{reason="validation"} 6.0'
    assert refused in api.get("/metrics").text
    paired = post(inline('"hi \\ud83d\\ude00"'))
    assert paired.status_code == 201, paired.text  # a pair is one character: taken
    assert paired.json()["spec"]["source"]["tasks"][0]["messages"][0]["content"] == "hi \U0001f600"


def test_a_job_redis_took_but_failed_to_read_back_is_answered_as_submitted(redis_url: str) -> None:
    """Redis fails the read of a job just written whole (here a user refused HGETALL; in life Redis gone right after
    the submit's MULTI): the submit is a 201 with the job as submitted, counted so, where a 503 ("try again") made a
    client without an Idempotency-Key submit it twice."""
    admin, password, keys = redis.Redis.from_url(redis_url), secrets.token_urlsafe(16), Keys("api-read-back")
    admin.acl_setuser("no-hgetall", enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                      commands=["+@all", "-hgetall"])
    limited = redis.Redis.from_url(redis_url, username="no-hgetall", password=password)
    cfg = load_config(None, [f"run.name={keys.run}", f"redis.url={redis_url}", f"api.token={TOKEN}"], env={})
    try:
        with serve_app(create_app(cfg, limited)) as url, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
            reply = api.post("/v1/jobs", json={"kind": "eval", "source": {"kind": "arith", "limit": 3}})
            assert reply.status_code == 201, reply.text
            job = reply.json()
            assert (job["kind"], job["state"], job["progress"]["submitted"], job["spec"]["source"]["limit"]) == \
                ("eval", "running", 3, 3), job
            assert api.get(f"/v1/jobs/{job['job_id']}").status_code == 503  # Redis still fails the read
            metrics = api.get("/metrics").text
        assert 'rollwave_api_jobs_submitted_total{kind="eval"} 1.0' in metrics
        assert "rollwave_api_jobs_rejected_total 0.0" in metrics
        assert admin.hkeys(keys.jobs) == [job["job_id"].encode()]
        assert TaskQueue(admin, keys, BufferConfig()).job(job["job_id"])["submitted"] == "3"
    finally:
        limited.close()
        admin.acl_deluser("no-hgetall")
        admin.close()


def test_submit_wait_on_a_job_cancelled_meanwhile_exits_1(run, tmp_path: Path) -> None:
    """``rollwave submit --wait`` exits 0 once the job is done; a job cancelled while it waits is not, and its results
    are partial: the wait prints where it stopped and exits 1 saying so (it exited 0, as for a job done)."""
    api, _client, _keys = run

    def cancel_once_submitted() -> None:
        deadline = time.monotonic() + 60
        while not (jobs := api.get("/v1/jobs").json()["jobs"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for job in jobs:
            api.post(f"/v1/jobs/{job['job_id']}/cancel").raise_for_status()

    canceller = threading.Thread(target=cancel_once_submitted)
    canceller.start()
    try:
        proc = rollwave("submit", "--kind", "eval", "--source", "arith", "--limit", "2", "--wait", "--timeout", "60",
                        "--api", str(api.base_url), cwd=tmp_path, env={"ROLLWAVE_API_TOKEN": TOKEN})
    finally:
        canceller.join(60)
    [job_id] = [job["job_id"] for job in api.get("/v1/jobs").json()["jobs"]]
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert json.loads(proc.stdout.splitlines()[-1])["state"] == "cancelled", proc.stdout
    assert proc.stderr.splitlines()[-1] == (f"error: job {job_id} was cancelled while --wait waited (0 of its 2 tasks "
                                            "rolled out): its results are partial"), proc.stderr


def test_a_wait_on_a_job_deleted_meanwhile_says_so_exit_1(run) -> None:
    """The job a wait polls is deleted (cancelled, then deleted, by someone else): the wait ends saying so, exit 1 (a
    run-time event), where it ended with the API's 404 as an input mistake (exit 2) asking whether --api was right."""
    api, _client, _keys = run
    job_id = _submit(api, {"kind": "eval", "source": {"kind": "arith", "limit": 2}})
    polls: list[int] = []

    def delete_after_first_poll(reply: httpx.Response) -> None:
        polls.append(reply.status_code)
        if len(polls) == 1:
            api.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
            api.delete(f"/v1/jobs/{job_id}").raise_for_status()

    with httpx.Client(base_url=api.base_url, headers=api.headers, timeout=30,
                      event_hooks={"response": [delete_after_first_poll]}) as client, \
            pytest.raises(CliError) as refused:
        wait_for_job(client, job_id, timeout_s=60, poll_s=0.1)
    assert polls == [200, 404], polls
    assert refused.value.exit_code == 1
    assert str(refused.value) == (f"job {job_id} at {api.base_url} was deleted while the wait polled it (last seen "
                                  "running, 0 of 2 tasks finished)")


def test_the_dashboards_series_are_read_whole_while_the_sampler_adds_points(run) -> None:
    """``GET /v1/metrics/summary`` runs in a worker thread while the sampler appends a point a second in the event
    loop's: reading the deque as it changed raised ``deque mutated during iteration`` (a 500 now and then). Here the
    two run side by side in a tight loop, threads switched as often as the interpreter allows."""
    _api, client, keys = run
    sampler = MetricsSampler(ClusterView(client, keys, ServerRegistry(client, keys), TaskQueue(client, keys,
                                                                                              BufferConfig())))
    raw = sampler.cluster.sample()
    for t in range(900):  # full: each point added drops the oldest
        sampler.record(float(t), dict(raw))
    stop, errors = threading.Event(), []

    def add_points() -> None:
        t = 900.0
        while not stop.is_set():
            t += 1
            sampler.record(t, dict(raw))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    adder = threading.Thread(target=add_points)
    adder.start()
    try:
        for _ in range(300):
            try:
                summary = sampler.summary()
            except RuntimeError as exc:
                errors.append(str(exc))
            else:
                assert len(summary["t"]) == 900 and all(len(s) == 900 for s in summary["series"].values())
    finally:
        stop.set()
        adder.join(30)
        sys.setswitchinterval(interval)
    assert errors == [], f"{len(errors)} of 300 reads failed: {errors[0]}"


def test_rollwave_trajectories_escapes_what_would_drive_the_terminal(run, tmp_path: Path) -> None:
    """A trajectory holds what the model wrote (any bytes its tokenizer makes) and what a job's submitter sent: an
    escape sequence among it (a window title, a clipboard write, a cleared screen, a carriage return over a line) went
    to the reader's terminal as it was. The table shows each control character as its escape, lines and tabs as they
    are; ``--json`` escapes them as JSON does."""
    api, client, keys = run
    job_id = _submit(api, {"kind": "eval", "source": {"kind": "arith", "limit": 1}})
    content = "2+2 is\t4\n\x1b]0;pwned\x07\x1b[2J\rfake line\x9b31m"
    sample = {"group_id": f"{job_id}:0:t\x1b[8m", "sample_index": 0, "reward": 1.0, "finish_reason": "stop",
              "messages": [{"role": "assistant", "content": content}], "tool_calls": []}
    client.xadd(keys.trajectories(job_id), {"sample": json.dumps(sample)})
    env = {"ROLLWAVE_API_TOKEN": TOKEN}
    proc = rollwave("trajectories", job_id, "--api", str(api.base_url), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"── {job_id}:0:t\\x1b[8m sample 0: reward 1.0 (stop)",
        "  [assistant] 2+2 is\t4",
        "\\x1b]0;pwned\\x07\\x1b[2J\\x0dfake line\\x9b31m",
    ], proc.stdout
    proc = rollwave("trajectories", job_id, "--json", "--api", str(api.base_url), cwd=tmp_path, env=env)
    assert json.loads(proc.stdout)["messages"][0]["content"] == content and "\x1b" not in proc.stdout


def test_an_input_nested_past_what_json_can_echo_is_named_in_its_422_never_a_500(run) -> None:
    """A field the schema refuses holding lists nested 254 levels or more (Python's parser takes about 990): its 422
    echoed the input, which the serializer cannot write past 255 levels, and the client got a 500. It is a 422 naming
    the field and how deep the input went; a shallower one is echoed as before."""
    api, _client, _keys = run
    for depth, echoed in ((300, "(not echoed: objects and lists 300 levels within each other)"),
                          (900, "(not echoed: objects and lists 900 levels within each other)"),
                          (50, json.loads("[" * 50 + "1" + "]" * 50))):
        body = '{"source": {"kind": "arith", "limit": 1}, "name": ' + "[" * depth + "1" + "]" * depth + "}"
        reply = api.post("/v1/jobs", content=body.encode(), headers={"Content-Type": "application/json"})
        assert reply.status_code == 422, (depth, reply.status_code, reply.text[:300])
        [error] = reply.json()["detail"]
        assert (error["loc"], error["msg"], error["input"]) == (["body", "name"], "Input should be a valid string",
                                                                echoed), error
    assert "rollwave_api_jobs_rejected_total 3.0" in api.get("/metrics").text


def test_a_wait_rides_out_503s_from_its_first_poll(tmp_path: Path) -> None:
    """Redis goes away right after the submit (the API answering 503): the wait's first poll rode out nothing, and the
    wait ended at once with exit 1, where its later polls ride out a minute of those (README). It waits, and sees
    the job's end once Redis is back."""
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        cfg = load_config(None, ["run.name=first-poll", f"redis.url={server.url}", "redis.timeout_s=1.5",
                                 f"api.token={TOKEN}"], env={})
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with serve_app(create_app(cfg)) as url, httpx.Client(base_url=url, headers=auth, timeout=30) as api:
            job_id = _submit(api, {"kind": "eval", "source": {"kind": "arith", "limit": 2}})
            assert server.proc is not None
            pid, polls = server.proc.pid, []

            def back_and_cancel() -> None:
                os.kill(pid, signal.SIGCONT)
                api.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()

            os.kill(pid, signal.SIGSTOP)
            timer = threading.Timer(4.5, back_and_cancel)
            timer.start()
            try:
                with httpx.Client(base_url=url, headers=auth, timeout=30,
                                  event_hooks={"response": [lambda reply: polls.append(reply.status_code)]}) as client:
                    job = wait_for_job(client, job_id, timeout_s=60, poll_s=0.1)
            finally:
                timer.join(30)
                os.kill(pid, signal.SIGCONT)
        assert job["state"] == "cancelled" and polls[0] == 503, (job, polls)


def test_the_sampler_goes_on_past_a_value_it_cannot_read(run, caplog: pytest.LogCaptureFixture) -> None:
    """A step whose metrics are not JSON (a writer's bug, a newer trainer) made a sample raise what is not a Redis
    error: the sampler's loop ended, and the dashboard's charts stopped for good. It logs the failure once, with its
    traceback, and samples again once the value is gone."""
    _api, client, keys = run
    sampler = MetricsSampler(ClusterView(client, keys, ServerRegistry(client, keys),
                                         TaskQueue(client, keys, BufferConfig())), interval_s=0.05)
    client.xadd(keys.steps, {"metrics": "not json"})

    async def sample_through_it() -> None:
        loop = asyncio.create_task(sampler.run())
        try:
            await asyncio.sleep(0.5)
            assert not loop.done() and not sampler.points
            client.delete(keys.steps)
            for _ in range(200):
                if sampler.points:
                    break
                await asyncio.sleep(0.05)
            assert not loop.done() and sampler.points
        finally:
            loop.cancel()

    with caplog.at_level(logging.INFO, logger="services.api.sampler"):
        asyncio.run(sample_through_it())
    failed = [r for r in caplog.records if "metrics sample failed (JSONDecodeError" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None, caplog.text
    assert "metrics samples work again" in caplog.text


def test_a_waits_first_poll_ends_at_its_deadline() -> None:
    """An API that takes the connection and never answers (stuck, or a port something else holds): the wait's first
    poll waited out the client's own timeout, whatever the wait's ``timeout_s``, where every later poll ends at the
    deadline. It ends there too, with the client's timeout error naming the request."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nothing ever reads or answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        errors: list[BaseException] = []

        def wait() -> None:
            with httpx.Client(base_url=url, timeout=600) as client:
                try:
                    wait_for_job(client, "j-silent", timeout_s=1.0, poll_s=0.1)
                except BaseException as exc:  # handed to the test's thread
                    errors.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(60)
        assert not waiter.is_alive(), "the first poll waited past the wait's timeout_s"
    [error] = errors
    assert isinstance(error, httpx.ReadTimeout) and "/v1/jobs/j-silent" in str(error.request.url), repr(error)
