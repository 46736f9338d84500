"""Pinning a component to its CPU set (``placement``): on a CPU host, what a GPU id is on a GPU host.

Without it the engine, the trainer and Redis all spread over every core, so in async mode each runs on
the cycles the others leave and the overlap async buys is lost to contention (bench/e2e.py).
"""

from __future__ import annotations

import logging
import os

from core.config import ConfigError

log = logging.getLogger(__name__)


def idle_threads_env(cpus: list[int]) -> dict[str, str]:
    """What an unpinned process's environment gets (the launcher's components, and the test workers from
    tests/conftest.py): ``OMP_WAIT_POLICY=PASSIVE``, so its idle OpenMP threads sleep at once (libgomp reads it
    as torch loads). Unpinned, the engine and the trainer each run as many torch threads as there are cores, and
    libgomp's default, a spin before each sleep, took each side's cores from the other's busy threads: an async
    run on two cores went 10x slower (``bench/e2e.py --compare unpinned``). Pinned (``cpus``), nothing: a
    colocated run, on both cores in turns, was a quarter faster with the spin. Nothing either where the variable
    is set already, which the process inherits."""
    return {} if cpus or "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}


def check_cpus(cpus: list[int], key: str) -> None:
    """Every CPU of ``cpus`` (config ``key``) is one this process may use; a ConfigError naming the key and the
    usable ones if not."""
    usable = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - usable)
    if missing:
        raise ConfigError(f"{key}: CPU {', '.join(map(str, missing))} is not available to this process "
                          f"(it may use {', '.join(map(str, sorted(usable)))})")


def cpu_share(cpus: list[int], sharers: int) -> int:
    """Torch threads for each of ``sharers`` processes pinned to the same ``cpus``: the CPUs split between them (at
    least 1 each), so that together they do not run more threads than the set has CPUs, each spinning on the
    others' cores, unless there are more processes than CPUs."""
    return max(1, len(set(cpus)) // max(1, sharers))


def pin(cpus: list[int], key: str, threads: int, sharers: int = 1) -> int:
    """Pin this process (every thread it runs, and the children it starts) to ``cpus``, named by its config
    ``key``; returns the torch thread count to run: ``threads`` when set, else the CPUs' share of each of the
    ``sharers`` processes pinned to the same set (the trainer's local ranks), at least 1; 0 when not pinned
    (torch's default). A CPU this process may not use is a ConfigError naming the key and the usable ones."""
    if not cpus:
        return threads
    check_cpus(cpus, key)
    for task in os.listdir("/proc/self/task"):  # every thread already running, not only the caller
        os.sched_setaffinity(int(task), set(cpus))
    log.info("pinned to CPUs %s (%s)", sorted(set(cpus)), key)
    return threads or cpu_share(cpus, sharers)
