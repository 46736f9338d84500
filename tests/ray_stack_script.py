"""``rollwave up`` -> jobs and a push over mutual TLS -> a killed rollout server comes back -> ``rollwave down``,
on a real local Ray; then ``up`` of a run whose rollout server refuses its config, and ``down``.

Run by ``tests/test_ray_launcher.py`` inside a network namespace that has only loopback, as
``python tests/ray_stack_script.py CONFIG``. It always runs ``rollwave down``, then prints one JSON
object (the last line of stdout) that the test asserts on; it asserts nothing itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis

from core.config import Config, load_config
from services.cli import LOOPBACK_RAY_ENV
from services.launcher import SECRET_VARS

ROOT = Path(__file__).resolve().parents[1]

TCP_LISTEN = "0A"
REFUSED_WATCH_S = 15.0  # longer than a restarted rollout server takes to refuse its config again


def rollwave(*args: str, timeout_s: float = 240.0) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    return {"rc": proc.returncode, "out": (proc.stdout + proc.stderr)[-3000:]}


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float) -> Any:
    """Poll ``probe`` until it returns something truthy; raise naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (httpx.HTTPError, KeyError, IndexError) as exc:
            last = repr(exc)
        else:
            if last:
                return last
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not reached in {timeout_s:.0f} s (last: {last!r})")


def _hex_address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} local address (little-endian words) -> printable IP."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in words[12:])
    return ":".join(words[i : i + 2].hex() for i in range(0, 16, 2))


