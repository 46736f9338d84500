"""A trainer fenced by a newer trainer of its run (``ReplayBuffer.fence``) writes no checkpoint and commits no weights
after that: the newer trainer resumes from the run's latest checkpoint, and numbers its versions from what the servers
serve. Real Redis, a real receiver in front of a stub engine, real ranks (gloo)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest
import redis
import torch
import torch.multiprocessing as mp
from pydantic import SecretStr
from test_checkpoint_faults import config, model_of, push
from test_engine_client import serve, sglang_056_stub
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.replay import ReplayBuffer, TrainerFenced
from core.config import BufferConfig, CheckpointConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_pusher import CheckpointPusher
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed
from trainer.worker import Trainer

GPS = 2
TRAINER = {"micro_batch_tokens": 128, "take_timeout_s": 0.5, "device": "cpu", "checkpoint_every": 1}


def _buffer(url: str, run: str) -> ReplayBuffer:
    buffer = ReplayBuffer(redis.Redis.from_url(url), Keys(run), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    return buffer


def test_a_fenced_trainer_neither_pushes_nor_checkpoints_the_step_it_trained(
    ctx: DistContext, redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The newer trainer starts while the older one trains a step it took before: the step used to be pushed to the
    servers and checkpointed all the same, the checkpoint then the newer trainer's resume point after its next crash.
    Now the older one stops before either, and its run directory holds nothing, not even a half-written checkpoint."""
    old = _buffer(redis_server.url, "fenced-step")
    assert old.put_many(synthetic_groups(0, GPS, run="fenced-step")) == [1] * GPS
    pusher = CheckpointPusher(CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32))), [])
    trainer = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path, BufferConfig(groups_per_step=GPS),
                      pusher=pusher, fence=old.check_fence).start(ctx=ctx)
    try:
        groups, _ = trainer.next_batch(old)
        _buffer(redis_server.url, "fenced-step").fence()  # the newer trainer
        with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-step started"):
            trainer.train(groups)
    finally:
        trainer.close()
        pusher.close()
    assert pusher.last_pushed == 0 and not (tmp_path / "checkpoints").exists()


def test_a_checkpoint_a_newer_trainer_started_during_is_not_listed(ctx: DistContext, redis_server: EmbeddedRedis,
                                                                    tmp_path: Path, tiny_model_dir: Path) -> None:
    """The newer trainer starts while the older one's checkpoint is written: it is not renamed into place (the newer
    trainer would resume from it), and the newer trainer's own first checkpoint removes what it left."""
    old, newer = _buffer(redis_server.url, "fenced-save"), _buffer(redis_server.url, "fenced-save")
    old.fence()
    asked: list[int] = []

    def newer_starts_during_the_save() -> None:
        old.check_fence()
        asked.append(1)
        if len(asked) == 1:  # asked before the write: the newer trainer starts while it is written
            newer.fence()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=2)
    with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-save started"):
        checkpoints.save(3, model, optimizer, scheduler, {}, fence=newer_starts_during_the_save)
    assert len(asked) == 1 and checkpoints.list() == []
    saved = checkpoints.save(1, model, optimizer, scheduler, {}, fence=newer.check_fence)
    assert checkpoints.list() == [saved] and sorted(p.name for p in checkpoints.root.iterdir()) == [saved.name]


def test_a_fenced_trainer_s_push_is_refused_before_its_commit_and_its_flush_says_so(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """After the newer trainer started, the older one's push is not committed (the server still serves the older
    one's last version), fails at stage ``fence``, counted, and is not recorded as the server's last push (the newer
    trainer's pushes are); its ``flush`` raises ``TrainerFenced`` in the trainer's thread. The newer trainer's push of
    the next version then stages and commits its own weights: the older one's commit used to land under that number,
    and the newer push found it served and sent nothing."""
    cfg = config(tmp_path, retries=0)
    client, keys = redis.Redis.from_url(redis_server.url), Keys("fenced-push")
    registry = ServerRegistry(client, keys)
    old, newer = _buffer(redis_server.url, keys.run), _buffer(redis_server.url, keys.run)
    old.fence()
    model = model_of(tiny_model_dir)

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            receiver = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "stub")
            address = await receiver.start()
            older = CheckpointPusher(cfg, [address], fence=old.check_fence, record=registry.record_push)
            newest = CheckpointPusher(cfg, [address], fence=newer.check_fence, record=registry.record_push)
            try:
                assert (await push(older, model, 1)).ok and receiver.version == 1
                newer.fence()
                [refused] = (await push(older, model, 2)).servers
                assert (refused.ok, refused.stage, refused.reason) == (False, "fence", "fenced"), refused
                assert "a newer trainer of run fenced-push started" in refused.error
                assert receiver.version == 1
                assert older.metrics.registry.get_sample_value(
                    "rollwave_trainer_push_failures_total", {"stage": "fence", "reason": "fenced"}) == 1
                assert (registry.pushes()[address].version, registry.pushes()[address].ok) == (1, True)
                with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-push started"):
                    await asyncio.to_thread(older.flush, 10.0)
                [committed] = (await push(newest, model, 2)).servers
                assert committed.ok and committed.bytes > 0 and receiver.version == 2, committed
            finally:
                await asyncio.to_thread(older.close)
                await asyncio.to_thread(newest.close)
                await receiver.stop()

    asyncio.run(run())


def _fenced_ranks(rank: int, world: int, port: int, redis_url: str, model_dir: Path, run_dir: Path,
                  where: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=60)
    outcome = "trained"
    try:
        fence, old = None, None
        if rank == 0:
            old = _buffer(redis_url, "fenced-ranks")
            old.fence()
            _buffer(redis_url, "fenced-ranks").fence()  # the newer trainer
            fence = old.check_fence
        trainer = Trainer(TrainerConfig(**TRAINER), model_dir, run_dir, fence=fence).start(ctx=ctx)
        try:
            if where == "take":  # rank 0's take is refused; the others wait in its broadcast
                trainer.next_batch(old)
            else:
                trainer.train(synthetic_groups(0, GPS))  # every rank trains the batch rank 0 shares
        except TrainerFenced as exc:
            outcome = f"fenced: {exc}"
        finally:
            trainer.close()
        (run_dir / f"rank{rank}").write_text(outcome)
    finally:
        close_distributed()
    exit_rank()


@pytest.mark.parametrize("where", ["checkpoint", "take"])
def test_every_rank_of_a_fenced_trainer_stops_together(redis_server: EmbeddedRedis, tiny_model_dir: Path,
                                                       tmp_path: Path, where: str) -> None:
    """Rank 0 alone reads the fence (before the checkpoint, or in its take); the other ranks stop with it, before the
    checkpoint's collectives or out of the read's broadcast, rather than waiting in them for a rank that left."""
    args = (2, free_port_outside_ephemeral(), redis_server.url, tiny_model_dir, tmp_path, where)
    mp.spawn(_fenced_ranks, args=args, nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text().startswith(
            "fenced: rw:fenced-ranks:trainer:epoch is 2: a newer trainer of run fenced-ranks started"), rank
    assert Checkpointer(tmp_path / "checkpoints", 1).list() == []
