"""The embedded engine's HTTP server: SGLang's native API (``srt/entrypoints/http_server.py``) over a
``Scheduler``. Handlers only parse, submit and wait; the scheduler thread does all model work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollout_server.engine.protocol import (
    AbortReq,
    ContinueGenerationReq,
    ContractError,
    GenerateSpec,
    PauseGenerationReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightVersionReq,
    WeightUpdateSessionReq,
    build_requests,
)
from rollout_server.engine.request import Request as EngineRequest
from rollout_server.engine.sampling import SamplingParams
from rollout_server.engine.scheduler import EngineFailure, Scheduler
from rollout_server.engine.weights import WeightError, decode_named_tensors, read_hf_dir

HEALTH_CHECK_TIMEOUT_S = 20.0
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
SESSION_REQUIRED = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"


class _WeightSession:
    """The 0.5.23 weight-update session: ``update_weights_from_tensor`` only between begin and end."""

    def __init__(self) -> None:
        self.open = False


def create_app(engine: Scheduler, spec: GenerateSpec) -> FastAPI:
    """The FastAPI app; its lifespan starts and closes ``engine``."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(lifespan=lifespan, title="rollwave embedded engine")
    session = _WeightSession()

    async def on_engine(fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(engine.call(fn))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        exc_str, errors_str = str(exc), str(exc.errors())
        message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
        return _object_error(message, 400)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestValidationError(
                [{"loc": ("body",), "msg": f"JSON decode error: {exc}", "type": "json_invalid"}]
            ) from None
        try:
            reqs, batch = build_requests(body, spec)
            engine.submit(reqs)
        except ContractError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        try:
            done = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in reqs))
        except asyncio.CancelledError:  # the client went away: free the batch slots
            rids = {r.rid for r in reqs}
            engine.call(lambda: engine.abort_where(lambda r: r.rid in rids))
            raise
        except EngineFailure as exc:
            return _object_error(f"engine failure: {exc}", 500)
        replies = [r.reply(spec.tokenizer) for r in done]
        return JSONResponse(replies if batch else replies[0])

    @app.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReq) -> dict[str, str]:
        await on_engine(lambda: engine.pause(obj.mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(obj: ContinueGenerationReq) -> dict[str, str]:
        await on_engine(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def load(
        tensors_fn: Callable[[], dict],
        *,
        require_all: bool,
        model_path: str | None,
        version: str | None,
        abort_all: bool,
    ) -> tuple[bool, str, int]:
        if abort_all:
            await on_engine(lambda: engine.abort(None))
        try:
            tensors = await asyncio.to_thread(tensors_fn)
        except WeightError as exc:
            return False, f"Failed to update weights: {exc}. Rolled back to the previous weights.", 0

        def apply() -> int:
            paused = engine.in_flight() if engine.paused else 0
            engine.load_weights(tensors, require_all=require_all, model_path=model_path, version=version)
            return paused

        try:
            num_paused = await asyncio.wrap_future(engine.call_when_idle(apply))
        except WeightError as exc:
            return False, f"Failed to update weights: {exc}. Rolled back to the previous weights.", 0
        suffix = f" Weight version updated to {version}." if version is not None else ""
        return True, "Succeeded to update model weights." + suffix, num_paused

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightsFromDiskReq) -> JSONResponse:
        if obj.load_format not in (None, "auto", "safetensors"):
            ok, msg, n = False, f"load_format {obj.load_format!r} is not supported (use safetensors)", 0
        else:
            ok, msg, n = await load(
                lambda: read_hf_dir(obj.model_path),
                require_all=True,
                model_path=obj.model_path,
                version=obj.weight_version,
                abort_all=obj.abort_all_requests,
            )
        body = {"success": ok, "message": msg, "num_paused_requests": n}
        return JSONResponse(body, status_code=200 if ok else 400)

    @app.post("/begin_weight_update")
    async def begin_weight_update(obj: WeightUpdateSessionReq) -> JSONResponse:
        if session.open:
            return _result(False, "A weight update session is already open; call end_weight_update() first")
        session.open = True
        return _result(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(obj: WeightUpdateSessionReq) -> JSONResponse:
        if not session.open:
            return _result(False, "No weight update session is open; call begin_weight_update() first")
        session.open = False
        return _result(True, "Success")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReq) -> JSONResponse:
        if not session.open:
            return _result(False, SESSION_REQUIRED)
        if obj.load_format not in (None, "direct"):
            return _result(False, f"load_format {obj.load_format!r} is not supported (use null or 'direct')")
        if len(obj.serialized_named_tensors) != 1:
            return _result(
                False,
                f"serialized_named_tensors has {len(obj.serialized_named_tensors)} items; "
                "the embedded engine has one rank and takes exactly one",
            )
        payload = obj.serialized_named_tensors[0]
        ok, msg, _ = await load(
            lambda: decode_named_tensors(payload),
            require_all=False,
            model_path=None,
            version=obj.weight_version,
            abort_all=obj.abort_all_requests,
        )
        return _result(ok, msg)

    @app.post("/update_weight_version")
    async def update_weight_version(obj: UpdateWeightVersionReq) -> dict[str, Any]:
        if obj.abort_all_requests:
            await on_engine(lambda: engine.abort(None))
        await on_engine(lambda: engine.set_version(obj.new_version))
        return {
            "success": True,
            "message": f"Weight version updated to {obj.new_version}",
            "new_version": obj.new_version,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await on_engine(engine.idle)
        return Response(FLUSH_TEXT, status_code=200 if ok else 400, media_type="text/plain")

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        if obj.abort_all or obj.rid:
            rid = None if obj.abort_all else obj.rid
            await on_engine(lambda: engine.abort(rid))
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.alive:
            return Response(status_code=503)
        if engine.paused is not None:  # SGLang's probe would block until continue; report the thread instead
            return Response(status_code=200)
        probe = EngineRequest(
            rid=f"HEALTH_CHECK_{time.time()}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            return_logprob=False,
            stop_ids=frozenset(),
            stop_window=1,
        )
        engine.submit([probe])
        try:
            await asyncio.wait_for(asyncio.wrap_future(probe.future), HEALTH_CHECK_TIMEOUT_S)
        except (TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if engine.alive and engine.paused is None else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        cfg = engine.model.config
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "tokenizer_path": engine.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.version,
            "load_format": "safetensors",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": list(cfg.architectures or []),
            "max_context": engine.max_context,
            "max_batch_size": engine.max_batch_size,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _object_error(message: str, status: int) -> JSONResponse:
    body = {
        "object": "error",
        "message": message,
        "type": "Bad Request" if status == 400 else str(status),
        "param": None,
        "code": status,
    }
    return JSONResponse(body, status_code=status)


def _result(ok: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)
