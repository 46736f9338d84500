"""Colocated placement with real parts: Redis, the embedded engine, the rollout server's ``EngineTurns`` and the
trainer's ``LocalPusher``. The test plays the trainer's loop (take the device, write new weights, give it back)
while requests keep arriving at the engine, and checks the order of the engine calls, that nothing is generated
while the engine is released, that the weights served are the ones written, and the memory held while training;
with the one-step overlap, that the engine keeps its memory and generates while the trainer trains. Restarts:
a trainer that takes a step again waits for a new release and numbers its weights above what was published, a
trainer fenced by a newer one neither writes over nor prunes the newer one's weights, and a restarted server
recovers engines left released or paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import time
from concurrent import futures
from pathlib import Path

import httpx
import pytest
import redis
import torch
from engine_helpers import metric, teacher_forced
from prometheus_client import CollectorRegistry
from rank_helpers import spawn_ranks
from safetensors.torch import load_file
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM

from buffer.colocation import DeviceTurns, Turn
from buffer.keys import Keys
from buffer.metrics import BufferMetrics
from buffer.registry import ServerInfo, ServerRegistry
from buffer.replay import ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from core.config import BufferConfig, Config, ConfigError, TrainerConfig, load_config
from core.net import free_port_outside_ephemeral
from rollout_server.__main__ import load_tools, serve
from rollout_server.colocation import EngineTurns
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineGroup
from rollout_server.metrics import RolloutMetrics
from services import demo
from trainer.__main__ import _connect
from trainer.colocation import LocalPusher, held_bytes
from trainer.parallel import close_distributed, exit_rank, init_distributed, iter_full_params
from trainer.worker import Trainer

PROMPT = [5, 17, 42, 99, 7, 300, 12]
MEMORY = tuple(f'rollwave_engine_memory_bytes{{kind="{kind}"}}' for kind in ("weights", "kv_cache", "spare_weights"))
STEPS = 2
DEMO_STEPS = 30  # 20 gave held-out gains of 0.09-0.275 beside a CPU hog: too near the +0.1 asked


class RecordingEngine(EngineClient):
    """The real client; every control call is also appended to ``calls``, in the order made."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    async def pause(self, mode: str = "retract") -> None:
        self.calls.append(f"pause {mode}")
        await super().pause(mode)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"release {tags}")
        await super().release_memory(tags)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"resume {tags}")
        await super().resume_memory(tags)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       flush_cache: bool = True) -> dict:
        self.calls.append(f"load {weight_version}")
        return await super().update_weights_from_disk(model_path, weight_version, flush_cache)

    async def resume(self, torch_empty_cache: bool = False) -> None:
        self.calls.append("continue")
        await super().resume(torch_empty_cache)


KEYS = Keys("colo")


def run_parts(url: str, max_staleness: int = 0) -> tuple[redis.Redis, DeviceTurns, ServerRegistry, StalenessControl]:
    """The run's parts in Redis a colocated test drives: its client, whose turn it is, the live servers, admission."""
    client = redis.Redis.from_url(url)
    return (client, DeviceTurns(client, KEYS), ServerRegistry(client, KEYS, ttl_s=60),
            StalenessControl(client, KEYS, BufferConfig(max_staleness=max_staleness)))


def engine_bytes(url: str) -> int:
    return int(sum(metric(url, name) for name in MEMORY))


