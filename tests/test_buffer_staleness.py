"""Staleness control against a real Redis: the admission bound under concurrency, the version, the filter;
plus the server registry and the buffer gauges."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from buffer_helpers import client, make_group

from buffer.keys import Keys
from buffer.metrics import BufferMetrics
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerInfo, ServerRegistry
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl, is_stale, split_stale
from buffer.task_queue import TaskQueue
from core.config import BufferConfig

ROOT = Path(__file__).resolve().parents[1]
KEYS = Keys("t")

# One producer process: tries to admit new groups as fast as it can until ``stop`` appears; prints its count.
PRODUCER = """
import sys, redis
from buffer.keys import Keys
from buffer.staleness import StalenessControl
from core.config import BufferConfig
r = redis.Redis.from_url(sys.argv[1])
st = StalenessControl(r, Keys("t"), BufferConfig(max_staleness=2, groups_per_step=8))
admitted, i = 0, 0
while not r.exists("stop"):
    i += 1
    admitted += st.try_admit(f"p{sys.argv[2]}-{i}")
print(admitted, flush=True)
"""


def control(server: EmbeddedRedis, max_staleness: int = 1, gps: int = 4) -> StalenessControl:
    return StalenessControl(client(server), KEYS, BufferConfig(max_staleness=max_staleness, groups_per_step=gps))


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_admission_bound_follows_the_version(redis_server: EmbeddedRedis) -> None:
    st = control(redis_server, max_staleness=1, gps=4)
    assert st.bound(0, 0) == 8 and st.capacity() == 8
    assert [st.try_admit(f"g{i}") for i in range(9)] == [True] * 8 + [False]
    assert st.try_admit("g3")  # already admitted: free
    assert st.capacity() == 0 and st.admitted() == 8
    assert st.set_version(1, trained=4) == 1
    assert st.capacity() == 4 and st.try_admit("g8")
    assert st.set_version(0, trained=0) == 1 and st.version() == 1  # the version never goes back
    assert st.capacity() == 3
    assert st.release("g8") and not st.release("g8") and st.admitted() == 8
    assert all(st.try_admit(f"h{i}") for i in range(4)) and st.capacity() == 0
    assert not st.admit("late", timeout_s=0.05)
    assert st.metrics.admission_waits._value.get() == 1
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessControl(client(redis_server), KEYS, BufferConfig(max_staleness=1, groups_per_step=0))


def test_a_version_spans_push_every_steps_of_groups(redis_server: EmbeddedRedis) -> None:
    cfg = BufferConfig(max_staleness=1, groups_per_step=4, push_every=3)
    st = StalenessControl(client(redis_server), KEYS, cfg)
    assert st.bound(0, 0) == 24 and st.bound(1, 12) == 36  # trained + (η + 1) × 4 groups × 3 steps
    assert sum(st.try_admit(f"g{i}") for i in range(30)) == 24


def test_the_bound_counts_trained_groups_not_versions(redis_server: EmbeddedRedis) -> None:
    """A resumed trainer publishes the weights it resumed from as a new version, trained on no more groups than
    the last one: admission opens nothing for it. The trained count comes from the buffer's acks."""
    st = control(redis_server, max_staleness=0, gps=2)
    buf = ReplayBuffer(client(redis_server), KEYS, BufferConfig(max_staleness=0, groups_per_step=2))
    buf.ensure_group()
    assert [st.try_admit(f"g{i}") for i in range(3)] == [True, True, False]
    buf.put_many([make_group("j", f"g{i}") for i in range(2)])
    items = buf.take(2, timeout_s=5)
    buf.ack([e for e, _ in items], [g.group_id for _, g in items])
    assert st.trained() == 2 and st.admitted() == 2
    st.set_version(1, trained=st.trained())
    assert [st.try_admit(f"g{i}") for i in range(2, 5)] == [True, True, False]
    st.set_version(2, trained=st.trained())  # the restart's push: same weights, a new number
    assert st.capacity() == 0 and not st.try_admit("g4")
    assert st.bound(2, 2) == 4 == st.bound(1, 2)

