"""The real ``python -m rollout_server`` worker against a real Redis and the embedded engine (its own, or a
shared one) with the tiny model: it writes groups, obeys admission and backpressure, survives being SIGKILLed
mid-task (another worker finishes the task, its group is written once) and shuts down gracefully on SIGTERM
(in-flight groups finish or are handed back)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from buffer_helpers import client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from http_harness import serve_app
from net_helpers import bound_socket, refused_port
from transformers import AutoModelForCausalLM, AutoTokenizer
from worker_helpers import serve_until

from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, CheckpointConfig, RolloutConfig
from core.jobs import JobSpec, TaskSource
from core.tasks import load_tasks
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker
from trainer.checkpoint_pusher import CheckpointPusher

ROOT = Path(__file__).resolve().parents[1]
KEYS = Keys("t")
CHECKPOINT_TOKEN = secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir) as engine:
        yield engine.url


class Worker:
    """One ``python -m rollout_server`` process with its log."""

    def __init__(self, tmp: Path, server: EmbeddedRedis, engines: list[str], model: Path, name: str, *extra: str):
        self.name = name
        self.log_path = tmp / f"{name}.log"
        argv = [
            sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp}", f"redis.url={server.url}",
            f"engine.urls={json.dumps(engines)}", f"model.path={model}",
            "model.init_if_missing=false",
            "rollout.n_samples=2", "rollout.max_new_tokens=8", "rollout.max_turns=2", "rollout.heartbeat_s=0.2",
            f"rollout.server_id={name}", "buffer.claim_idle_ms=1000", *extra,
        ]
        with open(self.log_path, "wb") as out:
            env = {**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": CHECKPOINT_TOKEN}
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def workers(tmp_path: Path, redis_server: EmbeddedRedis, engine_url: str, tiny_model_dir: Path):
    started: list[Worker] = []

    def start(name: str, *extra: str, own_engine: bool = False, engines: list[str] | None = None) -> Worker:
        """A server on the module's engine, its own (``own_engine``: engine.urls=[]) or ``engines``."""
        urls = [] if own_engine else engines or [engine_url]
        started.append(Worker(tmp_path, redis_server, urls, tiny_model_dir, name, *extra))
        return started[-1]

    yield start
    for w in started:
        w.close()


