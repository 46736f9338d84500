"""The train step: one batch of trajectory groups -> one policy update (or ``ppo_minibatches`` of them).

Every rank calls it with the same groups. The step collates them, shapes the rewards (``trainer.overlong``),
computes advantages over the whole batch (group-relative, or GAE on the critic's values), shards rows across
ranks and runs token-budget micro-batches with gradient accumulation. With a critic it then trains the critic
on the same minibatches; during ``trainer.critic.warmup_steps`` only the critic trains.

Proximal logprobs (π_prox = the weights at the start of the step): with one optimizer update per step
(``ppo_minibatches=1``, the default) every micro-batch's forward runs with exactly those weights, so
π_prox is that forward's own logprobs with the gradient stopped, bit for bit what a separate no-grad
pass would give (tests/test_trainer_fsdp.py checks it); with several updates the step first recomputes
them in a no-grad pass, since later minibatches see updated weights. So does a single update with LoRA
dropout (``model.lora.dropout > 0``): the training forward drops adapter inputs, the served policy does not.

A pool asked to stop (a SIGTERM's ``request_stop``) stops inside the step, every rank at the same ``stop_point``:
before each optimizer update and every ``STOP_EVERY_MICRO_BATCHES`` micro-batches of a pass (``stopping``), the
critic's (``CriticStep``) as the policy's. A big model's step outlasts a supervisor's grace (Kubernetes' 30 s by
default), and a pool that stopped only before its next buffer read was killed mid-step, its end unrecorded and its
lease left to lapse. A step stopped so leaves its groups unacked (a checkpoint covers them first) and is neither
pushed nor checkpointed; the next trainer trains it again.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from buffer.schema import TrajectoryGroup
from core.config import TrainerConfig
from core.transformers_compat import CACHE_ARG
from trainer import losses
from trainer.advantages import compute_advantages, gae, whiten
from trainer.batching import Batch, Layout, MicroBatch, collate, plan_step
from trainer.critic import CriticStep
from trainer.lora import has_dropout
from trainer.optim import apply_gradients, step_grad_norm
from trainer.parallel import DistContext, stop_point, stopping
from trainer.shaping import shape_batch

log = logging.getLogger(__name__)

_MEAN_KEYS = ("is_ratio_mean", "clip_fraction", "masked_fraction", "logprob_gap", "entropy", "kl")
_SUM_KEYS = ("loss", "pg_loss")
_RANK_KEYS = ("rank_compute_s", "rank_peak_memory_bytes")  # each rank's own figures, a list in rank order


class _Accumulator:
    """Step statistics over micro-batches and ranks: token-weighted means, sums and a max."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums = torch.zeros(len(_MEAN_KEYS) + len(_SUM_KEYS) + 1, dtype=torch.float64, device=device)
        self.max = torch.zeros(1, dtype=torch.float64, device=device)

    def add(self, tokens: int, means: dict[str, Tensor], sums: dict[str, Tensor], is_max: Tensor) -> None:
        values = [means[k].double() * tokens for k in _MEAN_KEYS] + [sums[k].double() for k in _SUM_KEYS]
        count = torch.tensor(float(tokens), dtype=torch.float64, device=self.device)
        self.sums += torch.stack([*values, count])
        self.max = torch.maximum(self.max, is_max.double().reshape(1))

    def reduce(self, updates: int, own: dict[str, float]) -> dict[str, Any]:
        """The step's figures over every rank, and each rank's ``own`` ones (``_RANK_KEYS``) as lists in rank
        order: they ride in the sums' all-reduce (each rank fills its own row, zeros elsewhere), so that rank 0
        can serve every rank's without a collective of their own."""
        several = dist.is_initialized() and dist.get_world_size() > 1
        world, rank = (dist.get_world_size(), dist.get_rank()) if several else (1, 0)
        ranks = torch.zeros(world, len(_RANK_KEYS), dtype=torch.float64, device=self.device)
        ranks[rank] = torch.tensor([own[k] for k in _RANK_KEYS], dtype=torch.float64, device=self.device)
        sums = torch.cat([self.sums, ranks.flatten()])
        if several:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(self.max, op=dist.ReduceOp.MAX)
        values = sums.tolist()
        tokens = max(values[len(self.sums) - 1], 1.0)
        out: dict[str, Any] = {k: values[i] / tokens for i, k in enumerate(_MEAN_KEYS)}
        out.update({k: values[len(_MEAN_KEYS) + i] / updates for i, k in enumerate(_SUM_KEYS)})
        out["is_ratio_max"] = float(self.max.item())
        per_rank = values[len(self.sums):]
        out.update({k: per_rank[i::len(_RANK_KEYS)] for i, k in enumerate(_RANK_KEYS)})
        return out


