"""Advantages: one scalar reward per sample -> per-token advantages on generated tokens.

The group-relative estimators (grpo, rloo, reinforce_pp) use the other samples of the same prompt as the
baseline, so no value model is needed: the reward is outcome-only (given at the end), so each generated
token of a sample gets the sample's advantage (γ = 1). ``gae`` uses a critic's per-token values instead.
Prompt, tool-output and padding tokens get 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvantageKind = Literal["grpo", "rloo", "reinforce_pp"]
ADVANTAGE_KINDS: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp")  # gae needs values: see ``gae``


def _group_sum(values: Tensor, group_index: Tensor) -> Tensor:
    """Σ of ``values`` over each sample's group, broadcast back to the samples [B]."""
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    return torch.zeros(n_groups, dtype=values.dtype).index_add_(0, group_index, values)[group_index]


def _size_and_mean(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    n = _group_sum(torch.ones_like(rewards), group_index)
    return n, _group_sum(rewards, group_index) / n


def _has_signal(rewards: Tensor, group_index: Tensor) -> Tensor:
    """[B] bool: the sample's group has more than one distinct reward (else its advantage is exactly 0,
    not a rounding residue of ``r - mean``)."""
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    lo = torch.zeros(n_groups, dtype=rewards.dtype)
    hi = torch.zeros(n_groups, dtype=rewards.dtype)
    lo.scatter_reduce_(0, group_index, rewards, "amin", include_self=False)
    hi.scatter_reduce_(0, group_index, rewards, "amax", include_self=False)
    return (hi > lo)[group_index]


def grpo(rewards: Tensor, group_index: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al., DeepSeekMath arXiv 2402.03300): ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased standard deviation of the group (as in TRL and verl); with
    ``std_norm=False`` only the mean is subtracted (Dr. GRPO, arXiv 2503.20783). A group of one
    sample, or one whose rewards are all equal, gets exactly 0.
    ``rewards`` [B] float, ``group_index`` [B] int in [0, G).
    """
    n, mean = _size_and_mean(rewards, group_index)
    centred = rewards - mean
    if std_norm:
        std = torch.sqrt(_group_sum(centred.square(), group_index) / (n - 1).clamp(min=1))
        centred = centred / (std + eps)
    return torch.where(_has_signal(rewards, group_index), centred, torch.zeros_like(centred))


def rloo(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. arXiv 2402.14740): ``A_i = r_i - mean_{j≠i} r_j``; a group of one, or of
    equal rewards, gets exactly 0."""
    n = _group_sum(torch.ones_like(rewards), group_index)
    leave_one_out = (_group_sum(rewards, group_index) - rewards) / (n - 1).clamp(min=1)
    return torch.where(_has_signal(rewards, group_index), rewards - leave_one_out, torch.zeros_like(rewards))


def reinforce_pp_baseline(rewards: Tensor, group_index: Tensor, loss_mask: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline (Hu et al. arXiv 2501.03262, OpenRLHF): subtract the group mean, then
    whiten over the loss-masked tokens of the batch: ``Â = (A - μ_tok) / (σ_tok + eps)``.

    μ_tok and σ_tok (population) are taken over tokens, so long answers weigh more, as in OpenRLHF, but
    only over groups with signal: a group whose rewards are all equal (or of one sample) carries no
    information and keeps advantage exactly 0 after whitening, as in GRPO and RLOO (OpenRLHF would
    shift it to -μ_tok/σ_tok). Returns per-token advantages [B, T], 0 off the mask.
    """
    _, mean = _size_and_mean(rewards, group_index)
    signal = _has_signal(rewards, group_index)
    mask = loss_mask.bool()
    tokens_mask = mask & signal[:, None]
    per_token = (rewards - mean)[:, None].expand(mask.shape)
    tokens = tokens_mask.sum().clamp(min=1)
    mu = torch.where(tokens_mask, per_token, 0.0).sum() / tokens
    var = torch.where(tokens_mask, (per_token - mu).square(), 0.0).sum() / tokens
    whitened = (per_token - mu) / (var.sqrt() + eps)
    return torch.where(tokens_mask, whitened, 0.0)


def compute_advantages(
    rewards: Tensor,
    group_index: Tensor,
    loss_mask: Tensor,
    kind: AdvantageKind = "grpo",
    std_norm: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token advantages [B, T] (fp32, 0 where ``loss_mask`` is 0) for ``rewards`` [B] of samples
    whose prompt is ``group_index`` [B]; ``std_norm`` applies to GRPO only."""
    if rewards.shape != group_index.shape or rewards.ndim != 1 or loss_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"advantages: rewards {tuple(rewards.shape)}, group_index {tuple(group_index.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must agree on B"
        )
    r = rewards.double()
    idx = group_index.long()
    mask = loss_mask.bool()
    if kind == "reinforce_pp":
        return reinforce_pp_baseline(r, idx, mask, eps).float()
    if kind == "grpo":
        per_sample = grpo(r, idx, std_norm, eps)
    elif kind == "rloo":
        per_sample = rloo(r, idx)
    else:
        raise ValueError(f"advantage: unknown kind {kind!r} (valid: {', '.join(ADVANTAGE_KINDS)})")
    return torch.where(mask, per_sample[:, None], 0.0).float()


def gae(rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. arXiv 1506.02438) over the generated tokens of each row: (advantages, returns) [B, T].

    ``rewards`` [B] is the outcome, given at the row's last generated token; ``values`` [B, T] the critic's
    V(s_t) aligned like ``loss_mask`` [B, T]. With t' the next generated token after t (V, A = 0 past the last):
    ``δ_t = r_t + γ·V_t' - V_t``, ``A_t = δ_t + γλ·A_t'``, returns ``R_t = A_t + V_t``. Tokens off the mask (tool
    output, template, padding) are skipped: they are the environment's, not actions, so the recursion passes
    over them (verl's multi-turn GAE), and they get 0.
    """
    mask = loss_mask.bool()
    values = values.to(torch.float64)
    b, t_len = mask.shape
    has_tokens = mask.any(dim=1)
    last = t_len - 1 - mask.flip(1).int().argmax(dim=1)
    token_rewards = torch.zeros(b, t_len, dtype=torch.float64)
    rows = torch.arange(b)[has_tokens]
    token_rewards[rows, last[has_tokens]] = rewards.to(torch.float64)[has_tokens]
    next_value = torch.zeros(b, dtype=torch.float64)
    next_adv = torch.zeros(b, dtype=torch.float64)
    adv = torch.zeros(b, t_len, dtype=torch.float64)
    for t in range(t_len - 1, -1, -1):
        m = mask[:, t]
        a = token_rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(mask, adv + values, 0.0)
    return adv.float(), returns.float()


def whiten(values: Tensor, loss_mask: Tensor, eps: float = 1e-6) -> Tensor:
    """``(x - μ) / (σ + eps)`` with μ, σ over the masked tokens of the batch (PPO's advantage normalisation); 0 off
    the mask."""
    mask = loss_mask.bool()
    x = values.to(torch.float64)
    n = mask.sum().clamp(min=1)
    mu = torch.where(mask, x, 0.0).sum() / n
    var = torch.where(mask, (x - mu).square(), 0.0).sum() / n
    return torch.where(mask, (x - mu) / (var.sqrt() + eps), 0.0).to(values.dtype)