def test_the_runs_budget_caps_admission_and_a_slot_given_back_reopens_it(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer publishes how many groups it trains in all; admission never passes it, whatever room the
    staleness bound has, so nothing is generated for steps that never come. A group that will not be trained
    gives its slot back; a trainer resumed with more steps raises the budget."""
    st = control(redis_server, max_staleness=2, gps=4)
    assert st.budget() is None and st.capacity() == 12  # no budget published: the bound alone
    st.set_budget(5)
    assert st.budget() == 5 and st.bound(0, 0, budget=5) == 5 and st.bound(0, 0, budget=50) == 12
    with caplog.at_level(logging.INFO, logger="buffer.staleness"):
        assert st.capacity() == 5
        assert [st.try_admit(f"g{i}") for i in range(7)] == [True] * 5 + [False] * 2
        assert st.capacity() == 0 and st.capacity() == 0 and st.admitted() == 5
    assert [r.getMessage() for r in caplog.records].count(
        "admission reached the run's budget: its trainer trains 5 groups in all and as many are admitted (trained or "
        "in flight); another is admitted only for one given back") == 1
    assert st.try_admit("g2")  # already admitted: free, even at the budget
    st.set_version(1, trained=4)  # the bound moves on; the budget does not
    assert st.capacity() == 0 and not st.try_admit("g5")
    assert st.release("g1") and st.capacity() == 1 and st.try_admit("g5") and not st.try_admit("g6")
    st.set_budget(8)
    assert st.capacity() == 3 and sum(st.try_admit(f"h{i}") for i in range(5)) == 3 and st.admitted() == 8


def test_a_lagging_server_is_held_to_the_version_it_serves(redis_server: EmbeddedRedis) -> None:
    """Admission uses ``min(published, served)``: a server that missed pushes stops taking work that could only
    reach the trainer stale, and takes it again once a push catches it up."""
    st = control(redis_server, max_staleness=1, gps=4)
    assert st.set_version(3, trained=12) == 3
    assert [st.try_admit(f"g{i}", served=3) for i in range(12)] == [True] * 12  # 12 + (1 + 1) * 4 = 20 allowed
    # a server two versions behind counts two versions' groups fewer: 12 - 2 * 4 + (1 + 1) * 4
    assert st.bound(3, 12, served=1) == 12 and st.capacity(served=1) == 0 and st.capacity(served=3) == 8
    assert not st.try_admit("lag", served=1)
    assert st.try_admit("ahead", served=9)  # a server ahead of the quorum is held to the published version
    served = [1]
    threading.Timer(0.3, lambda: served.__setitem__(0, 3)).start()  # a push lands while it waits
    assert st.admit("lag", timeout_s=30, served=lambda: served[0])
    assert st.admitted() == 14


def test_eight_concurrent_producers_never_exceed_the_bound(redis_server: EmbeddedRedis) -> None:
    st = StalenessControl(client(redis_server), KEYS, BufferConfig(max_staleness=2, groups_per_step=8))
    r = client(redis_server)
    procs = [
        subprocess.Popen([sys.executable, "-c", PRODUCER, redis_server.url, str(i)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
        for i in range(8)
    ]
    try:
        wait_for(lambda: st.admitted() >= st.bound(0, 0))
        time.sleep(0.3)  # all eight keep hammering at the bound
        assert st.admitted() == st.bound(0, 0) == 24
        st.set_version(2, trained=16)
        wait_for(lambda: st.admitted() >= st.bound(2, 16))
        time.sleep(0.3)
        assert st.admitted() == st.bound(2, 16) == 40
        r.set("stop", 1)
        counts = [int(p.communicate(timeout=30)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert sum(counts) == 40  # every admission the producers saw is one the bound allowed
    assert r.hlen(KEYS.admitted_ids) == 40


def test_is_stale_and_split(redis_server: EmbeddedRedis) -> None:
    st = control(redis_server, max_staleness=1)
    old, edge, new = (make_group("j", f"j:{v}:x", version=v) for v in (3, 4, 5))
    assert is_stale(old, version=5, max_staleness=1) and not is_stale(edge, 5, 1) and not is_stale(new, 5, 1)
    empty = make_group("j", "j:9:x")
    for s in empty.samples:
        s.loss_mask[:] = 0
    assert not is_stale(empty, version=100, max_staleness=0)
    fresh, stale = split_stale([("1-0", old), ("2-0", edge), ("3-0", new)], 5, st.max_staleness, st.metrics)
    assert [g for _, g in stale] == [old] and [g for _, g in fresh] == [edge, new]
    assert st.metrics.stale_dropped._value.get() == 1


def test_registry_heartbeats_and_expiry(redis_server: EmbeddedRedis) -> None:
    reg = ServerRegistry(client(redis_server), KEYS, ttl_s=0.3)
    a = ServerInfo("a", "http://127.0.0.1:1", grpc_address="127.0.0.1:2")
    b = ServerInfo("b", "http://127.0.0.1:3")
    reg.register(a)
    reg.register(b)
    assert [s.server_id for s in reg.live_servers()] == ["a", "b"]
    for _ in range(3):
        time.sleep(0.15)
        a.version = 7
        reg.heartbeat(a)
    [live] = reg.live_servers()  # b stopped beating: its record stays, but it is not live
    assert (live.server_id, live.version, live.grpc_address) == ("a", 7, "127.0.0.1:2")
    assert [(s.server_id, alive) for s, alive in reg.all_servers()] == [("a", True), ("b", False)]
    reg.deregister("a")
    assert reg.live_servers() == []


def test_metrics_report_depth_and_pending(redis_server: EmbeddedRedis) -> None:
    r = client(redis_server)
    metrics = BufferMetrics()
    metrics.observe(r, KEYS)  # nothing exists yet: zeros, no error
    q = TaskQueue(r, KEYS, BufferConfig(), metrics)
    q.ensure_groups()
    buf = ReplayBuffer(r, KEYS, BufferConfig(), metrics=metrics)
    buf.ensure_group()
    q.submit("j", [{"task_id": f"t{i}", "messages": []} for i in range(3)], "train")
    q.read("c", 1)
    buf.put_many([make_group("j", f"j:{i}:x") for i in range(2)])
    buf.take(1, 0.1)
    metrics.observe(r, KEYS)
    sample = metrics.registry.get_sample_value
    assert sample("rollwave_buffer_depth", {"stream": "tasks"}) == 3
    assert sample("rollwave_buffer_pending", {"stream": "tasks"}) == 1
    assert sample("rollwave_buffer_depth", {"stream": "groups"}) == 2
    assert sample("rollwave_buffer_pending", {"stream": "groups"}) == 1
    assert sample("rollwave_buffer_depth", {"stream": "tasks_dead"}) == 0
