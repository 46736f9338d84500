"""``rollwave up`` / ``rollwave down`` on a real local Ray, inside a network namespace with only loopback.

``tests/ray_stack_script.py`` runs in the namespace (``unshare -n``, then ``lo`` up): it brings the
stack up with one rollout server and one trainer rank, runs an eval and a train job through the API,
checks that the trainer's push went over the mutual TLS that ``up`` set up (a plaintext channel is
refused), SIGKILLs the rollout server's process and waits for its actor to restart it, then runs ``rollwave down``;
then it brings up a run whose rollout server refuses its config. The test checks what the script reports: jobs
done, a trainer step, the server back under a new process, every socket on loopback, nothing left running or
listening after ``down``, and the refusal named by ``up`` and not restarted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel

from core.config import load_config
from services.ray_launcher import absolute_paths

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.", "0:0:0:0:0:0:0:1")


def _config(tmp_path: Path, model: Path) -> Path:
    token_file = tmp_path / "api-token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    cfg = {
        "run": {"name": "raytest", "dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "init_if_missing": False},
        "api": {"port": 8000, "token_file": str(token_file)},
        "rollout": {"n_samples": 2, "max_new_tokens": 16, "max_turns": 2, "heartbeat_s": 0.5,
                    "shutdown_grace_s": 5},
        "buffer": {"claim_idle_ms": 2000, "groups_per_step": 2},
        # more steps than the job feeds: the trainer stays up (waiting for data) until `rollwave down`
        "trainer": {"total_steps": 1000, "device": "cpu", "checkpoint_every": 1},
        "checkpoint": {"stage_dir": str(tmp_path / "stage")},
        "redis": {"appendfsync": "always"},  # the Redis actor is started with it
    }
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _kill_leftovers(run_dir: Path) -> None:
    """If the script died before ``down``, end the Ray head it started (its process group) by pid."""
    state = run_dir / "ray.json"
    if state.exists():
        head = json.loads(state.read_text()).get("head_pid")
        if head:
            try:
                os.killpg(head, signal.SIGKILL)
            except ProcessLookupError:
                pass


# The Ray tests' network namespace: loopback, and a host's interface (a routable address and a default route) on a
# veth pair whose both ends are in the namespace, so nothing leaves it. On a host Ray takes that address for a node
# asked to be 127.0.0.1 (``resolve_ip_for_localhost``); with loopback alone the tests could not see it.
ISOLATED_NET = ("ip link set lo up && ip link add rw0 type veth peer name rw1 && ip addr add 192.0.2.77/24 dev rw0 "
                "&& ip link set rw0 up && ip link set rw1 up && ip route add default dev rw0")


@pytest.mark.ray
@pytest.mark.slow
def test_up_jobs_restart_down_in_a_loopback_namespace(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir)
    script = f"{ISOLATED_NET} && exec {sys.executable} {ROOT / 'tests/ray_stack_script.py'} {config}"
    try:
        proc = subprocess.run(["unshare", "-n", "bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                              timeout=400)
    finally:
        for run in ("raytest", "raytest-refused"):
            _kill_leftovers(tmp_path / "runs" / run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.dumps(result, indent=1)[-8000:]
    assert result["up"]["rc"] == 0 and "error" not in result, report
    assert "API http://127.0.0.1:8000;" in result["up"]["out"], report  # the address the API published
    assert result["submitted"] == [201, 201], report
    assert result["redis_appendfsync"] == "always", report
    assert result["eval"]["accuracy"] is not None and result["eval"]["progress"]["completed"] == 4, report
    assert int(result["trainer"]["step"]) >= 1, report
    # the trainer rank in a group of its own on one node, the rollout server and the API packed; one node here
    groups = result["placement"]["groups"]
    assert {k: (g["strategy"], [b["CPU"] for b in g["bundles"]]) for k, g in groups.items()} == {
        "one-node": ("STRICT_PACK", [1.0]), "packed": ("PACK", [1.0, 0.5])}, report
    assert {n for g in groups.values() for n in g["nodes"]} == {result["placement"]["driver_node"]}, report
    # no checkpoint.tls_* in the config: up made the run's PKI, and the version was pushed over it
    keys = dict.fromkeys(["ca.crt", "receiver.crt", "receiver.key", "trainer.crt", "trainer.key"], "0o600")
    assert result["checkpoint_plane"] == {"published": True, "plaintext_accepted": False, "files": keys}, report
    # secrets: each component gets only its own, in its environment; none is on a command line or in config.yaml
    assert result["secrets"] == {"trainer_env": ["ROLLWAVE_CHECKPOINT_TOKEN"], "api_env": ["ROLLWAVE_API_TOKEN"],
                                 "api_has_its_token": True, "in_argv": [], "in_config_yaml": []}, report
    # the local head requires the token made for it: a driver without it is refused
    assert result["ray_without_token"] == "refused ConnectionError (InvalidAuthToken)", report
    restart = result["restart"]
    assert restart["new_pid"] != restart["old_pid"] and restart["started"][1] > restart["started"][0], report
    assert restart["old_left"] == [], report
    # Everything listens on loopback. A pool of one trainer rank has no rendezvous: no c10d TCPStore, which
    # would bind the wildcard address on MASTER_PORT (torch has no option to bind it to one address).
    assert result["trainer_env"] == {"WORLD_SIZE": "1", "MASTER_PORT": None}, report
    assert result["listening_up"], report
    assert [s for s in result["listening_up"] if not s["addr"].startswith(LOOPBACK)] == [], report
    assert result["down"]["rc"] == 0, report
    assert result["left_after_down"] == [] and result["listening_after_down"] == [], report
    assert not result["state_file_left"], report
    # a rollout server that refuses its config: `up` names it and fails, Ray leaves it stopped, `down` stops the rest
    refused = result["refused"]
    assert refused["up"]["rc"] == 2, report
    assert "rollout-0 refused its config (exit 2; the reason is the last line of " in refused["up"]["out"], report
    assert "`rollwave down -c " in refused["up"]["out"] and " run.name=raytest-refused " in refused["up"]["out"], report
    assert refused["refusals_logged"] == 1, report
    assert refused["down"]["rc"] == 0 and refused["left_after_down"] == [], report


def test_up_makes_the_run_a_checkpoint_pki_unless_tls_is_configured(tmp_path: Path) -> None:
    """With no ``checkpoint.tls_*``, ``up``'s config has the receivers' certificate and the trainers' overrides
    theirs, and the two complete a handshake; run again, the run keeps its CA. A configured TLS is left alone."""
    from tls_handshake import handshakes

    from core.config import load_config
    from services.ray_launcher import _checkpoint_tls

    cfg = load_config(None)
    overrides = _checkpoint_tls(cfg, tmp_path)
    receiver = cfg.checkpoint
    assert receiver.tls_cert == tmp_path / "checkpoint-tls" / "receiver.crt"
    trainer = load_config(None, [*overrides, *(f"checkpoint.{k}={getattr(receiver, k)}"
                                              for k in ("tls_ca", "tls_server_name"))]).checkpoint
    assert trainer.tls_cert == tmp_path / "checkpoint-tls" / "trainer.crt"
    assert handshakes(receiver, trainer)
    ca = receiver.tls_ca.read_bytes()
    again = load_config(None)
    assert _checkpoint_tls(again, tmp_path) == overrides and again.checkpoint.tls_ca.read_bytes() == ca
    assert _checkpoint_tls(cfg, tmp_path / "other") == () and cfg.checkpoint == receiver
    assert not (tmp_path / "other").exists()


def without_ray(spec: Any, log_dir: Path, start_timeout_s: float = 60.0, backoff: Any = None) -> Any:
    """``ComponentProcess``, the class of the Ray actor, run here without Ray (it restarts its process itself)."""
    from services.ray_launcher import ComponentProcess

    return ComponentProcess(spec, str(log_dir), start_timeout_s, backoff)


def _until(what: str, cond: Callable[[], object], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_actor_leaves_a_config_refusal_stopped_and_restarts_a_crash(tmp_path: Path) -> None:
    """The actor restarts a component that crashed, not one that refused its config (exit 2), which would only
    come again, for ever. Its constructor returns once the component exited."""
    from core.config import CONFIG_ERROR_EXIT
    from services.launcher import ComponentSpec, RestartBackoff

    refuses = without_ray(ComponentSpec("refuses", [sys.executable, "-c", "import sys; print('error: x.y is bad'); "
                                                f"sys.exit({CONFIG_ERROR_EXIT})"]), tmp_path)
    assert refuses.returncode() == CONFIG_ERROR_EXIT
    assert (tmp_path / "refuses.log").read_text().strip() == "error: x.y is bad"
    crashes = without_ray(ComponentSpec("crashes", ["sh", "-c", "exit 1"]), tmp_path,
                          backoff=RestartBackoff("crashes", 0.05, 0.05))
    try:
        _until("crashes restarted", lambda: crashes.restarts() >= 2)
    finally:
        crashes.stop(10)
    assert refuses.restarts() == 0 and (tmp_path / "refuses.log").read_text().count("x.y is bad") == 1


def test_an_actor_stopped_while_its_component_waits_out_its_backoff_starts_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``stop`` cuts the backoff short, and returns once the restart is called off: nothing starts after it."""
    from services.launcher import ComponentSpec, RestartBackoff

    caplog.set_level(logging.WARNING, "services.launcher")
    component = without_ray(ComponentSpec("dies", ["sh", "-c", "echo up; exit 1"]), tmp_path,
                            backoff=RestartBackoff("dies", 60, 60))
    try:
        _until("the restart delay logged", lambda: any(r.getMessage().endswith("restarting it in 60 s")
                                                       for r in caplog.records))
    finally:
        rc = component.stop(10)
    assert rc == 1 and not component._watcher.is_alive() and component.restarts() == 0
    assert (tmp_path / "dies.log").read_text().split() == ["up"]


