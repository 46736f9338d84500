"""The trainer side of the replay buffer under faults, against a real Redis: a second trainer of the run, an ack
that Redis lost, a reply lost on the network."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import yaml
from buffer_helpers import client, make_group
from test_buffer_queue_faults import LoseExecReply
from trainer_helpers import reaped

from buffer.keys import TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis, client_for
from buffer.replay import ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.config import CONFIG_ERROR_EXIT, BufferConfig, RedisConfig

KEYS = Keys("t")


def buffer(url: str, consumer: str = "trainer") -> ReplayBuffer:
    buf = ReplayBuffer(client_for(url, RedisConfig(), outage_s=10), KEYS, BufferConfig(claim_idle_ms=200), consumer)
    buf.ensure_group()
    return buf


def fill(buf: ReplayBuffer, gids: list[str]) -> None:
    assert buf.put_many([make_group("job", g) for g in gids]) == [1] * len(gids)


def test_a_second_trainer_of_the_run_fences_the_first(redis_server: EmbeddedRedis) -> None:
    """A trainer started while the run's previous one still runs (launched twice, or restarted by a supervisor
    before the old one died) takes the old one's pending groups back. The old one used to go on taking and acking:
    what it trained after that, acked as trained, never reached the newer trainer's weights. Now its next ack and
    take are refused, naming the key, and nothing it holds is lost."""
    producer = buffer(redis_server.url, "producer")
    fill(producer, ["job:0:a", "job:1:a"])
    old = buffer(redis_server.url)
    old_batch = old.take(2, 0.5)
    assert len(old_batch) == 2
    new = buffer(redis_server.url)
    assert new.fence() == old.fence() + 1
    with pytest.raises(TrainerFenced, match=f"{KEYS.trainer_epoch} is {new.fence()}"):
        old.ack([e for e, _ in old_batch], [g.group_id for _, g in old_batch])
    fill(producer, ["job:2:a"])
    with pytest.raises(TrainerFenced, match="a newer trainer of run t started"):
        old.take(2, 0.2)
    trained: list[str] = []
    deadline = time.monotonic() + 10
    while len(trained) < 3 and time.monotonic() < deadline:
        batch = new.take(3, 0.2)
        trained += [g.group_id for _, g in batch]
        assert new.ack([e for e, _ in batch], [g.group_id for _, g in batch]) == len(batch)
    assert sorted(trained) == ["job:0:a", "job:1:a", "job:2:a"]  # each once, by the trainer that goes on
    assert TaskQueue(client(redis_server), KEYS, BufferConfig()).job("job")["trained"] == "3"


def test_a_write_a_newer_trainer_started_during_is_not_made(redis_server: EmbeddedRedis) -> None:
    """``fenced_write`` checks the epoch and writes in one MULTI under WATCH: a newer trainer that starts between the
    check and the EXEC aborts it, and the check, run again, refuses it (logged, counted). A check followed by the
    writes made them over the newer trainer's."""
    r = client(redis_server)
    old, newer = buffer(redis_server.url), buffer(redis_server.url)
    old.fence()
    calls: list[int] = []

    def write(pipe: redis.client.Pipeline) -> None:
        calls.append(1)
        if len(calls) == 1:  # checked already, not yet run
            newer.fence()
        pipe.set(KEYS.budget, 1)

    with pytest.raises(TrainerFenced, match=f"{KEYS.trainer_epoch} is 2: a newer trainer of run t started"):
        old.fenced_write(write, "a test's write")
    assert calls == [1] and r.get(KEYS.budget) is None
    assert old.metrics.registry.get_sample_value("rollwave_buffer_fenced_refusals_total") == 1
    newer.fenced_write(write, "a test's write")
    assert r.get(KEYS.budget) == b"1"


def test_a_fenced_trainer_acks_no_duplicate_away(redis_server: EmbeddedRedis) -> None:
    """The older trainer's take reads a copy of a group it holds (written again once its id left the dedup window)
    after the newer trainer started: it used to ack the copy away and delete it and its payload, with no fence
    check, on a view of what is held that is no longer the run's. Now its take is refused there (counted), and the
    copy stays pending, with its payload, for the newer trainer to judge."""
    r = client(redis_server)
    producer = buffer(redis_server.url, "producer")
    fill(producer, ["job:0:a"])
    old = buffer(redis_server.url)
    [(held, _)] = old.take(1, 0.5)
    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(old.take, 1, 10)
        deadline = time.monotonic() + 10
        while not any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in r.client_list()):  # past its check
            assert not taking.done() and time.monotonic() < deadline, "the older trainer's take never waited"
            time.sleep(0.01)
        buffer(redis_server.url).fence()  # the newer trainer
        r.hdel(KEYS.group_state, "job:0:a")  # the id left the dedup window
        fill(producer, ["job:0:a"])  # a late copy
        with pytest.raises(TrainerFenced, match="a newer trainer of run t started"):
            taking.result(timeout=60)
    [(copy, fields)] = [(e.decode(), f) for e, f in r.xrange(KEYS.groups) if e.decode() != held]
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 2 and r.exists(fields[b"p"]), copy
    metrics = old.metrics.registry
    assert metrics.get_sample_value("rollwave_buffer_fenced_refusals_total") == 1
    assert metrics.get_sample_value("rollwave_buffer_duplicates_dropped_total") == 0


