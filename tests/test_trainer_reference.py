"""The train step against a full-batch reference written out by hand: one plain (unsharded) model, one forward of
each minibatch's rows, the loss summed token by token, plain SGD. The step itself splits the rows into token-budget
micro-batches (uneven, some with no trained token), shards them over 1 or 2 gloo ranks and accumulates; at
non-default settings (every aggregation, several minibatches, an asymmetric clip that acts, a low IS cap, the k1 KL,
an entropy bonus, a grad clip that bites) its update must be the reference's.

The step runs with SGD rather than AdamW: AdamW's first update is about lr·sign(g), blind to how the gradient is
scaled, so a loss normalised by the wrong count would pass."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from rank_helpers import spawn_ranks
from torch.optim.lr_scheduler import LambdaLR
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM

from buffer.schema import TrajectoryGroup
from core.config import TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed, iter_full_params
from trainer.step import TrainStep
from trainer.worker import Trainer

CFG = {
    "device": "cpu",
    "total_steps": 2,
    "lr": 0.5,  # SGD's; large enough that the second minibatch's ratios leave the clip range
    "micro_batch_tokens": 64,
    "clip_eps": 0.02,
    "clip_eps_high": 0.05,
    "is_cap": 1.1,
    "kl_coef": 0.1,
    "kl_estimator": "k1",  # its gradient is not 0 where π_θ = π_ref, unlike k3's
    "entropy_coef": 0.01,
    "grad_clip": 0.5,
}


def _groups() -> list[TrajectoryGroup]:
    """Four groups; the first group's samples train on nothing. Over 2 ranks and 2 minibatches (micro-batches of
    64 tokens) one rank's whole share of the first minibatch then has no trained token, and the other runs a dummy
    micro-batch to match the first's count."""
    groups = synthetic_groups(1, 4)
    for s in groups[0].samples:
        s.loss_mask[:] = 0
    return groups


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    if mode == "token-mean":
        return sum(per_token[i][mask[i]].sum() for i in rows) / mask.sum()
    if mode == "seq-mean-token-sum":
        return sum(per_token[i][mask[i]].sum() for i in rows) / len(rows)
    return sum(per_token[i][mask[i]].mean() for i in rows) / len(rows)


