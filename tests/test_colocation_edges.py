"""Colocated placement's edges, with real parts (Redis, the embedded engine, ``EngineTurns``, ``LocalPusher``): a local
push that fails part-way leaves no half-written copy on the stage's tmpfs; a server whose engines stay released past
``placement.colocated_timeout_s`` counts each warning; a hand-over whose weights are gone from disk (a tmpfs emptied
by a reboot, an earlier run's stage directory removed) is skipped, logged and counted, and the server keeps running
until the weights exist; a trainer waiting for the releases stops at once when a newer trainer's turn replaces its
own, and writes its turn again when Redis lost it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from concurrent import futures
from pathlib import Path

import pytest
import torch
from test_colocation import KEYS, RecordingEngine, fenced_start, run_parts, stop, until
from transformers import AutoModelForCausalLM

from buffer.colocation import Turn
from buffer.registry import ServerInfo
from buffer.replay import TrainerFenced
from core.checkpoint_format import MODEL_WEIGHTS
from rollout_server.colocation import TAGS, EngineTurns
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineGroup
from rollout_server.metrics import RolloutMetrics
from trainer.colocation import LocalPusher

LOGGER = "rollout_server.colocation"


def handovers(metrics: RolloutMetrics, event: str) -> float:
    """``rollwave_rollout_device_handovers_total{event}`` as a scrape reads it (0 before its first count)."""
    value = metrics.registry.get_sample_value("rollwave_rollout_device_handovers_total", {"event": event})
    return value or 0.0


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


async def weight_version(url: str) -> str | None:
    """What the engine at ``url`` reports it serves."""
    engine = EngineClient(url)
    try:
        return await engine.weight_version()
    finally:
        await engine.aclose()


def test_a_local_push_that_fails_part_way_leaves_no_partial_copy(tmp_path: Path) -> None:
    """The weights are written, then the write fails (here the model's config.json cannot be copied; on a full tmpfs
    it is the safetensors file): the error reaches the trainer and the partial directory is gone. It used to stay,
    holding a model's worth of tmpfs that a restarted trainer (a new epoch) prunes only after its own first
    hand-over, which that space may be what it needs to write."""
    model_dir = tmp_path / "model"
    (model_dir / "config.json").mkdir(parents=True)
    root = tmp_path / "push"
    pusher = LocalPusher(root, model_dir)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(IsADirectoryError):
        pusher.push_model(model)
    assert list(root.iterdir()) == [] and pusher.written is None
    (model_dir / "config.json").rmdir()
    round_ = pusher.push_model(model)
    assert round_ is not None and round_.version == 0
    assert sorted(p.name for p in pusher.directory(0).iterdir()) == [MODEL_WEIGHTS]


def test_a_released_server_counts_each_warning_that_the_trainer_has_not_given_the_device_back(
    redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    """A server restarted while its external engines were released (the record says so: the engine is never asked,
    so none runs here) releases for the trainer's turn, which is never given back: each warning is also counted
    (``device_handovers{event="overdue"}``); it used to be only a log line."""
    client, turns, _registry, _staleness = run_parts(redis_server.url)
    url = "http://127.0.0.1:1"
    turns.record_engines([url], TAGS)
    turn = turns.take(turns.new_epoch(), 1)
    metrics = RolloutMetrics()
    engine = RecordingEngine(url)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = EngineTurns(turns, EngineGroup([engine]), "srv-a", lambda: 0, lambda _v: None, asyncio.to_thread,
                         metrics, warn_after_s=0.1)

    async def run() -> list[str]:
        task = asyncio.create_task(server.run())
        try:
            await until(lambda: len(warnings(caplog)) >= 2, "two warnings")
            return warnings(caplog)
        finally:
            await stop(task)
            await engine.aclose()

    warned = asyncio.run(run())
    assert handovers(metrics, "overdue") == len(warned) >= 2, warned
    assert client.hget(KEYS.device_released, "srv-a") == turn.key.encode() and engine.calls == []


def test_a_hand_over_whose_weights_are_gone_is_skipped_and_the_server_loads_the_next(
    redis_server, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The turn left in Redis names version 3 in a directory that no longer exists (the run resumed after a reboot
    emptied /dev/shm). The server starting now does not pause its engine for a load that fails: it logs and counts
    the hand-over (``device_handovers{event="missing"}``, once) and keeps serving; its hand-over task used to fail
    with the load, stopping the server, and every restart failed again until the launcher gave it up. Once the
    directory exists the server loads it; the trainer's start then hands over version 4, which it loads too."""
    _client, turns, registry, staleness = run_parts(redis_server.url)
    gone = tmp_path / "push" / "v3-e1"
    turns.give(1, 5, 3, str(gone))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        registry.register(ServerInfo("srv-a", engine_url=proc.url))
        engine, served, metrics = RecordingEngine(proc.url), {"version": 0}, RolloutMetrics()
        server = EngineTurns(turns, EngineGroup([engine]), "srv-a", lambda: served["version"],
                             lambda v: served.__setitem__("version", v), asyncio.to_thread, metrics, warn_after_s=60)

        async def run() -> tuple[list[str], bool, list[str], list[str]]:
            task = asyncio.create_task(server.run())
            try:
                await until(lambda: task.done() or handovers(metrics, "missing") > 0, "the skipped hand-over")
                if task.done():
                    task.result()
                skipped = list(engine.calls)
                await asyncio.sleep(0.2)  # polls of the same turn: skipped once, not loaded
                running = not task.done()
                shutil.copytree(tiny_model_dir, gone)  # the weights appear after all (a slow shared file system)
                await until(lambda: task.done() or served["version"] == 3, "the server to load version 3")
                if task.done():
                    task.result()
                pusher = LocalPusher(tmp_path / "push", tiny_model_dir, turns, registry, staleness)
                pusher.published = 3  # as _connect reads it from the run
                pusher.push_model(model)
                pusher.give_device(0)
                await until(lambda: task.done() or served["version"] == 4, "the server to load version 4")
                if task.done():
                    task.result()
                return skipped, running, engine.calls, warnings(caplog)
            finally:
                await stop(task)
                await engine.aclose()

        skipped, running, calls, warned = asyncio.run(run())
        version = asyncio.run(weight_version(proc.url))
    assert skipped == ["continue"] and running, skipped  # only the start's continue: no pause, no load
    assert handovers(metrics, "missing") == 1
    assert [w for w in warned if str(gone) in w] == [
        f"the trainer's hand-over of version 3 (epoch 1, step 5) names {gone}, which does not exist: not loaded; "
        "waiting for it, or the trainer's next hand-over"]
    assert calls == ["continue", "pause retract", "load 3", "continue", "pause retract", "load 4", "continue"]
    assert version == "4"


