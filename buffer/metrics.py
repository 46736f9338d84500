"""Prometheus metrics of the buffer, in a registry owned by whoever owns the queue objects."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge

from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys

TASK_STREAMS = {"train": "tasks", "eval": "tasks_eval"}  # a task kind's ``stream`` label, as its depth's


def stream_depths(client: redis.Redis, keys: Keys) -> dict[str, tuple[int, int | None]]:
    """The length of each of the run's streams by its ``stream`` label, and how many of its entries its consumers
    hold (None for a stream nobody consumes: dead letters, entries moved aside, groups kept for a newer trainer), in
    one pipelined round trip: what the depth gauges and the API's status show."""
    streams = {
        **{label: (keys.tasks(kind), ROLLOUT_GROUP) for kind, label in TASK_STREAMS.items()},
        "groups": (keys.groups, TRAINER_GROUP),
        "tasks_dead": (keys.tasks_dead, None),
        "tasks_malformed": (keys.tasks_malformed, None),
        "groups_malformed": (keys.groups_malformed, None),
        "groups_newer": (keys.groups_newer, None),
    }
    pipe = client.pipeline(transaction=False)
    for key, group in streams.values():
        pipe.xlen(key)
        if group is not None:
            pipe.xinfo_groups(key)
    replies = iter(pipe.execute(raise_on_error=False))
    out: dict[str, tuple[int, int | None]] = {}
    for label, (_key, group) in streams.items():
        length = next(replies)
        pending = None
        if group is not None:
            infos = next(replies)
            names = (group, group.encode())
            pending = sum(int(i["pending"]) for i in infos if i["name"] in names) if isinstance(infos, list) else 0
        out[label] = (length if isinstance(length, int) else 0, pending)
    return out


class BufferMetrics:
    """Counters shared by the task queue, the replay buffer and staleness control of one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.depth = Gauge("rollwave_buffer_depth", "entries in a stream (queued + pending)", ["stream"], registry=r)
        self.pending = Gauge(
            "rollwave_buffer_pending", "entries delivered to a consumer and not yet acked", ["stream"], registry=r
        )
        self.redeliveries = Counter(
            "rollwave_buffer_redeliveries_total",
            "entries delivered again: reclaimed from a consumer idle past its lease (another, or this one's earlier "
            "life after a restart or its periodic rescan)", ["stream"], registry=r,
        )
        self.dead_letters = Counter("rollwave_buffer_dead_letters_total", "tasks moved to dead letters", registry=r)
        self.malformed = Counter(
            "rollwave_buffer_malformed_total", "entries moved aside as malformed", ["stream"], registry=r
        )
        self.newer_schema = Counter(
            "rollwave_buffer_newer_schema_total",
            "train groups of a schema newer than this trainer reads: parked in groups:newer (action=parked) for a "
            "trainer that reads it, or moved back into groups by one (action=restored)", ["action"], registry=r,
        )
        self.stale_dropped = Counter(
            "rollwave_buffer_stale_dropped_total", "groups dropped by the trainer as too stale", registry=r
        )
        self.degenerate_dropped = Counter(
            "rollwave_buffer_degenerate_dropped_total",
            "groups dropped by the trainer because their rewards were all equal (buffer.filter_degenerate_groups)",
            registry=r,
        )
        self.cancelled = Counter(
            "rollwave_buffer_cancelled_total", "tasks and groups of cancelled jobs acked without rollout or training",
            ["stream"], registry=r,
        )
        self.admission_waits = Counter(
            "rollwave_buffer_admission_waits_total", "groups that waited for staleness admission", registry=r
        )
        self.backpressure_waits = Counter(
            "rollwave_buffer_backpressure_waits_total", "puts that waited because the buffer was full", registry=r
        )
        self.duplicates_dropped = Counter(
            "rollwave_buffer_duplicates_dropped_total", "groups skipped because already written or trained",
            registry=r,
        )
        self.deleted_pending = Counter(
            "rollwave_buffer_deleted_pending_total",
            "pending entries found deleted from their stream (an XDEL or trim by hand) and acked away when reclaimed, "
            "or acked by the trainer that held them (a reclaimed task or group gives its admission slot back, and its "
            "job counts it: a task dead_lettered, a group lost)", ["stream"],
            registry=r,
        )
        self.deleted_undelivered = Counter(
            "rollwave_buffer_deleted_undelivered_total",
            "entries found deleted from their stream (an XDEL or trim by hand) before any delivery, by the sweep of "
            "the records they left (a task gives its admission slot back, if it held one, and its job counts it "
            "dead_lettered; a group gives its slot back and its job counts it lost)", ["stream"],
            registry=r,
        )
        self.fenced_refusals = Counter(
            "rollwave_buffer_fenced_refusals_total",
            "writes refused to a trainer because a newer trainer of the run started (a take, an ack, a checkpoint, a "
            "push's commit, a published version or push result, a step, start or end in the run's status, a device "
            "turn; the log says which)", registry=r,
        )
        self.task_gone_dropped = Counter(
            "rollwave_buffer_task_gone_dropped_total", "groups not admitted or not written because their task was no "
            "longer pending for their worker (it lost its lease, and another took the task over, or failed, "
            "dead-lettered, cancelled or handed it back)",
            registry=r,
        )

    def observe(self, client: redis.Redis, keys: Keys) -> None:
        """Refresh the depth and pending gauges of the run's streams (one pipelined round trip)."""
        for label, (length, pending) in stream_depths(client, keys).items():
            self.depth.labels(stream=label).set(length)
            if pending is not None:
                self.pending.labels(stream=label).set(pending)
