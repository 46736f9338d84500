"""Admission slots and the trainer's acks, against a real Redis: an ack as anything but trained gives back the slot
its group holds, once, and nothing for a group that never held one."""

from __future__ import annotations

import time

from buffer_helpers import client, make_group

from buffer.keys import TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import FULL, WRITTEN, ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.config import BufferConfig

KEYS = Keys("t")
# at most 3 groups waiting for the trainer; admission: (η + 1) × groups_per_step = 2 groups in flight or trained
CONFIG = BufferConfig(max_groups=3, max_staleness=0, groups_per_step=2, claim_idle_ms=200)


def test_only_groups_that_hold_an_admission_slot_give_one_back_and_each_once(redis_server: EmbeddedRedis) -> None:
    """Groups nobody admitted (a bulk load's ``put_many``) dropped by the trainer as stale, degenerate, malformed or
    cancelled each gave a slot back all the same, taken from the admitted groups still in flight: admission let in
    more groups than its bound. A written group now carries whether it holds a slot, and an ack gives back only
    that slot, once: also when Redis lost the ack and the trainer acks the entry again."""
    r = client(redis_server)
    queue = TaskQueue(r, KEYS, CONFIG)
    queue.ensure_groups()
    staleness = StalenessControl(r, KEYS, CONFIG)
    producer = ReplayBuffer(r, KEYS, CONFIG, "producer")
    trainer = ReplayBuffer(r, KEYS, CONFIG)
    trainer.ensure_group()
    queue.submit("job", [{"task_id": t, "messages": []} for t in ("a", "b")])
    for entry in queue.read("srv", 2):  # as a rollout server does: admitted, then written with its task acked
        assert staleness.try_admit(entry.group_id)
        assert producer.put(make_group("job", entry.group_id), entry)
    assert not staleness.try_admit("job:9:z") and staleness.admitted() == 2  # the bound
    admitted = trainer.take(2, 0.5)
    assert len(admitted) == 2

    free = [f"free:{i}:x" for i in range(4)]
    assert producer.put_many([make_group("free", g) for g in free]) == [WRITTEN] * 3 + [FULL]  # max_groups
    (e0, g0), (e1, g1), (e2, _) = trainer.take(3, 0.5)
    assert trainer.ack([e0, e1], [g0.group_id, g1.group_id], stale_group_ids=[g0.group_id],
                       degenerate_group_ids=[g1.group_id]) == 2
    trainer.reject(e2, "the model cannot train on it")
    assert producer.put_many([make_group("free", free[3])]) == [WRITTEN]
    r.hset(KEYS.job("free"), "state", "cancelled")
    assert trainer.take(1, 0.3) == []  # dropped as cancelled
    assert trainer.ack([e0, e1], [g0.group_id, g1.group_id], stale_group_ids=[g0.group_id]) == 0  # redelivered ack
    job = queue.job("free")
    assert [job.get(k) for k in ("stale_dropped", "degenerate_dropped", "malformed", "cancelled")] == ["1"] * 4
    assert staleness.admitted() == 2 and not staleness.try_admit("job:9:z")  # the bound still holds

    before = {key: r.dump(key) for key in r.keys(KEYS.prefix + "*")}
    ids, gids = [e for e, _ in admitted], [g.group_id for _, g in admitted]
    assert trainer.ack(ids, gids, stale_group_ids=gids) == 2
    assert staleness.admitted() == 0
    r.delete(*r.keys(KEYS.prefix + "*"))  # Redis comes back as it was a moment before the ack
    for key, value in before.items():
        r.restore(key, 0, value)
    assert staleness.admitted() == 2 and r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 2
    time.sleep(0.3)  # past claim_idle_ms: the trainer's rescan finds its entries again and acks them again
    assert trainer.take(2, 0.3) == []
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0 and r.xlen(KEYS.groups) == 0
    assert trainer.ack(ids, gids, stale_group_ids=gids) == 0
    assert queue.job("job")["stale_dropped"] == "2"
    assert [staleness.try_admit(f"job:{i}:n") for i in range(3)] == [True, True, False]  # each slot back once
