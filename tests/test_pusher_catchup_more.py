"""A waiting trainer reaches the servers stranded from its newest version (restarted in fp32 where the version was cast
to bf16) in more settings than ``test_pusher_catchup`` covers: with ``buffer.push_every`` above 1 and steps trained
since the newest version (it pushes its present weights as a new version, ahead of schedule), from a pool of two ranks
(gloo, FSDP2), and without its snapshots holding the trainer's fp32 beside the fleet's bf16 for ever.

A real trainer and pusher, and a real receiver on 127.0.0.1 in front of an SGLang-shaped stub engine
(``test_engine_client.sglang_056_stub``); the weights file the receiver committed is what its engine was told to load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from rank_helpers import spawn_ranks
from safetensors.torch import load_file, save_file
from test_engine_client import serve, sglang_056_stub
from test_pusher_catchup import refused_catch_up, stranded, wait_for
from test_pusher_restart_dtype import WAIT_S, bf16_copy, trainer_side
from trainer_helpers import join_within, synthetic_groups
from transformers import AutoModelForCausalLM

from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from core.checkpoint_format import MODEL_WEIGHTS
from core.config import BufferConfig, CheckpointConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, Target
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed, iter_full_params
from trainer.snapshot import model_metas
from trainer.worker import Trainer

GPS = 2
GROUP_TIMEOUT_S = 60.0
START_S = 240.0  # two ranks' start and steps on a loaded machine (spawned, a minute was not unusual)


def trainer_config() -> TrainerConfig:
    return TrainerConfig(micro_batch_tokens=128, take_timeout_s=0.2, device="cpu", checkpoint_every=100)


def not_exactly(loaded: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Tensors of the weights a server loaded that are not ``want``, the trainer's fp32 weights, exactly."""
    assert loaded.keys() == want.keys()
    return [n for n, t in loaded.items() if t.dtype != torch.float32 or not torch.equal(t, want[n])]


def served_bf16_then_started(pusher: CheckpointPusher, trainer: Trainer, ctx: DistContext) -> Trainer:
    """Version 1 (the base weights) pushed to the bf16 server before ``trainer`` starts, in fp32 (its dtypes were not
    known yet), so that the trainer's start pushes version 2, cast to bf16. Rank 0 pushes; another rank's ``pusher``
    pushes nothing."""
    if ctx.is_main:
        rnd = pusher.push_model(AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32), 1)
        assert rnd is not None and rnd.wait(WAIT_S).ok, [s.error for s in rnd.servers]
        pusher.published = 1  # the round's quorum publishes it too, a moment after its wait ends
    return trainer.start(ctx=ctx)


@dataclass
class Stranded:
    """A trainer whose one server ``srv`` served bf16 and is stranded from version 2 (the newest, cast to bf16): it
    restarted in fp32, back on its base weights, and the pusher's catch-up was refused."""

    trainer: Trainer
    pusher: CheckpointPusher
    rec: CheckpointReceiver
    buffer: ReplayBuffer
    full: int  # the bytes of a snapshot in the trainer's fp32

    def loaded_not_the_trainer_s(self) -> list[str]:
        """Tensors of the version the server committed that are not the trainer's present fp32 weights exactly."""
        want = {n: t for n, t in iter_full_params(self.trainer.model) if t is not None}
        return not_exactly(load_file(self.rec.service._state.current_dir / MODEL_WEIGHTS), want)

    async def next_batch_once_served(self, version: int) -> None:
        """The trainer waits for data until the server serves ``version``; a batch then ends the wait, whatever
        happened."""
        waiting = asyncio.create_task(asyncio.to_thread(self.trainer.next_batch, self.buffer))
        try:
            await wait_for(f"version {version} on the restarted server",
                           lambda: self.rec.service._state.current == version)
        finally:
            self.buffer.put_many(synthetic_groups(9, GPS, version=version, run=self.buffer.keys.run))
            await waiting


@dataclass
class Bf16Server:
    """A receiver on 127.0.0.1 serving a bf16 copy of the model, in front of an SGLang-shaped stub engine."""

    cfg: CheckpointConfig
    engine: EngineClient
    url: str
    rec: CheckpointReceiver
    address: str

    async def restart_in_fp32(self, model_dir: Path) -> None:
        """The server restarted on its port serving ``model_dir`` (fp32): back on its base weights."""
        await self.rec.stop()
        self.rec = CheckpointReceiver(self.cfg, model_dir, self.engine, self.url, "srv",
                                      port=int(self.address.rsplit(":", 1)[1]))
        await self.rec.start()


