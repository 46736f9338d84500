"""Each component's grace to stop after its SIGTERM, before its launcher SIGKILLs it: a trainer rank's is
``launcher.trainer_stop_grace_s`` (a pool finishes a checkpoint or a push in flight first; the local stack gave every
component 30 s in all, Ray's ``down`` 45 s, where Helm and compose give a trainer 120 s), the others' stay short. A
kill is logged naming the component; one that exits within its grace is not killed. The deployments give a rollout
server its stop too (compose, the chart), ``rollwave down`` stops every component at once, and a process that
outlives its SIGKILL is named, not waited for for ever. Stand-in processes, not a trainer."""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import pytest
import yaml
from ray import exceptions as ray_exceptions
from test_helm_render import find, render

from core.config import CONFIG_ACCEPTED_FD_ENV, LauncherConfig, RolloutConfig, load_config
from core.process import stop_process
from services.launcher import HAND_BACK_S, STOP_GRACE_S, ComponentSpec, LocalStack, components

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES_DEFAULT_GRACE_S = 30  # a pod spec's terminationGracePeriodSeconds when it sets none
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


def test_every_deploy_gives_the_api_the_launchers_grace() -> None:
    """The API stops in ``STOP_GRACE_S`` under every launcher: compose gave it its own default, 10 s, cutting the
    requests in flight short; the chart leaves a pod's default, 30 s."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert compose["api"]["stop_grace_period"] == f"{STOP_GRACE_S:g}s"
    api = find(render(), "Deployment", "-api")["spec"]["template"]["spec"]
    assert api.get("terminationGracePeriodSeconds", KUBERNETES_DEFAULT_GRACE_S) == STOP_GRACE_S


def test_every_deploy_gives_a_rollout_server_shutdown_grace_s_and_the_hand_back() -> None:
    """A rollout server stops in ``rollout.shutdown_grace_s`` and ``HAND_BACK_S``: compose's ``stop_grace_period`` (of
    its run config's ``shutdown_grace_s``) and the chart's pod grace by default (of the config's default, which the
    chart's runConfig keeps) are that, not their own defaults (10 s, 30 s) that killed it before its hand-back."""
    default = RolloutConfig().shutdown_grace_s + HAND_BACK_S
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    run = yaml.safe_load((DEPLOY / "config" / "run.yaml").read_text())
    grace = run["rollout"].get("shutdown_grace_s", RolloutConfig().shutdown_grace_s) + HAND_BACK_S
    servers = [name for name, service in compose.items() if "rollout_server" in service.get("command", [])]
    assert servers
    for name in servers:
        assert compose[name]["stop_grace_period"] == f"{grace:g}s", name
    rollout = find(render(), "StatefulSet", "-rollout")["spec"]["template"]["spec"]
    assert rollout["terminationGracePeriodSeconds"] == default


def test_the_chart_refuses_a_rollout_pod_grace_shorter_than_the_servers_stop() -> None:
    """The chart knows ``runConfig.rollout.shutdown_grace_s`` (the config's default without it): a pod grace short of
    it and the hand-back is refused naming both, a longer one rendered into the pod spec."""
    shutdown = RolloutConfig().shutdown_grace_s
    short = int(shutdown + HAND_BACK_S) - 1
    with pytest.raises(helm.HelmRenderError, match=rf"rollout\.terminationGracePeriodSeconds \({short}\).*"
                       rf"rollout\.shutdown_grace_s \({shutdown:g}"):
        render({"rollout": {"terminationGracePeriodSeconds": short}})
    with pytest.raises(helm.HelmRenderError, match=r"rollout\.shutdown_grace_s \(60"):
        render({"runConfig": {"rollout": {"shutdown_grace_s": 60}}})
    longer = {"runConfig": {"rollout": {"shutdown_grace_s": 60}}, "rollout": {"terminationGracePeriodSeconds": 75}}
    pod = find(render(longer), "StatefulSet", "-rollout")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 75


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


class _Unkillable:
    """A process in uninterruptible sleep, as ``subprocess.Popen`` shows it: signals are taken but it never exits
    (an unbounded wait on it would never return: here it fails the test instead)."""

    pid, args = 4_000_000, ["stuck"]

    def __init__(self) -> None:
        self.signals: list[int] = []

    def poll(self) -> None:
        return None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        assert timeout is not None, "an unbounded wait on a process that never exits"
        raise subprocess.TimeoutExpired(self.args, timeout)


def test_a_process_that_outlives_its_sigkill_is_named_not_waited_for_for_ever(
        caplog: pytest.LogCaptureFixture) -> None:
    """``stop_process`` SIGKILLs a process past its grace (the grace in the log as given, 0.2 s, not "0 s"), then
    waits ``KILL_WAIT_S`` for it to exit, and raises naming it."""
    caplog.set_level(logging.WARNING, "core.process")
    proc = _Unkillable()
    with pytest.raises(TimeoutError, match=rf"^engine-x \(pid {proc.pid}\) did not exit within .* of its SIGKILL"):
        stop_process(proc, 0.2, name="engine-x")  # type: ignore[arg-type]
    assert proc.signals == [signal.SIGTERM, signal.SIGKILL]
    assert "engine-x (pid 4000000) did not stop in 0.2 s; killing it" in caplog.messages


class _Hung:
    """An actor whose stop never returns (its worker wedged) until the test lets it."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def stop(self) -> None:
        self.released.wait()


class _Ray:
    """What ``_stop_all`` asks of Ray, over actor objects run in threads (``ComponentProcess``, run here without
    Ray): each ``stop.remote()`` starts at once, ``get`` waits for one within its timeout; the log says in what order
    stops were sent, waited for, ended, and actors killed."""

    exceptions = ray_exceptions

    def __init__(self, actors: dict[str, Any], pool: ThreadPoolExecutor) -> None:
        self.actors, self.pool, self.log = actors, pool, []

    def is_initialized(self) -> bool:
        return True

    def get_actor(self, name: str) -> Any:
        actor, log, pool = self.actors[name], self.log, self.pool

        def stop() -> Any:
            rc = actor.stop()
            log.append(("done", name))
            return rc

        def remote() -> Future:
            log.append(("sent", name))
            call = pool.submit(stop)
            call.actor = name  # type: ignore[attr-defined]
            return call
        return SimpleNamespace(name=name, stop=SimpleNamespace(remote=remote))

    def get(self, call: Future, timeout: float) -> Any:
        self.log.append(("waited", call.actor))  # type: ignore[attr-defined]
        try:
            return call.result(timeout)
        except FutureTimeout:
            raise ray_exceptions.GetTimeoutError(f"timed out after {timeout} s") from None

    def kill(self, actor: SimpleNamespace, no_restart: bool) -> None:
        self.log.append(("killed", actor.name))

    def shutdown(self) -> None:
        pass


def test_down_stops_every_component_at_once_each_within_its_bound_then_redis(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_stop_all`` sends every component's actor its stop before waiting on any (a trainer rank's SIGTERM does not
    wait for the rollout servers' stops), waits for each within its recorded grace and ``STOP_MARGIN_S`` (a hung
    actor, the API's here, is named and killed at its own bound while the others stop), kills every actor, and stops
    the Redis actor only after all of them."""
    from services import ray_launcher

    monkeypatch.setattr(ray_launcher, "STOP_MARGIN_S", 0.5)
    caplog.set_level(logging.WARNING, "services.ray_launcher")
    specs = _specs(tmp_path)
    logs = tmp_path / "logs"
    hung = _Hung()
    actors: dict[str, ray_launcher.ComponentProcess] = {}
    with ThreadPoolExecutor(4) as pool:
        try:
            for name in ("trainer-0", "rollout-0"):
                spec = dataclasses.replace(_stand_in(specs[name], "finishes"), node_overrides=())
                actors[name] = ray_launcher.ComponentProcess(spec, str(logs), start_timeout_s=60)
            fake = _Ray({ray_launcher.REDIS_ACTOR: SimpleNamespace(stop=lambda: None), **actors, "api": hung}, pool)
            monkeypatch.setattr(ray_launcher, "ray", fake)
            _armed(logs, "trainer-0", "rollout-0")
            ray_launcher._stop_all({"actors": [ray_launcher.REDIS_ACTOR, *actors, "api"],
                                    "stop_grace_s": {"trainer-0": 120, "rollout-0": 45, "api": 0}})
        finally:
            hung.released.set()
            for actor in actors.values():  # stopped already, unless the test failed first
                actor.stop(0)
    components = {"trainer-0", "rollout-0", "api"}
    first_wait = next(i for i, (event, _) in enumerate(fake.log) if event == "waited")
    assert {name for event, name in fake.log[:first_wait] if event == "sent"} == components
    redis_sent = fake.log.index(("sent", ray_launcher.REDIS_ACTOR))
    assert {name for event, name in fake.log[:redis_sent] if event == "killed"} == components
    assert {("done", "trainer-0"), ("done", "rollout-0")} <= set(fake.log[:redis_sent])
    assert ("killed", ray_launcher.REDIS_ACTOR) in fake.log
    assert [m for m in caplog.messages if "did not stop" in m] == ["api did not stop within 0.5 s; killing its actor"]
    assert {name: actor.proc.returncode for name, actor in actors.items()} == {"trainer-0": 143, "rollout-0": 143}