def test_a_fenced_trainer_process_leaves_the_runs_end_and_budget_to_the_newer_one(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``python -m trainer`` fenced by a newer trainer of its run exits with the status that tells a launcher not to
    restart it (a restart would fence the newer one in turn), naming why. It used to record its end as a crash and
    set the run's budget to the groups trained, which shut admission for the newer trainer: its run stalled."""
    keys = Keys("fenced")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "fenced", "dir": str(tmp_path)},
        "model": {"path": str(tiny_model_dir), "init_if_missing": False},
        "redis": {"url": redis_server.url},
        "buffer": {"groups_per_step": 2},
        "trainer": {"total_steps": 4, "take_timeout_s": 0.2, "device": "cpu"},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "-c", str(config)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    r = client(redis_server)
    st = StalenessControl(r, keys, BufferConfig(groups_per_step=2))
    with reaped(proc):
        deadline = time.monotonic() + 120
        while st.budget() is None and proc.poll() is None and time.monotonic() < deadline:  # past its start
            time.sleep(0.1)
        assert st.budget() == 8
        ReplayBuffer(r, keys, BufferConfig()).fence()  # the newer trainer
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == CONFIG_ERROR_EXIT, err[-3000:]
    assert f"{keys.trainer_epoch} is 2: a newer trainer of run fenced started" in err
    assert st.budget() == 8 and r.hget(keys.trainer, "finished_reason") is None


def test_a_redis_that_lost_the_runs_keys_does_not_fence_the_live_trainer(redis_server: EmbeddedRedis) -> None:
    """Only a newer trainer fences: a Redis restarted without its data (no AOF) has no epoch, and the live
    trainer writes its own back."""
    buf = buffer(redis_server.url)
    fill(buf, ["job:0:a"])
    [(entry, group)] = buf.take(1, 0.5)
    client(redis_server).delete(KEYS.trainer_epoch)
    assert buf.ack([entry], [group.group_id]) == 1
    assert int(client(redis_server).get(KEYS.trainer_epoch)) == buf.fence()


def test_a_group_whose_ack_redis_lost_is_acked_again_not_trained_twice(redis_server: EmbeddedRedis) -> None:
    """A Redis restart with ``appendfsync everysec`` may lose the last second of writes, an ack among them: its
    entry is pending again, unconsumed. The live trainer's rescan of its own entries used to deliver it, and the
    group was trained a second time; the trainer remembers what it acked and acks it again instead."""
    buf = buffer(redis_server.url)
    r = client(redis_server)
    st = StalenessControl(r, KEYS, BufferConfig())
    fill(buf, ["job:0:a", "job:1:a"])
    first = buf.take(2, 0.5)
    assert [g.group_id for _, g in first] == ["job:0:a", "job:1:a"]
    before = {key: r.dump(key) for key in r.keys(KEYS.prefix + "*")}
    stale = first[1][1].group_id
    assert buf.ack([e for e, _ in first], [g.group_id for _, g in first], stale_group_ids=[stale]) == 2
    r.delete(*r.keys(KEYS.prefix + "*"))  # Redis comes back as it was a moment before the ack
    for key, value in before.items():
        r.restore(key, 0, value)
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 2
    time.sleep(0.3)  # past claim_idle_ms: the rescan finds the entries again
    assert buf.take(2, 0.3) == []
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0 and r.xlen(KEYS.groups) == 0
    assert r.hgetall(KEYS.group_state) == {b"job:0:a": b"t", b"job:1:a": b"t"}
    job = TaskQueue(r, KEYS, BufferConfig()).job("job")
    assert (job["trained"], job["stale_dropped"], st.trained()) == ("1", "1", 1)  # each acked with its outcome
    assert r.keys(KEYS.prefix + "payload:*") == []


def test_a_malformed_group_moved_aside_while_the_reply_was_lost_is_moved_once(redis_server: EmbeddedRedis) -> None:
    """The client runs a MULTI again when its reply is lost, and Redis had run it: the move of a malformed entry
    aside wrote it to ``groups:malformed`` twice."""
    r = client(redis_server)
    ReplayBuffer(r, KEYS, BufferConfig()).ensure_group()
    r.xadd(KEYS.groups, {"g": b"\xc1 not a group", "gid": "job:0:bad", "job": "job"})
    proxy = LoseExecReply(redis_server.port, ran=lambda: r.xlen(KEYS.groups_malformed) > 0)
    lossy = buffer(proxy.url)
    try:
        assert lossy.take(1, 0.2) == []
    finally:
        lossy.redis.close()
        proxy.close()
    assert proxy.lost  # the reply was lost and the client ran the MULTI again
    assert r.xlen(KEYS.groups_malformed) == 1 and r.xlen(KEYS.groups) == 0
    assert TaskQueue(r, KEYS, BufferConfig()).job("job")["malformed"] == "1"
