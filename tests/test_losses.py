"""Every policy loss, aggregation, KL estimator and entropy against plain-Python references.

The references loop over tokens with ``math`` and share no code with trainer/losses.py; they also give
the analytic gradient d loss / d logprob of each token, so the autograd gradient is checked too.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from trainer import losses

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
CLIP, CLIP_HIGH, CAP, LOW, HIGH = 0.2, 0.28, 3.0, 0.5, 2.0


def _inputs(seed: int, extreme: bool = False, b: int = 6, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prox = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    behav = prox + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[1] = False  # an all-masked row
    mask[2] = True
    if extreme:  # logprob differences of ±20 on some tokens
        pick = torch.rand(b, t, generator=g) < 0.3
        sign = torch.where(torch.rand(b, t, generator=g) < 0.5, -20.0, 20.0).double()
        prox = torch.where(pick, logp + sign, prox)
        pick = torch.rand(b, t, generator=g) < 0.3
        behav = torch.where(pick, prox - sign, behav)
        logp = torch.where(torch.rand(b, t, generator=g) < 0.2, prox + sign, logp)
    behav = torch.where(mask, behav, torch.zeros_like(behav))  # the schema's 0 off the mask
    return {"logp": logp, "prox": prox, "behav": behav, "adv": adv, "mask": mask}


def _ref_token(kind: str, lp: float, px: float, bh: float, a: float, cap_mode: str) -> tuple[float, float]:
    """(loss, d loss / d lp) of one token, written out by hand."""

    def surrogate(ratio: float) -> tuple[float, float]:
        clipped = min(max(ratio, 1 - CLIP), 1 + CLIP_HIGH)
        if ratio * a <= clipped * a:  # unclipped branch active: gradient ratio·A
            return -ratio * a, -ratio * a
        return -clipped * a, 0.0

    w = math.exp(px - bh)
    if kind == "decoupled_ppo":
        scale = min(w, CAP) if cap_mode == "truncate" else (w if w <= CAP else 0.0)
        value, grad = surrogate(math.exp(lp - px))
    elif kind == "ppo":
        scale = 1.0
        value, grad = surrogate(math.exp(lp - px))
    elif kind == "tis":
        scale = min(1.0, CAP / w) if cap_mode == "truncate" else float(w <= CAP)
        value, grad = surrogate(math.exp(lp - bh))
    elif kind == "icepop":
        scale = 1.0 if LOW <= w <= HIGH else 0.0
        value, grad = surrogate(math.exp(lp - bh))
    else:
        raise AssertionError(kind)
    return scale * value, scale * grad


def _ref_aggregate(values: list[list[float]], mask: list[list[bool]], mode: str) -> tuple[float, list]:
    """(aggregate, d aggregate / d value per token)."""
    rows = [i for i, m in enumerate(mask) if any(m)]
    dvals = [[0.0] * len(m) for m in mask]
    total = 0.0
    if mode == "token-mean":
        n = sum(sum(m) for m in mask)
        for i in rows:
            for j, keep in enumerate(mask[i]):
                if keep:
                    total += values[i][j] / n
                    dvals[i][j] = 1 / n
    else:
        for i in rows:
            length = sum(mask[i]) if mode == "seq-mean-token-mean" else 1
            for j, keep in enumerate(mask[i]):
                if keep:
                    total += values[i][j] / length / len(rows)
                    dvals[i][j] = 1 / length / len(rows)
    return total, dvals


def _reference(kind: str, x: dict[str, torch.Tensor], mode: str, cap_mode: str = "truncate") -> tuple[float, Tensor]:
    b, t = x["mask"].shape
    vals = [[0.0] * t for _ in range(b)]
    grads = [[0.0] * t for _ in range(b)]
    mask = x["mask"].tolist()
    for i in range(b):
        for j in range(t):
            if mask[i][j]:
                args = (x[k][i, j].item() for k in ("logp", "prox", "behav", "adv"))
                vals[i][j], grads[i][j] = _ref_token(kind, *args, cap_mode)
    loss, dagg = _ref_aggregate(vals, mask, mode)
    grad = torch.tensor([[grads[i][j] * dagg[i][j] for j in range(t)] for i in range(b)], dtype=torch.float64)
    return loss, grad


def _call(kind: str, x: dict[str, torch.Tensor], mode: str, cap_mode: str = "truncate", **extra):
    kwargs = {"clip_eps": CLIP, "clip_eps_high": CLIP_HIGH, "loss_agg": mode, **extra}
    if kind in ("decoupled_ppo", "tis"):
        kwargs.update(is_cap=CAP, is_cap_mode=cap_mode)
    if kind == "icepop":
        kwargs.update(is_low=LOW, is_high=HIGH)
    fn = losses.POLICY_LOSSES[kind]
    return fn(x["logp"], x["prox"], x["behav"], x["adv"], x["mask"], **kwargs)


@pytest.mark.parametrize("kind", sorted(losses.POLICY_LOSSES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extreme", [False, True], ids=["normal", "extreme"])
def test_policy_loss_matches_reference(kind: str, mode: str, extreme: bool) -> None:
    for seed in range(3):
        x = _inputs(seed, extreme)
        x["logp"] = x["logp"].clone().requires_grad_(True)
        loss, metrics = _call(kind, x, mode)
        want, want_grad = _reference(kind, x, mode)
        assert torch.isfinite(loss)
        assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
        loss.backward()
        torch.testing.assert_close(x["logp"].grad, want_grad, rtol=1e-4, atol=1e-6)
        assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("kind", ["decoupled_ppo", "tis"])
@pytest.mark.parametrize("mode", MODES)
def test_cap_mask_mode_drops_tokens_above_the_cap(kind: str, mode: str) -> None:
    """AReaL's variant: a token whose IS weight exceeds the cap gets no loss and no gradient."""
    for seed in range(3):
        x = _inputs(seed, extreme=True)
        x["logp"] = x["logp"].clone().requires_grad_(True)
        loss, metrics = _call(kind, x, mode, cap_mode="mask")
        want, want_grad = _reference(kind, x, mode, cap_mode="mask")
        assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
        if kind == "decoupled_ppo":  # (tis truncated at C/w with w ≈ e^20 is ~0 on those tokens as well)
            assert loss.item() != pytest.approx(_reference(kind, x, mode)[0], rel=1e-3)
        loss.backward()
        torch.testing.assert_close(x["logp"].grad, want_grad, rtol=1e-4, atol=1e-6)
        over = (torch.exp(x["prox"] - x["behav"]) > CAP) & x["mask"]
        assert over.any() and torch.all(x["logp"].grad[over] == 0)
        assert metrics["masked_fraction"].item() == pytest.approx(over.sum().item() / x["mask"].sum().item())
    with pytest.raises(ValueError, match="is_cap_mode: unknown mode 'clip'"):
        _call(kind, _inputs(0), "token-mean", cap_mode="clip")


