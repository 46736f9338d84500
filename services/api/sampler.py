"""The dashboard's time series: a sample of the cluster every second, kept in a ring buffer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import redis

from services.api.cluster import ClusterView

log = logging.getLogger(__name__)

SERIES = (
    "reward_mean",
    "policy_version",
    "buffer_depth_groups",
    "generated_tokens_per_s",
    "pause_ms",
    "trainer_idle_fraction",
    "staleness_mean",
    "tool_errors",
)


class MetricsSampler:
    """Polls ``ClusterView.sample`` and derives rates; ``summary()`` is what ``/v1/metrics/summary`` serves."""

    def __init__(self, cluster: ClusterView, interval_s: float = 1.0, keep: int = 900) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.points: deque[tuple[float, dict[str, float | None]]] = deque(maxlen=keep)
        self._last_tokens: tuple[float, float] | None = None

    def record(self, t: float, raw: dict[str, float | None]) -> None:
        tokens = raw.pop("generated_tokens") or 0.0
        rate = None
        if self._last_tokens is not None and t > self._last_tokens[0]:
            rate = max(0.0, tokens - self._last_tokens[1]) / (t - self._last_tokens[0])
        self._last_tokens = (t, tokens)
        raw["generated_tokens_per_s"] = rate
        self.points.append((t, raw))

    async def run(self) -> None:
        while True:
            try:
                raw = await asyncio.to_thread(self.cluster.sample)
                self.record(time.time(), raw)
            except redis.RedisError as exc:
                log.warning("metrics sample failed: %s", exc)
            await asyncio.sleep(self.interval_s)

    def summary(self) -> dict[str, Any]:
        return {
            "t": [round(t, 3) for t, _ in self.points],
            "series": {name: [p.get(name) for _, p in self.points] for name in SERIES},
        }
