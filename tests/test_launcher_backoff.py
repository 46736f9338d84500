"""LocalStack's restart backoff: a component that keeps dying at once is restarted after a delay that doubles each
time (up to its cap), and one that stayed up a while starts again from the first delay."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from services.launcher import ComponentSpec, LocalStack

DELAY = re.compile(r"^(\S+) exited with 1 after [\d.]+ s up; restarting it in ([\d.]+) s$")


def _delays(caplog: pytest.LogCaptureFixture, name: str) -> list[float]:
    """The restart delays ``LocalStack`` announced for ``name``, in order."""
    found = [DELAY.match(r.getMessage()) for r in caplog.records if r.name == "services.launcher"]
    return [float(m[2]) for m in found if m and m[1] == name]


def _wait_restarts(stack: LocalStack, name: str, count: int, timeout_s: float = 60.0) -> float:
    """Wait until ``name`` was restarted ``count`` times; returns the seconds it took."""
    started = time.monotonic()
    while stack.restarts[name] < count:
        assert time.monotonic() - started < timeout_s, stack.restarts
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
        took = _wait_restarts(stack, "dies", 5)
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
        _wait_restarts(stack, "flaky", 5)
    assert _delays(caplog, "flaky")[:5] == [0.05, 0.1, 0.15, 0.05, 0.1]