def _peak_memory_bytes(device: torch.device) -> float:
    """This rank's peak memory: on CUDA the most torch allocated since the step reset the count, on the CPU the
    process's peak resident set since it started (``VmHWM``: the CPU keeps no count a step could reset;
    ``getrusage``'s ``ru_maxrss`` carries the peak of whatever process started this one, through fork and exec)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    status = Path("/proc/self/status").read_text()
    return float(re.search(r"^VmHWM:\s+(\d+) kB$", status, re.M).group(1)) * 1024


def batch_stats(groups: list[TrajectoryGroup], batch: Batch, policy_version: int) -> dict[str, Any]:
    """Reward, size and staleness figures of a batch (identical on every rank, no collectives).

    A sample's staleness is ``policy_version`` minus the oldest version among its generated tokens. The reward
    figures are the outcome rewards, before any shaping.
    """
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    lags = [policy_version - v for g in groups for s in g.samples if (v := s.oldest_version()) is not None]
    hist = Counter(lags)
    return {
        "groups": len(groups),
        "samples": len(batch),
        "tokens": int(batch.lengths.sum()),
        "loss_tokens": int(batch.loss_mask.sum()),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness_max": max(lags, default=0),
    }


class TrainStep:
    """Owns nothing but references: the FSDP model, optimizer and scheduler belong to the Trainer."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        cfg: TrainerConfig,
        ctx: DistContext,
        *,
        temperature: float = 1.0,
        ref_model: nn.Module | None = None,
        pad_id: int = 0,
        critic: tuple[nn.Module, torch.optim.Optimizer] | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature: {temperature} must be > 0 (greedy decoding has no logprobs)")
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("trainer.kl_coef > 0 needs a reference model")
        if (cfg.advantage == "gae") != (critic is not None):
            raise ValueError("trainer.advantage=gae needs a critic, and only gae uses one")
        self.critic = None if critic is None else CriticStep(*critic, cfg, ctx)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cfg, self.ctx = cfg, ctx
        self.temperature, self.ref_model, self.pad_id = temperature, ref_model, pad_id
        self.recompute_prox = cfg.ppo_minibatches > 1 or has_dropout(model)  # else π_prox is the update's forward
        self.vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
        self.loss_fn = losses.POLICY_LOSSES[cfg.loss]
        self.loss_kwargs: dict[str, Any] = {"clip_eps": cfg.clip_eps, "clip_eps_high": cfg.clip_eps_high}
        if cfg.loss in ("decoupled_ppo", "tis"):
            self.loss_kwargs.update(is_cap=cfg.is_cap, is_cap_mode=cfg.is_cap_mode)
        if cfg.loss == "icepop":
            self.loss_kwargs.update(is_low=cfg.is_low, is_high=cfg.is_high)

    def __call__(self, groups: list[TrajectoryGroup], policy_version: int, step: int = 0) -> dict[str, Any]:
        """Train on ``groups`` as step ``step`` (0-based; it decides the critic warm-up)."""
        start = time.perf_counter()
        if self.ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        cfg = self.cfg
        batch, shaping = shape_batch(collate(groups, self.pad_id, self.vocab_size, self.temperature), groups,
                                     cfg.overlong)
        updates = min(cfg.ppo_minibatches, len(batch))
        if updates < cfg.ppo_minibatches:  # the last partial batch of a drained run, say: one update per sample
            log.warning("step %d: %d samples, fewer than trainer.ppo_minibatches=%d: %d updates, one per sample",
                        step, len(batch), cfg.ppo_minibatches, updates)
        minibatches = _split(len(batch), updates)
        plans = [self._micro_batches(rows, batch) for rows in minibatches]
        critic_out: dict[str, Any] = {}
        if self.critic is not None:
            old_values = self.critic.values(batch, plans)
            adv, returns = gae(batch.rewards, old_values, batch.loss_mask, cfg.critic.gamma, cfg.critic.lam)
            adv = whiten(adv, batch.loss_mask)
        else:
            adv = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask, cfg.advantage, cfg.std_norm)
        train_policy = self.critic is None or step >= cfg.critic.warmup_steps
        acc = _Accumulator(self.ctx.device)
        lr = self.scheduler.get_last_lr()[0]
        norms = [0.0]
        if train_policy:
            prox = self.proximal_logprobs(batch, plans) if self.recompute_prox else None
            norms = []
            for rows, plan in zip(minibatches, plans, strict=True):
                stop_point(self.ctx.device)  # before each update: none half-applied, all ranks at the same one
                norms.append(self._update(batch, adv, rows, plan, prox, acc))
            self.scheduler.step()
        if self.critic is not None:
            critic_out = self.critic.train(batch, old_values, returns, minibatches, plans)
        own = {"rank_compute_s": time.perf_counter() - start,  # up to the reduce, which waits for the slowest rank
               "rank_peak_memory_bytes": _peak_memory_bytes(self.ctx.device)}
        out = batch_stats(groups, batch, policy_version) | shaping | acc.reduce(updates, own) | critic_out
        elapsed = time.perf_counter() - start
        out.update(lr=lr, grad_norm=step_grad_norm(norms), step_time_s=elapsed, tokens_per_s=out["tokens"] / elapsed)
        out["skipped_updates"] = sum(not math.isfinite(n) for n in norms)
        out["policy_updates"] = updates if train_policy else 0
        return out

    def _forward_logprobs(self, model: nn.Module, mb: Batch, layout: Layout) -> tuple[Tensor, Tensor, slice]:
        """(logprobs [b, w] fp32, logits [b, w, V] scaled by 1/temperature of each row's group, the columns of
        the micro-batch's per-token fields they are) of the micro-batch: the distribution the rollout sampled
        from, so π_θ, π_prox and π_behav are comparable. The columns start at the first one any row trains on:
        the LM head and the softmax skip the prompts before it (``logits_to_keep``), which no loss reads.

        With a shared prefix in the layout (``trainer.share_prefix``) the tokens before those columns that every
        row shares with the first row of its group (the prompt) run once per group, and each row continues from
        its group's KV: the same numbers and gradients as a forward per row, for a group's prompt once instead
        of once per sample."""
        start, prefix, device = layout.start, layout.prefix, mb.input_ids.device
        keep = mb.input_ids.shape[1] - start
        if prefix:
            leaders = torch.tensor(layout.leaders, device=device)
            cache = model(input_ids=mb.input_ids[leaders, :prefix], use_cache=True, logits_to_keep=1)[CACHE_ARG]
            cache.reorder_cache(torch.tensor(layout.rows_leader, device=device))
            out = model(input_ids=mb.input_ids[:, prefix:], logits_to_keep=keep, **{CACHE_ARG: cache})
        else:
            out = model(input_ids=mb.input_ids, logits_to_keep=keep)
        logits = out.logits[:, :-1].float() / mb.temperatures[:, None, None]
        columns = slice(start, start + logits.shape[1])
        return losses.logprobs_from_logits(logits, mb.input_ids[:, start + 1 :]), logits, columns

    @torch.no_grad()
    def proximal_logprobs(self, batch: Batch, plans: list[list[MicroBatch]] | None = None) -> Tensor:
        """log π_prox [B, L-1] of the rows this rank trains (0 elsewhere): a no-grad pass with the current
        weights over the very micro-batches ``_update`` runs for each minibatch (``plans``; default: the whole
        batch as one minibatch), since each minibatch is sharded across ranks on its own."""
        prox = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=self.ctx.device)
        plans = plans or [self._micro_batches(list(range(len(batch))), batch)]
        for _, (rows, mb, layout) in stopping((m for plan in plans for m in plan), self.ctx.device):
            logp, _, columns = self._forward_logprobs(self.model, mb, layout)
            if rows:
                prox[rows, columns] = logp
        return prox

    def _micro_batches(self, rows: list[int], batch: Batch) -> list[MicroBatch]:
        """This rank's micro-batches of ``rows``, on its device (see ``plan_step``)."""
        plans = plan_step(batch, rows, self.ctx.world_size, self.cfg.micro_batch_tokens, self.cfg.share_prefix)
        return [m._replace(batch=m.batch.to(self.ctx.device)) for m in plans[self.ctx.rank]]

    def _update(self, batch: Batch, adv: Tensor, rows: list[int], plan: list[MicroBatch], prox: Tensor | None,
                acc: _Accumulator) -> float:
        """Accumulate gradients over this rank's micro-batches (``plan``) of the minibatch ``rows``, then one
        optimizer step."""
        cfg = self.cfg
        denom = losses.agg_denominator(batch.loss_mask[rows], cfg.loss_agg)
        with self._unsharded_through_backward():
            self._accumulate(plan, adv, prox, denom, acc)
        return apply_gradients(self.model, self.optimizer, cfg.grad_clip, "policy")

    @contextmanager
    def _unsharded_through_backward(self) -> Iterator[None]:
        """Keep the layers unsharded after their backward while the micro-batches run, then reshard them.

        A shared prompt's forward saves the unsharded weights for its backward, which runs only when the
        gradient comes back through its KV, after FSDP would have resharded the layer that made it. The update
        then holds one unsharded copy of the model (ZeRO-2's memory, not ZeRO-3's), so only where sharing is on."""
        hold = self.cfg.share_prefix
        if hold:
            self.model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            if hold:
                self.model.set_reshard_after_backward(True)
                for module in self.model.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def _accumulate(self, plan: list[MicroBatch], adv: Tensor, prox: Tensor | None, denom: int,
                    acc: _Accumulator) -> None:
        """Forward and backward of each micro-batch, the gradients summed; FSDP reduces them on the last."""
        for i, (mb_rows, mb, layout) in stopping(plan, self.ctx.device):
            self.model.set_requires_gradient_sync(i == len(plan) - 1)
            ref_logp = None
            if self.ref_model is not None:  # a collective too: run it on dummy micro-batches as well
                with torch.no_grad():
                    ref_logp, _, _ = self._forward_logprobs(self.ref_model, mb, layout)
            logp, logits, columns = self._forward_logprobs(self.model, mb, layout)
            if not mb_rows:
                (logits.sum() * 0.0).backward()
                continue
            mb_adv = adv[mb_rows, columns].to(self.ctx.device)
            mb_prox = logp.detach() if prox is None else prox[mb_rows, columns]
            total = self._loss(logp, logits, mb.loss_mask[:, columns], mb.behaviour_logprobs[:, columns], mb_adv,
                               mb_prox, ref_logp, denom, acc)
            (total * self.ctx.world_size).backward()  # FSDP averages gradients over ranks; we want the sum

    def _loss(
        self,
        logp: Tensor,
        logits: Tensor,
        mask: Tensor,
        behaviour: Tensor,
        adv: Tensor,
        prox: Tensor,
        ref_logp: Tensor | None,
        denom: int,
        acc: _Accumulator,
    ) -> Tensor:
        """Policy loss + KL penalty - entropy bonus of one micro-batch's trained columns (``mask``, ``behaviour``,
        ``adv`` and ``prox`` cut to the columns of ``logp``), all over the step's denominator."""
        cfg = self.cfg
        kwargs = {"loss_agg": cfg.loss_agg, "denominator": denom, **self.loss_kwargs}
        pg, metrics = self.loss_fn(logp, prox, behaviour, adv, mask, **kwargs)
        total = pg
        if cfg.entropy_coef > 0:
            entropy = losses.entropy_from_logits(logits)
            total = total - cfg.entropy_coef * losses.aggregate(entropy, mask, cfg.loss_agg, denom)
        else:
            with torch.no_grad():
                entropy = losses.entropy_from_logits(logits)
        kl = torch.zeros_like(logp)
        if ref_logp is not None:
            kl = losses.kl_penalty(logp, ref_logp, cfg.kl_estimator)
            total = total + cfg.kl_coef * losses.aggregate(kl, mask, cfg.loss_agg, denom)
        tokens = int(mask.sum())
        means = {k: metrics[k] for k in ("is_ratio_mean", "clip_fraction", "masked_fraction", "logprob_gap")}
        means["entropy"] = losses.aggregate(entropy.detach(), mask, "token-mean")
        means["kl"] = losses.aggregate(kl.detach(), mask, "token-mean")
        acc.add(tokens, means, {"loss": total.detach(), "pg_loss": pg.detach()}, metrics["is_ratio_max"])
        return total


def _split(n: int, parts: int) -> list[list[int]]:
    """Rows 0..n-1 in ``parts`` contiguous, near-equal minibatches."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]
