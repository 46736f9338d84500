"""Staleness control (AReaL's η = ``buffer.max_staleness``, arXiv 2505.24298): admission on the rollout side, a
filter on the trainer's. Both read the one ``buffer`` config section (``max_staleness``, ``groups_per_step``,
``push_every``).

Admission: a server starts a new train group only while
``admitted < trained(version) + (η + 1 − lag) × groups_per_version``, ``groups_per_version = groups_per_step ×
push_every`` (a version spans ``push_every`` trainer steps, so the trainer needs that many steps' groups to
reach the next one). ``version`` is the published version (a quorum of servers committed it) and
``trained(version)`` how many groups its weights were trained on, recorded with it. ``lag = max(0, version −
served)``, ``served`` being the version the admitting server itself serves: a lagging server counts
``groups_per_version`` fewer per version it lags. So a server that missed
pushes is held to its own weights: it stops taking work whose every token would reach the trainer already
stale, and starts again once a push catches it up. Counting trained groups, not versions, keeps the bound
exact when versions and steps part: a resumed trainer publishes the weights it resumed from as a new version,
trained on no more groups than before. Checked and incremented in one Lua call, so concurrent servers never
overshoot. An admitted group id is remembered until its task is done, so a redelivered task is not admitted
twice, and a group already written is not admitted again. A server admits a task only while it holds it (pending for
it, in the same Lua call): one resumed from a freeze past its lease (SIGSTOP, a GC pause) may hold tasks that another
server reclaimed and finished, cancelled or dead-lettered meanwhile, and a slot it took for one would be given back by
nothing (its put and its ack are refused), so admission would shrink for good. A slot taken while the server held the
task is its group id's, which the server that takes the task over is admitted on, and whose ending gives it back or
hands it to the group written. A group that never reaches training (dead-lettered task, dropped as stale) gives its
slot back, so the bound counts groups in flight or trained, as AReaL's ``StalenessManager`` does.

Budget: the trainer publishes how many groups it trains in all (``total_steps × groups_per_step``), and
``admitted`` never passes it, so the rollout generates nothing for steps that never come (without it, in one
30-step async run of ``bench/e2e.py``, the engine generated 12% more tokens than were trained). Every group
admitted is trained or gives its slot back, so the last step is always filled.

Filter: the trainer drops a group whose oldest generated token came from a policy older than
``version - max_staleness``, counted in ``rollwave_buffer_stale_dropped_total``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis

from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.metrics import BufferMetrics
from buffer.schema import TrajectoryGroup
from core.config import BufferConfig

if TYPE_CHECKING:
    from buffer.replay import ReplayBuffer
    from buffer.task_queue import TaskEntry

log = logging.getLogger(__name__)

# KEYS: admitted, version, admitted ids, version's trained groups, group state, budget, then the task stream when the
# group's task is given. ARGV: group id, max_staleness, groups per version, served version ('' if unknown), then the
# task's entry id and consumer. When the task is no longer pending for that consumer (it lost its lease), nothing is
# done, and it returns the consumer that holds the task now (another server took it over), or -1 when none does (it was
# ended meanwhile). A group already written (its task done by another
# server that reclaimed it) takes no slot: it is in flight nowhere, and its duplicate is dropped at the put. No budget:
# no cap.
GIVE_UP_CHECK_S = 5.0  # how often a wait for admission asks whether to go on (one Redis read per waiting task)
_ADMIT = """
if KEYS[7] then
  local held = redis.call('XPENDING', KEYS[7], '""" + ROLLOUT_GROUP + """', ARGV[5], ARGV[5], 1)[1]
  if not held then return -1 end
  if held[2] ~= ARGV[6] then return held[2] end
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[5], ARGV[1]) == 1 then return 1 end
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
local lag = 0
if ARGV[4] ~= '' then lag = math.max(0, version - tonumber(ARGV[4])) end
local trained = tonumber(redis.call('GET', KEYS[4]) or '0')
local admitted = tonumber(redis.call('GET', KEYS[1]) or '0')
local budget = redis.call('GET', KEYS[6])
if budget and admitted >= tonumber(budget) then return 0 end
if admitted < trained + (tonumber(ARGV[2]) + 1 - lag) * tonumber(ARGV[3]) then
  redis.call('INCR', KEYS[1])
  redis.call('HSET', KEYS[3], ARGV[1], '1')
  return 1
