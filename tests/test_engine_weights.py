"""Weight updates on the embedded engine over real HTTP: pause modes, versions, and which weights made
which token (each logprob is checked against a teacher-forced forward of the model that produced it)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import encode_named_tensors, metric, perturbed_model, post, teacher_forced, until
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from core.transformers_compat import CACHE_ARG
from rollout_server.engine.process import EngineProcess

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG = {"max_new_tokens": 800, "temperature": 0.8, "ignore_eos": True}
TOKENS = "rollwave_engine_generated_tokens_total"
ATTEMPTS = 5  # a request that finished before the pause (or load) it was meant for: started again


@pytest.fixture(scope="module")
def old_model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return perturbed_model(tiny_model_dir, tmp_path_factory.mktemp("new_model"), seed=1)


@pytest.fixture(scope="module")
def new_model(new_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, weight_version="v0", threads=1) as proc:
        yield proc.url


def load(url: str, model_dir: Path, version: str) -> None:
    resp = post(url, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": version})
    assert resp.status_code == 200 and resp.json()["success"], resp.text


def kept_kv(old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], output: list[int], k: int,
            temperature: float) -> torch.Tensor:
    """What an in_place swap after ``k`` tokens samples from: the old weights' KV of prompt + output[:k-1] (the
    k-th token was sampled, not yet fed), then the new weights over the rest on top of it. Logprobs of
    output[k:]."""
    with torch.no_grad():
        cache = old(input_ids=torch.tensor([prompt + output[: k - 1]]), use_cache=True)[CACHE_ARG]
        logits = new(input_ids=torch.tensor([output[k - 1 : -1]]), **{CACHE_ARG: cache}).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(output[k:])[:, None]).squeeze(1)


async def pause_in_flight(
    client: httpx.AsyncClient, url: str, body: dict, mode: str,
    before_pause: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[asyncio.Task, Any]:
    """Start ``body`` (one request that ignores EOS), run ``before_pause`` once it has sampled 20 tokens, then pause
    in ``mode``: the request's task, caught by the pause with tokens still to sample, and what ``before_pause``
    returned. The tiny model samples a thousand tokens a second or more, so a test process that stalls for half a
    second after seeing the 20 lets an 800-token request finish before its pause lands (a load then finds nothing
    in flight). The tokens sampled are read while paused, when nothing samples: a request that had none left was
    not caught, so it is let go and another started."""
    n = body["sampling_params"]["max_new_tokens"]
    for _ in range(ATTEMPTS):
        start = metric(url, TOKENS)
        task = asyncio.create_task(client.post("/generate", json=body))
        await until(url, TOKENS, start + 20)
        got = None if before_pause is None else await before_pause()
        await client.post("/pause_generation", json={"mode": mode})
        if metric(url, TOKENS) < start + n:
            return task, got
        await client.post("/continue_generation", json={})
        await task
    raise AssertionError(f"the request finished before its pause in each of {ATTEMPTS} attempts")


def span_across_update(url: str, mode: str, new_dir: Path, ahead: bool = False) -> dict:
    """Start a long request, pause in ``mode`` once it has produced tokens, load ``new_dir`` as v1, continue;
    ``ahead``: prepare ``new_dir`` first, with the running request's KV computed under it."""

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:

            async def prepare() -> httpx.Response:
                return await client.post("/prepare_weights_from_disk",
                                         json={"model_path": str(new_dir), "prefill_running": True})

            body = {"input_ids": PROMPT, "sampling_params": LONG, "return_logprob": True}
            task, prepared = await pause_in_flight(client, url, body, mode, prepare if ahead else None)
            if ahead:  # the request ran through the prepare: its KV was computed
                computed = int(prepared.json()["message"].split("KV of ")[1].split()[0])
                assert computed >= len(PROMPT) + 20, prepared.text
            reply = await client.post(
                "/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "v1"}
            )
            assert reply.json() == {
                "success": True,
                "num_paused_requests": 1,
                "message": "Succeeded to update model weights. Weight version updated to v1.",
            }
            await client.post("/continue_generation", json={})
            return (await task).json()

    return asyncio.run(run())


