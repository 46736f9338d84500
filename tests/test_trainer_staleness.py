"""Staleness admission and the trainer together, through a real Redis: with ``buffer.push_every = k`` a
version spans k steps, and a producer that obeys admission must keep the trainer fed to ``total_steps``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from trainer_helpers import synthetic_groups

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from core.config import BufferConfig, TrainerConfig
from trainer.parallel import DistContext
from trainer.worker import Trainer

GPS = 2
STEPS = 9


@pytest.mark.parametrize("push_every", [2, 3])
def test_push_every_k_steps_reaches_total_steps(
    ctx: DistContext, tiny_model_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path, push_every: int
) -> None:
    """The producer admits and writes every group admission allows, at the committed version, before each
    step; the step must find a full batch (with the bound of one step per version it ran dry after step 5)."""
    run = f"k{push_every}"
    cfg = BufferConfig(max_staleness=2, groups_per_step=GPS, push_every=push_every)
    client, keys = redis.Redis.from_url(redis_server.url), Keys(run)
    staleness = StalenessControl(client, keys, cfg)
    replay = ReplayBuffer(client, keys, cfg)
    replay.ensure_group()
    trainer_cfg = TrainerConfig(total_steps=STEPS, checkpoint_every=1, take_timeout_s=0.2, device="cpu")
    trainer = Trainer(trainer_cfg, tiny_model_dir, tmp_path, cfg).start(ctx=ctx)
    produced, versions = 0, []
    while not trainer.done:
        version = staleness.version()
        while staleness.try_admit(f"s{produced}-g0"):
            assert replay.put_many(synthetic_groups(produced, 1, version=version, run=run)) == [1]
            produced += 1
        assert produced >= (trainer.step + 1) * GPS, (
            f"admission ran dry before step {trainer.step + 1}: {produced} groups admitted at version {version}"
        )
        groups, _ = trainer.next_batch(replay)
        record = trainer.train(groups)
        versions.append(record["policy_version"])
        if trainer.version > staleness.version():  # what the rollout servers' commit of the pushed version does
            staleness.set_version(trainer.version, trained=trainer.step * GPS)
    trainer.finish(replay)
    trainer.close()
    assert trainer.step == STEPS and trainer.version == STEPS // push_every
    assert versions == [s // push_every for s in range(STEPS)]  # a version spans push_every steps
    assert produced <= (trainer.version + cfg.max_staleness + 1) * GPS * push_every


def _one_group(seed: int, run: str, rewards: list[float]) -> list:
    groups = synthetic_groups(seed, 1, run=run)
    for s, reward in zip(groups[0].samples, rewards, strict=True):
        s.reward = reward
    return groups


@pytest.mark.parametrize("filtered", [True, False])
def test_degenerate_groups_are_dropped_and_give_their_admission_back(
    ctx: DistContext, tiny_model_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path, filtered: bool
) -> None:
    """η = 0 and 2 groups per step: version 0 admits 2 groups. Both come back with equal rewards. Filtered, the
    trainer drops them, and their slots must come back (were they counted as trained, admission would stay shut
    at version 0 and the trainer would wait forever); the 2 informative groups admitted next make the step."""
    run = f"degenerate-{filtered}"
    cfg = BufferConfig(max_staleness=0, groups_per_step=GPS, filter_degenerate_groups=filtered)
    client, keys = redis.Redis.from_url(redis_server.url), Keys(run)
    staleness = StalenessControl(client, keys, cfg)
    replay = ReplayBuffer(client, keys, cfg)
    replay.ensure_group()
    trainer_cfg = TrainerConfig(total_steps=1, take_timeout_s=0.2, stop_when_drained=True, device="cpu")
    trainer = Trainer(trainer_cfg, tiny_model_dir, tmp_path, cfg).start(ctx=ctx)
    for seed in range(GPS):
        assert staleness.try_admit(f"s{seed}-g0")
        assert replay.put_many(_one_group(seed, run, [1.0] * 4)) == [1]
    assert staleness.capacity() == 0
    groups, _ = trainer.next_batch(replay)
    if not filtered:
        assert [g.group_id for g in groups] == ["s0-g0", "s1-g0"]  # trained as they are
        trainer.close()
        return
    assert groups == [] and trainer.done  # nothing informative, and nothing more to come
    assert staleness.capacity() == GPS and staleness.admitted() == 0  # the slots came back
    assert client.xlen(keys.groups) == 0  # acked away
    assert client.hget(keys.job("job"), "degenerate_dropped") == str(GPS).encode()
    for seed in (10, 11):
        assert staleness.try_admit(f"s{seed}-g0")
        assert replay.put_many(_one_group(seed, run, [1.0, 0.0, 0.0, 1.0])) == [1]
    groups, _ = trainer.next_batch(replay)
    assert [g.group_id for g in groups] == ["s10-g0", "s11-g0"]
    record = trainer.train(groups)
    trainer.finish(replay)
    trainer.close()
    assert record["degenerate_dropped"] == GPS
    assert trainer.metrics.registry.get_sample_value("rollwave_buffer_degenerate_dropped_total") == GPS
    assert client.hget(keys.job("job"), "trained") == str(GPS).encode()
    assert staleness.admitted() == GPS  # trained groups keep theirs


@pytest.mark.parametrize(("take_timeout_s", "reads"), [(0.25, range(3, 100)), (5.0, range(1, 2))])
def test_take_timeout_s_is_how_long_each_buffer_read_waits(
    ctx: DistContext, tiny_model_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path, take_timeout_s: float,
    reads: range,
) -> None:
    """trainer.take_timeout_s bounds each read of an empty buffer, after which rank 0 reads again (and, with
    several ranks, broadcasts in between): a batch that arrives 1.5 s late takes several reads of 0.25 s, and
    one read at the default 5 s. The trainer's idle time is counted at each of them."""
    run = f"take-{take_timeout_s}"
    cfg = BufferConfig(groups_per_step=1)
    replay = ReplayBuffer(redis.Redis.from_url(redis_server.url), Keys(run), cfg)
    replay.ensure_group()
    trainer_cfg = TrainerConfig(total_steps=1, take_timeout_s=take_timeout_s, device="cpu")
    trainer = Trainer(trainer_cfg, tiny_model_dir, tmp_path, cfg).start(ctx=ctx)
    calls, idle = [], []
    take = replay.take

    def counted(max_groups: int, timeout_s: float) -> list:
        calls.append(timeout_s)
        idle.append(trainer.metrics.registry.get_sample_value("rollwave_trainer_idle_seconds_total"))
        return take(max_groups, timeout_s)

    replay.take = counted  # type: ignore[method-assign]
    late = threading.Timer(1.5, lambda: replay.put_many(synthetic_groups(0, 1, run=run)))
    late.start()
    try:
        groups, waited = trainer.next_batch(replay)
    finally:
        late.join()
        trainer.close()
    assert len(groups) == 1 and waited >= 1.4
    assert len(calls) in reads and set(calls) == {take_timeout_s}, calls
    # the idle time is counted read by read, while the trainer waits (it was counted once the step had trained)
    assert idle[-1] >= (1.0 if take_timeout_s < 1 else 0.0), idle
    assert trainer.metrics.registry.get_sample_value("rollwave_trainer_idle_seconds_total") == pytest.approx(waited)


