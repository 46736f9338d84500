"""The Prometheus harness against a real Prometheus scraping a real prometheus_client server."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_harness import PrometheusHarness, scrape_config

from core.metrics import serve_metrics


def test_harness_scrapes_a_metrics_server_and_answers_queries(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    events = Counter("rollwave_test_events", "events seen by the test", ["kind"], registry=registry)
    events.labels(kind="ok").inc(3)
    Gauge("rollwave_test_version", "a gauge", registry=registry).set(7)
    server = serve_metrics(registry, "test", "127.0.0.1", 0)
    try:
        target = f"127.0.0.1:{server.server_port}"
        with PrometheusHarness({"rollwave-trainer": [target]}, tmp_path / "prom") as prom:
            result = prom.wait_for('rollwave_test_events_total{kind="ok"}')
            assert len(result) == 1
            sample = result[0]
            assert sample["metric"]["job"] == "rollwave-trainer"
            assert sample["metric"]["instance"] == target
            assert float(sample["value"][1]) == 3.0
            assert float(prom.wait_for("rollwave_test_version")[0]["value"][1]) == 7.0
            up = prom.query('up{job="rollwave-trainer"}')
            assert [float(s["value"][1]) for s in up] == [1.0]
            assert [t["health"] for t in prom.targets()] == ["up"]
        assert prom.proc is not None and prom.proc.poll() is not None
    finally:
        server.shutdown()
        server.server_close()


def test_generated_config_keeps_the_project_jobs_settings() -> None:
    config = scrape_config({"rollwave-engine": ["127.0.0.1:1234"], "rollwave-api": ["127.0.0.1:5678"]})
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"rollwave-engine", "rollwave-api"}
    engine = jobs["rollwave-engine"]
    assert engine["static_configs"] == [{"targets": ["127.0.0.1:1234"]}]
    assert engine["scrape_interval"] == "1s" and engine["metrics_path"] == "/engine/0/metrics"
    assert jobs["rollwave-api"]["static_configs"] == [{"targets": ["127.0.0.1:5678"]}]


def test_unknown_job_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="no scrape job named \\['rollwave-typo'\\]"):
        scrape_config({"rollwave-typo": ["127.0.0.1:1"]})


def test_a_bad_query_is_reported_with_prometheus_error(tmp_path: Path) -> None:
    with PrometheusHarness({"rollwave-api": ["127.0.0.1:1"]}, tmp_path / "prom") as prom:
        with pytest.raises(RuntimeError, match="HTTP 400"):
            prom.query("sum(rate(x[1m])")
