"""A KeyboardInterrupt or SystemExit (Ctrl-C, a launcher stopping the pool) in what rank 0 alone does, or in one rank's
part of a checkpoint save, reaches every rank at once: the others raise naming the rank and what it was doing, and the
rank where it happened raises it unchanged. They used to catch ``Exception`` only, so the other ranks waited in the next
collective until the process group's timeout.

Two real ranks (gloo) in spawned processes; the test waits for them well under the group's timeout, so a rank left
waiting fails it rather than hanging it. Each rank writes what it raised for the test to read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from rank_helpers import spawn_ranks
from torch import nn
from trainer_helpers import join_within

from core.net import free_port_outside_ephemeral
from trainer import checkpoint
from trainer.checkpoint import Checkpointer
from trainer.parallel import close_distributed, exit_rank, from_rank0, init_distributed

GROUP_TIMEOUT_S = 600  # what a rank left in a collective waits
BOUND_S = 120  # what the test waits for both ranks: well under the group's timeout


def _stopped(stop: BaseException) -> None:
    raise stop


def _said(exc: BaseException, stop: BaseException | None = None) -> str:
    return f"{type(exc).__name__}: {exc}" + (" (the same)" if exc is stop else "")


def _two_ranks(rank: int, port: int, root: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=GROUP_TIMEOUT_S)
    try:
        said = {}
        for stop in (KeyboardInterrupt(), SystemExit(3)):
            try:
                from_rank0(lambda stop=stop: _stopped(stop), "the buffer read")
                said[type(stop).__name__] = "nothing"
            except BaseException as exc:  # noqa: BLE001 - what each rank raised is the test's finding
                said[type(stop).__name__] = _said(exc, stop)
        said["next"] = from_rank0(lambda: "rank 0's", "a value")  # the ranks go on together
        model = nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        checkpoints = Checkpointer(root, keep=2)
        interrupt = KeyboardInterrupt()
        monkeypatch = pytest.MonkeyPatch()
        if rank == 1:  # rank 1 alone is interrupted writing its part (its RNG state)
            monkeypatch.setattr(checkpoint, "_rng_file", lambda path, r: _stopped(interrupt))
        try:
            checkpoints.save(5, model, optimizer, scheduler, {})
            said["save"] = "nothing"
        except BaseException as exc:  # noqa: BLE001 - what each rank raised is the test's finding
            said["save"] = _said(exc, interrupt)
        monkeypatch.undo()
        said["next save"] = checkpoints.save(6, model, optimizer, scheduler, {}).name
        (out / f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        close_distributed()
    exit_rank()



def test_an_interrupt_on_one_rank_reaches_every_rank_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    join_within(spawn_ranks(_two_ranks, args=(free_port_outside_ephemeral(), root, tmp_path), nprocs=2, join=False),
                BOUND_S, GROUP_TIMEOUT_S)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["KeyboardInterrupt"] == "KeyboardInterrupt:  (the same)", rank0  # re-raised as it was
    assert rank1["KeyboardInterrupt"] == "RuntimeError: the buffer read: rank 0 was interrupted: KeyboardInterrupt"
    assert rank0["SystemExit"] == "SystemExit: 3 (the same)", rank0
    assert rank1["SystemExit"] == "RuntimeError: the buffer read: rank 0 was interrupted: SystemExit: 3"
    assert rank0["next"] == rank1["next"] == "rank 0's"
    assert rank1["save"] == "KeyboardInterrupt:  (the same)", rank1
    assert rank0["save"] == (f"RuntimeError: checkpoint of step 5 ({root / 'step_00000005'}): rank 1 was "
                             "interrupted: KeyboardInterrupt"), rank0
    assert rank0["next save"] == rank1["next save"] == "step_00000006"
    assert [p.name for p in Checkpointer(root, keep=2).list()] == ["step_00000006"]
