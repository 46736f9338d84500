"""``DELETE /v1/jobs/{id}`` and ``rollwave jobs delete`` over real HTTP against a real Redis: a finished job goes with
every key the run kept of it, in one step, and a cancelled one with its tasks and groups that no live rollout server
or trainer holds; a running one, or one a live consumer holds some of, is refused (409) saying what is left; late
writes of a rollout server or the trainer bring nothing of it back; its submit's idempotency key is free again."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from buffer import task_queue
from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import Deletion, TaskEntry, TaskQueue
from core.config import BufferConfig, RolloutConfig
from rollout_server.engine_client import EngineClient
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker
from services.cli import build_parser, main
from tests.buffer_helpers import make_group
from tests.http_harness import serve_app
from tests.test_api import TOKEN, _metric, _refused, serve
from tests.test_cli_submit_retry import LostReply
from trainer.metrics import RedisStatus, TrainerLease

EVAL = {"kind": "eval", "source": {"kind": "arith", "limit": 2}}
TRAIN = {"kind": "train", "source": {"kind": "arith", "limit": 2}}


class Run:
    """One run's API and the parts around it: a rollout server (a real ``RolloutWorker``, whose puts write the
    groups and log their samples; its engine is never called) and the trainer's side of the buffer."""

    def __init__(self, redis_url: str, api: httpx.Client, tokenizer: Any) -> None:
        self.api = api
        self.keys = Keys(api.run)  # type: ignore[attr-defined]
        self.redis = redis.Redis.from_url(redis_url)
        self.queue = TaskQueue(self.redis, self.keys, BufferConfig())
        self.worker = RolloutWorker(redis.Redis.from_url(redis_url), self.keys.run, RolloutConfig(server_id="srv"),
                                    BufferConfig(), [EngineClient("http://127.0.0.1:9")], tokenizer,
                                    ToolRegistry.from_file(None))
        self.trainer = ReplayBuffer(self.redis, self.keys, BufferConfig(), consumer="trainer")
        self.trainer.ensure_group()
        self.leases: list[TrainerLease] = []

    def submit(self, body: dict[str, Any], key: str | None = None) -> str:
        reply = self.api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key} if key else {})
        assert reply.status_code == 201, reply.text
        return reply.json()["job_id"]

    def read(self, n: int) -> list[TaskEntry]:
        return self.queue.read("srv", n)

    def put(self, entry: TaskEntry) -> None:
        """What the rollout server does with a finished group: write it and ack its task, then log its samples."""
        group = make_group(entry.job_id, entry.group_id, run=self.keys.run, kind=entry.kind)
        asyncio.run(self.worker._put(group, entry))

    def roll_out(self, n: int) -> list[TaskEntry]:
        entries = self.read(n)
        for entry in entries:
            self.put(entry)
        return entries

    def keys_of(self, job_id: str) -> set[bytes]:
        """The run's keys named after the job, and the idempotency claims naming it."""
        named = {k for k in self.redis.keys(f"{self.keys.prefix}*") if job_id.encode() in k}
        claims = {k for k in self.redis.keys(self.keys.idempotency("*"))
                  if (self.redis.get(k) or b"").startswith(f"{job_id}:".encode())}
        return named | claims

    def listed(self) -> list[str]:
        return [j["job_id"] for j in self.api.get("/v1/jobs").json()["jobs"]]

    def held_by_a_dead_server(self, entry: TaskEntry) -> None:
        """The server holding ``entry`` stopped renewing it long ago (it crashed): its idle time is set past
        ``buffer.claim_idle_ms`` (XCLAIM's IDLE, to the same consumer), so any live server would take it over."""
        self.redis.xclaim(entry.stream, ROLLOUT_GROUP, entry.consumer, 0, [entry.entry_id],
                          idle=10 * BufferConfig().claim_idle_ms, justid=True)

    def trainer_alive(self) -> TrainerLease:
        """The trainer's lease, kept as ``python -m trainer`` keeps it (renewed by its thread until ``close``)."""
        lease = TrainerLease(self.redis, self.keys, self.trainer, BufferConfig().claim_idle_ms).start()
        self.leases.append(lease)
        return lease

    def trainer_finished(self) -> None:
        RedisStatus(self.redis, self.keys).finished(4, "trainer.total_steps", 0, 0)

    def depths(self) -> dict[str, dict[str, int]]:
        """The run's streams as ``GET /v1/status`` counts them."""
        return self.api.get("/v1/status").json()["buffer"]

    def close(self) -> None:
        for lease in self.leases:
            lease.stop()
        self.worker._pool.shutdown()

    @classmethod
    @contextlib.contextmanager
    def serving(cls, redis_url: str, tokenizer: Any, name: str) -> Iterator[Run]:
        """A run named ``name`` (cut to a run name's length) with its API served, closed after."""
        with serve(redis_url, name[:60]) as api:
            parts = cls(redis_url, api, tokenizer)
            try:
                yield parts
            finally:
                parts.close()


