"""A pool's ranks leave a checkpoint and the pool together, or one alone without another collective.

A rank interrupted inside ``dcp.save`` (a KeyboardInterrupt is raised as the collective it was in returns) used to go
on to the checkpoint's meeting, a collective of its own, while the others were in DCP's next: the meeting met DCP's
collective and both hung. It now raises at once, and the others learn of it as its process goes. A stop or an
interrupt that DCP caught in its steps is raised as it was, not as a checkpoint that fails to write or load. A pool
stopped by SIGTERM (``stop_point``: every rank at the same collective) used to leave its process group to the
interpreter's exit; every rank now leaves it together (``close_distributed``), as after any other end. A SIGINT (Ctrl-C,
which torchrun passes on to each rank) raised KeyboardInterrupt where it found each rank, and the pool hung; it now
stops the pool as a SIGTERM does.

Two real ranks (gloo) in spawned processes, or of the real ``python -m trainer`` with real Redis; the test waits for
them well under the group's timeout, so a rank left waiting fails it rather than hanging it.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import redis
import torch
from rank_helpers import spawn_ranks
from test_trainer_stop_all_ranks import GPS
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.utils import _DistWrapper
from trainer_helpers import join_within, reaped, signal_pool_when, synthetic_groups, trainer_pool

from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from core.config import BufferConfig
from core.net import free_port_outside_ephemeral
from trainer.checkpoint import Checkpointer, export_hf
from trainer.parallel import causal_lm, exit_rank, init_distributed, request_stop

GROUP_TIMEOUT_S = 600  # what a rank left in a collective waits
BOUND_S = 120  # what the test waits for the ranks: well under the group's timeout


def _interrupted_in_dcp(rank: int, port: int, root: Path, out: Path) -> None:
    """Rank 1 is interrupted as DCP's planning collective returns; rank 0 goes on to DCP's writing one. Each rank
    writes what it raised, then exits without leaving the group (rank 1 left it in the middle of a save)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=GROUP_TIMEOUT_S)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    interrupt = KeyboardInterrupt()
    if rank == 1:
        plan = _DistWrapper.reduce_scatter

        def interrupted(self: _DistWrapper, *args: object) -> object:
            plan(self, *args)
            raise interrupt

        pytest.MonkeyPatch().setattr(_DistWrapper, "reduce_scatter", interrupted)
    try:
        Checkpointer(root, keep=2).save(5, model, optimizer, scheduler, {})
        said = "nothing"
    except BaseException as exc:  # noqa: BLE001 - what each rank raised is the test's finding
        said = f"{type(exc).__name__}: {exc}" + (" (the same)" if exc is interrupt else "")
    (out / f"rank{rank}.json").write_text(json.dumps(said))
    exit_rank(0)


def _interrupted_alone(_rank: int, model_dir: Path, root: Path, out: Path) -> None:
    """A lone rank (a pool of one, no WORLD_SIZE): stopped by SIGTERM as DCP writes its shards (the handler's
    ``request_stop`` raises where the signal finds it), then interrupted as DCP reads them back for a resume and for an
    export. Writes what each raised."""
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    init_distributed("cpu")
    model = causal_lm(model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    checkpoints = Checkpointer(root, keep=2)
    saved = checkpoints.save(1, model, optimizer, scheduler, {})
    monkeypatch = pytest.MonkeyPatch()
    said = {}
    writes = FileSystemWriter.write_data

    def stopped(self: FileSystemWriter, *args: object) -> object:
        request_stop(signal.SIGTERM)
        return writes(self, *args)

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemWriter, "write_data", stopped)
    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    for what, act in (("save", lambda: checkpoints.save(2, model, optimizer, scheduler, {})),
                      ("load", lambda: checkpoints.load(saved, model, optimizer, scheduler)),
                      ("export", lambda: export_hf(saved, model_dir, root / "hf"))):
        try:
            act()
            said[what] = "nothing"
        except BaseException as exc:  # noqa: BLE001 - what the rank raised is the test's finding
            said[what] = [type(exc).__name__, str(exc), getattr(exc, "signum", None)]
    (out / "alone.json").write_text(json.dumps(said))
    exit_rank(0)



def test_a_rank_interrupted_inside_dcp_raises_in_no_further_collective(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    join_within(spawn_ranks(_interrupted_in_dcp, args=(free_port_outside_ephemeral(), root, tmp_path), nprocs=2,
                         join=False), BOUND_S, GROUP_TIMEOUT_S)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank1 == "KeyboardInterrupt:  (the same)"
    # rank 0 waited in DCP's writing collective, which failed once rank 1's process went
    assert rank0.startswith(f"OSError: {root / '.step_00000005.partial'}: cannot write the checkpoint: "), rank0
    assert Checkpointer(root, keep=2).list() == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_pool_stopped_by_a_signal_records_it_and_leaves_its_process_group_together(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path, signum: signal.Signals) -> None:
    """Both ranks of ``python -m trainer``, signalled once they have checkpointed (a SIGTERM: a supervisor's stop; a
    SIGINT: Ctrl-C, which torchrun passes on to each rank, and which raised KeyboardInterrupt where it found each),
    stop at their next stop point, rank 0 records the stop, and they leave the group together (each logs it; rank 0
    once every rank counted itself out), then exit 128 + the signal."""
    keys = Keys(f"stop-leaves-group-{signum.name.lower()}")  # a run of its own in the module's Redis
    client = redis.Redis.from_url(redis_url)
    buffer = ReplayBuffer(client, keys, BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    buffer.put_many(synthetic_groups(0, 4 * GPS, run=keys.run))
    checkpoints = Checkpointer(tmp_path / keys.run / "checkpoints", keep=2)
    ranks = trainer_pool(tmp_path, keys, redis_url, tiny_model_dir, GPS)
    try:
        with reaped(ranks[0]), reaped(ranks[1]):
            codes, tails = signal_pool_when(ranks, tmp_path, lambda: bool(checkpoints.list()), signum, BOUND_S,
                                            poll_s=0.05)
            assert codes == [128 + signum] * 2, tails
        assert client.hget(keys.trainer, "finished_reason").decode() == (
            f"crashed: stopped by {signum.name} before its end (a supervisor's or an operator's stop)")
        for rank, tail in enumerate(tails):
            assert f"rank {rank} of 2 left the trainer's process group" in tail, tail
    finally:
        client.close()


def test_a_stop_or_an_interrupt_dcp_caught_is_raised_as_it_was(tiny_model_dir: Path, tmp_path: Path) -> None:
    """DCP catches whatever its steps raise and hands it back as a CheckpointException: a lone trainer's SIGTERM during
    its writes was then recorded as a checkpoint it could not write (exit 1, not 143), and a Ctrl-C during a resume or
    an export as a checkpoint that does not load."""
    root = tmp_path / "checkpoints"
    join_within(spawn_ranks(_interrupted_alone, args=(tiny_model_dir, root, tmp_path), nprocs=1, join=False), BOUND_S,
                GROUP_TIMEOUT_S)
    said = json.loads((tmp_path / "alone.json").read_text())
    assert said == {
        "save": ["TrainerStopped", "stopped by SIGTERM before its end (a supervisor's or an operator's stop)",
                 signal.SIGTERM],
        "load": ["KeyboardInterrupt", "", None],
        "export": ["KeyboardInterrupt", "", None],
    }
    assert [p.name for p in Checkpointer(root, keep=2).list()] == ["step_00000001"]