def _logprobs_entropy(model: torch.nn.Module, ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's logprobs of its tokens 1.. and the entropy at each position, from a forward of that row alone."""
    logits = model(input_ids=ids[None, :length]).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, ids[1:length, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _reference(model_dir: Path, groups: list[TrajectoryGroup], cfg: TrainerConfig) -> tuple[dict, list, list]:
    """(parameters after the step, loss and gradient norm of each update) by hand: GRPO advantages, π_prox the
    weights at the start of the step, decoupled PPO per token, contiguous near-equal minibatches."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = [(gi, s) for gi, g in enumerate(groups) for s in g.samples]
    adv = []
    for gi, s in samples:
        rewards = torch.tensor([t.reward for t in groups[gi].samples], dtype=torch.float64)
        std = rewards.std()  # unbiased, as GRPO's
        adv.append(0.0 if rewards.max() == rewards.min() else float((s.reward - rewards.mean()) / (std + 1e-6)))
    rows = [(torch.as_tensor(s.token_ids), torch.as_tensor(s.loss_mask[1:]).bool(),
             torch.as_tensor(s.behaviour_logprobs[1:]).double()) for _, s in samples]
    with torch.no_grad():
        prox = [_logprobs_entropy(model, ids, len(ids))[0] for ids, _, _ in rows]
        ref_logp = [_logprobs_entropy(ref, ids, len(ids))[0] for ids, _, _ in rows]
    n, parts = len(rows), cfg.ppo_minibatches
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    losses, norms = [], []
    for k in range(parts):
        picked = range(bounds[k], bounds[k + 1])
        width = max(len(rows[i][0]) - 1 for i in picked)
        per_token = torch.zeros(len(picked), width, dtype=torch.float64)
        mask = torch.zeros(len(picked), width, dtype=torch.bool)
        for j, i in enumerate(picked):
            ids, m, behav = rows[i]
            logp, entropy = _logprobs_entropy(model, ids, len(ids))
            u = torch.exp(logp - prox[i])
            w = torch.exp(prox[i] - behav).clamp(max=cfg.is_cap)
            a = adv[i]
            surrogate = torch.minimum(u * a, u.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high) * a)
            value = -w * surrogate + cfg.kl_coef * (logp - ref_logp[i]) - cfg.entropy_coef * entropy
            per_token[j, : len(ids) - 1] = value
            mask[j, : len(ids) - 1] = m
        loss = _aggregate(per_token, mask, cfg.loss_agg)
        model.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads)))
        scale = min(1.0, cfg.grad_clip / (norm + 1e-6))
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.lr * scale * p.grad
        losses.append(loss.item())
        norms.append(norm)
    return {name: p.detach() for name, p in model.named_parameters()}, losses, norms


def _sgd_step(trainer: Trainer, cfg: TrainerConfig, ctx: DistContext, groups: list[TrajectoryGroup]) -> tuple:
    """The trainer's model, reference model and config in a TrainStep with SGD at ``cfg.lr``; (record, params)."""
    sgd = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=cfg.lr)
    step = TrainStep(trainer.model, sgd, LambdaLR(sgd, lambda _: 1.0), cfg, ctx,
                     ref_model=trainer.train_step.ref_model)
    record = step(groups, policy_version=0)
    return record, {name: t.clone() for name, t in iter_full_params(trainer.model) if t is not None}


def _check(record: dict, params: dict, want: tuple[dict, list, list]) -> None:
    want_params, want_losses, want_norms = want
    assert record["loss"] == pytest.approx(sum(want_losses) / len(want_losses), rel=1e-4, abs=1e-6)
    assert record["grad_norm"] == pytest.approx(max(want_norms), rel=1e-4)
    assert max(want_norms) > CFG["grad_clip"]  # the clip bites
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_one_rank_micro_batches_match_the_full_batch(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path,
                                                     loss_agg: str, minibatches: int) -> None:
    cfg = TrainerConfig(**CFG, loss_agg=loss_agg, ppo_minibatches=minibatches)
    groups = _groups()
    trainer = Trainer(cfg, tiny_model_dir, tmp_path).start(ctx=ctx)
    record, params = _sgd_step(trainer, cfg, ctx, groups)
    trainer.close()
    _check(record, params, _reference(tiny_model_dir, groups, cfg))
    if minibatches > 1:
        assert record["clip_fraction"] > 0  # the asymmetric clip acts on the second minibatch


def _rank(rank: int, world: int, port: int, model_dir: Path, run_dir: Path, out: Path, cfg: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    try:
        trainer_cfg = TrainerConfig(**cfg)
        trainer = Trainer(trainer_cfg, model_dir, run_dir).start(ctx=ctx)
        record, params = _sgd_step(trainer, trainer_cfg, ctx, _groups())
        trainer.close()
        if rank == 0:
            torch.save({"record": record, "params": params}, out)
    finally:
        close_distributed()
    exit_rank()


def test_two_ranks_and_two_minibatches_match_the_full_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each minibatch sharded over 2 ranks on its own, per-sequence aggregation: every rank must divide by the
    minibatch's count of sequences, not its own (seq-mean-token-mean over 2 ranks is the 1-rank run's:
    tests/test_trainer_fsdp.py)."""
    cfg = {**CFG, "loss_agg": "seq-mean-token-sum", "ppo_minibatches": 2}
    out = tmp_path / "rank0.pt"
    spawn_ranks(_rank, args=(2, free_port_outside_ephemeral(), tiny_model_dir, tmp_path / "run", out, cfg), nprocs=2,
             join=True)
    got = torch.load(out, weights_only=False)
    _check(got["record"], got["params"], _reference(tiny_model_dir, _groups(), TrainerConfig(**cfg)))
