"""The embedded engine's HTTP routes, one router per concern: generation, weights, health and info.

Handlers only parse, submit and wait; the scheduler thread does all model work. They reach the
scheduler and the generation spec through ``app.state`` (set by ``create_app``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.scheduler import EngineFailure, Scheduler

ALIVE_CHECK_S = 1.0  # how often a wait on the scheduler thread checks that the thread still runs


async def _scheduler(request: Request) -> Scheduler:  # async: a plain def would hop to a worker thread per request
    return request.app.state.engine


async def _spec(request: Request) -> GenerateSpec:
    return request.app.state.spec


EngineDep = Annotated[Scheduler, Depends(_scheduler)]
SpecDep = Annotated[GenerateSpec, Depends(_spec)]


async def on_engine(engine: Scheduler, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the scheduler thread and await its result."""
    return await engine_wait(engine, engine.call(fn))


async def engine_wait(
    engine: Scheduler, fut: Future | asyncio.Future, client: Request | None = None,
    on_gone: Callable[[], object] | None = None,
) -> Any:
    """Await what the scheduler thread settles (a request, a call): as long as that takes while the thread runs
    (a generation or a load waiting for one may take minutes, as in SGLang), an ``EngineFailure`` within
    ``ALIVE_CHECK_S`` once it has ended, since nothing would settle ``fut`` then. Cancelling the caller cancels
    ``fut``. Once ``client`` has closed its connection (checked every ``ALIVE_CHECK_S``: uvicorn never cancels
    the handler of a client that went away) ``on_gone`` runs, once, and the wait goes on."""
    waiter = asyncio.wrap_future(fut)
    try:
        while not (await asyncio.wait({waiter}, timeout=ALIVE_CHECK_S))[0]:
            if not engine.alive:
                waiter.cancel()
                raise EngineFailure("the engine's scheduler thread has ended; nothing it was given will finish")
            if client is not None and on_gone is not None and await client.is_disconnected():
                client = None
                on_gone()
    except asyncio.CancelledError:
        waiter.cancel()
        raise
    return waiter.result()


def object_error(message: str, status: int) -> JSONResponse:
    """SGLang's OpenAI-style error object."""
    body = {
        "object": "error",
        "message": message,
        "type": "Bad Request" if status == 400 else str(status),
        "param": None,
        "code": status,
    }
    return JSONResponse(body, status_code=status)


def result(ok: bool, message: str) -> JSONResponse:
    """SGLang's ``{success, message}`` reply, 400 on failure."""
    return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)
