"""The launchers' restart backoff (``RestartBackoff``, shared by ``LocalStack`` and the Ray launcher's actors): a
component that keeps dying at once is restarted after a delay that doubles each time (up to its cap), and one that
stayed up a while starts again from the first delay."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.launcher import ComponentSpec, LocalStack, RestartBackoff

DELAY = re.compile(r"^(\S+) exited with 1 after [\d.]+ s up; restarting it in ([\d.e-]+) s$")


def _delays(caplog: pytest.LogCaptureFixture, name: str) -> list[float]:
    """The restart delays announced for ``name``, in order."""
    found = [DELAY.match(r.getMessage()) for r in caplog.records if r.name == "services.launcher"]
    return [float(m[2]) for m in found if m and m[1] == name]


def _wait_restarts(restarts: Callable[[], int], count: int, timeout_s: float = 60.0) -> float:
    """Wait until ``restarts()`` reaches ``count``; returns the seconds it took."""
    started = time.monotonic()
    while restarts() < count:
        assert time.monotonic() - started < timeout_s, restarts()
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_component_that_dies_at_once_is_restarted_ever_later(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Five restarts of a component that exits at once take at least 0.05 * (1 + 2 + 4 + 8 + 16) s (the old
    supervisor made them in five polls, a quarter of a second); load only makes it longer."""
    caplog.set_level(logging.WARNING, "services.launcher")
    dies = ComponentSpec("dies", ["sh", "-c", "exit 1"])
    with LocalStack([dies], tmp_path / "logs", poll_s=0.01, backoff_s=0.05, max_backoff_s=10,
                    stable_s=60) as stack:
        took = _wait_restarts(lambda: stack.restarts["dies"], 5)
    assert took >= 0.05 * 31, (took, stack.restarts)
    assert _delays(caplog, "dies")[:5] == [0.05, 0.1, 0.2, 0.4, 0.8]


def test_the_backoff_is_capped_and_starts_again_after_a_stable_run(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Runs 1-3 die at once (0.05, 0.1, then the cap 0.15); run 4 stays up past ``stable_s`` before it dies, so
    the delay starts again from 0.05; run 5 dies at once (0.1)."""
    caplog.set_level(logging.WARNING, "services.launcher")
    runs = tmp_path / "runs"
    script = f'n=$(cat {runs} 2>/dev/null || echo 0); echo $((n + 1)) > {runs}; [ "$n" = 3 ] && sleep 2; exit 1'
    with LocalStack([ComponentSpec("flaky", ["sh", "-c", script])], tmp_path / "logs", poll_s=0.01,
                    backoff_s=0.05, max_backoff_s=0.15, stable_s=1) as stack:
        _wait_restarts(lambda: stack.restarts["flaky"], 5)
    assert _delays(caplog, "flaky")[:5] == [0.05, 0.1, 0.15, 0.05, 0.1]


def test_a_component_that_died_a_thousand_times_is_restarted_still(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The delay was ``backoff_s * 2 ** (deaths - 1)``, capped: at the 1025th death in a row the power no longer fits
    a float, and the OverflowError ended the supervisor (of every component) for good."""
    caplog.set_level(logging.WARNING, "services.launcher")
    dies = ComponentSpec("dies", ["sh", "-c", "exit 1"])
    with LocalStack([dies], tmp_path / "logs", poll_s=0.001, backoff_s=1e-4, max_backoff_s=1e-4) as stack:
        _wait_restarts(lambda: stack.restarts["dies"], 1100, timeout_s=120)
    assert set(_delays(caplog, "dies")) == {1e-4}


def test_a_ray_actor_restarts_its_component_by_the_same_backoff(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The Ray launcher's actor (its class, run here without Ray) restarts a component that exits at once as
    ``LocalStack`` does; it used to exit at once on every failure, and Ray restarted it at once, for ever."""
    from services.ray_launcher import ComponentProcess

    caplog.set_level(logging.WARNING, "services.launcher")
    dies = ComponentSpec("dies", ["sh", "-c", "exit 1"])
    component = ComponentProcess(dies, str(tmp_path / "logs"), 60, RestartBackoff("dies", 0.05, 10, 60))
    try:
        took = _wait_restarts(component.restarts, 5)
    finally:
        component.stop(10)
    assert took >= 0.05 * 30, took  # 0.05 * (1 + 2 + 4 + 8 + 16) s of delays, the first begun as it returned
    assert _delays(caplog, "dies")[:5] == [0.05, 0.1, 0.2, 0.4, 0.8]
