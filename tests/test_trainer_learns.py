"""A tiny model trained by the real trainer on a toy reward moves the right way in a few steps.

Toy task: reward = fraction of generated tokens with an even id. The model samples its own groups
(temperature 1, behaviour logprobs recorded as an engine would); after a few GRPO steps the probability
mass it puts on even ids must have risen. The stale variant trains each step on groups sampled before
the previous update, so the off-policy correction (π_prox/π_behav ≠ 1) is in play.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from buffer.schema import Sample, TrajectoryGroup
from core.config import BufferConfig, TrainerConfig
from trainer.parallel import DistContext
from trainer.worker import Trainer

STEPS, GROUPS, SAMPLES, NEW_TOKENS = 4, 8, 8, 8


@torch.no_grad()
def _sample(model: torch.nn.Module, prompts: list[list[int]], gen: torch.Generator, version: int, tag: str):
    groups = []
    for gi, prompt in enumerate(prompts):
        ids = torch.tensor(prompt).repeat(SAMPLES, 1)
        picked = []
        for _ in range(NEW_TOKENS):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=gen)
            picked.append(logp.gather(1, token))
            ids = torch.cat([ids, token], dim=1)
        behaviour = torch.cat(picked, dim=1).numpy()
        n = len(prompt)
        mask = np.r_[np.zeros(n), np.ones(NEW_TOKENS)]
        samples = [
            Sample(
                sample_index=i,
                token_ids=ids[i].numpy(),
                prompt_len=n,
                loss_mask=mask,
                behaviour_logprobs=np.r_[np.zeros(n), behaviour[i]],
                token_versions=np.where(mask > 0, version, -1),
                reward=float((ids[i, n:] % 2 == 0).float().mean()),
            )
            for i in range(SAMPLES)
        ]
        groups.append(TrajectoryGroup(run="learn", job_id="job", task_id=f"{tag}-{gi}", samples=samples))
    return groups


@torch.no_grad()
def _toy_task(model: torch.nn.Module) -> tuple[list[list[int]], list[list[int]], torch.Generator]:
    """The toy task's training prompts, its held-out prompts and the sampling generator, all seeded."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, 6).tolist() for _ in range(GROUPS)]
    held_out = [rng.integers(3, vocab, 6).tolist() for _ in range(32)]
    return prompts, held_out, torch.Generator().manual_seed(0)


def _even_mass(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    probs = torch.softmax(model(input_ids=torch.tensor(prompts)).logits[:, -1].float(), dim=-1)
    return probs[:, 0::2].sum(dim=-1).mean().item()


@pytest.mark.parametrize(
    "loss,stale",
    [("decoupled_ppo", False), ("ppo", False), ("tis", False), ("icepop", False)]
    + [("decoupled_ppo", True), ("tis", True), ("icepop", True)],
)
def test_grpo_raises_rewarded_token_mass(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, loss: str, stale: bool
) -> None:
    cfg = TrainerConfig(total_steps=STEPS, lr=1e-2, loss=loss, device="cpu")
    buffer = BufferConfig(max_staleness=1, groups_per_step=GROUPS)
    trainer = Trainer(cfg, tiny_model_dir, tmp_path, buffer).start(ctx=ctx)
    prompts, held_out, gen = _toy_task(trainer.model)
    before = _even_mass(trainer.model, held_out)
    queued = _sample(trainer.model, prompts, gen, trainer.version, "v0") if stale else None
    records = []
    for step in range(STEPS):
        fresh = _sample(trainer.model, prompts, gen, trainer.version, f"s{step}")
        batch, queued = (queued, fresh) if stale else (fresh, None)
        records.append(trainer.train(batch))
    after = _even_mass(trainer.model, held_out)
    trainer.close()
    assert after > before + 0.03, (before, after)  # from 0.50 to 0.56-0.60
    last = records[-1]
    if stale:  # one version behind from the second step on: the IS weight is really away from 1
        assert last["staleness_hist"] == {"1": GROUPS * SAMPLES}
        assert last["logprob_gap"] > 1e-2 and last["is_ratio_max"] > 2.0
        if loss in ("tis", "icepop"):  # the ratio to π_behav starts away from 1, so the clip bites
            assert last["clip_fraction"] > 0
        assert (last["masked_fraction"] > 0) == (loss == "icepop")
    else:
        assert last["staleness_hist"] == {"0": GROUPS * SAMPLES}
        assert last["logprob_gap"] < 1e-4  # the sampler's logprobs are the trainer's own


def test_ppo_with_a_critic_raises_rewarded_token_mass(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """trainer.advantage=gae: the same toy task with the critic's values as the baseline; the critic learns too."""
    cfg = TrainerConfig(total_steps=STEPS, lr=1e-2, advantage="gae", critic={"lr": 1e-3}, device="cpu")
    trainer = Trainer(cfg, tiny_model_dir, tmp_path, BufferConfig(groups_per_step=GROUPS)).start(ctx=ctx)
    prompts, held_out, gen = _toy_task(trainer.model)
    before = _even_mass(trainer.model, held_out)
    records = [trainer.train(_sample(trainer.model, prompts, gen, trainer.version, f"s{step}"))
               for step in range(STEPS)]
    after = _even_mass(trainer.model, held_out)
    trainer.close()
    assert after > before + 0.03, (before, after)
    losses = [r["value_loss"] for r in records]
    assert losses[-1] < losses[0] / 2, losses
