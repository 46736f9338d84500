"""Read-side views of a run in Redis: jobs, trajectories, cluster status, and one metrics sample."""

from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis

from buffer.keys import TRAINER_CRASHED, TRAINER_FINISHED_FIELDS, Keys
from buffer.metrics import stream_depths
from buffer.registry import ServerRegistry
from buffer.task_queue import JOB_COUNTERS, TRAIN_ENDS, TaskQueue

_MAX_ID_PART = 2**64 - 1


class NotFound(LookupError):
    """A job id that the run does not know."""


class NotCancellable(ValueError):
    """A cancel of a job with nothing left to cancel: every task of an eval job rolled out, every group of a train
    job trained or dropped."""


class NotDeletable(ValueError):
    """A delete of a job that is neither finished nor cancelled (a task of it not yet rolled out, or a group of a train
    job not yet trained or dropped), or of a cancelled one whose task or group a live rollout server or a running
    trainer (its lease held, its end not recorded) holds (it would count it on the job)."""


class InvalidCursor(ValueError):
    """A page cursor that names nothing: a trajectories cursor that is no Redis stream id (each part must fit
    in 64 bits), a jobs cursor that is no ``next`` of a jobs page."""


# the counters of each live server's stats (its heartbeat's) the dashboard charts, as rates or the latest pause
SERVER_COUNTERS = ("generated_tokens", "tool_errors", "pauses", "pause_s")
# the end of a trainer whose lease lapsed with none recorded (``ClusterView.trainer_end``)
LEASE_LAPSED = (f"{TRAINER_CRASHED}its lease lapsed with no end recorded: killed by SIGKILL, the OOM killer or a lost "
                "node, or cut off from Redis past buffer.claim_idle_ms")


@dataclass(frozen=True)
class TrainerEnd:
    """Where and why the run's trainer stopped (``RedisStatus.finished`` wrote it)."""

    step: int
    reason: str

    @property
    def crashed(self) -> bool:
        """It crashed rather than ended: a supervisor may restart it, which clears the end once it trains again."""
        return self.reason.startswith(TRAINER_CRASHED)

    def __str__(self) -> str:
        if self.crashed:
            return f"the trainer crashed at step {self.step} ({self.reason.removeprefix(TRAINER_CRASHED)})"
        return f"the trainer finished at step {self.step} ({self.reason})"


def _job_view(job_id: str, h: dict[str, str], end: TrainerEnd | None) -> dict[str, Any]:
    """What the API says about a job, from its hash and the trainer's ``end`` (None while it trains): a train job
    with groups left to train once the trainer finished (or crashed) reads ``stalled``, its ``reason`` saying why."""
    progress = {name: int(float(h.get(name, 0))) for name in JOB_COUNTERS}
    samples = progress["samples"]
    reward_mean = float(h.get("reward_sum", 0.0)) / samples if samples else None
    kind, state = h.get("kind", "train"), h.get("state", "running")
    untrained = progress["submitted"] - sum(progress[name] for name in TRAIN_ENDS)
    reason = None
    if kind == "train" and state != "cancelled" and end is not None and untrained > 0:
        state = "stalled"
        of = f"{untrained} of this job's {progress['submitted']} groups"
        if end.crashed:
            reason = (f"{end}; {of} wait for a trainer (LocalStack and Ray restart a crashed one, which trains "
                      "them once it is up again; by hand: python -m trainer --resume)")
        else:
            reason = (f"{end}; {of} will not be trained (start the trainer again to train them: python -m trainer "
                      f"--resume, trainer.total_steps above {end.step})")
    return {
        "job_id": job_id,
        "kind": kind,
        "state": state,
        "reason": reason,
        "created": float(h.get("created", 0.0)),
        "spec": json.loads(h["spec"]) if "spec" in h else None,
        "progress": progress,
        "reward_mean": reward_mean,
        "accuracy": reward_mean if kind == "eval" and state == "done" else None,
    }


def _after(cursor: str) -> tuple[float, str]:
    """Where a jobs page's ``next`` (``<created>:<job id>``, its last job's) falls in the newest-first order: a
    position, so the next page starts after it even if that job was deleted since (a cursor that was the job's id
    alone broke every listing that a delete overtook)."""
    created, _, job_id = cursor.partition(":")
    try:
        key = (-float(created), job_id)
    except ValueError:
        key = (math.nan, "")
    if not job_id or not math.isfinite(key[0]):
        raise InvalidCursor(f"cursor {cursor!r} is no `next` of a jobs page (<created>:<job id>)")
    return key


