"""Pause and continue, and the weight updates: from disk (prepared ahead or not), from tensors (in a 0.5.23
session), version only."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rollout_server.engine.memory import PreparedWeights
from rollout_server.engine.protocol import (
    ContinueGenerationReq,
    PauseGenerationReq,
    PrepareWeightsFromDiskReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightVersionReq,
    WeightUpdateSessionReq,
)
from rollout_server.engine.routes import EngineDep, engine_wait, on_engine, result
from rollout_server.engine.scheduler import Scheduler
from rollout_server.engine.weights import WeightError, check_tensors, decode_named_tensors, read_hf_dir

SESSION_REQUIRED = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"

router = APIRouter()


class WeightSession:
    """The 0.5.23 weight-update session: ``update_weights_from_tensor`` only between begin and end."""

    def __init__(self) -> None:
        self.open = False


def _session(request: Request) -> WeightSession:
    return request.app.state.weight_session


def _prepared_key(path: str) -> tuple:
    """What a prepared set is valid for: the directory, with its safetensors files' names, sizes and mtimes."""
    try:
        stats = [(f.name, f.stat()) for f in Path(path).glob("*.safetensors")]
    except OSError as exc:  # a file removed while we look
        raise WeightError(f"model_path {path}: {exc}") from exc
    return path, tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


@router.post("/pause_generation")
async def pause_generation(obj: PauseGenerationReq, engine: EngineDep) -> dict[str, str]:
    await on_engine(engine, lambda: engine.pause(obj.mode))
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(obj: ContinueGenerationReq, engine: EngineDep) -> JSONResponse:
    """Refused (400) while memory is released or resumed weights are not loaded again."""
    try:
        await on_engine(engine, engine.resume)
    except ValueError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def _load(
    engine: Scheduler,
    tensors_fn: Callable[[], dict[str, torch.Tensor] | PreparedWeights],
    *,
    require_all: bool,
    model_path: str | None,
    version: str | None,
    abort_all: bool,
    flush_cache: bool,
) -> tuple[bool, str, int]:
    """Read the tensors off the event loop, then swap them in once the scheduler is between steps."""
    if abort_all:
        await on_engine(engine, lambda: engine.abort(None))
    try:
        tensors = await asyncio.to_thread(tensors_fn)
    except WeightError as exc:
        return False, f"Failed to update weights: {exc}. Rolled back to the previous weights.", 0

    def apply() -> int:
        paused = engine.in_flight() if engine.paused else 0
        engine.load_weights(tensors, require_all=require_all, model_path=model_path, version=version,
                            flush_cache=flush_cache)
        return paused

    try:
        num_paused = await engine_wait(engine, engine.call_when_idle(apply))
    except WeightError as exc:
        return False, f"Failed to update weights: {exc}. Rolled back to the previous weights.", 0
    suffix = f" Weight version updated to {version}." if version is not None else ""
    return True, "Succeeded to update model weights." + suffix, num_paused


@router.post("/prepare_weights_from_disk")
async def prepare_weights_from_disk(obj: PrepareWeightsFromDiskReq, engine: EngineDep) -> JSONResponse:
    """Read and check ``model_path`` and copy it into the spare parameters now, off the scheduler thread, so
    the next update from it (while its files are unchanged) swaps them in without copying; with
    ``prefill_running``, answer once the running requests' KV under it is computed too."""
    def prepare() -> tuple[int, PreparedWeights | None]:
        key = _prepared_key(obj.model_path)
        tensors = read_hf_dir(obj.model_path)
        check_tensors(engine.model, tensors, require_all=True)
        return len(tensors), engine.memory.prepare(key, tensors)

    try:
        count, prepared = await asyncio.to_thread(prepare)
    except WeightError as exc:
        return result(False, f"Failed to prepare weights: {exc}")
    message = f"Prepared {count} tensors from {obj.model_path}"
    if obj.prefill_running:
        tokens = await engine_wait(engine, engine.prefill_ahead(prepared))
        message += f"; computed the KV of {tokens} tokens of running requests under them"
    return result(True, message)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(obj: UpdateWeightsFromDiskReq, engine: EngineDep) -> JSONResponse:
    try:
        ready = engine.memory.take_prepared(_prepared_key(obj.model_path))
    except WeightError:
        ready = None  # the load reads the directory and reports what is wrong with it
    if obj.load_format not in (None, "auto", "safetensors"):
        ok, msg, n = False, f"load_format {obj.load_format!r} is not supported (use safetensors)", 0
    else:
        ok, msg, n = await _load(
            engine,
            lambda: read_hf_dir(obj.model_path) if ready is None else ready,
            require_all=True,
            model_path=obj.model_path,
            version=obj.weight_version,
            abort_all=obj.abort_all_requests,
            flush_cache=obj.flush_cache,
        )
    body = {"success": ok, "message": msg, "num_paused_requests": n}
    return JSONResponse(body, status_code=200 if ok else 400)


@router.post("/begin_weight_update")
async def begin_weight_update(obj: WeightUpdateSessionReq, request: Request) -> JSONResponse:
    session = _session(request)
    if session.open:
        return result(False, "A weight update session is already open; call end_weight_update() first")
    session.open = True
    return result(True, "Success")


@router.post("/end_weight_update")
async def end_weight_update(obj: WeightUpdateSessionReq, request: Request) -> JSONResponse:
    session = _session(request)
    if not session.open:
        return result(False, "No weight update session is open; call begin_weight_update() first")
    session.open = False
    return result(True, "Success")


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    obj: UpdateWeightsFromTensorReq, request: Request, engine: EngineDep
) -> JSONResponse:
    if not _session(request).open:
        return result(False, SESSION_REQUIRED)
    if obj.load_format not in (None, "direct"):
        return result(False, f"load_format {obj.load_format!r} is not supported (use null or 'direct')")
    if len(obj.serialized_named_tensors) != 1:
        return result(
            False,
            f"serialized_named_tensors has {len(obj.serialized_named_tensors)} items; "
            "the embedded engine has one rank and takes exactly one",
        )
    payload = obj.serialized_named_tensors[0]
    ok, msg, _ = await _load(
        engine,
        lambda: decode_named_tensors(payload),
        require_all=False,
        model_path=None,
        version=obj.weight_version,
        abort_all=obj.abort_all_requests,
        flush_cache=obj.flush_cache,
    )
    return result(ok, msg)


@router.post("/update_weight_version")
async def update_weight_version(obj: UpdateWeightVersionReq, engine: EngineDep) -> dict[str, Any]:
    if obj.abort_all_requests:
        await on_engine(engine, lambda: engine.abort(None))
    await on_engine(engine, lambda: engine.set_version(obj.new_version))
    return {
        "success": True,
        "message": f"Weight version updated to {obj.new_version}",
        "new_version": obj.new_version,
    }
