"""What only rank 0 does (the buffer read, the fence check, the device's hand-over) and fails in a way other than a
newer trainer's fence reaches every rank at once: rank 1 raises naming what failed and why, rather than waiting in
rank 0's broadcast until the process group's timeout (minutes), then failing with a collective timeout that named
nothing. Real ranks (gloo), a real Redis and the real trainer; rank 0's buffer loses its Redis."""

from __future__ import annotations

import os
from pathlib import Path

import redis
import torch
from rank_helpers import spawn_ranks

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from core.config import BufferConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.parallel import close_distributed, exit_rank, from_rank0, init_distributed
from trainer.worker import Trainer

TRAINER = {"micro_batch_tokens": 128, "take_timeout_s": 0.5, "device": "cpu"}


def _ranks(rank: int, port: int, redis_url: str, model_dir: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=60)  # the minutes of a real run, in short: a rank left waiting fails
    try:
        said = [str(from_rank0(lambda: "rank 0's", "a value"))]  # every rank gets rank 0's result
        source = None
        if rank == 0:
            source = ReplayBuffer(redis.Redis.from_url(redis_url), Keys("rank0-failures"), BufferConfig(),
                                  consumer="trainer")
            source.ensure_group()
        trainer = Trainer(TrainerConfig(**TRAINER), model_dir, out / "run", BufferConfig(groups_per_step=2)
                          ).start(ctx=ctx)
        if source is not None:  # its Redis goes away: the read raises on rank 0 alone
            source.redis = redis.Redis(unix_socket_path=str(out / "no-redis.sock"), socket_connect_timeout=1)
        try:
            trainer.next_batch(source)
            said.append("read")
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {exc}")
        finally:
            trainer.close()
        (out / f"rank{rank}").write_text("\n".join(said))
    finally:
        close_distributed()
    exit_rank()


def test_a_failed_buffer_read_on_rank_0_stops_every_rank_naming_it(redis_server: EmbeddedRedis,
                                                                   tiny_model_dir: Path, tmp_path: Path) -> None:
    spawn_ranks(_ranks, args=(free_port_outside_ephemeral(), redis_server.url, tiny_model_dir, tmp_path), nprocs=2,
             join=True)
    rank0, rank1 = ((tmp_path / f"rank{r}").read_text().splitlines() for r in (0, 1))
    assert rank0[0] == rank1[0] == "rank 0's"
    assert rank0[1].startswith("ConnectionError: "), rank0
    assert rank1[1] == f"RuntimeError: the buffer read: rank 0 failed: {rank0[1]}", rank1
