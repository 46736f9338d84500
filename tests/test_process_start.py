"""What every component does first (``core.process.prepare_component``), in a fresh interpreter each time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import faulthandler
from core.process import prepare_component, tune_malloc
print(sorted(tune_malloc()), faulthandler.is_enabled())
prepare_component()
print(faulthandler.is_enabled())
"""


def run_probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "PYTHONFAULTHANDLER"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def test_a_component_tunes_malloc_and_dumps_stacks_on_a_crash() -> None:
    assert run_probe() == [
        "['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TOP_PAD_', 'MALLOC_TRIM_THRESHOLD_'] False", "True"]


def test_malloc_settings_in_the_environment_win() -> None:
    assert run_probe(MALLOC_TOP_PAD_="0") == ["['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_'] False", "True"]
