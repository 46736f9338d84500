"""LoRA pushes through the real pusher, checkpoint receiver and embedded engine process: only the adapter travels,
the engine serves it under ``model.lora.name`` to requests that name it, its logprobs match the trainer's forward
with the adapter, every commit is verified by the checksum the engine reports, and full weights after an adapter
unload it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from buffer_helpers import client
from engine_helpers import teacher_forced
from test_checkpoint_engine import (
    PROMPTS,
    TOKEN,
    WAIT_S,
    Fleet,
    commit_raw,
    greedy_reference,
    perturbed,
    stage_raw,
    status_of,
)
from transformers import AutoModelForCausalLM

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.replay import ReplayBuffer
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, CheckpointConfig, LoraConfig
from core.lora import ADAPTER_WEIGHTS, adapter_checksum
from core.tasks import load_tasks
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineError
from trainer.checkpoint_pusher import CheckpointPusher
from trainer.lora import adapter_config_json, adapter_metas, add_adapter, iter_adapter_params
from trainer.parallel import iter_full_params
from trainer.snapshot import BufferPool, model_metas, take_snapshot

ROOT = Path(__file__).resolve().parents[1]
LORA = LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
NAME = "policy"  # the receiver's adapter name (model.lora.name's default)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    stage_dir = Path("/dev/shm") / f"rollwave-lora-{tmp_path_factory.getbasetemp().name}"
    fleet = Fleet(tiny_model_dir, stage_dir, tmp_path_factory.mktemp("fleet"), size=1)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()
        shutil.rmtree(stage_dir, ignore_errors=True)


def lora_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The tiny model with an adapter whose B is random (a trained adapter changes what the model says)."""
    model = add_adapter(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LORA).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


def checksum_of(model: torch.nn.Module) -> str:
    return adapter_checksum(dict(iter_adapter_params(model)))  # type: ignore[arg-type]