@pytest.fixture
def run(redis_url: str, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[Run]:
    with Run.serving(redis_url, tokenizer, f"del-{request.node.name}") as parts:
        yield parts


def test_a_finished_eval_job_goes_with_every_key_of_it_and_a_second_delete_is_a_404(run: Run) -> None:
    """Its hash, its id in the index, its trajectories, its eval results and its idempotency claim: all gone in one
    delete, and nothing of another job touched. Then it is not found, not listed, and a second delete is a 404 that
    says a delete sent again finds it so."""
    job_id = run.submit(EVAL, key="eval-1")
    other = run.submit(EVAL)
    run.roll_out(1)
    assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 409  # a task of it left
    run.roll_out(1)
    assert run.api.get(f"/v1/jobs/{job_id}").json()["state"] == "done"
    fingerprint = hashlib.sha256(b"eval-1").hexdigest()
    assert run.keys_of(job_id) == {run.keys.job(job_id).encode(), run.keys.trajectories(job_id).encode(),
                                   run.keys.eval(job_id).encode(), run.keys.idempotency(fingerprint).encode()}
    assert len(run.api.get(f"/v1/jobs/{job_id}/trajectories").json()["items"]) == 4
    kept = run.keys_of(other)

    reply = run.api.delete(f"/v1/jobs/{job_id}")
    assert reply.status_code == 200 and reply.json() == {"job_id": job_id, "kind": "eval", "deleted": True}, reply.text
    assert run.keys_of(job_id) == set()
    assert not run.redis.hexists(run.keys.jobs, job_id)
    assert run.keys_of(other) == kept and run.listed() == [other]
    assert run.api.get(f"/v1/jobs/{job_id}").status_code == 404
    again = run.api.delete(f"/v1/jobs/{job_id}")
    assert again.status_code == 404 and "deleted already" in again.json()["detail"], again.text
    assert _metric(run.api, 'rollwave_api_jobs_deleted_total{kind="eval"}') == 1
    assert _refused(run.api, "not_found") == 2


def test_a_train_job_is_deleted_once_every_group_is_trained_or_dropped(
        run: Run, caplog: pytest.LogCaptureFixture) -> None:
    """Every task rolled out is not enough: while its groups wait in the buffer the delete is a 409 naming how many
    are not trained (logged and counted); once the trainer acked them (one trained, one dropped stale) it goes."""
    job_id = run.submit(TRAIN)
    run.roll_out(2)
    reply = run.api.delete(f"/v1/jobs/{job_id}")
    assert reply.status_code == 409, reply.text
    detail = reply.json()["detail"]
    assert "2 of its 2 groups are not trained yet" in detail and f"POST /v1/jobs/{job_id}/cancel" in detail, detail
    assert _refused(run.api, "not_deletable") == 1
    assert [r.getMessage() for r in caplog.records if "not_deletable" in r.getMessage()] == [
        f"refused DELETE /v1/jobs/{job_id} from 127.0.0.1: not_deletable: {detail}"]

    taken = run.trainer.take(2, 5.0)
    stale = taken[1][1].group_id
    assert run.trainer.ack([e for e, _ in taken], [g.group_id for _, g in taken], stale_group_ids=[stale]) == 2
    assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 200
    assert run.keys_of(job_id) == set() and run.listed() == []
    assert not run.redis.keys(f"{run.keys.prefix}payload:*")


def test_a_running_job_is_refused_and_a_cancelled_one_goes_with_what_is_left_of_it(run: Run) -> None:
    """Running (or ``stalled``: the trainer finished): cancel it first. Cancelled: it goes at once with its tasks not
    rolled out and its groups not trained, which no server or trainer would ever ack away once none runs (a 409
    forever); another job keeps its own."""
    job_id = run.submit({**EVAL, "source": {"kind": "arith", "limit": 3}})
    other = run.submit(EVAL)
    running = run.api.delete(f"/v1/jobs/{job_id}").json()["detail"]
    assert running.startswith(f"job {job_id} is running; 3 of its 3 tasks are not rolled out yet") and \
        "cancel it first" in running, running
    assert run.api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 200
    assert run.keys_of(job_id) == set()
    assert {f[b"job_id"].decode() for _, f in run.redis.xrange(run.keys.tasks("eval"))} == {other}

    train = run.submit(TRAIN)
    run.roll_out(2)
    run.trainer_finished()
    stalled = run.api.delete(f"/v1/jobs/{train}").json()["detail"]
    assert stalled.startswith(f"job {train} is stalled: the trainer finished at step 4"), stalled
    run.api.post(f"/v1/jobs/{train}/cancel")
    assert run.api.delete(f"/v1/jobs/{train}").status_code == 200
    assert run.keys_of(train) == set() and run.redis.xlen(run.keys.groups) == 0
    assert _refused(run.api, "not_deletable") == 2
    assert run.listed() == [other]


def test_a_cancelled_train_job_goes_with_its_groups_and_tasks_though_no_trainer_or_server_runs(run: Run) -> None:
    """The trainer finished and the server that held a task died: nothing would ack the cancelled job's leftovers away.
    The delete removes them in its step: its task handed back (queued, holding its admission slot), its task held by
    the dead server, its groups waiting in the buffer and the one the trainer held when it stopped. Their admission
    slots and payload keys go, their group ids are consumed, and the status counts what is left: the other job's
    task."""
    job_id = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 5}})
    other = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 1}})
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    entries = run.read(5)
    assert {e.job_id for e in entries} == {job_id}
    for entry in entries:
        assert staleness.try_admit(entry.group_id)
    for entry in entries[:3]:
        run.put(entry)
    [(taken, _)] = run.trainer.take(1, 5.0)
    assert run.queue.hand_back(entries[3])
    run.held_by_a_dead_server(entries[4])
    run.trainer_finished()
    assert run.api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    assert run.depths()["groups"] == {"length": 3, "pending": 1}
    assert run.depths()["tasks"] == {"length": 3, "pending": 1}  # handed back, held by the dead server, the other's

    reply = run.api.delete(f"/v1/jobs/{job_id}")
    assert reply.status_code == 200 and reply.json() == {"job_id": job_id, "kind": "train", "deleted": True}, reply.text
    assert run.keys_of(job_id) == set() and run.listed() == [other]
    assert run.depths()["groups"] == {"length": 0, "pending": 0}
    assert run.depths()["tasks"] == {"length": 1, "pending": 0}
    assert [f[b"job_id"].decode() for _, f in run.redis.xrange(run.keys.tasks("train"))] == [other]
    assert staleness.admitted() == 0 and run.redis.hlen(run.keys.admitted_ids) == 0
    assert run.redis.hmget(run.keys.group_state, [e.group_id for e in entries[:3]]) == [b"t"] * 3
    assert run.trainer.ack([taken], [entries[0].group_id]) == 0  # the stopped trainer's ack finds it gone
    assert run.keys_of(job_id) == set()


