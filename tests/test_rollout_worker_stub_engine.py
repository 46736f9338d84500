"""The rollout worker in-process against a real Redis and a stub engine (a plain HTTP server on 127.0.0.1 that
answers, hangs or fails as each test tells it): an engine that stops answering does not stop the heartbeat or the
lease renewals, and every task handed back unacked is logged and counted with its reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis
from buffer_helpers import client

from buffer import staleness as staleness_module
from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, RolloutConfig
from core.tasks import load_tasks
from rollout_server.engine_client import EngineClient
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker

KEYS = Keys("t")
SERVER = "srv-stub"
HANDED_BACK = "rollwave_rollout_tasks_handed_back_total"


class StubEngine:
    """``/health`` answers 200; ``/model_info`` answers version 3 while ``info_open`` is set and waits while it is
    clear; ``/generate`` waits until ``generate_open`` is set, then fails with HTTP 500. ``close`` opens both and
    stops the server, joining its request threads."""

    def __init__(self) -> None:
        self.info_open = threading.Event()
        self.info_open.set()
        self.generate_open = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/health":  # up, whatever its /generate does: the worker asks after a failure
                    self._reply(200, {})
                    return
                if self.path != "/model_info":
                    self._reply(404, {"error": "not found"})
                    return
                stub.info_open.wait()
                self._reply(200, {"weight_version": "3"})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/generate":
                    self._reply(404, {"error": "not found"})
                    return
                stub.generate_open.wait()
                self._reply(500, {"error": "the stub engine fails"})

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False  # so server_close joins the request threads
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.info_open.set()
        self.generate_open.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(30)


@pytest.fixture
def stub() -> Iterator[StubEngine]:
    engine = StubEngine()
    yield engine
    engine.close()


def make_worker(server: EmbeddedRedis, stub: StubEngine, tokenizer: Any, grace_s: float,
                buffer: BufferConfig | None = None) -> RolloutWorker:
    """Heartbeat and lease renewal every 0.5 s (a task idle 5 s is reclaimed), one sample per group."""
    rollout = RolloutConfig(server_id=SERVER, heartbeat_s=0.5, n_samples=1, max_new_tokens=8, max_turns=1,
                            shutdown_grace_s=grace_s)
    buffer = buffer or BufferConfig(claim_idle_ms=5000)
    return RolloutWorker(client(server), "t", rollout, buffer, [EngineClient(stub.url, retries=0)], tokenizer,
                         ToolRegistry.from_file(None))


def submit(server: EmbeddedRedis, kind: str) -> str:
    q = TaskQueue(client(server), KEYS, BufferConfig())
    q.ensure_groups()
    split = "train" if kind == "train" else "test"
    [gid] = q.submit("job", [t.model_dump(mode="json") for t in load_tasks("arith", split=split, limit=1)], kind)
    return gid


def held(r: redis.Redis, kind: str) -> list[dict[str, Any]]:
    """The worker's pending entries of a task stream (``time_since_delivered``: ms since read or renewed)."""
    return r.xpending_range(KEYS.tasks(kind), ROLLOUT_GROUP, "-", "+", 10, consumername=SERVER)


