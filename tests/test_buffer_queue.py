"""The task queue against a real Redis: delivery, crash recovery, leases, failures, dead letters, bad entries."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from buffer_helpers import client, make_group

from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import TASK_GONE, ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import Deletion, TaskQueue
from core.config import BufferConfig

ROOT = Path(__file__).resolve().parents[1]
KEYS = Keys("t")

# A real consumer process: takes one task with the real TaskQueue, says which, then hangs "mid-task".
CONSUMER = """
import sys, time, redis
from buffer.keys import Keys
from buffer.task_queue import TaskQueue
from core.config import BufferConfig
queue = TaskQueue(redis.Redis.from_url(sys.argv[1]), Keys("t"), BufferConfig(claim_idle_ms=300))
entries = queue.read("doomed", 1, 5000)
print(entries[0].group_id, flush=True)
time.sleep(600)
"""


def tasks(n: int, prefix: str = "q") -> list[dict]:
    return [{"task_id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"task {i}"}]} for i in range(n)]


def queue(server: EmbeddedRedis, **cfg) -> TaskQueue:
    q = TaskQueue(client(server), KEYS, BufferConfig(**{"claim_idle_ms": 300, **cfg}))
    q.ensure_groups()
    return q


def finish(server: EmbeddedRedis, entries, cfg: BufferConfig | None = None) -> None:
    """Write each entry's group and ack its task, as a rollout server does."""
    replay = ReplayBuffer(client(server), KEYS, cfg or BufferConfig())
    replay.ensure_group()
    for e in entries:
        assert replay.put(make_group(e.job_id, e.group_id, kind=e.kind), task=e)


def written_gids(server: EmbeddedRedis) -> list[str]:
    return [f[b"gid"].decode() for _, f in client(server).xrange(KEYS.groups)]


