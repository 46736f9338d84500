"""Trainer ranks for the tests, forked from a fork server of their own that has imported torch, transformers and
the trainer once per test worker.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter, which imports all of that again: about 5 s
of CPU a rank, most of what a two-rank test costs, on a machine whose two cores the test workers share. The server is
not ``multiprocessing``'s own (the agent runner's tests use that one, with their own preloads and memory limits); a
rank gets what a spawned one would have had at the spawn: the test's environment, its stdout and stderr (the fork
server holds those of the test that started it) and its SIGINT disposition.
"""

from __future__ import annotations

import multiprocessing.forkserver as forkserver
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any
from unittest import mock

import torch.multiprocessing as mp

PRELOAD = ["torch", "transformers", "peft", "torch.distributed.checkpoint", "torch.distributed.fsdp", "redis",
           "trainer.worker", "trainer.parallel", "trainer.checkpoint", "trainer.checkpoint_pusher"]

_SERVER = forkserver.ForkServer()
_SERVER.set_forkserver_preload(PRELOAD)


class _TestSide:
    """What a rank takes from the test that starts it: its environment and SIGINT disposition, and its stdout and
    stderr, pickled as file descriptors the fork server passes on (``stdio``, empty on the test's side)."""

    def __init__(self, env: dict[str, str], sigint_ignored: bool, stdio: tuple[Any, ...] = ()) -> None:
        self.env, self.sigint_ignored, self.stdio = env, sigint_ignored, stdio

    @classmethod
    def now(cls) -> _TestSide:
        return cls(dict(os.environ), signal.getsignal(signal.SIGINT) == signal.SIG_IGN)

    def __reduce__(self) -> tuple:
        return _TestSide, (self.env, self.sigint_ignored, (reduction.DupFd(1), reduction.DupFd(2)))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        signal.signal(signal.SIGINT, signal.SIG_IGN if self.sigint_ignored else signal.default_int_handler)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, passed in zip((1, 2), self.stdio, strict=True):
            fd = passed.detach()
            os.dup2(fd, target)
            os.close(fd)


def _rank(i: int, side: _TestSide, fn: Callable[..., None], *args: Any) -> None:
    side.apply()
    fn(i, *args)


def spawn_ranks(fn: Callable[..., None], args: tuple = (), nprocs: int = 1,
                join: bool = True) -> mp.ProcessContext | None:
    """``torch.multiprocessing.spawn``'s contract (``fn(i, *args)`` in each of ``nprocs`` processes; with ``join``, wait
    for all and raise a rank's failure), the ranks forked from the fork server."""
    with mock.patch.object(forkserver, "connect_to_new_process", _SERVER.connect_to_new_process):
        context = mp.start_processes(_rank, args=(_TestSide.now(), fn, *args), nprocs=nprocs, join=False,
                                     start_method="forkserver")
    if join:
        while not context.join():
            pass
        return None
    return context


def stop_server() -> None:
    """Stop the fork server (at the end of the test session), if it was started."""
    _SERVER._stop()