async def until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("overlap", [False, True], ids=["staleness0", "overlap"])
def test_turns_release_and_resume_in_order_and_nothing_generates_while_training(
    redis_server, tiny_model_dir: Path, tmp_path: Path, overlap: bool
) -> None:
    """Staleness 0: the engine releases its memory for each step and generates nothing meanwhile. The overlap
    (``placement.colocated_staleness=1``, with ``kv_on_swap: keep``): it keeps its memory and generates while the
    trainer trains, and only pauses (in place) around each load."""
    client, turns, registry, staleness = run_parts(redis_server.url, max_staleness=int(overlap))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pusher = LocalPusher(tmp_path / "push", tiny_model_dir, turns, registry, staleness, timeout_s=60, overlap=overlap)

    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        registry.register(ServerInfo("srv-a", engine_url=proc.url))
        engine = RecordingEngine(proc.url)
        served = {"version": 0}
        hand_over = EngineTurns(turns, EngineGroup([engine]), "srv-a", lambda: served["version"],
                                lambda v: served.__setitem__("version", v), asyncio.to_thread, RolloutMetrics(),
                                warn_after_s=60, swap_pause="in_place" if overlap else "retract")

        async def load(stop: asyncio.Event, versions: list[list[str]]) -> None:
            """Requests all along, as agent loops send them; each reply's weight versions are kept."""
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as http:
                while not stop.is_set():
                    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
                    reply = (await http.post("/generate", json=body)).json()
                    versions.append([s["version"] for s in reply["meta_info"]["weight_versions"]])

        async def trainer() -> dict[str, int]:
            pusher.push_model(model)  # the trainer's start: version 0, which the engine already serves
            pusher.give_device(0)
            generating, training, during = 0, 0, []
            for step in range(1, STEPS + 1):
                await until(lambda: metric(proc.url, "rollwave_engine_running_requests") > 0, "generation")
                generating = max(generating, engine_bytes(proc.url))
                await asyncio.to_thread(pusher.take_device, step)
                tokens = metric(proc.url, "rollwave_engine_generated_tokens_total")
                model(input_ids=torch.tensor([PROMPT])).logits.sum().backward()  # a training step
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                await asyncio.sleep(0.3)
                training = max(training, engine_bytes(proc.url))
                during.append(metric(proc.url, "rollwave_engine_generated_tokens_total") - tokens)
                pusher.push_model(model, unacked=step)  # a group a step, none acked yet
                pusher.give_device(step)
                await until(lambda s=step: served["version"] == s, f"the server to serve version {step}")
            return {"generating": generating, "training": training, "during": during}

        async def run() -> dict[str, int]:
            stop, versions = asyncio.Event(), []
            follow = asyncio.create_task(hand_over.run())
            requests = asyncio.create_task(load(stop, versions))
            try:
                return await trainer() | {"versions": versions}
            finally:
                stop.set()
                await requests
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)
                await engine.aclose()

        seen = asyncio.run(run())
        per_step = (["pause in_place", "load {v}", "continue"] if overlap else
                    ["pause retract", "release ['weights', 'kv_cache', 'cuda_graph']", "resume ['weights']",
                     "load {v}", "resume ['kv_cache', 'cuda_graph']", "continue"])
        start = ["continue"]  # nothing recorded released: continue what a server that died paused may have left
        assert engine.calls == start + [c.format(v=v) for v in range(1, STEPS + 1) for c in per_step]
        if overlap:
            assert all(n > 0 for n in seen["during"]), f"tokens generated while training: {seen['during']}"
        else:
            assert seen["during"] == [0] * STEPS, f"generated while released: {seen['during']}"
        assert any(v[-1] == str(STEPS) for v in seen["versions"])
        assert staleness.version() == STEPS and int(client.get(KEYS.version_trained)) == STEPS

        out = httpx.post(proc.url + "/generate", timeout=60, json={
            "input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}
        }).json()
    model.eval()
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - teacher_forced(model, PROMPT, out["output_ids"], 1.0)).abs().max() <= 1e-4  # the trained weights
    kept = sorted(p.name for p in (tmp_path / "push").iterdir())
    assert kept == [pusher.directory(STEPS - 1).name, pusher.directory(STEPS).name]  # older pruned

    if overlap:
        assert seen["training"] > 0  # the engine kept its weights and KV
        return
    trainer_bytes = held_bytes([model], [optimizer])
    decoupled, colocated = trainer_bytes + seen["generating"], trainer_bytes + seen["training"]
    print(f"held while training: decoupled {decoupled / 2**20:.2f} MiB (trainer {trainer_bytes / 2**20:.2f} + engine "
          f"{seen['generating'] / 2**20:.2f}), colocated {colocated / 2**20:.2f} MiB (engine released: "
          f"{seen['training']} bytes)")
    assert seen["training"] == 0 and colocated < decoupled


