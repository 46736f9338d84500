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
    "tool_errors_per_s",
)
# counters summed over the live servers, charted as rates: a total would drop whenever a server leaves
RATES = {"generated_tokens": "generated_tokens_per_s", "tool_errors": "tool_errors_per_s"}


class MetricsSampler:
    """Polls ``ClusterView.sample`` and derives rates; ``summary()`` is what ``/v1/metrics/summary`` serves."""

    def __init__(self, cluster: ClusterView, interval_s: float = 1.0, keep: int = 900) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.points: deque[tuple[float, dict[str, float | None]]] = deque(maxlen=keep)
        self._last: dict[str, tuple[float, float]] = {}  # counter -> (time, value) of the last sample

    def record(self, t: float, raw: dict[str, float | None]) -> None:
        for counter, series in RATES.items():
            value, last = raw.pop(counter) or 0.0, self._last.get(counter)
            raw[series] = None if last is None or t <= last[0] else max(0.0, value - last[1]) / (t - last[0])
            self._last[counter] = (t, value)
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
