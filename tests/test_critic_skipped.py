"""A critic update skipped for a non-finite gradient norm is counted, as a skipped policy update is."""

from __future__ import annotations

import math
from pathlib import Path

from trainer_helpers import synthetic_groups

from core.config import TrainerConfig
from trainer.parallel import DistContext
from trainer.worker import Trainer


def test_a_skipped_critic_update_is_counted_apart_from_the_policy_s(ctx: DistContext, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    """A reward of 1e30 in the second group (finite: the collator refuses NaN) makes the critic's squared error, so
    its second minibatch's gradient norm, infinite: that update is skipped (the critic trains alone during warm-up),
    and counted in the critic's counter, not the policy's."""
    groups = synthetic_groups(0, 2)
    groups[1].samples[0].reward = 1e30
    cfg = TrainerConfig(advantage="gae", device="cpu", lr=1e-3, micro_batch_tokens=128, kl_coef=0.0,
                        ppo_minibatches=2, critic={"warmup_steps": 1})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path).start(ctx=ctx)
    try:
        record = trainer.train(groups)
    finally:
        trainer.close()
    assert record["policy_updates"] == 0 and record["critic_grad_norm"] == math.inf
    assert (record["skipped_updates"], record["critic_skipped_updates"]) == (0, 1)
    sample = trainer.metrics.registry.get_sample_value
    assert sample("rollwave_trainer_critic_skipped_updates_total") == 1
    assert sample("rollwave_trainer_skipped_updates_total") == 0
