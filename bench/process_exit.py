"""How long a component's process takes to exit once its work is done, with and without the exit that
``core.process.prepare_component`` arranges (every object frozen out of the interpreter's last garbage
collection), in one run: a run's end waits on its trainer's exit.

Each side is a fresh interpreter that imports the trainer's modules and loads the tiny model (what a trainer
holds at its end), then prints the time and returns from its main; the parent times from that print to the
process's end. ``plain`` does what ``prepare_component`` does but the freeze. Rounds alternate the order of the
sides. Last line: ``exit_frozen_vs_plain ratio <median frozen / median plain>``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import faulthandler, sys, time
import trainer.__main__
from transformers import AutoModelForCausalLM
from core.process import prepare_component, tune_malloc
if sys.argv[1] == "frozen":
    prepare_component()
else:
    faulthandler.enable()
    tune_malloc()
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
print(time.time(), flush=True)
"""


def exit_seconds(side: str, model: Path) -> float:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, side, str(model)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    printed = float(proc.stdout.readline())
    if proc.wait(timeout=60) != 0:
        raise RuntimeError(f"{side}: the child exited with {proc.returncode}")
    return time.time() - printed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    times: dict[str, list[float]] = {"plain": [], "frozen": []}
    with tempfile.TemporaryDirectory(prefix="rollwave-exit-") as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        for i in range(args.rounds):
            for side in ("plain", "frozen") if i % 2 == 0 else ("frozen", "plain"):
                times[side].append(exit_seconds(side, model))
    median = {side: statistics.median(t) for side, t in times.items()}
    for side, t in times.items():
        print(f"{side:>6}: median {median[side] * 1000:.0f} ms to exit (" + ", ".join(f"{x * 1000:.0f}" for x in t)
              + ")")
    print(f"exit_frozen_vs_plain ratio {median['frozen'] / median['plain']:.3f}")


if __name__ == "__main__":
    main()