def wait_for(predicate: Callable[[], bool], *alive: Worker, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for w in alive:
            assert w.proc.poll() is None, f"worker {w.name} exited with {w.proc.returncode}:\n{w.log()}"
        assert time.monotonic() < deadline, "condition not reached in time:\n" + "\n".join(w.log() for w in alive)
        time.sleep(0.1)


def submit(server: EmbeddedRedis, job: str, n: int, kind: str = "train") -> list[str]:
    q = TaskQueue(client(server), KEYS, BufferConfig())
    q.ensure_groups()
    split = "train" if kind == "train" else "test"
    return q.submit(job, [t.model_dump(mode="json") for t in load_tasks("arith", split=split, limit=n)], kind)


def pending(server: EmbeddedRedis, consumer: str) -> int:
    info = client(server).xpending(KEYS.tasks("train"), ROLLOUT_GROUP)
    return sum(c["pending"] for c in info["consumers"] if c["name"] == consumer.encode())


def test_worker_serves_then_finishes_in_flight_group_on_sigterm(redis_server: EmbeddedRedis, workers) -> None:
    r = client(redis_server)
    [eval_gid] = submit(redis_server, "ev", 1, "eval")
    gids = submit(redis_server, "job", 4)
    w = workers("srv-a", "buffer.max_groups=2", "rollout.max_concurrent_groups=1", "rollout.shutdown_grace_s=60",
                own_engine=True)
    # Two groups fill the buffer; the third is rolled out and waits for room, its task still pending.
    wait_for(lambda: r.xlen(KEYS.groups) == 2 and pending(redis_server, "srv-a") == 1, w)
    [(_, ev)] = r.xrange(KEYS.eval("ev"))
    assert ev[b"gid"].decode() == eval_gid
    [info] = ServerRegistry(client(redis_server), KEYS).live_servers()
    assert info.server_id == "srv-a"
    assert httpx.get(info.engine_url + "/health").status_code == 401  # its own engine: up, and only for its key
    w.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert w.proc.poll() is None  # still draining: its in-flight group waits for room
    trainer = ReplayBuffer(r, KEYS, BufferConfig())
    batch = trainer.take(1, 5)
    trainer.ack([i for i, _ in batch], [g.group_id for _, g in batch])
    assert w.proc.wait(60) == 0, w.log()
    written = [f[b"gid"].decode() for _, f in r.xrange(KEYS.groups)] + [batch[0][1].group_id]
    assert sorted(written) == sorted(gids[:3])  # the fourth task was never started
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    assert r.xlen(KEYS.tasks("train")) == 1
    assert ServerRegistry(client(redis_server), KEYS).all_servers() == []
    with pytest.raises(httpx.TransportError):  # the worker's own engine stopped with it
        httpx.get(info.engine_url + "/health")
    group = batch[0][1]
    assert group.job_id == "job" and len(group.samples) == 2
    assert all(s.num_generated > 0 and s.oldest_version() == 0 for s in group.samples)


def test_eval_groups_in_flight_are_capped_by_max_concurrent_eval_groups(redis_server: EmbeddedRedis, workers) -> None:
    """rollout.max_concurrent_eval_groups=2: of six eval tasks the worker never holds more than two at once (a task
    read stays pending until its group is written); at the default (64) it takes all six together."""
    r = client(redis_server)
    peaks = {}
    for name, extra in (("srv-cap", ("rollout.max_concurrent_eval_groups=2",)), ("srv-free", ())):
        job = f"ev-{name}"
        submit(redis_server, job, 6, "eval")
        w = workers(name, "rollout.max_new_tokens=48", *extra)
        peaks[name], deadline = 0, time.monotonic() + 90
        while r.xlen(KEYS.eval(job)) < 6:  # polled closely: an episode of the tiny model may last a fraction of a s
            held = r.xpending(KEYS.tasks("eval"), ROLLOUT_GROUP)["consumers"]
            peaks[name] = max([peaks[name]] + [c["pending"] for c in held if c["name"] == name.encode()])
            assert w.proc.poll() is None and time.monotonic() < deadline, w.log()
            time.sleep(0.005)
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0, w.log()
    assert 1 <= peaks["srv-cap"] <= 2 and peaks["srv-free"] > 2, peaks


def test_sigkilled_worker_task_is_finished_by_another_and_written_once(
    redis_server: EmbeddedRedis, workers
) -> None:
    r = client(redis_server)
    gids = submit(redis_server, "job", 3)
    opts = ("buffer.max_groups=1", "rollout.max_concurrent_groups=1", "rollout.shutdown_grace_s=5")
    doomed = workers("srv-doomed", *opts)
    wait_for(lambda: r.xlen(KEYS.groups) == 1 and pending(redis_server, "srv-doomed") == 1, doomed)
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait()
    assert pending(redis_server, "srv-doomed") == 1  # killed in the middle of its second task
    survivor = workers("srv-survivor", *opts)
    trainer = ReplayBuffer(r, KEYS, BufferConfig())
    trained: list[str] = []

    def train() -> bool:
        batch = trainer.take(1, 0.2)
        trained.extend(g.group_id for _, g in batch)
        trainer.ack([i for i, _ in batch], [g.group_id for _, g in batch])
        return len(trained) >= 3

    wait_for(train, survivor)
    assert sorted(trained) == sorted(gids)  # each group exactly once
    assert TaskQueue(r, KEYS, BufferConfig()).job("job")["completed"] == "3"
    assert r.xlen(KEYS.tasks_dead) == 0 and r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0
    survivor.proc.send_signal(signal.SIGTERM)
    assert survivor.proc.wait(60) == 0, survivor.log()


def serve_version(engine_url: str, model: Path, version: int) -> None:
    """What a commit does to the engine: load weights (the same ones here) labelled ``version``."""
    body = {"model_path": str(model), "weight_version": str(version)}
    assert httpx.post(engine_url + "/update_weights_from_disk", json=body, timeout=60).json()["success"]


def test_admission_bad_tasks_and_handing_back_on_sigterm(redis_server: EmbeddedRedis, workers, engine_url: str,
                                                         tiny_model_dir: Path, tmp_path: Path) -> None:
    """Admission holds a server to the version it serves, and a push it commits opens room at once: the
    heartbeat, which also reads the engine's version, is stretched past the test's length."""
    r = client(redis_server)
    q = TaskQueue(r, KEYS, BufferConfig())
    q.ensure_groups()
    q.submit("bad", [{"task_id": "empty", "messages": []}], "train")  # fails validation: no retries
    gids = submit(redis_server, "job", 2)
    staleness = StalenessControl(r, KEYS, BufferConfig(max_staleness=0, groups_per_step=1))  # bound 1 at version 0
    w = workers("srv-b", "buffer.max_groups=1", "buffer.max_staleness=0", "buffer.groups_per_step=1",
                "rollout.max_concurrent_groups=4", "rollout.shutdown_grace_s=0.5", "rollout.heartbeat_s=600",
                "buffer.claim_idle_ms=600000", f"checkpoint.stage_dir={tmp_path / 'stage'}")
    wait_for(lambda: r.xlen(KEYS.groups) == 1 and r.xlen(KEYS.tasks_dead) == 1, w)
    [(_, dead)] = r.xrange(KEYS.tasks_dead)
    assert dead[b"gid"] == b"bad:0:empty" and b"invalid task" in dead[b"error"]
    time.sleep(1.0)
    assert staleness.admitted() == 1 and r.xlen(KEYS.groups) == 1  # the second task waits for the policy
    assert pending(redis_server, "srv-b") == 0 and r.xlen(KEYS.tasks("train")) == 1
    staleness.set_version(1, trained=1)  # a quorum committed version 1, but this server still serves version 0
    time.sleep(1.0)
    assert staleness.admitted() == 1 and pending(redis_server, "srv-b") == 0
    [info] = ServerRegistry(r, KEYS).live_servers()
    pusher = CheckpointPusher(CheckpointConfig(token=CHECKPOINT_TOKEN, stage_dir=tmp_path / "push"),
                              [info.grpc_address])
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert pusher.push_model(model, version=1).wait(60).ok  # its commit lands: one more group may start
    finally:
        pusher.close()
    try:
        wait_for(lambda: pending(redis_server, "srv-b") == 1, w)  # rolled out, waiting for room in the buffer
    finally:
        serve_version(engine_url, tiny_model_dir, 0)
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0, w.log()
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    [(_, back)] = r.xrange(KEYS.tasks("train"))  # handed back, not lost, and the attempt not counted
    assert back[b"gid"].decode() == gids[1] and back[b"attempts"] == b"0"
    assert r.xlen(KEYS.groups) == 1
    assert staleness.admitted() == 2 and r.hexists(KEYS.admitted_ids, gids[1])  # it keeps its slot


def test_a_dead_servers_admitted_tasks_are_taken_over(redis_server: EmbeddedRedis, workers, tmp_path: Path) -> None:
    """A server that admitted the whole staleness window and died holds every slot, so admission has no room
    for anyone: the live server takes its tasks over once idle (``claim_idle_ms``) and writes their groups."""
    r = client(redis_server)
    gids = submit(redis_server, "job", 2)
    cfg = BufferConfig(max_staleness=0, groups_per_step=2)  # a window of 2 groups at version 0
    staleness = StalenessControl(r, KEYS, cfg)
    held = TaskQueue(r, KEYS, cfg).read("dead", 2)
    assert [e.group_id for e in held] == gids and all(staleness.try_admit(gid) for gid in gids)
    assert staleness.capacity() == 0
    w = workers("srv-t", "buffer.max_staleness=0", "buffer.groups_per_step=2", f"checkpoint.stage_dir={tmp_path}")
    wait_for(lambda: r.xlen(KEYS.groups) == 2, w)
    assert sorted(f[b"gid"].decode() for _, f in r.xrange(KEYS.groups)) == sorted(gids)
    assert staleness.admitted() == 2 and r.xlen(KEYS.tasks("train")) == 0


def engine_metric(url: str, name: str) -> float:
    """The sum of a metric's samples (every label set) on an embedded engine's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def test_a_sigkilled_server_is_live_for_three_heartbeat_s_only(redis_server: EmbeddedRedis, workers) -> None:
    """rollout.heartbeat_s=0.3: the registry holds a server live for three heartbeats (0.9 s) past its last beat,
    so a SIGKILLed one, which never deregisters, is out of ``live_servers()`` within 3 s (the default, 2 s, keeps
    it for 6 s past a beat, and beats come every 0.33 s here: ``buffer.claim_idle_ms=1000``)."""
    r = client(redis_server)
    registry = ServerRegistry(r, KEYS)
    w = workers("srv-hb", "rollout.heartbeat_s=0.3")
    wait_for(lambda: [s.server_id for s in registry.live_servers()] == ["srv-hb"], w)
    ttls = []
    for _ in range(10):  # each beat sets it anew: under load a late beat may let it lapse a moment (then -2)
        ttls.append(r.pttl(KEYS.server_alive("srv-hb")))
        time.sleep(0.1)
    assert any(t > 0 for t in ttls) and max(ttls) <= 900, ttls
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait()
    wait_for(lambda: registry.live_servers() == [], timeout_s=3.0)
    assert [(info.server_id, live) for info, live in registry.all_servers()] == [("srv-hb", False)]  # not deregistered


def test_a_group_still_generating_when_shutdown_grace_s_runs_out_is_handed_back(
    redis_server: EmbeddedRedis, workers, engine_url: str
) -> None:
    """rollout.shutdown_grace_s=1: the engine is paused, so the group in flight cannot finish; on SIGTERM the server
    waits 1 s for it, then hands its task back (logged with the reason) and exits well within 15 s (the default,
    30 s, would still be waiting)."""
    r = client(redis_server)
    [gid] = submit(redis_server, "job", 1)
    assert httpx.post(engine_url + "/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
    try:
        w = workers("srv-g", "rollout.shutdown_grace_s=1")
        wait_for(lambda: pending(redis_server, "srv-g") == 1, w)
        wait_for(lambda: engine_metric(engine_url, "rollwave_engine_waiting_requests") >= 1, w)  # generating
        signalled = time.monotonic()
        w.proc.send_signal(signal.SIGTERM)
        try:
            code = w.proc.wait(15)
        except subprocess.TimeoutExpired:
            raise AssertionError("still draining 15 s after SIGTERM:\n" + w.log()) from None
        took = time.monotonic() - signalled
    finally:
        assert httpx.post(engine_url + "/continue_generation", json={}, timeout=30).status_code == 200
        deadline = time.monotonic() + 60  # the requests it left queued run now: none is left for the next test
        while engine_metric(engine_url, "rollwave_engine_waiting_requests") + \
                engine_metric(engine_url, "rollwave_engine_running_requests") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert code == 0 and took >= 1.0, (took, w.log())
    assert (f"group {gid}: cancelled before it finished (shutdown_grace_s ran out); its task is handed back"
            in w.log()), w.log()
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    [(_, back)] = r.xrange(KEYS.tasks("train"))  # handed back unacked, the attempt not counted
    assert back[b"gid"].decode() == gid and back[b"attempts"] == b"0"
    assert r.xlen(KEYS.groups) == 0 and r.xlen(KEYS.tasks_dead) == 0


def test_groups_go_round_robin_over_every_engine_url(
    redis_server: EmbeddedRedis, workers, engine_url: str, tiny_model_dir: Path
) -> None:
    """engine.urls with two engines: a server's groups are spread over both, two of four groups each (every group
    makes at least n_samples=2 requests); a server that used the first URL alone (or its own engine) would leave
    the second idle."""
    r = client(redis_server)
    with EngineProcess(tiny_model_dir, threads=1) as second:
        urls = [engine_url, second.url]
        before = [engine_metric(url, "rollwave_engine_requests_total") for url in urls]
        submit(redis_server, "job", 4)
        w = workers("srv-rr", engines=urls)
        wait_for(lambda: r.xlen(KEYS.groups) == 4, w)
        after = [engine_metric(url, "rollwave_engine_requests_total") for url in urls]
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0, w.log()
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert all(n >= 2 * 2 for n in served), served
    assert f"with {len(urls)} engine(s)" in w.log()


def test_failed_episodes_are_dead_letters_and_a_cancelled_job_is_not(redis_server: EmbeddedRedis, workers) -> None:
    """A reward function that raises: the group is not written with reward 0; the task is retried, then
    dead-lettered with the reason, and every failed episode is counted. A cancelled job's tasks are acked
    and counted ``cancelled``: dead letters mean failures only."""
    r = client(redis_server)
    q = TaskQueue(r, KEYS, BufferConfig())
    q.ensure_groups()
    submit(redis_server, "gone", 3)
    r.hset(KEYS.job("gone"), "state", "cancelled")
    spec = JobSpec(source=TaskSource(kind="arith", split="train", limit=1), reward="judge_down")
    tasks = [t.model_dump(mode="json") for t in spec.source.load()]
    for task in tasks:  # no task-level reward kind: the job's reward function scores them
        task["reward"].pop("kind", None)
    [gid] = q.submit("judged", tasks, "train", spec.model_dump_json())
    w = workers("srv-f", "buffer.max_attempts=2", "rollout.metrics_port=0",
                'rollout.reward_allowlist={"judge_down": "tests.reward_helpers:judge_down"}')
    wait_for(lambda: r.xlen(KEYS.tasks_dead) == 1, w)
    [(_, dead)] = r.xrange(KEYS.tasks_dead)
    assert dead[b"gid"].decode() == gid and dead[b"deliveries"] == b"2"
    assert b"2 of 2 episodes failed; first: RuntimeError: the judge is down" in dead[b"error"]
    assert r.xlen(KEYS.groups) == 0 and q.job("judged")["dead_lettered"] == "1"
    gone = q.job("gone")
    assert (gone["cancelled"], gone.get("dead_lettered"), gone["state"]) == ("3", None, "cancelled")
    assert r.xlen(KEYS.tasks("train")) == 0 and r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    [info] = [s for s in ServerRegistry(r, KEYS).live_servers() if s.server_id == "srv-f"]
    scraped = httpx.get(f"http://{info.metrics_address}/metrics", timeout=10).text
    assert 'rollwave_rollout_failed_total{reason="reward"} 4.0' in scraped  # 2 episodes × 2 attempts


def test_bound_ports_are_published_and_busy_configured_ports_waited_for(redis_server: EmbeddedRedis, workers) -> None:
    """Engine port 0: the registry holds the port it got. The gRPC, stage and metrics ports are configured and
    busy: the server waits for each (logging it), then serves on exactly that port."""
    grpc_busy, stage_busy, metrics_busy = bound_socket(), bound_socket(), bound_socket()
    for sock in (grpc_busy, stage_busy, metrics_busy):
        sock.listen()
    grpc_port, stage_port, metrics_port = (s.getsockname()[1] for s in (grpc_busy, stage_busy, metrics_busy))
    registry = ServerRegistry(client(redis_server), KEYS)
    try:
        w = workers("srv-p", f"rollout.grpc_port={grpc_port}", f"rollout.stage_port={stage_port}",
                    f"rollout.metrics_port={metrics_port}", own_engine=True)
        for sock, port in ((grpc_busy, grpc_port), (stage_busy, stage_port), (metrics_busy, metrics_port)):
            wait_for(lambda p=port: f"port {p} on 127.0.0.1 is in use; retrying" in w.log(), w)
            time.sleep(0.5)
            assert w.proc.poll() is None and registry.live_servers() == []  # still waiting, not dead
            sock.close()
        wait_for(lambda: bool(registry.live_servers()), w)
    finally:
        for sock in (grpc_busy, stage_busy, metrics_busy):
            sock.close()
    [info] = registry.live_servers()
    assert info.grpc_address == f"127.0.0.1:{grpc_port}" and info.metrics_address == f"127.0.0.1:{metrics_port}"
    assert "rollwave_rollout_" in httpx.get(f"http://{info.metrics_address}/metrics").text
    assert not info.engine_url.endswith(":0")
    assert httpx.get(info.engine_url + "/health").status_code == 401  # bound and serving, only for its key
    with grpc.insecure_channel(info.grpc_address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0, w.log()


def test_startup_refuses_an_unready_engine_or_a_non_integer_version(
    redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``engine.ready_timeout_s`` bounds the wait for the engine; an engine that reports a version rollwave
    cannot number (SGLang's default ``default``) is refused at startup, naming it."""
    base = [sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp_path}",
            f"redis.url={redis_server.url}", f"model.path={tiny_model_dir}"]
    env = {**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": CHECKPOINT_TOKEN}
    with refused_port() as port:
        dead = f"http://127.0.0.1:{port}"
        proc = subprocess.run([*base, f"engine.urls=[{dead}]", "engine.ready_timeout_s=1"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: engine.ready_timeout_s: {dead}/health: not healthy after 1s" in proc.stderr
    with EngineProcess(tiny_model_dir, weight_version="default", threads=1) as engine:
        proc = subprocess.run([*base, f"engine.urls=[{engine.url}]"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: engine.urls: {engine.url}: weight version 'default' is not an integer" in proc.stderr


def test_a_wrong_engine_key_is_named_where_the_engine_answers_health_without_one(
    redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SGLang's ``--api-key`` exempts ``/health``: a wrong ``engine.api_key`` passes the wait and is refused at the
    first call that needs it (``/model_info``), which named ``engine.urls`` and sent the operator to the URL."""
    sglang = FastAPI()  # SGLang's key check as it behaves: every route but /health needs the key

    @sglang.middleware("http")
    async def key_check(request: Request, call_next: Callable) -> Response:
        if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {'k' * 40}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @sglang.get("/health")
    async def health() -> Response:
        return Response()

    with serve_app(sglang) as url:
        proc = subprocess.run([sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp_path}",
                               f"redis.url={redis_server.url}", f"model.path={tiny_model_dir}", f"engine.urls=[{url}]",
                               "engine.backend=sglang"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": CHECKPOINT_TOKEN,
                                   "ROLLWAVE_ENGINE_API_KEY": "w" * 40})
    assert proc.returncode == 2, proc.stderr
    assert f"error: engine.api_key: {url}: /model_info: HTTP 401: Unauthorized" in proc.stderr, proc.stderr


def test_an_embedded_engine_refusing_its_model_stops_the_server_as_a_config_refused(
    redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A model whose weights file is cut short: the embedded engine refuses it (exit 2, naming the file's error), and
    so does the server (exit 2, which launchers do not restart), rather than exit 1 to be started again and again."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes()[:1000])
    proc = subprocess.run([sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp_path}",
                           f"redis.url={redis_server.url}", f"model.path={broken}"], cwd=ROOT,
                          env={**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": CHECKPOINT_TOKEN}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: --model {broken}: Error while deserializing header" in proc.stdout  # the engine's output
    assert "error: engine: the embedded engine refused to start (its error is above)" in proc.stderr


def test_busy_time_is_reported_while_groups_overlap_without_a_gap() -> None:
    """A server whose groups overlap never goes idle: its heartbeat must still report the time as busy."""
    metrics = RolloutMetrics()
    with metrics.generating():
        time.sleep(0.2)
        with metrics.generating():
            time.sleep(0.1)
            assert metrics.stats()["busy_s"] >= 0.3  # counted while still generating
    busy = metrics.stats()["busy_s"]
    assert busy >= 0.3
    time.sleep(0.2)  # idle time is not counted
    assert metrics.stats()["busy_s"] == busy


def test_a_slot_freed_by_a_group_is_not_held_empty_by_a_blocking_read(
    redis_server: EmbeddedRedis, engine_url: str, tiny_model_dir: Path
) -> None:
    """While groups are in flight the worker waits on them, not in a blocking read of the task streams: eval
    slots are always free, and a read that blocked on them kept a train slot freed meanwhile empty for up to
    READ_BLOCK_MS, once per group (the async pipeline idled a third of its time so). A read during which the
    last group ends leaves nothing to wait on, and the loop goes on."""
    submit(redis_server, "job", 3)
    rollout = RolloutConfig(n_samples=2, max_new_tokens=8, max_turns=2, max_concurrent_groups=1)
    engine = EngineClient(engine_url)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    worker = RolloutWorker(client(redis_server), "t", rollout, BufferConfig(), [engine], tokenizer,
                           ToolRegistry.from_file(None), RolloutMetrics())
    reads: list[tuple[int, int]] = []
    read = worker.tasks.read

    def spy(consumer: str, count: int, block_ms: int = 0, kinds: tuple[str, ...] = ("eval", "train")) -> list:
        reads.append((block_ms, len(worker._inflight)))
        if len(reads) == 3 and worker._inflight:  # the last group in flight ends during this read
            deadline = time.monotonic() + 60
            while worker._inflight and time.monotonic() < deadline:
                time.sleep(0.01)
        return read(consumer, count, block_ms, kinds)

    worker.tasks.read = spy

    asyncio.run(serve_until(worker, lambda: client(redis_server).xlen(KEYS.groups) >= 3, "3 groups were written"))
    assert any(inflight for _, inflight in reads)  # it did read while a group was in flight
    assert [block for block, inflight in reads if inflight and block] == []
    assert any(block for block, inflight in reads if not inflight)  # and blocked only with nothing in flight


@pytest.mark.parametrize(("override", "error"), [
    ("rollout.reward_allowlist={judge: nomod:fn}",
     "error: rollout.reward_allowlist.judge: reward 'judge' (nomod:fn): cannot import: No module named 'nomod'"),
    ("rollout.agent_allowlist=[nomod:run]",
     "error: rollout.agent_allowlist: nomod:run: no module 'nomod' on this server's path"),
    ("rollout.tools={tmp}/none.yaml", "error: rollout.tools: "),
], ids=["reward", "agent", "tools"])
def test_code_or_tools_the_config_names_that_do_not_load_stop_the_server_at_start(
    override: str, error: str, tmp_path: Path
) -> None:
    """A typo in an allowlist or the tools file is one line and exit 2 when the server starts, before it connects
    to anything, not a failure of every task that needs it later."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    argv = [sys.executable, "-m", "rollout_server", "redis.url=redis://127.0.0.1:1/0",
            override.replace("{tmp}", str(tmp_path))]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "ROLLWAVE_CHECKPOINT_TOKEN": CHECKPOINT_TOKEN})
    assert proc.returncode == 2 and proc.stderr.strip().startswith(error), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_engine_that_dies_stops_its_server_with_its_tasks_handed_back(redis_server: EmbeddedRedis,
                                                                         workers) -> None:
    """The engine a rollout server started dies (OOM, a crash). Every episode then failed on it, each failure
    spent an attempt of its task, and with ``buffer.max_attempts=1`` the queue was dead-lettered task by task while
    the server went on reading. Now the first failure finds the engine down: the server hands the task back
    unfailed (counted ``engine_down``), stops taking tasks and exits 1 naming the engine, for its supervisor to
    restart it; nothing is dead-lettered, and a new server rolls out every task."""
    r = client(redis_server)
    gids = submit(redis_server, "job", 12)
    w = workers("srv-e", "buffer.max_attempts=1", "rollout.max_concurrent_groups=2", "rollout.max_new_tokens=32",
                own_engine=True)
    wait_for(lambda: r.xlen(KEYS.groups) >= 1, w)
    children = Path(f"/proc/{w.proc.pid}/task/{w.proc.pid}/children").read_text().split()
    [engine] = [int(pid) for pid in children if "rollout_server.engine" in Path(f"/proc/{pid}/cmdline").read_text()]
    os.kill(engine, signal.SIGKILL)
    assert w.proc.wait(120) == 1, w.log()
    assert "does not answer /health: this server stopped, its tasks handed back" in w.log()
    assert r.xlen(KEYS.tasks_dead) == 0, r.xrange(KEYS.tasks_dead)
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0  # nothing left held by the dead server
    again = workers("srv-f", own_engine=True)
    wait_for(lambda: r.xlen(KEYS.groups) == len(gids), again)
    assert sorted(f[b"gid"].decode() for _, f in r.xrange(KEYS.groups)) == sorted(gids)