def test_a_cancelled_job_whose_task_or_group_a_live_consumer_holds_is_refused_saying_so(run: Run) -> None:
    """A server rolling a task of it out and a running trainer (its lease held) holding a group of it for its step keep
    them: the delete is a 409 naming both (nothing removed, nothing counted), and goes once they have acked them."""
    job_id = run.submit(TRAIN)
    first, second = run.read(2)
    run.put(first)
    lease = run.trainer_alive()
    [(entry_id, group)] = run.trainer.take(1, 5.0)
    run.api.post(f"/v1/jobs/{job_id}/cancel")
    before = run.api.get(f"/v1/jobs/{job_id}").json()

    reply = run.api.delete(f"/v1/jobs/{job_id}")
    assert reply.status_code == 409, reply.text
    assert reply.json()["detail"] == (
        f"job {job_id} is cancelled, but 1 of its tasks are being rolled out by srv, which ack them away as they "
        "finish (a server that stops renewing a task for 30 s, buffer.claim_idle_ms, is taken for dead, and the delete "
        f"removes it); 1 of its groups are held by the trainer ({lease.value}) for its current step, which acks them "
        "(once the trainer stopped, or its lease lapsed, the delete removes them: a trainer killed without recording "
        "its end renews its lease no more, and it lapses within 30 s, buffer.claim_idle_ms); delete it once they are "
        "(progress.cancelled counts them)")
    assert run.api.get(f"/v1/jobs/{job_id}").json() == before
    assert run.redis.xpending(run.keys.tasks("train"), ROLLOUT_GROUP)["pending"] == 1
    assert run.redis.xpending(run.keys.groups, TRAINER_GROUP)["pending"] == 1
    assert _refused(run.api, "not_deletable") == 1

    assert run.queue.cancel(second)  # as the server does with a task of a cancelled job
    assert run.trainer.ack([entry_id], [group.group_id]) == 1
    assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 200
    assert run.keys_of(job_id) == set()


def test_a_trainer_without_a_lease_has_the_groups_of_a_cancelled_job_it_holds_deleted_and_its_ack_counts_nothing(
        run: Run) -> None:
    """A trainer that keeps no lease (one from before it: a rolling upgrade that upgraded the API first; or one whose
    lease lapsed while it lived, frozen or cut off from Redis) is taken for stopped: the delete removes the cancelled
    job's group it holds, as a stopped trainer's. The ack of its step then acks and counts only the other job's group:
    the removed one's id is consumed, so no key of the deleted job comes back, ``trained`` counts the group acked, and
    each admission slot was given back (the removed group's) or kept by a trained group (the other's), once."""
    cancelled = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 1}})
    other = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 1}})
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    for entry in run.read(2):
        assert staleness.try_admit(entry.group_id)
        run.put(entry)
    taken = run.trainer.take(2, 5.0)
    assert sorted(g.job_id for _, g in taken) == sorted([cancelled, other])
    run.api.post(f"/v1/jobs/{cancelled}/cancel")
    assert run.api.get("/v1/status").json()["trainer"] is None  # no trainer recorded anything, none keeps a lease

    reply = run.api.delete(f"/v1/jobs/{cancelled}")
    assert reply.status_code == 200, reply.text
    assert staleness.admitted() == 1 and run.depths()["groups"] == {"length": 1, "pending": 1}
    assert run.trainer.ack([e for e, _ in taken], [g.group_id for _, g in taken]) == 1
    assert run.redis.get(run.keys.trained) == b"1" and staleness.admitted() == 1
    job = run.api.get(f"/v1/jobs/{other}").json()
    assert (job["state"], job["progress"]["trained"], job["progress"]["cancelled"]) == ("done", 1, 0), job
    assert run.keys_of(cancelled) == set() and run.listed() == [other]
    assert run.depths()["groups"] == {"length": 0, "pending": 0}
    assert not run.redis.keys(f"{run.keys.prefix}payload:*")


