"""Stopping a child process the one way every component does: SIGTERM, a bounded wait, then SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)


def stop_process(proc: subprocess.Popen, timeout_s: float, *, name: str = "", group: bool = False) -> int:
    """Ask ``proc`` to stop (SIGTERM), wait up to ``timeout_s``, then SIGKILL; return its exit code.

    ``group=True`` signals the whole process group (the process was started with ``start_new_session``),
    and SIGKILLs what is left of the group even after a clean exit, so no grandchild outlives it.
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
            log.warning("%s (pid %d) did not stop in %.0f s; killing it", name or proc.args, proc.pid, timeout_s)
            send(signal.SIGKILL)
    if group:
        send(signal.SIGKILL)
    return proc.wait()