end
return 0
"""

# KEYS: admitted, admitted ids. ARGV: group id.
_RELEASE = """
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then redis.call('DECR', KEYS[1]) end
return 1
"""

# KEYS: version, version's trained groups. ARGV: new version, the groups it was trained on. The committed version
# only goes up (the same one again, a resumed colocated trainer's, brings its count); returns the current one. A
# trainer's runs fenced (ReplayBuffer.fenced_script: the trainer epoch and its own after these, -1 when refused).
_SET_VERSION = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if new >= current then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
  return new
end
return current
"""


class LeaseLost(RuntimeError):
    """A server asked admission for a task it no longer holds: frozen past ``buffer.claim_idle_ms``, it lost its lease,
    and another server took the task over (its message names it), or the task was ended since. Not admitted: the task
    is that server's."""


def is_stale(group: TrajectoryGroup, version: int, max_staleness: int) -> bool:
    """True if the group's oldest generated token is older than ``version - max_staleness`` (no tokens: never)."""
    oldest = group.oldest_version()
    return oldest is not None and oldest < version - max_staleness


def split_stale(
    items: Sequence[tuple[str, TrajectoryGroup]], version: int, max_staleness: int, metrics: BufferMetrics
) -> tuple[list[tuple[str, TrajectoryGroup]], list[tuple[str, TrajectoryGroup]]]:
    """The trainer-side filter: (fresh, stale) items of a batch from ``take``, counting the stale ones.

    Ack the stale ones with ``ReplayBuffer.ack(..., stale_group_ids=...)``, which releases their slots."""
    fresh, stale = [], []
    for item in items:
        (stale if is_stale(item[1], version, max_staleness) else fresh).append(item)
    if stale:
        metrics.stale_dropped.inc(len(stale))
        log.info("dropped %d stale group(s) at policy version %d (buffer.max_staleness %d): %s", len(stale), version,
                 max_staleness, ", ".join(f"{g.group_id} (v{g.oldest_version()})" for _, g in stale))
    return fresh, stale


