"""Turn-taking on a shared device (``placement.mode=colocated``): the trainer and the rollout servers' engines
hold the device in turns, and Redis says whose turn it is.

The trainer takes a turn when it has a full batch: ``take(step)``; every live server then pauses its engines,
has them release their memory (weights and KV) and reports it with ``released(server_id, step)``; the trainer
trains once every live server has (``wait_released``). It gives the device back with ``give(step, version,
path)``: the weights to serve next, written to ``path`` (a local push: no gRPC). Each server resumes its engines,
loads them and generates the next batch. A server that starts during the trainer's turn releases too; one that
dies leaves the live set, so the trainer does not wait for it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis

from buffer.keys import Keys
from buffer.registry import ServerRegistry

POLL_S = 0.02


@dataclass(frozen=True)
class Turn:
    """Whose turn it is: ``trainer`` (for training ``step``) or ``rollout`` (serve ``version`` from ``path``)."""

    holder: str
    step: int
    version: int = 0
    path: str = ""


class DeviceTurns:
    """Both sides of the hand-over of one run."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def turn(self) -> Turn | None:
        raw = self.redis.get(self.keys.device_turn)
        return None if raw is None else Turn(**json.loads(raw))

    def take(self, step: int) -> None:
        """The trainer asks for the device to train ``step``."""
        self.redis.set(self.keys.device_turn, json.dumps(asdict(Turn("trainer", step))))

    def give(self, step: int, version: int, path: str) -> None:
        """The trainer is done with ``step``: the servers serve ``version`` from ``path`` next."""
        self.redis.set(self.keys.device_turn, json.dumps(asdict(Turn("rollout", step, version, path))))

    def released(self, server_id: str, step: int) -> None:
        """A server's engines released their memory for the trainer's ``step``."""
        self.redis.hset(self.keys.device_released, server_id, step)

    def wait_released(self, step: int, servers: ServerRegistry, timeout_s: float) -> list[str]:
        """Wait until every live server released for ``step``; returns their ids. TimeoutError names the
        servers that did not, and the stage."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [s.server_id for s in servers.live_servers()]
            done = {sid.decode() for sid, s in self.redis.hgetall(self.keys.device_released).items() if int(s) == step}
            waiting = [sid for sid in live if sid not in done]
            if not waiting:
                return live
            if time.monotonic() > deadline:
                raise TimeoutError(f"colocated step {step}: rollout server(s) {', '.join(waiting)} did not release "
                                   f"their engines' memory within {timeout_s:.0f} s (stage release)")
            time.sleep(POLL_S)
