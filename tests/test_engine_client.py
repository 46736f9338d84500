"""EngineClient against the real embedded engine, and against a stub of SGLang 0.5.6's HTTP shapes
(``/get_weight_version``, no ``weight_versions``, no weight-update session) for the version differences."""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from engine_helpers import encode_named_tensors
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from net_helpers import bound_socket, refused_port
from pydantic import SecretStr
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from core.config import CheckpointConfig
from rollout_server.agent_loop import turn_from_reply
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineError
from trainer.checkpoint_pusher import CheckpointPusher

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


def sglang_056_stub(with_version: bool = True, gate: asyncio.Event | None = None,
                    fault: Callable[[str], Awaitable[bool]] | None = None) -> tuple[FastAPI, list[str], list[dict]]:
    """SGLang 0.5.6's shapes: ``/get_weight_version``, replies without ``weight_versions`` and with
    ``total_retractions`` (the version reported is the one at the end of the request), pause, continue and
    ``update_weights_from_disk``, ``update_weights_from_tensor`` without a session; no ``/model_info``.
    ``/generate`` waits for ``gate`` when one is given; a call whose path ``fault`` (awaited first) says true
    answers 500 instead. ``app.state.paused``: paused and not continued since. Returns the app, the paths seen
    (and each pause's mode and each disk load's ``flush_cache``) and the bodies of ``/continue_generation``."""
    app = FastAPI()
    app.state.paused = False
    seen: list[str] = []
    continued: list[dict] = []
    state = {"version": "stub-v1"}

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]
        seen.append(request.url.path)
        if fault is not None and await fault(request.url.path):
            return JSONResponse({"error": {"message": f"{request.url.path} failed (the test's fault)"}},
                                status_code=500)
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
        if gate is not None:
            await gate.wait()
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

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: dict) -> dict:
        state["version"] = body.get("weight_version") or state["version"]
        seen.append(f"flush_cache {body['flush_cache']}")
        return {"success": True, "message": "Success"}

    @app.post("/pause_generation")
    async def pause_generation(body: dict) -> dict:
        seen.append(f"pause {body['mode']}")
        app.state.paused = True
        return {}

    @app.post("/continue_generation")
    async def continue_generation(body: dict) -> dict:
        continued.append(body)
        app.state.paused = False  # continuing an engine that is not paused does nothing, as on SGLang
        return {}

    return app, seen, continued


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
        app, seen, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as client:
            await client.wait_ready(10)
            assert await client.weight_version() == "stub-v1"
            out = await client.generate(PROMPT, {"max_new_tokens": 3})
            assert out["meta_info"]["weight_versions"] == [{"version": "stub-v1", "start": 0, "end": 3}]
            assert out["meta_info"]["weight_versions_approximate"] and out["meta_info"]["num_retractions"] == 0
            for version in ("stub-v2", "stub-v3"):
                assert (await client.update_weights_from_tensor(["payload"], weight_version=version))["success"]
            assert await client.weight_version() == "stub-v3"
            assert seen.count("/begin_weight_update") == 1 and "/end_weight_update" not in seen
            assert (await client.model_info())["model_path"] == "stub"

    asyncio.run(run())


def test_a_056_reply_across_a_pause_is_labelled_with_the_version_at_its_start() -> None:
    """A 0.5.6 reply says only the version at its end. A request that starts under version 1 and finishes after
    a swap to 2 is labelled 1 (the staleness is over-, never under-estimated) and marked approximate; the next
    request is labelled 2. Continue is sent with ``torch_empty_cache: false``."""

    async def run() -> None:
        gate = asyncio.Event()
        app, _, continued = sglang_056_stub(gate=gate)
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as client, \
                EngineClient(url, backoff_s=0.05) as receiver:
            await client.wait_ready(10)
            await receiver.update_weights_from_disk("/staged/v1", weight_version="1")
            assert await client.weight_version() == "1"
            request = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 3}))
            await asyncio.sleep(0.2)  # the request is in flight, held by the gate
            await receiver.pause("retract")
            await receiver.update_weights_from_disk("/staged/v2", weight_version="2")
            await receiver.resume()
            gate.set()
            out = await request
            assert out["meta_info"]["weight_version"] == "2"  # what the server says: the version at the end
            turn = turn_from_reply(out)
            assert turn.versions == [1, 1, 1] and turn.approximate
            assert turn_from_reply(await client.generate(PROMPT)).versions == [2, 2, 2]
            assert continued == [{"torch_empty_cache": False}]
            await receiver.resume(torch_empty_cache=True)
            assert continued[-1] == {"torch_empty_cache": True}

    asyncio.run(run())


