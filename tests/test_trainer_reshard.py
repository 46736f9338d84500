"""A resume with another number of ranks than the checkpoint was written with (2 -> 1 and 1 -> 2): DCP reshards the
model's and the optimizers' tensors (the policy's and the critic's), which must come back whole and equal; the step
and version go on and a step trains. Each rank's RNG cannot map one to one: a rank the checkpoint has none for
starts from a seed of the checkpoint's step and its rank, and one line says the count changed.

The two-rank side runs in spawned processes, the one-rank side in this one (the module's ``ctx``).
"""

from __future__ import annotations

import copy
import logging
import math
import os
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_helpers import spawn_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from trainer_helpers import synthetic_groups

from core.config import TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.checkpoint import rank_seed
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed, iter_full_params
from trainer.worker import Trainer

# the critic's optimizer is resharded too; two updates per step give Adam's state two counts per step
CFG = {"total_steps": 4, "checkpoint_every": 2, "lr": 1e-3, "micro_batch_tokens": 128, "device": "cpu",
       "advantage": "gae", "ppo_minibatches": 2}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0


def _full_state(trainer: Trainer) -> dict[str, Any]:
    """The policy's and the critic's whole parameters and optimizer state (rank 0; every rank calls it)."""
    assert trainer.critic is not None
    return {
        "params": {n: t.clone() for n, t in iter_full_params(trainer.model) if t is not None},
        "critic": {n: t.clone() for n, t in iter_full_params(trainer.critic[0]) if t is not None},
        # copies: on CPU the full state dict holds the optimizer's own tensors, which the next step changes
        "optim": copy.deepcopy(get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FULL).get("state")),
        "critic_optim": copy.deepcopy(get_optimizer_state_dict(*trainer.critic, options=FULL).get("state")),
    }


def _session(ctx: DistContext, model: Path, run_dir: Path, steps: int, resume: bool) -> dict[str, Any]:
    """Start (or resume), then train ``steps`` steps; what rank 0 saw: the state at start and after, the step and
    version at start, and every rank's RNG state at start and what the checkpoint module logged there."""
    handler = BufferingHandler(capacity=100)
    logger = logging.getLogger("trainer.checkpoint")
    logger.addHandler(handler)
    try:
        trainer = Trainer(TrainerConfig(**CFG), model, run_dir).start(resume=resume, ctx=ctx)
    finally:
        logger.removeHandler(handler)
    logged = [record.getMessage() for record in handler.buffer]
    rngs: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(rngs, torch.get_rng_state())
    # a fresh optimizer has no state to read: reading it would make one (DCP steps it once at lr 0)
    started = {"state": _full_state(trainer) if resume else None, "step": trainer.step, "version": trainer.version}
    records = [trainer.train(synthetic_groups(trainer.step, 2)) for _ in range(steps)]
    out = {"start": started, "end": _full_state(trainer), "records": records, "rngs": rngs,
           "step": trainer.step, "version": trainer.version}
    trainer.close()
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, logged)
    out["logged"] = [line for lines in gathered for line in lines]  # every rank's: rank 0 alone must say it
    return out


def _two_ranks(rank: int, port: int, model: Path, run_dir: Path, steps: int, resume: bool, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores
    ctx = init_distributed("cpu", timeout_s=120)  # a rank left alone in a collective fails, never hangs
    try:
        result = _session(ctx, model, run_dir, steps, resume)
        if rank == 0:
            torch.save(result, out)
    finally:
        close_distributed()
    exit_rank()


def _run(world: int, ctx: DistContext, model: Path, run_dir: Path, steps: int, resume: bool) -> dict[str, Any]:
    if world == 1:
        return _session(ctx, model, run_dir, steps, resume)
    out = run_dir.parent / f"{run_dir.name}-{int(resume)}.pt"
    spawn_ranks(_two_ranks, args=(free_port_outside_ephemeral(), model, run_dir, steps, resume, out), nprocs=2,
             join=True)
    return torch.load(out, weights_only=False)


def _assert_equal(saved: dict[str, Any], loaded: dict[str, Any], where: str) -> None:
    assert saved.keys() == loaded.keys(), where
    for key, value in saved.items():
        if isinstance(value, dict):
            _assert_equal(value, loaded[key], f"{where}.{key}")
        else:
            assert torch.equal(value, loaded[key]), f"{where}.{key}"


@pytest.mark.parametrize(("written", "resumed"), [(2, 1), (1, 2)])
def test_a_resume_on_another_number_of_ranks_restores_the_whole_state(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, written: int, resumed: int
) -> None:
    run_dir = tmp_path / "run"
    first = _run(written, ctx, tiny_model_dir, run_dir, steps=2, resume=False)  # checkpoint at step 2
    assert first["step"] == first["version"] == 2
    after = _run(resumed, ctx, tiny_model_dir, run_dir, steps=1, resume=True)
    _assert_equal(first["end"], after["start"]["state"], "resumed")
    assert first["end"]["optim"]["model.embed_tokens.weight"]["step"] == 4  # 2 steps × 2 minibatches
    assert (after["start"]["step"], after["start"]["version"]) == (2, 2)
    assert (after["step"], after["version"]) == (3, 3)
    assert math.isfinite(after["records"][0]["loss"])
    assert not torch.equal(after["end"]["params"]["model.embed_tokens.weight"],
                           first["end"]["params"]["model.embed_tokens.weight"])
    assert after["end"]["optim"]["model.embed_tokens.weight"]["step"] == 6

    saved_rngs = [torch.load(run_dir / "checkpoints" / "step_00000002" / f"rng_rank{r}.pt")["cpu"]
                  for r in range(written)]
    for rank, state in enumerate(after["rngs"]):
        want = saved_rngs[rank] if rank < written else torch.Generator().manual_seed(rank_seed(2, rank)).get_state()
        assert torch.equal(state, want), f"rank {rank}"
    what = "the RNG state of rank(s) 1 is not used" if resumed < written else \
        "rank(s) 1 start their RNG from rank_seed(step, rank)"
    assert after["logged"] == [f"{run_dir / 'checkpoints' / 'step_00000002'}: written by {written} rank(s), resumed by "
                               f"{resumed}: {what}"]
