"""The replay buffer against what an operator does to its Redis, with a real redis-server: a group deleted from the
stream while a trainer held it (an XDEL, a MAXLEN trim), and a server whose ``proto-max-bulk-len`` is below Redis's
default (or that refuses CONFIG)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from buffer_helpers import client, make_group

from buffer.keys import TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import MAX_PAYLOAD_BYTES, GroupTooLarge, ReplayBuffer
from buffer.schema import encode_group
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.config import BufferConfig

CONFIG = BufferConfig(claim_idle_ms=200)
LOW_BULK = 1 << 20  # the lowest proto-max-bulk-len Redis takes (1mb)


def admitted_groups(r: redis.Redis, keys: Keys, n: int) -> list[str]:
    """``n`` train groups of job ``job`` in the buffer, each admitted for its task and written by its rollout server
    (so each entry holds its admission slot); returns their group ids."""
    queue = TaskQueue(r, keys, CONFIG)
    queue.ensure_groups()
    queue.submit("job", [{"task_id": f"t{i}", "messages": []} for i in range(n)])
    staleness = StalenessControl(r, keys, CONFIG)
    producer = ReplayBuffer(r, keys, CONFIG, "producer")
    producer.ensure_group()
    for task in queue.read("srv", n):
        assert staleness.try_admit(task.group_id, task=task)
        assert producer.put(make_group("job", task.group_id), task)
    assert staleness.admitted() == n
    return [f[b"gid"].decode() for _, f in r.xrange(keys.groups)]


def trainer(r: redis.Redis, keys: Keys) -> ReplayBuffer:
    """The run's trainer (consumer ``trainer``): a new one is the same trainer restarted."""
    buf = ReplayBuffer(r, keys, CONFIG)
    buf.ensure_group()
    return buf


