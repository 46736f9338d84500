"""A component that fails at every start under the Ray launcher, on a real local Ray inside a network namespace with
only loopback (``tests/ray_given_up_script.py``): its actor gives it up by the limit its spec carries and stops the
run's other component through Ray (no one else stops it), and ``rollwave up --foreground``'s wait names it, stops the
run (its actors and the head) and exits 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ray
@pytest.mark.slow
def test_a_component_given_up_on_ray_stops_the_run(tmp_path: Path) -> None:
    script = f"ip link set lo up && exec {sys.executable} {ROOT / 'tests/ray_given_up_script.py'} {tmp_path}"
    try:
        proc = subprocess.run(["unshare", "-n", "bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    finally:  # the script died before its `down`: end the head it started (its process group)
        state = tmp_path / "givenup" / "ray.json"
        if state.exists() and (head := json.loads(state.read_text()).get("head_pid")):
            try:
                os.killpg(head, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.dumps(result, indent=1)[-3000:] + proc.stderr[-3000:]
    assert "error" not in result, report
    assert result["lives_rc"] == -signal.SIGTERM and result["dies_restarts"] == 1, report
    assert result["starts_logged"] == 2, report  # the first start and the one restart, none after
    message = (f"dies keeps failing and is given up: it died 2 times within 900 s "
               f"(launcher.max_restarts=1); its last exit 3, its log {tmp_path / 'givenup' / 'logs' / 'dies.log'}")
    assert f"error: {message}; stopping the run" in proc.stderr, report
    assert result["stay_rc"] == 1 and "rollwave down: stopped lives, dies, the Ray head" in proc.stdout, report
    assert result["left"] == [] and not result["lives_left"] and not result["state_file_left"], report
