"""What the trainer makes of the rewards before the advantages: DAPO's over-long shaping and the degenerate-group
test of its dynamic sampling (Yu et al., DAPO, arXiv 2503.14476).

Over-long (``trainer.overlong``): a sample cut off by a token limit (``Sample.truncated``) either is left out of the
loss (``mask``: its loss mask is zeroed; its reward still counts in its group's baseline) or every sample's reward
gets the soft over-long punishment (``penalty``) on its generated tokens ``|y|``, with ``L_max = max_tokens`` and
``L_cache = buffer_tokens``::

    R_len(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max

times ``penalty_factor``. A truncated sample that hit ``L_max`` gets the full penalty.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from buffer.schema import TrajectoryGroup
from core.config import OverlongConfig
from trainer.batching import Batch


def overlong_penalty(generated: np.ndarray, cfg: OverlongConfig) -> np.ndarray:
    """DAPO's soft over-long punishment (≤ 0) of samples with ``generated`` tokens [n]; 0 unless mode is penalty."""
    if cfg.mode != "penalty":
        return np.zeros(len(generated))
    assert cfg.max_tokens is not None  # the config's validator
    start = cfg.max_tokens - cfg.buffer_tokens
    ramp = (start - np.asarray(generated, dtype=np.float64)) / cfg.buffer_tokens
    return cfg.penalty_factor * np.clip(ramp, -1.0, 0.0)


def shaped_rewards(group: TrajectoryGroup, cfg: OverlongConfig) -> np.ndarray:
    """The rewards [n] the advantages of ``group`` see: outcome plus over-long penalty."""
    return group.rewards + overlong_penalty(np.array([s.num_generated for s in group.samples]), cfg)


def is_degenerate(group: TrajectoryGroup, cfg: OverlongConfig) -> bool:
    """All of the group's (shaped) rewards are equal: a group-relative advantage is 0 for every sample."""
    rewards = shaped_rewards(group, cfg)
    return bool(rewards.max() == rewards.min())


def shape_batch(batch: Batch, groups: list[TrajectoryGroup], cfg: OverlongConfig) -> tuple[Batch, dict[str, Any]]:
    """``batch`` (collated from ``groups``, in order) with shaped rewards or masked truncated rows, and the
    step's figures: ``truncated`` samples, ``overlong_penalty_mean`` and ``overlong_masked`` samples."""
    samples = [s for g in groups for s in g.samples]
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    penalty = overlong_penalty(np.array([s.num_generated for s in samples]), cfg)
    stats = {"truncated": int(truncated.sum()), "overlong_penalty_mean": float(penalty.mean()),
             "overlong_masked": 0}
    if cfg.mode == "penalty":
        batch = replace(batch, rewards=batch.rewards + torch.from_numpy(penalty))
    elif cfg.mode == "mask":
        batch = replace(batch, loss_mask=batch.loss_mask & ~truncated[:, None])
        stats["overlong_masked"] = stats["truncated"]
    return batch, stats
