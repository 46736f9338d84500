"""Submits under an idempotency key against a real Redis: the first claims the key for its job in the call that adds its
tasks, a later one under the key adds nothing and names that job (and whether its spec was the same), and the key
expires after ``IDEMPOTENCY_TTL_S``."""

from __future__ import annotations

import pytest
from buffer_helpers import client

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis, client_for
from buffer.task_queue import IDEMPOTENCY_TTL_S, SUBMIT_CHUNK, IdempotencyKeyUsed, TaskQueue
from core.config import BufferConfig, RedisConfig
from tests.test_buffer_queue_faults import LoseExecReply

KEYS = Keys("idem")
SPEC = '{"kind":"train","n_samples":2}'


def tasks(n: int) -> list[dict]:
    return [{"task_id": f"t{i}", "messages": [{"role": "user", "content": f"task {i}"}]} for i in range(n)]


@pytest.fixture
def queue(redis_server: EmbeddedRedis) -> TaskQueue:
    q = TaskQueue(client(redis_server), KEYS, BufferConfig())
    q.ensure_groups()
    return q


def test_a_second_submit_under_a_key_adds_nothing_and_names_the_first_job(queue: TaskQueue) -> None:
    """Every chunk of a submit of more than one chunk finds the key taken, so none of them adds a task."""
    n = SUBMIT_CHUNK + 5
    assert len(queue.submit("first", tasks(n), "train", SPEC, idempotency_key="k-1")) == n
    queue.check_idempotency_key("k-2", SPEC)  # another key names no job
    for spec, same in ((SPEC, True), ('{"kind":"train","n_samples":4}', False)):
        with pytest.raises(IdempotencyKeyUsed) as used:
            queue.check_idempotency_key("k-1", spec)
        assert (used.value.job_id, used.value.same_spec) == ("first", same)
        with pytest.raises(IdempotencyKeyUsed) as used:
            queue.submit("second", tasks(n), "train", spec, idempotency_key="k-1")
        assert (used.value.job_id, used.value.same_spec) == ("first", same)
    assert queue.redis.xlen(KEYS.tasks("train")) == n
    assert queue.job("second") == {} and queue.redis.hkeys(KEYS.jobs) == [b"first"]
    assert queue.job("first")["submitted"] == str(n)
    [key] = queue.redis.keys(f"{KEYS.prefix}idempotency:*")
    assert 0 < queue.redis.ttl(key) <= IDEMPOTENCY_TTL_S


@pytest.mark.parametrize("chunk", [1000, 2])
def test_a_submit_rerun_after_a_lost_reply_is_not_refused_its_own_key(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The client runs a MULTI whose reply it lost again; its chunks find the key claimed by their own job, so the
    rerun adds nothing and is not taken for a second submit under the key. Also in several chunks."""
    monkeypatch.setattr("buffer.task_queue.SUBMIT_CHUNK", chunk)
    r = client(redis_server)
    TaskQueue(r, KEYS, BufferConfig()).ensure_groups()
    proxy = LoseExecReply(redis_server.port, ran=lambda: r.xlen(KEYS.tasks("train")) > 0)
    lossy = TaskQueue(client_for(proxy.url, RedisConfig(), outage_s=10), KEYS, BufferConfig())
    try:
        gids = lossy.submit("job", tasks(5), "train", SPEC, idempotency_key="k")
    finally:
        lossy.redis.close()
        proxy.close()
    assert proxy.lost  # the reply was lost and the client ran the MULTI again
    assert gids == [f"job:{i}:t{i}" for i in range(5)]
    assert r.xlen(KEYS.tasks("train")) == 5 and r.hget(KEYS.job("job"), "submitted") == b"5"


def test_a_key_needs_the_spec_a_retry_repeats(queue: TaskQueue) -> None:
    with pytest.raises(ValueError, match="idempotency_key: a submit under one needs its spec"):
        queue.submit("job", tasks(1), "train", None, idempotency_key="k")
    assert queue.redis.xlen(KEYS.tasks("train")) == 0
