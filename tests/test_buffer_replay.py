"""The replay buffer against a real Redis: exactly-once training over at-least-once delivery, backpressure,
bad entries, eval routing, and durability across a Redis restart with AOF."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
from buffer_helpers import client, make_group

from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import BufferClosed, ReplayBuffer
from buffer.schema import encode_group
from buffer.staleness import StalenessControl, split_stale
from buffer.task_queue import TaskQueue
from core.config import BufferConfig

ROOT = Path(__file__).resolve().parents[1]
KEYS = Keys("t")

# A real trainer process: takes a batch with the real ReplayBuffer, says which groups, then dies before acking.
TRAINER = """
import sys, time, redis
from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from core.config import BufferConfig
buf = ReplayBuffer(redis.Redis.from_url(sys.argv[1]), Keys("t"), BufferConfig(claim_idle_ms=300), sys.argv[2])
batch = buf.take(int(sys.argv[3]), 10)
print(" ".join(g.group_id for _, g in batch), flush=True)
time.sleep(600)
"""


def buffer(server: EmbeddedRedis, consumer: str = "trainer", **cfg) -> ReplayBuffer:
    buf = ReplayBuffer(client(server), KEYS, BufferConfig(**{"claim_idle_ms": 300, **cfg}), consumer)
    buf.ensure_group()
    return buf


def fill(buf: ReplayBuffer, n: int, job: str = "job") -> list[str]:
    gids = [f"{job}:{i}:x" for i in range(n)]
    assert buf.put_many([make_group(job, g) for g in gids]) == [1] * n
    return gids


def train_until(buf: ReplayBuffer, want: int, trained: list[str], timeout_s: float = 20.0) -> None:
    """Take, 'train' (record ids) and ack until ``want`` groups were trained or the time is up."""
    deadline = time.monotonic() + timeout_s
    while len(trained) < want and time.monotonic() < deadline:
        batch = buf.take(want, 0.2)
        trained += [g.group_id for _, g in batch]
        buf.ack([i for i, _ in batch], [g.group_id for _, g in batch])


def kill_trainer_mid_batch(server: EmbeddedRedis, consumer: str, n: int) -> list[str]:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, server.url, consumer, str(n)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        taken = proc.stdout.readline().split()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    return taken


def test_put_take_ack_round_trip(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server)
    group = make_group("job", "job:0:x", n=3, tokens=40, version=2, reward=0.5)
    assert buf.put(group)
    [(entry_id, got)] = buf.take(5, 0.1)
    assert got.group_id == group.group_id and got.oldest_version() == 2
    for a, b in zip(got.samples, group.samples, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert buf.ack([entry_id], [got.group_id]) == 1
    assert buf.ack([entry_id], [got.group_id]) == 0  # idempotent
    job = TaskQueue(client(redis_server), KEYS, BufferConfig()).job("job")
    assert (job["completed"], job["trained"], float(job["reward_sum"])) == ("1", "1", 1.5)
    assert client(redis_server).xlen(KEYS.groups) == 0  # acked entries leave the stream
    with pytest.raises(ValueError, match="2 entry ids but 1 group ids"):
        buf.ack(["1-0", "2-0"], ["a"])


@pytest.mark.parametrize("same_name", [True, False], ids=["restarted-same-name", "new-trainer"])
def test_trainer_dies_before_ack_groups_come_back_and_train_once(redis_server: EmbeddedRedis, same_name: bool) -> None:
    gids = fill(buffer(redis_server, "producer"), 5)
    taken = kill_trainer_mid_batch(redis_server, "trainer", 3)
    assert taken == gids[:3]
    buf = buffer(redis_server, "trainer" if same_name else "trainer-2")
    trained: list[str] = []
    train_until(buf, 5, trained)
    assert sorted(trained) == sorted(gids)  # every group once, the dead trainer's batch included
    assert buf.take(5, 0.5) == []
    assert TaskQueue(client(redis_server), KEYS, BufferConfig()).job("job")["trained"] == "5"
    assert buf.metrics.redeliveries.labels(stream="groups")._value.get() == 3


def test_the_live_trainer_finds_again_a_group_whose_ack_redis_lost(redis_server: EmbeddedRedis) -> None:
    """An entry pending for this consumer that the live process does not hold (its ack was lost in a Redis
    restart with appendfsync everysec) comes back within ``claim_idle_ms``; entries it holds do not."""
    buf = buffer(redis_server)
    r = client(redis_server)
    [held] = fill(buf, 1, job="a")
    assert [g.group_id for _, g in buf.take(1, 0.1)] == [held]  # the start-up scan of own entries is done
    fill(buf, 1, job="b")
    r.xreadgroup(TRAINER_GROUP, "trainer", {KEYS.groups: ">"}, count=1)  # pending as ours, unknown to buf
    time.sleep(0.4)
    [(entry_id, got)] = buf.take(5, 0.5)
    assert got.group_id == "b:0:x"  # not the held group again
    assert buf.metrics.redeliveries.labels(stream="groups")._value.get() == 1
    assert buf.ack([entry_id], [got.group_id]) == 1


def test_groups_state_keeps_the_last_dedup_window_consumed_ids(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server, dedup_window=2)
    r = client(redis_server)
    gids = fill(buf, 5)
    trained: list[str] = []
    train_until(buf, 5, trained)
    assert r.hgetall(KEYS.group_state) == {b"job:3:x": b"t", b"job:4:x": b"t"}  # bounded, newest kept
    assert r.lrange(KEYS.groups_consumed, 0, -1) == [b"job:3:x", b"job:4:x"]
    assert buf.put_many([make_group("job", gids[4])]) == [0]  # a late duplicate inside the window: dropped
    assert buf.put_many([make_group("job", gids[0])]) == [1]  # one older than the window is forgotten


def test_groups_of_a_cancelled_job_are_acked_away_and_counted(redis_server: EmbeddedRedis) -> None:
    """Written but not yet trained when the job was cancelled: dropped at take, counted, slots given back."""
    buf = buffer(redis_server)
    r = client(redis_server)
    st = StalenessControl(r, KEYS, BufferConfig())
    for gid in ("gone:0:x", "gone:1:x", "kept:0:x"):
        assert st.try_admit(gid)
    fill(buf, 2, job="gone")
    fill(buf, 1, job="kept")
    r.hset(KEYS.job("gone"), "state", "cancelled")
    assert [g.group_id for _, g in buf.take(5, 0.2)] == ["kept:0:x"]
    job = TaskQueue(r, KEYS, BufferConfig()).job("gone")
    assert (job["cancelled"], job.get("trained"), job.get("dead_lettered")) == ("2", None, None)
    assert st.admitted() == 1 and r.xlen(KEYS.groups) == 1
    assert buf.metrics.cancelled.labels(stream="groups")._value.get() == 2


def test_groups_already_trained_or_held_are_skipped(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server)
    r = client(redis_server)
    g = make_group("job", "job:0:x")
    payload = encode_group(g)
    assert buf.put(g)
    [(entry_id, _)] = buf.take(1, 0.1)
    r.xadd(KEYS.groups, {"g": payload, "gid": g.group_id, "job": "job"})  # a stray copy while held
    assert buf.take(5, 0.1) == []
    buf.ack([entry_id], [g.group_id])
    r.xadd(KEYS.groups, {"g": payload, "gid": g.group_id, "job": "job"})  # a stray copy after training
    assert buf.take(5, 0.1) == []
    assert buf.metrics.duplicates_dropped._value.get() == 2
    assert r.xlen(KEYS.groups) == 0 and r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0


def test_a_group_is_written_once_and_its_task_acked(redis_server: EmbeddedRedis) -> None:
    q = TaskQueue(client(redis_server), KEYS, BufferConfig())
    q.ensure_groups()
    buf = buffer(redis_server)
    [gid] = q.submit("job", [{"task_id": "a", "messages": []}], "train")
    [entry] = q.read("srv", 1)
    assert buf.try_put(make_group("job", gid), entry) == 1
    assert buf.try_put(make_group("job", gid), entry) == 0
    assert buf.try_put(make_group("job", gid)) == 0
    with pytest.raises(ValueError, match="does not belong to task"):
        buf.try_put(make_group("job", "job:9:other"), entry)
    r = client(redis_server)
    assert r.xlen(KEYS.groups) == 1 and r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    assert q.job("job")["completed"] == "1"


def test_backpressure_bounds_the_backlog_and_never_trims(redis_server: EmbeddedRedis) -> None:
    producer = buffer(redis_server, "producer", max_groups=3)
    trainer = buffer(redis_server, max_groups=3)
    fill(producer, 3)
    g4 = make_group("job", "job:3:x")
    assert producer.try_put(g4) == -1
    assert producer.put(g4, timeout_s=0.2) is False
    assert producer.metrics.backpressure_waits._value.get() == 1
    done = threading.Event()
    waiter = threading.Thread(target=lambda: done.set() if producer.put(g4) else None)
    waiter.start()
    time.sleep(0.2)
    assert not done.is_set()  # still waiting: nothing taken yet
    batch = trainer.take(2, 0.1)  # delivered to the trainer: room for more, but nothing is trimmed
    waiter.join(10)
    assert done.is_set()
    r = client(redis_server)
    assert r.xlen(KEYS.groups) == 4 and r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 2
    assert producer.try_put(make_group("job", "job:4:x")) == 1  # backlog 2 + this one = 3
    assert producer.try_put(make_group("job", "job:5:x")) == -1
    trainer.ack([i for i, _ in batch], [g.group_id for _, g in batch])
    assert r.xlen(KEYS.groups) == 3  # only acked entries ever leave


def test_close_wakes_a_waiting_put(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server, max_groups=1)
    fill(buf, 1)
    errors: list[BaseException] = []

    def put() -> None:
        try:
            buf.put(make_group("job", "job:1:x"))
        except BufferClosed as exc:
            errors.append(exc)

    t = threading.Thread(target=put)
    t.start()
    time.sleep(0.1)
    buf.close()
    t.join(5)
    assert len(errors) == 1 and "job:1:x" in str(errors[0])


def test_malformed_group_entries_are_moved_aside(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server)
    r = client(redis_server)
    fill(buf, 1)
    r.xadd(KEYS.groups, {"gid": "nope"})
    r.xadd(KEYS.groups, {"g": b"\xc1\xc1garbage", "gid": "bad"})
    r.xadd(KEYS.groups, {"g": msgpack.packb({"schema_version": 0}), "gid": "old"})  # a newer one waits for its trainer
    r.xadd(KEYS.groups, {"p": KEYS.payload("gone", "0"), "gid": "gone"})  # its payload key was lost
    fill(buf, 2, job="later")
    got = buf.take(10, 0.2)
    assert [g.group_id for _, g in got] == ["job:0:x", "later:0:x", "later:1:x"]
    errors = [f[b"error"].decode() for _, f in r.xrange(KEYS.groups_malformed)]
    assert "missing field p (the payload key) or g (the group)" in errors[0]
    assert "not valid msgpack" in errors[1]
    assert "schema_version 0 is not supported" in errors[2]
    assert f"payload key {KEYS.payload('gone', '0')} is missing" in errors[3]
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 3
    assert buf.metrics.malformed.labels(stream="groups")._value.get() == 4


def test_a_malformed_group_gives_its_admission_slot_back_and_counts_for_its_job(
    redis_server: EmbeddedRedis,
) -> None:
    """A group that will never train (its payload lost, or written by a producer of another schema) must not hold
    its admission slot for good: with a budget of one group, admission would stay shut for the rest of the run."""
    buf = buffer(redis_server)
    r = client(redis_server)
    st = StalenessControl(r, KEYS, BufferConfig())
    st.set_budget(1)
    assert st.try_admit("job:0:x") and not st.try_admit("job:1:x")
    fill(buf, 1)
    [payload_key] = r.keys(KEYS.payload("*", "*"))
    r.set(payload_key, b"\xc1 not a group")
    r.xadd(KEYS.groups, {"gid": "job:1:y", "job": "job"})  # an entry without its payload field
    r.xadd(KEYS.groups, {"g": b"\xc1"})  # nor a gid: acked all the same, marks no id
    assert buf.take(5, 0.2) == []
    assert r.xlen(KEYS.groups_malformed) == 3 and r.xlen(KEYS.groups) == 0
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0 and not r.exists(payload_key)
    [(_, moved), *_] = r.xrange(KEYS.groups_malformed)
    assert moved[b"payload"] == b"\xc1 not a group"  # kept aside with the entry
    assert TaskQueue(r, KEYS, BufferConfig()).job("job")["malformed"] == "2"
    assert st.admitted() == 0 and st.try_admit("job:2:x")  # the slots came back
    assert r.hgetall(KEYS.group_state) == {b"job:0:x": b"t", b"job:1:y": b"t"}  # a late copy is a duplicate
    assert buf.metrics.malformed.labels(stream="groups")._value.get() == 3


@pytest.mark.parametrize("stored", ["payload-key", "inline"])
def test_group_with_a_wrong_field_type_is_moved_aside_and_the_rest_of_the_read_delivered(
    stored: str, redis_server: EmbeddedRedis,
) -> None:
    """A producer bug (``prompt_len: "8"``) between good groups of one read costs that entry only: the good
    ones are delivered by the same take and acked as usual, none left pending behind it. The entry is moved
    aside with its payload (from its payload key, which goes; or inline, as entries were once written)."""
    buf = buffer(redis_server)
    r = client(redis_server)
    fill(buf, 1)
    wire = msgpack.unpackb(encode_group(make_group("job", "job:1:bad")))
    wire["samples"][0]["prompt_len"] = "8"
    bad = msgpack.packb(wire)
    key = KEYS.payload("job:1:bad", "0")
    if stored == "payload-key":  # the fields and key a put writes
        r.set(key, bad)
        r.xadd(KEYS.groups, {"p": key, "gid": "job:1:bad", "job": "job"})
    else:
        r.xadd(KEYS.groups, {"g": bad, "gid": "job:1:bad", "job": "job"})
    fill(buf, 2, job="later")
    got = buf.take(10, 0.2)
    assert [g.group_id for _, g in got] == ["job:0:x", "later:0:x", "later:1:x"]
    [(_, moved)] = r.xrange(KEYS.groups_malformed)
    assert "group job:1:bad.samples[0].prompt_len: expected an int, got str" in moved[b"error"].decode()
    assert moved[b"payload" if stored == "payload-key" else b"f.g"] == bad and moved[b"f.gid"] == b"job:1:bad"
    assert not r.exists(key)
    assert buf.metrics.malformed.labels(stream="groups")._value.get() == 1
    assert buf.ack([i for i, _ in got], [g.group_id for _, g in got]) == 3
    assert r.xpending(KEYS.groups, TRAINER_GROUP)["pending"] == 0 and r.xlen(KEYS.groups) == 0
    assert buf.take(10, 0.1) == []


def test_eval_groups_go_to_their_job_stream_unbounded(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server, max_groups=1)
    for i in range(3):
        assert buf.try_put(make_group("ev", f"ev:{i}:x", kind="eval", n=1)) == 1
    r = client(redis_server)
    assert r.xlen(KEYS.eval("ev")) == 3 and r.xlen(KEYS.groups) == 0
    assert buf.take(5, 0.1) == []
    with pytest.raises(ValueError, match="rewards .* are not all finite"):
        buf.try_put(make_group("job", "job:0:x", reward=float("nan")))


def test_eval_group_ids_stay_in_the_dedup_window_only(redis_server: EmbeddedRedis) -> None:
    """An eval group is finished once written: its id enters the bounded de-duplication record at once, so
    periodic evals do not grow ``groups:state`` for the life of the run."""
    buf = buffer(redis_server, dedup_window=2)
    r = client(redis_server)
    for i in range(5):
        assert buf.try_put(make_group("ev", f"ev:{i}:x", kind="eval", n=1)) == 1
    assert r.hgetall(KEYS.group_state) == {b"ev:3:x": b"w", b"ev:4:x": b"w"}
    assert r.lrange(KEYS.groups_consumed, 0, -1) == [b"ev:3:x", b"ev:4:x"]
    assert buf.try_put(make_group("ev", "ev:4:x", kind="eval", n=1)) == 0  # a late duplicate inside the window
    fill(buf, 1)
    train_until(buf, 1, [])
    assert r.hgetall(KEYS.group_state) == {b"ev:4:x": b"w", b"job:0:x": b"t"}  # one window for both kinds
    assert r.xlen(KEYS.eval("ev")) == 5


def test_stale_groups_acked_release_admission(redis_server: EmbeddedRedis) -> None:
    buf = buffer(redis_server)
    st = StalenessControl(client(redis_server), KEYS, BufferConfig(max_staleness=0, groups_per_step=2))
    assert st.try_admit("job:0:x") and st.try_admit("job:1:x") and not st.try_admit("job:2:x")
    r = client(redis_server)
    buf.put_many([make_group("job", "job:0:x", version=0), make_group("job", "job:1:x", version=1)])
    st.set_version(1, trained=0)
    batch = buf.take(2, 0.1)
    fresh, stale = split_stale(batch, st.version(), st.max_staleness, st.metrics)
    assert [g.group_id for _, g in stale] == ["job:0:x"] and len(fresh) == 1
    buf.ack([i for i, _ in batch], [g.group_id for _, g in batch], stale_group_ids=["job:0:x"])
    job = TaskQueue(r, KEYS, BufferConfig()).job("job")
    assert (job["trained"], job["stale_dropped"]) == ("1", "1")
    assert st.admitted() == 1 and st.metrics.stale_dropped._value.get() == 1


@pytest.mark.parametrize("fsync,crash", [("always", True), ("everysec", False)], ids=["sigkill", "restart"])
def test_redis_restart_with_aof_loses_no_acked_group_and_no_pending_task(
    tmp_path: Path, fsync: str, crash: bool
) -> None:
    server = EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync=fsync).start()
    try:
        r = client(server)
        q = TaskQueue(r, KEYS, BufferConfig(claim_idle_ms=600_000))
        q.ensure_groups()
        buf = ReplayBuffer(r, KEYS, BufferConfig())
        buf.ensure_group()
        st = StalenessControl(r, KEYS, BufferConfig(max_staleness=1, groups_per_step=4))
        gids = q.submit("job", [{"task_id": f"t{i}", "messages": []} for i in range(4)], "train")
        entries = q.read("srv", 3)
        for e in entries:
            assert st.try_admit(e.group_id)
        assert buf.put(make_group("job", gids[0]), entries[0])
        assert buf.put(make_group("job", gids[1]), entries[1])
        [(trained_entry, trained), _held] = buf.take(2, 0.1)
        buf.ack([trained_entry], [trained.group_id])  # group 1 is taken but not acked
        before = q.job("job")
        server.kill() if crash else server.stop()
        server.start()
        # The same objects carry on: the client reconnects and the scripts are reloaded.
        assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 1  # task 2, still held by srv
        assert q.job("job") == before
        assert st.admitted() == 3
        assert buf.take(5, 0.1) == []  # group 0 stays consumed; group 1 is still held by this trainer
        again = ReplayBuffer(r, KEYS, BufferConfig(), "trainer")  # a restarted trainer gets its batch back
        assert [g.group_id for _, g in again.take(5, 0.1)] == [gids[1]]
        srv = TaskQueue(r, KEYS, BufferConfig(claim_idle_ms=600_000))  # a restarted server gets task 2 back
        assert [e.group_id for e in srv.read("srv", 5)] == [gids[2], gids[3]]
        assert r.hget(KEYS.group_state, gids[0]) == b"t"
        r.close()
    finally:
        server.stop()


def test_payload_keys_live_exactly_as_long_as_their_entries(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put stores its encoded group under a key of its own, outside Lua. The key goes when its entry is acked
    (trained, or dropped for a cancelled job) or moved aside, and right away when the put is refused (full) or
    is a duplicate; a duplicate never touches the written copy's key, and a MULTI that runs twice (a client
    retrying after a lost reply: same payload key) keeps it."""
    buf = buffer(redis_server, max_groups=2)
    r = client(redis_server)

    def payloads() -> list[bytes]:
        return sorted(r.keys(KEYS.prefix + "payload:*"))

    assert buf.try_put(make_group("job", "job:0:x")) == 1 and buf.try_put(make_group("job", "job:1:x")) == 1
    assert len(payloads()) == 2
    assert buf.try_put(make_group("job", "job:2:x")) == -1 and len(payloads()) == 2  # full: its key went at once
    assert buf.try_put(make_group("job", "job:0:x", reward=0.0)) == 0 and len(payloads()) == 2  # a duplicate
    [(entry, fields)] = r.xrange(KEYS.groups, count=1)
    monkeypatch.setattr("buffer.replay.secrets.token_hex", lambda _n: fields[b"p"].decode().rsplit(":", 1)[1])
    assert buf.try_put(make_group("job", "job:0:x")) == 0 and len(payloads()) == 2  # the same MULTI again
    monkeypatch.undo()
    got = buf.take(2, 0.5)
    assert [g.group_id for _, g in got] == ["job:0:x", "job:1:x"] and got[0][0] == entry.decode()
    assert float(got[0][1].rewards.sum()) == 2.0  # the copy written first, not the duplicate's
    assert buf.ack([got[0][0]], [got[0][1].group_id]) == 1 and len(payloads()) == 1
    r.hset(KEYS.job("job"), "state", "cancelled")
    assert buf.try_put(make_group("job", "job:3:x")) == 1  # taken back, the trained one made room
    assert buf.take(2, 0.2) == [] and len(payloads()) == 1  # job:3:x acked away unread, its key too
    assert buf.ack([got[1][0]], [got[1][1].group_id]) == 1 and payloads() == []  # the one still held
    r.xadd(KEYS.groups, {"p": KEYS.payload("job:4:x", "0"), "gid": "job:4:x"})  # a payload that will not decode
    r.set(KEYS.payload("job:4:x", "0"), b"\xc1")
    assert buf.take(1, 0.2) == [] and payloads() == [] and r.xlen(KEYS.groups_malformed) == 1
    assert buf.try_put(make_group("job2", "job2:5:x")) == 1
    [(entry, group)] = buf.take(1, 0.5)
    other = buffer(redis_server, "trainer-2")  # an ack from a trainer that never read the entry: the script does
    assert other.ack([entry], [group.group_id]) == 1 and payloads() == []
    assert r.hget(KEYS.job("job2"), "trained") == b"1"  # the job, too, read from the entry


