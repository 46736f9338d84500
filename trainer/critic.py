"""The critic of ``trainer.advantage=gae``: a value model, its optimizer, and its part of a train step.

The value model is the policy's architecture with a scalar head (``AutoModelForTokenClassification``,
``num_labels=1``, as verl's critic), started from ``trainer.critic.path`` or from the policy's weights; a head
the checkpoint lacks starts at zero (V ≡ 0, the same on every rank). It is sharded with FSDP2 in the same pool
as the policy and trained with its own AdamW (``trainer.critic.lr``, constant) on the clipped value loss
(``losses.value_loss``), over the same minibatches and micro-batches as the policy, with the same stop points (a
``stop_point`` before each update and every few micro-batches of a pass, ``stopping``): a pool asked to stop during a
long critic pass waited for its end, then the step's push and checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification

from core.config import ConfigError, TrainerConfig
from trainer import losses
from trainer.batching import Batch, MicroBatch
from trainer.optim import apply_gradients, param_groups, step_grad_norm
from trainer.parallel import DistContext, from_pretrained, shard_model, stop_point, stopping


def load_critic(path: Path | str, ctx: DistContext) -> nn.Module:
    """The value model from the HF directory ``path``, in fp32 and sharded like the policy (dropout off)."""
    model, missing = from_pretrained(AutoModelForTokenClassification, path, "trainer.critic.path", own_head=True,
                                     num_labels=1)
    if body := sorted(name for name in missing if name.startswith(f"{model.base_model_prefix}.")):
        raise ConfigError(f"trainer.critic.path: {path}: its weights lack {body[0]}, which its config.json's model "
                          "has: it would train from random numbers there (the value head alone starts at zero)")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in missing:
                param.zero_()
    model.to(ctx.device)
    model.eval()
    return shard_model(model, ctx)


def build_critic_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW with the policy's betas and decay groups (``trainer.weight_decay`` on matrices alone)."""
    return torch.optim.AdamW(param_groups(model.parameters(), cfg.weight_decay), lr=cfg.critic.lr, betas=cfg.betas)


def explained_variance(values: Tensor, returns: Tensor, loss_mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens: 1 is a perfect critic, 0 no better than a constant."""
    mask = loss_mask.bool()
    v, r = values[mask].double(), returns[mask].double()
    var = r.var(unbiased=False)
    return float(1.0 - (r - v).var(unbiased=False) / var) if v.numel() > 1 and var > 0 else 0.0


class CriticStep:
    """Values before the step, then the critic's updates; every rank calls both with the same batch."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainerConfig,
                 ctx: DistContext) -> None:
        self.model, self.optimizer, self.cfg, self.ctx = model, optimizer, cfg, ctx

    def _values(self, mb: Batch) -> Tensor:
        """V(s_t) [b, l-1] fp32, aligned to the predicted token like ``loss_mask``: the state after token t."""
        return self.model(input_ids=mb.input_ids).logits[:, :-1, 0].float()

    @torch.no_grad()
    def values(self, batch: Batch, plans: list[list[MicroBatch]]) -> Tensor:
        """V_old [B, L-1] of every row, on the CPU of every rank: each rank computes its rows over the very
        micro-batches of the update (``plans``: this rank's, per minibatch), then a sum over ranks fills in the
        others'."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=self.ctx.device)
        for _, (rows, mb, _) in stopping((m for plan in plans for m in plan), self.ctx.device):
            v = self._values(mb)
            if rows:
                out[rows, : v.shape[1]] = v
        if self.ctx.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu()

    def update(self, batch: Batch, old_values: Tensor, returns: Tensor, rows: list[int],
               plan: list[MicroBatch]) -> tuple[float, Tensor]:
        """One optimizer step on the value loss of the minibatch ``rows`` over this rank's micro-batches of it
        (``plan``): (gradient norm, [loss sum, clipped tokens, tokens])."""
        cfg = self.cfg
        denom = losses.agg_denominator(batch.loss_mask[rows], cfg.loss_agg)
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for i, (mb_rows, mb, _) in stopping(plan, self.ctx.device):
            self.model.set_requires_gradient_sync(i == len(plan) - 1)
            v = self._values(mb)
            if not mb_rows:
                (v.sum() * 0.0).backward()
                continue
            width = v.shape[1]
            old = old_values[mb_rows, :width].to(self.ctx.device)
            ret = returns[mb_rows, :width].to(self.ctx.device)
            loss, metrics = losses.value_loss(v, old, ret, mb.loss_mask, value_clip=cfg.critic.value_clip,
                                              loss_agg=cfg.loss_agg, denominator=denom)
            (loss * self.ctx.world_size).backward()  # FSDP averages gradients over ranks; we want the sum
            tokens = float(mb.loss_mask.sum())
            sums += torch.stack([loss.detach().double(), metrics["value_clip_fraction"].double() * tokens,
                                 torch.tensor(tokens, dtype=torch.float64, device=self.ctx.device)])
        return apply_gradients(self.model, self.optimizer, cfg.grad_clip, "critic"), sums

    def train(
        self, batch: Batch, old_values: Tensor, returns: Tensor, minibatches: list[list[int]],
        plans: list[list[MicroBatch]]
    ) -> dict[str, float]:
        """The critic's updates of one step (one per minibatch, over this rank's ``plans`` of it) and their
        figures (reduced over ranks), the updates skipped for a non-finite gradient norm among them."""
        results = []
        for rows, plan in zip(minibatches, plans, strict=True):
            stop_point(self.ctx.device)  # before each update: none half-applied, all ranks at the same one
            results.append(self.update(batch, old_values, returns, rows, plan))
        sums = torch.stack([s for _, s in results]).sum(dim=0)
        if self.ctx.world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        loss, clipped, tokens = sums.tolist()
        mask = batch.loss_mask
        return {
            "value_loss": loss / len(minibatches),
            "value_clip_fraction": clipped / max(tokens, 1.0),
            "explained_variance": explained_variance(old_values, returns, mask),
            "value_mean": float(old_values[mask].mean()) if mask.any() else 0.0,
            "return_mean": float(returns[mask].mean()) if mask.any() else 0.0,
            "critic_grad_norm": step_grad_norm([n for n, _ in results]),
            "critic_skipped_updates": sum(not math.isfinite(n) for n, _ in results),
        }
