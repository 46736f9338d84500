"""``trainer.weight_decay`` decays the matrices (embeddings included) and spares biases and norm gains, in the
policy's and the critic's AdamW, FSDP2-sharded; a checkpoint written with one param group (before the split)
resumes into the two groups, and another count of groups is refused, naming the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from trainer_helpers import synthetic_groups

from core.config import LoraConfig, TrainerConfig
from trainer.checkpoint import Checkpointer, CheckpointMismatch
from trainer.critic import build_critic_optimizer, load_critic
from trainer.lora import add_adapter
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel import DistContext, load_model
from trainer.worker import Trainer

CFG = {"total_steps": 4, "lr": 1e-2, "weight_decay": 0.1, "micro_batch_tokens": 128, "device": "cpu",
       "advantage": "gae"}
SPARED = {"model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.bias"}
DECAYED = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"}


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _zero_gradient_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[torch.Tensor, ...]]:
    """name -> (before, after) of one step of a fresh optimizer on zero gradients: only the decay moves a weight."""
    before = {name: _full(p) for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    return {name: (before[name], _full(p)) for name, p in model.named_parameters()}


def test_one_zero_gradient_step_shrinks_the_matrices_and_spares_biases_and_norm_gains(
    ctx: DistContext, tiny_model_dir: Path
) -> None:
    cfg = TrainerConfig(**CFG)
    policy = load_model(tiny_model_dir, ctx)
    critic = load_critic(tiny_model_dir, ctx)
    assert all(isinstance(p, DTensor) for p in policy.parameters())  # FSDP2's shards: the logical ndim decides
    for model, optimizer, lr, spared in ((policy, build_optimizer(policy, cfg), cfg.lr, SPARED),
                                         (critic, build_critic_optimizer(critic, cfg), cfg.critic.lr,
                                          SPARED | {"score.bias"})):
        moved = _zero_gradient_step(model, optimizer)
        assert {name for name, (before, _) in moved.items() if before.ndim == 1} >= spared
        assert all(moved[name][0].ndim == 2 and moved[name][0].abs().max() > 0.01 for name in DECAYED)
        for name, (before, after) in moved.items():
            if before.ndim == 1:
                assert torch.equal(after, before), name
            else:
                torch.testing.assert_close(after, before * (1.0 - lr * 0.1), rtol=1e-6, atol=0, msg=name)


def test_lora_decays_the_adapter_alone_in_one_group(ctx: DistContext, tiny_model_dir: Path) -> None:
    """The adapter's A and B are matrices: one decayed group, no empty one beside it, the frozen base left out."""
    lora = LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])
    model = load_model(tiny_model_dir, ctx, prepare=lambda m: add_adapter(m, lora))
    [group] = build_optimizer(model, TrainerConfig(**CFG)).param_groups
    assert group["weight_decay"] == 0.1
    assert group["params"] == [p for p in model.parameters() if p.requires_grad] and len(group["params"]) == 8


def _old_checkpoint(ctx: DistContext, model_dir: Path, run_dir: Path, groups: int
                    ) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Write step 2 of ``run_dir`` with the policy's and the critic's AdamW in ``groups`` param groups (1: as the
    trainer wrote them before the decay groups), after a step on a real gradient; returns their state by name."""
    cfg = TrainerConfig(**CFG)
    policy = load_model(model_dir, ctx)
    critic = load_critic(model_dir, ctx)
    saved = {}
    optimizers = []
    input_ids = torch.arange(3, 40)[None]
    for key, model, lr in (("optim", policy, cfg.lr), ("critic_optim", critic, cfg.critic.lr)):
        params = list(model.parameters())
        optimizer = torch.optim.AdamW([{"params": params[i::groups]} for i in range(groups)], lr=lr,
                                      weight_decay=cfg.weight_decay)
        (model(input_ids=input_ids).logits.float() - 1.0).pow(2).mean().backward()  # the critic's head is 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        saved[key] = {name: {k: _full(v) for k, v in state.items()}
                      for name, state in get_optimizer_state_dict(model, optimizer)["state"].items()}
        optimizers.append(optimizer)
    state = {"policy_version": 2, "buffer": {"unacked": []}, "settings": {"model.lora": None}}
    Checkpointer(run_dir / "checkpoints", keep=1).save(2, policy, optimizers[0], build_scheduler(optimizers[0], cfg),
                                                        state, critic=(critic, optimizers[1]))
    return saved


def test_a_checkpoint_written_with_one_param_group_resumes_into_the_decay_groups(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A run resumed across the upgrade keeps every parameter's moments and step count, and trains on with the
    1-D parameters undecayed."""
    saved = _old_checkpoint(ctx, tiny_model_dir, tmp_path, groups=1)
    trainer = Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path).start(resume=True, ctx=ctx)
    assert trainer.critic is not None and trainer.step == 2
    for key, (model, optimizer) in {"optim": (trainer.model, trainer.optimizer),
                                    "critic_optim": trainer.critic}.items():
        decayed, spared = optimizer.param_groups
        assert (decayed["weight_decay"], spared["weight_decay"]) == (0.1, 0.0), key
        assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in spared["params"])
        state = get_optimizer_state_dict(model, optimizer)["state"]
        assert state.keys() == saved[key].keys()
        assert any(v["exp_avg"].abs().max() > 0 for v in saved[key].values())
        for name, values in saved[key].items():
            for k, value in values.items():
                assert torch.equal(_full(state[name][k]), value), (key, name, k)
    assert trainer.train(synthetic_groups(2, 2))["lr"] == CFG["lr"]
    trainer.close()


def test_a_checkpoint_with_another_count_of_param_groups_is_refused_naming_it(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _old_checkpoint(ctx, tiny_model_dir, tmp_path, groups=3)
    with pytest.raises(CheckpointMismatch, match=r"step_00000002: its optimizer optim has 3 param groups, this run's "
                                                 r"has 2"):
        Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path).start(resume=True, ctx=ctx)
