"""Every Redis key of a run, in one place: ``rw:<run>:<name>`` (ARCHITECTURE.md, "Redis layout").

Train and eval tasks have separate streams so eval jobs never wait behind admission control.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUT_GROUP = "rollout"
TRAINER_GROUP = "trainer"
TASK_KINDS = ("train", "eval")
# the ``trainer`` hash's fields that say where and why the trainer stopped (the trainer writes them, the API reads)
TRAINER_FINISHED_FIELDS = ("finished_step", "finished_reason", "finished_at")
# how ``finished_reason`` starts when the trainer crashed (an exception out of its loop) rather than ended: a
# supervisor (LocalStack, Ray) restarts it, and the restarted trainer clears the end once it trains again
TRAINER_CRASHED = "crashed: "


@dataclass(frozen=True)
class Keys:
    """Key names of one run; all keys share the prefix, so a run can be listed or dropped by pattern."""

    run: str

    def __post_init__(self) -> None:
        if not self.run or any(c in self.run for c in " :{}*?[]"):
            raise ValueError(f"run name {self.run!r}: must be non-empty without spaces, ':', braces or globs")

    @property
    def prefix(self) -> str:
        return f"rw:{self.run}:"

    def tasks(self, kind: str) -> str:
        """Task stream of one kind (consumer group ``rollout``)."""
        if kind not in TASK_KINDS:
            raise ValueError(f"task kind {kind!r}: expected one of {', '.join(TASK_KINDS)}")
        return self.prefix + ("tasks" if kind == "train" else "tasks:eval")

    def task_gids(self, kind: str) -> str:
        """Hash entry id of a task in its kind's stream -> its group id, written with the entry and deleted with it:
        a pending task deleted by hand (an XDEL, a trim) is known by its id alone (XPENDING), and this names the group
        whose admission slot (``admitted_ids``) and job it ends (``buffer.streams.Reclaimer``); a record whose entry is
        neither in the stream nor pending is one deleted before it was delivered (the reclaimer's sweep ends it)."""
        return self.tasks(kind) + ":gids"

    def task_leases(self, kind: str) -> str:
        """Prefix of the keys ``<prefix><entry id>`` (a string with a TTL, naming the consumer) by which a live rollout
        server holds a pending task of its kind's stream deleted by hand, which no renewal can reset the idle time of
        (``buffer.streams.RENEW_LUA``): while one is there no reclaim ends the task, so its server writes its group."""
        return self.tasks(kind) + ":held:"

    @property
    def tasks_dead(self) -> str:
        """Dead-letter stream: tasks delivered or failed more than ``max_attempts`` times, with the error."""
        return self.prefix + "tasks:dead"

    @property
    def tasks_malformed(self) -> str:
        return self.prefix + "tasks:malformed"

    @property
    def groups(self) -> str:
        """Finished train groups (consumer group ``trainer``)."""
        return self.prefix + "groups"

    @property
    def group_records(self) -> str:
        """Hash entry id of a train group in ``groups`` -> JSON [group id, job id, payload key ('' inline), slot (its
        field s)], written with the entry and deleted with it: a pending entry deleted by hand (an XDEL, a trim) is
        known by its id alone (XPENDING), and this says whose payload, state, slot and job it ends (as ``lost``); so
        does the record of one deleted before it was delivered, which the trainer's sweep finds."""
        return self.prefix + "groups:records"

    @property
    def groups_malformed(self) -> str:
        return self.prefix + "groups:malformed"

    @property
    def groups_newer(self) -> str:
        """Train groups of a schema newer than the trainer that took them reads (a rolling upgrade's producers went
        first), with their entries' fields (``f.<name>``) and ``schema``: a trainer that reads it moves them back
        into ``groups`` as it starts (and again should Redis lose that; the ack of a group it holds from a lost move
        finds it here). Their payload keys stay, owned by these entries."""
        return self.prefix + "groups:newer"

    @property
    def group_state(self) -> str:
        """Hash group_id -> written (a train group's payload key, an eval group's ``w``) | ``t`` (consumed by the
        trainer): the de-duplication record."""
        return self.prefix + "groups:state"

    @property
    def groups_consumed(self) -> str:
        """List of consumed group ids, oldest first: ``groups:state`` keeps the last ``buffer.dedup_window``."""
        return self.prefix + "groups:consumed"

    def entries(self, job_id: str) -> str:
        """Set of a job's entries in the run-wide streams, so a delete finds them without reading a stream whole:
        ``t<id>`` its task in its kind's task stream, ``d<id>`` its dead letter in ``tasks:dead``, ``g<id>`` its group
        moved to ``groups:malformed``. The calls that add, move and end an entry keep it (a dead letter or requeued
        task takes the place of an indexed task only: nothing adds to the entries of a deleted job); it is deleted
        with its job. Its own prefix, like ``traj:`` and ``eval:``: no job id names another job's key."""
        return f"{self.prefix}entries:{job_id}"

    @property
    def deleted_aside(self) -> str:
        """Set: ids of deleted jobs whose set aside (``entries_aside``) is still to be removed, added in the delete's
        own Lua call: a delete interrupted before it removed them (the API died, its reply lost, a client that did not
        send it again) leaves them to the next delete of any job."""
        return self.prefix + "deleted:aside"

    def entries_aside(self, job_id: str) -> str:
        """Set of a job's dead letters and malformed groups set aside from its entries by a delete's walk (members as
        ``entries``'s): they stay indexed there while the job exists, and are removed in batches once it is gone. Under
        the job's entries key: a job id holds no ':', so it names no other job's key."""
        return f"{self.prefix}entries:{job_id}:aside"

    def eval(self, job_id: str) -> str:
        """Results of an eval job, one entry per group (id, reward sum, samples), never trained on."""
        return f"{self.prefix}eval:{job_id}"

    def payload(self, group_id: str, nonce: str) -> str:
        """One put's encoded group (a string key; the ``groups`` entry that names it owns it): unique per put, so
        a duplicate put never touches the payload of the copy that was written."""
        return f"{self.prefix}payload:{group_id}:{nonce}"

    @property
    def version(self) -> str:
        return self.prefix + "version"

    @property
    def version_trained(self) -> str:
        """How many groups the weights of the published ``version`` were trained on (admission's base)."""
        return self.prefix + "version:trained"

    @property
    def trained(self) -> str:
        """Groups acked as trained, by every trainer of the run."""
        return self.prefix + "trained"

    @property
    def admitted(self) -> str:
        return self.prefix + "admitted"

    @property
    def budget(self) -> str:
        """How many train groups the run trains in all, published by its trainer at start: admission's cap, so the
        rollout generates nothing past the last step."""
        return self.prefix + "budget"

    @property
    def admitted_ids(self) -> str:
        """Hash of group ids admitted whose task is not yet done, so a redelivered task is not admitted twice; a
        written group takes its slot over (its entry's field ``s``)."""
        return self.prefix + "admitted:ids"

    @property
    def jobs(self) -> str:
        return self.prefix + "jobs"

    @property
    def job_prefix(self) -> str:
        return self.prefix + "job:"

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def idempotency(self, fingerprint: str) -> str:
        """String naming the job a submit's idempotency key made (its id and its spec's fingerprint), with an expiry:
        keyed by the client key's fingerprint, so a key of any length or bytes names one of ours."""
        return f"{self.prefix}idempotency:{fingerprint}"

    @property
    def servers(self) -> str:
        return self.prefix + "servers"

    @property
    def pushes(self) -> str:
        """Hash server_id -> JSON: the last weight push to that server (written by the trainer's pusher)."""
        return self.prefix + "pushes"

    def server_alive(self, server_id: str) -> str:
        """Heartbeat key with a TTL: the server is live while it exists."""
        return f"{self.prefix}server:{server_id}:alive"

    @property
    def device_turn(self) -> str:
        """Colocated placement: JSON of whose turn the device is (``buffer.colocation``)."""
        return self.prefix + "device:turn"

    @property
    def device_released(self) -> str:
        """Colocated placement: hash server_id -> the trainer turn (``epoch:step``) for which its engines released
        their memory and have not resumed since."""
        return self.prefix + "device:released"

    @property
    def device_epoch(self) -> str:
        """Colocated placement: counter, one per trainer start; a turn carries its start's, so a step retaken after a
        restart is a new turn."""
        return self.prefix + "device:epoch"

    @property
    def device_engines(self) -> str:
        """Colocated placement: hash a server's engine URLs (space-separated) -> JSON list of the memory tags they hold
        released, so a restarted server knows (SGLang cannot tell, and dies resuming what it holds)."""
        return self.prefix + "device:engines"

    @property
    def trainer_epoch(self) -> str:
        """Counter, one per trainer that took or acked groups (``ReplayBuffer.fence``): only the newest may go on."""
        return self.prefix + "trainer:epoch"

    @property
    def trainer_alive(self) -> str:
        """The trainer's lease: a key with a TTL (``buffer.claim_idle_ms``) naming the trainer that holds it (pid, host
        and trainer epoch), which rank 0 renews from a thread of its own while it runs, only while it is the run's
        newest trainer, and deletes as it exits (``trainer.metrics.TrainerLease``). A trainer killed without recording
        its end (SIGKILL, the OOM killer, a lost node) lets it lapse: a job's delete then takes the groups pending for
        the trainer as no one's."""
        return self.prefix + "trainer:alive"

    @property
    def trainer(self) -> str:
        """Hash: the trainer's step, version, heartbeat and metrics address (written by rank 0); once it stopped,
        where and why (``TRAINER_FINISHED_FIELDS``); ``leased`` once a trainer that keeps a lease (``trainer_alive``)
        started, so a lapsed one reads as its death."""
        return self.prefix + "trainer"

    @property
    def api(self) -> str:
        """Hash: where the API that started last listens (``url``, ``pid``), for whoever started it."""
        return self.prefix + "api"

    @property
    def steps(self) -> str:
        """Stream of per-step trainer metrics (capped), read by the API's charts."""
        return self.prefix + "steps"

    def trajectories(self, job_id: str) -> str:
        """Stream of per-sample summaries of a job (messages, tool calls, reward) for reading back."""
        return f"{self.prefix}traj:{job_id}"
