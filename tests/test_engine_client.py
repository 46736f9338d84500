"""EngineClient against the real embedded engine, and against a stub of SGLang 0.5.6's HTTP shapes
(``/get_weight_version``, no ``weight_versions``, no weight-update session) for the version differences."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from net_helpers import bound_socket
from safetensors.torch import load_file

from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineError, encode_named_tensors

PROMPT = [5, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, weight_version="c0", threads=1) as proc:
        yield proc.url


def test_generate_and_weight_updates_against_the_embedded_engine(engine: str, tiny_model_dir: Path) -> None:
    async def run() -> None:
        async with EngineClient(engine) as client:
            assert await client.health()
            await client.wait_ready(5)
            assert await client.weight_version() == "c0"
            out = await client.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0}, rid="cl-1")
            assert out["meta_info"]["id"] == "cl-1" and len(out["meta_info"]["output_token_logprobs"]) == 5
            assert out["meta_info"]["weight_versions"] == [{"version": "c0", "start": 0, "end": 5}]
            batch = await client.generate([PROMPT, PROMPT[:3]], {"max_new_tokens": 2}, return_logprob=False)
            assert [b["meta_info"]["completion_tokens"] for b in batch] == [2, 2]

            await client.pause("retract")
            reply = await client.update_weights_from_disk(str(tiny_model_dir), weight_version="c1")
            assert reply["success"]
            await client.resume()
            assert await client.weight_version() == "c1"

            tensors = load_file(tiny_model_dir / "model.safetensors")
            reply = await client.update_weights_from_tensor([encode_named_tensors(tensors.items())], "c2")
            assert reply["success"] and await client.weight_version() == "c2"
            await client.update_weights_from_tensor([encode_named_tensors(list(tensors.items())[:2])], "c3")
            assert await client.weight_version() == "c3"  # the session was closed after each update
            await client.flush_cache()
            info = await client.model_info()
            assert info["weight_version"] == "c3"

    asyncio.run(run())


def test_abort_and_errors_carry_the_server_message(engine: str) -> None:
    async def run() -> None:
        async with EngineClient(engine) as client:
            long = asyncio.create_task(
                client.generate(PROMPT, {"max_new_tokens": 900, "ignore_eos": True}, rid="to-abort-1")
            )
            for _ in range(6000):
                if await _running(engine):
                    break
                await asyncio.sleep(0.01)
            await client.abort("to-abort")
            out = await long
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"]
            await client.abort()  # abort_all with nothing in flight is fine

            with pytest.raises(EngineError) as bad_key:
                await client.generate(PROMPT, {"seed": 1})
            assert bad_key.value.status == 400 and "unknown field `seed`" in bad_key.value.message
            with pytest.raises(EngineError) as too_long:
                await client.generate(PROMPT, {"max_new_tokens": 5000})
            assert too_long.value.status == 400 and "maximum context length" in too_long.value.message
            with pytest.raises(EngineError) as missing:
                await client.update_weights_from_disk("/nonexistent/model", weight_version="x")
            assert missing.value.status == 400 and "/nonexistent/model" in missing.value.message
            assert await client.weight_version() != "x"

    asyncio.run(run())


async def _running(url: str) -> bool:
    async with httpx.AsyncClient() as http:
        return "rollwave_engine_running_requests 1.0" in (await http.get(url + "/metrics")).text


def sglang_056_stub(with_version: bool = True) -> tuple[FastAPI, list[str]]:
    """SGLang 0.5.6's shapes: ``/get_weight_version``, replies without ``weight_versions`` and with
    ``total_retractions``, ``update_weights_from_tensor`` without a session; no ``/model_info``."""
    app = FastAPI()
    seen: list[str] = []
    state = {"version": "stub-v1"}

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]
        seen.append(request.url.path)
        return await call_next(request)

    if with_version:

        @app.get("/get_weight_version")
        async def get_weight_version() -> dict:
            return {"weight_version": state["version"]}

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {
            "model_path": "stub",
            "tokenizer_path": "stub",
            "is_generation": True,
            "preferred_sampling_params": None,
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(None)

    @app.post("/generate")
    async def generate(body: dict) -> dict:
        meta = {
            "id": "r",
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": 3,
            "total_retractions": 0,
            "output_token_logprobs": [[-0.5, 1, None], [-0.5, 2, None], [-0.5, 3, None]],
        }
        if with_version:
            meta["weight_version"] = state["version"]
        return {"text": "abc", "output_ids": [1, 2, 3], "meta_info": meta}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: dict) -> dict:
        state["version"] = body.get("weight_version") or state["version"]
        return {"success": True, "message": "Success"}

    return app, seen


@asynccontextmanager
async def serve(app: FastAPI, sock: socket.socket | None = None, delay_s: float = 0.0) -> AsyncIterator[str]:
    """Serve ``app`` on ``sock`` (bound, not yet listening: refused until the server starts) after ``delay_s``."""
    sock = sock or bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

    async def start() -> None:
        await asyncio.sleep(delay_s)
        await server.serve(sockets=[sock])

    task = asyncio.create_task(start())
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def test_sglang_056_shapes_are_normalised() -> None:
    async def run() -> None:
        app, seen = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as client:
            await client.wait_ready(10)
            assert await client.weight_version() == "stub-v1"
            out = await client.generate(PROMPT, {"max_new_tokens": 3})
            assert out["meta_info"]["weight_versions"] == [{"version": "stub-v1", "start": 0, "end": 3}]
            assert out["meta_info"]["num_retractions"] == 0
            for version in ("stub-v2", "stub-v3"):
                assert (await client.update_weights_from_tensor(["payload"], weight_version=version))["success"]
            assert await client.weight_version() == "stub-v3"
            assert seen.count("/begin_weight_update") == 1 and "/end_weight_update" not in seen
            assert (await client.model_info())["model_path"] == "stub"

    asyncio.run(run())


def test_servers_without_versions_give_none() -> None:
    async def run() -> None:
        app, _ = sglang_056_stub(with_version=False)
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as client:
            await client.wait_ready(10)
            assert await client.weight_version() is None
            out = await client.generate(PROMPT)
            assert out["meta_info"]["weight_versions"] is None

    asyncio.run(run())


def test_connection_errors_are_retried_then_reported() -> None:
    async def run() -> None:
        sock = bound_socket()
        port = sock.getsockname()[1]
        async with EngineClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as client:
            assert not await client.health()
            with pytest.raises(EngineError) as exc:
                await client.generate(PROMPT)
            assert exc.value.status is None and "cannot connect" in exc.value.message
            with pytest.raises(EngineError):
                await client.wait_ready(0.3)
        app, _ = sglang_056_stub()
        async with (
            serve(app, sock, delay_s=0.5),
            EngineClient(f"http://127.0.0.1:{port}", retries=10, backoff_s=0.05) as client,
        ):
            out = await client.generate(PROMPT)  # refused at first, answered once the server is up
            assert out["output_ids"] == [1, 2, 3]

    asyncio.run(run())
