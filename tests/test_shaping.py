"""DAPO's over-long shaping (soft punishment or masking of truncated samples) and its degenerate-group test,
against hand-worked numbers, and through the trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import synthetic_groups

from buffer.schema import TrajectoryGroup
from core.config import ConfigError, OverlongConfig, TrainerConfig, load_config
from trainer.batching import collate
from trainer.parallel import DistContext
from trainer.shaping import is_degenerate, overlong_penalty, shape_batch
from trainer.worker import Trainer

PENALTY = OverlongConfig(mode="penalty", max_tokens=20, buffer_tokens=5, penalty_factor=0.5)


def _dapo(length: int, l_max: int, l_cache: int) -> float:
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_soft_overlong_punishment() -> None:
    lengths = [0, 10, 15, 16, 18, 20, 21, 90]
    got = overlong_penalty(np.array(lengths), PENALTY)
    assert got.tolist() == pytest.approx([0.5 * _dapo(n, 20, 5) for n in lengths])
    assert got.tolist() == pytest.approx([0, 0, 0, -0.1, -0.3, -0.5, -0.5, -0.5])
    assert not overlong_penalty(np.array(lengths), OverlongConfig(mode="mask")).any()


def test_penalty_needs_its_lengths() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.overlong: .*max_tokens"):
        load_config(overrides=["trainer.overlong.mode=penalty"], env={})
    with pytest.raises(ConfigError, match=r"trainer\.overlong: .*buffer_tokens"):
        load_config(overrides=["trainer.overlong.mode=penalty", "trainer.overlong.max_tokens=8",
                               "trainer.overlong.buffer_tokens=9"], env={})
    cfg = load_config(overrides=["trainer.overlong.mode=penalty", "trainer.overlong.max_tokens=30"], env={})
    assert cfg.trainer.overlong.buffer_tokens == 16


def _with_truncation(seed: int = 0) -> list[TrajectoryGroup]:
    """Two groups; samples 0 and 5 hit a token limit (a turn's and the context's), sample 2 the turn limit."""
    groups = synthetic_groups(seed, 2)
    samples = [s for g in groups for s in g.samples]
    samples[0].finish_reason = "length"
    samples[5].finish_reason = "max_total_tokens"
    samples[2].finish_reason = "max_turns"  # not a token limit
    return groups


def test_mask_mode_leaves_truncated_samples_out_of_the_loss() -> None:
    groups = _with_truncation()
    batch = collate(groups)
    shaped, stats = shape_batch(batch, groups, OverlongConfig(mode="mask"))
    assert stats == {"truncated": 2, "overlong_penalty_mean": 0.0, "overlong_masked": 2}
    assert not shaped.loss_mask[[0, 5]].any() and batch.loss_mask[[0, 5]].any()
    assert torch.equal(shaped.loss_mask[[1, 2, 3, 4, 6, 7]], batch.loss_mask[[1, 2, 3, 4, 6, 7]])
    assert torch.equal(shaped.rewards, batch.rewards)
    off, stats = shape_batch(batch, groups, OverlongConfig())
    assert stats["truncated"] == 2 and stats["overlong_masked"] == 0 and torch.equal(off.loss_mask, batch.loss_mask)


def test_penalty_mode_shapes_the_rewards_by_generated_tokens() -> None:
    groups = _with_truncation()
    batch = collate(groups)
    shaped, stats = shape_batch(batch, groups, PENALTY)
    want = [s.reward + 0.5 * _dapo(s.num_generated, 20, 5) for g in groups for s in g.samples]
    assert shaped.rewards.tolist() == pytest.approx(want)
    assert stats["overlong_penalty_mean"] == pytest.approx(float(np.mean(np.array(want) - batch.rewards.numpy())))
    assert stats["overlong_penalty_mean"] < 0 and torch.equal(shaped.loss_mask, batch.loss_mask)


def test_degenerate_means_equal_rewards_as_the_advantages_see_them() -> None:
    group = synthetic_groups(1, 1)[0]
    for s in group.samples:
        s.reward = 1.0
    lengths = [s.num_generated for s in group.samples]
    assert len(set(lengths)) > 1 and max(lengths) > 15  # the penalty tells them apart
    assert is_degenerate(group, OverlongConfig())
    assert not is_degenerate(group, PENALTY)
    group.samples[0].reward = 0.0
    assert not is_degenerate(group, OverlongConfig())


def test_overlong_modes_in_the_trainer(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Equal outcomes: GRPO has no signal unless the penalty separates long samples from short ones; masking
    takes the truncated samples' tokens out of the step. Both are counted in the metrics."""
    records = {}
    for mode, overlong in {"off": {}, "penalty": PENALTY.model_dump(), "mask": {"mode": "mask"}}.items():
        groups = _with_truncation()
        for s in (s for g in groups for s in g.samples):
            s.reward = 1.0
        cfg = TrainerConfig(device="cpu", total_steps=1, overlong=overlong)
        trainer = Trainer(cfg, tiny_model_dir, tmp_path / mode).start(ctx=ctx)
        records[mode] = trainer.train(groups)
        registry = trainer.metrics.registry
        assert registry.get_sample_value("rollwave_trainer_truncated_samples_total") == 2
        masked = registry.get_sample_value("rollwave_trainer_overlong_masked_samples_total")
        assert masked == (2 if mode == "mask" else 0)
        trainer.close()
    assert records["off"]["grad_norm"] == 0.0 and records["penalty"]["grad_norm"] > 0
    truncated_tokens = sum(int(s.loss_mask.sum()) for i, s in enumerate(
        s for g in _with_truncation() for s in g.samples) if i in (0, 5))
    assert records["mask"]["loss_tokens"] == records["off"]["loss_tokens"] - truncated_tokens
    assert records["off"]["reward_mean"] == records["penalty"]["reward_mean"] == 1.0  # outcome, before shaping