class StalenessControl:
    """Admission control and the committed policy ``version`` of one run."""

    def __init__(
        self, client: redis.Redis, keys: Keys, cfg: BufferConfig, metrics: BufferMetrics | None = None,
        fence: ReplayBuffer | None = None,
    ) -> None:
        """``fence``: the trainer's buffer, whose epoch its versions are published under (``set_version``)."""
        self.redis = client
        self.keys = keys
        self.max_staleness = cfg.max_staleness
        self.groups_per_version = cfg.groups_per_step * cfg.push_every
        self.metrics = metrics or BufferMetrics()
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._set_version = (client.register_script(_SET_VERSION) if fence is None
                             else fence.fenced_script(_SET_VERSION, "publishing a policy version"))
        self._budget_logged = False  # once per process

    def bound(self, version: int, trained: int, served: int | None = None, budget: int | None = None) -> int:
        """How many groups may be admitted in all, by a server serving ``served`` (None: unknown), while the
        published ``version`` was trained on ``trained`` groups and the run trains ``budget`` (None: no cap)."""
        lag = 0 if served is None else max(0, version - served)
        bound = trained + (self.max_staleness + 1 - lag) * self.groups_per_version
        return bound if budget is None else min(bound, budget)

    def set_budget(self, groups: int) -> None:
        """Publish how many train groups the run's trainer trains in all: admission stops there. A trainer
        resumed with more steps raises it."""
        self.redis.set(self.keys.budget, int(groups))

    def budget(self) -> int | None:
        """The run's budget of train groups (None: none published)."""
        value = self.redis.get(self.keys.budget)
        return None if value is None else int(value)

    def version(self) -> int:
        """The latest committed policy version (0 before the first commit)."""
        return int(self.redis.get(self.keys.version) or 0)

    def trained(self) -> int:
        """Groups acked as trained in this run, by every trainer that ran it (``ReplayBuffer.ack``)."""
        return int(self.redis.get(self.keys.trained) or 0)

    def set_version(self, version: int, trained: int) -> int:
        """Publish a committed version whose weights were trained on ``trained`` groups of this run; an older
        version is ignored. Returns the version now current. With a ``fence``, refused (``TrainerFenced``) once a
        newer trainer of the run started: a fenced trainer's late quorum (or hand-over) used to publish its version,
        and the groups it was trained on, over the newer trainer's."""
        return int(self._set_version([self.keys.version, self.keys.version_trained], [int(version), int(trained)]))

    def admitted(self) -> int:
        return int(self.redis.get(self.keys.admitted) or 0)

    def capacity(self, served: int | None = None) -> int:
        """How many more groups would be admitted now (a hint; ``try_admit`` is the atomic check)."""
        version, trained, admitted, budget = self.redis.mget(
            self.keys.version, self.keys.version_trained, self.keys.admitted, self.keys.budget)
        admitted, budget = int(admitted or 0), None if budget is None else int(budget)
        room = max(0, self.bound(int(version or 0), int(trained or 0), served, budget) - admitted)
        if budget is not None and admitted >= budget and not self._budget_logged:
            self._budget_logged = True
            log.info("admission reached the run's budget: its trainer trains %d groups in all and as many are admitted "
                     "(trained or in flight); another is admitted only for one given back", budget)
        return room

    def try_admit(self, group_id: str, served: int | None = None, task: TaskEntry | None = None) -> bool:
        """Admit one group if the bound allows (for a server serving ``served``; None: unknown); a group id
        admitted before is admitted again at no cost. With the ``task`` the group is made for, only while its consumer
        holds it: else ``LeaseLost`` (logged and counted), no slot taken, as nothing would give it back."""
        keys = [self.keys.admitted, self.keys.version, self.keys.admitted_ids, self.keys.version_trained,
                self.keys.group_state, self.keys.budget]
        args = [group_id, self.max_staleness, self.groups_per_version, "" if served is None else int(served)]
        if task is None:
            return bool(self._admit(keys, args))
        admitted = self._admit([*keys, task.stream], [*args, task.entry_id, task.consumer])
        if isinstance(admitted, bytes) or admitted < 0:
            self.metrics.task_gone_dropped.inc()
            why = (f"{admitted.decode()} took the task over and holds it" if isinstance(admitted, bytes) else
                   "the task was ended since (by a server that took it over, a delete of its cancelled job, or the "
                   "reclaim of its entry deleted by hand)")
            error = (f"group {group_id}: not admitted: its task {task.entry_id} is no longer held by {task.consumer} "
                     f"(frozen past buffer.claim_idle_ms, it lost its lease): {why}")
            log.warning("%s; left to that server", error)
            raise LeaseLost(error)
        return bool(admitted)

    def admit(self, group_id: str, stop: threading.Event | None = None, timeout_s: float | None = None,
              served: Callable[[], int] | None = None, give_up: Callable[[], bool] | None = None,
              task: TaskEntry | None = None) -> bool:
        """Wait (polling with backoff) until the group is admitted; False if ``stop`` is set, time runs out or
        ``give_up()`` (asked every ``GIVE_UP_CHECK_S`` of waiting: its job cancelled meanwhile) is true.
        ``served()`` is read at every try: a lagging server is admitted as soon as a push catches it up. With its
        ``task``, raises ``LeaseLost`` once the task is no longer this consumer's (``try_admit``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 0.01
        stop = stop or threading.Event()
        waited = False
        next_check = time.monotonic() + GIVE_UP_CHECK_S
        while not self.try_admit(group_id, None if served is None else served(), task):
            if not waited:
                self.metrics.admission_waits.inc()
                waited = True
            if deadline is not None and time.monotonic() + delay > deadline:
                return False
            if stop.wait(delay):
                return False
            if give_up is not None and time.monotonic() >= next_check:
                if give_up():
                    return False
                next_check = time.monotonic() + GIVE_UP_CHECK_S
            delay = min(delay * 2, 1.0)
        return True

    def release(self, group_id: str) -> bool:
        """Give back the slot of an admitted group that will never be trained; False if it held none."""
        return bool(self._release([self.keys.admitted, self.keys.admitted_ids], [group_id]))
