"""The optimizer side of a step: AdamW, the LR schedule (warmup, then constant or cosine), gradient clipping.

``trainer.weight_decay`` decays the matrices (linear weights and the embeddings, as HF Trainer and Megatron decay
them) and spares the 1-D parameters, biases and norm gains: decay pulls a gain toward 0, not toward the identity.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from core.config import TrainerConfig

log = logging.getLogger(__name__)


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies to ``param``: a matrix does, a bias or a norm gain (1-D) does not. A DTensor
    (an FSDP2 shard) has its full tensor's ``ndim``."""
    return param.ndim >= 2


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups: the decayed parameters at ``weight_decay``, the others at 0. A group that would be empty (a
    LoRA adapter has matrices alone) is left out: DCP's optimizer state dict takes at most one empty group."""
    params = list(params)
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    trainable = (p for p in model.parameters() if p.requires_grad)  # with LoRA: the adapter alone
    return torch.optim.AdamW(param_groups(trainable, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of ``cfg.lr`` at the scheduler's step ``step`` (0-based; it advances once per trainer step that
    trains the policy, whatever ``ppo_minibatches``): linear warmup over ``warmup_steps`` (step s uses
    (s+1)/warmup), then constant or a cosine decay that reaches 0 when the policy's steps end: ``total_steps``
    less the critic's warm-up under ``advantage=gae`` (steps that train the critic alone do not advance it)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    policy_steps = cfg.total_steps - (cfg.critic.warmup_steps if cfg.advantage == "gae" else 0)
    progress = (step - cfg.warmup_steps) / max(1, policy_steps - cfg.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, cfg)

    return LambdaLR(optimizer, factor)


def apply_settings(optimizer: torch.optim.Optimizer, lr: float, cfg: TrainerConfig,
                   scheduler: LambdaLR | None = None) -> None:
    """After a resume: the run's config sets the learning rate, betas and weight decay (the matrices'; the 1-D
    parameters' group stays at 0), the checkpoint only the state (step counts, moments, the schedule's position). A
    scheduler's base rate is ``lr`` and the current rate is its schedule's (``cfg``'s, e.g. a raised ``total_steps``)
    at the restored position, as ``LambdaLR`` computes it; without a scheduler the rate is ``lr`` (constant)."""
    for group in optimizer.param_groups:
        decay = cfg.weight_decay if all(decays(p) for p in group["params"]) else 0.0
        group.update(betas=tuple(cfg.betas), weight_decay=decay, lr=lr)
    if scheduler is not None:
        now = [lr * lr_factor(scheduler.last_epoch, cfg) for _ in optimizer.param_groups]
        scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": [lr] * len(now), "_last_lr": now})
        for group, rate in zip(optimizer.param_groups, now, strict=True):
            group.update(initial_lr=lr, lr=rate)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all shards) and return it before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, what: str) -> float:
    """Clip, step (skipped, and logged, when the norm is not finite) and zero the gradients of ``what`` (the
    policy, the critic); returns the norm before clipping."""
    norm = clip_grad_norm(model, max_norm)
    if math.isfinite(norm):
        optimizer.step()
    else:
        log.warning("%s gradient norm is %s: update skipped", what, norm)
    optimizer.zero_grad(set_to_none=True)
    return norm


def step_grad_norm(norms: Sequence[float]) -> float:
    """The gradient norm of a step's updates: the largest, or the first that is not finite (an update skipped).
    ``max`` alone skips a NaN that is not first (``max([0.5, nan]) == 0.5``) and would hide it."""
    return next((n for n in norms if not math.isfinite(n)), max(norms))
