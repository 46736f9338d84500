"""A pool asked to stop stops inside its step, every rank at the same stop point, rather than after the whole step.

A pool used to stop only before its next buffer read (``stop_point`` in ``next_batch``): a stop waited for every
minibatch update and micro-batch of the step in hand, then its push and its checkpoint, which for a big model outlasts
a supervisor's grace (Kubernetes' 30 s by default), so the pool was killed with its end unrecorded and its lease left to
lapse. It now stops before each optimizer update and every few micro-batches (``STOP_EVERY_MICRO_BATCHES``); the step
stopped so is neither applied in part past the update in hand, nor pushed, nor checkpointed, and its groups stay unacked
for the next trainer.

Two real ranks (gloo): spawned ones running ``Trainer.train`` with one rank asked to stop (``request_stop``, as its
SIGTERM handler does) at a known point of the step, and the real ``python -m trainer`` with real Redis, SIGTERMed once
it took its step's groups.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis
import torch
from rank_helpers import spawn_ranks
from torch import nn
from trainer_helpers import reaped, signal_pool_when, synthetic_groups, trainer_pool

from buffer.keys import TRAINER_GROUP, Keys
from buffer.replay import ReplayBuffer
from core.config import BufferConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.parallel import (
    STOP_EVERY_MICRO_BATCHES,
    TrainerStopped,
    close_distributed,
    exit_rank,
    init_distributed,
    request_stop,
)
from trainer.worker import Trainer

GROUPS = 6  # 24 rows of at least 10 tokens: 12 micro-batches of 16 tokens on each of two ranks
CFG = {"micro_batch_tokens": 16, "share_prefix": False, "checkpoint_every": 1, "total_steps": 5, "lr": 1e-3,
       "device": "cpu"}
STOPPED = "stopped by SIGTERM before its end (a supervisor's or an operator's stop)"
STOPPED_ELSEWHERE = STOPPED.replace(" before", " to another rank of the pool before")
BOUND_S = 120  # what a test waits for the ranks once one is asked to stop: well under the group's timeout (600 s)


def _stop_once(model: nn.Module, optimizer: torch.optim.Optimizer, where: str) -> None:
    """Ask this rank to stop once, as its SIGTERM handler would: at the step's first forward (``forward``) or after its
    first optimizer update (``update``)."""
    def stop(*_args: object) -> None:
        handle.remove()
        request_stop(signal.SIGTERM)

    handle = model.register_forward_hook(stop) if where == "forward" else optimizer.register_step_post_hook(stop)


def _train_one_step(rank: int, port: int, model_dir: Path, run_dir: Path, cfg: dict, where: str, out: Path) -> None:
    """One of two ranks (``spawn_ranks``'s target) training a step of ``GROUPS`` groups, rank 1 asked to stop at
    ``where``; writes what it raised, its optimizer updates, its step and its scheduler's."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=600)
    try:
        trainer = Trainer(TrainerConfig(**cfg), model_dir, run_dir).start(ctx=ctx)
        updates = []
        trainer.optimizer.register_step_post_hook(lambda *_: updates.append(1))
        if rank == 1:
            _stop_once(trainer.model, trainer.optimizer, where)
        try:
            trainer.train(synthetic_groups(0, GROUPS))
            said = "went on"
        except TrainerStopped as exc:
            said = str(exc)
        trainer.close()
        (out / f"rank{rank}.json").write_text(json.dumps({
            "said": said, "updates": len(updates), "step": trainer.step,
            "scheduler_steps": trainer.scheduler.last_epoch}))
    finally:
        close_distributed()
    exit_rank()


@pytest.mark.parametrize(("minibatches", "where", "updates"), [(1, "forward", 0), (4, "update", 1)],
                         ids=["between-micro-batches", "between-updates"])
def test_a_stop_asked_mid_step_stops_every_rank_inside_it(tiny_model_dir: Path, tmp_path: Path, minibatches: int,
                                                          where: str, updates: int) -> None:
    """Asked at the first micro-batch of a single update's 12, the pool stops before the update is applied; asked
    after the first of four updates, before the second. Neither rank steps its scheduler, counts the step or
    checkpoints it (``checkpoint_every: 1``)."""
    assert STOP_EVERY_MICRO_BATCHES < 12  # else the single update has no stop point among its micro-batches
    run_dir = tmp_path / "run"
    args = (free_port_outside_ephemeral("127.0.0.1"), tiny_model_dir, run_dir, {**CFG, "ppo_minibatches": minibatches},
            where, tmp_path)
    ranks = spawn_ranks(_train_one_step, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + BOUND_S
    try:
        while not ranks.join(timeout=max(deadline - time.monotonic(), 0)):
            assert time.monotonic() < deadline, "a rank is still running: left waiting in a collective"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
                process.join()
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert said == [{"said": STOPPED_ELSEWHERE, "updates": updates, "step": 0, "scheduler_steps": 0},
                    {"said": STOPPED, "updates": updates, "step": 0, "scheduler_steps": 0}]
    assert not list(run_dir.rglob("*.distcp"))



def test_a_pool_sigtermed_mid_step_stops_in_it_recording_the_stop_its_groups_unacked(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to both ranks as soon as rank 0 took the step's groups: both exit 143 within the step, rank 0 records
    the stop at step 0, no checkpoint is written (one was due after the step), and the groups stay pending."""
    groups = 8
    keys = Keys("stop-in-step")
    client = redis.Redis.from_url(redis_url)
    buffer = ReplayBuffer(client, keys, BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    buffer.put_many(synthetic_groups(0, groups, run=keys.run))
    ranks = trainer_pool(tmp_path, keys, redis_url, tiny_model_dir, groups, micro_batch_tokens=16, share_prefix=False,
                         ppo_minibatches=8)
    try:
        with reaped(ranks[0]), reaped(ranks[1]):
            codes, tails = signal_pool_when(  # as the step's groups are taken
                ranks, tmp_path, lambda: client.xpending(keys.groups, TRAINER_GROUP)["pending"] >= groups,
                signal.SIGTERM, BOUND_S)
            assert codes == [128 + signal.SIGTERM] * 2, tails
        ended = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer).items()}
        assert (ended["finished_reason"], ended["finished_step"]) == (f"crashed: {STOPPED}", "0")
        assert not client.exists(keys.trainer_alive)  # its lease deleted, not left to lapse
        assert not list((tmp_path / keys.run).rglob("*.distcp"))
        assert client.xpending(keys.groups, TRAINER_GROUP)["pending"] == groups
    finally:
        client.close()
