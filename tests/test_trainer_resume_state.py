"""What a checkpoint must carry besides the tensors for a resumed run to train like an uninterrupted one: every
rank's RNG (LoRA dropout draws from it), the LR schedule's position under the run's current settings, and the
settings its tensors were trained under (a resume with other LoRA settings or another model is refused, naming the
key); and a checkpoint is on disk before it is listed.

A process starts with a random RNG seed, so each run below seeds its RNG before it starts, a resumed one with
another seed, as a new process would.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from rank_helpers import spawn_ranks
from trainer_helpers import synthetic_groups

from core.config import LoraConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.optim import lr_factor
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed, iter_full_params
from trainer.worker import Trainer

CFG = {"total_steps": 4, "checkpoint_every": 2, "keep_checkpoints": 1, "lr": 1e-2, "micro_batch_tokens": 128,
       "device": "cpu"}
DROPOUT = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], dropout=0.5)


def _run(ctx: DistContext, model: Path, run_dir: Path, seed: int, steps: int, resume: bool = False,
         lora: LoraConfig | None = DROPOUT) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(records, full parameters) of ``steps`` steps of a trainer that starts with the RNG at ``seed``."""
    torch.manual_seed(seed)
    trainer = Trainer(TrainerConfig(**CFG), model, run_dir, lora=lora).start(resume=resume, ctx=ctx)
    records = [trainer.train(synthetic_groups(trainer.step, 2)) for _ in range(steps)]
    params = {name: value.clone() for name, value in iter_full_params(trainer.model) if value is not None}
    trainer.close()
    return records, params