def test_a_server_that_does_not_release_fails_the_step_by_name(redis_server, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    _client, turns, registry, _staleness = run_parts(redis_server.url)
    registry.register(ServerInfo("srv-a", engine_url="http://127.0.0.1:1"))
    registry.register(ServerInfo("srv-frozen", engine_url="http://127.0.0.1:2"))
    before = LocalPusher(tmp_path, tiny_model_dir, turns, registry, timeout_s=0.5)  # a start that died
    pusher = LocalPusher(tmp_path, tiny_model_dir, turns, registry, timeout_s=0.5)
    turns.released("srv-a", Turn("trainer", 3, epoch=pusher.epoch))
    turns.released("srv-frozen", Turn("trainer", 3, epoch=before.epoch))  # step 3 of the start before
    with pytest.raises(TimeoutError, match=r"step 3: rollout server\(s\) srv-frozen did not release .*stage release"):
        pusher.take_device(3)
    turns.released("srv-frozen", Turn("trainer", 2, epoch=pusher.epoch))  # an earlier step only
    with pytest.raises(TimeoutError, match="srv-frozen did not release"):
        pusher.take_device(3)
    registry.deregister("srv-frozen")  # a dead server leaves the live set and is not waited for
    assert pusher.take_device(3) < 0.5
    with pytest.raises(RuntimeError, match="push_model first"):
        pusher.give_device(3)


class StallingEngine(RecordingEngine):
    """Never returns from a load once the engine has done it (``loaded``: the versions it did; ``calls`` has a load
    as it is asked for): a server can be killed there."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.loaded: list[str | None] = []

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       flush_cache: bool = True) -> dict:
        reply = await super().update_weights_from_disk(model_path, weight_version, flush_cache)
        self.loaded.append(weight_version)
        await asyncio.Event().wait()
        return reply


def follow(turns: DeviceTurns, engine: EngineClient, server_id: str, served: dict[str, int],
           swap_pause: str = "retract") -> EngineTurns:
    return EngineTurns(turns, EngineGroup([engine]), server_id, lambda: served["version"],
                       lambda v: served.__setitem__("version", v), asyncio.to_thread, RolloutMetrics(),
                       warn_after_s=60, swap_pause=swap_pause)


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_trainer_that_restarts_in_a_step_waits_for_the_engines_to_release_it_again(
    redis_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The trainer dies holding step 2 (the engines released for it) and resumes from the step-1 checkpoint: its
    start gives the device back and the server resumes. When it takes step 2 again, the server releases again
    and the trainer waits for that, not for the report from before its restart."""
    client, turns, registry, staleness = run_parts(redis_server.url)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        registry.register(ServerInfo("srv-a", engine_url=proc.url))
        engine = RecordingEngine(proc.url)
        served = {"version": 0}

        async def run() -> tuple[int, list[str]]:
            server = asyncio.create_task(follow(turns, engine, "srv-a", served).run())
            try:
                dead = LocalPusher(tmp_path / "push", tiny_model_dir, turns, registry, staleness, timeout_s=60)
                dead.push_model(model)
                dead.give_device(0)
                await asyncio.to_thread(dead.take_device, 1)
                dead.push_model(model, unacked=1)
                dead.give_device(1)
                await until(lambda: served["version"] == 1, "version 1")
                await asyncio.to_thread(dead.take_device, 2)  # and dies
                resumed = LocalPusher(tmp_path / "push", tiny_model_dir, turns, registry, staleness, timeout_s=60)
                resumed.published = staleness.version()  # as the trainer's _connect
                resumed.push_model(model, unacked=1)  # its start, from the step-1 checkpoint
                resumed.give_device(1)
                assert resumed.written is not None
                version = resumed.written[0]
                await until(lambda: served["version"] == version, f"the resumed trainer's version {version}")
                before = len(engine.calls)
                await asyncio.to_thread(resumed.take_device, 2)
                return engine_bytes(proc.url), engine.calls[before:]
            finally:
                await stop(server)
                await engine.aclose()

        held, calls = asyncio.run(run())
    assert calls == ["pause retract", "release ['weights', 'kv_cache', 'cuda_graph']"]
    assert held == 0  # the engine released before the trainer went on


def test_a_resumed_trainer_hands_over_its_weights_above_the_published_version(
    redis_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A trainer that published version 2 dies and resumes from an older checkpoint: the weights it resumes from
    go out as version 3 (engines serving 2 load them; groups of 2 are one version old to them), and version 2's
    directory stays as it was written."""
    client, turns, registry, staleness = run_parts(redis_server.url)  # no server: the device is taken at once
    root = tmp_path / "push"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    dead = LocalPusher(root, tiny_model_dir, turns, registry, staleness)
    dead.push_model(model)
    dead.give_device(0)
    for step in (1, 2):
        dead.take_device(step)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a training step
        dead.push_model(model, unacked=step)
        dead.give_device(step)
    v2 = load_file(dead.directory(2) / "model.safetensors")
    assert (turns.turn().version, staleness.version()) == (2, 2)

    checkpoint = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # older weights
    resumed = LocalPusher(root, tiny_model_dir, turns, registry, staleness)
    resumed.published = staleness.version()
    resumed.push_model(checkpoint, unacked=1)
    resumed.give_device(1)
    turn = turns.turn()
    assert turn is not None and (turn.version, turn.path) == (3, str(resumed.directory(3))) and staleness.version() == 3
    kept = load_file(dead.directory(2) / "model.safetensors")
    assert all(torch.equal(kept[name], t) for name, t in v2.items())


def fenced_start(client: redis.Redis, root: Path, model_dir: Path, registry: ServerRegistry,
                 overlap: bool = False) -> tuple[LocalPusher, StalenessControl]:
    """A trainer start's pusher and admission as ``_connect`` makes them: the start fences the run's older trainers,
    and its turns and versions are refused once a newer start fences it."""
    buffer = ReplayBuffer(client, KEYS, BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    buffer.fence()
    staleness = StalenessControl(client, KEYS, BufferConfig(max_staleness=int(overlap)), fence=buffer)
    pusher = LocalPusher(root, model_dir, DeviceTurns(client, KEYS, fence=buffer), registry, staleness,
                         overlap=overlap)
    pusher.published = staleness.version()
    return pusher, staleness


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_a_fenced_trainer_writing_a_version_the_newer_one_wrote_leaves_the_newer_one_s_weights_alone(
    redis_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The older trainer holds the device for step 2 when the newer one starts (from the step-1 checkpoint) and hands
    over versions 2 and 3. The older one then writes its step as version 2 too, and is refused the hand-over: it used to
    write over the newer one's version 2 and prune its version 3, the one the turn names. Now its write lies beside
    them and its prune leaves them; the newer start's next prune removes it."""
    client, turns, registry, _staleness = run_parts(redis_server.url)  # no server: the device is taken at once
    root = tmp_path / "push"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    older, _ = fenced_start(client, root, tiny_model_dir, registry)
    older.push_model(model)
    older.give_device(0)
    older.take_device(1)
    older.push_model(model, unacked=1)
    older.give_device(1)
    older.take_device(2)
    newer, _ = fenced_start(client, root, tiny_model_dir, registry)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # the newer trainer's weights
    for step in (1, 2):
        if step > 1:
            newer.take_device(step)
        newer.push_model(model, unacked=step)
        newer.give_device(step)
    turn = turns.turn()
    assert turn is not None and (turn.version, turn.path) == (3, str(newer.directory(3)))
    written = {v: files(newer.directory(v)) for v in (2, 3)}

    with torch.no_grad():
        next(model.parameters()).sub_(2.0)  # the older trainer's step
    older.push_model(model, unacked=2)
    assert older.written is not None and older.written[0] == 2
    with pytest.raises(TrainerFenced):
        older.give_device(2)
    assert {v: files(newer.directory(v)) for v in (2, 3)} == written
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [older.directory(2).name, newer.directory(2).name, newer.directory(3).name])


def test_a_start_numbers_its_epoch_above_the_written_ones_when_redis_lost_the_count(
    redis_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Redis lost ``device:epoch`` (a new Redis, a restore without it) while the stage directory kept the earlier
    starts' weights: the next start numbers its epoch above every one written. It took epoch 1 again, named another
    start's weights as its own, and left the ones of epoch 2 unpruned for good, as a newer start's."""
    client, _turns, registry, _staleness = run_parts(redis_server.url)  # no server: the device is taken at once
    root = tmp_path / "push"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    first, _ = fenced_start(client, root, tiny_model_dir, registry)
    second, _ = fenced_start(client, root, tiny_model_dir, registry)
    second.push_model(model)
    assert (first.epoch, second.epoch) == (1, 2)
    client.delete(KEYS.device_epoch)
    third, _ = fenced_start(client, root, tiny_model_dir, registry)
    assert third.epoch == 3
    third.push_model(model)
    third.give_device(0)
    third.take_device(1)
    third.push_model(model, unacked=1)
    assert sorted(p.name for p in root.iterdir()) == [third.directory(0).name, third.directory(1).name]


def test_a_trainer_start_prunes_the_older_starts_weights_only_once_it_handed_its_own_over(
    redis_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With the one-step overlap (the turn names the weights to serve while the trainer trains), the older trainer
    wrote version 2, published it and died before it handed it over: the turn still names its version 1, which a
    server that restarts loads. The newer start writes version 3 and keeps that directory until its own hand-over (it
    used to prune all but versions 2 and 3 at once); its next write removes every directory of the older start, and
    those written before starts had epochs."""
    client, turns, registry, _staleness = run_parts(redis_server.url)
    root = tmp_path / "push"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    older, published = fenced_start(client, root, tiny_model_dir, registry, overlap=True)
    older.push_model(model)
    older.give_device(0)
    for step in (1, 2):
        older.take_device(step)
        older.push_model(model, unacked=step)
        if step == 1:
            older.give_device(step)
    assert older.written is not None
    published.set_version(*older.written)  # its hand-over's first half, and it dies
    legacy = ["v7", ".v8.partial"]  # written before starts had epochs
    for name in legacy:
        (root / name).mkdir()

    newer, _ = fenced_start(client, root, tiny_model_dir, registry, overlap=True)
    newer.push_model(model, unacked=2)
    turn = turns.turn()
    assert turn is not None and (turn.version, turn.path) == (1, str(older.directory(1)))
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [older.directory(1).name, older.directory(2).name, newer.directory(3).name, *legacy])
    newer.give_device(2)
    newer.take_device(3)
    newer.push_model(model, unacked=3)
    assert sorted(p.name for p in root.iterdir()) == [newer.directory(3).name, newer.directory(4).name]


@pytest.mark.parametrize("died", ["in_training", "after_release", "after_load", "overlap_after_load"])
def test_a_restarted_server_recovers_engines_left_released_or_paused(
    redis_server, tiny_model_dir: Path, tmp_path: Path, died: str
) -> None:
    """A rollout server with external engines (``engine.urls``) is killed and started again (a new server id):
    while the trainer trains, with the engines released (it reports them released without releasing again:
    SGLang dies pausing memory twice); after that, the trainer having given the device back while it was down;
    after the load, with the rest of the memory still released (the version already the one to serve); with the
    overlap, after the load, the engines paused. Each time the engines end up serving the version given."""
    client, turns, registry, staleness = run_parts(redis_server.url)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    overlap = died.startswith("overlap")
    pusher = LocalPusher(tmp_path / "push", tiny_model_dir, turns, registry, staleness, timeout_s=60, overlap=overlap)
    swap_pause = "in_place" if overlap else "retract"

    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        registry.register(ServerInfo("srv-a", engine_url=proc.url))
        first, second = StallingEngine(proc.url), RecordingEngine(proc.url)

        async def run() -> list[str]:
            killed = asyncio.create_task(follow(turns, first, "srv-a", {"version": 0}, swap_pause).run())
            pusher.push_model(model)
            pusher.give_device(0)
            await asyncio.to_thread(pusher.take_device, 1)
            pusher.push_model(model, unacked=1)
            if died.endswith("after_load"):
                pusher.give_device(1)
                await until(lambda: "1" in first.loaded, "the load")  # done, not only asked for (it raced the kill)
            await stop(killed)
            registry.deregister("srv-a")
            if died == "after_release":
                pusher.give_device(1)
            registry.register(ServerInfo("srv-b", engine_url=proc.url))
            served = {"version": int(await second.weight_version() or 0)}  # as the rollout worker starts
            restarted = asyncio.create_task(follow(turns, second, "srv-b", served, swap_pause).run())
            try:
                if died == "in_training":
                    await asyncio.to_thread(turns.wait_released, Turn("trainer", 1, epoch=pusher.epoch), registry, 20)
                    assert second.calls == []
                    pusher.give_device(1)
                await until(lambda: "continue" in second.calls, "the engines to continue", timeout_s=20)
                async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
                    reply = (await http.post("/generate", json=body)).json()
                assert [s["version"] for s in reply["meta_info"]["weight_versions"]] == ["1"]
                return second.calls
            finally:
                await stop(restarted)
                await first.aclose()
                await second.aclose()

        calls = asyncio.run(run())
    rest = "resume ['kv_cache', 'cuda_graph']"
    assert calls == {"in_training": ["resume ['weights']", "load 1", rest, "continue"],
                     "after_release": ["resume ['weights']", "load 1", rest, "continue"],
                     "after_load": ["load 1", rest, "continue"],
                     "overlap_after_load": ["continue"]}[died]
    assert turns.engines_released([proc.url]) == [] and not client.hexists(KEYS.device_released, "srv-b")


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_of_an_overlapped_trainer_keeps_its_memory(redis_server, ctx, tiny_model_dir: Path,
                                                               tmp_path: Path, rank: int) -> None:
    """With ``placement.colocated_staleness=1`` the engines keep the device, so no rank offloads: each rank's
    device share says overlap, as rank 0's does (the other ranks' used to offload every step)."""
    cfg = load_config(None, ["placement.mode=colocated", "placement.colocated_staleness=1",
                             f"redis.url={redis_server.url}", f"run.dir={tmp_path}", f"model.path={tiny_model_dir}",
                             f"checkpoint.stage_dir={tmp_path}/stage"], env={})
    metrics = CollectorRegistry()
    with contextlib.ExitStack() as stack:
        _, pusher, _, _ = _connect(cfg, dataclasses.replace(ctx, rank=rank, world_size=2), stack, metrics,
                                   BufferMetrics(metrics))
    assert isinstance(pusher, LocalPusher) and pusher.overlap


def test_colocated_config_is_synchronous_or_one_step_behind_and_refuses_lora() -> None:
    cfg = load_config(None, ["placement.mode=colocated", "buffer.max_staleness=3"])
    assert cfg.buffer.max_staleness == 0 and cfg.placement.colocated_timeout_s == 600
    cfg = load_config(None, ["placement.mode=colocated", "placement.colocated_staleness=1", "buffer.max_staleness=3"])
    assert cfg.buffer.max_staleness == 1
    with pytest.raises(Exception, match="colocated_staleness"):
        load_config(None, ["placement.mode=colocated", "placement.colocated_staleness=2"])
    with pytest.raises(Exception, match="model.lora is not supported"):
        load_config(None, ["placement.mode=colocated", "model.lora.rank=4"])
    with pytest.raises(ConfigError, match="placement.colocated_staleness:.*rollout.mode=sync generates each batch"):
        load_config(None, ["placement.mode=colocated", "placement.colocated_staleness=1", "rollout.mode=sync"])
    with pytest.raises(ConfigError, match=r"placement.colocated_timeout_s:.*\(6\) must exceed three rollout.heart"):
        load_config(None, ["placement.mode=colocated", "placement.colocated_timeout_s=6"])


GUARD_S = 60.0  # far under the 600 s default: a wait this long means placement.colocated_timeout_s was not applied


def colocated_config(redis_url: str, tmp_path: Path, model_dir: Path, *overrides: str) -> Config:
    """A colocated run's config as a user sets it (``load_config`` with dotted overrides), on this test's Redis."""
    return load_config(None, ["placement.mode=colocated", f"run.name={KEYS.run}", f"redis.url={redis_url}",
                              f"run.dir={tmp_path}", f"model.path={model_dir}",
                              f"checkpoint.stage_dir={tmp_path}/stage", *overrides], env={})


def test_the_trainer_waits_placement_colocated_timeout_s_for_the_servers_to_release(
    redis_server, ctx, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``placement.colocated_timeout_s=0.5`` through the trainer's ``_connect``: a live server that never releases
    the device fails the step after that long, not the 600 s default, with an error naming the server (not the
    one that released), the step, the stage and the limit."""
    cfg = colocated_config(redis_server.url, tmp_path, tiny_model_dir, "placement.colocated_timeout_s=0.5",
                           "rollout.heartbeat_s=0.1")
    client, turns, _registry, _staleness = run_parts(redis_server.url)
    registry = ServerRegistry(client, KEYS, ttl_s=10 * GUARD_S)  # live past the guard without a heartbeat
    registry.register(ServerInfo("srv-a", engine_url="http://127.0.0.1:1"))
    registry.register(ServerInfo("srv-frozen", engine_url="http://127.0.0.1:2"))
    metrics = CollectorRegistry()
    with contextlib.ExitStack() as stack, futures.ThreadPoolExecutor(1) as pool:
        _, pusher, _, _ = _connect(cfg, ctx, stack, metrics, BufferMetrics(metrics))
        assert isinstance(pusher, LocalPusher)
        turns.released("srv-a", Turn("trainer", 1, epoch=pusher.epoch))
        start = time.monotonic()
        step = pool.submit(pusher.take_device, 1)
        try:
            futures.wait([step], timeout=GUARD_S)
            waited = time.monotonic() - start
            assert step.done(), f"take_device still waiting after {GUARD_S:.0f} s: placement.colocated_timeout_s unused"
        finally:
            registry.deregister("srv-frozen")  # ends a wait the guard cut short: the pool's thread returns
    error = step.exception()
    assert isinstance(error, TimeoutError), error
    assert str(error) == ("colocated step 1: rollout server(s) srv-frozen did not release their engines' memory "
                          "within 0.5 s (stage release)")
    assert 0.5 <= waited < GUARD_S


def test_a_released_server_warns_after_placement_colocated_timeout_s(
    redis_server, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``placement.colocated_timeout_s=0.5`` through the rollout server's ``serve`` (as ``python -m rollout_server``
    runs it, with the embedded engine it starts): its engines released for a trainer turn that is not given back
    within the limit, it logs a warning naming the turn, instead of after the 600 s default (each warning is also
    counted: tests/test_colocation_edges.py)."""
    cfg = colocated_config(redis_server.url, tmp_path, tiny_model_dir, "placement.colocated_timeout_s=0.5",
                           "rollout.heartbeat_s=0.1", "rollout.server_id=srv-a", "rollout.metrics_port=null",
                           "engine.threads=1")
    client, turns, registry, _staleness = run_parts(redis_server.url)
    caplog.set_level(logging.WARNING, logger="rollout_server.colocation")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "rollout_server.colocation" and r.levelno == logging.WARNING]

    async def run() -> tuple[Turn, list[str]]:
        server = asyncio.create_task(serve(cfg, load_tools(cfg.rollout)))

        def serving(check) -> bool:
            if server.done():  # serve failed (or returned): its error, not a wait to the guard
                server.result()
                raise AssertionError("serve returned")
            return bool(check())

        try:
            await until(lambda: serving(lambda: [s.server_id for s in registry.live_servers()] == ["srv-a"]),
                        "the server to register")
            turn = turns.take(turns.new_epoch(), 1)
            await until(lambda: serving(lambda: client.hget(KEYS.device_released, "srv-a") == turn.key.encode()),
                        "the server to release the device")
            await until(lambda: serving(warnings), "the released server's warning", timeout_s=GUARD_S)
            return turn, warnings()
        finally:
            await stop(server)

    turn, warned = asyncio.run(run())
    assert re.fullmatch(rf"engines released for \d+ s: the trainer has not given the device back \(its turn "
                        rf"{turn.key}\)", warned[0]), warned
    assert registry.live_servers() == []  # serve stopped: deregistered


def _ranks(rank: int, world: int, port: int, model_dir: Path, root: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    try:
        pusher = LocalPusher(root, model_dir)  # no turns: the ranks still meet at the barrier around each step
        trainer = Trainer(TrainerConfig(total_steps=2, lr=1e-2, device="cpu"), model_dir, root / "run",
                          BufferConfig(groups_per_step=2), pusher=pusher, device_share=pusher).start(ctx=ctx)
        for seed in range(2):
            trainer.train(synthetic_groups(seed, 2))
        full = {name: t.clone() for name, t in iter_full_params(trainer.model) if t is not None}
        if rank == 0:
            torch.save(full, root / "full.pt")
        trainer.close()
    finally:
        close_distributed()
    exit_rank()


def test_two_ranks_write_the_full_weights_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    spawn_ranks(_ranks, args=(2, free_port_outside_ephemeral(), tiny_model_dir, tmp_path), nprocs=2, join=True)
    full = torch.load(tmp_path / "full.pt")
    written = load_file(tmp_path / "v2-e0" / "model.safetensors")  # epoch 0: no turns
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v1-e0", "v2-e0"]  # v0 at start, one per step, two kept
    assert written.keys() == full.keys()
    assert all(torch.equal(written[name], full[name]) for name in full)
    assert (tmp_path / "v2-e0" / "config.json").exists()


@pytest.mark.slow
def test_colocated_demo_learns(tmp_path: Path) -> None:
    """The demo in colocated placement: the engine and the trainer take turns on both CPUs, weights go by local
    push, and held-out accuracy rises from the demo's SFT warm start."""
    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "configs/demo.yaml", [
        "run.name=colocated", f"run.dir={tmp_path}", f"checkpoint.stage_dir={tmp_path}/stage",
        "placement.mode=colocated", "placement.rollout_cpus=[]", "placement.trainer_cpus=[]", "engine.threads=1",
        "trainer.threads=1",  # one thread each: two per process thrash on a loaded 2-core machine
        f"trainer.total_steps={DEMO_STEPS}", "trainer.lr=2e-4",
    ])
    summary = demo.run(cfg, sft_steps=0, eval_tasks=200, timeout_s=600,
                       warm_start_dir=root / "tests/data/arith_warm_start")
    print({k: summary[k] for k in ("heldout_accuracy_before", "heldout_accuracy_after", "rl_seconds") if k in summary})
    assert summary["steps"] == DEMO_STEPS and summary["groups_trained"] >= DEMO_STEPS * cfg.buffer.groups_per_step
    assert summary["final_policy_version"] == DEMO_STEPS, summary  # staleness 0: one version per step
    assert summary["heldout_accuracy_after"] >= summary["heldout_accuracy_before"] + 0.1, summary
    assert not (tmp_path / "stage" / "colocated").exists()  # the local pushes left tmpfs with the run