@pytest.mark.parametrize(("empty_cache", "kv_on_swap"), [(False, "recompute"), (True, "keep")])
def test_a_commit_pauses_and_empties_the_cuda_cache_as_configured(
    tiny_model_dir: Path, tmp_path: Path, empty_cache: bool, kv_on_swap: str
) -> None:
    """A real push and Commit through the checkpoint receiver to an engine shaped like SGLang 0.5.6: the
    continue after the load says ``torch_empty_cache: false`` unless ``checkpoint.empty_cache_on_resume``; the
    pause retracts unless ``checkpoint.kv_on_swap: keep`` (in_place, and the load keeps the prefix cache); the
    engine has no prepare route (404), so the load reads the staged directory itself."""
    config = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                              empty_cache_on_resume=empty_cache, kv_on_swap=kv_on_swap)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    async def run() -> None:
        app, seen, continued = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            receiver = CheckpointReceiver(config, tiny_model_dir, engine, url, "stub")
            address = await receiver.start()
            pusher = CheckpointPusher(config, [address])
            try:
                pushed = await asyncio.to_thread(lambda: pusher.push_model(model, version=1).wait(60))
            finally:
                await asyncio.to_thread(pusher.close)
                await receiver.stop()
            assert pushed.ok, pushed.servers
            assert continued == [{"torch_empty_cache": empty_cache}]
            mode = "in_place" if kv_on_swap == "keep" else "retract"
            swap = ["/prepare_weights_from_disk", "/pause_generation", f"pause {mode}", "/update_weights_from_disk",
                    f"flush_cache {kv_on_swap == 'recompute'}", "/continue_generation"]
            assert [p for p in seen if p in swap or p.startswith(("pause ", "flush_cache "))] == swap

    asyncio.run(run())


def test_servers_without_versions_give_none() -> None:
    async def run() -> None:
        app, _, _ = sglang_056_stub(with_version=False)
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as client:
            await client.wait_ready(10)
            assert await client.weight_version() is None
            out = await client.generate(PROMPT)
            assert out["meta_info"]["weight_versions"] is None

    asyncio.run(run())


