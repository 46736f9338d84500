"""Running an in-process rollout worker in a test until a condition holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rollout_server.worker import RolloutWorker


async def serve_until(worker: RolloutWorker, done: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    """Run ``worker`` until ``done()`` (polled off the event loop, the worker's), failing with whatever stopped the
    worker first, or naming ``what`` after ``timeout_s``; then stop it (it must end within 60 s) and close its
    engines."""
    serving = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(done):
            if serving.done():
                serving.result()  # raises what stopped the worker
                raise AssertionError(f"the worker stopped before {what}")
            assert time.monotonic() < deadline, f"not {what} in {timeout_s:g} s"
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)
        for engine in worker.engines:
            await engine.aclose()
