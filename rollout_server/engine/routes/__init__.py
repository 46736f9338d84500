"""The embedded engine's HTTP routes, one router per concern: generation, weights, health and info.

Handlers only parse, submit and wait; the scheduler thread does all model work. They reach the
scheduler and the generation spec through ``app.state`` (set by ``create_app``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.scheduler import Scheduler


async def _scheduler(request: Request) -> Scheduler:  # async: a plain def would hop to a worker thread per request
    return request.app.state.engine


async def _spec(request: Request) -> GenerateSpec:
    return request.app.state.spec


EngineDep = Annotated[Scheduler, Depends(_scheduler)]
SpecDep = Annotated[GenerateSpec, Depends(_spec)]


async def on_engine(engine: Scheduler, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the scheduler thread and await its result."""
    return await asyncio.wrap_future(engine.call(fn))


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
