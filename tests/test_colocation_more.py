"""Colocated placement's failures and leftovers, with real parts (Redis, the embedded engine, ``EngineTurns``,
``LocalPusher``, the trainer): servers that did not release the device in time are logged and counted by the trainer;
the last checkpoint of a run whose data ran out is written in a turn of the trainer's, the engines' memory released; a
local push that fails on rank 0 fails every rank, naming the stage; an engines' release that fails is counted and
never reported, not by a restarted server either; the releases of servers no longer live are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from rank_helpers import spawn_ranks
from test_colocation import KEYS, RecordingEngine, engine_bytes, follow, run_parts, stop, until
from test_colocation_edges import handovers
from trainer_helpers import synthetic_groups

from buffer.colocation import Turn
from buffer.registry import ServerInfo, ServerRegistry
from core.config import BufferConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from rollout_server.colocation import TAGS, EngineTurns
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineError, EngineGroup
from rollout_server.metrics import RolloutMetrics
from trainer.colocation import LocalPusher
from trainer.parallel import close_distributed, exit_rank, init_distributed
from trainer.worker import Trainer

FAILURES = "rollwave_trainer_device_handover_failures_total"


def colocated_trainer(pusher: LocalPusher, model_dir: Path, run_dir: Path, registry: CollectorRegistry | None = None
                      ) -> Trainer:
    """A trainer sharing its device through ``pusher``, checkpointing only at its end (the run's tenth step)."""
    return Trainer(TrainerConfig(total_steps=10, checkpoint_every=10, lr=1e-3, device="cpu"), model_dir, run_dir,
                   BufferConfig(groups_per_step=2), pusher=pusher, device_share=pusher, registry=registry)


def test_servers_that_do_not_release_the_device_in_time_are_logged_and_counted(
    redis_server, ctx, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's step waits ``placement.colocated_timeout_s`` for a live server that never releases: the
    TimeoutError that stops it is logged, naming that server (not the one that released), and counted
    (``rollwave_trainer_device_handover_failures_total{stage="release"}``); it used to be neither."""
    client, turns, _registry, staleness = run_parts(redis_server.url)
    servers = ServerRegistry(client, KEYS, ttl_s=600)  # live for the test without a heartbeat
    servers.register(ServerInfo("srv-a", engine_url="http://127.0.0.1:1"))
    servers.register(ServerInfo("srv-frozen", engine_url="http://127.0.0.1:2"))
    pusher = LocalPusher(tmp_path / "push", tiny_model_dir, turns, servers, staleness, timeout_s=0.5)
    metrics = CollectorRegistry()
    trainer = colocated_trainer(pusher, tiny_model_dir, tmp_path / "run", metrics).start(ctx=ctx)
    turns.released("srv-a", Turn("trainer", 1, epoch=pusher.epoch))
    caplog.set_level(logging.ERROR, logger="trainer.worker")
    assert metrics.get_sample_value(FAILURES, {"stage": "release"}) == 0
    try:
        with pytest.raises(TimeoutError, match="srv-frozen did not release"):
            trainer.train(synthetic_groups(0, 2))
    finally:
        trainer.close()
    assert metrics.get_sample_value(FAILURES, {"stage": "release"}) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "trainer.worker" and r.levelno == logging.ERROR]
    assert logged == ["the device's hand-over failed: colocated step 1: rollout server(s) srv-frozen did not release "
                      "their engines' memory within 0.5 s (stage release)"]


def test_the_last_checkpoint_after_the_data_ran_out_is_written_in_the_trainer_s_turn(
    redis_server, ctx, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose data runs out after step 1 (its checkpoint due at step 10) checkpoints at its end (``finish``): the
    trainer takes a turn for it (the engine releases its memory), writes it and gives the device back with the
    weights the engine served, which it loads again. The checkpoint used to be written after the last step had given
    the device back: the trainer took its memory back onto the device the engine held."""
    _client, turns, registry, staleness = run_parts(redis_server.url)
    pusher = LocalPusher(tmp_path / "push", tiny_model_dir, turns, registry, staleness, timeout_s=60)
    trainer = colocated_trainer(pusher, tiny_model_dir, tmp_path / "run")

    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        registry.register(ServerInfo("srv-a", engine_url=proc.url))
        engine, served = RecordingEngine(proc.url), {"version": 0}
        at_checkpoint: list[tuple[Turn | None, int]] = []

        async def run() -> list[str]:
            server = asyncio.create_task(follow(turns, engine, "srv-a", served).run())
            try:
                await asyncio.to_thread(trainer.start, ctx=ctx)
                await asyncio.to_thread(trainer.train, synthetic_groups(0, 2))
                await until(lambda: server.done() or served["version"] == 1, "the server to serve version 1")
                if server.done():
                    server.result()
                save = trainer.checkpointer.save

                def save_seen(*args, **kwargs) -> Path:
                    at_checkpoint.append((turns.turn(), engine_bytes(proc.url)))
                    return save(*args, **kwargs)

                monkeypatch.setattr(trainer.checkpointer, "save", save_seen)
                before = len(engine.calls)
                await asyncio.to_thread(trainer.finish, None)
                await until(lambda: server.done() or engine.calls[-1:] == ["continue"] and len(engine.calls) > before,
                            "the server to continue after the checkpoint")
                if server.done():
                    server.result()
                return engine.calls[before:]
            finally:
                await stop(server)
                await engine.aclose()
                trainer.close()

        calls = asyncio.run(run())
    assert at_checkpoint == [(Turn("trainer", 2, epoch=pusher.epoch), 0)]
    assert calls == ["pause retract", f"release {TAGS}", "resume ['weights']", "load 1",
                     "resume ['kv_cache', 'cuda_graph']", "continue"]
    assert trainer.checkpointer.latest() == tmp_path / "run" / "checkpoints" / "step_00000001"
    turn = turns.turn()
    assert turn is not None and (turn.holder, turn.version, turn.path) == ("rollout", 1, str(pusher.directory(1)))


def _push_on_ranks(rank: int, world: int, port: int, model_dir: Path, out: Path) -> None:
    """One rank's local push, its outcome written to ``out/rank<rank>``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    try:
        torch.manual_seed(0)
        try:
            outcome = f"returned {LocalPusher(out / 'push', model_dir).push_model(torch.nn.Linear(4, 4))}"
        except Exception as exc:  # noqa: BLE001 - the outcome the test reads
            outcome = f"{type(exc).__name__}: {exc}"
        (out / f"rank{rank}").write_text(outcome)
    finally:
        close_distributed()
    exit_rank()


def test_a_local_push_that_fails_on_rank_0_fails_every_rank_naming_the_stage(tmp_path: Path) -> None:
    """Two gloo ranks push; rank 0's write fails (the model's config.json cannot be copied; on a full tmpfs it is the
    safetensors file): rank 0 raises its error, and rank 1 an error naming the stage and rank 0's cause. Rank 1 used to
    return as after a push, going on to the step's next collective, where it waited for rank 0 until the group's
    timeout."""
    model_dir = tmp_path / "model"
    (model_dir / "config.json").mkdir(parents=True)
    spawn_ranks(_push_on_ranks, args=(2, free_port_outside_ephemeral(), model_dir, tmp_path), nprocs=2, join=True)
    cause = f"IsADirectoryError: [Errno 21] Is a directory: '{model_dir / 'config.json'}'"
    assert (tmp_path / "rank0").read_text() == cause
    assert (tmp_path / "rank1").read_text() == f"RuntimeError: the local push (stage write): rank 0 failed: {cause}"
    assert list((tmp_path / "push").iterdir()) == []  # no partial copy


class RefusedRelease(RecordingEngine):
    """The real client and engine; its release asks for a tag the engine does not know, so the engine refuses it
    (HTTP 400) and releases nothing, as a failed release on an engine does."""

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await super().release_memory([*(tags or TAGS), "activations"])


def test_a_failed_release_is_counted_and_never_reported_not_by_a_restarted_server_either(
    redis_server, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine refuses the release for the trainer's turn: the server logs and counts it
    (``device_handovers{event="release_failed"}``), reports no release, and its hand-over fails. Restarted, it
    pauses and releases the engine, whose memory is then free, before it reports. The record of what the engine holds
    released (written before the call) used to stay: the restarted server took the engine for released and reported
    it without a call, the trainer training beside the engine's memory."""
    client, turns, registry, _staleness = run_parts(redis_server.url)
    turn = turns.take(turns.new_epoch(), 1)
    caplog.set_level(logging.ERROR, logger="rollout_server.colocation")

    with EngineProcess(tiny_model_dir, weight_version="0", threads=1) as proc:
        registry.register(ServerInfo("srv-a", engine_url=proc.url))
        refused, restarted_engine, metrics = RefusedRelease(proc.url), RecordingEngine(proc.url), RolloutMetrics()
        failing = EngineTurns(turns, EngineGroup([refused]), "srv-a", lambda: 0, lambda _v: None, asyncio.to_thread,
                              metrics, warn_after_s=60)

        async def run() -> tuple[BaseException | None, list[str], int]:
            server = asyncio.create_task(failing.run())
            try:
                await until(server.done, "the failed release to end the hand-over")
                error = server.exception()
                reported = client.hexists(KEYS.device_released, "srv-a")
                assert not reported and turns.engines_released([proc.url]) == []
                registry.deregister("srv-a")
                registry.register(ServerInfo("srv-b", engine_url=proc.url))
                restarted = asyncio.create_task(follow(turns, restarted_engine, "srv-b", {"version": 0}).run())
                try:
                    await asyncio.to_thread(turns.wait_released, turn, registry, 60)
                    return error, restarted_engine.calls, engine_bytes(proc.url)
                finally:
                    await stop(restarted)
            finally:
                await stop(server)
                await refused.aclose()
                await restarted_engine.aclose()

        error, calls, held = asyncio.run(run())
    assert isinstance(error, EngineError) and error.status == 400, error
    assert handovers(metrics, "release_failed") == 1 and handovers(metrics, "release") == 0
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout_server.colocation"]
    assert len(logged) == 1 and logged[0].startswith(
        f"the engines' release for trainer step 1 (epoch {turn.epoch}) failed, not reported: ")
    assert calls == ["continue", "pause retract", f"release {TAGS}"]
    assert held == 0


def test_waiting_for_the_releases_drops_those_of_servers_no_longer_live(redis_server) -> None:
    """``device:released`` kept every server's report for good, dead ones' included. The trainer's wait drops the
    reports of servers out of the live set (deregistered, or whose heartbeat lapsed: killed) made for earlier turns;
    one made for the turn it waits for stays (a server back in the live set does not release again for it)."""
    client, turns, registry, _staleness = run_parts(redis_server.url)
    epoch = turns.new_epoch()
    earlier = Turn("trainer", 1, epoch=epoch)
    for sid in ("srv-a", "srv-gone", "srv-killed", "srv-lapsed"):
        registry.register(ServerInfo(sid, engine_url="http://127.0.0.1:1"))
    turns.released("srv-gone", earlier)
    turns.released("srv-killed", earlier)
    registry.deregister("srv-gone")
    client.delete(KEYS.server_alive("srv-killed"))  # its heartbeat lapsed: it was killed
    turn = turns.take(epoch, 2)
    turns.released("srv-a", turn)
    turns.released("srv-lapsed", turn)
    client.delete(KEYS.server_alive("srv-lapsed"))
    assert turns.wait_released(turn, registry, 60) == ["srv-a"]
    assert client.hgetall(KEYS.device_released) == {b"srv-a": turn.key.encode(), b"srv-lapsed": turn.key.encode()}
