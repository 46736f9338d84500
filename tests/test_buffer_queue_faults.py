"""The task side of the buffer under faults, against a real Redis: a reply lost on the network, a lease lost to
another worker, a registry record that does not parse."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import pytest
from buffer_helpers import client
from net_helpers import LoopbackProxy

from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.redis_server import EmbeddedRedis, client_for
from buffer.registry import ServerInfo, ServerRegistry
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, RedisConfig

KEYS = Keys("t")


class LoseExecReply(LoopbackProxy):
    """A TCP proxy on 127.0.0.1 in front of Redis that, once, closes the connection instead of passing on the
    reply to a MULTI/EXEC, after Redis has run it (``ran()``): the reply lost as when Redis restarts or the
    network resets at that moment."""

    def __init__(self, upstream_port: int, ran: Callable[[], bool]) -> None:
        self.ran = ran
        self.armed = threading.Event()
        self.lost = False
        super().__init__(("127.0.0.1", upstream_port), wait_s=10)
        self.url = f"redis://{self.address}/0"

    def passes(self, pair: tuple[socket.socket, socket.socket], to_upstream: bool, data: bytes) -> bool:
        if to_upstream:
            if b"EXEC" in data and not self.lost:
                self.armed.set()
            return True
        if not self.armed.is_set() or self.lost:
            return True
        deadline = time.monotonic() + 10
        while not self.ran() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.lost = True
        return False


@pytest.mark.parametrize("chunk", [1000, 2])
def test_a_submit_whose_reply_was_lost_adds_its_tasks_once(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The client retries a MULTI whose reply it lost; Redis had run it, so without a submit id the job's tasks
    were queued twice (two groups each, ``submitted`` doubled). Also in several chunks."""
    monkeypatch.setattr("buffer.task_queue.SUBMIT_CHUNK", chunk)
    r = client(redis_server)
    q = TaskQueue(r, KEYS, BufferConfig())
    q.ensure_groups()
    assert q.submit("job", [{"task_id": "before", "messages": []}]) == ["job:0:before"]
    proxy = LoseExecReply(redis_server.port, ran=lambda: r.xlen(KEYS.tasks("train")) > 1)
    lossy = TaskQueue(client_for(proxy.url, RedisConfig(), outage_s=10), KEYS, BufferConfig())
    try:
        gids = lossy.submit("job", [{"task_id": f"q{i}", "messages": []} for i in range(5)])
    finally:
        lossy.redis.close()
        proxy.close()
    assert proxy.lost  # the reply was lost and the client ran the MULTI again
    assert gids == [f"job:{i + 1}:q{i}" for i in range(5)]
    assert [f[b"gid"].decode() for _, f in r.xrange(KEYS.tasks("train"))] == ["job:0:before", *gids]
    assert q.job("job")["submitted"] == "6"
    assert q.submit("job", [{"task_id": "after", "messages": []}]) == ["job:6:after"]  # a new submit adds


@pytest.mark.parametrize("ending", ["fail", "dead_letter", "cancel", "hand_back"])
def test_a_worker_that_lost_its_lease_does_not_end_the_task(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, ending: str
) -> None:
    """A worker frozen past its lease resumes and ends a task another worker has taken over: nothing changes,
    and it says so, naming the task, the entry and itself. XACK acks whoever holds an entry, so it used to
    requeue, dead-letter or cancel the task under the live worker, whose group was then dropped (task gone)
    and the task rolled out again."""
    r = client(redis_server)
    q = TaskQueue(r, KEYS, BufferConfig(claim_idle_ms=100))
    q.ensure_groups()
    [gid] = q.submit("job", [{"task_id": "a", "messages": []}])
    [frozen] = q.read("frozen", 1)
    time.sleep(0.15)
    [live] = q.read("live", 1)
    assert (live.entry_id, live.consumer) == (frozen.entry_id, "live")
    caplog.set_level(logging.INFO, logger="buffer.task_queue")
    end = {"fail": q.fail, "dead_letter": q.dead_letter, "cancel": lambda e, _: q.cancel(e),
           "hand_back": lambda e, _: q.hand_back(e)}[ending]
    assert end(frozen, "engine error") is False
    [record] = caplog.records
    assert record.levelname == "WARNING" and "no longer pending for frozen" in record.message
    assert gid in record.message and frozen.entry_id in record.message
    [(_, owner, _, _)] = [tuple(p.values()) for p in r.xpending_range(KEYS.tasks("train"), ROLLOUT_GROUP, "-", "+", 5)]
    assert owner == b"live" and r.xlen(KEYS.tasks("train")) == 1 and r.xlen(KEYS.tasks_dead) == 0
    job = q.job("job")
    assert (job["state"], "cancelled" in job, "dead_lettered" in job) == ("running", False, False)
    caplog.clear()
    assert end(live, "engine error") is (ending != "fail")  # its holder can (fail: requeued, not dead-lettered)
    assert not any("no longer pending" in rec.message for rec in caplog.records)
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0


def test_a_registry_record_that_does_not_parse_is_skipped_and_named(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """One server's record that this version cannot read (a field added by a newer server, a corrupt value)
    used to fail every listing with a bare TypeError or JSONDecodeError, and with it the trainer's pushes to
    every server. A newer record's extra fields are ignored; one that still does not parse is skipped, logged
    with the key and the field."""
    r = client(redis_server)
    reg = ServerRegistry(r, KEYS)
    reg.register(ServerInfo("s1", "http://a"))
    newer = '{"server_id": "s2", "engine_url": "http://b", "version": 3, "added_later": 1}'
    reg.heartbeat(ServerInfo("s3", "http://c"))
    pipe = r.pipeline()
    pipe.hset(KEYS.servers, "s2", newer).set(KEYS.server_alive("s2"), "1")
    pipe.hset(KEYS.servers, "s4", "{not json").hset(KEYS.servers, "s5", '{"engine_url": "http://e"}')
    pipe.execute()
    caplog.set_level(logging.WARNING, logger="buffer.registry")
    assert [(s.server_id, s.engine_url, s.version) for s in reg.live_servers()] == [
        ("s1", "http://a", 0), ("s2", "http://b", 3), ("s3", "http://c", 0)]
    assert [s.server_id for s, _ in reg.all_servers()] == ["s1", "s2", "s3"]
    r.hset(KEYS.pushes, mapping={"s2": '{"version": 2, "ok": true, "added_later": 1}', "s4": "[1]"})
    assert {k: (p.version, p.ok) for k, p in reg.pushes().items()} == {"s2": (2, True)}
    messages = [rec.message for rec in caplog.records]
    assert len(messages) == 5  # two listings with two bad records each, one bad push
    assert all(KEYS.servers in m for m in messages[:4]) and f"{KEYS.pushes}[s4]" in messages[4]
    assert "[s4]" in messages[0] and "[s5]" in messages[1] and "server_id" in messages[1]
