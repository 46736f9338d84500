"""A SIGTERM to every rank of a pool at once (Kubernetes, docker-compose stop, a Ray actor kill): each rank used to
raise where the signal found it, one mid-collective (its handler runs as the collective returns), another between
two, and they went on to different collectives (a checkpoint's meeting, DCP's own, ``from_rank0``'s), waiting there
for the group's timeout, or one left the pool while the other still waited in it (exit 1 and a crash recorded as a
gloo error, or an abort, 134). Every rank now exits 143 and rank 0 records the stop, wherever the ranks were.

Two ranks of the real ``python -m trainer`` (gloo), real Redis; the signals go out as soon as a rank writes its shard
of a checkpoint (one every step): one rank is then writing files between two of DCP's collectives, the other in one
or about to be (before the fix, every try under two CPU hogs hung both ranks)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import redis
import torch
from rank_helpers import spawn_ranks
from trainer_helpers import reaped, signal_pool_when, synthetic_groups, trainer_pool

from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from core.config import BufferConfig
from core.net import free_port_outside_ephemeral
from trainer.parallel import TrainerStopped, close_distributed, exit_rank, init_distributed, request_stop, stop_point

GPS = 2
BOUND_S = 60  # what the test waits for the ranks once signalled: well under trainer.dist_timeout_s
STOPPED = "crashed: stopped by SIGTERM before its end (a supervisor's or an operator's stop)"



def test_a_sigterm_to_every_rank_mid_checkpoint_stops_them_all_recording_the_stop(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    keys = Keys("stop-all-ranks")
    client = redis.Redis.from_url(redis_url)
    buffer = ReplayBuffer(client, keys, BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    buffer.put_many(synthetic_groups(0, 20 * GPS, run=keys.run))
    checkpoints = tmp_path / keys.run / "checkpoints"
    ranks = trainer_pool(tmp_path, keys, redis_url, tiny_model_dir, GPS)
    try:
        with reaped(ranks[0]), reaped(ranks[1]):
            codes, tails = signal_pool_when(  # as a rank writes its shard
                ranks, tmp_path, lambda: any(checkpoints.glob(".step_*.partial/*.distcp")), signal.SIGTERM, BOUND_S)
            assert codes == [128 + signal.SIGTERM] * 2, (codes, *tails)
        assert client.hget(keys.trainer, "finished_reason").decode() == STOPPED
        assert not client.exists(keys.trainer_alive)  # its lease deleted, not left to lapse
    finally:
        client.close()



def _one_rank_signalled(rank: int, port: int, out: Path) -> None:
    """Rank 1 alone is asked to stop (its SIGTERM handler's ``request_stop``); both ranks reach the stop point."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=600)
    try:
        if rank == 1:
            request_stop(signal.SIGTERM)
        try:
            stop_point(ctx.device)
            said = "went on"
        except TrainerStopped as exc:
            said = str(exc)
        (out / f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        close_distributed()
    exit_rank()


def test_a_stop_asked_of_one_rank_stops_every_rank_at_the_stop_point(tmp_path: Path) -> None:
    """Rank 0, which was not signalled, stops too (and its record says where the stop came from)."""
    spawn_ranks(_one_rank_signalled, args=(free_port_outside_ephemeral("127.0.0.1"), tmp_path), nprocs=2, join=True)
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert said == ["stopped by SIGTERM to another rank of the pool before its end (a supervisor's or an operator's "
                    "stop)", "stopped by SIGTERM before its end (a supervisor's or an operator's stop)"]