@pytest.mark.parametrize(("mode", "ahead"), [("retract", False), ("in_place", False), ("retract", True)])
def test_request_spanning_an_update_records_versions_and_right_logprobs(
    engine: str, tiny_model_dir: Path, new_dir: Path, old_model, new_model, mode: str, ahead: bool
) -> None:
    """``ahead``: the request's KV under the new weights was computed before the pause (kv_on_swap recompute with
    prepared weights), so its re-prefill runs only the tokens since, with the same logprobs as a full one."""
    load(engine, tiny_model_dir, "v0")
    stalls = "rollwave_engine_generation_stall_seconds_count"
    stalled = "rollwave_engine_generation_stall_seconds_sum"
    before, before_s = metric(engine, stalls), metric(engine, stalled)
    post(engine, "/pause_generation", {"mode": mode})  # nothing running: nothing stalls
    post(engine, "/continue_generation", {})
    assert metric(engine, stalls) == before
    out = span_across_update(engine, mode, new_dir, ahead)
    assert metric(engine, stalls) == before + 1  # the swap stalled the request once, measured to its next token
    assert 0 < metric(engine, stalled) - before_s < 60
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    assert n == LONG["max_new_tokens"] and meta["weight_version"] == "v1"
    (old, new) = meta["weight_versions"]
    k = old["end"]
    assert old == {"version": "v0", "start": 0, "end": k} and new == {"version": "v1", "start": k, "end": n}
    assert 0 < k < n
    assert meta["num_retractions"] == (1 if mode == "retract" else 0)
    assert (meta["cached_tokens"] >= len(PROMPT) + 20) == ahead  # the re-prefill started from the KV computed ahead
    got = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
    t = LONG["temperature"]
    want_old = teacher_forced(old_model, PROMPT, out["output_ids"], t)
    want_new = teacher_forced(new_model, PROMPT, out["output_ids"], t)
    assert (got[:k] - want_old[:k]).abs().max() <= 1e-4
    assert (want_old[k:] - want_new[k:]).abs().max() > 1e-2  # the two policies really differ
    if mode == "retract":  # the KV was dropped and recomputed by the new weights
        assert (got[k:] - want_new[k:]).abs().max() <= 1e-4
    else:  # in_place keeps the old weights' KV, as SGLang does
        kept = kept_kv(old_model, new_model, PROMPT, out["output_ids"], k, t)
        assert (got[k:] - kept).abs().max() <= 1e-4
        assert (got[k:] - want_new[k:]).abs().max() > 1e-3


def test_update_when_not_paused_waits_for_requests_in_flight(engine: str, tiny_model_dir: Path, new_dir: Path) -> None:
    """As in ``pause_in_flight``, the first request may finish before the load is queued (then nothing waits): the
    attempt is let go and made again from v0."""

    async def run() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as client:
            for _ in range(ATTEMPTS):
                load(engine, tiny_model_dir, "v0")
                start = metric(engine, TOKENS)
                first = asyncio.create_task(client.post(
                    "/generate", json={"input_ids": PROMPT, "sampling_params": LONG | {"max_new_tokens": 300}}))
                await until(engine, TOKENS, start + 1)
                update = asyncio.create_task(
                    client.post("/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "v1"})
                )
                while metric(engine, "rollwave_engine_pending_weight_updates") < 1 and not update.done():
                    await asyncio.sleep(0.005)
                if not update.done():  # the load waits for the first request, the later one for the load
                    later = await client.post(
                        "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
                    return (await first).json(), (await update).json(), later.json()
                await asyncio.gather(first, update)
            raise AssertionError(f"the first request finished before the load in each of {ATTEMPTS} attempts")

    first, update, later = asyncio.run(run())
    assert update["success"] and update["num_paused_requests"] == 0
    assert first["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": 300}]
    assert later["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 5}]


def test_pause_in_place_without_update_continues_on_the_same_weights(
    engine: str, tiny_model_dir: Path, old_model
) -> None:
    load(engine, tiny_model_dir, "v0")

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as client:
            body = {"input_ids": PROMPT, "sampling_params": LONG | {"max_new_tokens": 200}, "return_logprob": True}
            task, _ = await pause_in_flight(client, engine, body, "in_place")
            assert (await client.post("/flush_cache")).status_code == 400  # requests hold KV in place
            await asyncio.sleep(0.05)
            await client.post("/continue_generation", json={})
            return (await task).json()

    out = asyncio.run(run())
    assert out["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": 200}]
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - teacher_forced(old_model, PROMPT, out["output_ids"], LONG["temperature"])).abs().max() <= 1e-4


def test_failed_update_keeps_the_old_weights(engine: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    load(engine, tiny_model_dir, "v0")
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = post(engine, "/generate", greedy).json()["output_ids"]
    missing = post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope"), "weight_version": "x"})
    assert missing.status_code == 400 and missing.json()["success"] is False and "nope" in missing.json()["message"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    (tmp_path / "bad").mkdir()
    save_file(state, tmp_path / "bad" / "model.safetensors")
    bad = post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "bad"), "weight_version": "x"})
    assert bad.status_code == 400 and "model.layers.1.mlp.up_proj.weight" in bad.json()["message"]
    assert httpx.get(engine + "/model_info").json()["weight_version"] == "v0"
    assert post(engine, "/generate", greedy).json()["output_ids"] == before


