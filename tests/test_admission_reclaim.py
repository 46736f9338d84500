"""Admission of a train task whose rollout server froze past its lease (SIGSTOP, a GC pause) against a real Redis:
another server reclaims the task and ends it (writes its group, which may then be trained and leave the dedup window;
cancels it with its job; dead-letters it). The frozen server, when it wakes, must take no admission slot for it: a slot
taken then was given back by nothing (its put and its ack are refused, as it no longer holds the task), and admission
shrank for good."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
from buffer_helpers import client, make_group

from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.redis_server import EmbeddedRedis
from buffer.replay import ReplayBuffer
from buffer.staleness import LeaseLost, StalenessControl
from buffer.task_queue import TaskEntry, TaskQueue
from core.config import BufferConfig, RolloutConfig
from core.tasks import load_tasks
from rollout_server.engine_client import EngineClient
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker

KEYS = Keys("t")
CFG = BufferConfig(max_staleness=0, groups_per_step=4, dedup_window=1)
ENDINGS = ["finish", "trained", "cancel", "dead_letter"]


def submit(r: redis.Redis) -> str:
    """One train task of job ``job``; returns its group id."""
    queue = TaskQueue(r, KEYS, CFG)
    queue.ensure_groups()
    ReplayBuffer(r, KEYS, CFG).ensure_group()
    [gid] = queue.submit("job", [t.model_dump(mode="json") for t in load_tasks("arith", split="train", limit=1)],
                         "train")
    return gid


def take_over(server: EmbeddedRedis, frozen: TaskEntry, ending: str) -> int:
    """The live server: the frozen one's task, idle past buffer.claim_idle_ms (XCLAIM's IDLE, to the same consumer), is
    reclaimed and ended as ``ending`` says (``trained``: its group written, trained, and out of the dedup window of 1,
    another group consumed after it). Returns how many groups are admitted after."""
    r = client(server)
    r.xclaim(frozen.stream, ROLLOUT_GROUP, frozen.consumer, 0, [frozen.entry_id], idle=10 * CFG.claim_idle_ms,
             justid=True)
    queue = TaskQueue(r, KEYS, CFG)
    [live] = queue.read("live", 1)
    assert (live.group_id, live.deliveries) == (frozen.group_id, 2)
    staleness = StalenessControl(r, KEYS, CFG)
    if ending == "cancel":
        assert queue.cancel_job(live.job_id) == "cancelled" and queue.cancel(live)
    elif ending == "dead_letter":
        assert queue.dead_letter(live, "the prompt leaves no room to generate")
    else:
        assert staleness.try_admit(live.group_id)
        replay = ReplayBuffer(r, KEYS, CFG)
        assert replay.put(make_group(live.job_id, live.group_id), live)
        if ending == "trained":
            replay.put_many([make_group("other", "other:0:x")])
            taken = replay.take(2, 5.0)
            assert replay.ack([e for e, _ in taken], [g.group_id for _, g in taken]) == 2
            assert not r.hexists(KEYS.group_state, live.group_id)
    return staleness.admitted()


class FreezesBeforeAdmission(redis.Redis):
    """The frozen server's Redis client: runs ``meanwhile`` once, right before the server's first admission call (the
    EVALSHA of ``admit_sha``): the server froze after it read its task and found its job running, and woke only after
    ``meanwhile``."""

    admit_sha = ""
    meanwhile: Callable[[], None] | None = None

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "EVALSHA" and args[1] == self.admit_sha and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        return super().execute_command(*args, **options)


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_server_woken_after_its_task_was_taken_over_takes_no_admission_slot(
    redis_server: EmbeddedRedis, tokenizer: Any, caplog: pytest.LogCaptureFixture, ending: str
) -> None:
    """A rollout server reads a train task and freezes before its admission; another server takes the task over and
    ends it. When the frozen one wakes, its admission is refused (it no longer holds the task), logged and counted:
    it takes no slot (before, it took one whenever the group id was neither admitted nor written, its task cancelled,
    dead-lettered, or trained and out of the dedup window), and it rolls nothing out (before, it generated the whole
    group for a put that was then refused, or dropped as a duplicate)."""
    r = client(redis_server)
    gid = submit(r)
    frozen_client = FreezesBeforeAdmission.from_url(redis_server.url)
    worker = RolloutWorker(frozen_client, "t", RolloutConfig(server_id="frozen"), CFG,
                           [EngineClient("http://127.0.0.1:9", retries=0)], tokenizer, ToolRegistry.from_file(None))
    [entry] = worker.tasks.read(worker.consumer, 1)
    admitted: list[int] = []
    frozen_client.admit_sha = worker.staleness._admit.sha
    frozen_client.meanwhile = lambda: admitted.append(take_over(redis_server, entry, ending))
    try:
        with caplog.at_level(logging.WARNING):
            asyncio.run(worker._handle(entry))
    finally:
        asyncio.run(worker.engines[0].aclose())
        worker._pool.shutdown(wait=True)

    assert admitted == [0 if ending in ("cancel", "dead_letter") else 1]  # the live server took the task over
    assert StalenessControl(r, KEYS, CFG).admitted() == admitted[0] and not r.hexists(KEYS.admitted_ids, gid)
    assert worker.engine_down is None  # its engine (no one serves that port) was never asked: nothing rolled out
    assert worker.buffer_metrics.task_gone_dropped._value.get() == 1
    assert f"group {gid}: not admitted: its task {entry.entry_id} is no longer held by frozen" in caplog.text
    assert r.xpending(KEYS.tasks("train"), ROLLOUT_GROUP)["pending"] == 0


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_slot_taken_before_the_freeze_goes_with_the_task(redis_server: EmbeddedRedis, ending: str) -> None:
    """Admitted while it held its task, then frozen: the slot is its group id's, on which the server that took the task
    over is admitted at no cost, and which that server's ending moves to the group written or gives back. The woken
    server's put writes nothing (a duplicate, or refused: its task is gone) and its admission, asked again, is refused:
    no slot is left taken (this order leaked none before either)."""
    r = client(redis_server)
    gid = submit(r)
    queue = TaskQueue(r, KEYS, CFG)
    staleness = StalenessControl(r, KEYS, CFG)
    [frozen] = queue.read("frozen", 1)
    assert staleness.try_admit(gid, task=frozen) and staleness.try_admit(gid, task=frozen)
    assert staleness.admitted() == 1

    admitted = take_over(redis_server, frozen, ending)
    assert admitted == (0 if ending in ("cancel", "dead_letter") else 1)
    replay = ReplayBuffer(r, KEYS, CFG)
    assert replay.put(make_group("job", gid), frozen) is (ending == "finish")
    with pytest.raises(LeaseLost, match="no longer held by frozen .*: the task was ended since"):
        staleness.try_admit(gid, task=frozen)
    assert staleness.admitted() == admitted and not r.hexists(KEYS.admitted_ids, gid)
    assert [f[b"gid"].decode() for _, f in r.xrange(KEYS.groups)] == ([gid] if ending == "finish" else [])
    assert staleness.metrics.task_gone_dropped._value.get() == 1


def test_a_refused_admission_names_the_server_that_took_the_task_over(redis_server: EmbeddedRedis) -> None:
    """Frozen past its lease, a server's task is taken over by another that still holds it: the refusal names that
    server (it said only that someone took it over or ended it), takes no slot and is counted."""
    r = client(redis_server)
    gid = submit(r)
    queue = TaskQueue(r, KEYS, CFG)
    staleness = StalenessControl(r, KEYS, CFG)
    [frozen] = queue.read("frozen", 1)
    r.xclaim(frozen.stream, ROLLOUT_GROUP, frozen.consumer, 0, [frozen.entry_id], idle=10 * CFG.claim_idle_ms,
             justid=True)
    [live] = queue.read("live", 1)
    assert live.group_id == gid
    with pytest.raises(LeaseLost, match=f"its task {frozen.entry_id} is no longer held by frozen .*: live took the "
                                         "task over and holds it"):
        staleness.try_admit(gid, task=frozen)
    assert staleness.admitted() == 0 and staleness.metrics.task_gone_dropped._value.get() == 1
    assert staleness.try_admit(gid, task=live) and staleness.admitted() == 1
