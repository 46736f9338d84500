"""Groups of a schema newer than the trainer reads, against a real Redis: a rolling upgrade upgrades the producers
first, and the groups they write wait, counted and holding their admission slots, for a trainer that reads them.

The older trainer is this code pinned to the schema versions a release that read 1 and 2 only decodes; the groups
come from this code's producer, in version 3."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import redis
from buffer_helpers import client, make_group

from buffer import schema
from buffer.keys import TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import WRITTEN, ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from buffer.task_queue import TRAIN_ENDS, Deletion, TaskQueue
from core.config import BufferConfig

KEYS = Keys("t")
CONFIG = BufferConfig(max_staleness=0, groups_per_step=2, claim_idle_ms=200)  # admission: 2 groups


def older_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on this process decodes as a release that read schema versions 1 and 2 only (its producer still
    writes version 3: a newer one)."""
    monkeypatch.setattr(schema, "READABLE_VERSIONS", (1, 2))


def run_parts(r: redis.Redis) -> tuple[TaskQueue, StalenessControl, ReplayBuffer]:
    """The run's task queue, admission and a rollout server's producer side, their streams created."""
    queue = TaskQueue(r, KEYS, CONFIG)
    queue.ensure_groups()
    producer = ReplayBuffer(r, KEYS, CONFIG, "producer")
    producer.ensure_group()
    return queue, StalenessControl(r, KEYS, CONFIG), producer


def produce(queue: TaskQueue, staleness: StalenessControl, producer: ReplayBuffer, n: int) -> list[str]:
    """As a rollout server does: each task admitted, then its group written with the task acked."""
    gids = queue.submit("job", [{"task_id": f"t{i}", "messages": []} for i in range(n)])
    for entry in queue.read("srv", n):
        assert staleness.try_admit(entry.group_id)
        assert producer.put(make_group("job", entry.group_id), entry)
    return gids


