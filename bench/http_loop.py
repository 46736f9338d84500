"""The CPU a ``/generate`` round trip costs the embedded engine's HTTP side and the rollout's client, on the
pure-Python stack (uvicorn's h11 parser on asyncio's loop; the client on asyncio's loop) against httptools and
uvloop (what uvicorn picks when they are installed, and the loop the rollout server runs).

The engine is the real app (``create_app``: middleware, routes, request validation, replies) over a scheduler
that finishes each request as it is submitted with 30 tokens and their logprobs, so no model work hides the
HTTP path. It runs as a process pinned to one CPU, the client (the rollout's ``EngineClient``, 32 requests in
flight, 300-token prompts) on another; the engine's CPU comes from ``/proc``, the client's from ``getrusage``.
The sides alternate for ``--rounds`` rounds; medians.
Last line: ``stock_vs_uvloop_cpu_per_request ratio <CPU per request, stock / uvloop + httptools>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import uvicorn
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.net import listen_socket  # noqa: E402
from core.tiny_model import build_tiny_model  # noqa: E402
from rollout_server.engine.protocol import GenerateSpec  # noqa: E402
from rollout_server.engine.request import Request  # noqa: E402
from rollout_server.engine.scheduler import Scheduler  # noqa: E402
from rollout_server.engine.server import create_app  # noqa: E402
from rollout_server.engine.weights import load_model  # noqa: E402
from rollout_server.engine_client import EngineClient  # noqa: E402

NEW_TOKENS = 30
PROMPT = 300
STACKS = {"stock": ("h11", "asyncio"), "uvloop": ("httptools", "uvloop")}


class InstantScheduler(Scheduler):
    """Finishes every request when it is submitted: each reply carries ``NEW_TOKENS`` tokens, no forward runs."""

    def submit(self, reqs: list[Request]) -> None:
        for r in reqs:
            for i in range(NEW_TOKENS):
                r.append(5 + i, -0.5, self.version, self.tokenizer)
            r.finish(None, self.version)


def serve(model_dir: Path, http: str, loop: str, port_file: Path) -> None:
    model, tokenizer, eos_ids = load_model(model_dir)
    engine = InstantScheduler(model, tokenizer, model_path=str(model_dir), weight_version="0")
    spec = GenerateSpec(tokenizer, model.config.vocab_size, 1024, eos_ids)
    sock = listen_socket("127.0.0.1", 0, "engine")
    port_file.write_text(str(sock.getsockname()[1]))
    config = uvicorn.Config(create_app(engine, spec), log_level="warning", access_log=False, http=http, loop=loop)
    uvicorn.Server(config).run(sockets=[sock])


def process_cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def drive(url: str, requests: int, vocab: int) -> None:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url) as client:
        gate = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with gate:
                reply = await client.generate([3 + (7 * j + i) % (vocab - 3) for j in range(PROMPT)], params)
                assert len(reply["output_ids"]) == NEW_TOKENS, reply["meta_info"]

        await asyncio.gather(*(one(i) for i in range(requests)))


def measure(
    stack: str, model_dir: Path, vocab: int, requests: int, cpus: tuple[int, int], tmp: Path
) -> tuple[float, float]:
    """(engine, client) CPU ms per request on ``stack``."""
    http, loop = STACKS[stack]
    port_file = tmp / f"port-{stack}"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(model_dir), http, loop, str(port_file)],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}))
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {stack} engine did not start (exit {proc.poll()})")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        run = asyncio.run if loop == "asyncio" else uvloop.run
        run(drive(url, 64, vocab))  # warm-up: connections, first-call paths
        engine0, client0 = process_cpu_s(proc.pid), own_cpu_s()
        run(drive(url, requests, vocab))
        return ((process_cpu_s(proc.pid) - engine0) * 1e3 / requests, (own_cpu_s() - client0) * 1e3 / requests)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    usable = sorted(os.sched_getaffinity(0))
    cpus = (usable[0], usable[-1])
    os.sched_setaffinity(0, {cpus[1]})
    results: dict[str, list[tuple[float, float]]] = {stack: [] for stack in STACKS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        vocab = load_model(model_dir)[0].config.vocab_size
        for i in range(args.rounds):
            for stack in list(STACKS) if i % 2 == 0 else list(STACKS)[::-1]:
                engine_ms, client_ms = measure(stack, model_dir, vocab, args.requests, cpus, Path(tmp))
                results[stack].append((engine_ms, client_ms))
                print(f"round {i} {stack:6}: engine {engine_ms:.3f} ms, client {client_ms:.3f} ms CPU per request",
                      flush=True)
    median = {stack: (statistics.median(e for e, _ in runs), statistics.median(c for _, c in runs))
              for stack, runs in results.items()}
    print(f"{args.requests} requests a round, 32 in flight, {PROMPT}-token prompts, {NEW_TOKENS} tokens each; "
          f"engine on CPU {cpus[0]}, client on CPU {cpus[1]}")
    for stack, (engine_ms, client_ms) in median.items():
        http, loop = STACKS[stack]
        print(f"{stack:6} ({http} + {loop}) median: engine {engine_ms:.3f} ms, client {client_ms:.3f} ms per request")
    print(f"engine_stock_vs_uvloop ratio {median['stock'][0] / median['uvloop'][0]:.3f}")
    print(f"client_stock_vs_uvloop ratio {median['stock'][1] / median['uvloop'][1]:.3f}")
    print(f"stock_vs_uvloop_cpu_per_request ratio {sum(median['stock']) / sum(median['uvloop']):.3f}")


if __name__ == "__main__":
    main()