def _socket_owners() -> dict[str, str]:
    owners: dict[str, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owners[target[8:-1]] = f"{pid} {cmd}"
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return owners


def listening() -> list[dict[str, Any]]:
    """Every listening TCP socket of this network namespace, with the process that holds it."""
    owners = _socket_owners()
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != TCP_LISTEN:
                continue
            addr, port = fields[1].split(":")
            out.append({"addr": _hex_address(addr), "port": int(port, 16), "owner": owners.get(fields[9], "?")})
    return out


def alive_in(pgids: set[int], needle: str) -> list[str]:
    """Live processes in one of ``pgids`` or with ``needle`` in their command line (zombies excluded)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if stat[0] != "Z" and (int(stat[2]) in pgids or (needle and needle in cmd)):
            found.append(f"{pid} {cmd[:150]}")
    return found


def _environ(pid: int) -> dict[str, str]:
    return dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if v)


def _secrets_report(cfg: Config, trainer_env: dict[str, str], api_env: dict[str, str]) -> dict[str, Any]:
    """Which component got which secret in its environment, and where the secrets' values show up that they
    must not: any process's command line, the run's config.yaml."""
    api_token = cfg.api.token.get_secret_value() if cfg.api.token else ""
    checkpoint_token = trainer_env.get("ROLLWAVE_CHECKPOINT_TOKEN", "")
    cmdlines = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdlines.append(path.read_bytes())
        except (FileNotFoundError, ProcessLookupError):
            continue
    dumped = (cfg.run.path / "config.yaml").read_text()
    return {
        "trainer_env": sorted(k for k in trainer_env if k in SECRET_VARS),
        "api_env": sorted(k for k in api_env if k in SECRET_VARS),
        "api_has_its_token": api_env.get("ROLLWAVE_API_TOKEN") == api_token != "",
        "in_argv": [name for name, value in (("api", api_token), ("checkpoint", checkpoint_token))
                    if not value or any(value.encode() in c for c in cmdlines)],
        "in_config_yaml": [name for name, value in (("api", api_token), ("checkpoint", checkpoint_token))
                           if not value or value in dumped],
    }


def _checkpoint_plane(cfg: Config, api: httpx.Client, server: dict[str, Any]) -> dict[str, Any]:
    """A version pushed and published, whether the receiver takes a plaintext channel, the run's TLS files."""
    status = wait_for("a version committed over the checkpoint plane",
                      lambda: (s := api.get("/v1/status").json())["version"] >= 1 and s, 120)
    channel = grpc.insecure_channel(server["grpc_address"])
    try:
        grpc.channel_ready_future(channel).result(timeout=5)
        plaintext = True
    except grpc.FutureTimeoutError:
        plaintext = False
    finally:
        channel.close()
    files = {p.name: oct(p.stat().st_mode & 0o777) for p in (cfg.run.path / "checkpoint-tls").iterdir()}
    return {"published": status["version"] >= 1, "plaintext_accepted": plaintext, "files": files}


def rollout_server(api: httpx.Client) -> dict[str, Any] | None:
    servers = [s for s in api.get("/v1/status").json()["servers"] if s["server_id"] == "rollout-0"]
    return servers[0] if servers and servers[0]["alive"] else None


def jobs_and_a_step(api: httpx.Client, result: dict[str, Any]) -> dict[str, Any]:
    """An eval and a train job through the API, done and trained on (a trainer step); returns the rollout server as
    it first registered."""
    first = wait_for("rollout-0 registered", lambda: rollout_server(api), 120)
    eval_job = api.post("/v1/jobs", json={"kind": "eval", "source": {"kind": "arith", "split": "test", "limit": 4}})
    train_job = api.post("/v1/jobs", json={"kind": "train", "source": {"kind": "arith", "limit": 16}})
    result["submitted"] = [eval_job.status_code, train_job.status_code]
    eval_id = eval_job.json()["job_id"]

    def eval_done() -> dict[str, Any] | None:
        job = api.get(f"/v1/jobs/{eval_id}").json()
        return job if job["state"] == "done" else None

    result["eval"] = wait_for("eval job done", eval_done, 120)
    result["trainer"] = wait_for(
        "trainer step 1", lambda: (t := api.get("/v1/status").json()["trainer"]) and int(t["step"]) >= 1 and t, 120
    )
    return first


def placement(state: dict[str, Any]) -> dict[str, Any]:
    """Each placement group's strategy, bundles and nodes, and the node of this driver (connected to the run)."""
    import ray

    groups = {}
    for name in state["placement_groups"]:
        table = ray.util.placement_group_table(ray.util.get_placement_group(name))
        groups[name.removeprefix(state["namespace"] + "-")] = {
            "strategy": table["strategy"], "bundles": list(table["bundles"].values()),
            "nodes": sorted(set(table["bundles_to_node_id"].values()))}
    return {"groups": groups, "driver_node": ray.get_runtime_context().get_node_id()}


def _connect_without_token(address: str) -> str:
    """What a driver without the head's token gets from ``ray.init`` (no token file in its home either)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    code = (f"import ray\ntry:\n    ray.init(address={address!r}, log_to_driver=False)\n    print('connected')\n"
            "except Exception as exc:\n    print('refused', type(exc).__name__)")
    with tempfile.TemporaryDirectory() as home:
        proc = subprocess.run([sys.executable, "-c", code], env={**env, "HOME": home}, capture_output=True,
                              text=True, timeout=180)
    return (proc.stdout.strip().splitlines() or ["no answer"])[-1] + (
        " (InvalidAuthToken)" if "InvalidAuthToken" in proc.stderr else "")


def exercise(cfg: Config, api: httpx.Client, result: dict[str, Any]) -> None:
    """Jobs through the API, a trainer step, then SIGKILL the rollout server and watch it come back."""
    import ray

    first = jobs_and_a_step(api, result)
    result["checkpoint_plane"] = _checkpoint_plane(cfg, api, first)
    result["listening_up"] = listening()

    state = json.loads((cfg.run.path / "ray.json").read_text())
    result["ray_without_token"] = _connect_without_token(state["address"])
    os.environ["RAY_AUTH_TOKEN_PATH"] = state["auth_token"]  # the mode was set before ray was imported (main)
    ray.init(address=state["address"], namespace=state["namespace"], _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        result["placement"] = placement(state)
        actor = ray.get_actor("rollout-0")
        old_pid = ray.get(actor.pid.remote(), timeout=30)
        os.kill(old_pid, signal.SIGKILL)
        new_pid = wait_for("rollout-0 restarted", lambda: (p := ray.get(actor.pid.remote(), timeout=60)) != old_pid
                           and p, 90)
        trainer_pid, api_pid = (ray.get(ray.get_actor(n).pid.remote(), timeout=30) for n in ("trainer-0", "api"))
        result["component_pgids"] = [old_pid, new_pid, trainer_pid, api_pid]
        environ = _environ(trainer_pid)
        result["trainer_env"] = {k: environ.get(k) for k in ("WORLD_SIZE", "MASTER_PORT")}
        result["secrets"] = _secrets_report(cfg, environ, _environ(api_pid))
    finally:
        ray.shutdown()
    again = wait_for("rollout-0 registered again",
                     lambda: (s := rollout_server(api)) and s["started"] > first["started"] and s, 120)
    result["restart"] = {"old_pid": old_pid, "new_pid": new_pid, "old_left": alive_in({old_pid}, ""),
                         "started": [first["started"], again["started"]]}


def failed(cfg: Config, result: dict[str, Any]) -> None:
    """The exception being handled and the tail of each component's log, into ``result``."""
    result["error"] = traceback.format_exc()[-3000:]
    logs = cfg.run.path / "logs"
    result["logs"] = {p.name: p.read_text(errors="replace")[-2500:] for p in sorted(logs.glob("*.log"))}


def two_nodes(config: str) -> dict[str, Any]:
    """``up`` on a cluster of two nodes (``RAY_ADDRESS``), jobs, a step and a push across them, ``down``."""
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    try:
        wait_for("both Ray nodes alive", lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 120)
    finally:
        ray.shutdown()
    cfg = load_config(config)
    result: dict[str, Any] = {"up": rollwave("up", "-c", config, "--rollout-servers", "1", "--trainer-ranks", "1")}
    try:
        if result["up"]["rc"] == 0:
            api_url, redis_url = (re.search(rf"{what} (\S+?)[;,]", result["up"]["out"])[1] for what in ("API", "redis"))
            headers = {"Authorization": f"Bearer {cfg.api.token.get_secret_value()}"}
            with httpx.Client(base_url=api_url, headers=headers, timeout=30) as api:
                jobs_and_a_step(api, result)
                published = wait_for("a version published and pushed to rollout-0",
                                     lambda: (s := rollout_server(api)) and s["version"] >= 1 and s, 120)
            result["addresses"] = {"api": api_url, "redis": redis_url, "receiver": published["grpc_address"]}
            state = json.loads((cfg.run.path / "ray.json").read_text())
            ray.init(address=os.environ["RAY_ADDRESS"], namespace=state["namespace"], log_to_driver=False)
            try:
                result["placement"] = placement(state)
            finally:
                ray.shutdown()
    except Exception:  # reported in the JSON with the component logs; the test fails on it
        failed(cfg, result)
    finally:
        result["down"] = rollwave("down", "-c", config)
    return result


def refused_run(config: str) -> dict[str, Any]:
    """``up`` of a run whose rollout server refuses its config (an agent module it does not have): ``up`` fails
    naming it, Ray does not restart it (its log has one refusal), and ``down`` stops the rest."""
    overrides = ["run.name=raytest-refused", "rollout.agent_allowlist=[missing_mod:run]"]
    cfg = load_config(config, overrides)
    report: dict[str, Any] = {"up": rollwave("up", "-c", config, *overrides)}
    head: dict[str, Any] = {}
    try:
        if (cfg.run.path / "ray.json").exists():
            head = json.loads((cfg.run.path / "ray.json").read_text())
        time.sleep(REFUSED_WATCH_S)  # Ray would have started it again by now, and it would have refused again
        log = (cfg.run.path / "logs" / "rollout-0.log").read_text(errors="replace")
        report["refusals_logged"] = log.count("error: rollout.agent_allowlist")
    finally:
        report["down"] = rollwave("down", "-c", config, *overrides)
        report["left_after_down"] = alive_in({head["head_pid"]} if head else set(), head.get("temp_dir") or "")
    return report


def main() -> int:
    if sys.argv[1] == "--two-nodes":
        print(json.dumps(two_nodes(str(Path(sys.argv[2]).absolute()))))
        return 0
    # the head `up` starts requires its token and stays on loopback, as `rollwave up` sets; Ray reads both on import
    os.environ.update({"RAY_AUTH_MODE": "token", **LOOPBACK_RAY_ENV})
    cfg = load_config(sys.argv[1])
    config = str(Path(sys.argv[1]).absolute())
    result: dict[str, Any] = {"up": rollwave("up", "-c", config, "--rollout-servers", "1", "--trainer-ranks", "1")}
    headers = {"Authorization": f"Bearer {cfg.api.token.get_secret_value()}"} if cfg.api.token else {}
    try:
        if result["up"]["rc"] == 0:
            state = json.loads((cfg.run.path / "ray.json").read_text())
            result["head"] = {k: state.get(k) for k in ("head_pid", "temp_dir", "address")}
            with redis.Redis.from_url(re.search(r"redis (\S+?);", result["up"]["out"])[1]) as client:
                result["redis_appendfsync"] = client.config_get("appendfsync")["appendfsync"]
            with httpx.Client(base_url=f"http://{cfg.api.host}:{cfg.api.port}", headers=headers, timeout=30) as api:
                exercise(cfg, api, result)
    except Exception:  # reported in the JSON with the component logs; the test fails on it
        failed(cfg, result)
    finally:
        result["down"] = rollwave("down", "-c", config)
        head = result.get("head") or {}
        pgids = {int(p) for p in [head.get("head_pid"), *result.get("component_pgids", [])] if p}
        result["left_after_down"] = alive_in(pgids, head.get("temp_dir") or "")
        result["listening_after_down"] = listening()
        result["state_file_left"] = (cfg.run.path / "ray.json").exists()
    try:
        result["refused"] = refused_run(config)
    except Exception:
        result["error"] = result.get("error", "") + traceback.format_exc()[-3000:]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