def test_groups_of_a_newer_schema_wait_for_a_trainer_that_reads_them(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """They used to go to ``groups:malformed`` (counted ``malformed``, their slots given back): lost for training,
    though the upgraded trainer reads them. The older trainer moves them to ``groups:newer`` once (it does not read
    them again, nor does it when started again), its job counts nothing for them and they keep their slots; the
    upgraded trainer moves them back as it starts and trains them. A truly malformed group still goes aside."""
    caplog.set_level(logging.INFO, logger="buffer.replay")
    r = client(redis_server)
    queue, staleness, producer = run_parts(r)
    gids = produce(queue, staleness, producer, 2)
    r.set(KEYS.payload("bad:0:x", "0"), b"\xc1 not a group")
    r.xadd(KEYS.groups, {"p": KEYS.payload("bad:0:x", "0"), "gid": "bad:0:x", "job": "bad", "s": "0"})

    older_trainer(monkeypatch)
    old = ReplayBuffer(r, KEYS, CONFIG)
    assert old.take(5, 0.3) == []
    assert r.xlen(KEYS.groups) == 0 and r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0
    assert r.xlen(KEYS.groups_malformed) == 1 and queue.job("bad")["malformed"] == "1"
    parked = [fields for _, fields in r.xrange(KEYS.groups_newer)]
    assert [(f[b"schema"], f[b"f.gid"].decode()) for f in parked] == [(b"3", g) for g in gids]
    assert all(r.exists(f[b"f.p"]) for f in parked)  # the payloads wait with them
    assert "written by a newer producer" in caplog.text and f"moved to {KEYS.groups_newer}" in caplog.text
    job = queue.job("job")
    assert job["completed"] == "2" and not set(TRAIN_ENDS) & set(job)  # not ended: still to train
    assert staleness.admitted() == 2 and not staleness.try_admit("job:9:z")  # in flight, holding their slots
    time.sleep(0.3)  # past claim_idle_ms: the rescan of its own pending entries finds none
    assert old.take(5, 0.3) == []
    assert old.metrics.newer_schema.labels(action="parked")._value.get() == 2  # once each
    old.metrics.observe(r, KEYS)
    assert old.metrics.registry.get_sample_value("rollwave_buffer_depth", {"stream": "groups_newer"}) == 2
    again = ReplayBuffer(r, KEYS, CONFIG)  # the older trainer started again: it still does not read them
    assert again.take(5, 0.2) == [] and r.xlen(KEYS.groups_newer) == 2
    assert again.metrics.newer_schema.labels(action="restored")._value.get() == 0

    monkeypatch.undo()  # the trainer is upgraded
    new = ReplayBuffer(r, KEYS, CONFIG)
    batch = new.take(5, 0.5)
    assert sorted(g.group_id for _, g in batch) == gids and r.xlen(KEYS.groups_newer) == 0
    assert new.metrics.newer_schema.labels(action="restored")._value.get() == 2
    assert f"moved 2 group(s) of schema_version 3 back into {KEYS.groups}" in caplog.text
    with pytest.raises(TrainerFenced):
        again.take(1, 0.1)
    assert new.ack([e for e, _ in batch], [g.group_id for _, g in batch], stale_group_ids=[gids[0]]) == 2
    job = queue.job("job")
    assert (job["trained"], job["stale_dropped"]) == ("1", "1")  # submitted = trained + stale_dropped
    assert staleness.admitted() == 1  # the trained group keeps its slot, the stale one gave its own back
    assert r.keys(KEYS.payload("*", "*")) == []


def test_an_older_trainer_fenced_while_reading_parks_nothing(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer trainer that started while the older one waited on its read has already moved back what was parked:
    what the older one reads after that is left pending for the newer one, not parked out of its reach."""
    r = client(redis_server)
    queue, staleness, producer = run_parts(r)
    older_trainer(monkeypatch)
    old = ReplayBuffer(r, KEYS, CONFIG)
    errors: list[Exception] = []

    def take() -> None:
        try:
            old.take(1, 30)
        except TrainerFenced as exc:
            errors.append(exc)

    reader = threading.Thread(target=take)
    reader.start()
    deadline = time.monotonic() + 10
    while r.info("clients")["blocked_clients"] == 0:  # the older trainer waits on its read
        assert time.monotonic() < deadline, "the older trainer never waited on its read"
        time.sleep(0.01)
    new = ReplayBuffer(r, KEYS, CONFIG)
    new.fence()
    [gid] = produce(queue, staleness, producer, 1)
    reader.join(10)
    assert not reader.is_alive() and len(errors) == 1
    assert r.xlen(KEYS.groups_newer) == 0 and r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 1
    monkeypatch.undo()  # the newer trainer reads version 3
    [(_, group)] = new.take(1, 0.5)
    assert group.group_id == gid


def aof_now(server: EmbeddedRedis) -> dict[Path, bytes]:
    """The AOF as it stands (every write fsynced: ``appendfsync always``): what a Redis that crashes and loses the
    writes after this point comes back with. Redis 6.2 keeps one file, Redis 7 a directory of them."""
    return {path: path.read_bytes() for path in server.data_dir.rglob("appendonly*") if path.is_file()}


def crash_back_to(server: EmbeddedRedis, aof: dict[Path, bytes]) -> None:
    """Crash Redis and start it again from ``aof``: the writes made since are lost, as the last second or two of
    them are with ``appendfsync everysec``."""
    server.kill()
    for path in server.data_dir.rglob("appendonly*"):
        if path.is_file():
            path.unlink()
    for path, data in aof.items():
        path.write_bytes(data)
    server.start()


def parked_groups(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, n: int, unadmitted: int = 0,
) -> tuple[TaskQueue, list[str]]:
    """``n`` groups written by upgraded producers (and ``unadmitted`` more, put without a task) and parked by an older
    trainer; the trainer is then upgraded."""
    queue, staleness, producer = run_parts(r)
    gids = produce(queue, staleness, producer, n)
    gids += [f"job:{n + i}:x" for i in range(unadmitted)]
    assert producer.put_many([make_group("job", g) for g in gids[n:]]) == [WRITTEN] * unadmitted
    older_trainer(monkeypatch)
    assert ReplayBuffer(r, KEYS, CONFIG).take(len(gids), 0.3) == [] and r.xlen(KEYS.groups_newer) == len(gids)
    monkeypatch.undo()
    return queue, gids


def assert_trained_once(r: redis.Redis, queue: TaskQueue, gids: list[str]) -> None:
    """Each group counted trained once, nothing left to deliver anywhere: a later trainer gets none of them."""
    assert queue.job("job")["trained"] == str(len(gids))
    assert r.hgetall(KEYS.group_state) == {g.encode(): b"t" for g in gids}
    assert r.xlen(KEYS.groups_newer) == 0 and r.xlen(KEYS.groups) == 0
    assert r.keys(KEYS.payload("*", "*")) == []
    assert ReplayBuffer(r, KEYS, CONFIG).take(5, 0.3) == []


def test_a_restore_redis_lost_is_done_again_and_what_the_trainer_held_trains_once(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis lost the restore (a crash with ``appendfsync everysec``): the groups were parked again, while the
    trainer held the copies the restore had made. It restored only once, so it never took the group it had not read
    yet, and the acks of those it held found no entry: they counted nothing, and the next trainer trained them again.
    Now the held group's ack finds it parked, one acked before the loss is acked again there, and the rest are
    restored again within ``claim_idle_ms``, the held one left parked until then."""
    caplog.set_level(logging.INFO, logger="buffer.replay")
    r = client(redis_server)
    queue, gids = parked_groups(r, monkeypatch, 2, unadmitted=1)
    trainer = ReplayBuffer(r, KEYS, CONFIG)
    trainer.fence()
    before_restore = aof_now(redis_server)
    (e0, g0), (e1, g1) = trainer.take(2, 0.5)  # restores all three, takes two
    assert [g0.group_id, g1.group_id] == gids[:2]
    assert trainer.ack([e0], [g0.group_id]) == 1  # trained before the crash: this ack is lost with the restore
    crash_back_to(redis_server, before_restore)
    assert r.xlen(KEYS.groups_newer) == 3 and r.xlen(KEYS.groups) == 0

    time.sleep(0.3)  # past claim_idle_ms: the trainer restores again the group it had not read, and only it
    [(e2, g2)] = trainer.take(5, 0.5)
    assert g2.group_id == gids[2] and r.xlen(KEYS.groups_newer) == 1  # the held one waits for its ack
    assert f"Redis lost the restore of 1 group(s) this trainer holds (entries {e1})" in caplog.text
    assert trainer.ack([e1, e2], [g1.group_id, g2.group_id]) == 2
    assert_trained_once(r, queue, gids)


def test_a_trainer_resumed_after_a_lost_restore_trains_nothing_twice(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer that held the restored copies crashed after its checkpoint, before its ack; Redis had lost the
    restore. The next trainer acks what that checkpoint covers before it takes: the acks found no entry, and it
    restored and trained the groups a second time."""
    r = client(redis_server)
    queue, gids = parked_groups(r, monkeypatch, 2)
    crashed = ReplayBuffer(r, KEYS, CONFIG)
    crashed.fence()
    before_restore = aof_now(redis_server)
    covered = crashed.take(2, 0.5)
    crash_back_to(redis_server, before_restore)
    resumed = ReplayBuffer(r, KEYS, CONFIG)
    assert resumed.ack([e for e, _ in covered], [g.group_id for _, g in covered]) == 2
    assert_trained_once(r, queue, gids)


def test_a_take_redis_lost_after_a_restore_it_kept_trains_nothing_twice(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis kept the restore but lost the read that delivered a restored group (its entry is there, undelivered);
    the trainer crashed after its checkpoint. The next trainer's ack of that entry counted nothing, since it was not
    pending, and its take delivered the group again."""
    r = client(redis_server)
    queue, gids = parked_groups(r, monkeypatch, 2)
    crashed = ReplayBuffer(r, KEYS, CONFIG)
    covered = crashed.take(1, 0.5)  # restores both, reads one
    before_read = aof_now(redis_server)
    covered += crashed.take(1, 0.5)
    crash_back_to(redis_server, before_read)
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 1 and r.xlen(KEYS.groups) == 2
    resumed = ReplayBuffer(r, KEYS, CONFIG)
    assert resumed.ack([e for e, _ in covered], [g.group_id for _, g in covered]) == 2
    assert_trained_once(r, queue, gids)


def test_a_deleted_cancelled_jobs_groups_parked_for_a_newer_trainer_go_with_it(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups an older trainer parked in ``groups:newer`` are left of their job, and no trainer holds them: deleting
    the cancelled job removes them with their payload keys and admission slots, so the upgraded trainer, starting,
    has nothing of the job to move back, train, or count on a job hash it would bring back."""
    r = client(redis_server)
    queue, staleness, producer = run_parts(r)
    gids = produce(queue, staleness, producer, 2)
    older_trainer(monkeypatch)
    assert ReplayBuffer(r, KEYS, CONFIG).take(5, 0.3) == []
    assert r.xlen(KEYS.groups_newer) == 2 and staleness.admitted() == 2
    assert queue.cancel_job("job") == "cancelled"

    assert queue.delete_job("job") == Deletion("train", 0, removed_groups=2)
    assert r.xlen(KEYS.groups_newer) == 0 and not r.keys(KEYS.payload("*", "*"))
    assert staleness.admitted() == 0
    assert r.hmget(KEYS.group_state, gids) == [b"t", b"t"]
    monkeypatch.undo()
    assert ReplayBuffer(r, KEYS, CONFIG).take(5, 0.3) == []
    assert not r.exists(KEYS.job("job")) and r.xlen(KEYS.groups) == 0
