"""A task deleted by hand (an XDEL) while a live rollout server holds it under its lease key (``Keys.task_leases``),
against a real redis-server (both binaries, as ``test_buffer_deleted_entries``): a delete of its cancelled job finds it
held, as it finds a task a live server renews; and a put that finds its task gone says what ended it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import redis
from buffer_helpers import age, make_group
from test_buffer_deleted_entries import CONFIG, r
from test_buffer_undelivered_deleted import lose_writes

from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.replay import TASK_GONE, ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskEntry, TaskQueue

__all__ = ["r"]  # the fixture, on both binaries


def job_of(r: redis.Redis, keys: Keys, kind: str, n: int) -> tuple[TaskQueue, ReplayBuffer]:
    """A job ``job`` of ``n`` tasks of ``kind``, its queue and a rollout server's buffer."""
    queue = TaskQueue(r, keys, CONFIG)
    queue.ensure_groups()
    queue.submit("job", [{"task_id": f"t{i}", "messages": []} for i in range(n)], kind=kind)
    producer = ReplayBuffer(r, keys, CONFIG, "producer")
    producer.ensure_group()
    return queue, producer


def held_deleted(r: redis.Redis, queue: TaskQueue, kind: str) -> TaskEntry:
    """A task that live server ``srv`` has worked on past claim_idle_ms, deleted by hand meanwhile: its renewal holds it
    under its lease key."""
    [task] = queue.read("srv", 1, kinds=(kind,))
    if kind == "train":
        assert StalenessControl(r, queue.keys, CONFIG).try_admit(task.group_id, task=task)
    age(r, task.stream, ROLLOUT_GROUP, "srv", [task.entry_id])
    r.xdel(task.stream, task.entry_id)
    assert queue.renew("srv", [task]) == []
    assert r.exists(queue.keys.task_leases(kind) + task.entry_id)
    return task


@pytest.mark.parametrize("kind", ["train", "eval"])
@pytest.mark.parametrize("ending", ["put", "cancel"])
def test_a_delete_refuses_a_cancelled_job_whose_deleted_task_a_live_server_holds_under_its_lease(
    r: redis.Redis, kind: str, ending: str
) -> None:
    """The job is cancelled while srv holds a task of it deleted by hand. Its delete removes the task no one holds and
    is refused, naming srv, as for a task a live server renews (before, the lease was not read: the delete removed the
    task and ended the job, and srv's put was refused as task-gone); the task ends as srv's put or cancel ends it, and
    the delete then goes."""
    keys = Keys(f"held-delete-{kind}-{ending}")
    queue, producer = job_of(r, keys, kind, 2)
    task = held_deleted(r, queue, kind)
    assert queue.cancel_job("job") == "cancelled"

    refused = queue.delete_job("job")
    assert refused is not None
    assert (refused.left, refused.removed_tasks, refused.rolling_out, refused.servers) == (1, 1, 1, ("srv",))
    assert queue.job("job")["cancelled"] == "1" and "dead_lettered" not in queue.job("job")

    if ending == "put":
        assert producer.put(make_group("job", task.group_id, run=keys.run, kind=kind), task)
        assert queue.job("job")["completed"] == "1"
    else:
        assert queue.cancel(task)
        assert queue.job("job")["cancelled"] == "2"
    assert r.xpending(task.stream, ROLLOUT_GROUP)["pending"] == 0
    deleted = queue.delete_job("job")
    assert deleted is not None and deleted.left == 0
    assert r.exists(keys.job("job")) == 0 and r.hlen(keys.task_gids(kind)) == 0 and r.hlen(keys.admitted_ids) == 0


def ended_by_the_reclaim(r: redis.Redis, queue: TaskQueue, kind: str) -> TaskEntry:
    """srv died holding a task, deleted by hand meanwhile (no renewal, no lease): another server's reclaim ends it."""
    [task] = queue.read("srv", 1, kinds=(kind,))
    age(r, task.stream, ROLLOUT_GROUP, "srv", [task.entry_id])
    r.xdel(task.stream, task.entry_id)
    assert TaskQueue(r, queue.keys, CONFIG).read("other", 1, kinds=(kind,)) == []
    assert queue.job("job")["dead_lettered"] == "1"
    return task


def job_deleted(r: redis.Redis, queue: TaskQueue, kind: str) -> TaskEntry:
    """srv, frozen past claim_idle_ms, held a task of a job cancelled and deleted meanwhile."""
    [task] = queue.read("srv", 1, kinds=(kind,))
    age(r, task.stream, ROLLOUT_GROUP, "srv", [task.entry_id])
    assert queue.cancel_job("job") == "cancelled"
    deleted = queue.delete_job("job")
    assert deleted is not None and deleted.left == 0
    return task


def delivery_lost(r: redis.Redis, queue: TaskQueue, kind: str) -> TaskEntry:
    """Redis lost the read that delivered srv its task (``appendfsync everysec`` and a restart)."""
    taken: list[TaskEntry] = []
    lose_writes(r, queue.keys, lambda: taken.extend(queue.read("srv", 1, kinds=(kind,))))
    return taken[0]


def delivery_lost_then_deleted(r: redis.Redis, queue: TaskQueue, kind: str) -> TaskEntry:
    """Redis lost the read that delivered srv its task, and the entry was then deleted by hand (no sweep ran yet)."""
    task = delivery_lost(r, queue, kind)
    r.xdel(task.stream, task.entry_id)
    return task


@pytest.mark.parametrize(("lose", "why"), [
    (ended_by_the_reclaim, "its entry and its record are gone: it was ended after this server lost its lease (frozen "
     "past buffer.claim_idle_ms): another server failed, dead-lettered, cancelled or handed it back; or it was deleted "
     "by hand (an XDEL or trim) and the reclaim or the records' sweep ended it (dead_lettered for its job); or a "
     "delete of its cancelled job removed it"),
    (job_deleted, "its job was deleted (cancelled, then deleted: the delete removed the task, which this server no "
     "longer held, frozen past buffer.claim_idle_ms)"),
    (delivery_lost, "its entry is in the stream, delivered to no one (Redis lost the delivery: a restart); a server "
     "reads it again"),
    (delivery_lost_then_deleted, "its entry was deleted by hand (an XDEL or trim), delivered to no one (Redis lost the "
     "delivery: a restart); its record is left, which the records' sweep ends (dead_lettered for its job)"),
], ids=lambda x: getattr(x, "__name__", ""))
def test_a_put_whose_task_is_gone_says_what_ended_it(
    r: redis.Redis, caplog: pytest.LogCaptureFixture, lose: Callable[[redis.Redis, TaskQueue, str], TaskEntry], why: str
) -> None:
    """srv finishes an eval task that is pending for no one: its put is refused as task-gone, counted, and its log says
    what the put's call can tell of how the task was lost (before, it blamed a lost lease and another worker whatever
    happened: since tasks deleted by hand are ended by the reclaim and the records' sweep, and since jobs can be
    deleted, that was often not so)."""
    keys = Keys(f"gone-why-{lose.__name__}".replace("_", "-"))
    queue, producer = job_of(r, keys, "eval", 1)
    task = lose(r, queue, "eval")
    with caplog.at_level(logging.WARNING, logger="buffer.replay"):
        assert producer.try_put(make_group("job", task.group_id, run=keys.run, kind="eval"), task) == TASK_GONE
    assert (f"group {task.group_id}: its task (entry {task.entry_id} of {task.stream}) is pending for no one: {why}; "
            "dropped, not written") in caplog.text
    assert producer.metrics.task_gone_dropped._value.get() == 1
    assert r.xlen(keys.eval("job")) == 0
