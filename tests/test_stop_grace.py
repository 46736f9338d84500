"""Each component's grace to stop after its SIGTERM, before its launcher SIGKILLs it: a trainer rank's is
``launcher.trainer_stop_grace_s`` (a pool finishes a checkpoint or a push in flight first; the local stack gave every
component 30 s in all, Ray's ``down`` 45 s, where Helm and compose give a trainer 120 s), the others' stay short. A
kill is logged naming the component; one that exits within its grace is not killed. Stand-in processes, not a
trainer."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import pytest
import yaml

from core.config import CONFIG_ACCEPTED_FD_ENV, LauncherConfig, load_config
from services.launcher import HAND_BACK_S, STOP_GRACE_S, ComponentSpec, LocalStack, components

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# ignores SIGTERM (hung), or takes a moment to finish (a checkpoint in flight) and exits 143; says when it is armed,
# after telling a waiting launcher (``ComponentProcess``) its config passed
STAND_IN = f"""
import os, signal, sys, time
if sys.argv[1] == "ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def finish(*_):
        time.sleep(1)
        print("finished", flush=True)
        sys.exit(143)
    signal.signal(signal.SIGTERM, finish)
if "{CONFIG_ACCEPTED_FD_ENV}" in os.environ:
    os.write(int(os.environ["{CONFIG_ACCEPTED_FD_ENV}"]), b"1")
print("armed", flush=True)
time.sleep(120)
"""


def _specs(tmp_path: Path, *overrides: str) -> dict[str, ComponentSpec]:
    cfg = load_config(None, list(overrides), env={})
    return {s.name: s for s in components(cfg, tmp_path / "config.yaml", None, rollout_servers=1, trainer_ranks=2)}


def _stand_in(spec: ComponentSpec, behaviour: str) -> ComponentSpec:
    return dataclasses.replace(spec, argv=[sys.executable, "-c", STAND_IN, behaviour], env={})


def _armed(log_dir: Path, *names: str) -> None:
    deadline = time.monotonic() + 60
    for name in names:
        log = log_dir / f"{name}.log"
        while "armed" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, f"{name} never armed its SIGTERM handler"
            time.sleep(0.02)


def _killed(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The components whose SIGKILL past their grace was logged, by the name the log gives them."""
    return [r.args[0] for r in caplog.records if r.name == "core.process" and "killing it" in r.getMessage()]


def test_the_trainer_ranks_grace_is_launcher_trainer_stop_grace_s_and_the_others_stay_short(tmp_path: Path) -> None:
    graces = {name: spec.stop_grace_s for name, spec in _specs(tmp_path, "launcher.trainer_stop_grace_s=7",
                                                              "rollout.shutdown_grace_s=4").items()}
    assert graces == {"trainer-0": 7, "trainer-1": 7, "rollout-0": 4 + HAND_BACK_S, "api": STOP_GRACE_S}
    assert _specs(tmp_path)["trainer-0"].stop_grace_s == 120  # as the chart's and compose's


def test_every_launcher_gives_a_trainer_the_same_grace_by_default() -> None:
    """The chart's pod grace, compose's and the launchers' are one number, kept alike by hand (the chart and compose
    do not read the run config); torchrun waits 10 s less for its ranks, so it ends first."""
    grace = LauncherConfig().trainer_stop_grace_s
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    values = yaml.safe_load((DEPLOY / "helm" / "rollwave" / "values.yaml").read_text())
    assert values["trainer"]["terminationGracePeriodSeconds"] == grace
    for name in ("trainer", "trainer-gpu"):
        assert compose[name]["stop_grace_period"] == f"{grace:g}s", name
    assert compose["trainer-gpu"]["environment"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == f"{grace - 10:g}"


def test_local_stack_kills_a_component_past_its_grace_naming_it_and_not_one_that_stops_within(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``launcher.trainer_stop_grace_s=0.5``: a trainer rank that ignores SIGTERM, and one that takes a second to
    finish, are SIGKILLed past it, each kill logged naming the rank; a rollout server that takes as long, within its
    own grace, exits on its own."""
    caplog.set_level(logging.WARNING, "core.process")
    specs = _specs(tmp_path, "launcher.trainer_stop_grace_s=0.5")
    stand_ins = [_stand_in(specs["trainer-0"], "ignores"), _stand_in(specs["trainer-1"], "finishes"),
                 _stand_in(specs["rollout-0"], "finishes")]
    logs = tmp_path / "logs"
    stack = LocalStack(stand_ins, logs, poll_s=0.05).start()
    try:
        _armed(logs, "trainer-0", "trainer-1", "rollout-0")
    finally:
        stack.close()
    assert sorted(_killed(caplog)) == ["trainer-0", "trainer-1"]
    assert {name: proc.returncode for name, proc in stack.procs.items()} == {
        "trainer-0": -9, "trainer-1": -9, "rollout-0": 143}
    assert "finished" in (logs / "rollout-0.log").read_text()


@pytest.mark.parametrize(("grace", "rc"), [("0.5", -9), ("60", 143)])
def test_a_ray_actor_gives_its_trainer_launcher_trainer_stop_grace_s(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, grace: str, rc: int) -> None:
    """``ComponentProcess`` (the Ray actor's class, run here without Ray) gives its component the grace its spec
    carries, unless ``stop`` is given another (``down`` and a peer's give-up give none): a trainer rank that takes a
    second to finish is killed past a grace of 0.5 s, named in the log, and exits on its own within 60 s."""
    from services.ray_launcher import ComponentProcess

    caplog.set_level(logging.WARNING, "core.process")
    spec = _stand_in(_specs(tmp_path, f"launcher.trainer_stop_grace_s={grace}")["trainer-0"], "finishes")
    component = ComponentProcess(spec, str(tmp_path / "logs"), start_timeout_s=60)
    try:
        _armed(tmp_path / "logs", "trainer-0")
    finally:
        stopped = component.stop()
    assert stopped == rc
    assert _killed(caplog) == (["trainer-0"] if rc == -9 else [])