@contextlib.asynccontextmanager
async def bf16_server(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Bf16Server]:
    """``Bf16Server``, stopped on the way out."""
    cfg, _ = trainer_side(tiny_model_dir, tmp_path)
    app, _, _ = sglang_056_stub()
    async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
        rec = CheckpointReceiver(cfg, bf16_copy(tiny_model_dir, tmp_path / "bf16" / "model"), engine, url, "srv")
        server = Bf16Server(cfg, engine, url, rec, await rec.start())
        try:
            yield server
        finally:
            await server.rec.stop()


def trainer_buffer(redis_url: str, run: str) -> ReplayBuffer:
    buffer = ReplayBuffer(redis.Redis.from_url(redis_url), Keys(run), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    return buffer


@contextlib.asynccontextmanager
async def stranded_trainer(ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path: Path, push_every: int,
                           steps: int) -> AsyncIterator[Stranded]:
    """``Stranded``, the trainer at ``buffer.push_every`` = ``push_every`` having trained ``steps`` steps since its
    start push (none pushed) when the server restarted."""
    buffer = trainer_buffer(redis_url, f"more-{push_every}-{steps}")
    async with bf16_server(tiny_model_dir, tmp_path) as server:
        live = [Target("srv", server.address, started=1.0)]
        pusher = CheckpointPusher(server.cfg, lambda: list(live))
        trainer = Trainer(trainer_config(), tiny_model_dir, tmp_path / "run",
                          BufferConfig(groups_per_step=GPS, push_every=push_every), pusher=pusher)
        try:
            await asyncio.to_thread(served_bf16_then_started, pusher, trainer, ctx)
            full = sum(m.nbytes for m in model_metas(trainer.model))
            for seed in range(steps):
                await asyncio.to_thread(trainer.train, synthetic_groups(seed, GPS))
            assert await asyncio.to_thread(pusher.flush) == [] and server.rec.service._state.current == 2
            assert (trainer.step, pusher.last_pushed) == (steps, 2)
            pusher.take_results()
            await server.restart_in_fp32(tiny_model_dir)
            live[0] = Target("srv", server.address, started=2.0)
            await refused_catch_up(pusher)
            assert stranded(pusher) == 1
            yield Stranded(trainer, pusher, server.rec, buffer, full)
        finally:
            trainer.close()
            await asyncio.to_thread(pusher.close)


def test_a_trainer_that_trained_since_the_newest_version_pushes_its_weights_as_a_new_one_to_a_stranded_fleet(
        ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """``buffer.push_every`` 3, one step trained since version 2 when its only server restarted in fp32: the trainer's
    masters are no longer version 2's, so no re-push was due, and the fleet stayed on its base weights until the next
    scheduled push, two steps away, which the trainer, waiting for data the stale fleet could not make, never reached.
    Now the waiting trainer pushes its present weights as version 3, ahead of schedule and in its fp32: the server
    serves them exactly, version 3 is published, and the server is no longer counted stranded."""

    async def main() -> None:
        async with stranded_trainer(ctx, tiny_model_dir, redis_url, tmp_path, push_every=3, steps=1) as fleet:
            await fleet.next_batch_once_served(3)
            assert fleet.loaded_not_the_trainer_s() == []
            assert (fleet.trainer.step, fleet.pusher.last_pushed) == (1, 3)
            await wait_for("version 3 published", lambda: fleet.pusher.published == 3)
            await wait_for("the stranded gauge back to 0", lambda: stranded(fleet.pusher) == 0)
            assert [(r.version, r.ok) for r in fleet.pusher.take_results() if not r.skipped] == [(3, True)]

    asyncio.run(main())


def test_a_re_push_in_the_trainer_s_precision_leaves_no_fp32_buffer_beside_the_fleet_s_bf16(
        ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """``buffer.push_every`` 3, no step trained since version 2 (the start push, cast to bf16): the waiting trainer
    pushes version 2 again in its fp32 to the restarted server alone, which then serves the trainer's weights exactly
    (the server, the whole fleet, used to stay on version 0 for ever, its groups too stale to train); no new version is
    pushed, and the server is no longer counted stranded. The pusher's snapshot buffers used to keep version 1's
    fp32 buffer (taken before the server's dtypes were known) beside the bf16 ones for ever, and the re-push's fp32
    buffer after it was sent: twice the pushed weights in host memory. Now they hold the newest version and pooled
    buffers of its size alone, before and after the re-push."""

    async def main() -> None:
        async with stranded_trainer(ctx, tiny_model_dir, redis_url, tmp_path, push_every=3, steps=0) as fleet:
            pusher = fleet.pusher
            newest = pusher._newest
            assert newest is not None and 2 * newest.nbytes == fleet.full  # cast to bf16

            def held() -> list[int]:
                """The bytes of each host buffer the pusher keeps: the newest version's, then the pooled ones."""
                return [newest.nbytes] + [b.numel() for b in pusher._pool._free]

            assert set(held()) == {newest.nbytes}, held()
            await fleet.next_batch_once_served(2)
            assert fleet.loaded_not_the_trainer_s() == []
            assert await asyncio.to_thread(pusher.flush) == []
            assert [(r.version, r.ok) for r in pusher.take_results() if not r.skipped] == [(2, True)]
            assert pusher._newest is newest and pusher.last_pushed == 2 and pusher.published == 2
            assert set(held()) == {newest.nbytes} and sum(held()) <= fleet.full, held()
            await wait_for("the stranded gauge back to 0", lambda: stranded(pusher) == 0)

    asyncio.run(main())


def _two_ranks(rank: int, port: int, model_dir: Path, cfg: CheckpointConfig, address: str, redis_url: str,
               out: Path, steps: int) -> None:
    """One rank of a pool of two at ``buffer.push_every`` 3: rank 0 pushes to ``address``; both train ``steps`` steps
    (no push due), then wait for data until rank 0's read gets a batch; rank 0 writes the trainer's full weights once
    trained and what its pusher saw after the start push."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=GROUP_TIMEOUT_S)
    pusher = CheckpointPusher(cfg, [address] if rank == 0 else [])
    try:
        trainer = Trainer(trainer_config(), model_dir, out / "run", BufferConfig(groups_per_step=GPS, push_every=3),
                          pusher=pusher)
        served_bf16_then_started(pusher, trainer, ctx)
        if rank == 0:
            assert pusher.flush() == []
            pusher.take_results()
        for seed in range(steps):
            trainer.train(synthetic_groups(seed, GPS))
        if rank == 0:  # the server restarts only after this: a step's record takes the push results that came before
            (out / "trained").touch()
        want = {n: t.clone() for n, t in iter_full_params(trainer.model) if t is not None}  # on rank 0
        buffer = None
        if rank == 0:
            save_file(want, out / "want.safetensors")
            buffer = ReplayBuffer(redis.Redis.from_url(redis_url), Keys(f"more-ranks-{steps}"), BufferConfig(),
                                  consumer="trainer")
        trainer.next_batch(buffer)
        if rank == 0:
            assert pusher.flush() == []
            seen = {"results": [(r.version, r.ok, r.reason) for r in pusher.take_results() if not r.skipped],
                    "step": trainer.step, "last_pushed": pusher.last_pushed}
            (out / "rank0.json").write_text(json.dumps(seen))
        trainer.close()
    finally:
        pusher.close()
        close_distributed()
    exit_rank()


@pytest.mark.parametrize("steps", [0, 1])
def test_a_pool_of_two_ranks_reaches_a_stranded_server(tiny_model_dir: Path, redis_url: str, tmp_path: Path,
                                                       steps: int) -> None:
    """Two ranks (gloo, FSDP2) pushed version 2 at their start, cast to bf16 for their one bf16 server, which then
    restarted in fp32 (at its address alone: its Status tells the restart). While they wait for data, both ranks
    gather the weights again and rank 0 pushes them in fp32 to that server, which then serves the trainer's full
    weights exactly: with no step trained since, version 2 once more, and no new version; with one step trained since
    (``buffer.push_every`` 3: none due), the present weights as version 3."""
    buffer = trainer_buffer(redis_url, f"more-ranks-{steps}")
    version = 2 + (steps > 0)

    async def main() -> None:
        async with bf16_server(tiny_model_dir, tmp_path) as server:
            args = (free_port_outside_ephemeral(), tiny_model_dir, server.cfg, server.address, redis_url, tmp_path,
                    steps)
            ranks = spawn_ranks(_two_ranks, args=args, nprocs=2, join=False)
            try:
                deadline = time.monotonic() + START_S
                # the ranks' start push, and their steps trained (a restart in a step: its refused catch-up was that
                # step's push result, not the one read after the wait)
                while server.rec.service._state.current != 2 or not (tmp_path / "trained").exists():
                    assert all(p.is_alive() for p in ranks.processes), "a rank ended before its start push"
                    assert time.monotonic() < deadline, f"no start push and {steps} step(s) within {START_S} s"
                    await asyncio.sleep(0.05)
                await server.restart_in_fp32(tiny_model_dir)
                await wait_for(f"version {version} on the restarted server",
                               lambda: server.rec.service._state.current == version)
                loaded = load_file(server.rec.service._state.current_dir / MODEL_WEIGHTS)
            finally:  # a batch ends the ranks' wait, whatever happened
                buffer.put_many(synthetic_groups(9, GPS, version=version, run=f"more-ranks-{steps}"))
                await asyncio.to_thread(join_within, ranks, WAIT_S, GROUP_TIMEOUT_S)
        assert not_exactly(loaded, load_file(tmp_path / "want.safetensors")) == []
        seen = json.loads((tmp_path / "rank0.json").read_text())
        assert seen == {"results": [[2, False, "cast"], [version, True, ""]], "step": steps, "last_pushed": version}

    asyncio.run(main())
