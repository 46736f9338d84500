"""The critic of ``trainer.advantage=gae``: GAE and the clipped value loss against plain-Python references,
then the value model in the trainer (init, warm-up, clip, learning rate, checkpoint, resume, HF export)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import synthetic_groups
from transformers import AutoModelForTokenClassification

from core.config import TrainerConfig, dump_config, load_config
from core.tiny_model import build_tiny_model
from trainer.advantages import gae, whiten
from trainer.batching import collate
from trainer.checkpoint import export_hf
from trainer.critic import explained_variance
from trainer.losses import value_loss
from trainer.parallel import DistContext, iter_full_params
from trainer.worker import Trainer, critic_unused

# Hand-built multi-turn rows, aligned like loss_mask: prompt (0), assistant turn (1), tool output (0),
# assistant turn (1), padding (0). Row 3 generated nothing (e.g. every token masked by over-long).
MASKS = [
    [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
    [0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 0],
    [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
]
REWARDS = [1.0, -0.5, 0.25, 1.0, 2.0]


def _reference_gae(rewards: list[float], values: list[list[float]], masks: list[list[int]], gamma: float,
                   lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """Textbook GAE on each row's generated tokens alone (the others removed), written back in place."""
    advs, rets = [], []
    for reward, row_values, row_mask in zip(rewards, values, masks, strict=True):
        steps = [t for t, m in enumerate(row_mask) if m]
        adv = [0.0] * len(row_mask)
        ret = [0.0] * len(row_mask)
        running = 0.0
        for k in reversed(range(len(steps))):
            last = k == len(steps) - 1
            next_value = 0.0 if last else row_values[steps[k + 1]]
            r = reward if last else 0.0
            delta = r + gamma * next_value - row_values[steps[k]]
            running = delta + gamma * lam * (0.0 if last else running)
            adv[steps[k]] = running
            ret[steps[k]] = running + row_values[steps[k]]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0), (1.0, 0.95)])
def test_gae_skips_tool_tokens_like_a_loop_over_assistant_tokens(gamma: float, lam: float) -> None:
    values = torch.randn(len(MASKS), len(MASKS[0]), generator=torch.Generator().manual_seed(3))
    adv, ret = gae(torch.tensor(REWARDS), values, torch.tensor(MASKS, dtype=torch.bool), gamma, lam)
    want_adv, want_ret = _reference_gae(REWARDS, values.tolist(), MASKS, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor(want_ret), rtol=1e-5, atol=1e-6)
    assert not adv[3].any() and not ret[3].any()


