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
        self._pauses: dict[tuple[str, float], tuple[float, float]] = {}  # (server, start) -> (pauses, seconds)
        self._pause_ms: float | None = None
        self._since = time.time()

    def record(self, t: float, raw: dict[str, Any]) -> None:
        for counter, series in RATES.items():
            value, last = raw.pop(counter) or 0.0, self._last.get(counter)
            raw[series] = None if last is None or t <= last[0] else max(0.0, value - last[1]) / (t - last[0])
            self._last[counter] = (t, value)
        raw["pause_ms"] = self._latest_pause_ms(raw.pop("pauses"))
        self.points.append((t, raw))

    def _latest_pause_ms(self, pauses: dict[tuple[str, float], tuple[float, float]]) -> float | None:
        """The mean pause of the updates since the last sample, or the last such mean while none came. Each
        server's counters are differenced against its own last seen; one seen for the first time counts from zero
        if it started after this sampler (a new server, or one restarted: a new start), else its first sight is
        the baseline. So the chart shows what updates cost now, not a lifetime mean that stops moving as a run
        grows, nor a lifetime of pauses in one point."""
        count = seconds = 0.0
        for (server, started), (n, s) in pauses.items():
            n0, s0 = self._pauses.get((server, started), (0.0, 0.0) if started >= self._since else (n, s))
            count, seconds = count + n - n0, seconds + s - s0
        live = {server_id for server_id, _ in pauses}  # a server out of sight keeps its baseline until it returns
        self._pauses = {k: v for k, v in self._pauses.items() if k[0] not in live} | pauses
        if count > 0:
            self._pause_ms = 1000 * seconds / count
        return self._pause_ms

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