def _decode(h: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


class ClusterView:
    """Everything the API reads, from Redis alone, so any number of API replicas agree."""

    def __init__(self, client: redis.Redis, keys: Keys, registry: ServerRegistry, queue: TaskQueue) -> None:
        self.redis = client
        self.keys = keys
        self.servers = registry
        self.queue = queue

    def _read_end(self, pipe: redis.client.Pipeline) -> None:
        """Queue on ``pipe`` what ``trainer_end`` reads."""
        pipe.hmget(self.keys.trainer, *TRAINER_FINISHED_FIELDS[:2], "step", "leased")
        pipe.exists(self.keys.trainer_alive)

    def trainer_end(self, read: list[Any] | None = None) -> TrainerEnd | None:
        """The run's trainer's end, once it stopped; None while it trains (or before one started). A trainer that kept
        a lease (the hash's ``leased``) and let it lapse with no end recorded was killed (SIGKILL, the OOM killer, a
        lost node), or is cut off from Redis past its TTL: it reads as crashed at its last step, so its train jobs read
        ``stalled`` and a wait on them ends, where they read ``running`` for ever. ``read``: what ``_read_end`` queued,
        already executed."""
        if read is None:
            pipe = self.redis.pipeline(transaction=False)
            self._read_end(pipe)
            read = pipe.execute()
        (step, reason, last, leased), alive = read
        if step is not None and reason is not None:
            return TrainerEnd(int(step), reason.decode())
        return TrainerEnd(int(last or 0), LEASE_LAPSED) if leased and not alive else None

    def job(self, job_id: str, summary: bool = False) -> dict[str, Any]:
        """The job; with ``summary`` its ``spec`` as a listing has it (no inline task is read or sent)."""
        # its state reads ``done`` once every task is written or dead-lettered
        h = self.queue.job_summaries([job_id])[0] if summary else self.queue.job(job_id)
        if not h:
            raise NotFound(f"job {job_id!r} not found")
        return _job_view(job_id, h, self.trainer_end())

    @staticmethod
    def submitted(job_id: str, kind: str, spec: str, tasks: int) -> dict[str, Any]:
        """A job just submitted with ``tasks`` tasks, as ``job`` reads it then (``created`` within milliseconds): the
        answer to its submit where Redis failed as it was read back."""
        return _job_view(job_id, {"kind": kind, "state": "running", "created": str(time.time()), "spec": spec,
                                  "submitted": str(tasks)}, None)

    def jobs(self, cursor: str = "", limit: int = 50) -> dict[str, Any]:
        """A page of jobs, newest first, after the job ``cursor`` names; two round trips whatever the page size (two
        more, once, for jobs stored without summaries). Each job's ``spec`` is its summary (``TaskQueue.job_summaries``:
        no inline tasks)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.jobs)
        self._read_end(pipe)
        index, *end_read = pipe.execute()
        order = sorted((-float(created), job_id.decode()) for job_id, created in index.items())
        start = bisect.bisect_right(order, _after(cursor)) if cursor else 0
        page = [job_id for _, job_id in order[start : start + limit]]
        end = self.trainer_end(end_read)
        jobs = [_job_view(job_id, h, end) for job_id, h in zip(page, self.queue.job_summaries(page), strict=True) if h]
        last = order[start + limit - 1] if start + limit < len(order) else None
        return {"jobs": jobs, "next": None if last is None else f"{-last[0]!r}:{last[1]}"}

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Mark a running or ``stalled`` job cancelled (checked and set in one step: a job done meanwhile stays
        done); servers acknowledge its remaining tasks without rolling them out, and a trainer acks its groups away
        untrained. ``NotCancellable`` for a job that is done; a cancelled one reads as it is."""
        state = self.queue.cancel_job(job_id)
        if state is None:
            raise NotFound(f"job {job_id!r} not found")
        if state == "done":
            raise NotCancellable(f"job {job_id} is done: every task of it is rolled out and scored, or its groups "
                                 "trained or dropped, or dead-lettered; nothing is left to cancel")
        return self.job(job_id)

    def delete(self, job_id: str) -> dict[str, Any]:
        """Delete a finished or cancelled job and everything the run keeps of it, a cancelled job's tasks and groups
        that no one holds included (``TaskQueue.delete_job``: checked and deleted in one step, whether or not a
        rollout server or trainer runs). ``NotDeletable`` for a job neither finished nor cancelled, or one of whose
        tasks or groups a live consumer holds, saying what to do; ``NotFound`` for a job unknown or deleted already,
        which is what a delete sent again after its reply was lost finds."""
        found = self.queue.delete_job(job_id)
        if found is None:
            raise NotFound(f"job {job_id!r} not found: never submitted, or deleted already (a DELETE sent again after "
                           "its reply was lost finds it so)")
        if not found.left:
            return {"job_id": job_id, "kind": found.kind, "deleted": True}
        held, idle_s = [], self.queue.config.claim_idle_ms / 1000
        if found.rolling_out:
            held.append(f"{found.rolling_out} of its tasks are being rolled out by {', '.join(found.servers)}, which "
                        f"ack them away as they finish (a server that stops renewing a task for {idle_s:g} s, "
                        "buffer.claim_idle_ms, is taken for dead, and the delete removes it)")
        if found.training:
            held.append(f"{found.training} of its groups are held by the trainer ({found.trainer}) for its current "
                        "step, which acks them (once the trainer stopped, or its lease lapsed, the delete removes "
                        "them: a trainer killed without recording its end renews its lease no more, and it lapses "
                        f"within {idle_s:g} s, buffer.claim_idle_ms)")
        if found.unfound:
            held.append(f"{found.unfound} of what is left of it are in no place the delete finds them (tasks an API "
                        "from before the jobs' index of entries submitted): the rollout servers ack them away as they "
                        "read them")
        if held:
            raise NotDeletable(f"job {job_id} is cancelled, but {'; '.join(held)}; delete it once they are "
                               "(progress.cancelled counts them)")
        job = self.job(job_id)
        if job["state"] == "cancelled":  # cancelled since the delete read it: it goes now, or says what holds it
            return self.delete(job_id)
        what = (f"{found.left} of its {job['progress']['submitted']} "
                + ("tasks are not rolled out yet" if found.kind == "eval" else
                   "groups are not trained yet (tasks not rolled out, or groups waiting in the buffer)"))
        why = f": {job['reason']}" if job["reason"] else ""
        raise NotDeletable(f"job {job_id} is {job['state']}{why}; {what}. Only a finished or cancelled job is "
                           f"deleted: cancel it first (POST /v1/jobs/{job_id}/cancel, `rollwave jobs cancel "
                           f"{job_id}`), then delete it")

    def trajectories(self, job_id: str, cursor: str, limit: int) -> dict[str, Any]:
        self.job(job_id)
        if cursor:
            ms, seq = (int(part) for part in cursor.split("-"))
            if ms > _MAX_ID_PART or seq > _MAX_ID_PART:
                raise InvalidCursor(f"cursor {cursor!r}: each part of a stream id must be < 2**64")
            if ms == seq == _MAX_ID_PART:
                return {"items": [], "next": None}
        start = f"({cursor}" if cursor else "-"
        entries = self.redis.xrange(self.keys.trajectories(job_id), start, "+", count=limit)
        items = [json.loads(fields[b"sample"]) for _id, fields in entries]
        nxt = entries[-1][0].decode() if len(entries) == limit else None
        return {"items": items, "next": nxt}

    def buffer(self) -> dict[str, dict[str, int]]:
        """Each of the run's streams (``stream_depths``): its length, and how many of its entries are pending."""
        return {label: {"length": length, "pending": pending or 0}
                for label, (length, pending) in stream_depths(self.redis, self.keys).items()}

    def status(self) -> dict[str, Any]:
        """The run at a glance. ``version`` is the published one (a quorum of servers committed it); each
        server carries its ``last_push`` (None before the trainer pushed to it) and ``straggler`` (its last
        push failed: ``last_push`` says at which stage, why, and the version it serves). The ``trainer`` (its hash, None
        before any trainer started) carries ``alive``: whether a trainer holds its lease (``Keys.trainer_alive``), which
        a trainer killed without recording its end lets lapse."""
        now = time.time()
        pushes = self.servers.pushes()
        servers = []
        for info, alive in self.servers.all_servers():
            push = pushes.get(info.server_id)
            servers.append({**asdict(info), "alive": alive, "heartbeat_age_s": round(now - info.heartbeat, 3),
                            "straggler": push is not None and push.straggler,
                            "last_push": asdict(push) if push is not None else None})
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.trainer)
        pipe.exists(self.keys.trainer_alive)
        fields, alive = pipe.execute()
        trainer = {**_decode(fields), "alive": bool(alive)} if fields or alive else None
        return {
            "run": self.keys.run,
            "version": int(self.redis.get(self.keys.version) or 0),
            "servers": servers,
            "stragglers": [s["server_id"] for s in servers if s["straggler"]],
            "trainer": trainer,
            "buffer": self.buffer(),
        }

    def sample(self) -> dict[str, Any]:
        """One point of the dashboard's time series: the run's figures, and the counters of each live server
        (``SERVER_COUNTERS``), keyed by its id and start (``servers``); the sampler turns those into rates and the
        mean pause of the latest updates."""
        last = self.redis.xrevrange(self.keys.steps, "+", "-", count=1)
        step = json.loads(last[0][1][b"metrics"]) if last else {}
        servers = self.servers.live_servers()
        return {
            "policy_version": float(self.redis.get(self.keys.version) or 0),
            "buffer_depth_groups": float(self.redis.xlen(self.keys.groups)),
            "reward_mean": step.get("reward_mean"),
            "trainer_idle_fraction": step.get("idle_fraction"),
            "staleness_mean": step.get("staleness_mean"),
            "servers": {(info.server_id, info.started): {name: float(info.stats.get(name, 0.0))
                                                         for name in SERVER_COUNTERS} for info in servers},
        }
