"""Warms the agent fork server: importing this module runs a few canned chats through the ``openai`` client.

The client imports most of its modules and fills its caches on its first call, not when ``openai`` is imported,
so every sample's process paid for them again (about 60 of its 115 ms of CPU here; ``bench/agent_fork.py``).
Imported in the fork server (``agent_runner.start_fork_server``), the chats run there once, against
``canned_openai_server`` on a loopback port of its own that closes when they are done: the async and the
sync client, a tool call, a plain answer and a stream, as agents use them. A warm-up that fails only costs
that time: it prints why and the fork server starts as before.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
from aiohttp import web

from core.tasks.arith import CALCULATOR_SCHEMA

WARMUP_TIMEOUT_S = 30.0


def _completion(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {"id": "warmup", "object": "chat.completion", "created": 0, "model": "warmup",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


async def _chat(request: web.Request) -> web.StreamResponse:
    """A tool call to the first message, a plain answer after it; SSE chunks when asked to stream."""
    body = await request.json()
    if body.get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "warmup", "object": "chat.completion.chunk", "created": 0, "model": "warmup",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "5"}, "finish_reason": "stop"}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response
    if len(body["messages"]) == 1:
        call = {"id": "call-0", "type": "function", "function": {"name": "calculator",
                                                                   "arguments": '{"expression": "2+3"}'}}
        return web.json_response(_completion({"role": "assistant", "content": None, "tool_calls": [call]},
                                             "tool_calls"))
    return web.json_response(_completion({"role": "assistant", "content": "5"}, "stop"))


@asynccontextmanager
async def canned_openai_server() -> AsyncIterator[str]:
    """An OpenAI-compatible ``/v1/chat/completions`` with canned replies on 127.0.0.1; yields its base URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


def _sync_chat(base_url: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="warmup", max_retries=0, timeout=10) as client:
        client.chat.completions.create(model="warmup", messages=[{"role": "user", "content": "2+3?"}],
                                       tools=[CALCULATOR_SCHEMA])


async def _chats() -> None:
    async with canned_openai_server() as base_url:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="warmup", max_retries=0, timeout=10) as client:
            messages: list[Any] = [{"role": "user", "content": "2+3?"}]
            reply = await client.chat.completions.create(model="warmup", messages=messages, tools=[CALCULATOR_SCHEMA])
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": "call-0", "content": "5"})
            await client.chat.completions.create(model="warmup", messages=messages, tools=[CALCULATOR_SCHEMA])
            async for _ in await client.chat.completions.create(model="warmup", messages=messages, stream=True):
                pass
        await asyncio.to_thread(_sync_chat, base_url)


def warm() -> bool:
    """Run the canned chats; False (and why, on stderr) when they fail or outlast ``WARMUP_TIMEOUT_S``."""
    try:
        asyncio.run(asyncio.wait_for(_chats(), WARMUP_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a warm-up that fails must not stop the fork server
        print("agent fork server: the openai warm-up failed; samples will start slower:\n"
              + traceback.format_exc(), file=sys.stderr)
        return False
    return True


warm()
