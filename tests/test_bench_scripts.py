"""The bench scripts run against the current code and end as the project's rules say: their headline ratio on the
last line, or, when a part of the run fails, a non-zero exit with no ratio printed. What they measure is not
checked here: timings belong in bench/, never in tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from core.process import INSPECTABLE_ENV

ROOT = Path(__file__).resolve().parent.parent


def run_bench(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=env)


def test_frozen_bench_ends_on_its_headline() -> None:
    """bench/frozen.py starts its receivers through bench/checkpoint.py's child mode, which now takes the receiver's
    swap mode, and pushes every step through ``buffer.push_every`` (once a trainer key): it failed at its start."""
    out = run_bench(["bench/frozen.py", "--rounds", "1", "--steps", "2"], 300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.fullmatch(r"frozen_vs_healthy ratio \d+\.\d{3}", out.stdout.splitlines()[-1]), out.stdout[-2000:]


def test_e2e_bench_exits_when_its_components_refuse_to_start() -> None:
    """Every component refuses its environment (exit 2, not restarted): the bench raises the stack's ConfigError and
    prints no ratio (it waited for ever for a rollout server to register)."""
    env = {**os.environ, INSPECTABLE_ENV: "2"}
    out = run_bench(["bench/e2e.py", "--warm-start", "tests/data/arith_warm_start", "--steps", "2", "--runs", "1"],
                    120, env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "ConfigError" in out.stderr and INSPECTABLE_ENV in out.stderr, out.stderr[-3000:]
    assert " ratio " not in out.stdout
