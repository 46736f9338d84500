"""``/release_memory_occupation`` and ``/resume_memory_occupation``: SGLang's bodies and replies (200 with a
``null`` body; 400 ``{"error": {"message"}}`` when refused or for an unknown tag)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rollout_server.engine.memory import parse_tags
from rollout_server.engine.protocol import MemoryOccupationReq
from rollout_server.engine.routes import EngineDep, on_engine

router = APIRouter()


async def _apply(engine_fn: Callable[[tuple[str, ...]], None], obj: MemoryOccupationReq, engine: EngineDep
                 ) -> JSONResponse:
    try:
        tags = parse_tags(obj.tags)
        await on_engine(engine, lambda: engine_fn(tags))
    except ValueError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    return JSONResponse(None)


@router.post("/release_memory_occupation")
async def release_memory_occupation(obj: MemoryOccupationReq, engine: EngineDep) -> JSONResponse:
    return await _apply(engine.release_memory, obj, engine)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(obj: MemoryOccupationReq, engine: EngineDep) -> JSONResponse:
    return await _apply(engine.resume_memory, obj, engine)
