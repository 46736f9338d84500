"""The dashboard's time series: a sample of the cluster every second, kept in a ring buffer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import redis

from services.api.cluster import SERVER_COUNTERS, ClusterView

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
# server counters charted as rates: each server differenced on its own (a sum would drop whenever one leaves, and
# jump by its lifetime when it comes back)
RATES = {"generated_tokens": "generated_tokens_per_s", "tool_errors": "tool_errors_per_s"}


class MetricsSampler:
    """Polls ``ClusterView.sample`` and derives rates; ``summary()`` is what ``/v1/metrics/summary`` serves."""

    def __init__(self, cluster: ClusterView, interval_s: float = 1.0, keep: int = 900) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.points: deque[tuple[float, dict[str, float | None]]] = deque(maxlen=keep)
        self._last_t: float | None = None  # the time of the last sample
        self._seen: dict[tuple[str, float], dict[str, float]] = {}  # (server, start) -> its counters last seen
        self._pause_ms: float | None = None
        self._since = time.time()

    def record(self, t: float, raw: dict[str, Any]) -> None:
        done = self._since_last(raw.pop("servers"))
        elapsed = None if self._last_t is None or t <= self._last_t else t - self._last_t
        for counter, series in RATES.items():
            raw[series] = None if elapsed is None else done[counter] / elapsed
        if done["pauses"] > 0:  # the mean pause of the updates since the last sample; held while none came
            self._pause_ms = 1000 * done["pause_s"] / done["pauses"]
        raw["pause_ms"] = self._pause_ms
        self._last_t = t
        self.points.append((t, raw))

    def _since_last(self, servers: dict[tuple[str, float], dict[str, float]]) -> dict[str, float]:
        """What the live servers counted since the last sample, summed. Each server is differenced against its own
        last seen; one seen for the first time counts from zero if it started after this sampler (a new server, or
        one restarted: a new start), else its first sight is the baseline; one out of sight keeps its baseline until
        it returns. So the charts show what happens now: not a lifetime mean that stops moving as a run grows, nor a
        server's lifetime in one point when it comes back after a missed heartbeat."""
        done = dict.fromkeys(SERVER_COUNTERS, 0.0)
        for (server, started), now in servers.items():
            seen = self._seen.get((server, started), dict.fromkeys(SERVER_COUNTERS, 0.0)
                                  if started >= self._since else now)
            for name in SERVER_COUNTERS:
                done[name] += max(0.0, now[name] - seen[name])
        live = {server_id for server_id, _ in servers}
        self._seen = {k: v for k, v in self._seen.items() if k[0] not in live} | servers
        return done

    async def run(self) -> None:
        """Sample every ``interval_s`` for as long as the API runs. A failed sample (Redis away, or a value in it the
        view cannot read: a step's metrics that are not JSON) is logged once, with its traceback when it is not
        Redis's, until one works again: any error but Redis's ended the loop, and the charts stopped for good."""
        failing = False
        while True:
            try:
                raw = await asyncio.to_thread(self.cluster.sample)
                self.record(time.time(), raw)
            except Exception as exc:
                if not failing:
                    log.warning("metrics sample failed (%s: %s): the dashboard's charts miss points until one works",
                                type(exc).__name__, exc, exc_info=not isinstance(exc, redis.RedisError))
                failing = True
            else:
                if failing:
                    log.info("metrics samples work again")
                failing = False
            await asyncio.sleep(self.interval_s)

    def summary(self) -> dict[str, Any]:
        """The points so far. Read from a copy, taken in one step: the route runs in a worker thread while ``run``
        appends in the event loop's, and iterating the deque it changed raised (a 500 now and then)."""
        points = list(self.points)
        return {
            "t": [round(t, 3) for t, _ in points],
            "series": {name: [p.get(name) for _, p in points] for name in SERIES},
        }
