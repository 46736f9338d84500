"""An agent sample's CPU: the fork server warmed up (``rollout_server.agent_warmup``) against one that only
imported ``openai``, side by side in one run.

Each side is a process of its own with a fresh fork server, which runs ``--samples`` episodes of
``rollout_server.agents.calculator_agent`` one after the other through ``agent_runner.run_agent`` (as a rollout
server runs an ``agent`` job's samples) against a canned OpenAI server (a tool call, then the answer). The CPU
of the samples' processes is read from the fork server, which reaps them. The sides alternate ``--rounds``
times (A, B, B, A, ...); each figure is a median. Last line:
``warm_vs_cold_cpu_per_sample ratio <median warm / median cold>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.forkserver
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_server.agent_runner import run_agent, start_fork_server  # noqa: E402

AGENT = "rollout_server.agents.calculator_agent:run"


def children_cpu_s() -> float:
    """CPU of the reaped children of this process's fork server (its only child process)."""
    for child in psutil.Process().children():
        if any("forkserver" in part for part in child.cmdline()):
            times = child.cpu_times()
            return times.children_user + times.children_system
    raise RuntimeError("no fork server among this process's children")


async def side(warm: bool, samples: int) -> dict[str, float]:
    if warm:
        await start_fork_server([AGENT])
    else:
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["rollout_server.agent_runner", "openai", AGENT.partition(":")[0]])
        multiprocessing.forkserver.ensure_running()
    from rollout_server.agent_warmup import canned_openai_server  # its import warms this process too: no matter

    task = SimpleNamespace(task_id="t", messages=[{"role": "user", "content": "2+3?"}], tools=None)
    async with canned_openai_server() as base_url:
        before, start = children_cpu_s(), time.perf_counter()
        for _ in range(samples):
            outcome = await run_agent(AGENT, task, base_url, "key", timeout_s=60, memory_mb=4096, max_processes=None)
            assert outcome.failure is None, outcome
        wall = time.perf_counter() - start
    return {"cpu_ms": (children_cpu_s() - before) / samples * 1e3, "wall_ms": wall / samples * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side", choices=["warm", "cold"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        print(json.dumps(asyncio.run(side(args.side == "warm", args.samples))))
        return
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for r in range(args.rounds):
        for name in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
            out = subprocess.run([sys.executable, __file__, "--side", name, "--samples", str(args.samples)],
                                 capture_output=True, text=True, check=True, timeout=600).stdout
            runs[name].append(json.loads(out.splitlines()[-1]))
            print(f"round {r} {name}: {runs[name][-1]['cpu_ms']:.1f} ms of CPU, {runs[name][-1]['wall_ms']:.1f} ms "
                  "wall per sample", flush=True)
    cpu = {name: statistics.median(x["cpu_ms"] for x in rs) for name, rs in runs.items()}
    wall = {name: statistics.median(x["wall_ms"] for x in rs) for name, rs in runs.items()}
    print(f"{args.samples} samples of {AGENT} per run, {args.rounds} runs per side, medians")
    for name in ("cold", "warm"):
        print(f"fork server {name:5s} {cpu[name]:7.1f} ms of CPU per sample  {wall[name]:7.1f} ms wall per sample")
    print(f"warm_vs_cold_cpu_per_sample ratio {cpu['warm'] / cpu['cold']:.3f}")


if __name__ == "__main__":
    main()
