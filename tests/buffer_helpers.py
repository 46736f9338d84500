"""Small builders shared by the buffer tests: synthetic trajectory groups, a Redis client, and pending entries aged
past their lease."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import redis

from buffer.redis_server import EmbeddedRedis
from buffer.schema import Sample, TrajectoryGroup


def client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def make_group(
    job_id: str, group_id: str, *, run: str = "t", n: int = 2, tokens: int = 16, version: int = 0,
    kind: str = "train", reward: float = 1.0,
) -> TrajectoryGroup:
    """A valid group whose generated tokens all come from policy ``version``."""
    prompt = tokens // 2
    samples = []
    for i in range(n):
        mask = np.r_[np.zeros(prompt), np.ones(tokens - prompt)]
        samples.append(Sample(
            sample_index=i, token_ids=np.arange(tokens) + i, prompt_len=prompt, loss_mask=mask,
            behaviour_logprobs=-0.5 * mask, token_versions=np.where(mask > 0, version, -1), reward=reward,
        ))
    return TrajectoryGroup(run=run, job_id=job_id, task_id=group_id, samples=samples, kind=kind)


# an idle time past any lease a test sets (buffer.claim_idle_ms): what an entry of a consumer that died long ago shows
AGED_MS = 24 * 3600 * 1000


def age(r: redis.Redis, stream: str, group: str, consumer: str, ids: Sequence[str]) -> None:
    """Leave ``consumer``'s pending entries ``ids`` idle past any lease, as if it died holding them, without a test
    waiting the lease out (a sleep past a short lease let a live holder's entries lapse too under load): an XCLAIM to
    the same consumer with IDLE and JUSTID, which keeps their owner and delivery count. Only entries still in the
    stream: Redis 7's XCLAIM drops one deleted from it from the pending list, so age an entry before deleting it."""
    for entry_id in ids:
        assert r.xrange(stream, entry_id, entry_id), f"{entry_id} is not in {stream}: age it before deleting it"
        [pending] = r.xpending_range(stream, group, entry_id, entry_id, 1)
        assert pending["consumer"].decode() == consumer, (entry_id, pending)
    aged = r.xclaim(stream, group, consumer, min_idle_time=0, message_ids=list(ids), idle=AGED_MS, justid=True)
    assert sorted(i.decode() for i in aged) == sorted(ids)
