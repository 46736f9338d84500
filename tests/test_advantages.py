"""Advantage estimators against plain numpy/Python loops over groups and tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from trainer_helpers import synthetic_groups

from trainer.advantages import compute_advantages
from trainer.batching import collate

EPS = 1e-6


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of sizes 4, 1, 3, 5, 2 with one all-equal group, binary and real rewards, one empty mask row."""
    rng = np.random.default_rng(seed)
    sizes = [4, 1, 3, 5, 2]
    group = np.repeat(np.arange(len(sizes)), sizes)
    rewards = rng.normal(size=group.size)
    rewards[group == 2] = 0.5  # equal rewards: zero advantage
    rewards[group == 3] = rng.integers(0, 2, size=5).astype(float)
    mask = rng.random((group.size, 8)) < 0.6
    mask[3] = False
    return rewards, group, mask


def _ref_per_sample(kind: str, rewards: np.ndarray, group: np.ndarray, std_norm: bool) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if group[j] == group[i]]
        n = len(members)
        if n == 1 or max(members) == min(members):
            out.append(0.0)
            continue
        mean = sum(members) / n
        if kind == "rloo":
            out.append(r - (sum(members) - r) / (n - 1))
        elif kind == "grpo" and std_norm:
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
            out.append((r - mean) / (std + EPS))
        else:
            out.append(r - mean)
    return out


def _ref_tokens(kind: str, rewards: np.ndarray, group: np.ndarray, mask: np.ndarray, std_norm: bool):
    per_sample = _ref_per_sample(kind, rewards, group, std_norm)
    out = np.zeros(mask.shape)
    if kind != "reinforce_pp":
        for i in range(mask.shape[0]):
            for j in range(mask.shape[1]):
                out[i, j] = per_sample[i] if mask[i, j] else 0.0
        return out
    sizes = np.bincount(group)
    signal = [sizes[group[i]] > 1 and np.ptp(rewards[group == group[i]]) > 0 for i in range(len(rewards))]
    tokens = [per_sample[i] for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j] and signal[i]]
    mu = sum(tokens) / len(tokens)
    sigma = math.sqrt(sum((v - mu) ** 2 for v in tokens) / len(tokens))
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            out[i, j] = (per_sample[i] - mu) / (sigma + EPS) if mask[i, j] and signal[i] else 0.0
    return out


@pytest.mark.parametrize("kind,std_norm", [("grpo", True), ("grpo", False), ("rloo", True), ("reinforce_pp", True)])
def test_matches_reference(kind: str, std_norm: bool) -> None:
    for seed in range(4):
        rewards, group, mask = _batch(seed)
        r, g, m = torch.tensor(rewards), torch.tensor(group), torch.tensor(mask)
        got = compute_advantages(r, g, m, kind=kind, std_norm=std_norm, eps=EPS)
        assert got.dtype == torch.float32 and got.shape == mask.shape
        want = _ref_tokens(kind, rewards, group, mask, std_norm)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "rloo", "reinforce_pp"])
def test_equal_rewards_singletons_and_masked_rows_are_exactly_zero(kind: str) -> None:
    rewards, group, mask = _batch(1)
    got = compute_advantages(torch.tensor(rewards), torch.tensor(group), torch.tensor(mask), kind=kind)
    assert torch.all(got[torch.tensor(group == 2)] == 0)  # REINFORCE++ too: whitening skips groups without signal
    assert torch.all(got[torch.tensor(group == 1)] == 0)
    assert torch.all(got[~torch.tensor(mask)] == 0)
    same = torch.full((6,), 0.1, dtype=torch.float64)  # 0.1·3/3 != 0.1 in floating point
    idx = torch.tensor([0, 0, 0, 1, 1, 1])
    assert torch.all(compute_advantages(same, idx, torch.ones(6, 4, dtype=torch.bool), kind=kind) == 0)


def test_grpo_group_advantages_sum_to_zero_and_unit_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    idx = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = compute_advantages(rewards, idx, torch.ones(8, 1, dtype=torch.bool), "grpo")[:, 0]
    for g in (0, 1):
        assert adv[idx == g].sum().item() == pytest.approx(0.0, abs=1e-6)
        assert adv[idx == g].std().item() == pytest.approx(1.0, rel=1e-4)
    assert adv[4] > 0 > adv[5]


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="advantage: unknown kind"):
        compute_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2, 3), kind="gae")
    with pytest.raises(ValueError, match="must agree on B"):
        compute_advantages(torch.ones(2), torch.zeros(3, dtype=torch.long), torch.ones(2, 3))


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_refused_naming_its_sample(reward: float) -> None:
    """A NaN reward would zero its group's advantages without a word (a NaN fails the "rewards differ" test), an
    infinite one would make the step's loss NaN: the collator refuses either, naming the sample."""
    groups = synthetic_groups(0, 2)
    groups[1].samples[2].reward = reward
    with pytest.raises(ValueError, match=r"group s0-g1\.samples\[2\]\.reward: .* not a finite number"):
        collate(groups)
