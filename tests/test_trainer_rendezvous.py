"""A trainer pool whose ranks never meet fails after ``trainer.dist_timeout_s`` with an error naming the pool's
address, the rank and the stage, instead of waiting torch's 30 minutes; the real ``python -m trainer``."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from core.net import free_port_outside_ephemeral

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("rank", "host", "error"), [
    ("0", "127.0.0.1", "TimeoutError"), ("1", "127.0.0.1", "ConnectionError"), ("0", "198.51.100.7", "ConnectionError"),
], ids=["the-other-rank-never-joins", "no-rank-0", "rank-0-cannot-listen-there"])
def test_a_rank_that_waits_alone_fails_after_dist_timeout_s(
    rank: str, host: str, error: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 of 2 alone waits for its peer, rank 1 of 2 for a rank 0 that is not there: with
    trainer.dist_timeout_s=2 both give up within seconds (at the default they would wait 1800 s). A rank 0
    whose MASTER_ADDR is not one of its host's addresses (TEST-NET-2 here) cannot host the store: it says so."""
    port = free_port_outside_ephemeral("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    env.update(WORLD_SIZE="2", RANK=rank, LOCAL_WORLD_SIZE="1", MASTER_ADDR=host, MASTER_PORT=str(port),
               ROLLWAVE_CHECKPOINT_TOKEN=secrets.token_urlsafe(32), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "trainer", f"run.dir={tmp_path}", f"model.path={tiny_model_dir}",
            "trainer.device=cpu", "trainer.dist_timeout_s=2"]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith(f"{error}: trainer rendezvous at {host}:{port} (rank {rank} of 2): "), last
    assert last.endswith("cannot listen: [Errno 99] Cannot assign requested address" if host != "127.0.0.1"
                         else "(trainer.dist_timeout_s)"), last
    assert elapsed < 60, elapsed


def test_colocated_ranks_must_outwait_the_servers_release() -> None:
    """In colocated placement the other ranks sit at a barrier while rank 0 waits up to
    placement.colocated_timeout_s for the servers: a shorter trainer.dist_timeout_s would kill the pool first."""
    with pytest.raises(ConfigError, match=r"trainer.dist_timeout_s \(300\) must exceed placement.colocated_timeout_s"):
        load_config(None, ["placement.mode=colocated", "trainer.dist_timeout_s=300"], env={})
    load_config(None, ["placement.mode=colocated", "trainer.dist_timeout_s=300", "placement.colocated_timeout_s=200"],
                env={})