def test_prepared_weights_serve_and_a_rewritten_directory_is_read_again(
    engine: str, tiny_model_dir: Path, new_dir: Path, old_model, new_model, tmp_path: Path
) -> None:
    """``/prepare_weights_from_disk`` reads and checks a directory ahead into spare parameters; the next update
    from it swaps them in and keeps what it served as the spare, unless its files changed since, then it reads
    them again."""

    def logprobs_match(model: torch.nn.Module) -> bool:
        sampling = {"max_new_tokens": 16, "temperature": 0.8}
        out = post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True})
        got = torch.tensor([e[0] for e in out.json()["meta_info"]["output_token_logprobs"]])
        return bool((got - teacher_forced(model, PROMPT, out.json()["output_ids"], 0.8)).abs().max() <= 1e-4)

    load(engine, tiny_model_dir, "v0")
    missing = post(engine, "/prepare_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and missing.json()["success"] is False and "nope" in missing.json()["message"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    (tmp_path / "bad").mkdir()
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file({**state, "model.norm.weight": torch.zeros(3)}, tmp_path / "bad" / "model.safetensors")
    bad = post(engine, "/prepare_weights_from_disk", {"model_path": str(tmp_path / "bad")})
    assert bad.status_code == 400 and "'model.norm.weight' has shape [3]" in bad.json()["message"], bad.text
    staged = tmp_path / "staged"
    shutil.copytree(new_dir, staged)
    ready = post(engine, "/prepare_weights_from_disk", {"model_path": str(staged)})
    assert ready.status_code == 200 and ready.json()["success"], ready.text
    load(engine, staged, "v1")
    assert logprobs_match(new_model)
    served = metric(engine, 'rollwave_engine_memory_bytes{kind="weights"}')
    assert metric(engine, 'rollwave_engine_memory_bytes{kind="spare_weights"}') == served  # swapped, not copied
    assert post(engine, "/prepare_weights_from_disk", {"model_path": str(staged)}).json()["success"]
    shutil.copyfile(tiny_model_dir / "model.safetensors", tmp_path / "old.safetensors")
    os.replace(tmp_path / "old.safetensors", staged / "model.safetensors")  # after the prepare
    load(engine, staged, "v2")
    assert logprobs_match(old_model)


def test_update_from_tensor_needs_a_session(engine: str, tiny_model_dir: Path, new_dir: Path, new_model) -> None:
    load(engine, tiny_model_dir, "v0")
    named = list(new_model.state_dict().items())
    body = {"serialized_named_tensors": [encode_named_tensors(named[:5])], "weight_version": "t1"}
    outside = post(engine, "/update_weights_from_tensor", body)
    assert outside.status_code == 400 and outside.json()["success"] is False
    assert "must run between begin_weight_update() and end_weight_update()" in outside.json()["message"]
    assert post(engine, "/begin_weight_update", {"selector": "all"}).json() == {"success": True, "message": "Success"}
    assert post(engine, "/begin_weight_update", {}).status_code == 400
    assert post(engine, "/update_weights_from_tensor", body).json()["success"]
    buf = io.BytesIO()
    torch.save(named[5:], buf)  # the other accepted format
    rest = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "weight_version": "t2"}
    assert post(engine, "/update_weights_from_tensor", rest).json()["success"]
    wrong = {"serialized_named_tensors": [encode_named_tensors([("model.no_such.weight", torch.zeros(2))])]}
    reply = post(engine, "/update_weights_from_tensor", wrong)
    assert reply.status_code == 400 and "model.no_such.weight" in reply.json()["message"]
    assert post(engine, "/end_weight_update", {}).json()["success"]
    assert post(engine, "/end_weight_update", {}).status_code == 400
    assert httpx.get(engine + "/model_info").json()["weight_version"] == "t2"
    out = post(
        engine,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True},
    ).json()
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - teacher_forced(new_model, PROMPT, out["output_ids"], 1.0)).abs().max() <= 1e-4


def test_update_weight_version_and_flush_while_retracted(engine: str) -> None:
    reply = post(engine, "/update_weight_version", {"new_version": "v9", "abort_all_requests": False}).json()
    assert reply == {"success": True, "message": "Weight version updated to v9", "new_version": "v9"}
    assert httpx.get(engine + "/model_info").json()["weight_version"] == "v9"

    async def run() -> tuple[int, dict]:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as client:
            body = {"input_ids": PROMPT, "sampling_params": LONG | {"max_new_tokens": 200}}
            task, _ = await pause_in_flight(client, engine, body, "retract")
            flushed = (await client.post("/flush_cache")).status_code  # queued requests do not count while paused
            await client.post("/continue_generation", json={})
            return flushed, (await task).json()

    flushed, out = asyncio.run(run())
    assert flushed == 200
    assert out["meta_info"]["num_retractions"] == 1 and out["meta_info"]["completion_tokens"] == 200