def test_a_cancelled_job_an_older_api_submitted_waits_for_its_tasks_to_be_acked_away(run: Run) -> None:
    """An API from before the jobs' index of entries wrote none: its tasks cannot be found without reading the whole
    task stream, so the delete refuses, saying so, until the servers have acked them away."""
    job_id = run.submit(EVAL)
    run.redis.delete(run.keys.entries(job_id))  # as an older API submitted it
    run.api.post(f"/v1/jobs/{job_id}/cancel")
    detail = run.api.delete(f"/v1/jobs/{job_id}").json()["detail"]
    assert detail == (f"job {job_id} is cancelled, but 2 of what is left of it are in no place the delete finds them "
                      "(tasks an API from before the jobs' index of entries submitted): the rollout servers ack them "
                      "away as they read them; delete it once they are (progress.cancelled counts them)"), detail
    assert run.redis.xlen(run.keys.tasks("eval")) == 2
    for entry in run.read(2):
        assert run.queue.cancel(entry)
    assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 200
    assert run.keys_of(job_id) == set()


def test_late_writes_of_a_server_or_the_trainer_bring_nothing_of_a_deleted_job_back(run: Run) -> None:
    """A server's put sent again after the job was deleted (its reply lost, or a frozen server's copy of a group
    another wrote) is a duplicate: it writes no counter and, no longer, logs no samples into a new ``traj:<job>``
    (it did: the stream of a deleted job came back, forever). Its fail, dead letter or cancel of the task ends
    nothing; the trainer's ack sent again acks nothing. No key of either job comes back, and neither is found."""
    eval_job = run.submit({**EVAL, "source": {"kind": "arith", "limit": 1}})
    [entry] = run.roll_out(1)
    assert run.api.delete(f"/v1/jobs/{eval_job}").status_code == 200
    run.put(entry)
    assert not run.queue.fail(entry, "late") and not run.queue.dead_letter(entry, "late")
    assert not run.queue.cancel(entry)
    assert run.keys_of(eval_job) == set()
    assert run.api.get(f"/v1/jobs/{eval_job}").status_code == 404

    train_job = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 1}})
    [entry] = run.roll_out(1)
    [(entry_id, group)] = run.trainer.take(1, 5.0)
    assert run.trainer.ack([entry_id], [group.group_id]) == 1
    assert run.api.delete(f"/v1/jobs/{train_job}").status_code == 200
    assert run.trainer.ack([entry_id], [group.group_id]) == 0
    run.put(entry)
    assert run.keys_of(train_job) == set() and run.listed() == []


def test_late_writes_of_a_dead_server_or_a_stopped_trainer_bring_nothing_of_a_deleted_cancelled_job_back(
        run: Run) -> None:
    """The delete took a dead server's tasks and a stopped trainer's group away from them: if either comes back after
    all (frozen, not dead), its put is refused (its task is no longer pending), its fail, dead letter, cancel and hand
    back end nothing, and its ack acks nothing, so no key of either job comes back and nothing is left in a stream."""
    eval_job = run.submit({**EVAL, "source": {"kind": "arith", "limit": 1}})
    train_job = run.submit(TRAIN)
    evaluated, first, second = run.read(3)
    run.put(first)
    [(entry_id, group)] = run.trainer.take(1, 5.0)
    for entry in (evaluated, second):
        run.held_by_a_dead_server(entry)
    run.trainer_finished()
    for job_id in (eval_job, train_job):
        run.api.post(f"/v1/jobs/{job_id}/cancel")
        assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 200

    for entry in (evaluated, second):
        run.put(entry)
        assert not run.queue.fail(entry, "late") and not run.queue.dead_letter(entry, "late")
        assert not run.queue.cancel(entry) and not run.queue.hand_back(entry)
    assert run.trainer.ack([entry_id], [group.group_id]) == 0
    assert run.keys_of(eval_job) == set() and run.keys_of(train_job) == set() and run.listed() == []
    streams = (run.keys.tasks("train"), run.keys.tasks("eval"), run.keys.groups, run.keys.tasks_dead)
    assert [run.redis.xlen(key) for key in streams] == [0, 0, 0, 0]


