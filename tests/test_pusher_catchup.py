"""A rollout server that restarts after the newest version was pushed: the pusher catches it up, or, when it cannot
(the newest version is kept only cast to a dtype the restarted server does not serve), says so loudly (an error naming
the server) and counts it in ``rollwave_trainer_push_stranded_servers`` until a newer version reaches it. A server
listed by address alone (no registry, no ``started``) is caught up too: the pusher learns of its restart from its
Status.

A real pusher and real receivers on 127.0.0.1, in front of an SGLang-shaped stub engine
(``test_engine_client.sglang_056_stub``); the weights file a receiver committed is what its engine was told to load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_engine_client import serve, sglang_056_stub
from test_pusher_restart_dtype import WAIT_S, Fleet, bf16_copy, restarted_in_fp32, trainer_side

from core.checkpoint_format import MODEL_WEIGHTS
from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, PushResult, Target

STRANDED = "rollwave_trainer_push_stranded_servers"


async def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)


async def refused_catch_up(pusher: CheckpointPusher) -> PushResult:
    """The watcher's catch-up of a restarted server, refused: the newest snapshot is cast to a dtype it does not
    serve."""
    results: list[PushResult] = []

    def arrived() -> bool:
        results.extend(r for r in pusher.take_results() if not r.skipped)
        return bool(results)

    await wait_for("the catch-up of the restarted server", arrived)
    (caught_up,) = results
    assert (caught_up.version, caught_up.ok, caught_up.stage, caught_up.reason) == (2, False, "stage", "cast")
    return caught_up


def stranded(pusher: CheckpointPusher) -> float | None:
    return pusher.metrics.registry.get_sample_value(STRANDED, {"reason": "cast"})


def named_stranded(caplog: pytest.LogCaptureFixture, server: str) -> bool:
    """An error names ``server``, the version it serves (its base weights) and the newest, which it lacks."""
    return any(r.levelno == logging.ERROR and r.getMessage().startswith(f"server {server} (")
               and "stays on version 0, behind the newest, 2" in r.getMessage() for r in caplog.records)


def test_a_server_restarted_in_fp32_after_the_last_version_is_named_until_a_newer_version_reaches_it(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Back on its base weights after version 2, the newest, which is kept only in bf16: the catch-up is refused, and
    the server used to stay on version 0 with a warning only. Now an error names it and says it stays behind until the
    trainer pushes a newer version, and the stranded gauge counts it until version 3 reaches it."""

    async def check(fleet: Fleet) -> None:
        await refused_catch_up(fleet.pusher)
        assert stranded(fleet.pusher) == 1
        assert named_stranded(caplog, "srv")
        assert fleet.rec.service._state.current == 0
        await fleet.push(3)
        assert fleet.rec.service._state.current == 3
        assert stranded(fleet.pusher) == 0

    async def main() -> None:
        async with restarted_in_fp32(tiny_model_dir, tmp_path, 0) as fleet:
            await check(fleet)

    asyncio.run(main())


class FixedAddress:
    """A pusher given one plain address (as the bench scripts use it) and the receiver there, restarted at will."""

    def __init__(self, cfg: CheckpointConfig, engine: EngineClient, url: str, model: torch.nn.Module) -> None:
        self.cfg, self.engine, self.url, self.model = cfg, engine, url, model
        self.want = {n: t.detach().clone() for n, t in model.state_dict().items()}
        self.rec: CheckpointReceiver | None = None
        self.address = ""
        self.pusher: CheckpointPusher | None = None

    async def start(self, model_dir: Path) -> None:
        """(Re)start the receiver at the address, on ``model_dir``'s weights (version 0)."""
        if self.rec is not None:
            await self.rec.stop()
        port = int(self.address.rsplit(":", 1)[1]) if self.address else 0
        self.rec = CheckpointReceiver(self.cfg, model_dir, self.engine, self.url, "srv", port=port)
        self.address = await self.rec.start()
        if self.pusher is None:
            self.pusher = CheckpointPusher(self.cfg, [self.address])

    async def push(self, version: int) -> None:
        pusher = self.pusher
        assert pusher is not None
        rnd = await asyncio.to_thread(lambda: pusher.push_model(self.model, version).wait(WAIT_S))
        assert rnd.ok, [s.error for s in rnd.servers]

    def serves(self) -> int:
        assert self.rec is not None
        return self.rec.service._state.current

    def not_the_trainer_s(self) -> list[str]:
        """Tensors of the version the server committed that are not the trainer's fp32 weights exactly."""
        assert self.rec is not None
        loaded = load_file(self.rec.service._state.current_dir / MODEL_WEIGHTS)
        return [n for n, t in loaded.items() if t.dtype != torch.float32 or not torch.equal(t, self.want[n])]


