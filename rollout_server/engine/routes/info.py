"""Health, readiness, model info and Prometheus metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollout_server.engine.request import Request as EngineRequest
from rollout_server.engine.routes import EngineDep
from rollout_server.engine.sampling import SamplingParams

HEALTH_CHECK_TIMEOUT_S = 20.0

router = APIRouter()


@router.get("/health")
async def health(engine: EngineDep) -> Response:
    return Response(status_code=200 if engine.alive else 503)


@router.get("/health_generate")
async def health_generate(engine: EngineDep) -> Response:
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


@router.get("/ready")
async def ready(engine: EngineDep) -> Response:
    return Response(status_code=200 if engine.alive and engine.paused is None else 503)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(engine: EngineDep) -> dict[str, Any]:
    cfg = engine.model.config
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.served_model_name,
        "tokenizer_path": engine.served_model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.version,
        "dtype": str(engine.model.dtype).removeprefix("torch."),  # not in SGLang's reply: the served dtype
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
        "lora_adapters": engine.adapters.info(),  # not in SGLang's reply: name -> path, checksum
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(engine: EngineDep) -> dict[str, Any]:
    """SGLang's server arguments under its own key names, for the ones this engine has (a client reads the
    context length and batch size here); ``internal_states`` has one entry, the one rank."""
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "served_model_name": engine.served_model_name,
        "weight_version": engine.version,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "context_length": engine.max_context,
        "max_running_requests": engine.max_batch_size,
        "max_prefill_tokens": engine.prefill_tokens,
        "skip_tokenizer_init": False,
        "internal_states": [{"paused": engine.paused is not None}],
    }


@router.get("/metrics")
async def metrics(engine: EngineDep) -> Response:
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)
