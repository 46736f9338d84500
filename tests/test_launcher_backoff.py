"""The launchers' restart backoff (``RestartBackoff``, shared by ``LocalStack`` and the Ray launcher's actors): a
component that keeps dying at once is restarted after a delay that doubles each time (up to its cap), and one that
stayed up a while starts again from the first delay. One that keeps failing is given up after
``launcher.max_restarts`` restarts within ``launcher.restart_window_s``, and the stack stops."""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from services.launcher import ComponentGivenUp, ComponentSpec, LocalStack, RestartBackoff, components

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
    dies = ComponentSpec("dies", ["sh", "-c", "exit 1"], max_restarts=0)  # never given up
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


def _until(what: str, cond: Callable[[], object], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_component_that_fails_at_every_start_is_given_up_and_the_stack_stops(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With ``max_restarts=3`` (the default is 10) the fourth death in a row gives ``dies`` up: an error names it,
    its last exit code and its log, the stack stops its other component, and ``check_refused``
    (which the demo's waits call) raises naming it. It used to be restarted for as long as the run lasted."""
    caplog.set_level(logging.WARNING, "services.launcher")
    dies = ComponentSpec("dies", ["sh", "-c", "exit 3"], max_restarts=3)
    lives = ComponentSpec("lives", ["sleep", "120"])
    with LocalStack([dies, lives], tmp_path / "logs", poll_s=0.01, backoff_s=0.01, max_backoff_s=0.05) as stack:
        _until("dies given up", lambda: stack.given_up is not None)
        assert stack.procs["lives"].poll() == -signal.SIGTERM  # stopped by the stack, before close
        with pytest.raises(ComponentGivenUp, match=r"^the stack stopped: dies keeps failing") as raised:
            stack.check_refused()
    message = (f"dies keeps failing and is given up: it died 4 times within 900 s "
               f"(launcher.max_restarts=3); its last exit 3, its log {tmp_path / 'logs' / 'dies.log'}")
    assert str(raised.value) == f"the stack stopped: {message}"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [f"{message}; stopping the run"]
    assert stack.restarts == {"dies": 3, "lives": 0}


def test_a_component_that_stays_up_a_while_before_each_death_is_given_up_too(tmp_path: Path) -> None:
    """Each run of ``flaky`` stays up past ``stable_s`` before it dies, so each restart comes after the first delay,
    but its deaths within the window count all the same: with ``max_restarts=2`` the third gives it up. Counting only
    the deaths before ``stable_s`` up, it was restarted for as long as the run lasted."""
    flaky = ComponentSpec("flaky", ["sh", "-c", "sleep 0.3; exit 1"], max_restarts=2)
    with LocalStack([flaky], tmp_path / "logs", poll_s=0.01, backoff_s=0.01, max_backoff_s=1,
                    stable_s=0.2) as stack:
        _until("flaky given up", lambda: stack.given_up is not None)
        assert stack.restarts == {"flaky": 2}
        assert stack.given_up is not None and "flaky keeps failing and is given up: it died 3 times" in stack.given_up


def test_deaths_further_apart_than_the_window_are_never_given_up(tmp_path: Path) -> None:
    """A restart waits its backoff (0.05 s), so with a window of 0.02 s no two deaths fall in one window: with
    ``max_restarts=1`` the component that dies at once is restarted still."""
    dies = ComponentSpec("dies", ["sh", "-c", "exit 1"], max_restarts=1, restart_window_s=0.02)
    with LocalStack([dies], tmp_path / "logs", poll_s=0.01, backoff_s=0.05, max_backoff_s=0.05) as stack:
        _wait_restarts(lambda: stack.restarts["dies"], 3)
        assert stack.given_up is None


def test_a_ray_actor_gives_up_by_its_specs_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The Ray launcher's actor (its class, run here without Ray) gives up a component that fails at every start by
    the limit its spec carries (``max_restarts=2``), with the same error as ``LocalStack``, and restarts
    it no more; ``given_up`` says why (``rollwave up --foreground`` asks it)."""
    from services.ray_launcher import ComponentProcess

    caplog.set_level(logging.WARNING, "services.launcher")
    dies = ComponentSpec("dies", ["sh", "-c", "exit 3"], max_restarts=2)
    component = ComponentProcess(dies, str(tmp_path / "logs"), 60)  # the default backoff: 0.5 s, then 1 s
    try:
        _until("dies given up", component.given_up)
        component._watcher.join(10)
    finally:
        component.stop(10)
    message = (f"dies keeps failing and is given up: it died 3 times within 900 s "
               f"(launcher.max_restarts=2); its last exit 3, its log {tmp_path / 'logs' / 'dies.log'}")
    assert component.given_up() == message and not component._watcher.is_alive() and component.restarts() == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [f"{message}; stopping the run"]


@pytest.mark.parametrize("override", ["launcher.max_restarts=-1", "launcher.restart_window_s=0",
                                      "launcher.restart_window_s=-60"])
def test_a_negative_restart_limit_or_an_empty_window_is_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=f"{override.partition('=')[0]}:"):
        load_config(None, [override])


def test_every_component_gets_the_configured_restart_limit(tmp_path: Path) -> None:
    """``launcher.*`` reach each spec ``components`` makes, and so ``LocalStack`` and the Ray actors; by default the
    specs carry the config's defaults."""
    cfg = load_config(None, ["launcher.max_restarts=3", "launcher.restart_window_s=60"])
    specs = components(cfg, tmp_path / "config.yaml", None, rollout_servers=2)
    assert [(s.name, s.max_restarts, s.restart_window_s) for s in specs] == [
        ("trainer-0", 3, 60), ("rollout-0", 3, 60), ("rollout-1", 3, 60), ("api", 3, 60)]
    default, spec = load_config(None).launcher, ComponentSpec("x", [])
    assert (default.max_restarts, default.restart_window_s) == (spec.max_restarts, spec.restart_window_s) == (10, 900)
