"""Edges of the replay buffer against a real Redis: a group longer than Redis takes in one argument."""

from __future__ import annotations

import pytest
from buffer_helpers import client, make_group

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import MAX_PAYLOAD_BYTES, GroupTooLarge, ReplayBuffer
from buffer.schema import encode_group
from buffer.task_queue import TaskQueue
from core.config import BufferConfig

KEYS = Keys("t")
CONFIG = BufferConfig(claim_idle_ms=200)


def test_a_group_longer_than_redis_takes_is_refused_naming_it_and_its_task_stays(redis_server: EmbeddedRedis) -> None:
    """A payload over Redis's proto-max-bulk-len made Redis close the connection: the client retried the put, sending
    the whole payload each time, for 60 s, then failed with a connection reset naming neither the group nor its size,
    and the rollout server, taking that for an outage, retried the put for ever. It is refused before anything is
    sent, naming the group and its size; its task stays pending for its worker, and the next group is written."""
    r = client(redis_server)
    assert int(r.config_get("proto-max-bulk-len")["proto-max-bulk-len"]) == MAX_PAYLOAD_BYTES
    queue = TaskQueue(r, KEYS, CONFIG)
    queue.ensure_groups()
    producer = ReplayBuffer(r, KEYS, CONFIG, "producer")
    producer.ensure_group()
    queue.submit("job", [{"task_id": t, "messages": []} for t in ("big", "small")])
    big, small = queue.read("srv", 2)
    producer.max_payload_bytes = len(encode_group(make_group("job", small.group_id)))  # the small group just fits

    with pytest.raises(GroupTooLarge, match=rf"group {big.group_id} \(job job\): encoded payload is \d+ bytes"):
        producer.put(make_group("job", big.group_id, tokens=64), big)
    assert r.xlen(KEYS.groups) == 0 and r.keys(KEYS.prefix + "payload:*") == []
    assert not queue.fail(big, "its group is too large")  # still this worker's: requeued, not lost
    assert producer.put(make_group("job", small.group_id), small)
    assert r.xlen(KEYS.groups) == 1 and queue.job("job").get("completed") == "1"