def test_a_group_the_model_cannot_train_on_is_moved_aside_not_trained(
    ctx: DistContext, tiny_model_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """A group that decodes but holds a token outside the model's vocabulary (a rollout on another tokenizer) used
    to reach the step and fail it: the trainer crashed, and each restart took the same pending group back and
    crashed again. It is moved aside before the step (``groups:malformed``, with its payload and the reason; its
    job counts it ``malformed`` and its admission slot comes back), and the step trains the others."""
    run = "untrainable"
    cfg = BufferConfig(max_staleness=1, groups_per_step=GPS)  # room for GPS + 1
    client, keys = redis.Redis.from_url(redis_server.url), Keys(run)
    staleness = StalenessControl(client, keys, cfg)
    replay = ReplayBuffer(client, keys, cfg)
    replay.ensure_group()
    trainer_cfg = TrainerConfig(total_steps=1, take_timeout_s=0.2, device="cpu")
    trainer = Trainer(trainer_cfg, tiny_model_dir, tmp_path, cfg).start(ctx=ctx)
    vocab = trainer.train_step.vocab_size
    groups = synthetic_groups(0, GPS + 1, run=run)
    groups[1].samples[2].token_ids[-1] = vocab + 5
    for g in groups:
        assert staleness.try_admit(g.group_id)
    assert replay.put_many(groups) == [1] * (GPS + 1)
    batch, _ = trainer.next_batch(replay)
    assert [g.group_id for g in batch] == [groups[0].group_id, groups[2].group_id]
    trainer.train(batch)
    trainer.finish(replay)
    trainer.close()
    [(_, letter)] = client.xrange(keys.groups_malformed)
    assert f"samples[2].token_ids: id {vocab + 5} outside the model's vocabulary".encode() in letter[b"error"]
    assert letter[b"payload"]  # the group itself, nothing accepted is lost
    assert client.hget(keys.job("job"), "malformed") == b"1" and client.hget(keys.job("job"), "trained") == b"2"
    assert client.xlen(keys.groups) == 0 and staleness.admitted() == GPS  # the rejected one's slot came back
