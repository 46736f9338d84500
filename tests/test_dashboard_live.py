"""The built-in dashboard and the CLI against a live cluster: real Redis, a real rollout server with the
tiny model, the real API over HTTP with a token, and jobs that have run.

Headless Chromium opens ``/#token=...`` and must find every chart whose series has data drawn
(``data-points`` > 0), the jobs table listing the jobs and the cluster table listing the server;
``rollwave jobs | status | trajectories`` must print the same jobs, server and trajectories.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from transformers import AutoModelForCausalLM

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import PushRecord, ServerRegistry
from core.config import CheckpointConfig, load_config
from services.api import create_app
from tests.chromium_harness import dump_dom, elements
from tests.http_harness import serve_app
from trainer.checkpoint_pusher import CheckpointPusher

ROOT = Path(__file__).resolve().parents[1]
TOKEN = secrets.token_urlsafe(32)
CHECKPOINT_TOKEN = secrets.token_urlsafe(32)
DATA = ROOT / "data"
SERVER_ID = "dash-0"
EVAL_TASKS = 3
# Series the cluster above feeds (the pause: by one push); the trainer's (reward, staleness, idle) stay empty.
FED_SERIES = {"policy_version", "buffer_depth_groups", "generated_tokens_per_s", "pause_ms", "tool_errors_per_s"}


@dataclass
class Live:
    url: str
    api: httpx.Client
    eval_id: str
    train_id: str
    redis_url: str


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, server: subprocess.Popen, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := probe()):
        assert server.poll() is None, f"rollout server exited with {server.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)
    return found


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server stops its engine), then SIGKILL whatever is left of its process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("dashboard")
    with EmbeddedRedis(tmp / "redis", aof=False) as redis_server:
        overrides = [
            "run.name=dash", f"run.dir={tmp}", f"redis.url={redis_server.url}",
            f"model.path={tiny_model_dir}", "model.init_if_missing=false", "rollout.n_samples=2",
            "rollout.max_new_tokens=16", "rollout.max_turns=2", "rollout.heartbeat_s=0.5",
            f"rollout.server_id={SERVER_ID}",
        ]
        api_cfg = load_config(None, [*overrides, f"api.token={TOKEN}", f"api.data_root={DATA}"])
        log = tmp / "rollout.log"
        env = {**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": CHECKPOINT_TOKEN}
        with serve_app(create_app(api_cfg)) as url, open(log, "wb") as out:
            server = subprocess.Popen([sys.executable, "-m", "rollout_server", *overrides], cwd=ROOT, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True, env=env)
            try:
                with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
                    yield _run_jobs(url, api, server, log, redis_server.url, tiny_model_dir, tmp / "push")
            finally:
                _stop(server)


def _run_jobs(url: str, api: httpx.Client, server: subprocess.Popen, log: Path, redis_url: str, model_dir: Path,
              stage_dir: Path) -> Live:
    """An eval job run to the end, a small train job whose groups wait in the buffer (no trainer) and one
    weight push (the trainer's pusher) so the pause is charted."""

    def alive() -> bool:
        return any(s["server_id"] == SERVER_ID and s["alive"] for s in api.get("/v1/status").json()["servers"])

    wait_for("server registered", alive, 120, server, log)
    eval_job = api.post("/v1/jobs", json={"kind": "eval", "name": "held-out",
                                          "source": {"kind": "arith", "split": "test", "limit": EVAL_TASKS}})
    train_job = api.post("/v1/jobs", json={"kind": "train", "source": {"kind": "arith", "limit": 2}})
    assert eval_job.status_code == train_job.status_code == 201, (eval_job.text, train_job.text)
    eval_id, train_id = eval_job.json()["job_id"], train_job.json()["job_id"]
    wait_for("eval job done", lambda: api.get(f"/v1/jobs/{eval_id}").json()["state"] == "done", 120, server, log)
    wait_for("train groups written", lambda: api.get(f"/v1/jobs/{train_id}").json()["progress"]["completed"] == 2,
             120, server, log)
    [info] = ServerRegistry(redis.Redis.from_url(redis_url), Keys("dash")).live_servers()
    pusher = CheckpointPusher(CheckpointConfig(token=CHECKPOINT_TOKEN, stage_dir=stage_dir), [info.grpc_address])
    try:
        assert pusher.push_model(AutoModelForCausalLM.from_pretrained(model_dir), version=1).wait(60).ok
    finally:
        pusher.close()
    series = lambda: api.get("/v1/metrics/summary").json()["series"]  # noqa: E731
    wait_for("every fed series sampled", lambda: all(any(v is not None for v in series()[n]) for n in FED_SERIES),
             30, server, log)
    return Live(url, api, eval_id, train_id, redis_url)


def _section(html: str, element_id: str) -> str:
    start = html.index(f'id="{element_id}"')
    return html[start : html.index("</section>", start)]


def test_dashboard_draws_live_charts_jobs_and_servers(live: Live) -> None:
    summary = live.api.get("/v1/metrics/summary").json()
    with_data = {name for name, ys in summary["series"].items() if any(v is not None for v in ys)}
    assert with_data >= FED_SERIES

    html = dump_dom(f"{live.url}/#token={TOKEN}", virtual_time_ms=5000)

    body = elements(html, "body")[0].attrs
    assert body["data-state"] == "ok" and int(body["data-polls"]) >= 1, _section(html, "status")
    points = {c.attrs["data-series"]: int(c.attrs["data-points"]) for c in elements(html, "canvas")}
    assert set(points) == set(summary["series"])
    assert {name for name in with_data if points[name] == 0} == set(), points
    jobs = _section(html, "jobs")
    assert live.eval_id in jobs and live.train_id in jobs and "held-out" in jobs and "done" in jobs
    assert SERVER_ID in _section(html, "status")


def test_a_straggler_shows_in_the_api_dashboard_and_cli(live: Live) -> None:
    """The trainer's pusher records each push in the registry; a failed one marks the server a straggler."""
    registry = ServerRegistry(redis.Redis.from_url(live.redis_url), Keys("dash"))
    error = f"server {SERVER_ID} (127.0.0.1:1): connect: no answer within its 10 s deadline"
    registry.record_push(SERVER_ID, PushRecord(version=7, ok=False, stage="connect", reason="timeout", error=error,
                                               serves=5))
    try:
        status = live.api.get("/v1/status").json()
        [server] = [s for s in status["servers"] if s["server_id"] == SERVER_ID]
        assert server["straggler"] and status["stragglers"] == [SERVER_ID]
        assert server["last_push"]["reason"] == "timeout" and server["last_push"]["serves"] == 5

        html = dump_dom(f"{live.url}/#token={TOKEN}", virtual_time_ms=5000)
        assert f"v7 failed at connect (timeout), serves v5: {error}" in _section(html, "status")

        lines = _rollwave(live, "status").splitlines()
        assert any(line.split()[:2] == [SERVER_ID, "True"] and "v7 FAILED connect/timeout" in line for line in lines)
        assert f"straggler {SERVER_ID}: serves v5, last push failed: {error}" in lines
    finally:
        registry.record_push(SERVER_ID, PushRecord(version=8, ok=True, serves=8))
    assert live.api.get("/v1/status").json()["stragglers"] == []


def _rollwave(live: Live, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args, "--api", live.url], cwd=ROOT,
                          env={**os.environ, "ROLLWAVE_API_TOKEN": TOKEN}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_prints_jobs_status_and_trajectories(live: Live) -> None:
    rows = {line.split()[0]: line.split() for line in _rollwave(live, "jobs").splitlines()[1:]}
    assert rows[live.eval_id][1:4] == ["eval", "done", f"{EVAL_TASKS}/{EVAL_TASKS}"]
    assert rows[live.train_id][1:4] == ["train", "done", "2/2"]

    status = _rollwave(live, "status")
    assert any(line.split()[:2] == [SERVER_ID, "True"] for line in status.splitlines()), status

    lines = _rollwave(live, "trajectories", live.eval_id, "--all", "--limit", "2", "--json").splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) == EVAL_TASKS, lines
    for sample in samples:
        assert sample["sample_index"] == 0 and sample["finish_reason"] and isinstance(sample["reward"], float)
        assert sample["messages"][0]["role"] == "system" and sample["messages"][-1]["role"] == "assistant"
    assert len({s["group_id"] for s in samples}) == EVAL_TASKS
    text = _rollwave(live, "trajectories", live.eval_id)
    assert text.count(" sample 0: reward ") == EVAL_TASKS and "[user]" in text


def test_gsm8k_eval_job_through_the_api_reports_accuracy(live: Live) -> None:
    """Issue 9.5: an eval job over the real GSM8K test file, with the calculator tool, through the API."""
    body = {"kind": "eval", "name": "gsm8k", "tools": ["calculator"], "sampling": {"max_new_tokens": 16},
            "source": {"kind": "gsm8k", "split": "test", "limit": 4}}
    reply = live.api.post("/v1/jobs", json=body)
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["job_id"]
    deadline = time.monotonic() + 120
    while (job := live.api.get(f"/v1/jobs/{job_id}").json())["state"] != "done":
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["progress"]["completed"] == 4 and job["progress"]["dead_lettered"] == 0
    assert 0.0 <= job["accuracy"] <= 1.0
    items = live.api.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 10}).json()["items"]
    assert len(items) == 4
    assert any("Janet" in i["messages"][1]["content"] for i in items), "the first GSM8K test question"
    assert job["spec"]["tools"] == ["calculator"]