def test_an_actor_retries_a_restart_it_could_not_make(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A component whose program is gone when its restart is due: the actor logs it and tries again after the next
    delay, and the program back, restarts it."""
    from services.launcher import ComponentSpec, RestartBackoff

    caplog.set_level(logging.ERROR, "services.launcher")
    program = tmp_path / "program"
    program.write_text('#!/bin/sh\nrm -f "$0"\nexit 1\n')  # it removes itself, then fails
    program.chmod(0o755)
    component = without_ray(ComponentSpec("gone", [str(program)]), tmp_path / "logs",
                            backoff=RestartBackoff("gone", 0.05, 0.2))
    try:
        _until("the failed restart logged", lambda: any(r.getMessage().startswith(
            f"gone could not be restarted ([Errno 2] No such file or directory: '{program}'); trying again in")
            for r in caplog.records))
        back = tmp_path / "program.new"
        back.write_text("#!/bin/sh\nexec sleep 120\n")
        back.chmod(0o755)
        back.rename(program)  # whole, at once: an exec never sees it half written
        _until("gone restarted once its program was back", lambda: component.restarts() == 1)
        assert component.returncode() is None
    finally:
        component.stop(10)
    assert component.returncode() == -15  # stopped by its SIGTERM


def test_an_actor_starts_once_its_component_accepted_its_config(tmp_path: Path) -> None:
    """``load_config_or_exit`` tells the actor, which returns from its constructor while the component runs (so
    ``up`` waits no longer than every component's config check); the component's children do not inherit the pipe."""
    from services.launcher import ComponentSpec

    accepts = ("import os, time; from core.config import CONFIG_ACCEPTED_FD_ENV, load_config_or_exit; "
               "fd = int(os.environ[CONFIG_ACCEPTED_FD_ENV]); load_config_or_exit(None); "
               "print('after', CONFIG_ACCEPTED_FD_ENV in os.environ, os.path.exists(f'/proc/self/fd/{fd}'), "
               "flush=True); time.sleep(120)")
    spec = ComponentSpec("accepts", [sys.executable, "-c", accepts], {"PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    component = without_ray(spec, tmp_path, start_timeout_s=60)
    try:
        assert time.monotonic() - started < 30 and component.returncode() is None
        deadline = time.monotonic() + 30
        while "after" not in (log := (tmp_path / "accepts.log").read_text()):
            assert time.monotonic() < deadline, log
            time.sleep(0.05)
        assert log.split() == ["after", "False", "False"], log  # neither the variable nor the pipe is left
        assert component.config_checked()
    finally:
        component.stop(10)
    assert component.restarts() == 0


def test_an_actor_whose_component_says_nothing_returns_by_its_timeout_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A component that neither passes its config check nor exits in time: the constructor returns after its
    timeout, naming the component and its log, and reports it unchecked, so ``up`` does not count it as started.
    The component, left running, passes its check later and goes on (its word to the closed pipe is dropped: it
    used to die of the broken pipe and be restarted, to be waited for again)."""
    from services.launcher import ComponentSpec

    late = ("import time; time.sleep(3); from core.config import load_config_or_exit; load_config_or_exit(None); "
            "print('checked', flush=True); time.sleep(120)")
    spec = ComponentSpec("late", [sys.executable, "-c", late], {"PYTHONPATH": str(ROOT)})
    component = without_ray(spec, tmp_path, start_timeout_s=1)
    try:
        assert component.returncode() is None and not component.config_checked()
        deadline = time.monotonic() + 60
        while "checked" not in (log := (tmp_path / "late.log").read_text()):
            assert time.monotonic() < deadline and component.returncode() is None, log
            time.sleep(0.05)
        time.sleep(0.5)
        assert component.returncode() is None and component.restarts() == 0, log
    finally:
        component.stop(10)
    assert f"late: no word from its config check within 1 s (see {tmp_path / 'late.log'})" in capsys.readouterr().err


@contextlib.contextmanager
def two_node_cluster(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two Ray nodes, each in a network namespace of its own (10.77.0.1, the head, and 10.77.0.2, two CPUs each)
    joined by a veth pair, with no other network; yields the head's namespace and address. Everything started
    here is stopped, and the namespaces deleted, on the way out."""
    suffix = str(os.getpid())
    names = [f"rwa{suffix}", f"rwb{suffix}"]  # namespace and veth end of each node
    ips = ["10.77.0.1", "10.77.0.2"]
    temp_dir = tempfile.mkdtemp(prefix="rwray-")  # short: Ray's socket paths must stay under 108 bytes
    # a home of their own: a ~/.ray/auth_token (a local ray.init writes one) turns token auth on for the head only
    env = {**os.environ, "HOME": str(tmp_path)}
    nodes: list[subprocess.Popen] = []
    try:
        subprocess.run(["ip", "link", "add", names[0], "type", "veth", "peer", "name", names[1]], check=True)
        for name, ip in zip(names, ips, strict=True):
            subprocess.run(["ip", "netns", "add", name], check=True)
            subprocess.run(["ip", "link", "set", name, "netns", name], check=True)
            for cmd in (["addr", "add", f"{ip}/24", "dev", name], ["link", "set", name, "up"],
                        ["link", "set", "lo", "up"]):
                subprocess.run(["ip", "-n", name, *cmd], check=True)
        ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus=2", "--disable-usage-stats"]
        roles = [["--head", "--port=6380", "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                 [f"--address={ips[0]}:6380"]]
        for name, ip, role in zip(names, ips, roles, strict=True):
            log = tmp_path / f"ray-{ip}.log"
            with open(log, "wb") as out:
                nodes.append(subprocess.Popen(["ip", "netns", "exec", name, *ray, *role, f"--node-ip-address={ip}"],
                                              stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            deadline = time.monotonic() + 120
            while "Ray runtime started" not in log.read_text(errors="replace"):
                assert nodes[-1].poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(0.5)
        yield names[0], f"{ips[0]}:6380"
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(30)
        for name in names:
            left = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in left:  # a Ray process that outlived its node's `ray start`
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_up_spreads_the_stack_over_two_nodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """On a cluster of two nodes that reach each other only by their addresses, the stack does not fit one node
    (Redis 1 CPU on the driver's, the trainer 1, the rollout server 1, the API 0.5; two CPUs a node), so it spans
    both: the receiver and the API listen on their node's address, the embedded Redis on the head's with a
    password made for the run, and jobs, a trainer step and a push go across."""
    config = _config(tmp_path, tiny_model_dir)
    with two_node_cluster(tmp_path) as (namespace, address):
        script = [sys.executable, str(ROOT / "tests/ray_stack_script.py"), "--two-nodes", str(config)]
        proc = subprocess.run(["ip", "netns", "exec", namespace, *script], cwd=ROOT,
                              env={**os.environ, "RAY_ADDRESS": address}, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.dumps(result, indent=1)[-8000:]
    assert result["up"]["rc"] == 0 and "error" not in result, report
    assert result["submitted"] == [201, 201] and result["eval"]["progress"]["completed"] == 4, report
    assert int(result["trainer"]["step"]) >= 1, report
    addresses = result["addresses"]
    assert addresses["redis"].startswith("redis://10.77.0.1:"), report
    assert urlsplit(addresses["api"]).hostname in ("10.77.0.1", "10.77.0.2"), report
    assert addresses["receiver"].rpartition(":")[0] in ("10.77.0.1", "10.77.0.2"), report
    groups = result["placement"]["groups"]
    assert groups["one-node"]["strategy"] == "STRICT_PACK" and groups["packed"]["strategy"] == "PACK", report
    nodes = {result["placement"]["driver_node"], *groups["one-node"]["nodes"], *groups["packed"]["nodes"]}
    assert len(nodes) == 2, report
    assert result["down"]["rc"] == 0, report


@contextlib.contextmanager
def loopback_namespace() -> Iterator[tuple[list[str], str]]:
    """A network namespace set up as ``ISOLATED_NET``, held by a sleeping process; yields the prefix that runs a
    command in it (``nsenter`` execs the command: the pid it is started under is the command's) and the namespace's
    id."""
    holder = subprocess.Popen(["unshare", "-n", "bash", "-c", f"{ISOLATED_NET} && echo up && exec sleep 900"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        yield ["nsenter", "-t", str(holder.pid), "-n"], os.readlink(f"/proc/{holder.pid}/ns/net")
    finally:
        holder.kill()
        holder.wait()


def _heads_in(netns: str) -> set[int]:
    """The Ray heads (``ray start``) running in the network namespace ``netns``. A head's child between its fork and
    its exec (the head starting the GCS or a raylet) still shows the head's command line: it is not another head."""
    found: dict[int, int] = {}  # pid: parent pid
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (os.readlink(f"/proc/{pid}/ns/net") == netns
                    and b"ray.scripts.scripts\0start" in Path(f"/proc/{pid}/cmdline").read_bytes()):
                stat = Path(f"/proc/{pid}/stat").read_text()
                found[int(pid)] = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "(comm) state"
        except (FileNotFoundError, ProcessLookupError, PermissionError):  # gone, or not ours
            continue
    return {pid for pid, parent in found.items() if parent not in found}


def _recorded(state: Path, key: str, up: subprocess.Popen, log: Path) -> dict[str, Any]:
    """Wait for ``up`` to record ``key`` (``head_pid``: the head it started; ``launched``) in ``ray.json``; returns
    the record."""
    deadline = time.monotonic() + 120
    while not (state.exists() and (record := json.loads(state.read_text())).get(key)):
        assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    return record


def _gone(head: dict[str, Any]) -> list[str]:
    """What is left of a head: its processes (its group, or anything with its temp dir in the command line) and
    its temp dir."""
    from ray_stack_script import alive_in

    return alive_in({head["head_pid"]}, head["temp_dir"]) + [head["temp_dir"]] * Path(head["temp_dir"]).exists()


@pytest.mark.ray
@pytest.mark.slow
def test_up_claims_its_run_and_leaves_no_head_that_down_cannot_stop(
    tmp_path: Path, tiny_model_dir: Path, ctrl_c_raises: None
) -> None:
    """On a real local Ray head, in a loopback-only namespace: ``up`` records the head in ``ray.json`` as soon as it
    starts it; a second ``up`` of the run meanwhile fails at once naming the first and starts nothing; Ctrl-C while
    the head starts stops it; an ``up`` SIGKILLed there leaves a head that the next ``up`` names (and refuses to
    start beside) and ``down`` stops; Ctrl-C once the run is launched (``up`` waiting for the config checks) says
    what it leaves running and how to stop it."""
    config = str(_config(tmp_path, tiny_model_dir))
    run_dir = tmp_path / "runs" / "raytest"
    state, down_cmd = run_dir / "ray.json", f"`rollwave down -c {config}`"
    heads: list[dict[str, Any]] = []
    procs: list[subprocess.Popen] = []
    with loopback_namespace() as (ns, netns):
        def rollwave(*args: str, log: Path | None = None) -> subprocess.Popen:
            with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
                procs.append(subprocess.Popen([*ns, sys.executable, "-m", "services.cli", *args, "-c", config],
                                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                              env={**os.environ, "ROLLWAVE_DEBUG": "1"}))  # with a traceback
            return procs[-1]

        def finished(*args: str) -> tuple[int, str]:
            proc = rollwave(*args)
            out = proc.communicate(timeout=180)[0]
            return proc.returncode, out

        try:
            first = rollwave("up", log=tmp_path / "first.log")
            heads.append(head := _recorded(state, "head_pid", first, tmp_path / "first.log"))
            os.kill(first.pid, signal.SIGSTOP)  # holding the run, the head still starting
            rc, out = finished("up")
            assert rc == 1 and f"{run_dir}: `rollwave up` (pid {first.pid}) is starting or stopping" in out, out
            assert _heads_in(netns) == {head["head_pid"]}, out  # the second started nothing
            os.kill(first.pid, signal.SIGINT)  # delivered as it goes on, in start_head's wait
            os.kill(first.pid, signal.SIGCONT)
            assert first.wait(120) == 130, (tmp_path / "first.log").read_text()[-3000:]
            assert _gone(head) == [] and _heads_in(netns) == set() and not state.exists()

            killed = rollwave("up", log=tmp_path / "killed.log")
            heads.append(head := _recorded(state, "head_pid", killed, tmp_path / "killed.log"))
            killed.kill()
            killed.wait()
            rc, out = finished("up")
            assert rc == 2 and f"(pid {killed.pid}) ended mid-launch" in out, out
            assert f"the Ray head (pid {head['head_pid']}, {head['temp_dir']}); stop it with {down_cmd}" in out, out
            assert _heads_in(netns) == {head["head_pid"]}, out
            rc, out = finished("down")
            assert rc == 0 and f"stopped the Ray head (pid {head['head_pid']}" in out, out
            assert _gone(head) == [] and _heads_in(netns) == set() and not state.exists()

            launched = rollwave("up", log=tmp_path / "launched.log")
            heads.append(head := _recorded(state, "launched", launched, tmp_path / "launched.log"))
            os.kill(launched.pid, signal.SIGINT)
            assert launched.wait(120) == 130
            out = (tmp_path / "launched.log").read_text()
            assert (f"error: interrupted; left running: redis, trainer-0, rollout-0, api, the Ray head (pid "
                    f"{head['head_pid']}, {head['temp_dir']}) (run raytest, {state}); {down_cmd} stops it") in out, out
            assert _heads_in(netns) == {head["head_pid"]}
            rc, out = finished("down")
            assert rc == 0 and _gone(head) == [] and _heads_in(netns) == set() and not state.exists(), out
        finally:
            for proc in procs:  # one left stopped (SIGSTOP) by a failed assertion too
                proc.kill()
                proc.wait()
            for head in heads:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(head["head_pid"], signal.SIGKILL)
                shutil.rmtree(head["temp_dir"], ignore_errors=True)


class _InterruptedFinalizer:
    """Ctrl-C arriving while Python runs a finalizer, as a collected redis-py pool's ``__del__``: the
    KeyboardInterrupt is printed ("Exception ignored in") and dropped."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the finalizers' dropped ones
def test_a_ctrl_c_that_a_finalizer_swallowed_still_stops_up(ctrl_c_raises: None) -> None:
    """``up`` remembers a Ctrl-C (``_ctrl_c_remembered``) and raises one a finalizer swallowed where it would report a
    clean start or stay (an interrupted ``up`` exited 0 as started); outside it, and where SIGINT is ignored (a
    background job), nothing changes."""
    from services.ray_launcher import _ctrl_c_remembered, _raise_if_pressed

    _InterruptedFinalizer()  # dropped: the plain default handler loses it
    with _ctrl_c_remembered() as pressed:
        _InterruptedFinalizer()
        with pytest.raises(KeyboardInterrupt):
            _raise_if_pressed(pressed)
        with pytest.raises(KeyboardInterrupt):  # raised in place, as by default, where no finalizer runs
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with _ctrl_c_remembered() as pressed:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        _raise_if_pressed(pressed)
    assert not pressed.is_set()


def test_a_run_held_by_an_up_refuses_a_second_up_or_down_and_a_dead_ones_record_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without Ray: another process holding the run's lock and ``ray.json`` as ``up`` does while it launches makes
    ``up`` and ``down`` of the run fail at once (exit 1) naming the run dir and the holder, touching nothing. SIGKILLed,
    it holds nothing (the kernel drops an ``flock``), and its ``ray.json`` (``launched`` false) makes the next ``up``
    name it and the ``down`` to run, which clears it."""
    from services.cli import main

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # what the CLI sets for a local head, undone after the test
    config = str(_config(tmp_path, tmp_path / "model"))
    run_dir = tmp_path / "runs" / "raytest"
    run_dir.mkdir(parents=True)
    state = run_dir / "ray.json"
    holds = ("import os, sys, time; from pathlib import Path\n"
             "from services.ray_launcher import _run_lock, _write_state\n"
             "with _run_lock(Path(sys.argv[1]), 'up'):\n"
             "    _write_state(Path(sys.argv[1]) / 'ray.json', {'namespace': 'rollwave-raytest', 'actors': [], "
             "'placement_groups': [], 'up_pid': os.getpid(), 'launched': False})\n"
             "    print('held', flush=True)\n    time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", holds, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        record = state.read_text()
        for command in ("up", "down"):
            started = time.monotonic()
            assert main([command, "-c", config]) == 1
            err = capsys.readouterr().err
            assert f"{run_dir}: `rollwave up` (pid {holder.pid}) is starting or stopping this run" in err, err
            assert time.monotonic() - started < 10 and state.read_text() == record
            assert sorted(p.name for p in run_dir.iterdir()) == ["ray.json", "ray.lock"]  # nothing started
    finally:
        holder.kill()
        holder.wait()
    assert main(["up", "-c", config]) == 2
    err = capsys.readouterr().err
    assert (f"{state}: the `rollwave up` that started this run (pid {holder.pid}) ended mid-launch, leaving what it "
            f"had started: nothing; stop it with `rollwave down -c {config}` first") in err, err
    assert main(["down", "-c", config]) == 0 and not state.exists()
    assert capsys.readouterr().out == "rollwave down: stopped nothing\n"


def test_every_path_of_the_config_is_pinned_for_the_ray_workers(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Components run in Ray workers, whose working directory is not the caller's: every path key of the config,
    in every section, is made absolute against the caller's (a list kept by hand missed redis.password_file,
    trainer.critic.path and checkpoint.stage_dir, which a worker then looked for under its own directory)."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [], env={})

    def paths(section: BaseModel, where: str = "") -> Iterator[tuple[BaseModel, str, str]]:
        for name, field in type(section).model_fields.items():
            if Path in (field.annotation, *get_args(field.annotation)):
                yield section, name, where + name
            elif isinstance(value := getattr(section, name), BaseModel):
                yield from paths(value, f"{where}{name}.")

    for section, name, key in paths(cfg):
        section.__dict__[name] = Path("relative", key)  # as a config file or override gives it, unchecked here
    absolute_paths(cfg)
    pinned = {key: getattr(section, name) for section, name, key in paths(cfg)}
    assert {"redis.password_file", "trainer.critic.path", "checkpoint.stage_dir", "model.path"} <= pinned.keys()
    assert pinned == {key: tmp_path / "relative" / key for key in pinned}