def test_submit_read_and_finish(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    gids = q.submit("job", tasks(3), "train", spec=json.dumps({"source": {"kind": "arith", "limit": 3}}))
    assert gids == ["job:0:q0", "job:1:q1", "job:2:q2"]
    assert q.submit("job", tasks(1), "train") == ["job:3:q0"]  # resubmitting a task makes a new group
    with pytest.raises(ValueError, match="tasks\\[0\\].task_id"):
        q.submit("job", [{"messages": []}], "train")
    with pytest.raises(Exception, match="is a train job"):
        q.submit("job", tasks(1), "eval")
    entries = q.read("c1", 10)
    assert [e.group_id for e in entries] == gids + ["job:3:q0"]
    assert all(e.deliveries == 1 and e.kind == "train" for e in entries)
    assert entries[0].task == tasks(1)[0]
    job = q.job("job")
    assert (job["submitted"], job["state"], json.loads(job["spec"])["source"]["limit"]) == ("4", "running", 3)
    finish(redis_server, entries)
    job = q.job("job")
    assert (job["completed"], job["state"]) == ("4", "done")
    r = client(redis_server)
    assert r.xlen(KEYS.tasks("train")) == 0 and r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0


def test_eval_tasks_come_first_and_train_can_be_left_out(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    q.submit("tr", tasks(2, "t"), "train")
    q.submit("ev", tasks(2, "e"), "eval")
    assert [e.kind for e in q.read("c", 3)] == ["eval", "eval", "train"]
    assert q.read("c", 5, kinds=("eval",)) == []
    assert [e.group_id for e in q.read("c", 5, block_ms=50)] == ["tr:1:t1"]


def test_sigkilled_consumer_task_is_redelivered_and_written_once(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    gids = q.submit("job", tasks(3), "train")
    proc = subprocess.Popen([sys.executable, "-c", CONSUMER, redis_server.url], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        doomed = proc.stdout.readline().strip()
        assert doomed == gids[0]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < 3 and time.monotonic() < deadline:
        for e in q.read("live", 3, block_ms=100):
            got[e.group_id] = e
        assert q.renew("live", list(got.values())) == []  # as a rollout server keeps what it works on
    assert set(got) == set(gids)
    assert got[doomed].deliveries == 2 and got[gids[1]].deliveries == 1
    assert q.metrics.redeliveries.labels(stream="tasks")._value.get() == 1  # the label of the stream's depth
    finish(redis_server, got.values())
    finish(redis_server, [got[doomed]])  # a second attempt to write it changes nothing
    assert sorted(written_gids(redis_server)) == sorted(gids)
    assert q.job("job")["completed"] == "3"
    r = client(redis_server)
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0


def test_restarted_consumer_recovers_its_own_pending_tasks_at_once(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server, claim_idle_ms=600_000)
    gids = q.submit("job", tasks(3), "train")
    assert len(q.read("srv-1", 2)) == 2
    again = queue(redis_server, claim_idle_ms=600_000)  # same consumer name, new process state
    first = again.read("srv-1", 1)
    rest = again.read("srv-1", 5)
    assert [e.group_id for e in first + rest] == gids
    assert [e.deliveries for e in first + rest] == [2, 2, 1]
    assert again.read("srv-1", 5) == []  # its in-flight tasks are not handed to it twice


def test_renewed_leases_are_not_reclaimed(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server, claim_idle_ms=1000)
    q.submit("job", tasks(2), "train")
    held = q.read("busy", 2)
    for _ in range(4):
        time.sleep(0.3)
        assert q.renew("busy", held) == []
        assert q.read("other", 2) == []  # nothing idle long enough to take
    time.sleep(1.1)
    stolen = q.read("other", 1)
    assert [e.group_id for e in stolen] == [held[0].group_id]
    assert q.renew("busy", held) == [held[0]]  # the lease on the taken one is lost
    assert q.cancel(held[1])
    assert q.renew("busy", held) == [held[0]]  # one acked (finished) meanwhile is not


def test_failures_requeue_then_dead_letter_with_error(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server, max_attempts=2)
    st = StalenessControl(client(redis_server), KEYS, BufferConfig(max_staleness=0, groups_per_step=4))
    [gid] = q.submit("job", tasks(1), "train")
    [e] = q.read("c", 1)
    assert st.try_admit(gid) and st.admitted() == 1
    assert q.fail(e, "ValueError: boom 1") is False
    assert st.admitted() == 0  # the retry waits at the tail: its slot goes to the tasks before it meanwhile
    [e] = q.read("c", 1)
    assert (e.group_id, e.deliveries, e.last_error) == (gid, 2, "ValueError: boom 1")
    assert st.try_admit(gid) and st.try_admit(gid) and st.admitted() == 1  # admitted again, once
    assert q.fail(e, "ValueError: boom 2") is True
    assert q.read("c", 1) == []
    [(_, dead)] = client(redis_server).xrange(KEYS.tasks_dead)
    assert (dead[b"gid"].decode(), dead[b"error"], dead[b"deliveries"]) == (gid, b"ValueError: boom 2", b"2")
    assert st.admitted() == 0  # its admission slot was given back
    job = q.job("job")
    assert (job["dead_lettered"], job["state"]) == ("1", "done")
    assert q.metrics.dead_letters._value.get() == 1


def test_consumers_dying_repeatedly_dead_letters_the_task(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server, max_attempts=2)
    [gid] = q.submit("job", tasks(1), "train")
    assert len(q.read("dies-1", 1)) == 1
    time.sleep(0.35)
    assert [e.deliveries for e in q.read("dies-2", 1)] == [2]
    time.sleep(0.35)
    assert q.read("survivor", 1) == []  # third delivery would exceed max_attempts
    [(_, dead)] = client(redis_server).xrange(KEYS.tasks_dead)
    assert dead[b"gid"].decode() == gid and b"delivered 3 times" in dead[b"error"]


def test_hand_back_does_not_count_an_attempt(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server, max_attempts=1)
    [gid] = q.submit("job", tasks(1), "train")
    for _ in range(3):
        [e] = q.read("c", 1)
        assert (e.group_id, e.deliveries) == (gid, 1)
        q.hand_back(e)
    assert client(redis_server).xlen(KEYS.tasks_dead) == 0


def test_malformed_entries_are_moved_aside_never_crash_the_consumer(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    r = client(redis_server)
    stream = KEYS.tasks("train")
    q.submit("job", tasks(1, "a"), "train")
    r.xadd(stream, {"job_id": "job", "kind": "train", "gid": "x"})  # no task
    r.xadd(stream, {"job_id": "job", "kind": "train", "gid": "x", "task": "{not json"})
    r.xadd(stream, {"job_id": "job", "kind": "train", "gid": "x", "task": "[1, 2]"})
    r.xadd(stream, {"job_id": "job", "kind": "chores", "gid": "x", "task": "{}"})
    r.xadd(stream, {"job_id": b"\xff\xfe", "kind": "train", "gid": "x", "task": "{}"})
    r.xadd(stream, {"job_id": "job", "kind": "train", "gid": "x", "task": "{}", "attempts": "many"})
    q.submit("job", tasks(1, "b"), "train")
    got = q.read("c", 10)
    assert [e.group_id for e in got] == ["job:0:a0", "job:1:b0"]
    bad = r.xrange(KEYS.tasks_malformed)
    errors = [f[b"error"].decode() for _, f in bad]
    assert len(bad) == 6
    assert "missing field(s) task" in errors[0]
    assert "Expecting property name" in errors[1]
    assert "expected a JSON object, got list" in errors[2]
    assert "kind 'chores'" in errors[3]
    assert "utf-8" in errors[4]
    assert "invalid literal" in errors[5]
    assert bad[1][1][b"f.task"] == b"{not json"  # the raw entry is kept for inspection
    assert r.xpending(stream, ROLLOUT_GROUP)["pending"] == 2
    assert q.metrics.malformed.labels(stream="tasks")._value.get() == 6


def test_a_malformed_task_ends_for_its_job_which_then_ends_and_can_be_deleted(redis_server: EmbeddedRedis) -> None:
    """A task entry of a job that cannot be parsed (written damaged) counts ``dead_lettered`` on its job as it moves
    aside, once, so the job reads done and can be deleted; one naming a job that is gone brings no hash back."""
    q = queue(redis_server)
    r = client(redis_server)
    stream = KEYS.tasks("eval")
    q.submit("job", tasks(2), "eval")
    first, second = r.xrange(stream)
    r.xdel(stream, second[0])
    r.xadd(stream, {**second[1], b"task": b"{not json"})
    r.xadd(stream, {"job_id": "gone", "kind": "eval", "gid": "gone:0:q0", "task": "[]"})
    [entry] = q.read("c", 10)
    assert entry.entry_id == first[0].decode() and r.xlen(KEYS.tasks_malformed) == 2
    assert q.job("job")["dead_lettered"] == "1" and not r.exists(KEYS.job("gone"))
    assert q.delete_job("job") == Deletion("eval", 1)
    q.dead_letter(entry, "fails every time")
    assert q.job("job")["state"] == "done"
    assert q.delete_job("job") == Deletion("eval", 0)


def test_a_deleted_jobs_dead_letters_and_malformed_groups_go_with_it(redis_server: EmbeddedRedis) -> None:
    """``tasks:dead`` and ``groups:malformed`` are the run's: a job's entries there are found through its index of
    entries (no stream is read whole) and deleted with it, another job's stay; the index goes too."""
    q = queue(redis_server)
    r = client(redis_server)
    q.submit("job", tasks(3), "train")
    q.submit("other", tasks(2, "o"), "train")
    first, second, third, other_first, other_second = q.read("c", 5)
    assert q.dead_letter(first, "fails every time") and q.dead_letter(other_first, "fails every time")
    finish(redis_server, [second, other_second])
    trainer = ReplayBuffer(client(redis_server), KEYS, BufferConfig())
    for entry_id, _ in trainer.take(2, 5.0):
        trainer.reject(entry_id, "its model cannot train on it")
    assert q.cancel_job("job") == "cancelled" and q.cancel(third)
    assert r.xlen(KEYS.tasks_dead) == 2 and r.xlen(KEYS.groups_malformed) == 2

    assert q.delete_job("job") == Deletion("train", 0)
    assert [f[b"job_id"] for _, f in r.xrange(KEYS.tasks_dead)] == [b"other"]
    assert [f[b"f.job"] for _, f in r.xrange(KEYS.groups_malformed)] == [b"other"]
    assert not r.exists(KEYS.job("job"), KEYS.entries("job"))
    assert r.scard(KEYS.entries("other")) == 2


def test_tasks_deleted_while_pending_are_acked_away(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    r = client(redis_server)
    q.submit("job", tasks(2), "train")
    held = q.read("gone", 2)
    r.xdel(KEYS.tasks("train"), held[0].entry_id)
    time.sleep(0.35)
    assert [e.group_id for e in q.read("c", 5)] == [held[1].group_id]
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 1


def test_cancelled_job_state_is_kept_on_submit(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    q.submit("job", tasks(1), "train")
    client(redis_server).hset(KEYS.job("job"), "state", "cancelled")
    q.submit("job", tasks(1), "train")
    assert q.job("job")["state"] == "cancelled"


def test_a_task_finished_elsewhere_takes_no_admission_slot(redis_server: EmbeddedRedis) -> None:
    q = queue(redis_server)
    st = StalenessControl(client(redis_server), KEYS, BufferConfig(max_staleness=0, groups_per_step=2))
    [gid] = q.submit("job", tasks(1), "train")
    [held] = q.read("frozen", 1)  # read, then frozen (SIGSTOP) before its admission
    time.sleep(0.4)
    [taken] = q.read("live", 1)  # idle past claim_idle_ms: another server reclaims it, is admitted and finishes
    assert taken.group_id == held.group_id == gid and st.try_admit(gid)
    finish(redis_server, [taken])
    assert st.admitted() == 1 and client(redis_server).hlen(KEYS.admitted_ids) == 0
    assert st.try_admit(gid)  # the frozen server resumes: its copy runs, but holds no slot
    finish(redis_server, [held])  # and its duplicate changes nothing
    assert st.admitted() == 1 and client(redis_server).hlen(KEYS.admitted_ids) == 0
    assert st.capacity() == 1  # the bound of 2 still has room for the next group
    assert written_gids(redis_server) == [gid] and client(redis_server).xlen(KEYS.tasks("train")) == 0


@pytest.mark.parametrize("ending", ["fail", "dead_letter", "cancel", "hand_back"])
def test_a_late_group_of_a_task_another_worker_ended_is_not_written(redis_server: EmbeddedRedis, ending: str) -> None:
    """A worker frozen past its lease resumes after another worker ended its task (failed and requeued it,
    dead-lettered it, cancelled it, handed it back): its group is not written, so the job counts the task once
    and the admission slot the ending gave back stays given back."""
    q = queue(redis_server, max_attempts=3 if ending != "dead_letter" else 2)
    r = client(redis_server)
    st = StalenessControl(r, KEYS, BufferConfig(max_staleness=0, groups_per_step=4))
    replay = ReplayBuffer(r, KEYS, BufferConfig())
    replay.ensure_group()
    [gid] = q.submit("job", tasks(1), "train")
    [frozen] = q.read("frozen", 1)
    assert st.try_admit(gid)
    time.sleep(0.4)
    [live] = q.read("live", 1)  # reclaimed: the frozen worker's lease is lost
    assert live.group_id == gid and live.deliveries == 2
    {"fail": lambda: q.fail(live, "engine error"), "dead_letter": lambda: q.fail(live, "engine error"),
     "cancel": lambda: q.cancel(live), "hand_back": lambda: q.hand_back(live)}[ending]()
    before = (q.job("job"), st.admitted(), r.hlen(KEYS.admitted_ids))
    assert replay.try_put(make_group("job", gid), frozen) == TASK_GONE
    assert replay.put(make_group("job", gid), frozen) is False
    assert (q.job("job"), st.admitted(), r.hlen(KEYS.admitted_ids)) == before  # nothing counted, no slot taken
    assert r.xlen(KEYS.groups) == 0 and r.keys(KEYS.payload("*", "*")) == [] and not r.hexists(KEYS.group_state, gid)
    assert replay.metrics.task_gone_dropped._value.get() == 2
    again = q.read("live", 1)
    if ending in ("fail", "hand_back"):  # requeued: rolled out again, written once
        assert [e.group_id for e in again] == [gid]
        finish(redis_server, again)
        assert written_gids(redis_server) == [gid] and q.job("job")["completed"] == "1"
    else:
        job = q.job("job")
        assert again == [] and job["cancelled" if ending == "cancel" else "dead_lettered"] == "1"
        assert "completed" not in job and st.admitted() == 0


def test_a_live_consumer_takes_back_a_task_it_left_pending_not_one_it_renews(redis_server: EmbeddedRedis) -> None:
    """A task a live server dropped without an ack (Redis out of reach past its retries) comes back to that
    server once idle ``claim_idle_ms``, so a server alone still finishes its job; a task it renews does not."""
    q = queue(redis_server, claim_idle_ms=1000)
    [left, busy] = q.submit("job", tasks(2), "train")
    [e_left, e_busy] = q.read("alone", 2)
    assert q.read("alone", 2) == []  # the start-up scan of its own entries is done; nothing is idle yet
    for _ in range(3):
        time.sleep(0.4)
        assert q.renew("alone", [e_busy]) == []
    [back] = q.read("alone", 2)
    assert (back.group_id, back.deliveries) == (left, 2)
    assert e_left.group_id == left and e_busy.group_id == busy
    assert q.read("alone", 2) == []  # taken back once