class CountsRemovals(redis.Redis):
    """A Redis client that records, for each Lua call it sends, how many entries the streams ``streams`` lost in that
    call (``removed``), and the script's SHA with the size of the set ``entries`` as the call began (``calls``)."""

    streams: tuple[str, ...] = ()
    entries = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.removed: list[int] = []
        self.calls: list[tuple[str, int]] = []

    def _length(self) -> int:
        return sum(super(CountsRemovals, self).execute_command("XLEN", stream) for stream in self.streams)

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] != "EVALSHA":
            return super().execute_command(*args, **options)
        before = self._length()
        self.calls.append((args[1], super().execute_command("SCARD", self.entries) if self.entries else 0))
        reply = super().execute_command(*args, **options)
        self.removed.append(before - self._length())
        return reply


def test_a_cancelled_jobs_tasks_are_removed_a_batch_a_lua_call(
        run: Run, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job may hold api.max_job_tasks (100,000) tasks: removed in the delete's one Lua call, they held Redis for
    seconds (every other client of the run answered BUSY). Those no one holds go first, ``CANCEL_BATCH`` a call, each
    counted ``cancelled`` with its admission slot given back, as a server's cancel would: also when the delete is then
    refused for the one a live server holds. Once that one is acked away, the job goes with nothing left of it."""
    monkeypatch.setattr(task_queue, "CANCEL_BATCH", 3)
    job_id = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 11}})
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    live, handed, other_handed, dead = run.read(4)
    for entry in (live, handed, other_handed, dead):
        assert staleness.try_admit(entry.group_id)
    assert run.queue.hand_back(handed) and run.queue.hand_back(other_handed)  # queued, holding their slots
    run.held_by_a_dead_server(dead)
    run.api.post(f"/v1/jobs/{job_id}/cancel")
    client = CountsRemovals.from_url(redis_url)
    client.streams = (run.keys.tasks("train"),)
    queue = TaskQueue(client, run.keys, BufferConfig())

    refused = queue.delete_job(job_id)
    assert refused is not None and (refused.left, refused.rolling_out, refused.servers) == (1, 1, ("srv",))
    assert refused.removed_tasks == 10 and sum(client.removed) == 10
    assert max(client.removed) <= 3, client.removed
    assert run.api.get(f"/v1/jobs/{job_id}").json()["progress"]["cancelled"] == 10
    assert staleness.admitted() == 1 and run.redis.hkeys(run.keys.admitted_ids) == [live.group_id.encode()]
    assert [e for e, _ in run.redis.xrange(run.keys.tasks("train"))] == [live.entry_id.encode()]
    assert run.redis.smembers(run.keys.entries(job_id)) == {f"t{live.entry_id}".encode()}

    assert run.queue.cancel(live)
    client.removed.clear()
    assert queue.delete_job(job_id) == Deletion("train", 0)
    assert client.removed == [0]
    assert run.keys_of(job_id) == set() and run.redis.xlen(run.keys.tasks("train")) == 0
    assert staleness.admitted() == 0 and run.redis.hlen(run.keys.admitted_ids) == 0


def test_a_jobs_dead_letters_and_malformed_groups_go_a_batch_a_lua_call_once_it_is_deleted(
        run: Run, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job of api.max_job_tasks (100,000) tasks that all dead-lettered (a bad reward function, a prompt too long for
    every task) has as many dead letters: XDEL'd in the delete's one Lua call, with its whole index of entries read,
    they held Redis for a third of a second, every other client waiting. A delete refused (the job running, then
    cancelled but a task of it held by a live server) keeps every one of them, in its stream; the delete's own call
    reads the few entries left in the index (the held task), not the dead letters; once the job goes, they and its
    malformed group go ``CANCEL_BATCH`` a call, and another job's dead letter stays."""
    monkeypatch.setattr(task_queue, "CANCEL_BATCH", 3)
    job_id = run.submit({**TRAIN, "source": {"kind": "arith", "limit": 9}})
    entries = run.read(9)
    for entry in entries[:7]:
        assert run.queue.dead_letter(entry, "the reward function raised")
    run.put(entries[7])
    [(malformed, _)] = run.trainer.take(1, 5.0)
    run.trainer.reject(malformed, "its model cannot train on it")
    other = run.submit({**EVAL, "source": {"kind": "arith", "limit": 1}})
    [other_entry] = run.read(1)
    assert run.queue.dead_letter(other_entry, "the reward function raised")
    aside = {run.keys.tasks_dead: run.redis.xrange(run.keys.tasks_dead),
             run.keys.groups_malformed: run.redis.xrange(run.keys.groups_malformed)}
    assert [len(kept) for kept in aside.values()] == [8, 1]
    client = CountsRemovals.from_url(redis_url)
    client.streams, client.entries = tuple(aside), run.keys.entries(job_id)
    queue = TaskQueue(client, run.keys, BufferConfig())

    assert queue.delete_job(job_id) == Deletion("train", 1)  # running: a task of it is left
    assert run.api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    client.calls.clear()
    refused = queue.delete_job(job_id)
    assert refused is not None and (refused.left, refused.rolling_out, refused.servers) == (1, 1, ("srv",))
    assert [size for sha, size in client.calls if sha == queue._delete_job.sha] == [1]
    assert {key: run.redis.xrange(key) for key in aside} == aside and set(client.removed) == {0}
    assert run.api.get(f"/v1/jobs/{job_id}").json()["progress"]["dead_lettered"] == 7

    assert run.queue.cancel(entries[8])
    client.removed.clear()
    assert queue.delete_job(job_id) == Deletion("train", 0)
    assert sum(client.removed) == 8 and max(client.removed) <= 3, client.removed
    assert [f[b"job_id"].decode() for _, f in run.redis.xrange(run.keys.tasks_dead)] == [other]
    assert run.redis.xlen(run.keys.groups_malformed) == 0 and run.keys_of(job_id) == set()


def test_a_delete_refused_by_a_submit_after_its_walk_keeps_the_jobs_dead_letters(
        run: Run, redis_url: str) -> None:
    """A finished job's delete sets its dead letters aside before its one call decides: tasks submitted under its id
    in between (``TaskQueue.submit`` adds to a job that exists) make it running, and that call refuses it. Its dead
    letters are all still there, and go with it once it is finished again and deleted."""
    job_id = run.submit({**EVAL, "source": {"kind": "arith", "limit": 2}})
    for entry in run.read(2):
        assert run.queue.dead_letter(entry, "the prompt is too long")
    dead = run.redis.xrange(run.keys.tasks_dead)
    client = DeletesBefore.from_url(redis_url)
    queue = TaskQueue(client, run.keys, BufferConfig())
    client.when = lambda args: args[0] == "EVALSHA" and args[1] == queue._delete_job.sha
    client.delete = lambda: run.queue.submit(job_id, [{"task_id": "late", "prompt": "1+1"}], "eval")

    assert queue.delete_job(job_id) == Deletion("eval", 1)
    assert client.delete is None and run.redis.xrange(run.keys.tasks_dead) == dead
    run.roll_out(1)
    assert queue.delete_job(job_id) == Deletion("eval", 0)
    assert run.redis.xlen(run.keys.tasks_dead) == 0 and run.keys_of(job_id) == set()


class FailsOnce(redis.Redis):
    """A Redis client whose first call of the Lua script ``sha`` is lost on the way (the API died, or its connection
    dropped), before Redis ran it."""

    sha = ""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "EVALSHA" and args[1] == self.sha:
            self.sha = ""
            raise redis.ConnectionError("lost on the way")
        return super().execute_command(*args, **options)


@pytest.mark.parametrize("then", ["sent_again", "another_job_deleted"])
def test_the_dead_letters_an_interrupted_delete_left_go_with_the_next_delete(run: Run, redis_url: str,
                                                                             then: str) -> None:
    """The job went in the delete's one call, and its dead letters are removed after it: a delete interrupted between
    leaves them, set aside under the job's id and listed in ``deleted:aside`` by that call. The client sends the delete
    again (it had no reply: 404, and they go), or it never does and the next delete of another job removes them (they
    were left for good)."""
    job_id = run.submit(EVAL)
    for entry in run.read(2):
        assert run.queue.dead_letter(entry, "the prompt is too long")
    client = FailsOnce.from_url(redis_url)
    queue = TaskQueue(client, run.keys, BufferConfig())
    client.sha = queue._drop_aside.sha
    with pytest.raises(redis.ConnectionError):
        queue.delete_job(job_id)
    assert run.api.get(f"/v1/jobs/{job_id}").status_code == 404
    assert run.keys_of(job_id) == {run.keys.entries_aside(job_id).encode()}
    assert run.redis.xlen(run.keys.tasks_dead) == 2
    assert run.redis.smembers(run.keys.deleted_aside) == {job_id.encode()}

    if then == "sent_again":
        assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 404
    else:
        other = run.submit(EVAL)
        for entry in run.read(2):
            assert run.queue.dead_letter(entry, "the prompt is too long")
        assert run.api.delete(f"/v1/jobs/{other}").status_code == 200
        assert run.keys_of(other) == set()
    assert run.redis.xlen(run.keys.tasks_dead) == 0 and run.keys_of(job_id) == set()
    assert not run.redis.exists(run.keys.deleted_aside)


def test_a_frozen_servers_task_the_delete_removed_takes_no_admission_slot_when_it_wakes(run: Run) -> None:
    """A server frozen past buffer.claim_idle_ms (not dead) holds a task of a job that is cancelled and deleted
    meanwhile; the delete removes the task as a dead server's. When the server wakes, it asks admission for the task:
    its group id, consumed by the delete, is admitted at no cost (before, it took a slot that nothing ever gave back:
    admission shrank for good), and its put is a duplicate that writes nothing. The task no one had read leaves its id
    unconsumed: only the held ones are marked, so the dedup window is not flooded."""
    job_id = run.submit(TRAIN)
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    [frozen] = run.read(1)
    [(_, fields)] = [e for e in run.redis.xrange(run.keys.tasks("train")) if e[0].decode() != frozen.entry_id]
    run.held_by_a_dead_server(frozen)
    run.api.post(f"/v1/jobs/{job_id}/cancel")
    assert run.api.delete(f"/v1/jobs/{job_id}").status_code == 200
    admitted = staleness.admitted()

    assert staleness.try_admit(frozen.group_id)
    assert staleness.admitted() == admitted and not run.redis.hexists(run.keys.admitted_ids, frozen.group_id)
    run.put(frozen)
    assert run.redis.xlen(run.keys.groups) == 0 and not run.redis.keys(f"{run.keys.prefix}payload:*")
    assert run.keys_of(job_id) == set()
    assert run.redis.hget(run.keys.group_state, frozen.group_id) == b"t"
    assert not run.redis.hexists(run.keys.group_state, fields[b"gid"])


class DeletesBefore(redis.Redis):
    """A Redis client that runs ``delete`` once, right before the first command (or pipeline) that ``when`` picks:
    another API replica deletes the job just then."""

    delete: Callable[[], object] | None = None
    when: Callable[[tuple[Any, ...]], bool] = staticmethod(lambda _args: False)

    def _maybe_delete(self, commands: list[tuple[Any, ...]]) -> None:
        if self.delete is not None and any(self.when(args) for args in commands):
            delete, self.delete = self.delete, None
            delete()

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self._maybe_delete([args])
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def deleting_first(raise_on_error: bool = True) -> Any:
            self._maybe_delete([args for args, _options in pipe.command_stack])
            return execute(raise_on_error)

        pipe.execute = deleting_first
        return pipe


@pytest.fixture
def racing(redis_url: str, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[tuple[Run, DeletesBefore]]:
    client = DeletesBefore.from_url(redis_url)
    with serve(redis_url, f"del-{request.node.name}"[:60], client=client) as api:
        parts = Run(redis_url, api, tokenizer)
        yield parts, client
        parts.close()


def test_the_idempotency_key_of_a_deleted_job_makes_a_new_job(racing: tuple[Run, DeletesBefore]) -> None:
    """The delete frees the key: a submit under it makes a new job (201), and one after that is answered with that
    one. A claim left naming a deleted job (an API from before kept no ``idempotency`` field) is void and taken over.
    A submit whose key's job is deleted between the API's check of the key and its answer gets a 409 saying to send
    it again, which then makes the job."""
    run, client = racing
    first = run.submit(EVAL, key="k")
    run.roll_out(2)
    assert run.api.delete(f"/v1/jobs/{first}").status_code == 200
    assert not run.redis.keys(run.keys.idempotency("*"))
    second = run.submit(EVAL, key="k")
    assert second != first
    replayed = run.api.post("/v1/jobs", json=EVAL, headers={"Idempotency-Key": "k"})
    assert replayed.status_code == 200 and replayed.json()["job_id"] == second, replayed.text

    run.roll_out(2)
    run.redis.hdel(run.keys.job(second), "idempotency")  # as an API from before stored it
    assert run.api.delete(f"/v1/jobs/{second}").status_code == 200
    [claim] = run.redis.keys(run.keys.idempotency("*"))
    assert run.redis.get(claim).startswith(f"{second}:".encode())  # left behind, naming the deleted job
    third = run.submit(EVAL, key="k")
    assert third not in (first, second) and run.redis.get(claim).startswith(f"{third}:".encode())

    run.roll_out(2)
    client.when = lambda args: args[0] == "HGETALL" and args[1] == run.keys.job(third)  # the API reads the job
    client.delete = lambda: run.queue.delete_job(third)
    raced = run.api.post("/v1/jobs", json=EVAL, headers={"Idempotency-Key": "k"})
    assert client.delete is None and raced.status_code == 409, raced.text
    assert raced.json()["detail"].startswith(f"the Idempotency-Key named job {third}, which was deleted while"), raced
    assert _refused(run.api, "idempotency_key") == 1
    fourth = run.submit(EVAL, key="k")
    assert run.listed() == [fourth]


def test_a_listing_that_summarizes_a_job_deleted_meanwhile_brings_no_hash_back(
        racing: tuple[Run, DeletesBefore]) -> None:
    """A job stored without a spec summary (by an older API) gets one at its first listing, read then written: deleted
    in between, it got back a hash of that summary alone (a half job, never deleted again)."""
    run, client = racing
    job_id = run.submit(EVAL)
    run.roll_out(2)
    run.redis.hdel(run.keys.job(job_id), "spec_summary")
    client.when = lambda args: args[0] in ("HSETNX", "EVALSHA") and run.keys.job(job_id) in args
    client.delete = lambda: run.queue.delete_job(job_id)
    assert run.api.get("/v1/jobs").status_code == 200
    assert client.delete is None
    assert run.keys_of(job_id) == set()
    assert run.listed() == []


def test_a_job_cancelled_while_its_delete_runs_goes(racing: tuple[Run, DeletesBefore]) -> None:
    """The delete found the job running, and another client cancelled it before the API read it back to say what is
    left: the API deletes it then, as it would have had the cancel come first, and does not refuse it as cancelled
    with nothing held."""
    run, client = racing
    job_id = run.submit(EVAL)
    client.when = lambda args: args[0] == "HGETALL" and args[1] == run.keys.job(job_id)  # the API reads the job back
    client.delete = lambda: run.queue.cancel_job(job_id)
    reply = run.api.delete(f"/v1/jobs/{job_id}")
    assert client.delete is None and reply.status_code == 200, reply.text
    assert run.keys_of(job_id) == set() and run.redis.xlen(run.keys.tasks("eval")) == 0


class LosesFirstDelete:
    """A front to the API for DELETE /v1/jobs/{id}: each delete is passed on, but the first reply is lost."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url
        self.deletes = 0
        self.app = Starlette(routes=[Route("/v1/jobs/{job_id}", self.delete, methods=["DELETE"])])

    async def delete(self, request: Request) -> Response:
        self.deletes += 1
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30) as api:
            reply = await api.delete(request.url.path, headers={"authorization": request.headers["authorization"]})
        if self.deletes == 1:
            return LostReply()
        return Response(reply.content, reply.status_code, media_type="application/json")


def test_rollwave_jobs_delete(run: Run, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deletes a finished job; a job not finished, or not there, is one error line naming why (exit 2); a delete whose
    reply was lost is sent again, and its 404 then said to mean that the first one deleted the job."""
    monkeypatch.setenv("ROLLWAVE_API_TOKEN", TOKEN)
    url = str(run.api.base_url)
    job_id = run.submit(EVAL)
    assert main(["jobs", "delete", job_id, "--api", url]) == 2
    assert "cancel it first" in capsys.readouterr().err
    run.roll_out(2)
    assert main(["jobs", "--api", url, "delete", job_id]) == 0
    assert capsys.readouterr().out == f"job {job_id} (eval) deleted\n"
    assert main(["jobs", "delete", job_id, "--api", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: DELETE {url}/v1/jobs/{job_id}: the API answered HTTP 404: job '{job_id}' not "
                          "found") and err.count("\n") == 1, err

    job_id = run.submit(EVAL)
    run.roll_out(2)
    front = LosesFirstDelete(url)
    with serve_app(front.app) as front_url:
        assert main(["jobs", "delete", job_id, "--api", front_url]) == 0
    assert front.deletes == 2
    assert capsys.readouterr().out.startswith(f"job {job_id} deleted (by an earlier try, whose reply was lost")
    assert run.keys_of(job_id) == set()
    assert main(["jobs", "--api", url]) == 0 and capsys.readouterr().out.count("\n") == 1  # the header alone


def test_rollwave_jobs_cancel_then_delete(run: Run, capsys: pytest.CaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollwave jobs cancel`` cancels a running job (the README sent users to curl for it), a cancel sent again
    finds it cancelled, and the delete then goes; a job that is done is refused naming why (exit 2)."""
    monkeypatch.setenv("ROLLWAVE_API_TOKEN", TOKEN)
    url = str(run.api.base_url)
    job_id = run.submit(EVAL)
    for _ in range(2):
        assert main(["jobs", "cancel", job_id, "--api", url]) == 0
        assert capsys.readouterr().out.startswith(f"job {job_id} (eval) cancelled: its tasks not rolled out yet")
    assert main(["jobs", "delete", job_id, "--api", url]) == 0 and run.keys_of(job_id) == set()
    done = run.submit(EVAL)
    run.roll_out(2)
    assert main(["jobs", "cancel", done, "--api", url]) == 2
    assert f"the API answered HTTP 409: job {done} is done" in capsys.readouterr().err


def test_jobs_delete_help_has_an_example_that_parses(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["jobs", "delete", "--help"])
    assert exit_.value.code == 0
    example = capsys.readouterr().out.split("example:\n", 1)[1].split()
    args = build_parser().parse_args(example[1:])
    assert (args.command, args.jobs_command, args.job) == ("jobs", "delete", "3f2a9c1b7d4e")


def test_a_delete_is_a_write_guarded_as_the_others(run: Run) -> None:
    """Without the token: 401; from a page of another origin: 403 (a loopback API may have no token). Both counted,
    and the job stays."""
    job_id = run.submit(EVAL)
    run.roll_out(2)
    url = f"{run.api.base_url}/v1/jobs/{job_id}"
    assert httpx.delete(url).status_code == 401
    foreign = run.api.delete(f"/v1/jobs/{job_id}", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403, foreign.text
    assert (_refused(run.api, "auth"), _refused(run.api, "origin")) == (1, 1)
    assert run.listed() == [job_id]