async def until(predicate: Callable[[], bool], serving: asyncio.Task, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` (generous deadline: a loaded machine), failing at once if the worker stopped."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if serving.done():
            serving.result()
            raise AssertionError(f"the worker stopped before: {what}")
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(worker: RolloutWorker) -> AsyncIterator[asyncio.Task]:
    """``worker.run()`` as a task; on exit the worker is stopped (it must end within 60 s) and its engine closed."""
    serving = asyncio.create_task(worker.run())
    try:
        yield serving
    finally:
        worker.stop()
        done, _ = await asyncio.wait({serving}, timeout=60)
        serving.cancel()
        await worker.engines[0].aclose()
        assert done, "the worker did not stop within 60 s"
        serving.result()


def test_heartbeat_and_lease_renewal_go_on_while_the_engine_hangs(
    redis_server: EmbeddedRedis, stub: StubEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine stops answering (its version read would wait ``engine.request_timeout_s``, 600 s) while a group
    is in flight: the registry heartbeat, with the last version known, and the renewal of the group's task lease
    still come every period; the hung read is logged naming the engine. A group cancelled at the end of the
    shutdown grace is handed back, logged and counted."""
    r = client(redis_server)
    registry = ServerRegistry(r, KEYS)
    worker = make_worker(redis_server, stub, tokenizer, grace_s=0.5)

    async def scenario() -> tuple[list[float], int]:
        async with running(worker) as serving:
            await until(lambda: bool(registry.all_servers()), serving, "the worker registered")
            stub.info_open.clear()  # from now on the engine answers nothing (its /generate waits too)
            submit(redis_server, "eval")
            await until(lambda: len(held(r, "eval")) == 1, serving, "the worker took the task")
            beats: list[float] = []
            renewals, idle = 0, held(r, "eval")[0]["time_since_delivered"]
            deadline = time.monotonic() + 30
            while len(beats) < 4 or renewals < 3:
                assert time.monotonic() < deadline, f"beats {beats}, renewals {renewals} in 30 s, the engine hung"
                [(info, _live)] = registry.all_servers()
                if info.heartbeat not in beats:
                    beats.append(info.heartbeat)
                    assert info.version == 3  # the version last read, kept
                entries = held(r, "eval")  # a reclaim would count a delivery (and dead-letter the task at last)
                assert [e["times_delivered"] for e in entries] == [1], "the lease lapsed: the task was reclaimed"
                renewals += entries[0]["time_since_delivered"] < idle  # the idle time went back: renewed
                idle = entries[0]["time_since_delivered"]
                await asyncio.sleep(0.05)
        return beats, renewals

    beats, renewals = asyncio.run(scenario())
    assert len(beats) >= 4 and renewals >= 3
    assert f"heartbeat: the engine {stub.url} did not report its weight version within 0.25 s" in caplog.text
    assert held(r, "eval") == [] and r.xlen(KEYS.tasks("eval")) == 1  # handed back at the end of the grace
    assert r.xlen(KEYS.tasks_dead) == 0
    assert worker.metrics.total(HANDED_BACK, reason="cancelled") == 1
    assert "its task is handed back" in caplog.text


def test_a_group_that_failed_while_the_server_stopped_is_handed_back_logged_and_counted(
    redis_server: EmbeddedRedis, stub: StubEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine fails its requests during a shutdown: the group is dropped and its task handed back unacked (not
    failed: the engine went away, the task did not), with the reason logged and counted."""
    r = client(redis_server)
    worker = make_worker(redis_server, stub, tokenizer, grace_s=60)
    gid = submit(redis_server, "eval")

    async def scenario() -> None:
        async with running(worker) as serving:
            await until(lambda: len(held(r, "eval")) == 1, serving, "the worker took the task")
            worker.stop()
            stub.generate_open.set()  # only now does /generate answer, with HTTP 500

    with caplog.at_level(logging.WARNING, logger="rollout_server.worker"):
        asyncio.run(scenario())
    assert worker.metrics.total(HANDED_BACK, reason="failed_while_stopping") == 1
    assert f"group {gid}: 1 of 1 episodes failed while the server was stopping" in caplog.text
    [(_, back)] = r.xrange(KEYS.tasks("eval"))
    assert back[b"gid"].decode() == gid and back[b"attempts"] == b"0" and held(r, "eval") == []
    assert r.xlen(KEYS.tasks_dead) == 0


def admission_shut(redis_server: EmbeddedRedis, stub: StubEngine, tokenizer: Any
                   ) -> tuple[redis.Redis, StalenessControl, str, RolloutWorker]:
    """A train task submitted, and a worker that reads it on a hint of room (``capacity``) whose atomic admission then
    finds none (another group took the last slot of a window of one): the task waits for admission."""
    r = client(redis_server)
    cfg = BufferConfig(claim_idle_ms=5000, max_staleness=0, groups_per_step=1)
    staleness = StalenessControl(r, KEYS, cfg)
    assert staleness.try_admit("other:0:taken") and staleness.capacity() == 0
    gid = submit(redis_server, "train")
    worker = make_worker(redis_server, stub, tokenizer, grace_s=60, buffer=cfg)
    worker.staleness.capacity = lambda served=None: 1  # the hint that was true a moment before
    return r, staleness, gid, worker


def test_a_task_stopped_while_waiting_for_admission_is_handed_back_logged_and_counted(
    redis_server: EmbeddedRedis, stub: StubEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A train task read on a hint of room (``capacity``) whose atomic admission then finds none (another group
    took the last slot) waits for admission; the server stops meanwhile: the task is handed back, logged and
    counted."""
    r, staleness, gid, worker = admission_shut(redis_server, stub, tokenizer)

    async def scenario() -> None:
        async with running(worker) as serving:
            await until(lambda: len(held(r, "train")) == 1, serving, "the worker took the task")

    with caplog.at_level(logging.WARNING, logger="rollout_server.worker"):
        asyncio.run(scenario())
    assert worker.metrics.total(HANDED_BACK, reason="stopped_awaiting_admission") == 1
    assert f"group {gid}: the server stopped while it waited for staleness admission" in caplog.text
    assert held(r, "train") == [] and r.xlen(KEYS.tasks("train")) == 1 and not r.hexists(KEYS.admitted_ids, gid)


def test_a_task_waiting_for_admission_whose_job_is_cancelled_is_acked_away(
    redis_server: EmbeddedRedis, stub: StubEngine, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A train task waiting for admission checked its job only before the wait: cancelled meanwhile, it stayed held
    (its lease renewed) for as long as admission stayed shut, for good once the run's trainer finished, and the
    job could never be deleted. The wait now asks after the job (every ``GIVE_UP_CHECK_S``): the task is acked away
    as cancelled, and the job deleted."""
    monkeypatch.setattr(staleness_module, "GIVE_UP_CHECK_S", 0.2)
    r, staleness, gid, worker = admission_shut(redis_server, stub, tokenizer)
    queue = worker.tasks

    async def scenario() -> None:
        async with running(worker) as serving:
            await until(lambda: len(held(r, "train")) == 1, serving, "the worker took the task")
            assert queue.cancel_job("job") == "cancelled"
            await until(lambda: held(r, "train") == [], serving, "the task acked away")

    asyncio.run(scenario())
    assert queue.job("job")["cancelled"] == "1" and r.xlen(KEYS.tasks("train")) == 0
    assert not r.hexists(KEYS.admitted_ids, gid) and staleness.admitted() == 1  # the other group's slot alone
    deleted = queue.delete_job("job")
    assert deleted is not None and deleted.left == 0 and not r.exists(KEYS.job("job"))
