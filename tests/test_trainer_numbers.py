"""A step's numbers against a reference computed by hand from the documented definitions, in one process on the plain
HF model: the parameter update and the reported figures of 1, 2 and 3 FSDP2 ranks (3 with uneven rows per rank),
several minibatches, token-budget micro-batches, each loss aggregation, grad clipping at the global norm, the warmup
schedule and the weight decay groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_helpers import spawn_ranks
from test_trainer_fsdp import train_ranks
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from buffer.schema import TrajectoryGroup
from core.config import LoraConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.advantages import compute_advantages, gae, whiten
from trainer.batching import collate
from trainer.lora import add_adapter

STEPS = 2
CFG = {
    "total_steps": 4,
    "checkpoint_every": 100,
    "lr": 2e-3,
    "warmup_steps": 2,
    "weight_decay": 0.1,
    "grad_clip": 0.5,
    "ppo_minibatches": 2,
    "micro_batch_tokens": 48,
    "is_cap": 1.05,
    "clip_eps": 0.02,
    "kl_coef": 0.1,
    "kl_estimator": "k3",
    "entropy_coef": 0.01,
    "device": "cpu",
}
FIGURES = ("loss", "pg_loss", "clip_fraction", "is_ratio_mean", "is_ratio_max", "kl", "entropy", "grad_norm", "lr")


def _batches() -> list[list[TrajectoryGroup]]:
    """Two groups of 5 per step (5 rows in each of 2 minibatches, uneven over 3 ranks), the second sampled at a
    temperature of 0.7 (the first records none: the trainer's 1.0)."""
    steps = [synthetic_groups(seed, 2, group_size=5) for seed in range(STEPS)]
    for groups in steps:
        groups[1].temperature = 0.7
    return steps


def _agg(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The documented aggregation of ``values`` [b, t] over ``mask`` of the whole minibatch."""
    m = mask.double()
    v = values.double() * m
    rows = float((m.sum(dim=1) > 0).sum())
    if mode == "token-mean":
        return v.sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return v.sum() / rows
    return (v.sum(dim=1) / m.sum(dim=1).clamp(min=1)).sum() / rows


def _logits(model: torch.nn.Module, ids: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits[:, :-1].double() / temperature[:, None, None].double()


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _adamw(params: list[torch.nn.Parameter], cfg: TrainerConfig, lr: float) -> torch.optim.AdamW:
    """AdamW with the documented decay groups: matrices at ``weight_decay``, 1-D parameters at 0."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=cfg.betas)


def _clipped_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Scale the gradients to at most ``max_norm`` in global norm, step, zero them; the norm before the clip."""
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _critic_model(model_dir: Path) -> torch.nn.Module:
    critic = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32, num_labels=1).eval()
    with torch.no_grad():
        critic.score.weight.zero_()
    return critic


def _reference(model_dir: Path, cfg: TrainerConfig, lora: LoraConfig | None = None
               ) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every step of ``_batches`` by hand on one plain model: π_prox before the first update, one AdamW update per
    minibatch (contiguous, near-equal rows) on decoupled PPO + KL - entropy over the minibatch's own denominator,
    the gradient clipped at its global norm; under ``gae`` the advantages from the critic's values before the step,
    and one critic update per minibatch on the clipped value loss. The figures as the step documents them (token
    means over the step, losses the mean over updates, gradient norms the largest)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if lora is not None:
        model = add_adapter(model, lora)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _adamw(params, cfg, cfg.lr)
    critic = _critic_model(model_dir) if cfg.advantage == "gae" else None
    critic_opt = None if critic is None else _adamw(list(critic.parameters()), cfg, cfg.critic.lr)
    records = []
    for step, step_groups in enumerate(_batches()):
        batch = collate(step_groups, vocab_size=ref.config.vocab_size)
        ids, mask, behav, temp = batch.input_ids, batch.loss_mask, batch.behaviour_logprobs.double(), batch.temperatures
        n, parts = len(batch), cfg.ppo_minibatches
        minibatches = [[*range(round(i * n / parts), round((i + 1) * n / parts))] for i in range(parts)]
        record: dict[str, float] = {}
        if critic is None:
            adv = compute_advantages(batch.rewards, batch.group_index, mask).double()
        else:
            with torch.no_grad():
                old_values = critic(input_ids=ids).logits[:, :-1, 0]
            adv, returns = gae(batch.rewards, old_values, mask, cfg.critic.gamma, cfg.critic.lam)
            adv = whiten(adv, mask).double()
            sums = {"loss": 0.0, "clip": 0.0}
            norms = []
            for rows in minibatches:
                v, old, ret = critic(input_ids=ids[rows]).logits[:, :-1, 0], old_values[rows], returns[rows]
                clipped = old + (v - old).clamp(-cfg.critic.value_clip, cfg.critic.value_clip)
                loss = 0.5 * _agg(torch.maximum((v - ret) ** 2, (clipped - ret) ** 2), mask[rows], cfg.loss_agg)
                loss.backward()
                norms.append(_clipped_step(list(critic.parameters()), critic_opt, cfg.grad_clip))
                with torch.no_grad():
                    sums["loss"] += float(loss)
                    sums["clip"] += float(((clipped - ret) ** 2 > (v - ret) ** 2)[mask[rows]].sum())
            v, r = old_values[mask].double(), returns[mask].double()
            record.update(value_loss=sums["loss"] / parts, value_clip_fraction=sums["clip"] / float(mask.sum()),
                          critic_grad_norm=max(norms), value_mean=float(v.mean()), return_mean=float(r.mean()),
                          explained_variance=float(1 - (r - v).var(unbiased=False) / r.var(unbiased=False)))
        if critic is not None and step < cfg.critic.warmup_steps:
            records.append(record)
            continue
        policy_step = step - (cfg.critic.warmup_steps if critic is not None else 0)
        lr = cfg.lr * (policy_step + 1) / cfg.warmup_steps
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            prox = _logprobs(_logits(model, ids, temp), ids)
            ref_logp = _logprobs(_logits(ref, ids, temp), ids)
        sums = dict.fromkeys(("loss", "pg_loss", "clip", "w", "kl", "entropy"), 0.0)
        w_max, norms = 0.0, []
        for rows in minibatches:
            logits = _logits(model, ids[rows], temp[rows])
            logp = _logprobs(logits, ids[rows])
            m, a = mask[rows], adv[rows]
            u = torch.exp(logp - prox[rows])
            w_full = torch.exp(prox[rows] - behav[rows]) * m
            w = w_full.clamp(max=cfg.is_cap)
            clipped_branch = u.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a
            pg = _agg(-w * torch.minimum(u * a, clipped_branch), m, cfg.loss_agg)
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            delta = ref_logp[rows] - logp
            kl = torch.exp(delta) - delta - 1
            total = pg + cfg.kl_coef * _agg(kl, m, cfg.loss_agg) - cfg.entropy_coef * _agg(entropy, m, cfg.loss_agg)
            total.backward()
            norms.append(_clipped_step(params, optimizer, cfg.grad_clip))
            with torch.no_grad():
                on = m.bool()
                sums["loss"] += float(total)
                sums["pg_loss"] += float(pg)
                sums["clip"] += float((clipped_branch < u * a)[on].sum())
                sums["w"] += float(w_full[on].sum())
                sums["kl"] += float(kl[on].sum())
                sums["entropy"] += float(entropy[on].sum())
                w_max = max(w_max, float(w_full[on].max()))
        tokens = float(mask.sum())
        records.append(record | {
            "loss": sums["loss"] / parts, "pg_loss": sums["pg_loss"] / parts, "clip_fraction": sums["clip"] / tokens,
            "is_ratio_mean": sums["w"] / tokens, "is_ratio_max": w_max, "kl": sums["kl"] / tokens,
            "entropy": sums["entropy"] / tokens, "grad_norm": max(norms), "lr": lr})
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    return records, trained, {} if critic is None else {n: p.detach().clone() for n, p in critic.named_parameters()}


def _spawn(world: int, model_dir: Path, tmp_path: Path, cfg: dict, lora: dict | None = None) -> dict:
    out = tmp_path / f"world{world}.pt"
    args = (world, free_port_outside_ephemeral(), model_dir, tmp_path / f"run{world}", out, cfg, lora, _batches)
    spawn_ranks(train_ranks, args=args, nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def _assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal up to Adam's amplified summation-order noise where a gradient is ~0 (~lr/100 an update)."""
    assert set(got) == set(want)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("world", "loss_agg", "budget", "minibatches"), [
    (1, "token-mean", 48, 2), (2, "seq-mean-token-sum", 256, 1), (3, "seq-mean-token-mean", 48, 2),
    (3, "token-mean", 96, 3)])
def test_a_step_matches_the_hand_computed_reference(tiny_model_dir: Path, tmp_path: Path, world: int,
                                                    loss_agg: str, budget: int, minibatches: int) -> None:
    """10 rows a step; 3 ranks get 2, 2 and 1 rows of a minibatch of 5 (a dummy micro-batch on some); a budget of
    256 tokens keeps each group together on 2 ranks, its prompt run once (``share_prefix``); one minibatch takes
    π_prox from the update's own forward."""
    cfg = {**CFG, "loss_agg": loss_agg, "micro_batch_tokens": budget, "ppo_minibatches": minibatches}
    want, want_params, _ = _reference(tiny_model_dir, TrainerConfig(**cfg))
    got = _spawn(world, tiny_model_dir, tmp_path, cfg)
    for step, (a, b) in enumerate(zip(got["records"], want, strict=True)):
        for key in FIGURES:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (step, key)
        assert a["policy_updates"] == minibatches
    assert (want[-1]["clip_fraction"] > 0) == (minibatches > 1) and want[-1]["kl"] > 0  # the clip and KL act
    assert min(r["grad_norm"] for r in want) > CFG["grad_clip"]  # so does the gradient clip
    _assert_params(got["params"], want_params)


def test_a_critic_step_matches_the_hand_computed_reference(tiny_model_dir: Path, tmp_path: Path) -> None:
    """GAE on 3 ranks: the critic's values before the step, its clipped value loss over 2 minibatches, its warm-up
    step (which does not advance the policy's schedule), its gradient clip and decay groups."""
    critic = {"warmup_steps": 1, "value_clip": 2e-3, "lr": 1e-3, "gamma": 0.9, "lam": 0.8}
    cfg = {**CFG, "advantage": "gae", "critic": critic, "loss_agg": "seq-mean-token-sum"}
    want, want_params, want_critic = _reference(tiny_model_dir, TrainerConfig(**cfg))
    got = _spawn(3, tiny_model_dir, tmp_path, cfg)
    for step, (a, b) in enumerate(zip(got["records"], want, strict=True)):
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (step, key)
    assert [r["policy_updates"] for r in got["records"]] == [0, 2]
    assert want[-1]["value_clip_fraction"] > 0 and min(r["critic_grad_norm"] for r in want) > CFG["grad_clip"]
    _assert_params(got["params"], want_params)
    _assert_params(got["critic"], want_critic)


def test_a_lora_step_matches_the_hand_computed_reference(tiny_model_dir: Path, tmp_path: Path) -> None:
    """LoRA on 3 ranks: the adapter trains as by hand, the base weights do not move, and the policy trained is the
    base model with W + (alpha / rank)·B·A in each target, what an engine serving the pushed adapter computes."""
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    want, want_params, _ = _reference(tiny_model_dir, TrainerConfig(**CFG), LoraConfig(**lora))
    got = _spawn(3, tiny_model_dir, tmp_path, CFG, lora)
    for step, (a, b) in enumerate(zip(got["records"], want, strict=True)):
        for key in FIGURES:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (step, key)
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    for name, p in got["params"].items():
        if ".lora_" not in name:
            torch.testing.assert_close(p, base[name.removeprefix("base_model.model.").replace(".base_layer.", ".")],
                                       rtol=0, atol=0)
    _assert_params(got["params"], want_params)
    trained = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(**lora)).eval()
    assert not trained.load_state_dict(got["params"], strict=False).unexpected_keys  # lm_head is tied, named once
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for name, module in merged.named_modules():
            if name.rsplit(".", 1)[-1] in lora["target_modules"]:
                a, b = (got["params"][f"base_model.model.{name}.lora_{x}.default.weight"] for x in "AB")
                module.weight += lora["alpha"] / lora["rank"] * b @ a
        ids = collate(_batches()[0]).input_ids
        served, ours = merged(input_ids=ids).logits, trained(input_ids=ids).logits
    assert (ours - AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits).abs().max() > 1e-4
    torch.testing.assert_close(ours, served, rtol=1e-5, atol=1e-5)
