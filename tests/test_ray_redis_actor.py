"""``rollwave up``'s Redis actor comes back after its Ray worker is SIGKILLed, on a real local Ray inside a network
namespace with only loopback: Ray rebuilds it while the killed worker's redis-server still stops (held here in
SIGSTOP until the rebuilt actor has opened the data directory's lock) and holds the directory; the rebuilt actor
waits for it and serves the same URL with the data written before."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run as ``python -c SCRIPT <data dir>``; prints one JSON line, asserts nothing itself.
SCRIPT = """
import contextlib, json, os, signal, sys, time
from pathlib import Path
import psutil, ray, redis
from services.ray_launcher import RedisActor

data_dir = Path(sys.argv[1])
lock = os.path.realpath(data_dir / "redis.lock")


def openers():
    found = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(f.path == lock for f in proc.open_files()):
                found.add(proc.pid)
    return found


def until(what, probe):
    deadline = time.monotonic() + 120
    while not (got := probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)
    return got


def url():
    try:
        return ray.get(actor.url.remote(), timeout=120)
    except ray.exceptions.RayActorError:  # not rebuilt yet
        return None


result = {}
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    actor = RedisActor.remote(str(data_dir), 0, True, "always", None)
    result["url"] = ray.get(actor.url.remote(), timeout=120)
    holder = json.loads(Path(lock).read_text())
    server = holder["redis_server_pid"]
    result["servers"] = [server]
    with redis.Redis.from_url(result["url"]) as client:
        client.set("k", "v")
    os.kill(server, signal.SIGSTOP)  # the guard's SIGTERM waits until it continues
    try:
        os.kill(holder["owner_pid"], signal.SIGKILL)
        until("the rebuilt actor at the data directory's lock", lambda: openers() - {server})
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone: its guard SIGKILLed it after its grace
            os.kill(server, signal.SIGCONT)
    result["url_again"] = until("the rebuilt actor's URL", url)
    result["servers"].append(json.loads(Path(lock).read_text())["redis_server_pid"])
    with redis.Redis.from_url(result["url_again"]) as client:
        result["k"] = client.get("k").decode()
    ray.get(actor.stop.remote(), timeout=60)
    ray.kill(actor, no_restart=True)
except Exception as exc:
    result["error"] = repr(exc)
finally:
    ray.shutdown()
    print(json.dumps(result), flush=True)
"""


@pytest.mark.ray  # not slow: it waits on events only, so it runs beside the other tests
def test_a_redis_actor_whose_worker_is_killed_comes_back_with_its_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    home = tmp_path / "home"  # a local ray.init writes ~/.ray/auth_token, which turns on token auth for later heads
    home.mkdir()
    proc = subprocess.run(["unshare", "-n", "bash", "-c", 'ip link set lo up && exec "$0" -c "$1" "$2"',
                           sys.executable, SCRIPT, str(data_dir)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HOME": str(home)}, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    for pid in result.get("servers", []):  # the script died before stopping them: end what is left of them
        with contextlib.suppress(psutil.NoSuchProcess):
            if (server := psutil.Process(pid)).name() == "redis-server":
                server.kill()  # psutil checks that the pid is still this process's
    report = json.dumps(result) + proc.stderr[-3000:]
    assert proc.returncode == 0 and "error" not in result, report
    assert result["url_again"] == result["url"] and result["k"] == "v", report
    assert result["servers"][1] != result["servers"][0], report
