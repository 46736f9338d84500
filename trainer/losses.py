"""Policy losses with off-policy correction, KL and entropy terms: pure functions on [B, T] tensors.

Three policies appear (AReaL's decoupled PPO, arXiv 2505.24298; Hilton et al. arXiv 2110.00641):
``logprobs`` = log π_θ (the only input that carries a gradient), ``prox_logprobs`` = log π_prox (the
trainer's weights at the start of the step, recomputed by the trainer), ``behaviour_logprobs`` = log π_behav
(what the rollout engine reported when it sampled the token). Every input is [B, T] and aligned to the
predicted token; ``loss_mask`` is 1 on tokens the policy generated. prox, behav and advantages are
detached inside each loss, so gradients flow only through ``logprobs``.

Each policy loss returns ``(loss, metrics)``: ``loss`` is the aggregated scalar (see ``aggregate``) and
``metrics`` are detached token means over ``loss_mask`` (``is_ratio_max`` is a max), ready to be
combined across micro-batches weighted by their token counts.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k2", "k3", "low-var-kl"]
IsCapMode = Literal["truncate", "mask"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def agg_denominator(loss_mask: Tensor, mode: LossAgg) -> int:
    """The count ``aggregate`` divides by: masked tokens (token-mean) or rows with >= 1 masked token.

    Sum it over every micro-batch of every rank to get the step's global denominator.
    """
    mask = loss_mask.bool()
    if mode == "token-mean":
        return int(mask.sum())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return int(mask.any(dim=-1).sum())
    raise ValueError(f"loss_agg: unknown mode {mode!r} (valid: {', '.join(LOSS_AGG_MODES)})")


def aggregate(values: Tensor, loss_mask: Tensor, mode: LossAgg, denominator: float | None = None) -> Tensor:
    """Reduce per-token ``values`` [B, T] over ``loss_mask`` [B, T] to a scalar.

    - ``token-mean``: Σ_{b,t} m·v / Σ m (every token weighs the same; DAPO's choice)
    - ``seq-mean-token-sum``: Σ_b (Σ_t m·v) / S (each sequence's sum; long answers weigh more)
    - ``seq-mean-token-mean``: Σ_b (Σ_t m·v / Σ_t m) / S (original GRPO)

    S counts rows with at least one masked token; fully masked rows contribute nothing. ``denominator``
    replaces the local count (Σ m or S) with the global one of the whole step, so that summing the
    results of all micro-batches gives the aggregate of the full batch. An empty mask gives 0.
    """
    mask = loss_mask.bool()
    local = agg_denominator(mask, mode)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode == "seq-mean-token-mean":
        numerator = (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()
    else:
        numerator = masked.sum()
    if denominator is None:
        denominator = local
    return numerator / max(float(denominator), 1.0)


# A log ratio is clamped to ±this before exp: e^60 ≈ 1e26 lies far past any cap or window, yet ratio·A·cap stays
# finite in fp32 (exp overflows at 88.7), where an inf would meet a zero (a dropped token, a zero advantage) as NaN.
MAX_LOG_RATIO = 60.0


def _masked_exp(diff: Tensor, mask: Tensor) -> Tensor:
    """exp(diff) on masked tokens, exactly 1 elsewhere, diff clamped to ±``MAX_LOG_RATIO``: neither padding nor a
    wild behaviour logprob (e.g. -inf from an engine) produces inf or NaN; a clamped token's ratio carries no
    gradient, and the cap or window drops it as it would any large weight."""
    kept = torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
    return torch.exp(kept.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, clip_eps: float, clip_eps_high: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token ``-min(r·A, clip(r, 1-ε, 1+ε_high)·A)`` and where the clipped branch is the active one."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    n = mask.sum().clamp(min=1)
    return (torch.where(mask, x.float(), torch.zeros((), device=x.device)).sum() / n).detach()


def _metrics(
    mask: Tensor, is_weight: Tensor, clipped: Tensor, gap: Tensor, masked: Tensor | None
) -> dict[str, Tensor]:
    """Detached per-call statistics over ``mask``: IS weight π_prox/π_behav, clip and mask fractions."""
    zero = torch.zeros((), device=mask.device)
    return {
        "is_ratio_mean": _token_mean(is_weight, mask),
        "is_ratio_max": torch.where(mask, is_weight, zero).max().detach() if mask.any() else zero,
        "clip_fraction": _token_mean(clipped, mask),
        "masked_fraction": zero if masked is None else _token_mean(masked, mask),
        "logprob_gap": _token_mean(gap.abs(), mask),
    }


def _over_cap(is_weight: Tensor, is_cap: float | None, mode: IsCapMode) -> Tensor | None:
    """Tokens whose IS weight exceeds ``is_cap`` when ``mode`` masks them (None: nothing is masked)."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"is_cap_mode: unknown mode {mode!r} (valid: truncate, mask)")
    if is_cap is None or mode == "truncate":
        return None
    return is_weight > is_cap


def _prepare(
    logprobs: Tensor, prox: Tensor, behav: Tensor, adv: Tensor, loss_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Check shapes, cast to fp32, detach everything but ``logprobs`` (the stop-gradients)."""
    named = {"prox_logprobs": prox, "behaviour_logprobs": behav, "advantages": adv, "loss_mask": loss_mask}
    for name, t in named.items():
        if t.shape != logprobs.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from logprobs {tuple(logprobs.shape)}")
    fixed = [t.detach().float() for t in (prox, behav, adv)]
    return logprobs.float(), *fixed, loss_mask.bool()


def decoupled_ppo(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float | None = None,
    is_cap_mode: IsCapMode = "truncate",
    loss_agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, arXiv 2505.24298; Hilton et al. 2021), per token:

    ``L = -w · min(u·A, clip(u, 1-ε, 1+ε_high)·A)``, ``u = π_θ/π_prox``, ``w = π_prox/π_behav`` capped:

    - ``is_cap_mode="truncate"``: ``w = min(π_prox/π_behav, is_cap)`` (Hilton et al.'s truncation);
    - ``is_cap_mode="mask"``: ``w = 0`` where ``π_prox/π_behav > is_cap`` (AReaL's code: the token is
      dropped, but still counts in the denominator); ``masked_fraction`` reports how many.

    The PPO trust region is measured from the proximal policy; staleness is corrected by the
    behaviour importance weight w (``is_cap`` None: not capped).
    """
    logp, prox, behav, adv, mask = _prepare(logprobs, prox_logprobs, behaviour_logprobs, advantages, loss_mask)
    ratio = _masked_exp(logp - prox, mask)
    is_weight = _masked_exp(prox - behav, mask)
    over = _over_cap(is_weight, is_cap, is_cap_mode)
    if over is not None:
        weight = torch.where(over, torch.zeros((), device=is_weight.device), is_weight)
    else:
        weight = is_weight if is_cap is None else is_weight.clamp(max=is_cap)
    per_token, clipped = _clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)
    loss = aggregate(weight * per_token, mask, loss_agg, denominator)
    kept = clipped if over is None else clipped & ~over
    return loss, _metrics(mask, is_weight, kept, prox - behav, over)


def tis(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float | None = 5.0,
    is_cap_mode: IsCapMode = "truncate",
    loss_agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated IS in bypass mode (π_old = π_behav; Yao et al. "off-policy RL", verl rollout correction):

    ``L = -min(1, C/w) · min(r·A, clip(r, 1-ε, 1+ε_high)·A)``, ``r = π_θ/π_behav``, ``w = π_prox/π_behav``,
    ``C = is_cap``.

    The ratio r already carries the behaviour IS weight (r = w at the start of the step), so its
    gradient is ``min(w, C)·A·∇log π_θ``: the IS weight truncated at C. Multiplying the surrogate by
    ``min(w, C)`` itself would weight each token by ``w·min(w, C)``, counting the correction twice.
    With ``is_cap_mode="mask"`` the factor is ``1[w ≤ C]`` instead: tokens above the cap are dropped.
    """
    logp, prox, behav, adv, mask = _prepare(logprobs, prox_logprobs, behaviour_logprobs, advantages, loss_mask)
    ratio = _masked_exp(logp - behav, mask)
    is_weight = _masked_exp(prox - behav, mask)
    per_token, clipped = _clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)
    over = _over_cap(is_weight, is_cap, is_cap_mode)
    if over is not None:
        per_token = torch.where(over, torch.zeros((), device=per_token.device), per_token)
        clipped = clipped & ~over
    elif is_cap is not None:
        per_token = per_token * (is_cap / is_weight).clamp(max=1.0)
    loss = aggregate(per_token, mask, loss_agg, denominator)
    return loss, _metrics(mask, is_weight, clipped, prox - behav, over)


def icepop(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_low: float = 0.5,
    is_high: float = 2.0,
    loss_agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop / token-level masked IS (Ling team's IcePop; verl's token rejection sampling), bypass mode:

    ``L = -1[is_low ≤ w ≤ is_high] · min(r·A, clip(r, 1-ε, 1+ε_high)·A)``, ``r = π_θ/π_behav``,
    ``w = π_prox/π_behav``.

    Tokens whose weight leaves the window are masked (zero loss, zero gradient), not clamped; they still
    count in the denominator, so the other tokens' weight does not grow when many are masked.
    """
    logp, prox, behav, adv, mask = _prepare(logprobs, prox_logprobs, behaviour_logprobs, advantages, loss_mask)
    ratio = _masked_exp(logp - behav, mask)
    is_weight = _masked_exp(prox - behav, mask)
    outside = (is_weight < is_low) | (is_weight > is_high)
    per_token, clipped = _clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)
    per_token = torch.where(outside, torch.zeros((), device=per_token.device), per_token)
    loss = aggregate(per_token, mask, loss_agg, denominator)
    return loss, _metrics(mask, is_weight, clipped & ~outside, prox - behav, outside)


def ppo(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    loss_agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO (Schulman et al. 2017) with π_old = π_prox; the on-policy baseline, no IS correction:

    ``L = -min(u·A, clip(u, 1-ε, 1+ε_high)·A)``, ``u = π_θ/π_prox``.

    ``behaviour_logprobs`` only feeds the metrics (IS ratio, logprob gap).
    """
    logp, prox, behav, adv, mask = _prepare(logprobs, prox_logprobs, behaviour_logprobs, advantages, loss_mask)
    ratio = _masked_exp(logp - prox, mask)
    per_token, clipped = _clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)
    loss = aggregate(per_token, mask, loss_agg, denominator)
    return loss, _metrics(mask, _masked_exp(prox - behav, mask), clipped, prox - behav, None)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    value_clip: float | None = 0.5,
    loss_agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of PPO's critic (Schulman et al. 2017's baselines; verl, OpenRLHF), per token:

    ``L = ½·max((V - R)², (clip(V, V_old - ε, V_old + ε) - R)²)``, ``ε = value_clip`` (None: ``½·(V - R)²``).

    ``values`` [B, T] carries the gradient; ``old_values`` (the critic at the start of the step) and ``returns``
    are detached. ``value_clip_fraction``: tokens where the clipped branch is the larger one.
    """
    named = {"old_values": old_values, "returns": returns, "loss_mask": loss_mask}
    for name, t in named.items():
        if t.shape != values.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from values {tuple(values.shape)}")
    v, old, ret, mask = values.float(), old_values.detach().float(), returns.detach().float(), loss_mask.bool()
    unclipped = (v - ret).square()
    if value_clip is None:
        per_token, clipped = unclipped, torch.zeros_like(mask)
    else:
        clipped_sq = (old + (v - old).clamp(-value_clip, value_clip) - ret).square()
        per_token, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    loss = 0.5 * aggregate(per_token, mask, loss_agg, denominator)
    return loss, {"value_clip_fraction": _token_mean(clipped, mask)}


POLICY_LOSSES = {"decoupled_ppo": decoupled_ppo, "tis": tis, "icepop": icepop, "ppo": ppo}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "low-var-kl") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled tokens (Schulman, "Approximating KL"):

    ``k1 = log π_θ - log π_ref``; ``k2 = ½ (log π_θ - log π_ref)²``; ``k3 = e^{δ} - δ - 1`` with
    ``δ = log π_ref - log π_θ`` (unbiased, non-negative); ``low-var-kl`` = k3 with δ clamped to
    [-20, 20] and the result to [-10, 10] (verl), so one wild token cannot dominate.
    Gradient flows through ``logprobs`` only.
    """
    logp = logprobs.float()
    delta = ref_logprobs.detach().float() - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.expm1(delta) - delta
    if estimator == "low-var-kl":
        delta = delta.clamp(-20.0, 20.0)
        return (torch.expm1(delta) - delta).clamp(-10.0, 10.0)
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r} (valid: k1, k2, k3, low-var-kl)")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: ``logsumexp(z) - Σ softmax(z)·z``; [B, T, V] -> [B, T]."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] per position; logits [B, T, V], targets [B, T] -> [B, T] in fp32."""
    z = logits.float()
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