def test_gae_by_hand() -> None:
    """Two assistant tokens around a tool token: the first bootstraps from the value after the tool output."""
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    values = torch.tensor([[0.5, 9.0, 0.25]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=0.9, lam=0.5)
    last = 1.0 - 0.25  # δ = r - V
    first = (0.9 * 0.25 - 0.5) + 0.9 * 0.5 * last  # δ = γ V' - V, plus γλ A'
    torch.testing.assert_close(adv, torch.tensor([[first, 0.0, last]]))
    torch.testing.assert_close(ret, torch.tensor([[first + 0.5, 0.0, 1.0]]))


def test_whiten_over_the_masked_tokens() -> None:
    x = torch.tensor([[1.0, 100.0, 3.0], [5.0, 7.0, -50.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    out = whiten(x, mask)
    kept = torch.tensor([1.0, 3.0, 5.0, 7.0])
    want = (kept - kept.mean()) / (kept.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(out[mask], want)
    assert out[~mask].eq(0).all()


def test_value_loss_clips_around_the_old_values() -> None:
    """Token 0 moved past the clip (1.0 -> 1.5, ε 0.2) away from its return: the clipped branch is larger, the
    loss counts it and no gradient flows. Token 1 moved inside the clip. Token 2 is off the mask."""
    values = torch.tensor([[1.5, 0.9, 7.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, metrics = value_loss(values, old, returns, mask, value_clip=0.2)
    # ½·mean(max((1.5-2)², (1.2-2)²), max((0.9-0)², (0.9-0)²)) = ½·(0.64 + 0.81)/2
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert metrics["value_clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.9 / 2, 0.0]]))  # ½·2·(V-R)/n on token 1 only

    values.grad = None
    plain, metrics = value_loss(values, old, returns, mask, value_clip=None)
    assert plain.item() == pytest.approx(0.5 * (0.25 + 0.81) / 2) and metrics["value_clip_fraction"].item() == 0
    plain.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.5 / 2, 0.9 / 2, 0.0]]))


def test_a_critic_set_for_an_estimator_without_one_is_told_not_a_dumped_default(tmp_path: Path) -> None:
    """A launcher's config dump names every default, critic's included: that is no critic setting."""
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_config(load_config(None, [])))
    assert not critic_unused(load_config(dumped, []).trainer)
    assert critic_unused(load_config(dumped, ["trainer.critic.lr=3e-5"]).trainer)
    assert not critic_unused(load_config(dumped, ["trainer.critic.lr=3e-5", "trainer.advantage=gae"]).trainer)


def test_explained_variance() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    noisy = torch.tensor([[1.5, 2.0, 2.5, 0.0]])  # residuals -0.5, 0, 0.5: Var 1/6 against Var(R) = 2/3
    assert explained_variance(noisy, returns, mask) == pytest.approx(1 - (1 / 6) / (2 / 3))


GAE = {"advantage": "gae", "device": "cpu", "lr": 1e-3, "micro_batch_tokens": 128, "total_steps": 4,
       "checkpoint_every": 1, "keep_checkpoints": 1}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in iter_full_params(model) if t is not None}


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max((after[n] - before[n]).abs().max().item() for n in before)


def test_a_new_head_starts_at_zero_and_gamma_lambda_reach_the_returns(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """V ≡ 0 at first, so each token's return is (γλ)^k·r with k generated tokens after it (γ, λ from the config)."""
    cfg = TrainerConfig(**GAE, critic={"gamma": 0.5, "lam": 0.8})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path).start(ctx=ctx)
    groups = synthetic_groups(0, 2)
    batch = collate(groups)
    mask = batch.loss_mask
    later = mask.flip(1).cumsum(1).flip(1) - 1  # generated tokens after each one
    want = torch.where(mask, (0.5 * 0.8) ** later.double() * batch.rewards[:, None], 0.0)
    critic_before, policy_before = _params(trainer.critic[0]), _params(trainer.model)
    record = trainer.train(groups)
    trainer.close()
    assert record["value_mean"] == 0.0 and record["explained_variance"] == 0.0
    assert record["return_mean"] == pytest.approx(float(want[mask].mean()), rel=1e-5)
    assert record["value_loss"] == pytest.approx(0.5 * float(want[mask].square().mean()), rel=1e-5)
    assert record["policy_updates"] == 1 and _moved(policy_before, _params(trainer.model)) > 0
    assert _moved(critic_before, _params(trainer.critic[0])) > 0
    assert trainer.metrics.registry.get_sample_value("rollwave_trainer_value_loss") == record["value_loss"]


def test_warmup_steps_train_the_critic_alone(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(TrainerConfig(**GAE, critic={"warmup_steps": 2}), tiny_model_dir, tmp_path).start(ctx=ctx)
    policy, critic = _params(trainer.model), _params(trainer.critic[0])
    records = [trainer.train(synthetic_groups(seed, 2)) for seed in range(3)]
    assert [r["policy_updates"] for r in records] == [0, 0, 1]
    assert [r["lr"] for r in records] == [1e-3] * 3  # the policy's schedule starts with its first update
    assert records[1]["explained_variance"] != 0.0  # the critic learned from step 1
    trainer.close()
    assert _moved(critic, _params(trainer.critic[0])) > 0
    after_warmup = Trainer(TrainerConfig(**GAE, critic={"warmup_steps": 2}), tiny_model_dir, tmp_path / "b")
    after_warmup.start(ctx=ctx)
    for seed in range(2):
        after_warmup.train(synthetic_groups(seed, 2))
    assert _moved(policy, _params(after_warmup.model)) == 0.0  # two warm-up steps left the policy as it was
    after_warmup.close()


def test_value_clip_and_critic_lr(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """With 4 minibatches the later ones are clipped against the step's old values: at ε = 1e-4 and a high
    learning rate many tokens are; unclipped, none. The critic's own lr sets how far it moves."""
    records, moved = {}, {}
    for name, critic in {"tight": {"value_clip": 1e-4, "lr": 1e-2}, "none": {"value_clip": None, "lr": 1e-2},
                         "slow": {"lr": 1e-6}}.items():
        trainer = Trainer(TrainerConfig(**GAE, ppo_minibatches=4, critic=critic), tiny_model_dir, tmp_path / name)
        trainer.start(ctx=ctx)
        before = _params(trainer.critic[0])
        records[name] = trainer.train(synthetic_groups(0, 2))
        moved[name] = _moved(before, _params(trainer.critic[0]))
        trainer.close()
    assert records["tight"]["value_clip_fraction"] > 0.1  # of all tokens; the first minibatch is never clipped
    assert records["none"]["value_clip_fraction"] == 0.0
    assert moved["slow"] < moved["none"] / 100


def test_critic_path(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1)
    trainer = Trainer(TrainerConfig(**GAE, critic={"path": str(other)}), tiny_model_dir, tmp_path).start(ctx=ctx)
    critic = _params(trainer.critic[0])
    trainer.close()
    want = AutoModelForTokenClassification.from_pretrained(other, num_labels=1, local_files_only=True)
    for name, value in want.named_parameters():
        expected = torch.zeros_like(value) if name.startswith("score.") else value
        torch.testing.assert_close(critic[name], expected, rtol=0, atol=0)
    mine = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1, local_files_only=True)
    assert not torch.equal(critic["model.embed_tokens.weight"], mine.model.embed_tokens.weight)


def test_a_critic_path_with_a_classifier_head_gets_a_value_head_at_zero(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``trainer.critic.path`` whose head has another number of outputs (a two-label classifier) is a body to start
    from, with a value head at zero: it was refused as weights that do not fit their own config.json."""
    classifier = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=2, local_files_only=True)
    classifier.save_pretrained(tmp_path / "classifier")
    trainer = Trainer(TrainerConfig(**GAE, critic={"path": str(tmp_path / "classifier")}), tiny_model_dir,
                      tmp_path / "run").start(ctx=ctx)
    critic = _params(trainer.critic[0])
    trainer.close()
    assert not critic["score.weight"].any() and critic["score.weight"].shape[0] == 1
    torch.testing.assert_close(critic["model.embed_tokens.weight"], classifier.model.embed_tokens.weight, rtol=0,
                               atol=0)
    assert "trainer.critic.path" in caplog.text and "its weights' score.weight has shape [2, " in caplog.text


def test_checkpoint_resume_and_export_carry_the_critic(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    straight = Trainer(TrainerConfig(**GAE), tiny_model_dir, tmp_path / "straight").start(ctx=ctx)
    want = [straight.train(synthetic_groups(seed, 2)) for seed in range(3)]
    straight.close()
    first = Trainer(TrainerConfig(**GAE), tiny_model_dir, tmp_path / "run").start(ctx=ctx)
    for seed in range(2):
        first.train(synthetic_groups(seed, 2))
    saved = _params(first.critic[0])
    first.close()
    resumed = Trainer(TrainerConfig(**GAE), tiny_model_dir, tmp_path / "run").start(resume=True, ctx=ctx)
    assert resumed.step == 2
    for name, value in _params(resumed.critic[0]).items():
        assert torch.equal(value, saved[name]), name
    again = resumed.train(synthetic_groups(2, 2))  # the critic's optimizer state came back too: same step 3
    for key in ("value_loss", "explained_variance", "critic_grad_norm", "loss", "grad_norm"):
        assert again[key] == want[2][key], key
    final = _params(resumed.critic[0])
    resumed.close()

    out = export_hf(resumed.checkpointer.latest(), tiny_model_dir, tmp_path / "hf")
    exported = AutoModelForTokenClassification.from_pretrained(out / "critic", local_files_only=True)
    assert exported.config.num_labels == 1
    for name, value in exported.named_parameters():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0)

    plain = Trainer(TrainerConfig(**{**GAE, "advantage": "grpo"}), tiny_model_dir, tmp_path / "grpo").start(ctx=ctx)
    plain.train(synthetic_groups(0, 2))
    plain.close()
    with pytest.raises(ValueError, match="has no critic"):
        Trainer(TrainerConfig(**GAE), tiny_model_dir, tmp_path / "grpo").start(resume=True, ctx=ctx)


def test_critic_settings_without_gae_are_reported_ignored(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = TrainerConfig(**{**GAE, "advantage": "rloo"}, critic={"lr": 1e-2})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path).start(ctx=ctx)
    trainer.close()
    assert trainer.critic is None
    assert "trainer.critic is set but trainer.advantage is rloo" in caplog.text


def test_held_bytes_counts_the_critic_and_its_optimizer(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A step's ``held_bytes`` is what the trainer keeps between steps, the memory colocated engines must leave it:
    with gae the critic's weights and AdamW state as well as the policy's (they were left out: about half)."""
    trainer = Trainer(TrainerConfig(**GAE), tiny_model_dir, tmp_path).start(ctx=ctx)
    record = trainer.train(synthetic_groups(0, 2))
    trainer.close()
    models, optimizers = (trainer.model, trainer.critic[0]), (trainer.optimizer, trainer.critic[1])
    tensors = [p for m in models for p in m.parameters()]
    tensors += [t for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert len(trainer.critic[1].state) > 0
    assert record["held_bytes"] == sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)
