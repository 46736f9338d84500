"""``check_group`` on the per-token fields the loss and the staleness filter read: a trained token's behaviour
logprob must be a finite log-probability and its version a policy version; what untrained tokens carry is never
read, and a group refused is moved aside by the trainer before its step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from trainer_helpers import synthetic_groups

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from core.config import BufferConfig, TrainerConfig
from trainer import losses
from trainer.batching import check_group, collate
from trainer.parallel import DistContext
from trainer.worker import Trainer


def _positions(sample_mask: np.ndarray) -> tuple[int, int]:
    """(a trained token, an untrained one after the prompt: the tool output) of a synthetic sample."""
    trained = np.flatnonzero(sample_mask)
    untrained = [i for i in range(int(trained[0]), int(trained[-1])) if not sample_mask[i]]
    return int(trained[-1]), untrained[0]


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.5, 1e-3])
def test_a_trained_token_s_behaviour_logprob_must_be_a_log_probability(value: float) -> None:
    """NaN makes the importance ratio, so the step's loss and weights, NaN; inf and a positive value are no
    log-probability a sampler gives its token. The error names the group, sample, field, position and value."""
    [group] = synthetic_groups(0, 1)
    sample = group.samples[1]
    at, _ = _positions(sample.loss_mask)
    sample.behaviour_logprobs[at] = value
    want = rf"group s0-g0\.samples\[1\]\.behaviour_logprobs\[{at}\]: {np.float32(value)} on a trained token is not"
    with pytest.raises(ValueError, match=want):
        check_group(group)


def test_a_trained_token_s_logprob_may_be_zero_a_rounding_above_or_far_below() -> None:
    """0 (a certain token), a rounding error above it (an engine's log of renormalised probabilities), a very
    unlikely token and one its precision rounded to probability 0 (-inf: the losses clamp its log ratio) are all
    log-probabilities an engine reports."""
    [group] = synthetic_groups(0, 1)
    trained = np.flatnonzero(group.samples[0].loss_mask)
    group.samples[0].behaviour_logprobs[trained[:4]] = [0.0, 5e-5, -80.0, -math.inf]
    check_group(group)


@pytest.mark.parametrize("version", [-1, -3])
def test_a_trained_token_needs_a_policy_version(version: int) -> None:
    """-1 (the schema's "none", off the mask) or any negative version on a trained token: the staleness filter
    would judge its sample by a version no policy had (kept at early versions, dropped as stale later)."""
    [group] = synthetic_groups(0, 1, version=2)
    sample = group.samples[3]
    at, _ = _positions(sample.loss_mask)
    sample.token_versions[at] = version
    with pytest.raises(ValueError, match=rf"group s0-g0\.samples\[3\]\.token_versions\[{at}\]: {version} on a "
                       r"trained token is no policy version"):
        check_group(group)


def test_untrained_tokens_logprobs_and_versions_are_never_read() -> None:
    """The prompt's and a tool output's behaviour logprobs (0 from the rollout) and versions (-1) feed neither the
    loss nor the staleness filter: whatever they hold, the group trains, and the loss stays finite."""
    [group] = synthetic_groups(0, 1)
    for sample in group.samples:
        _, tool = _positions(sample.loss_mask)
        sample.behaviour_logprobs[[1, tool]] = [math.nan, math.inf]
        sample.token_versions[[1, tool]] = -7
    check_group(group)
    batch = collate([group])
    logp = torch.full(batch.loss_mask.shape, -6.0, requires_grad=True)
    adv = torch.ones(batch.loss_mask.shape)
    for name, loss_fn in losses.POLICY_LOSSES.items():
        loss, metrics = loss_fn(logp, logp.detach(), batch.behaviour_logprobs, adv, batch.loss_mask)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), (name, metrics)


def test_a_group_with_a_nan_behaviour_logprob_is_moved_aside_before_the_step(
    ctx: DistContext, tiny_model_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The trainer's read refuses it through ``check_group`` (``groups:malformed`` with the reason, counted in
    ``rollwave_buffer_malformed_total``, its job's ``malformed`` and its admission slot back); the step trains
    the others, and its loss is finite."""
    run, gps = "nanlogprob", 2
    cfg = BufferConfig(max_staleness=1, groups_per_step=gps)
    client, keys = redis.Redis.from_url(redis_server.url), Keys(run)
    staleness = StalenessControl(client, keys, cfg)
    replay = ReplayBuffer(client, keys, cfg)
    replay.ensure_group()
    trainer = Trainer(TrainerConfig(total_steps=1, take_timeout_s=0.2, device="cpu"), tiny_model_dir, tmp_path,
                      cfg).start(ctx=ctx)
    groups = synthetic_groups(0, gps + 1, run=run)
    at, _ = _positions(groups[1].samples[0].loss_mask)
    groups[1].samples[0].behaviour_logprobs[at] = math.nan
    for g in groups:
        assert staleness.try_admit(g.group_id)
    assert replay.put_many(groups) == [1] * (gps + 1)
    batch, _ = trainer.next_batch(replay)
    assert [g.group_id for g in batch] == [groups[0].group_id, groups[2].group_id]
    record = trainer.train(batch)
    trainer.finish(replay)
    trainer.close()
    assert math.isfinite(record["loss"]) and record["skipped_updates"] == 0
    [(_, letter)] = client.xrange(keys.groups_malformed)
    assert f"samples[0].behaviour_logprobs[{at}]: nan on a trained token".encode() in letter[b"error"]
    assert replay.metrics.malformed.labels(stream="groups")._value.get() == 1
    assert client.hget(keys.job("job"), "malformed") == b"1" and client.hget(keys.job("job"), "trained") == b"2"
    assert client.xlen(keys.groups) == 0 and staleness.admitted() == gps


def test_a_group_with_no_policy_s_version_is_malformed_not_stale(
    ctx: DistContext, tiny_model_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The read checks a group before the staleness filter judges its age: a trained token's version -1 is no
    policy's, so the group is malformed (moved aside, counted so), not dropped as stale under a policy version past
    ``max_staleness``."""
    run, gps = "noversion", 2
    cfg = BufferConfig(max_staleness=1, groups_per_step=gps)
    client, keys = redis.Redis.from_url(redis_server.url), Keys(run)
    replay = ReplayBuffer(client, keys, cfg)
    replay.ensure_group()
    trainer = Trainer(TrainerConfig(total_steps=1, take_timeout_s=0.2, device="cpu"), tiny_model_dir, tmp_path,
                      cfg).start(ctx=ctx)
    trainer.version = 5
    groups = synthetic_groups(0, gps + 1, run=run, version=5)
    at, _ = _positions(groups[1].samples[0].loss_mask)
    groups[1].samples[0].token_versions[at] = -1
    assert replay.put_many(groups) == [1] * (gps + 1)
    batch, _ = trainer.next_batch(replay)
    trainer.close()
    assert [g.group_id for g in batch] == [groups[0].group_id, groups[2].group_id]
    assert client.hget(keys.job("job"), "malformed") == b"1" and client.hget(keys.job("job"), "stale_dropped") is None
    assert replay.metrics.stale_dropped._value.get() == 0


@pytest.mark.parametrize("temperature", [0.0, 5e-7, math.nan])
def test_a_group_sampled_greedily_cannot_be_trained_on(temperature: float) -> None:
    """Below 1e-6 the engines sample greedily, while the trainer would divide the logits by the group's temperature:
    the group is refused, naming it (at 1e-6 it trains)."""
    [group] = synthetic_groups(0, 1)
    group.temperature = temperature
    with pytest.raises(ValueError, match=r"group s0-g0\.temperature: .* cannot be trained on: below 1e-06 the engines "
                       "sample greedily"):
        check_group(group)
    group.temperature = 1e-6
    check_group(group)
