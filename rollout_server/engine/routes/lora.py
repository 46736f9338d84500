"""``/load_lora_adapter`` and ``/unload_lora_adapter``, SGLang's shapes (``{success, error_message,
loaded_adapters}``, 400 on failure) plus ``checksums`` (``core.lora.adapter_checksum`` of each adapter as read).

Unlike SGLang, loading a name that is already loaded replaces that adapter: the checkpoint receiver pushes each
new version of the policy's adapter under one name. The adapter is read and checked off the scheduler thread;
installing it waits, like a weight load, for the requests in flight (at once while paused). Unloading aborts the
requests that still name the adapter.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rollout_server.engine.lora import read_adapter
from rollout_server.engine.protocol import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from rollout_server.engine.routes import EngineDep, engine_wait
from rollout_server.engine.scheduler import Scheduler
from rollout_server.engine.weights import WeightError

router = APIRouter()


def _reply(engine: Scheduler, error: str = "") -> JSONResponse:
    info = engine.adapters.info()
    body = {"success": not error, "error_message": error,
            "loaded_adapters": {name: a["path"] for name, a in info.items()},
            "checksums": {name: a["checksum"] for name, a in info.items()}}
    return JSONResponse(body, status_code=400 if error else 200)


@router.post("/load_lora_adapter")
async def load_lora_adapter(obj: LoadLoRAAdapterReq, engine: EngineDep) -> JSONResponse:
    try:
        adapter = await asyncio.to_thread(read_adapter, engine.model, obj.lora_path)
    except WeightError as exc:
        return _reply(engine, f"Failed to load LoRA adapter {obj.lora_name!r}: {exc}")
    await engine_wait(engine, engine.call_when_idle(lambda: engine.install_adapter(obj.lora_name, adapter)))
    return _reply(engine)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(obj: UnloadLoRAAdapterReq, engine: EngineDep) -> JSONResponse:
    if obj.lora_name not in engine.adapters.loaded:
        return _reply(engine, f"LoRA adapter {obj.lora_name!r} is not loaded")
    await engine_wait(engine, engine.call_when_idle(lambda: engine.remove_adapter(obj.lora_name)))
    return _reply(engine)