@pytest.mark.parametrize("deletion", ["xdel", "maxlen_trim"])
def test_a_group_deleted_while_a_dead_trainer_held_it_gives_its_admission_slot_back_once(
    redis_url: str, caplog: pytest.LogCaptureFixture, deletion: str
) -> None:
    """The trainer took two groups and died; an operator deleted the first one's entry meanwhile (XDEL, or a MAXLEN
    trim). Restarted, the trainer takes back the other and acks the deleted one away: its admission slot goes back with
    it, logged and counted (before, only the ack gave a slot back, and this one was never acked: admission shrank by one
    for good). Once only: the ack of it its checkpoint recorded, the next takes and the other group's ack give back no
    more."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(f"deleted-{deletion.replace('_', '-')}")
    gids = admitted_groups(r, keys, 2)
    held = trainer(r, keys).take(2, 5.0)
    assert [g.group_id for _, g in held] == gids
    if deletion == "xdel":
        assert r.xdel(keys.groups, held[0][0]) == 1
    else:
        assert r.xtrim(keys.groups, maxlen=1, approximate=False) == 1
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 2  # still pending for the dead trainer

    restarted = trainer(r, keys)
    with caplog.at_level(logging.WARNING, logger="buffer.replay"):
        taken = restarted.take(2, 0.0)
    assert [e for e, _ in taken] == [held[1][0]]
    staleness = StalenessControl(r, keys, CONFIG)
    assert staleness.admitted() == 1
    assert (f"{keys.groups}: 1 pending group(s) had been deleted from the stream (an XDEL or trim by hand); acked them "
            "away and gave their admission slots back") in caplog.text
    assert restarted.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total",
                                                       {"stream": "groups"}) == 1

    assert restarted.ack([held[0][0]], [gids[0]], stale_group_ids=[gids[0]]) == 0
    assert restarted.take(2, 0.0) == []
    assert restarted.ack([held[1][0]], [gids[1]]) == 1
    assert (staleness.admitted(), staleness.trained()) == (1, 1)
    assert restarted.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total",
                                                       {"stream": "groups"}) == 1
    assert r.xpending(keys.groups, TRAINER_GROUP)["pending"] == 0


def test_a_group_deleted_while_held_and_then_dropped_gives_its_slot_back_at_its_ack_only(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The other order: the live trainer drops (stale) a group whose entry an operator deleted while it held it. Its
    ack finds it still pending and gives its slot back, and says the entry was gone (before, nothing did); a restarted
    trainer's reclaim finds nothing more to give."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys("deleted-then-acked")
    [gid] = admitted_groups(r, keys, 1)
    live = trainer(r, keys)
    [(entry_id, _)] = live.take(1, 5.0)
    assert r.xdel(keys.groups, entry_id) == 1
    with caplog.at_level(logging.WARNING, logger="buffer.replay"):
        assert live.ack([entry_id], [gid], stale_group_ids=[gid]) == 1
    assert (f"{keys.groups}: 1 group(s) acked had been deleted from the stream while pending (an XDEL or trim by "
            "hand)") in caplog.text
    assert live.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total", {"stream": "groups"}) == 1
    assert StalenessControl(r, keys, CONFIG).admitted() == 0
    restarted = trainer(r, keys)
    assert restarted.take(1, 0.0) == []
    assert restarted.metrics.registry.get_sample_value("rollwave_buffer_deleted_pending_total",
                                                       {"stream": "groups"}) is None
    assert StalenessControl(r, keys, CONFIG).admitted() == 0


class LowBulkRedis(EmbeddedRedis):
    """The embedded redis-server started with ``--proto-max-bulk-len 1mb``: an external Redis configured below the
    512 MiB default."""

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--proto-max-bulk-len", "1mb"]


@pytest.fixture
def low_bulk_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with LowBulkRedis(tmp_path / "redis", aof=False) as server:
        yield server


def test_a_group_over_the_servers_lower_bulk_limit_is_refused_before_it_is_sent(low_bulk_redis: EmbeddedRedis) -> None:
    """A group between the server's proto-max-bulk-len (1 MiB here) and 512 MiB made Redis close the connection, which
    the client took for an outage and retried: it is refused before anything is sent, naming the server's limit, its
    task still pending for its worker; a group within the limit is written."""
    r = client(low_bulk_redis)
    assert int(r.config_get("proto-max-bulk-len")["proto-max-bulk-len"]) == LOW_BULK
    keys = Keys("low-bulk")
    queue = TaskQueue(r, keys, CONFIG)
    queue.ensure_groups()
    queue.submit("job", [{"task_id": t, "messages": []} for t in ("big", "small")])
    big, small = queue.read("srv", 2)
    producer = ReplayBuffer(r, keys, CONFIG, "producer")
    producer.ensure_group()
    group = make_group("job", big.group_id, tokens=80_000)
    assert LOW_BULK < len(encode_group(group)) < MAX_PAYLOAD_BYTES

    with pytest.raises(GroupTooLarge, match=rf"group {big.group_id} \(job job\): encoded payload is \d+ bytes, over "
                                            rf"the {LOW_BULK} Redis takes"):
        producer.put(group, big)
    assert r.xlen(keys.groups) == 0 and r.keys(keys.prefix + "payload:*") == []
    assert not queue.fail(big, "its group is too large")  # still this worker's: requeued, not lost
    assert producer.put(make_group("job", small.group_id), small)
    assert r.xlen(keys.groups) == 1


def test_a_server_that_refuses_config_is_taken_to_have_the_default_limit_logged_once(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A managed Redis may deny CONFIG (here an ACL user without it): puts go on under the 512 MiB default, and the
    buffer says once that it could not read the server's limit."""
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("no-config", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-config"])
    try:
        r = redis.Redis.from_url(redis_url, username="no-config", password="pw")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.config_get("proto-max-bulk-len")
        keys = Keys("no-config")
        producer = ReplayBuffer(r, keys, CONFIG, "producer")
        producer.ensure_group()
        with caplog.at_level(logging.WARNING, logger="buffer.replay"):
            assert producer.put_many([make_group("job", f"job:{i}:x") for i in range(2)]) == [1, 1]
            assert producer.put(make_group("job", "job:2:x"))
        assert producer.payload_limit() == MAX_PAYLOAD_BYTES
        assert r.xlen(keys.groups) == 3
        assert caplog.text.count("CONFIG GET proto-max-bulk-len gave no limit (NoPermissionError") == 1
    finally:
        admin.acl_deluser("no-config")
