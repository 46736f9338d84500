"""Trajectory groups -> padded tensors, rank shards and token-budget micro-batches.

Tensors are right-padded. With causal attention no real position can attend to a pad that follows it,
so the model needs no attention mask and its outputs at real positions do not depend on the padding.
Per-token fields are aligned to the *predicted* token: column t of ``loss_mask``, ``behaviour_logprobs``,
``token_versions`` and the advantages belongs to ``input_ids[:, t + 1]``, which the logits at position
t predict; they have L - 1 columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from buffer.schema import TrajectoryGroup
from core.config import check_train_temperature


@dataclass
class Batch:
    """One step's samples, the contract between the collator and the train step.

    ``input_ids`` [B, L]; ``loss_mask`` [B, L-1] bool; ``behaviour_logprobs`` [B, L-1] fp32;
    ``token_versions`` [B, L-1] int (-1 off the mask); ``rewards`` [B] fp64; ``group_index`` [B]
    (position of the sample's group in the step); ``lengths`` [B] real tokens per row; ``temperatures``
    [B] fp32, the sampling temperature of the row's group (its logits are divided by it).
    """

    input_ids: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    token_versions: Tensor
    rewards: Tensor
    group_index: Tensor
    lengths: Tensor
    temperatures: Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: list[int]) -> Batch:
        """The given rows, trimmed to their longest sequence."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        length = int(self.lengths[idx].max()) if rows else 1
        return Batch(
            input_ids=self.input_ids[idx, :length],
            loss_mask=self.loss_mask[idx, : length - 1],
            behaviour_logprobs=self.behaviour_logprobs[idx, : length - 1],
            token_versions=self.token_versions[idx, : length - 1],
            rewards=self.rewards[idx],
            group_index=self.group_index[idx],
            lengths=self.lengths[idx],
            temperatures=self.temperatures[idx],
        )

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: v.to(device) for k, v in vars(self).items()})


# A behaviour logprob above this is no log-probability: the engine's fp32 log_softmax gives at most 0, an engine that
# takes the log of renormalised probabilities (SGLang after top-p) a rounding error above it.
MAX_BEHAVIOUR_LOGPROB = 1e-4


def check_group(group: TrajectoryGroup, vocab_size: int | None = None, temperature: float = 1.0) -> None:
    """ValueError naming what the trainer cannot train on in ``group``: a greedy temperature, a non-finite reward,
    a token id outside [0, vocab_size), a trained first token, and on a trained token a behaviour logprob that is
    NaN (it makes the step's loss NaN) or above 0 or a negative policy version (the staleness filter
    cannot judge its age). Untrained tokens' logprobs and versions are never read. The buffer's decode checks the
    schema; these depend on the trainer's model and loss, and the trainer moves a group that fails them aside
    before its step (one that reached the step would fail it again after every restart)."""
    t = temperature if group.temperature is None else group.temperature
    try:
        check_train_temperature(t)
    except ValueError as exc:
        raise ValueError(f"group {group.group_id}.temperature: {exc}") from None
    for s in group.samples:
        where = f"group {group.group_id}.samples[{s.sample_index}]"
        s.validate(where)
        if not math.isfinite(s.reward):  # NaN would zero its group's advantages unseen; inf makes the loss NaN
            raise ValueError(f"{where}.reward: {s.reward} is not a finite number")
        n = len(s.token_ids)
        if n and (s.token_ids.min() < 0 or (vocab_size is not None and s.token_ids.max() >= vocab_size)):
            bad = int(s.token_ids.max() if s.token_ids.min() >= 0 else s.token_ids.min())
            raise ValueError(f"{where}.token_ids: id {bad} outside the model's vocabulary [0, {vocab_size})")
        if n and s.loss_mask[0]:
            raise ValueError(f"{where}.loss_mask: the first token cannot be trained on (nothing predicts it)")
        trained = s.loss_mask.astype(bool)
        logprobs = s.behaviour_logprobs
        # -inf passes: an engine reports it for a token its float precision rounds to 0, and the losses clamp its
        # log ratio (losses.py), so its weight is capped or the token masked rather than its group lost
        wrong = np.flatnonzero(trained & ~(logprobs <= MAX_BEHAVIOUR_LOGPROB))
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(f"{where}.behaviour_logprobs[{i}]: {logprobs[i]} on a trained token is not a "
                             "log-probability (<= 0): the token's importance ratio would be NaN or meaningless")
        wrong = np.flatnonzero(trained & (s.token_versions < 0))
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(f"{where}.token_versions[{i}]: {s.token_versions[i]} on a trained token is no policy "
                             "version (0, 1, ...): the staleness filter cannot judge its age")