def test_wait_ready_logs_its_progress(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        with refused_port() as port:
            url = f"http://127.0.0.1:{port}"
            async with EngineClient(url, retries=0) as client:
                with caplog.at_level("INFO", logger="rollout_server.engine_client"), \
                        pytest.raises(EngineError) as exc:
                    await client.wait_ready(1.0, log_every_s=0.3)
        assert "not healthy after 1s" in str(exc.value) and url in str(exc.value)
        assert "(last probe: ClientConnectorError: " in str(exc.value), exc.value
        assert sum(f"waiting for the engine at {url} to be healthy" in r.getMessage() for r in caplog.records) >= 2

    asyncio.run(run())


def test_wait_ready_on_an_engine_that_never_answers_ends_in_its_time() -> None:
    """An engine that accepts and never answers (a hung process) held each probe 30 s: ``wait_ready(1)`` took 31 s
    and said only "not healthy". No probe outlasts the time left, and the error says the last one got no answer."""
    async def run() -> None:
        with bound_socket() as sock:
            sock.listen()  # the kernel accepts; nobody answers
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            async with EngineClient(url, retries=0) as client:
                start = time.monotonic()
                with pytest.raises(EngineError) as exc:
                    await client.wait_ready(1.0)
                took = time.monotonic() - start
        assert took < 20, took  # each probe held 30 s
        assert "not healthy after 1s (last probe: no answer within " in str(exc.value), exc.value

    asyncio.run(run())


def test_wait_ready_ends_at_once_on_an_answer_waiting_cannot_change() -> None:
    """A wrong key (401) or a URL that is no engine's (404, e.g. one ending /v1) was polled for all of
    ``engine.ready_timeout_s``, an hour by default, then said "not healthy". Each is an error at the first probe,
    naming the key or the URL; a 503 (an engine still starting) is waited through."""
    app = FastAPI()
    answers = iter([503, 503, 401])

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, status_code=next(answers))

    async def run() -> None:
        async with serve(app) as url:
            async with EngineClient(url, retries=0) as client:
                with pytest.raises(EngineError) as refused:
                    await client.wait_ready(3600)
            async with EngineClient(url + "/v1", retries=0) as client:
                with pytest.raises(EngineError) as missing:
                    await client.wait_ready(3600)
                assert not await client.health()
        assert refused.value.status == 401 and "engine.api_key" in str(refused.value), refused.value
        assert missing.value.status == 404 and "no /health here" in str(missing.value), missing.value

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
        app, _, _ = sglang_056_stub()
        async with (
            serve(app, sock, delay_s=0.5),
            EngineClient(f"http://127.0.0.1:{port}", retries=10, backoff_s=0.05) as client,
        ):
            out = await client.generate(PROMPT)  # refused at first, answered once the server is up
            assert out["output_ids"] == [1, 2, 3]

    asyncio.run(run())


def test_a_timeout_is_an_engine_error_naming_the_engine_and_the_call() -> None:
    async def run() -> None:
        gate = asyncio.Event()  # never set: /generate never answers
        app, _, _ = sglang_056_stub(gate=gate)
        async with serve(app) as url, EngineClient(url, timeout_s=0.3) as client:
            try:
                with pytest.raises(EngineError) as exc:
                    await client.generate(PROMPT)
            finally:
                gate.set()  # the server's shutdown waits for the request
            assert exc.value.status is None and exc.value.path == "/generate"
            assert str(exc.value) == f"/generate: {url}: no answer within 0.3 s"

    asyncio.run(run())


@asynccontextmanager
async def dropping_server(drop: Callable[[int], bool]) -> AsyncIterator[tuple[str, list[int]]]:
    """A bare HTTP/1.1 server answering ``{}`` on kept-alive connections; it drops (closes,
    unanswered) the request ``drop(n)`` names, ``n`` counting the requests on that connection from 0. Yields its
    URL and each connection's request count."""
    body = b"{}"
    counts: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts.append(0)
        conn = len(counts) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length[1]) if length else 0)
                counts[conn] += 1
                if drop(counts[conn] - 1):
                    # RST on the first connection (the client reads ClientOSError: reset by peer), a plain
                    # close after it (ServerDisconnectedError)
                    if conn == 0:
                        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                    struct.pack("ii", 1, 0))
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", counts


def test_a_connection_dropped_without_an_answer_is_replayed_once(caplog: pytest.LogCaptureFixture) -> None:
    """A kept-alive connection the engine closed as the request went out (its keep-alive ended while a busy
    rollout server was about to send on it) is replayed on a fresh connection, once."""
    async def run() -> None:
        async with dropping_server(lambda n: n == 1) as (url, counts), EngineClient(url) as client:
            with caplog.at_level("INFO", logger="rollout_server.engine_client"):
                await client.abort()
                await client.abort()  # dropped, then replayed (a POST: aiohttp itself replays only GETs)
            assert counts == [2, 1]
            assert f"{url}/abort_request: the connection dropped without an answer (ClientOSError)" in caplog.text
        async with dropping_server(lambda n: True) as (url, counts), EngineClient(url) as client:
            with pytest.raises(EngineError) as exc:
                await client.abort()
            assert counts == [1, 1]  # one replay, then the error
            assert exc.value.status is None and exc.value.path == "/abort_request"
            assert str(exc.value).startswith(f"/abort_request: {url}: ServerDisconnectedError")

    asyncio.run(run())