def test_a_resume_continues_the_rng_lora_dropout_draws_from(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    want, final = _run(ctx, tiny_model_dir, tmp_path / "straight", seed=1, steps=4)
    first, _ = _run(ctx, tiny_model_dir, tmp_path / "crash", seed=1, steps=3)  # checkpoint at 2, step 3 lost
    assert [r["loss"] for r in first] == [r["loss"] for r in want[:3]]
    after, params = _run(ctx, tiny_model_dir, tmp_path / "crash", seed=2, steps=2, resume=True)
    assert [r["loss"] for r in after] == [r["loss"] for r in want[2:]]
    for name, value in params.items():
        assert torch.equal(value, final[name]), name


def _two_ranks(rank: int, world: int, port: int, model: Path, root: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores
    ctx = init_distributed("cpu", timeout_s=120)  # a rank left alone in a collective fails, never hangs
    try:
        want, final = _run(ctx, model, root / "straight", seed=10 + rank, steps=4)
        _run(ctx, model, root / "crash", seed=10 + rank, steps=3)
        after, params = _run(ctx, model, root / "crash", seed=20 + rank, steps=2, resume=True)
        if rank == 0:
            torch.save({"want": want, "after": after, "final": final, "params": params}, root / "out.pt")
    finally:
        close_distributed()
    exit_rank()


def test_two_ranks_resume_each_rank_s_rng(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each rank drops adapter inputs of its own rows, with its own RNG: each gets its own back."""
    spawn_ranks(_two_ranks, args=(2, free_port_outside_ephemeral(), tiny_model_dir, tmp_path), nprocs=2, join=True)
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert [r["loss"] for r in out["after"]] == [r["loss"] for r in out["want"][2:]]
    for name, value in out["params"].items():
        assert torch.equal(value, out["final"][name]), name


def test_the_resumed_optimizers_follow_the_run_s_settings(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The checkpoint gives the position (step counts, moments, the schedule's step); the run's config gives the
    learning rates, betas and weight decay (the matrices'; biases and norm gains stay at 0), so a run extended on
    resume (``trainer.total_steps`` raised) trains on its new schedule at once, not one step at the end of the old
    one (a cosine's 0)."""
    base = {**CFG, "advantage": "gae", "total_steps": 2, "warmup_steps": 1, "lr_schedule": "cosine"}
    first = Trainer(TrainerConfig(**base), tiny_model_dir, tmp_path).start(ctx=ctx)
    for seed in range(2):
        first.train(synthetic_groups(seed, 2))
    first.close()
    cfg = TrainerConfig(**{**base, "total_steps": 4, "lr": 5e-3, "betas": (0.8, 0.95), "weight_decay": 0.1},
                        critic={"lr": 2e-3})
    resumed = Trainer(cfg, tiny_model_dir, tmp_path).start(resume=True, ctx=ctx)
    lr = 5e-3 * lr_factor(2, cfg)
    assert lr > 0
    assert resumed.train(synthetic_groups(2, 2))["lr"] == lr
    assert resumed.train(synthetic_groups(3, 2))["lr"] == 5e-3 * lr_factor(3, cfg)
    resumed.close()
    assert resumed.critic is not None
    policy, critic = resumed.optimizer.param_groups, resumed.critic[1].param_groups
    assert [g["initial_lr"] for g in policy] == [5e-3] * 2 and [g["lr"] for g in critic] == [2e-3] * 2
    assert [(g["betas"], g["weight_decay"]) for g in policy + critic] == [((0.8, 0.95), 0.1), ((0.8, 0.95), 0.0)] * 2


@pytest.mark.parametrize(("saved", "resumed", "key"), [
    (LoraConfig(rank=4), LoraConfig(rank=4, alpha=32), "model.lora.alpha"),
    (LoraConfig(rank=4), LoraConfig(rank=8), "model.lora.rank"),
    (LoraConfig(rank=4), LoraConfig(rank=4, target_modules=["q_proj"]), "model.lora.target_modules"),
    (LoraConfig(rank=4), None, "model.lora"),
    (None, LoraConfig(rank=4), "model.lora"),
])
def test_a_resume_with_other_lora_settings_is_refused_naming_the_key(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, saved: LoraConfig | None, resumed: LoraConfig | None,
    key: str
) -> None:
    """The adapter's tensors mean what rank, alpha and the target modules made them (alpha scales the update):
    resumed under others they would compute another function, silently or deep inside DCP's planner."""
    _run(ctx, tiny_model_dir, tmp_path, seed=0, steps=2, lora=saved)
    with pytest.raises(ValueError, match=rf"step_00000002: written with {key}=.*, this run has {key}="):
        Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path, lora=resumed).start(resume=True, ctx=ctx)


def test_a_resume_on_another_model_is_refused_naming_the_tensor(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint written before the settings were recorded, or resumed on another model: the shapes decide."""
    _run(ctx, tiny_model_dir, tmp_path / "run", seed=0, steps=2, lora=None)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(num_hidden_layers=1, layer_types=config["layer_types"][:1])  # the first layer of the same model
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"step_00000002: written for another model \(model\.path\): it has "
                                         r"model\.layers\.1\.input_layernorm\.weight, this run's model does not"):
        Trainer(TrainerConfig(**CFG), other, tmp_path / "run").start(resume=True, ctx=ctx)


def test_a_checkpoint_is_on_disk_before_it_is_listed(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename that lists a checkpoint must not reach the disk before what it names: after a power loss the
    state file would be empty in a checkpoint that looks complete, and the resume would fail on it."""
    synced: list[str] = []
    fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    trainer = Trainer(TrainerConfig(**{**CFG, "checkpoint_every": 1}), tiny_model_dir, tmp_path).start(ctx=ctx)
    path = trainer.save_checkpoint()
    trainer.close()
    staging = str(path.parent / f".{path.name}.partial")
    assert f"{staging}/trainer_state.json" in synced
    assert synced.index(staging) > synced.index(f"{staging}/trainer_state.json")  # the directory after its files
    assert synced[-1] == str(path.parent)  # and the rename itself


def test_what_a_crash_left_half_written_or_half_pruned_goes_at_the_next_save(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's staging directory that a crash left (at a step the resumed run never saves again: another
    ``checkpoint_every``, an earlier end) held a whole checkpoint's disk for good; a checkpoint half pruned was still
    listed, its state file left beside missing shards."""
    trainer = Trainer(TrainerConfig(**{**CFG, "keep_checkpoints": 1}), tiny_model_dir, tmp_path).start(ctx=ctx)
    first = trainer.save_checkpoint()
    root = first.parent
    (root / ".step_00000007.partial").mkdir()
    (root / ".step_00000007.partial" / "__0_0.distcp").write_bytes(b"half a checkpoint")
    trainer.step = 1

    rmtree = shutil.rmtree

    def crash(path: Path, **kwargs: bool) -> None:  # pruning: the shards go, then the process dies
        if "step_00000000" not in Path(path).name:
            return rmtree(path, **kwargs)
        for shard in Path(path).glob("*.distcp"):
            shard.unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()
    assert trainer.checkpointer.list() == [root / "step_00000001"]
    monkeypatch.undo()
    trainer.step = 2
    trainer.save_checkpoint()
    trainer.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]
