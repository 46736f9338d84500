"""The rollout-server registry: who is serving, where, at which policy version, and whether it is alive.

``servers`` is a hash server_id -> JSON record; each server also keeps a key with a TTL alive by
heart-beating. A server whose key expired is dead even if its record is still there (it crashed
without deregistering); the trainer's pusher and the API read ``live_servers()``. The trainer records
the outcome of its last weight push to each server in ``pushes`` (a server whose push failed is a
straggler), apart from the record the server itself rewrites at every heartbeat.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TypeVar

import redis

from buffer.keys import Keys

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass
class ServerInfo:
    """What other components need to know about one rollout server."""

    server_id: str
    engine_url: str
    grpc_address: str = ""
    metrics_address: str = ""  # host:port of its Prometheus metrics, as bound ("" when not served)
    openai_url: str = ""  # the episode endpoint agents call (agent jobs)
    version: int = 0
    started: float = field(default_factory=time.time)
    heartbeat: float = field(default_factory=time.time)
    stats: dict[str, float] = field(default_factory=dict)  # counters for the dashboard (tokens, tool errors)


@dataclass
class PushRecord:
    """The last weight push to one server: the version, whether it committed, and if not the stage (connect,
    stage, commit), the reason and the error; ``serves`` is the version the server served at the end."""

    version: int
    ok: bool
    stage: str = ""
    reason: str = ""
    error: str = ""
    serves: int = 0
    at: float = field(default_factory=time.time)

    @property
    def straggler(self) -> bool:
        return not self.ok


class ServerRegistry:
    """Register, heartbeat and list rollout servers; a server is live for ``ttl_s`` after its last beat."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float = 10.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.redis = client
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)

    def register(self, info: ServerInfo) -> None:
        info.started = time.time()
        self.heartbeat(info)

    def heartbeat(self, info: ServerInfo) -> None:
        """Refresh the record (version, addresses) and the liveness key."""
        info.heartbeat = time.time()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.servers, info.server_id, json.dumps(asdict(info)))
        pipe.set(self.keys.server_alive(info.server_id), "1", px=self.ttl_ms)
        pipe.execute()

    def deregister(self, server_id: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.keys.servers, server_id)
        pipe.hdel(self.keys.pushes, server_id)
        pipe.delete(self.keys.server_alive(server_id))
        pipe.execute()

    def record_push(self, server_id: str, record: PushRecord) -> None:
        self.redis.hset(self.keys.pushes, server_id, json.dumps(asdict(record)))

    def pushes(self) -> dict[str, PushRecord]:
        """The last push to each server, by server id."""
        records = {k.decode(): _decode(PushRecord, self.keys.pushes, k.decode(), v)
                   for k, v in self.redis.hgetall(self.keys.pushes).items()}
        return {k: r for k, r in records.items() if r is not None}

    def all_servers(self) -> list[tuple[ServerInfo, bool]]:
        """Every registered server with whether it is live, sorted by id."""
        records = self.redis.hgetall(self.keys.servers)
        ids = sorted(k.decode() for k in records)
        if not ids:
            return []
        alive = self.redis.mget([self.keys.server_alive(i) for i in ids])
        infos = [(_decode(ServerInfo, self.keys.servers, i, records[i.encode()]), flag is not None)
                 for i, flag in zip(ids, alive, strict=True)]
        return [(info, live) for info, live in infos if info is not None]

    def live_servers(self) -> list[ServerInfo]:
        return [info for info, live in self.all_servers() if live]


def _decode(cls: type[R], key: str, name: str, raw: bytes) -> R | None:
    """The record in field ``name`` of hash ``key``, without the fields this version does not know (a newer
    component wrote them); None, logged with the key and field, for one that still does not parse, so a bad
    record hides only itself, not every server from the pusher and the API."""
    try:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("%s[%s]: record skipped, it does not parse: %s: %s", key, name, type(exc).__name__, exc)
        return None
