"""Releasing and resuming the embedded engine's memory over real HTTP, in the order a colocated trainer uses
(pause -> release all -> resume weights -> update weights -> resume KV -> continue), and every refusal."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import metric, perturbed_model, post, teacher_forced, until
from transformers import AutoModelForCausalLM

from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineError

PROMPT = [5, 17, 42, 99, 7, 300, 12]
WEIGHTS = 'rollwave_engine_memory_bytes{kind="weights"}'
KV = 'rollwave_engine_memory_bytes{kind="kv_cache"}'


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return perturbed_model(tiny_model_dir, tmp_path_factory.mktemp("new_model"), seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        yield proc.url


def refused(url: str, path: str, body: dict, needle: str) -> None:
    resp = post(url, path, body)
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert needle in (body["error"]["message"] if "error" in body else body["message"]), resp.text


def test_release_frees_weights_and_kv_and_nothing_generates_until_the_new_weights_are_in(
    engine: str, new_dir: Path
) -> None:
    full = metric(engine, WEIGHTS)
    assert full > 0

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as http, EngineClient(engine) as client:
            body = {"input_ids": PROMPT, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0.7, "ignore_eos": True}}
            task = asyncio.create_task(http.post("/generate", json=body))
            await until(engine, "rollwave_engine_generated_tokens_total", 20)
            assert metric(engine, KV) > 0
            await client.pause("in_place")  # keeps the KV: releasing kv_cache must retract it
            await client.release_memory()
            assert metric(engine, WEIGHTS) == 0 and metric(engine, KV) == 0
            tokens = metric(engine, "rollwave_engine_generated_tokens_total")
            refused(engine, "/continue_generation", {}, "released")
            refused(engine, "/update_weights_from_disk", {"model_path": str(new_dir)}, "released")
            await client.resume_memory(["weights"])
            assert metric(engine, WEIGHTS) == full
            refused(engine, "/continue_generation", {}, "not loaded")
            await client.update_weights_from_disk(str(new_dir), "1")
            refused(engine, "/continue_generation", {}, "['cuda_graph', 'kv_cache'] is released")
            await client.resume_memory(["kv_cache", "cuda_graph"])
            await asyncio.sleep(0.3)
            assert metric(engine, "rollwave_engine_generated_tokens_total") == tokens  # still paused
            await client.resume()
            return (await task).json()

    out = asyncio.run(run())
    meta = out["meta_info"]
    assert meta["num_retractions"] == 1 and meta["completion_tokens"] == 400
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    cut = spans[1]["start"]
    expected = teacher_forced(new_model, PROMPT + out["output_ids"][:cut], out["output_ids"][cut:], 0.7)
    got = torch.tensor([e[0] for e in meta["output_token_logprobs"][cut:]])
    assert (got - expected).abs().max() <= 1e-4  # the re-prefill ran on the new weights, not on garbage
    assert metric(engine, 'rollwave_engine_refused_total{call="continue_generation"}') == 3
    assert metric(engine, 'rollwave_engine_refused_total{call="update_weights"}') == 1


def test_release_needs_a_pause_and_known_tags(engine: str, tiny_model_dir: Path) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as http, EngineClient(engine) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
            task = asyncio.create_task(http.post("/generate", json=body))
            await until(engine, "rollwave_engine_running_requests", 1)
            with pytest.raises(EngineError, match="in flight: pause_generation first"):
                await client.release_memory(["kv_cache"])
            with pytest.raises(EngineError, match=r"unknown \['activations'\]"):
                await client.release_memory(["weights", "activations"])
            assert metric(engine, WEIGHTS) > 0  # nothing was released by either
            assert (await task).json()["meta_info"]["completion_tokens"] == 300

    asyncio.run(run())
    assert metric(engine, 'rollwave_engine_refused_total{call="release_memory_occupation"}') == 1
    # idle and not paused (SGLang's condition): the release pauses, so a request queues until continue
    assert post(engine, "/release_memory_occupation", {"tags": ["weights"]}).json() is None
    assert post(engine, "/resume_memory_occupation", {"tags": None}).json() is None

    async def queued() -> dict:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as http:
            task = asyncio.create_task(http.post("/generate", json={"input_ids": PROMPT,
                                                                    "sampling_params": {"max_new_tokens": 4}}))
            await until(engine, "rollwave_engine_waiting_requests", 1)
            refused(engine, "/continue_generation", {}, "not loaded")
            assert not task.done()
            load = {"model_path": str(tiny_model_dir), "weight_version": "2"}
            assert post(engine, "/update_weights_from_disk", load).json()["success"]
            assert post(engine, "/continue_generation", {}).status_code == 200
            return (await task).json()

    assert asyncio.run(queued())["meta_info"]["weight_version"] == "2"
