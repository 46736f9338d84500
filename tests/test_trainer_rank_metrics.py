"""Rank 0 serves every rank's step time and peak memory (``rollwave_trainer_rank_*{rank}``): the other ranks serve no
metrics, and a pool scraped on one port used to hide a slow or memory-hungry rank. The figures ride in the step's own
all-reduce. Two real ranks (gloo) train a step on the tiny model; rank 1 holds a ballast rank 0 does not, so the
peak memory rank 0 serves for it is rank 1's own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from rank_helpers import spawn_ranks
from trainer_helpers import synthetic_groups

from core.config import TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.parallel import close_distributed, exit_rank, init_distributed
from trainer.worker import Trainer

BALLAST = 384 << 20  # bytes rank 1 holds through the step
SERIES = ("rollwave_trainer_rank_compute_seconds", "rollwave_trainer_rank_peak_memory_bytes")


def _resident_peak() -> int:
    """This process's peak resident set (bytes), as the kernel counts it for its own memory (``ru_maxrss`` carries the
    peak of the process that started it: pytest's worker, through fork and exec)."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) * 1024


def _ranks(rank: int, port: int, model_dir: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=60)
    try:
        trainer = Trainer(TrainerConfig(micro_batch_tokens=128, device="cpu"), model_dir, out / "run").start(ctx=ctx)
        ballast = torch.ones(BALLAST if rank == 1 else 0, dtype=torch.uint8)  # every page written: resident
        record = trainer.train(synthetic_groups(0, 2))
        peak = _resident_peak()
        seen = {"step_time_s": record["step_time_s"], "peak_after_step": peak, "ballast": ballast.numel()}
        if rank == 0:
            value = trainer.metrics.registry.get_sample_value
            seen["served"] = {name: {r: value(name, {"rank": r}) for r in ("0", "1")} for name in SERIES}
        trainer.close()
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        close_distributed()
    exit_rank()


def test_rank_0_serves_each_rank_s_step_time_and_peak_memory(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 serves both ranks' figures; rank 1's peak is its own, not the peak of the process that spawned the ranks
    (this test's, which holds a ballast too: ``ru_maxrss`` counted it in every rank)."""
    parent_ballast = torch.ones(2 * BALLAST, dtype=torch.uint8)  # resident here, never in the ranks
    spawn_ranks(_ranks, args=(free_port_outside_ephemeral(), tiny_model_dir, tmp_path), nprocs=2, join=True)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    compute, memory = (rank0["served"][name] for name in SERIES)
    for rank, own in (("0", rank0), ("1", rank1)):  # each rank's time, up to its closing reduce, within its step
        assert compute[rank] is not None and 0 < compute[rank] <= own["step_time_s"], (rank, compute, own)
        assert memory[rank] is not None and memory[rank] <= own["peak_after_step"], (rank, memory, own)
    assert rank1["ballast"] <= memory["1"]
    assert memory["1"] - memory["0"] > BALLAST // 2, memory  # rank 1's figure, not rank 0's
    assert memory["0"] < parent_ballast.numel(), memory  # nor this process's