@contextlib.asynccontextmanager
async def fixed_address(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[FixedAddress]:
    cfg, model = trainer_side(tiny_model_dir, tmp_path)
    app, _, _ = sglang_056_stub()
    async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
        fixed = FixedAddress(cfg, engine, url, model)
        try:
            yield fixed
        finally:
            if fixed.pusher is not None:
                await asyncio.to_thread(fixed.pusher.close)
            if fixed.rec is not None:
                await fixed.rec.stop()


def test_a_server_at_a_fixed_address_is_caught_up_after_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A plain address list carries no restart: the pusher counted the version the server committed before it
    restarted as served, and the server stayed on its base weights. Now the watcher asks its Status, sees it serves
    less than it committed, and catches it up with the trainer's weights."""

    async def main() -> None:
        async with fixed_address(tiny_model_dir, tmp_path) as fixed:
            await fixed.start(tiny_model_dir)
            await fixed.push(1)
            await fixed.start(tiny_model_dir)
            assert fixed.serves() == 0
            await wait_for("the catch-up of the restarted server", lambda: fixed.serves() == 1)
            assert fixed.not_the_trainer_s() == []

    asyncio.run(main())


def test_a_server_at_a_fixed_address_restarted_in_fp32_gets_no_bf16_weights_and_is_named(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Served bf16 (version 2 cast to it), restarted in fp32 at the same address: its catch-up is refused, its dtypes
    are its new incarnation's (the next version is not cast to bf16 for it), and it is named and counted stranded until
    version 3 reaches it, in the trainer's fp32 exactly."""

    async def main() -> None:
        async with fixed_address(tiny_model_dir, tmp_path) as fixed:
            await fixed.start(bf16_copy(tiny_model_dir, tmp_path / "bf16" / "model"))
            await fixed.push(1)
            await fixed.push(2)
            assert fixed.pusher is not None
            fixed.pusher.take_results()
            await fixed.start(tiny_model_dir)
            await refused_catch_up(fixed.pusher)
            assert stranded(fixed.pusher) == 1
            assert named_stranded(caplog, fixed.address)
            assert fixed.serves() == 0
            await fixed.push(3)
            assert fixed.serves() == 3
            assert fixed.not_the_trainer_s() == []
            assert stranded(fixed.pusher) == 0

    asyncio.run(main())


def test_the_newest_version_pushed_again_goes_to_the_stranded_server_alone(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """Two bf16 servers committed version 2 (cast to bf16); one restarted in fp32. Pushing version 2 again from the
    trainer's fp32 weights (``repush_model``, what a waiting trainer does) sends it to that one alone, which then serves
    the trainer's weights exactly: the other keeps what it committed, nothing is published anew, and once it is served
    no re-push is due any more."""

    async def main() -> None:
        cfg, model = trainer_side(tiny_model_dir, tmp_path)
        bf16 = bf16_copy(tiny_model_dir, tmp_path / "bf16" / "model")
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            recs = {name: CheckpointReceiver(cfg, bf16, engine, url, name) for name in ("kept", "srv")}
            live = [Target(name, await rec.start(), started=1.0) for name, rec in recs.items()]
            fleet = Fleet(cfg, CheckpointPusher(cfg, lambda: list(live)), recs["srv"], model)
            try:
                await fleet.push(1)
                await fleet.push(2)
                kept = recs["kept"].service._state.current_dir
                fleet.pusher.take_results()
                await fleet.rec.stop()
                fleet.rec = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "srv",
                                               port=int(live[1].address.rsplit(":", 1)[1]))
                await fleet.rec.start()
                live[1] = Target("srv", live[1].address, started=2.0)
                await refused_catch_up(fleet.pusher)
                await wait_for("the re-push due", lambda: fleet.pusher.repush_due() == 2)
                offered = await asyncio.to_thread(fleet.pusher.repush_model, model, 2)
                assert offered == [f"srv ({live[1].address})"]
                await wait_for("version 2 on the restarted server", lambda: fleet.rec.service._state.current == 2)
                assert fleet.not_the_trainer_s() == []
                assert await asyncio.to_thread(fleet.pusher.flush) == []
                assert [(r.server_id, r.version, r.ok) for r in fleet.pusher.take_results()] == [("srv", 2, True)]
                assert recs["kept"].service._state.current_dir == kept and stranded(fleet.pusher) == 0
                assert (fleet.pusher.last_pushed, fleet.pusher.published, fleet.pusher.repush_due()) == (2, 2, 0)
            finally:
                await asyncio.to_thread(fleet.pusher.close)
                await recs["kept"].stop()
                await fleet.rec.stop()

    asyncio.run(main())
