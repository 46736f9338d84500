"""Observability edges: a histogram's buckets resolve the values the docs report for it, so a quantile read from it
(Grafana's histogram_quantile) says something of them rather than interpolating inside one bucket from zero."""

from __future__ import annotations

import math

import pytest
from prometheus_client import Histogram

from rollout_server.engine.metrics import EngineMetrics

# histogram attribute, a value the docs report for it (seconds), where
DOCUMENTED = [
    ("weight_update_seconds", 0.0024, "bench/RESULTS.md: a commit's load of prepared weights, 2.4 ms"),
    ("weight_update_seconds", 0.034, "bench/RESULTS.md: a load copying its 390 MiB in the pause (a memcpy: 34 ms)"),
    ("generation_stall_seconds", 0.0142, "docs/TESTING.md: the demo's stall, 14.2 ms mean"),
    ("generation_stall_seconds", 1.206, "bench/RESULTS.md: a re-prefill's stall, 1206 ms median"),
    ("decode_step_seconds", 0.042, "README.md: a 100M model's decode step, 42 ms"),
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


@pytest.mark.parametrize(("name", "value", "where"), DOCUMENTED, ids=[f"{n}-{v}" for n, v, _ in DOCUMENTED])
def test_engine_histograms_resolve_the_documented_values(name: str, value: float, where: str) -> None:
    lower, upper = _bucket_of(getattr(EngineMetrics(), name), value)
    assert lower > 0 and math.isfinite(upper) and upper / lower <= 2.5, (where, lower, upper)