WAIT_S = 30.0  # the trainer's placement.colocated_timeout_s here: far above what the hand-overs below take


def test_a_fenced_trainer_waiting_for_the_release_stops_at_once_when_a_newer_one_hands_the_device_over(
    redis_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The older trainer waits for a live server to release step 2 when a newer trainer starts and gives the device
    back: the older one is refused (``TrainerFenced``, logged and counted as every fenced write) while it waits. It
    used to wait out ``placement.colocated_timeout_s``, the servers resuming under it, and fail blaming them
    (TimeoutError naming the server), a crash its launcher restarts, fencing the newer trainer in turn."""
    client, turns, registry, _staleness = run_parts(redis_server.url)
    registry.register(ServerInfo("srv-a", engine_url="http://127.0.0.1:1"))  # live, follows no turn here
    root = tmp_path / "push"
    model = torch.nn.Linear(4, 4)
    older, _ = fenced_start(client, root, tiny_model_dir, registry)
    older.timeout_s = WAIT_S
    older.push_model(model)
    older.give_device(0)
    with futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(older.take_device, 2)
        wait_until(lambda: turns.turn() == turns_of(older.epoch, 2), "the older trainer's turn")
        newer, _ = fenced_start(client, root, tiny_model_dir, registry)
        newer.push_model(model, unacked=1)
        newer.give_device(1)
        try:
            futures.wait([waiting], timeout=2 * WAIT_S)
        finally:
            registry.deregister("srv-a")  # ends a wait the guard cut short
    assert isinstance(waiting.exception(), TrainerFenced), waiting.exception()
    turn = turns.turn()
    assert turn is not None and (turn.holder, turn.epoch, turn.version) == ("rollout", newer.epoch, 1)


def test_a_trainer_turn_redis_lost_is_written_again_and_the_servers_release_for_it(
    redis_server, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Redis loses the trainer's turn right after it was written (a crash within ``appendfsync everysec``'s last
    second): the trainer waiting for the releases writes it again, the server (its engines released already, as its
    record says: the engine is never asked) reports the release, and the step goes on. The trainer used to wait
    ``placement.colocated_timeout_s`` for a turn no server could see, then fail blaming the server."""
    client, turns, registry, _staleness = run_parts(redis_server.url)
    registry.register(ServerInfo("srv-a", engine_url="http://127.0.0.1:1"))
    url = "http://127.0.0.1:1"
    turns.record_engines([url], TAGS)
    pusher, _ = fenced_start(client, tmp_path / "push", tiny_model_dir, registry)
    pusher.timeout_s = WAIT_S
    engine = RecordingEngine(url)
    server = EngineTurns(turns, EngineGroup([engine]), "srv-a", lambda: 0, lambda _v: None, asyncio.to_thread,
                         RolloutMetrics(), warn_after_s=60)
    with futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(pusher.take_device, 1)
        wait_until(lambda: waiting.done() or turns.turn() == turns_of(pusher.epoch, 1), "the trainer's turn")
        client.delete(KEYS.device_turn)

        async def follow() -> None:
            task = asyncio.create_task(server.run())
            try:
                await until(lambda: waiting.done() or task.done(), "the trainer's wait to end", timeout_s=2 * WAIT_S)
                if task.done():
                    task.result()
            finally:
                await stop(task)
                await engine.aclose()

        asyncio.run(follow())
    waiting.result()  # no TimeoutError
    assert client.hget(KEYS.device_released, "srv-a") == f"{pusher.epoch}:1".encode() and engine.calls == []


def turns_of(epoch: int, step: int) -> Turn:
    """The turn a trainer start of ``epoch`` takes for ``step``."""
    return Turn("trainer", step, epoch=epoch)


def wait_until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
