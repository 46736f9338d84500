"""A rollout server restarted under its id and address in another dtype: the pusher casts a snapshot only to dtypes
that the server's present incarnation (its registration's ``started``) said it serves, and does not catch it up with
a snapshot cast for its last incarnation.

A real pusher and real receivers on 127.0.0.1, in front of an SGLang-shaped stub engine
(``test_engine_client.sglang_056_stub``); the weights file a receiver committed is what its engine was told to load.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import torch
from pydantic import SecretStr
from safetensors.torch import load_file, save_file
from test_engine_client import serve, sglang_056_stub
from transformers import AutoModelForCausalLM

from core.checkpoint_format import MODEL_WEIGHTS
from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, PushResult, Target

WAIT_S = 60.0


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with its weights saved in bf16, as a bf16 deployment serves them."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / MODEL_WEIGHTS)
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, out / MODEL_WEIGHTS, metadata={"format": "pt"})
    return out


class Fleet:
    """One server ``srv`` that served bf16 and committed versions 1 (the trainer's fp32: it was not known yet) and 2
    (bf16: cast once for the fleet), then restarted under the same id and address serving fp32, back on
    ``back_on``; the pusher, trained fp32 weights (most are not exact in bf16) and what a push of them costs."""

    def __init__(self, cfg: CheckpointConfig, pusher: CheckpointPusher, rec: CheckpointReceiver,
                 model: torch.nn.Module) -> None:
        self.cfg, self.pusher, self.rec, self.model = cfg, pusher, rec, model
        self.want = {n: t.detach().clone() for n, t in model.state_dict().items()}
        self.full = 0  # the bytes of a snapshot in the trainer's fp32

    async def push(self, version: int) -> int:
        """Push ``version``; the bytes of its snapshot."""
        rnd = await asyncio.to_thread(lambda: self.pusher.push_model(self.model, version).wait(WAIT_S))
        assert rnd.ok, [s.error for s in rnd.servers]
        return self.pusher._newest.nbytes  # type: ignore[union-attr]

    def not_the_trainer_s(self) -> list[str]:
        """Tensors of the version the server committed that are not the trainer's fp32 weights exactly."""
        loaded = load_file(self.rec.service._state.current_dir / MODEL_WEIGHTS)
        return [n for n, t in loaded.items() if t.dtype != torch.float32 or not torch.equal(t, self.want[n])]


def trainer_side(tiny_model_dir: Path, tmp_path: Path) -> tuple[CheckpointConfig, torch.nn.Module]:
    """The pusher's config (a fresh token, no retries) and the trainer's fp32 weights: the tiny model, moved off the
    served base weights, so a server that loaded them is told apart from one that did not."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=5.0, retries=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    return cfg, model


@contextlib.asynccontextmanager
async def restarted_in_fp32(tiny_model_dir: Path, tmp_path: Path, back_on: int) -> AsyncIterator[Fleet]:
    cfg, model = trainer_side(tiny_model_dir, tmp_path)
    bf16_dir = bf16_copy(tiny_model_dir, tmp_path / "bf16" / "model")
    app, _, _ = sglang_056_stub()
    async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
        rec = CheckpointReceiver(cfg, bf16_dir, engine, url, "srv")
        address = await rec.start()
        live = [Target("srv", address, started=1.0)]
        fleet = Fleet(cfg, CheckpointPusher(cfg, lambda: list(live)), rec, model)
        try:
            fleet.full = await fleet.push(1)
            assert await fleet.push(2) * 2 == fleet.full  # known to serve bf16
            fleet.pusher.take_results()  # the tests read what comes after the restart
            await rec.stop()
            fleet.rec = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "srv",
                                           port=int(address.rsplit(":", 1)[1]), version=back_on)
            await fleet.rec.start()
            live[0] = Target("srv", address, version=back_on, started=2.0)
            yield fleet
        finally:
            await asyncio.to_thread(fleet.pusher.close)
            await fleet.rec.stop()


def run(tiny_model_dir: Path, tmp_path: Path, back_on: int, check: Callable[[Fleet], Awaitable[None]]) -> None:
    async def main() -> None:
        async with restarted_in_fp32(tiny_model_dir, tmp_path, back_on) as fleet:
            await check(fleet)

    asyncio.run(main())


def test_a_server_restarted_in_fp32_where_it_served_bf16_gets_the_trainer_s_fp32_weights(tiny_model_dir: Path,
                                                                                         tmp_path: Path) -> None:
    """Back on version 2 (no catch-up due). Version 3 used to be cast to the bf16 its last incarnation served, so the
    fp32 server loaded bf16-rounded weights; now the snapshot keeps the trainer's fp32 until the new incarnation
    answers, and the server loads the trainer's weights exactly."""

    async def check(fleet: Fleet) -> None:
        three = await fleet.push(3)
        assert fleet.rec.service._state.current == 3
        assert fleet.not_the_trainer_s() == []
        assert three == fleet.full  # the snapshot in the trainer's fp32, not cast to the old incarnation's bf16

    run(tiny_model_dir, tmp_path, 2, check)


def test_a_server_restarted_in_fp32_is_not_caught_up_with_a_snapshot_cast_to_bf16(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """Back on its base weights (version 0): the watcher catches it up with the newest snapshot, version 2, which
    was cast to bf16 for the fleet, so the fp32 server loaded bf16-rounded weights under version 2. Now the
    catch-up is refused once it answers in fp32 (logged, counted at stage ``stage`` with reason ``cast``, recorded)
    and the server stays on its base weights until version 3, which it loads in the trainer's fp32 exactly."""

    async def check(fleet: Fleet) -> None:
        deadline, results = time.monotonic() + WAIT_S, list[PushResult]()
        while not results:  # the watcher's catch-up of the restarted server
            assert time.monotonic() < deadline, "gave up waiting for the catch-up of the restarted server"
            await asyncio.sleep(0.02)
            results = [r for r in fleet.pusher.take_results() if not r.skipped]
        (caught_up,) = results
        assert (caught_up.version, caught_up.ok, caught_up.stage, caught_up.reason) == (2, False, "stage", "cast")
        assert "in bfloat16" in caught_up.error and "(this server serves float32)" in caught_up.error
        assert fleet.pusher.metrics.registry.get_sample_value(
            "rollwave_trainer_push_failures_total", {"stage": "stage", "reason": "cast"}) == 1
        assert fleet.rec.service._state.current == 0
        assert await fleet.push(3) == fleet.full
        assert fleet.rec.service._state.current == 3
        assert fleet.not_the_trainer_s() == []

    run(tiny_model_dir, tmp_path, 0, check)