def collate(
    groups: list[TrajectoryGroup], pad_id: int = 0, vocab_size: int | None = None, temperature: float = 1.0
) -> Batch:
    """Stack every sample of ``groups`` (in order) into one right-padded ``Batch``; each group must pass
    ``check_group``. ``temperature`` stands in for groups that do not record theirs (schema 1)."""
    # each group is told apart by its position, not its id: two groups with one id must not share a baseline
    samples = [(i, g, s) for i, g in enumerate(groups) for s in g.samples]
    if not samples:
        raise ValueError("collate: the step has no samples")
    for g in groups:
        check_group(g, vocab_size, temperature)
    length = max(max(len(s.token_ids) for _, _, s in samples), 2)
    b = len(samples)
    ids = np.full((b, length), pad_id, dtype=np.int64)
    mask = np.zeros((b, length), dtype=bool)
    behav = np.zeros((b, length), dtype=np.float32)
    versions = np.full((b, length), -1, dtype=np.int64)
    for row, (_, _, s) in enumerate(samples):
        n = len(s.token_ids)
        ids[row, :n] = s.token_ids
        mask[row, :n] = s.loss_mask.astype(bool)
        behav[row, :n] = s.behaviour_logprobs
        versions[row, :n] = s.token_versions
    return Batch(
        input_ids=torch.from_numpy(ids),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        behaviour_logprobs=torch.from_numpy(behav[:, 1:].copy()),
        token_versions=torch.from_numpy(versions[:, 1:].copy()),
        rewards=torch.tensor([s.reward for _, _, s in samples], dtype=torch.float64),
        group_index=torch.tensor([i for i, _, _ in samples], dtype=torch.long),
        lengths=torch.tensor([len(s.token_ids) for _, _, s in samples], dtype=torch.long),
        temperatures=torch.tensor([temperature if g.temperature is None else g.temperature for _, g, _ in samples],
                                  dtype=torch.float32),
    )


def _shard(units: list[list[int]], lengths: list[int], world_size: int) -> list[list[list[int]]]:
    """``units`` (lists of rows that stay together) per rank, balanced by tokens (most first to the least
    loaded rank); each shard is sorted by length so micro-batches waste little padding. Deterministic: every
    rank computes all."""
    load = [0] * world_size
    shards: list[list[list[int]]] = [[] for _ in range(world_size)]
    for unit in sorted(units, key=lambda u: (-sum(lengths[r] for r in u), u[0])):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        shards[rank].append(sorted(unit, key=lambda r: (lengths[r], r)))
        load[rank] += sum(lengths[r] for r in unit)
    return [sorted(s, key=lambda u: (lengths[u[-1]], u[0])) for s in shards]


