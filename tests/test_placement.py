"""``placement``: a component pins every thread it runs (and the children it starts) to its CPU set, and
runs one torch thread per CPU unless told otherwise; a CPU it may not use is refused naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError
from core.placement import pin
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


def test_a_component_refuses_its_placement_at_start(tmp_path: Path) -> None:
    """``python -m trainer`` with a CPU it cannot have exits 2 with the key on stderr, before anything runs."""
    proc = subprocess.run([sys.executable, "-m", "trainer", "placement.trainer_cpus=[4096]", f"run.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": "x" * 32})
    assert proc.returncode == 2 and "placement.trainer_cpus: CPU 4096" in proc.stderr, proc.stderr
