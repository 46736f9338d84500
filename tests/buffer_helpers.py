"""Small builders shared by the buffer tests: synthetic trajectory groups and a Redis client."""

from __future__ import annotations

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
