"""The off-policy losses stay finite when one token's behaviour logprob is wildly off the trainer's.

A ratio past e^88.7 overflows fp32 to inf; times a zero (a masked token's weight, a zero advantage, a truncated
IS factor) that is NaN, which poisons the whole update's gradient, so the optimizer skips the step. The tokens the
window or the cap drops must instead drop out exactly as a merely large weight does.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer import losses

WILD = (-1e3, -math.inf)  # behaviour logprobs no real sampler gives its token, but a faulty engine can report
LARGE = -10.0  # far enough below π_prox that the cap and the window drop the token too, without overflow


def _inputs(behav_wild: float, adv_wild: float) -> dict[str, torch.Tensor]:
    """Two rows of three trained tokens; token (0, 1) has the wild behaviour logprob."""
    logp = torch.tensor([[-0.7, -0.2, -1.5], [-0.4, -2.0, -0.9]])
    prox = logp + torch.tensor([[0.05, 0.0, -0.1], [0.02, 0.1, -0.03]])
    behav = prox + torch.tensor([[0.1, 0.0, -0.2], [0.05, -0.1, 0.15]])
    behav[0, 1] = behav_wild
    adv = torch.tensor([[0.8, adv_wild, 0.8], [-1.1, -1.1, -1.1]])
    return {"logp": logp, "prox": prox, "behav": behav, "adv": adv, "mask": torch.ones(2, 3, dtype=torch.bool)}


def _run(kind: str, x: dict[str, torch.Tensor], **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logp = x["logp"].clone().requires_grad_(True)
    loss, metrics = losses.POLICY_LOSSES[kind](logp, x["prox"], x["behav"], x["adv"], x["mask"], **kwargs)
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad, metrics


DROPPING = [("icepop", {}), ("tis", {"is_cap": 2.0, "is_cap_mode": "mask"}),
            ("decoupled_ppo", {"is_cap": 2.0, "is_cap_mode": "mask"})]
ALL = [*DROPPING, ("tis", {"is_cap": 2.0, "is_cap_mode": "truncate"}),
       ("decoupled_ppo", {"is_cap": 2.0, "is_cap_mode": "truncate"})]


@pytest.mark.parametrize(("kind", "kwargs"), ALL, ids=[f"{k}-{a.get('is_cap_mode', 'window')}" for k, a in ALL])
@pytest.mark.parametrize("behav_wild", WILD)
@pytest.mark.parametrize("adv_wild", [1.0, -1.0, 0.0])
def test_a_wild_behaviour_logprob_leaves_loss_gradient_and_metrics_finite(
    kind: str, kwargs: dict, behav_wild: float, adv_wild: float
) -> None:
    loss, grad, metrics = _run(kind, _inputs(behav_wild, adv_wild), **kwargs)
    assert torch.isfinite(loss), loss
    assert torch.isfinite(grad).all(), grad
    assert all(torch.isfinite(metrics[k]) for k in ("is_ratio_mean", "is_ratio_max", "clip_fraction")), metrics


@pytest.mark.parametrize(("kind", "kwargs"), DROPPING, ids=[k for k, _ in DROPPING])
@pytest.mark.parametrize("behav_wild", WILD)
@pytest.mark.parametrize("adv_wild", [1.0, -1.0, 0.0])
def test_a_token_dropped_for_its_weight_drops_out_however_wild(
    kind: str, kwargs: dict, behav_wild: float, adv_wild: float
) -> None:
    """The window (icepop) or the cap in mask mode drops the token at a weight of e^10 and at an overflowing one
    alike: the same loss, the same gradient on every token."""
    wild_loss, wild_grad, _ = _run(kind, _inputs(behav_wild, adv_wild), **kwargs)
    large = _inputs(behav_wild, adv_wild)
    large["behav"][0, 1] = large["prox"][0, 1] + LARGE
    large_loss, large_grad, _ = _run(kind, large, **kwargs)
    torch.testing.assert_close(wild_loss, large_loss)
    torch.testing.assert_close(wild_grad, large_grad)
    assert wild_grad[0, 1] == 0.0
