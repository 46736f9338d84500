"""Helpers shared by the engine tests: raw HTTP calls, /metrics polling, teacher-forced logprobs."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from rollout_server.engine.request import Request
from rollout_server.engine.sampling import SamplingParams


def encode_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One ``serialized_named_tensors`` element in the embedded engine's own format (base64 safetensors;
    SGLang's is its MultiprocessingSerializer, which rollwave never sends)."""
    return base64.b64encode(save({name: t.contiguous() for name, t in named_tensors})).decode("ascii")


def post(url: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120.0, **kw)


def metric(url: str, name: str, missing: float | None = None) -> float:
    """A /metrics sample by its full name and labels; ``missing`` while it has none (a labelled counter before its
    first count; None: an error)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    if missing is None:
        raise AssertionError(f"{name} not in /metrics")
    return missing


def wait_for(url: str, name: str, want: float, timeout_s: float = 30.0) -> None:
    """Poll a /metrics counter (0 before its first count) until it is ``want`` (a test fails rather than hangs)."""
    deadline = time.monotonic() + timeout_s
    while (now := metric(url, name, 0.0)) != want:
        assert time.monotonic() < deadline, f"{name} never became {want} (now {now})"
        time.sleep(0.02)


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


def perturbed_model(model_dir: Path, out: Path, seed: int) -> Path:
    """``model_dir``'s model with every weight perturbed, saved to ``out``: a different policy, the same shapes."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def greedy_request(rid: str, ids: list[int], n: int = 10) -> Request:
    """A greedy request of ``n`` new tokens that ignores EOS, for a ``Scheduler`` driven directly."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return Request(rid=rid, input_ids=list(ids), params=params, return_logprob=True, stop_ids=frozenset(),
                   stop_window=1)