def _pack(pieces: list[list[int]], lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Greedy, in order: a micro-batch grows by whole pieces while rows × longest row ≤ ``budget_tokens``;
    a piece over the budget gets a micro-batch of its own."""
    plan: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for piece in pieces:
        grown = max(longest, *(lengths[r] for r in piece))
        if current and grown * (len(current) + len(piece)) > budget_tokens:
            plan.append(current)
            current, grown = [], max(lengths[r] for r in piece)
        current += piece
        longest = grown
    if current:
        plan.append(current)
    return plan


def plan_micro_batches(units: list[list[int]], lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Micro-batches of whole ``units`` (rows sorted by length within each) while rows × longest row ≤
    ``budget_tokens``. A unit over the budget is cut into pieces that fit; a row longer than the budget gets a
    micro-batch of its own (it is never split)."""
    pieces = [piece for unit in units for piece in _pack([[r] for r in unit], lengths, budget_tokens)]
    return _pack(pieces, lengths, budget_tokens)


def plan_ranks(
    rows: list[int], lengths: list[int], world_size: int, budget: int, groups: list[int] | None = None
) -> list[list[list[int]]]:
    """Every rank's micro-batches of ``rows``, padded with empty ones to the largest count of any rank.

    With ``groups`` (each row's group) a group's rows stay together: on one rank, in as few micro-batches as
    the budget allows, so the step runs their shared prompt once (``trainer.share_prefix``). Without, rows
    are placed one by one. Every FSDP forward and backward is a collective, so all ranks must run the same
    number of them; an empty micro-batch runs on a dummy input with zero loss.
    """
    units: dict[int, list[int]] = {}
    for row in rows:
        units.setdefault(row if groups is None else groups[row], []).append(row)
    plans = [plan_micro_batches(shard, lengths, budget) for shard in _shard(list(units.values()), lengths, world_size)]
    count = max(len(p) for p in plans)
    return [plan + [[] for _ in range(count - len(plan))] for plan in plans]


@dataclass(frozen=True)
class Layout:
    """How one micro-batch runs through the model: its LM head from ``start``, the first column any row trains
    on. With ``prefix`` > 0 the first ``prefix`` tokens, which every row shares with the first row of its group,
    run once per group (``trainer.share_prefix``): ``leaders`` are those first rows, ``rows_leader`` gives each
    row's group among them."""

    rows: int
    width: int
    start: int
    prefix: int = 0
    leaders: tuple[int, ...] = ()
    rows_leader: tuple[int, ...] = ()

    def fed_tokens(self) -> int:
        """Tokens the model is fed, padding included."""
        return len(self.leaders) * self.prefix + self.rows * (self.width - self.prefix)

    def unshared(self) -> Layout:
        return Layout(self.rows, self.width, self.start)


def layout(mb: Batch) -> Layout:
    """The layout of a micro-batch on the host (no device sync): the prefix is what every row shares with its
    group's first row, up to the first trained column (whose logits must come from the rows' own forward)."""
    trained = mb.loss_mask.any(dim=0)
    start = int(trained.int().argmax()) if trained.any() else 0
    groups = mb.group_index.tolist()
    plain = Layout(len(groups), int(mb.input_ids.shape[1]), start)
    order = list(dict.fromkeys(groups))
    if len(order) == len(groups):
        return plain
    leaders = [groups.index(g) for g in order]
    position = {g: i for i, g in enumerate(order)}
    rows_leader = [position[g] for g in groups]
    own_leader = mb.input_ids[[leaders[i] for i in rows_leader]]
    prefix = min(int((mb.input_ids == own_leader).int().cumprod(dim=1).sum(dim=1).min()), start)
    return Layout(plain.rows, plain.width, start, prefix, tuple(leaders), tuple(rows_leader)) if prefix else plain


class MicroBatch(NamedTuple):
    """One micro-batch of a rank: its rows of the step's batch (none: a dummy), their tensors, its layout."""

    rows: list[int]
    batch: Batch
    layout: Layout


def micro_batch(batch: Batch, rows: list[int]) -> Batch:
    """The rows of ``batch``; no rows give a 2-token dummy that trains on nothing (see ``plan_ranks``)."""
    if rows:
        return batch.select(rows)
    dummy = batch.select([0])
    return Batch(**{**vars(dummy), "input_ids": dummy.input_ids[:, :2], "loss_mask": dummy.loss_mask[:, :1] & False})


def lay_out(batch: Batch, plans: list[list[list[int]]], share: bool) -> list[list[MicroBatch]]:
    """Every rank's micro-batches of ``plans`` with their layouts. A shared prefix runs apart only where every
    rank's micro-batch at that place has one: it takes the model two forwards, and FSDP's are collectives."""
    out = [[MicroBatch(rows, mb, layout(mb)) for rows in plan for mb in [micro_batch(batch, rows)]] for plan in plans]
    for i, column in enumerate(zip(*out, strict=True)):
        if not share or not all(m.layout.prefix for m in column):
            for plan in out:
                plan[i] = plan[i]._replace(layout=plan[i].layout.unshared())
    return out


def fed_tokens(plans: list[list[MicroBatch]]) -> int:
    """Tokens the model is fed (padding included) to run every rank's micro-batches."""
    return sum(m.layout.fed_tokens() for plan in plans for m in plan)


def plan_step(batch: Batch, rows: list[int], world_size: int, budget: int, share: bool) -> list[list[MicroBatch]]:
    """Every rank's micro-batches of ``rows``. With ``share`` a group's rows stay together where that feeds the
    model fewer tokens than rows sorted by length (a group's prompt once, but each row padded to its
    micro-batch's longest); every rank computes all and so makes the same choice."""
    lengths = batch.lengths.tolist()
    plans = lay_out(batch, plan_ranks(rows, lengths, world_size, budget), share)
    if share:
        grouped = lay_out(batch, plan_ranks(rows, lengths, world_size, budget, batch.group_index.tolist()), share)
        if fed_tokens(grouped) < fed_tokens(plans):
            plans = grouped
    return plans
