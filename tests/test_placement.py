"""``placement``: a component pins every thread it runs (and the children it starts) to its CPU set, and
runs one torch thread per CPU unless told otherwise; a CPU it may not use is refused naming the key. Unpinned,
the launcher lets its idle OpenMP threads sleep unless ``OMP_WAIT_POLICY`` says otherwise."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from buffer.redis_server import EmbeddedRedis
from core.config import ConfigError, EngineConfig, load_config
from core.placement import pin
from rollout_server.__main__ import engine_urls
from services.launcher import components
from tests.stack_helpers import affinities

ROOT = Path(__file__).resolve().parent.parent
USABLE = sorted(os.sched_getaffinity(0))


def test_pinning_covers_threads_started_before_and_after_and_children() -> None:
    cpu = USABLE[-1]
    script = f"""
import json, os, subprocess, sys, threading, time
before = threading.Thread(target=time.sleep, args=(30,), daemon=True)
before.start()
from core.placement import pin
from tests.stack_helpers import affinities
threads = pin([{cpu}], "placement.trainer_cpus", 0)
after = threading.Thread(target=time.sleep, args=(30,), daemon=True)
after.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print(json.dumps({{"threads": threads, "child": child.pid}}), flush=True)
sys.stdin.read()
child.kill()
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        reply = json.loads(proc.stdout.readline())
        seen = affinities(proc.pid)
        assert reply["threads"] == 1
        assert reply["child"] in seen and len(seen) >= 4  # main, two threads, the child
        assert set(seen.values()) == {str(cpu)}, seen
    finally:
        proc.communicate("", timeout=30)


def test_threads_follow_the_cpus_unless_set() -> None:
    assert pin([], "placement.trainer_cpus", 3) == 3  # not pinned: as configured
    assert pin([], "placement.trainer_cpus", 0) == 0
    mine = os.sched_getaffinity(0)
    try:
        assert pin(USABLE, "placement.rollout_cpus", 0) == len(USABLE)
        assert pin(USABLE, "placement.rollout_cpus", 5) == 5
        assert pin(USABLE, "placement.trainer_cpus", 0, sharers=len(USABLE)) == 1
        assert pin(USABLE, "placement.trainer_cpus", 0, sharers=2 * len(USABLE)) == 1  # never 0
    finally:
        os.sched_setaffinity(0, mine)


def test_a_cpu_out_of_reach_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"placement\.rollout_cpus: CPU 4096 is not available .* may use"):
        pin([USABLE[0], 4096], "placement.rollout_cpus", 0)
    assert sorted(os.sched_getaffinity(0)) == USABLE


@pytest.mark.parametrize(("component", "key"), [("trainer", "trainer_cpus"), ("rollout_server", "agent_cpus")])
def test_a_component_refuses_its_placement_at_start(tmp_path: Path, component: str, key: str) -> None:
    """``python -m trainer`` with a CPU it cannot have, or a rollout server with such a CPU for its agents, exits 2
    with the key on stderr, before anything runs."""
    proc = subprocess.run([sys.executable, "-m", component, f"placement.{key}=[4096]", f"run.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": "x" * 32})
    assert proc.returncode == 2 and f"placement.{key}: CPU 4096" in proc.stderr, proc.stderr


# Imported by every Python process started with its folder first on PYTHONPATH: it writes the torch thread count the
# process runs with to $THREADS_PROBE_OUT once $THREADS_PROBE_OUT.ask exists (from a thread of its own: torch hands
# every thread the count set last), or at a normal exit.
THREADS_PROBE = """
import atexit, os, sys, threading, time

def _report():
    torch = sys.modules.get("torch")
    if torch is not None:
        with open(os.environ["THREADS_PROBE_OUT"] + ".tmp", "w") as out:
            out.write(str(torch.get_num_threads()))
        os.replace(os.environ["THREADS_PROBE_OUT"] + ".tmp", os.environ["THREADS_PROBE_OUT"])

def _on_ask():
    while not os.path.exists(os.environ["THREADS_PROBE_OUT"] + ".ask"):
        time.sleep(0.05)
    _report()

threading.Thread(target=_on_ask, daemon=True).start()
atexit.register(_report)
"""


def _probe_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(the variables that make a Python process report its torch threads, the file it writes them to). Torch's
    own default there is 1 thread (OMP_NUM_THREADS), so a count of 2 comes from the config alone."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(THREADS_PROBE)
    path = os.pathsep.join(p for p in (str(probe), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = tmp_path / "torch_threads"
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "THREADS_PROBE_OUT": str(out)}, out


def test_the_embedded_engine_runs_engine_threads_torch_threads(tmp_path: Path, tiny_model_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.threads reaches the embedded engine the rollout server starts (``engine_urls``): its process runs 2
    torch threads where torch alone would run 1."""
    env, out = _probe_env(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    async def ask_while_serving() -> None:
        async with AsyncExitStack() as stack:
            await engine_urls(EngineConfig(threads=2), tiny_model_dir, stack)  # returns once the engine is healthy
            Path(f"{out}.ask").touch()
            deadline = time.monotonic() + 30
            while not out.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    asyncio.run(ask_while_serving())
    assert out.read_text() == "2"


def test_the_trainer_runs_trainer_threads_torch_threads(tmp_path: Path, tiny_model_dir: Path,
                                                        redis_server: EmbeddedRedis) -> None:
    """trainer.threads reaches ``python -m trainer``: the process runs 2 torch threads where torch alone would run 1
    (an empty buffer with stop_when_drained makes it exit after one read)."""
    env, out = _probe_env(tmp_path)
    env["ROLLWAVE_CHECKPOINT_TOKEN"] = secrets.token_urlsafe(32)
    overrides = [
        "run.name=threads", f"run.dir={tmp_path}", f"redis.url={redis_server.url}", f"model.path={tiny_model_dir}",
        f"checkpoint.stage_dir={tmp_path}/stage", "trainer.device=cpu", "trainer.threads=2",
        "trainer.take_timeout_s=1", "trainer.stop_when_drained=true",
    ]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_") and k != "REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "trainer", *overrides], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**clean, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert out.read_text() == "2"


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_unpinned_components_get_sleeping_openmp_threads_unless_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: bool, given: str | None) -> None:
    """The launcher gives the trainer and the rollout server (whose engine inherits it) ``OMP_WAIT_POLICY=PASSIVE``
    when their placement pins them nowhere and the variable is not set: spinning, unpinned, they made an async
    run 10x slower (bench/e2e.py); pinned, the spin made a colocated one faster."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if given is not None:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    cpus = f"[{USABLE[0]}]" if pinned else "[]"
    cfg = load_config(None, [f"run.dir={tmp_path}", f"placement.rollout_cpus={cpus}", f"placement.trainer_cpus={cpus}"])
    specs = components(cfg, tmp_path / "config.yaml", "redis://127.0.0.1:1", rollout_servers=2, api=True)
    policies = {spec.name: spec.env.get("OMP_WAIT_POLICY") for spec in specs}
    want = "PASSIVE" if not pinned and given is None else None
    assert policies == {"trainer-0": want, "rollout-0": want, "rollout-1": want, "api": None}
