"""``/generate``, ``/abort_request`` and ``/flush_cache``."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from rollout_server.engine.protocol import AbortReq, ContractError, build_requests
from rollout_server.engine.routes import EngineDep, SpecDep, engine_wait, object_error, on_engine
from rollout_server.engine.scheduler import EngineFailure

FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

log = logging.getLogger(__name__)
router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, engine: EngineDep, spec: SpecDep) -> Response:
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestValidationError(
            [{"loc": ("body",), "msg": f"JSON decode error: {exc}", "type": "json_invalid"}]
        ) from None
    try:
        reqs, batch = build_requests(body, spec)
        loaded = engine.adapters.loaded  # read only (the scheduler re-checks at enqueue)
        missing = next((r.lora for r in reqs if r.lora is not None and r.lora not in loaded), None)
        if missing is not None:
            raise ValueError(f"lora_path: LoRA adapter {missing!r} is not loaded (loaded: {sorted(loaded)})")
        engine.submit(reqs)
    except ContractError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    except ValueError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    mine = set(reqs)  # by identity: a rid may be in flight again, from another client, once one of these ended

    def abort() -> None:  # free their batch slots and KV: they end as aborted, with their partial output
        engine.call(lambda: engine.abort_where(lambda r: r in mine))

    def gone() -> None:
        log.info("the client of /generate %s closed its connection: aborting it", [r.rid for r in reqs])
        abort()

    try:
        done = await engine_wait(engine, asyncio.gather(*(asyncio.wrap_future(r.future) for r in reqs)),
                                 request, gone)
    except asyncio.CancelledError:  # the server shuts down
        abort()
        raise
    except EngineFailure as exc:
        return object_error(f"engine failure: {exc}", 500)
    replies = [r.reply(spec.tokenizer) for r in done]
    return JSONResponse(replies if batch else replies[0])


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(engine: EngineDep) -> Response:
    ok = await on_engine(engine, engine.flush_cache)
    return Response(FLUSH_TEXT, status_code=200 if ok else 400, media_type="text/plain")


@router.post("/abort_request")
async def abort_request(obj: AbortReq, engine: EngineDep) -> Response:
    if obj.abort_all or obj.rid:
        rid = None if obj.abort_all else obj.rid
        await on_engine(engine, lambda: engine.abort(rid))
    return Response(status_code=200)