@pytest.mark.parametrize("kind", sorted(losses.POLICY_LOSSES))
def test_stop_gradient_only_through_current_logprobs(kind: str) -> None:
    x = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in _inputs(7).items()}
    loss, _ = _call(kind, x, "token-mean")
    loss.backward()
    for name in ("prox", "behav", "adv"):
        assert x[name].grad is None, f"{kind}: gradient leaked into {name}"
    assert x["logp"].grad.abs().sum() > 0
    assert torch.all(x["logp"].grad[~x["mask"]] == 0)


def test_metrics_match_reference() -> None:
    x = _inputs(3)
    m = x["mask"]
    w = torch.exp(x["prox"] - x["behav"])[m]
    _, metrics = _call("decoupled_ppo", x, "token-mean")
    assert metrics["is_ratio_mean"].item() == pytest.approx(w.mean().item(), rel=1e-5)
    assert metrics["is_ratio_max"].item() == pytest.approx(w.max().item(), rel=1e-5)
    gap = (x["prox"] - x["behav"]).abs()[m].mean().item()
    assert metrics["logprob_gap"].item() == pytest.approx(gap, rel=1e-5)
    _, metrics = _call("icepop", x, "token-mean")
    outside = ((w < LOW) | (w > HIGH)).double().mean().item()
    assert metrics["masked_fraction"].item() == pytest.approx(outside, rel=1e-5)
    # ppo on a batch where π_θ moved far from π_prox: clipped exactly where the reference says so
    x["logp"] = x["prox"] + torch.where(x["adv"] > 0, 1.0, -1.0).double()
    _, metrics = _call("ppo", x, "token-mean")
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)


def test_zero_advantage_and_empty_mask_give_zero_loss() -> None:
    x = _inputs(5)
    x["adv"] = torch.zeros_like(x["adv"])
    for kind in losses.POLICY_LOSSES:
        assert _call(kind, x, "token-mean")[0].item() == 0.0
    x = _inputs(5)
    x["mask"] = torch.zeros_like(x["mask"])
    for kind in losses.POLICY_LOSSES:
        for mode in MODES:
            loss, metrics = _call(kind, x, mode)
            assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_denominator_sum_to_full_batch(mode: str) -> None:
    x = _inputs(11, b=8)
    full, _ = _call("decoupled_ppo", x, mode)
    denom = losses.agg_denominator(x["mask"], mode)
    parts = [
        _call("decoupled_ppo", {k: v[rows] for k, v in x.items()}, mode, denominator=denom)[0]
        for rows in (slice(0, 3), slice(3, 5), slice(5, 8))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), rel=1e-6)


def test_aggregate_rejects_unknown_mode_and_bad_shapes() -> None:
    x = _inputs(0)
    with pytest.raises(ValueError, match="loss_agg"):
        losses.aggregate(x["logp"], x["mask"], "token-sum")
    with pytest.raises(ValueError, match="advantages"):
        losses.ppo(x["logp"], x["prox"], x["behav"], x["adv"][:, :3], x["mask"])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low-var-kl"])
def test_kl_estimators(estimator: str) -> None:
    x = _inputs(2, extreme=True)
    logp = x["logp"].clone().requires_grad_(True)
    ref = x["prox"].clone().requires_grad_(True)
    got = losses.kl_penalty(logp, ref, estimator)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            d = ref[i, j].item() - logp[i, j].item()
            if estimator == "k1":
                want = -d
            elif estimator == "k2":
                want = d * d / 2
            elif estimator == "k3":
                want = math.exp(d) - d - 1
            else:
                d = min(max(d, -20.0), 20.0)
                want = min(max(math.exp(d) - d - 1, -10.0), 10.0)
            assert got[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    got.sum().backward()
    assert ref.grad is None and logp.grad is not None


def test_entropy_and_logprobs_from_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g) * 4
    targets = torch.randint(0, 11, (2, 3), generator=g)
    ent = losses.entropy_from_logits(logits)
    lp = losses.logprobs_from_logits(logits, targets)
    for i in range(2):
        for j in range(3):
            z = logits[i, j].tolist()
            norm = math.log(sum(math.exp(v) for v in z))
            probs = [math.exp(v - norm) for v in z]
            assert ent[i, j].item() == pytest.approx(-sum(p * math.log(p) for p in probs), rel=1e-5)
            assert lp[i, j].item() == pytest.approx(z[targets[i, j]] - norm, rel=1e-5, abs=1e-6)