def test_a_user_confined_to_the_runs_keys_puts_takes_and_acks(redis_server: EmbeddedRedis) -> None:
    """Compose and Helm log the components in as an ACL user that may touch ``rw:*`` keys only, which Redis checks
    for every key a script names: train and eval groups go through put, take and ack as that user, their tasks
    acked, and the jobs count them."""
    password = "u" * 40
    client(redis_server).acl_setuser("rollwave", enabled=True, passwords=[f"+{password}"], keys=["rw:*"],
                                     channels=["*"], commands=["+@all", "-@admin", "-@dangerous"])
    user = redis.Redis.from_url(redis_server.url, username="rollwave", password=password)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("elsewhere", 1)
    q = TaskQueue(user, KEYS, BufferConfig())
    q.ensure_groups()
    buf = ReplayBuffer(user, KEYS, BufferConfig(), "trainer")
    buf.ensure_group()
    for kind in ("train", "eval"):
        [gid] = q.submit(kind, [{"task_id": "a", "messages": []}], kind)
        [entry] = q.read("srv", 1, kinds=(kind,))
        assert buf.try_put(make_group(kind, gid, kind=kind, n=1), entry) == 1
    [(entry_id, group)] = buf.take(5, 0.1)
    assert buf.ack([entry_id], [group.group_id]) == 1
    assert q.job("train")["trained"] == "1" and q.job("eval")["completed"] == "1"
    assert user.xlen(KEYS.eval("eval")) == 1
    assert user.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0
    assert user.xpending(KEYS.tasks("eval"), ROLLOUT_GROUP)["pending"] == 0
    user.close()
