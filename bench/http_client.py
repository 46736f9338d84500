"""The engine client's transport: CPU per call of aiohttp (what ``EngineClient`` uses) against httpx2 (the openai
client's, which the engine client used before), side by side in one run.

A rollout server shares its core with its engine, so every microsecond its HTTP client spends is taken from
generation. A stub engine (a uvicorn process answering ``/generate`` with a 48-token reply after 0-50 ms) serves
both sides; each round sends ``--calls`` generate-shaped requests (300 prompt tokens) from ``--concurrency``
tasks, each pausing 0-20 ms between its calls, as agent loops do between turns. The client process is pinned to
one CPU and its CPU time per call is measured. The sides alternate ``--rounds`` times (A, B, B, A, ...); each
figure is a median. Last line: ``aiohttp_vs_httpx2_cpu_per_call ratio <median aiohttp / median httpx2>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.net import listen_socket  # noqa: E402

BODY = {"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 48}, "return_logprob": True}
STUB = """
import asyncio, random, socket, sys
import uvicorn
from fastapi import FastAPI
app = FastAPI()
REPLY = {"text": "x" * 100, "output_ids": list(range(48)),
         "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in range(48)]}}
@app.post("/generate")
async def generate(body: dict) -> dict:
    await asyncio.sleep(random.random() * 0.05)
    return REPLY
uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(
    sockets=[socket.socket(fileno=int(sys.argv[1]))])
"""


async def calls(send: Callable[[], Awaitable[None]], n: int, concurrency: int) -> None:
    async def agent(k: int) -> None:
        for _ in range(k):
            await send()
            await asyncio.sleep(random.random() * 0.02)

    await asyncio.gather(*(agent(n // concurrency) for _ in range(concurrency)))


async def with_httpx2(url: str, n: int, concurrency: int) -> None:
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    async with httpx2.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def send() -> None:
            (await client.post("/generate", json=BODY)).json()

        await calls(send, n, concurrency)


async def with_aiohttp(url: str, n: int, concurrency: int) -> None:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(sock_read=60)) as session:
        async def send() -> None:
            async with session.post(url + "/generate", json=BODY) as resp:
                await resp.json()

        await calls(send, n, concurrency)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    sock = listen_socket("127.0.0.1", 0, "stub engine")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(sock.fileno())], pass_fds=[sock.fileno()])
    try:
        time.sleep(3.0)  # uvicorn starts; the listening socket queues the first connections meanwhile
        sides = {"httpx2": with_httpx2, "aiohttp": with_aiohttp}
        per_call: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.rounds):
            for name in sides if i % 2 == 0 else reversed(sides):
                cpu = time.process_time()
                asyncio.run(sides[name](url, args.calls, args.concurrency))
                per_call[name].append((time.process_time() - cpu) / args.calls * 1e6)
                print(f"round {i} {name:>8}: {per_call[name][-1]:.0f} us of client CPU per call", flush=True)
    finally:
        stub.terminate()
        stub.wait(timeout=30)
    median = {name: statistics.median(v) for name, v in per_call.items()}
    print(f"median: httpx2 {median['httpx2']:.0f} us, aiohttp {median['aiohttp']:.0f} us of client CPU per call "
          f"({args.calls} calls from {args.concurrency} tasks a round, {args.rounds} rounds)")
    print(f"aiohttp_vs_httpx2_cpu_per_call ratio {median['aiohttp'] / median['httpx2']:.3f}")


if __name__ == "__main__":
    main()
