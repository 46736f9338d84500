"""What every component does first (``core.process.prepare_component``), in a fresh interpreter each time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core.config import CONFIG_ERROR_EXIT
from core.process import PR_SET_DUMPABLE

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


# Both sides run as one user that is not root (root may read any process): as root, each switches to ``nobody``
# once its imports are done (the interpreter's own files may be closed to that user). A process a user starts is
# dumpable, which a switch of uid turns off, so the target turns it back on before it starts as a component or not.
AS_ANOTHER_USER = f"""
import ctypes, os, sys
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    ctypes.CDLL(None).prctl({PR_SET_DUMPABLE}, 1, 0, 0, 0)
"""
TARGET = """
from core.process import forget_environment, prepare_component
""" + AS_ANOTHER_USER + """
forget_environment(["ROLLWAVE_CHECKPOINT_TOKEN"])  # as a rollout server does once its config holds it
if sys.argv[1] == "component":
    prepare_component()
print("ready", flush=True)
sys.stdin.read()
"""
READER = AS_ANOTHER_USER + """
try:
    with open(f"/proc/{sys.argv[1]}/environ", "rb") as f:
        print("read", b"ROLLWAVE_CHECKPOINT_TOKEN=token-of-the-test" in f.read())
except PermissionError:
    print("refused")
"""


def read_environment_of(kind: str, **extra_env: str) -> str:
    """What another process of the target's user gets from the target's ``/proc/<pid>/environ``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROLLWAVE_CHECKPOINT_TOKEN": "token-of-the-test", **extra_env}
    with subprocess.Popen([sys.executable, "-c", TARGET, kind], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as target:
        try:
            assert target.stdout.readline() == "ready\n"
            return subprocess.run([sys.executable, "-c", READER, str(target.pid)], capture_output=True, text=True,
                                  timeout=60, check=True).stdout.strip()
        finally:
            target.stdin.close()
            target.wait(60)


def test_no_other_process_of_the_same_user_reads_a_components_secrets() -> None:
    # a plain process keeps the secret in the environment it started with, forgotten or not: an agent or a tool a
    # rollout server runs, as the same user, could read it; a component's is refused
    assert read_environment_of("plain") == "read True"
    assert read_environment_of("component") == "refused"


def test_a_component_stays_inspectable_only_when_told() -> None:
    # ROLLWAVE_INSPECTABLE=1, for debugging (py-spy, gdb), leaves it dumpable; a value neither 1 nor 0 stops it
    assert read_environment_of("component", ROLLWAVE_INSPECTABLE="1") == "read True"
    bad = subprocess.run([sys.executable, "-c", "from core.process import prepare_component; prepare_component()"],
                         env={**os.environ, "PYTHONPATH": str(ROOT), "ROLLWAVE_INSPECTABLE": "yes"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == CONFIG_ERROR_EXIT, bad.stderr
    assert "ROLLWAVE_INSPECTABLE='yes': want 1 (dumpable, for debugging) or 0" in bad.stderr
