"""Helpers shared by the engine tests: raw HTTP calls, /metrics polling, teacher-forced logprobs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import torch


def post(url: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120.0, **kw)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def until(url: str, name: str, at_least: float, timeout_s: float = 60.0) -> None:
    """Poll a /metrics value until it reaches ``at_least`` (a test fails rather than hangs)."""
    deadline = time.monotonic() + timeout_s
    while metric(url, name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        await asyncio.sleep(0.005)


def teacher_forced(model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token under one forward over prompt + output."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)
