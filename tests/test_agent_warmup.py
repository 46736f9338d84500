"""The agent fork server's warm-up: it leaves the ``openai`` client's first-call imports loaded and nothing
running, and a warm-up that fails or hangs says why and lets the fork server start."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import openai
import pytest

from rollout_server import agent_warmup


def test_after_it_an_agent_imports_nothing_more() -> None:
    """What the fork server has loaded its samples do not load again: an episode of the calculator agent, run
    after the warm-up in the same process, imports no module (the client's first call imports dozens)."""
    code = """
import asyncio, sys, threading
import rollout_server.agents.calculator_agent as agent
cold = 'openai.resources.chat.completions' in sys.modules
from rollout_server import agent_warmup
before = set(sys.modules)
async def episode():
    async with agent_warmup.canned_openai_server() as url:
        await agent.run({'messages': [{'role': 'user', 'content': '2+3?'}]}, url, 'key')
asyncio.run(episode())
print(cold, sorted(set(sys.modules) - before), threading.active_count())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert (out.stdout, out.stderr) == ("False [] 1\n", "")


def test_the_canned_server_answers_a_tool_call_then_the_answer_and_closes() -> None:
    async def chat() -> str:
        async with agent_warmup.canned_openai_server() as base_url:
            async with openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=10) as client:
                user = {"role": "user", "content": "2+3?"}
                first = await client.chat.completions.create(model="m", messages=[user])
                [call] = first.choices[0].message.tool_calls
                assert call.function.name == "calculator"
                second = await client.chat.completions.create(model="m", messages=[
                    user, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "5"}])
                assert second.choices[0].message.content == "5"
        return base_url

    host, port = asyncio.run(chat()).removeprefix("http://").removesuffix("/v1").split(":")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5)


def test_a_failed_warm_up_says_why_and_returns(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("no client today")

    monkeypatch.setattr(openai, "AsyncOpenAI", refuse)
    assert agent_warmup.warm() is False
    err = capsys.readouterr().err
    assert "the openai warm-up failed; samples will start slower" in err and "no client today" in err


def test_a_hung_warm_up_times_out(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    async def hang() -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(agent_warmup, "_chats", hang)
    monkeypatch.setattr(agent_warmup, "WARMUP_TIMEOUT_S", 0.2)
    assert agent_warmup.warm() is False
    assert "TimeoutError" in capsys.readouterr().err
