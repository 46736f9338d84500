"""A checkpoint save on two ranks whose rank-0-only part fails (here the state file: a value JSON cannot write, which
rank 0 alone serialises): every rank raises at once naming the step, the checkpoint, the rank that failed and its
cause. Rank 1 used to wait in the save's barrier until the process group's timeout (minutes), then fail with a
collective timeout that named none of them; so did rank 0 where rank 1's own part (its RNG state) failed. The ranks go
on together: the next save of both is written.

The two ranks run in spawned processes with a short group timeout; each writes what it raised for the test to read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from rank_helpers import spawn_ranks
from torch import nn

from core.net import free_port_outside_ephemeral
from trainer import checkpoint
from trainer.checkpoint import FORMAT, STATE_FILE, Checkpointer
from trainer.parallel import close_distributed, exit_rank, init_distributed


def _two_ranks(rank: int, port: int, root: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=60)  # the minutes of a real run, in short: a rank left waiting fails
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        checkpoints = Checkpointer(root, keep=2)
        try:
            checkpoints.save(3, model, optimizer, scheduler, {"tags": {"a"}})  # a set: not JSON
            raised = "nothing"
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
        saved = checkpoints.save(4, model, optimizer, scheduler, {"tags": ["a"]})
        if rank == 1:  # its RNG state goes where no directory is: a write that fails on rank 1 alone
            monkeypatch = pytest.MonkeyPatch()
            monkeypatch.setattr(checkpoint, "_rng_file", lambda path, r: path / "gone" / f"rng_rank{r}.pt")
        try:
            checkpoints.save(5, model, optimizer, scheduler, {"tags": ["a"]})
            raised_5 = "nothing"
        except Exception as exc:
            raised_5 = f"{type(exc).__name__}: {exc}"
        if rank == 1:
            monkeypatch.undo()
        saved_6 = checkpoints.save(6, model, optimizer, scheduler, {"tags": ["a"]})
        (out / f"rank{rank}.json").write_text(json.dumps({"raised": raised, "saved": saved.name, "raised_5": raised_5,
                                                          "saved_6": saved_6.name}))
    finally:
        close_distributed()
    exit_rank()


def test_a_rank_0_failure_in_a_save_reaches_every_rank_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    spawn_ranks(_two_ranks, args=(free_port_outside_ephemeral(), root, tmp_path), nprocs=2, join=True)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    cause = (f"OSError: {root / '.step_00000003.partial'}: cannot write the checkpoint: TypeError: Object of type set "
             "is not JSON serializable")
    assert rank0["raised"].startswith(cause), rank0
    assert rank1["raised"].startswith(f"RuntimeError: checkpoint of step 3 ({root / 'step_00000003'}): rank 0 "
                                      f"failed: {cause}"), rank1
    assert rank0["saved"] == rank1["saved"] == "step_00000004"
    assert json.loads((root / "step_00000004" / STATE_FILE).read_text())["format"] == FORMAT
    own = f"OSError: {root / '.step_00000005.partial'}: cannot write the checkpoint: "  # rank 1's part: rank 0 waited
    assert rank1["raised_5"].startswith(own), rank1
    assert rank0["raised_5"].startswith(f"RuntimeError: checkpoint of step 5 ({root / 'step_00000005'}): rank 1 "
                                        f"failed: {own}"), rank0
    assert rank0["saved_6"] == rank1["saved_6"] == "step_00000006"
    assert [p.name for p in Checkpointer(root, keep=2).list()] == ["step_00000004", "step_00000006"]
