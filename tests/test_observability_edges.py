"""Observability edges: a histogram's buckets resolve the values the docs report for it, so a quantile read from it
(Grafana's histogram_quantile) says something of them rather than interpolating inside one bucket from zero."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from prometheus_client import Histogram

from rollout_server.checkpoint_receiver import CheckpointMetrics
from rollout_server.engine.metrics import EngineMetrics

# the component's metrics, the histogram's attribute, a value the docs report for it (seconds), where
DOCUMENTED = [
    (EngineMetrics, "weight_update_seconds", 0.0024, "bench/RESULTS.md: a commit's load of prepared weights, 2.4 ms"),
    (EngineMetrics, "weight_update_seconds", 0.034,
     "bench/RESULTS.md: a load copying its 390 MiB in the pause (a memcpy: 34 ms)"),
    (EngineMetrics, "generation_stall_seconds", 0.0142, "docs/TESTING.md: the demo's stall, 14.2 ms mean"),
    (EngineMetrics, "generation_stall_seconds", 1.206, "bench/RESULTS.md: a re-prefill's stall, 1206 ms median"),
    (EngineMetrics, "decode_step_seconds", 0.042, "README.md: a 100M model's decode step, 42 ms"),
    (CheckpointMetrics, "pause_seconds", 0.0037, "bench/RESULTS.md: a Commit's pause, 3.7 ms median"),
    (CheckpointMetrics, "pause_seconds", 0.0061, "README.md: the demo's pause per update, 6 ms mean"),
]


def _bucket_of(histogram: Histogram, value: float) -> tuple[float, float]:
    """The (lower, upper] bounds of the bucket ``value`` lands in, read back from the exposition."""
    histogram.observe(value)
    lower = 0.0
    for sample in next(iter(histogram.collect())).samples:
        if sample.name.endswith("_bucket"):
            if sample.value > 0:
                return lower, float(sample.labels["le"])
            lower = float(sample.labels["le"])
    raise AssertionError(f"{value} landed in no bucket")


@pytest.mark.parametrize(("metrics", "name", "value", "where"), DOCUMENTED,
                         ids=[f"{n}-{v}" for _, n, v, _ in DOCUMENTED])
def test_histograms_resolve_the_documented_values(metrics: Callable[[], object], name: str, value: float,
                                                  where: str) -> None:
    """The rollout server's pause histogram began at 10 ms: every documented pause (2-11 ms) fell in its first bucket,
    and Grafana's p95 read 9.5 ms whatever they were."""
    lower, upper = _bucket_of(getattr(metrics(), name), value)
    assert lower > 0 and math.isfinite(upper) and upper / lower <= 2.5, (where, lower, upper)