def generate(url: str, adapter: str | None, temperature: float = 0.0) -> httpx.Response:
    body = {"input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"temperature": temperature, "max_new_tokens": 12, "ignore_eos": True}}
    if adapter is not None:
        body["lora_path"] = adapter
    return httpx.post(url + "/generate", json=body, timeout=WAIT_S)


def outputs(reply: httpx.Response) -> list[list[int]]:
    assert reply.status_code == 200, reply.text
    return [r["output_ids"] for r in reply.json()]


def test_adapter_push_serves_the_adapter_and_matches_the_trainer(fleet: Fleet, tiny_model_dir: Path) -> None:
    url = fleet.engines[0].url
    base = outputs(generate(url, None))
    model = lora_model(tiny_model_dir, seed=1)
    version = fleet.status(0).current_version + 1
    pusher = fleet.pusher()
    try:
        rnd = pusher.push_model(model, version)
        assert rnd is not None and rnd.wait(WAIT_S).ok, [r.error for r in rnd.servers]
        [result] = rnd.servers
        adapter_bytes = sum(m.nbytes for m in adapter_metas(model))
        full_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
        assert result.bytes == adapter_bytes < full_bytes / 10  # the adapter alone travelled
        status = fleet.status(0)
        assert status.current_version == version and status.adapter_checksum == checksum_of(model)

        # Greedy outputs change with the adapter, equal a full forward of the trainer's model, and requests that
        # name no adapter still get the base model.
        assert outputs(generate(url, NAME)) == greedy_reference(model) != base
        assert outputs(generate(url, None)) == base
        # Sampled tokens' logprobs are the trainer's forward with the adapter.
        for prompt, item in zip(PROMPTS, generate(url, NAME, temperature=1.0).json(), strict=True):
            engine = torch.tensor([lp for lp, _tok, _ in item["meta_info"]["output_token_logprobs"]])
            trainer = teacher_forced(model, prompt, item["output_ids"], 1.0)
            torch.testing.assert_close(engine, trainer, rtol=0, atol=1e-3)

        # The next version (another adapter) replaces it under the same name.
        second = lora_model(tiny_model_dir, seed=2)
        assert pusher.push_model(second, version + 1).wait(WAIT_S).ok
        assert outputs(generate(url, NAME)) == greedy_reference(second) != greedy_reference(model)
        assert fleet.status(0).adapter_checksum == checksum_of(second) != checksum_of(model)
    finally:
        pusher.close()


def test_a_corrupted_adapter_fails_verification(fleet: Fleet, tiny_model_dir: Path) -> None:
    """Bytes changed after the Stage (whose xxh3 digests they passed) reach the engine: the checksum the engine reports
    differs from what was pushed, and the pusher refuses the delivery, naming the stage and counting it."""
    model = lora_model(tiny_model_dir, seed=3)
    version = fleet.status(0).current_version + 1
    metas = adapter_metas(model)
    snapshot = take_snapshot(version, metas, iter_adapter_params(model), BufferPool(),  # type: ignore[arg-type]
                             adapter_config_json(model))
    stage_raw(fleet.addresses[0], snapshot.chunks(64 << 10))
    staged = fleet.config.stage_dir / "server0" / f"v{version}" / ADAPTER_WEIGHTS
    raw = bytearray(staged.read_bytes())
    raw[-1] ^= 0x40
    staged.write_bytes(raw)
    reply = commit_raw(fleet.addresses[0], version)
    assert reply.adapter_checksum and reply.adapter_checksum != snapshot.adapter_checksum

    pusher = fleet.pusher()
    try:  # the pusher, offering this version again, finds it served with other bytes
        rnd = pusher.push(metas, iter_adapter_params(model), version, adapter_config_json(model))  # type: ignore[arg-type]
        [result] = rnd.wait(WAIT_S).servers
        assert not result.ok and (result.stage, result.reason) == ("verify", "mismatch"), result
        assert snapshot.adapter_checksum in result.error and reply.adapter_checksum in result.error
        failures = pusher.metrics.failures.labels(stage="verify", reason="mismatch")
        assert failures._value.get() == 1
    finally:
        pusher.close()


def test_full_weights_after_an_adapter_unload_it(fleet: Fleet, tiny_model_dir: Path, tmp_path: Path) -> None:
    url = fleet.engines[0].url
    pusher = fleet.pusher()
    try:
        version = fleet.status(0).current_version + 1
        assert pusher.push_model(lora_model(tiny_model_dir, seed=4), version).wait(WAIT_S).ok
        full = perturbed(tiny_model_dir, seed=5, out=tmp_path / "full")
        snapshot_metas = model_metas(full)
        assert pusher.push(snapshot_metas, iter_full_params(full), version + 1).wait(WAIT_S).ok  # type: ignore[arg-type]
    finally:
        pusher.close()
    assert fleet.status(0).adapter_checksum == ""
    assert outputs(generate(url, None)) == greedy_reference(full)
    refused = generate(url, NAME)
    assert refused.status_code == 400 and NAME in refused.text


class SGLangLike:
    """SGLang's LoRA behaviour at its HTTP boundary, for the one path the embedded engine never takes: loading a
    name that is loaded is refused, and the replies carry no checksum (the receiver checks the staged file).
    ``failing_loads``: how many of the next loads of a name not loaded fail (as out of memory); ``failing_versions``:
    how many of the next version updates fail."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: set[str] = set()
        self.failing_loads = 0
        self.failing_versions = 0

    async def pause(self, mode: str = "retract") -> None:
        self.calls.append("pause")

    async def resume(self, torch_empty_cache: bool = False) -> None:
        self.calls.append("continue")

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"version {version}")
        if self.failing_versions:
            self.failing_versions -= 1
            raise EngineError(503, "the engine is shutting down", "/update_weight_version")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        self.calls.append(f"load {lora_name}")
        if lora_name in self.loaded:
            raise EngineError(400, f"LoRA adapter {lora_name} is already loaded", "/load_lora_adapter")
        if self.failing_loads:
            self.failing_loads -= 1
            raise EngineError(500, "CUDA out of memory", "/load_lora_adapter")
        self.loaded.add(lora_name)
        return {"success": True, "error_message": "", "loaded_adapters": {lora_name: lora_path}}

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        self.calls.append(f"unload {lora_name}")
        self.loaded.discard(lora_name)
        return {"success": True, "error_message": "", "loaded_adapters": {}}


@contextlib.contextmanager
def sglang_receiver(engine: SGLangLike, model_dir: Path, stage_dir: Path,
                    named: list[str | None]) -> Iterator[tuple[str, CheckpointPusher]]:
    """A receiver of adapter ``pol`` on ``engine`` (its loop in a thread; ``named`` gets its ``on_adapter`` calls),
    and a pusher to it that tries each Commit once."""
    config = CheckpointConfig(token=TOKEN, stage_dir=stage_dir, connect_timeout_s=5.0, retries=0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    receiver = CheckpointReceiver(config, model_dir, engine, "http://sglang", "server0", adapter_name="pol",
                                  on_adapter=named.append)
    address = asyncio.run_coroutine_threadsafe(receiver.start(), loop).result(WAIT_S)
    pusher = CheckpointPusher(config, [address])
    try:
        yield address, pusher
    finally:
        pusher.close()
        asyncio.run_coroutine_threadsafe(receiver.stop(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_an_engine_that_refuses_a_loaded_name_gets_unload_then_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = SGLangLike()
    with sglang_receiver(engine, tiny_model_dir, tmp_path / "stage", []) as (address, pusher):
        for version, seed in ((1, 8), (2, 9)):
            model = lora_model(tiny_model_dir, seed)
            assert pusher.push_model(model, version).wait(WAIT_S).ok  # verified against the staged file
            assert status_of(address).adapter_checksum == checksum_of(model)
    assert engine.calls == ["pause", "load pol", "version 1", "continue",
                            "pause", "load pol", "unload pol", "load pol", "version 2", "continue"]


@pytest.mark.parametrize(("failing", "cause", "named", "calls"), [
    ("failing_loads", "CUDA out of memory", ["pol", None],
     ["pause", "load pol", "unload pol", "load pol", "continue"]),
    ("failing_versions", "the engine is shutting down", ["pol", None, None],
     ["pause", "load pol", "unload pol", "load pol", "version 2", "unload pol", "continue"]),
], ids=["the-load", "the-version-update"])
def test_an_adapter_push_failing_after_the_unload_says_no_adapter_serves(
        tiny_model_dir: Path, tmp_path: Path, failing: str, cause: str, named: list, calls: list[str]) -> None:
    """The load after the unload fails, or the load works and the engine's version update then fails: the engine
    serves no adapter, so the worker stops naming it, Status reports no checksum and the Commit's error says the base
    weights serve until the next push, which loads. (After a failed version update the engine kept the new adapter
    under the old version's number: SGLang, here, then refused every later load of the name as already loaded, while
    the receiver believed none loaded, so no adapter push could commit again; an engine that replaces an adapter in
    place served it to a worker still naming it, its tokens recorded under the old version. It is unloaded now.)"""
    engine, got = SGLangLike(), []
    with sglang_receiver(engine, tiny_model_dir, tmp_path / "stage", got) as (address, pusher):
        assert pusher.push_model(lora_model(tiny_model_dir, 8), 1).wait(WAIT_S).ok
        setattr(engine, failing, 1)
        [failed] = pusher.push_model(lora_model(tiny_model_dir, 9), 2).wait(WAIT_S).servers
        assert (failed.stage, failed.reason) == ("commit", "load"), failed
        assert "the engine now serves the base weights without the adapter until the next push" in failed.error
        assert cause in failed.error
        assert engine.loaded == set() and got == named
        status = status_of(address)
        assert (status.current_version, status.adapter_checksum) == (1, "")
        model = lora_model(tiny_model_dir, 10)
        assert pusher.push_model(model, 3).wait(WAIT_S).ok
        assert status_of(address).adapter_checksum == checksum_of(model) and got == [*named, "pol"]
    assert engine.calls[4:] == [*calls, "pause", "load pol", "version 3", "continue"]


def test_a_rollout_server_loads_and_names_the_adapter_model_lora_name(
    tiny_model_dir: Path, tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """``model.lora.name`` on a real ``python -m rollout_server``: a pushed adapter is loaded into the engine under
    that name (not the default ``policy``), and the server's own generate requests name it: the group it rolls out
    after the push carries the adapter's logprobs (the trainer's forward with the adapter, not the base model's)
    for tokens of the pushed version."""
    name, keys, r = "rl-adapter", Keys("t"), client(redis_server)
    engine = EngineProcess(tiny_model_dir, log_path=tmp_path / "engine.log").launch()  # starts with the server's
    log_path = tmp_path / "rollout.log"
    argv = [
        sys.executable, "-m", "rollout_server", "run.name=t", f"run.dir={tmp_path}", f"redis.url={redis_server.url}",
        f"engine.urls={json.dumps([engine.url])}", f"model.path={tiny_model_dir}", "model.init_if_missing=false",
        f"model.lora.name={name}", "rollout.server_id=srv-lora", "rollout.n_samples=2", "rollout.max_turns=1",
        "rollout.max_new_tokens=8", "rollout.heartbeat_s=0.2", "buffer.max_attempts=1",
        f"checkpoint.stage_dir={tmp_path / 'stage'}",
    ]

    def wait(what: str, cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            log = log_path.read_text(errors="replace")
            assert proc is not None and proc.poll() is None, f"the rollout server exited:\n{log}"
            assert time.monotonic() < deadline, f"gave up waiting for {what}:\n{log}"
            time.sleep(0.1)

    proc, pusher = None, None
    try:
        with open(log_path, "wb") as out:
            env = {**os.environ, "ROLLWAVE_CHECKPOINT_TOKEN": TOKEN}
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        engine.wait_ready()
        registry = ServerRegistry(r, keys)
        wait("the server to register", lambda: bool(registry.live_servers()))
        [info] = registry.live_servers()
        model = lora_model(tiny_model_dir, seed=11)
        pusher = CheckpointPusher(CheckpointConfig(token=TOKEN, stage_dir=tmp_path / "push"), [info.grpc_address])
        assert pusher.push_model(model, 1).wait(WAIT_S).ok

        # The engine serves the adapter under model.lora.name, and under no other name.
        assert outputs(generate(engine.url, name)) == greedy_reference(model)
        refused = generate(engine.url, NAME)
        assert refused.status_code == 400 and NAME in refused.text

        # The server's requests name it: its group after the push has the adapter's logprobs.
        queue = TaskQueue(r, keys, BufferConfig())
        queue.ensure_groups()
        [task] = load_tasks("arith", split="train", limit=1)
        queue.submit("job", [task.model_dump(mode="json")], "train")
        wait("the group or a dead letter", lambda: r.xlen(keys.groups) + r.xlen(keys.tasks_dead) > 0)
        dead = [f.get(b"error", b"").decode() for _, f in r.xrange(keys.tasks_dead)]
        assert dead == [], dead  # e.g. the engine refused the name the requests gave
        [(_, group)] = ReplayBuffer(r, keys, BufferConfig()).take(1, WAIT_S)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        for sample in group.samples:
            generated = sample.loss_mask.nonzero()[0]
            assert len(generated) and (sample.token_versions[generated] == 1).all()
            end = int(generated[-1]) + 1
            prompt, output = sample.token_ids[:sample.prompt_len].tolist(), sample.token_ids[sample.prompt_len:end]
            engine_lp = torch.tensor(sample.behaviour_logprobs[generated])
            at = torch.tensor(generated - sample.prompt_len)
            adapter_lp = teacher_forced(model, prompt, output.tolist(), group.temperature)[at]
            base_lp = teacher_forced(base, prompt, output.tolist(), group.temperature)[at]
            torch.testing.assert_close(engine_lp, adapter_lp, rtol=0, atol=1e-3)
            assert (engine_lp - base_lp).abs().max() > 0.05  # the base model would have given other logprobs
    finally:
        if pusher is not None:
            pusher.close()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        engine.close()
