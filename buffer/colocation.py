"""Turn-taking on a shared device (``placement.mode=colocated``): the trainer and the rollout servers' engines
hold the device in turns, and Redis says whose turn it is.

The trainer takes a turn when it has a full batch: ``take(epoch, step)``; every live server then pauses its
engines, has them release their memory (weights and KV) and reports it with ``released(server_id, turn)``; the
trainer trains once every live server has (``wait_released``). It gives the device back with ``give(epoch, step,
version, path)``: the weights to serve next, written to ``path`` (a local push: no gRPC). Each server resumes its
engines, loads them, generates the next batch and withdraws its report (``resumed``). A server that starts
during the trainer's turn releases too; one that dies leaves the live set, so the trainer does not wait for it.

Each trainer start takes a new ``epoch`` (``new_epoch``) and every turn carries it: a trainer that resumes from an
older checkpoint and takes a step again takes a new turn, which the servers release for and it waits for, never
a report left from before its restart. What the engines hold released is recorded by their URLs
(``engines_released``), so a server restarted while they are released resumes them instead of loading into them.

The trainer's turns are written only while it is the run's newest trainer (``ReplayBuffer.fenced_script``): a trainer
fenced by a newer one used to hand the engines its weights after its step, or have them release the device for a
step of its own, over the newer trainer's turns. A trainer waiting for the releases writes its turn again whenever
Redis no longer holds it, so a newer trainer's turn stops it at once and a lost one is restored.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import redis

from buffer.keys import Keys
from buffer.registry import ServerRegistry

if TYPE_CHECKING:
    from buffer.replay import ReplayBuffer

log = logging.getLogger(__name__)

POLL_S = 0.02
_SET_TURN = "redis.call('SET', KEYS[1], ARGV[1])"  # KEYS: the turn. ARGV: its JSON. Run fenced (fenced_script).
# KEYS: the epoch counter. ARGV: an epoch the new one must exceed. The counter's next value, raised past ARGV[1].
_NEW_EPOCH = """
local epoch = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[1])
if epoch <= floor then
  epoch = floor + 1
  redis.call('SET', KEYS[1], epoch)
end
return epoch
"""
# KEYS: the releases hash. ARGV: server id, the report read, ... Each removed only while it is still the report read: a
# server back in the live set reporting anew between the read and the removal keeps its new report.
_PRUNE = """
local pruned = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    pruned = pruned + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return pruned
"""


@dataclass(frozen=True)
class Turn:
    """Whose turn it is: ``trainer`` (for training ``step``) or ``rollout`` (serve ``version`` from ``path``), in
    trainer start ``epoch``."""

    holder: str
    step: int
    version: int = 0
    path: str = ""
    epoch: int = 0

    @property
    def key(self) -> str:
        """What a release for this turn is reported under."""
        return f"{self.epoch}:{self.step}"


class DeviceTurns:
    """Both sides of the hand-over of one run."""

    def __init__(self, client: redis.Redis, keys: Keys, fence: ReplayBuffer | None = None) -> None:
        """``fence``: the trainer's buffer; its turns (``take``, ``give``) are refused (``TrainerFenced``) once a newer
        trainer of the run started."""
        self.redis = client
        self.keys = keys
        self._fenced_set = None if fence is None else fence.fenced_script(_SET_TURN, "a device turn")
        self._new_epoch = client.register_script(_NEW_EPOCH)
        self._prune = client.register_script(_PRUNE)

    def turn(self) -> Turn | None:
        raw = self.redis.get(self.keys.device_turn)
        return None if raw is None else Turn(**json.loads(raw))

    def new_epoch(self, above: int = 0) -> int:
        """A trainer start's epoch, above every earlier start's: those Redis counted, and ``above`` (the highest
        the start finds written: Redis may have lost its count, and a repeated epoch names another start's
        weights as its own)."""
        return int(self._new_epoch(keys=[self.keys.device_epoch], args=[above]))

    def take(self, epoch: int, step: int) -> Turn:
        """The trainer asks for the device to train ``step``."""
        turn = Turn("trainer", step, epoch=epoch)
        self._set(turn)
        return turn

    def give(self, epoch: int, step: int, version: int, path: str) -> None:
        """The trainer is done with ``step``: the servers serve ``version`` from ``path`` next."""
        self._set(Turn("rollout", step, version, path, epoch))

    def _set(self, turn: Turn) -> None:
        raw = json.dumps(asdict(turn))
        if self._fenced_set is None:
            self.redis.set(self.keys.device_turn, raw)
        else:
            self._fenced_set([self.keys.device_turn], [raw])

    def released(self, server_id: str, turn: Turn) -> None:
        """A server's engines released their memory for the trainer's ``turn``."""
        self.redis.hset(self.keys.device_released, server_id, turn.key)

    def resumed(self, server_id: str) -> None:
        """A server's engines hold their memory again: its report no longer stands."""
        self.redis.hdel(self.keys.device_released, server_id)

    def wait_released(self, turn: Turn, servers: ServerRegistry, timeout_s: float) -> list[str]:
        """Wait until every live server released for ``turn``; returns their ids. TimeoutError names the
        servers that did not, and the stage. A turn no longer in Redis is written again: a newer trainer's refuses
        it at once (``TrainerFenced``; a fenced trainer waited out the timeout, then blamed the servers), and one
        Redis lost (a crash that lost its last second of writes) is restored (the servers never saw it). The reports of
        servers no longer live are removed as it reads them (``_prune_dead``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.turn() != turn:
                self._set(turn)
            live = [s.server_id for s in servers.live_servers()]
            reports = {sid.decode(): key.decode() for sid, key in self.redis.hgetall(self.keys.device_released).items()}
            self._prune_dead(turn, live, reports)
            waiting = [sid for sid in live if reports.get(sid) != turn.key]
            if not waiting:
                return live
            if time.monotonic() > deadline:
                raise TimeoutError(f"colocated step {turn.step}: rollout server(s) {', '.join(waiting)} did not "
                                   f"release their engines' memory within {timeout_s:g} s (stage release)")
            time.sleep(POLL_S)

    def _prune_dead(self, turn: Turn, live: list[str], reports: dict[str, str]) -> None:
        """Remove the reports of servers out of the live set (deregistered, or dead) made for another turn than
        ``turn``: the hash kept every dead server's id for good. A report for ``turn`` stays, as a server whose
        heartbeat lapsed may come back for it (it does not release again for a turn it handled)."""
        dead = {sid: key for sid, key in reports.items() if sid not in live and key != turn.key}
        if dead and self._prune(keys=[self.keys.device_released], args=[v for item in dead.items() for v in item]):
            log.info("dropped the device releases of rollout server(s) no longer live: %s", ", ".join(sorted(dead)))

    def engines_released(self, urls: list[str]) -> list[str]:
        """The memory tags the engines at ``urls`` hold released, as the server that drove them last recorded."""
        raw = self.redis.hget(self.keys.device_engines, " ".join(urls))
        return [] if raw is None else json.loads(raw)

    def record_engines(self, urls: list[str], tags: list[str]) -> None:
        """The engines at ``urls`` hold ``tags`` released (none: they hold all their memory)."""
        if tags:
            self.redis.hset(self.keys.device_engines, " ".join(urls), json.dumps(tags))
        else:
            self.redis.hdel(self.keys.device_engines, " ".join(urls))
