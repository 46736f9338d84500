"""A pending group or task deleted from its stream (an operator's XDEL, a trim by hand) is acked away by the next
reclaim, logged and counted, against a real Redis."""

from __future__ import annotations

import logging
import time

import pytest
from buffer_helpers import client, make_group

from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.task_queue import TaskQueue
from core.config import BufferConfig

KEYS = Keys("t")
IDLE_MS = 100


def buffer(server: EmbeddedRedis, consumer: str) -> ReplayBuffer:
    buf = ReplayBuffer(client(server), KEYS, BufferConfig(claim_idle_ms=IDLE_MS), consumer)
    buf.ensure_group()
    return buf


def test_pending_groups_deleted_from_the_stream_are_acked_logged_and_counted(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A dead trainer held two groups; one was deleted from the stream meanwhile. The live trainer reclaims the
    other and acks the deleted one away: the warning names the stream, and the counter says how many."""
    dead, live = buffer(redis_server, "dead"), buffer(redis_server, "live")
    assert dead.put_many([make_group("job", f"job:{i}:x") for i in range(2)]) == [1, 1]
    held = dead.take(2, 5.0)
    assert len(held) == 2
    r = client(redis_server)
    r.xdel(KEYS.groups, held[0][0])
    time.sleep(3 * IDLE_MS / 1000)  # both idle past claim_idle_ms
    with caplog.at_level(logging.WARNING, logger="buffer.replay"):
        taken = live.take(2, 0.0)
    assert [gid for gid, _ in taken] == [held[1][0]]
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 1  # the reclaimed one, now the live trainer's
    assert f"{KEYS.groups}: 1 pending group(s) had been deleted from the stream" in caplog.text
    assert live.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total", {"stream": "groups"}) == 1


def test_pending_tasks_deleted_from_the_stream_are_acked_logged_and_counted(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The same for the rollout servers' tasks: a dead server held two eval tasks, one was deleted; the live
    server's reclaim takes the other, and the counter names the eval task stream."""
    r = client(redis_server)
    queue = TaskQueue(r, KEYS, BufferConfig(claim_idle_ms=IDLE_MS))
    queue.ensure_groups()
    queue.submit("job", [{"task_id": f"t{i}", "prompt": "1+1"} for i in range(2)], "eval")
    held = queue.read("dead", 2, kinds=("eval",))
    assert len(held) == 2
    r.xdel(KEYS.tasks("eval"), held[0].entry_id)
    time.sleep(3 * IDLE_MS / 1000)
    with caplog.at_level(logging.WARNING, logger="buffer.task_queue"):
        taken = queue.reclaim("live", 2, "eval")
    assert [e.entry_id for e in taken] == [held[1].entry_id]
    assert r.xpending(KEYS.tasks("eval"), ROLLOUT_GROUP)["pending"] == 1
    assert f"{KEYS.tasks('eval')}: 1 pending task(s) had been deleted from the stream" in caplog.text
    assert queue.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total",
                                                   {"stream": "tasks_eval"}) == 1
