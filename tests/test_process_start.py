"""What every component does first (``core.process.prepare_component``), in a fresh interpreter each time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Whether glibc serves a 1 MiB malloc from a fresh mmap (whose pages the kernel zeroes at every fault): its
# mmapped-block count (mallinfo2's hblks) goes up while the block is held.
PROBE = """
import ctypes, faulthandler
from core.process import prepare_component

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p

def mmapped_1mib():
    before = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    mapped = libc.mallinfo2().hblks > before
    libc.free(ctypes.c_void_p(block))
    return mapped

print(mmapped_1mib(), faulthandler.is_enabled())
print(sorted(prepare_component()), mmapped_1mib(), faulthandler.is_enabled())
"""


# An exit handler registered before prepare_component runs after every one it registers.
EXIT_PROBE = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
from core.process import prepare_component
print("frozen at start:", gc.get_freeze_count() > 0)
prepare_component()
"""


def run_probe(probe: str = PROBE, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "PYTHONFAULTHANDLER"}
    out = subprocess.run([sys.executable, "-c", probe], env={**clean, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def test_a_component_tunes_malloc_and_dumps_stacks_on_a_crash() -> None:
    assert run_probe() == [
        "True False", "['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TOP_PAD_', 'MALLOC_TRIM_THRESHOLD_'] False True"]


def test_malloc_settings_in_the_environment_win() -> None:
    # glibc's own default threshold (128 KiB), set in the environment: a 1 MiB block stays an mmap
    assert run_probe(MALLOC_MMAP_THRESHOLD_="131072") == [
        "True False", "['MALLOC_TOP_PAD_', 'MALLOC_TRIM_THRESHOLD_'] True True"]


def test_a_component_exits_without_the_last_garbage_collection() -> None:
    # every object is frozen out of the interpreter's final collection (bench/process_exit.py times it)
    assert run_probe(EXIT_PROBE) == ["frozen at start: False", "frozen at exit: True"]
