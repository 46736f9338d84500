"""The replay buffer: finished train groups in the ``groups`` stream, consumed by the trainer (group ``trainer``).

Exactly-once effect over at-least-once delivery:
- a group is written and its task acked in one Lua call, and a group id already written is not written
  again (``groups:state`` hash), so a redelivered task never makes a second copy;
- the trainer acks after the step that used the groups is checkpointed or committed; the ack marks the
  group ids consumed in the same call, and ``take`` skips ids already consumed or held, so a group is
  trained on once even when the trainer dies between take and ack; an entry this process acked that comes
  back pending (Redis lost the ack) is acked again, not delivered;
- one trainer per run: each takes a new trainer epoch (``fence``), and an older one still running is refused
  its next take or ack (``TrainerFenced``), checked in the ack's Lua call, its next checkpoint or push
  commit (``check_fence``, which the trainer calls), and any other write it makes to the run (``fenced_write``: a
  MULTI under WATCH of the epoch, its duplicates acked away, its start and end in the run's status; ``fenced_script``:
  a Lua call checking the epoch, its steps, published versions and device turns).
Bounded: a put waits while ``max_groups`` groups are not yet delivered to the trainer. Nothing is ever
trimmed: an entry leaves the stream only when the trainer acks it, and its id leaves ``groups:state`` once
``dedup_window`` newer groups were consumed. Groups of a cancelled job are acked away unread, counted
``cancelled``. An eval group's results (reward sum, samples) go to ``eval:<job>``; its tokens are not kept.
A written group takes over its admission slot (entry field ``s``), and an ack as anything but trained gives back
only a slot the group holds. A group of a schema newer than this trainer reads is kept in ``groups:newer`` (its job
counts nothing, its slot stays) until a trainer that reads it moves it back at its first take (and again should Redis
lose that move; the ack of a group the trainer holds from a lost move finds it parked).
An entry deleted by hand while pending (an XDEL, a trim) is acked as any other by the trainer that holds it (a restarted
one acking what its checkpoint covers reads its job, payload key and slot from the record its put wrote,
``Keys.group_records``, which outlives the entry); one no live trainer holds (its trainer died) is ended as the reclaim
finds it, by that record: its payload key deleted, its id consumed, its slot given back, its job counting it ``lost``;
so is one deleted before it was delivered, by the sweep of the records (``buffer.streams.Reclaimer``). One the live
trainer acked, whose ack Redis lost, is acked again with its outcome.

The encoded group never passes through Lua: Redis 7 hashes every byte of every Lua string (a 64 KiB
argument costs its single thread ~60 us, 30x Redis 6.2), so a put SETs the payload under a key of its own
and the script, in the same MULTI, writes a stream entry naming that key or deletes it; ``take`` reads
payloads with one MGET and the ack deletes them. An entry that carries its group inline (field ``g``, as
written before) is read as well.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import redis

from buffer.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from buffer.metrics import BufferMetrics
from buffer.schema import NewerSchema, SchemaError, TrajectoryGroup, decode_group, encode_group, reads_version
from buffer.streams import Gone, Reclaimer, named
from buffer.task_queue import TaskEntry
from core.config import BufferConfig

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # below the client's socket timeout; take() loops until its own deadline
WRITTEN, DUPLICATE, FULL, TASK_GONE = 1, 0, -1, -2  # what a put did (try_put, put_many)
# what ``_PUT`` returns, below TASK_GONE, for a task pending for no one whose loss it can tell more of (try_put returns
# TASK_GONE for each)
_JOB_DELETED, _ENTRY_UNDELIVERED, _ENTRY_DELETED = -3, -4, -5
# why a put found its task pending for no one, by what ``_PUT`` returns, as its log says it
_TASK_GONE_WHY = {
    TASK_GONE: "its entry and its record are gone: it was ended after this server lost its lease (frozen past "
    "buffer.claim_idle_ms): another server failed, dead-lettered, cancelled or handed it back; or it was deleted by "
    "hand (an XDEL or trim) and the reclaim or the records' sweep ended it (dead_lettered for its job); or a delete of "
    "its cancelled job removed it",
    _JOB_DELETED: "its job was deleted (cancelled, then deleted: the delete removed the task, which this server no "
    "longer held, frozen past buffer.claim_idle_ms)",
    _ENTRY_UNDELIVERED: "its entry is in the stream, delivered to no one (Redis lost the delivery: a restart); a "
    "server reads it again",
    _ENTRY_DELETED: "its entry was deleted by hand (an XDEL or trim), delivered to no one (Redis lost the delivery: a "
    "restart); its record is left, which the records' sweep ends (dead_lettered for its job)",
}
# Redis's proto-max-bulk-len (its default, the embedded server's): a longer argument is refused and the connection
# closed, which the client took for an outage and retried, the whole payload each time, then failed naming neither
# the group nor its size (the rollout server retried that put for ever). A server configured lower is read at the
# first train put (ReplayBuffer.payload_limit)
MAX_PAYLOAD_BYTES = 512 << 20

# KEYS: target stream (groups, or eval:<job>), group state, job hash, task stream, admitted ids, consumed ids list,
# the job's entries (``Keys.entries``: the task acked leaves them), the task stream's records (``Keys.task_gids``:
# likewise), the group records (``Keys.group_records``: a written train group's entry gets one), payload key (none for
# an eval group, whose entry holds its results only: an ACL that confines the user to the run's keys refuses a script
# naming any other, '' included).
# ARGV: gid, job_id, backlog bound (0: none), task entry id ('' none), reward sum, sample count, dedup window.
# Runs in the MULTI that SET the payload key: a written train group's entry names it (so does its groups:state
# value, which a retried MULTI finds); otherwise it is deleted. A group is written only while its task is pending
# (for this worker or another): a worker that lost its lease must not write a group whose task another one failed,
# dead-lettered or cancelled meanwhile, which has already been counted and given its admission slot back. An eval
# group is finished once written, so its id enters the consumed ids (and the dedup window) at once. A written train
# group takes its admission slot over from the admitted ids: its entry's field s is 1 when it holds one, 0 when it was
# never admitted (a put without a task, as put_many's), so the trainer's ack gives back only a slot the group holds.
# Returns 1 written, 0 duplicate (already written; its task is acked all the same), -1 full, or, the task pending for no
# one, why, as far as this call can tell (``_TASK_GONE_WHY``): -3 its job deleted, -4 its entry in the stream, -5 its
# entry deleted by hand with its record left, -2 both gone (ended) (nothing done for these).
_PUT = """
local gid, bound, task, payload = ARGV[1], tonumber(ARGV[3]), ARGV[4], KEYS[10] or ''
local written = redis.call('HGET', KEYS[2], gid)
if written then
  if payload ~= '' and written ~= payload then redis.call('DEL', payload) end  -- not this very put, retried
else
  if bound > 0 then
    local pending = redis.call('XPENDING', KEYS[1], '""" + TRAINER_GROUP + """')[1]
    if redis.call('XLEN', KEYS[1]) - pending >= bound then
      redis.call('DEL', payload)
      return -1
    end
  end
  if task ~= '' and not redis.call('XPENDING', KEYS[4], '""" + ROLLOUT_GROUP + """', task, task, 1)[1] then
    if payload ~= '' then redis.call('DEL', payload) end
    if redis.call('EXISTS', KEYS[3]) == 0 then return -3 end
    if redis.call('XRANGE', KEYS[4], task, task)[1] then return -4 end
    if redis.call('HEXISTS', KEYS[8], task) == 1 then return -5 end
    return -2
  end
  if payload ~= '' then
    local slot = tostring(redis.call('HDEL', KEYS[5], gid))
    redis.call('HSET', KEYS[2], gid, payload)
    local id = redis.call('XADD', KEYS[1], '*', 'p', payload, 'gid', gid, 'job', ARGV[2], 's', slot)
    redis.call('HSET', KEYS[9], id, cjson.encode({gid, ARGV[2], payload, slot}))
  else
    redis.call('HSET', KEYS[2], gid, 'w')
    redis.call('XADD', KEYS[1], '*', 'gid', gid, 'job', ARGV[2], 'reward_sum', ARGV[5], 'samples', ARGV[6])
    redis.call('RPUSH', KEYS[6], gid)
    for _ = 1, redis.call('LLEN', KEYS[6]) - tonumber(ARGV[7]) do
      redis.call('HDEL', KEYS[2], redis.call('LPOP', KEYS[6]))
    end
  end
  redis.call('HINCRBY', KEYS[3], 'completed', 1)
  redis.call('HINCRBYFLOAT', KEYS[3], 'reward_sum', ARGV[5])
  redis.call('HINCRBY', KEYS[3], 'samples', ARGV[6])
end
if task ~= '' and redis.call('XACK', KEYS[4], '""" + ROLLOUT_GROUP + """', task) == 1 then
  redis.call('XDEL', KEYS[4], task)
  redis.call('HDEL', KEYS[8], task)
  redis.call('HDEL', KEYS[5], gid)
  redis.call('SREM', KEYS[7], 't' .. task)
end
return written and 0 or 1
"""


# gone(id) of the groups stream (``buffer.streams.Gone``; KEYS after the stream: group records, admitted, group state,
# consumed ids list; ARGV from 7: the job hashes' key prefix, the dedup window). A group deleted by hand (an XDEL, a
# trim) that no live trainer holds (one that does acks it itself), pending or never delivered, will never be trained
# (nor acked again: a deleted entry that the live trainer acked before, whose ack Redis lost, is its to ack again, as
# trained or dropped, ``ReplayBuffer.take``): its record names its
# payload key, deleted; its group id, consumed (as an ack marks it: a late copy of it is a duplicate); the admission
# slot it holds, given back; and its job, which counts it ``lost`` (else the job waited for it for ever). An entry
# written before records has none: its slot goes back (taken to hold one, as every group a rollout server wrote).
_GROUP_GONE = """
local function gone(id)
  local record = redis.call('HGET', KEYS[2], id)
  local gid, job, payload, slot = '', '', '', ''
  if record then gid, job, payload, slot = unpack(cjson.decode(record)) end
  redis.call('HDEL', KEYS[2], id)
  if payload ~= '' then redis.call('DEL', payload) end
  if slot ~= '0' and tonumber(redis.call('GET', KEYS[3]) or '0') > 0 then redis.call('DECR', KEYS[3]) end
  if gid ~= '' then
    redis.call('HSET', KEYS[4], gid, 't')
    redis.call('RPUSH', KEYS[5], gid)
    for _ = 1, redis.call('LLEN', KEYS[5]) - tonumber(ARGV[8]) do
      redis.call('HDEL', KEYS[4], redis.call('LPOP', KEYS[5]))
    end
  end
  if job ~= '' and redis.call('EXISTS', ARGV[7] .. job) == 1 then redis.call('HINCRBY', ARGV[7] .. job, 'lost', 1) end
  return record and gid
end
"""


def _fence_lua(key: str, epoch: str) -> str:
    """Lua that returns -1 when the trainer epoch at ``key`` is newer than ours (``epoch``): a newer trainer of the
    run started. Ours is written back where Redis lost it (a restart without its data): only a newer one fences."""
    return f"""
local current, mine = tonumber(redis.call('GET', {key}) or '0'), tonumber({epoch})
if current > mine then return -1 end
if current < mine then redis.call('SET', {key}, mine) end
"""


# KEYS: trainer epoch. ARGV: this trainer's epoch. Returns -1 when fenced, else 0.
_FENCE = _fence_lua("KEYS[1]", "ARGV[1]") + "return 0"

# KEYS: groups stream, malformed stream, trainer epoch, then its job's hash and entries when the entry names a job.
# ARGV: entry id, this trainer's epoch, then the dead letter's field/value pairs. Written only while the entry is
# pending (the ack runs after it in the same MULTI), so a MULTI the client runs again after a lost reply writes no
# second dead letter; the job's entries index it while the job exists (it goes with the job). Returns -1 fenced, 1
# written, 0 not.
_MOVE_ASIDE = _fence_lua("KEYS[3]", "ARGV[2]") + """
if not redis.call('XPENDING', KEYS[1], '""" + TRAINER_GROUP + """', ARGV[1], ARGV[1], 1)[1] then return 0 end
local moved = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('SADD', KEYS[5], 'g' .. moved) end
return 1
"""

# KEYS: groups stream, group state, admitted counter, consumed ids list, trained counter, trainer epoch, newer stream,
# group records (a groups entry's leaves with it). ARGV: job key prefix, dedup window, this trainer's epoch, then (entry
# id, gid, outcome, job, payload key, slot) sextuples; outcome is the job counter: trained (also counted run-wide),
# stale_dropped, degenerate_dropped, cancelled or malformed (all but trained give back the admission slot the group
# holds). slot is the entry's field s: 1 the group holds a slot, 0 it holds none (never admitted), '' an entry written
# before puts recorded it (taken to hold one, as every group a rollout server wrote was admitted). The caller that read
# the entry passes its job, payload key ('' for a group stored inline) and slot, so the script does not read the entry
# again; an empty job means the caller does not know the entry, and all three are looked up in it, or, the entry deleted
# by hand (an XDEL, a trim), in its record (a restarted trainer acks what its checkpoint covers by ids alone: else the
# payload key stayed and the job never counted it). Only entries still pending count, and the slot goes back in the call
# that deletes the entry, so acking twice changes nothing, and an ack Redis lost (the entry pending again) gives it back
# once when acked again. Where Redis lost what delivered the entry, a group not yet consumed is found all the same: its
# entry undelivered (the read was lost; its entry deleted by hand since, its record), or, its entry gone, parked again
# in the newer stream (the restore that made the entry was lost; its copy there has the f.<name> fields). The payload
# key goes with the entry. An empty gid (a malformed entry without one) marks nothing consumed. Consumed ids beyond the
# window leave groups:state. An entry still pending but no longer in its stream (an operator's XDEL or trim) is acked as
# the others. Returns {how many were acked, how many of them had been deleted from the stream}, or -1 (nothing done)
# when a newer trainer started.
_ACK = _fence_lua("KEYS[6]", "ARGV[3]") + """
local acked, gone, parked = 0, 0, nil
for i = 4, #ARGV, 6 do
  local id, gid, outcome, job = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local payload, slot = ARGV[i + 4], ARGV[i + 5]
  local stream, prefix = KEYS[1], ''
  if redis.call('XACK', KEYS[1], '""" + TRAINER_GROUP + """', id) == 0 then
    stream = nil
    if gid ~= '' and redis.call('HGET', KEYS[2], gid) ~= 't' then
      if redis.call('XRANGE', KEYS[1], id, id)[1] or redis.call('HEXISTS', KEYS[8], id) == 1 then
        stream = KEYS[1]
      else
        if not parked then  -- gid -> its entry in the newer stream, read once
          parked = {}
          for _, e in ipairs(redis.call('XRANGE', KEYS[7], '-', '+')) do
            for j = 1, #e[2], 2 do
              if e[2][j] == 'f.gid' then parked[e[2][j + 1]] = e[1] end
            end
          end
        end
        if parked[gid] then
          stream, prefix, id, job = KEYS[7], 'f.', parked[gid], ''
          parked[gid] = nil
        end
      end
    end
  end
  if stream then
    if job == '' then
      local e = redis.call('XRANGE', stream, id, id)[1]
      if e then
        for j = 1, #e[2], 2 do
          if e[2][j] == prefix .. 'p' then payload = e[2][j + 1] end
          if e[2][j] == prefix .. 'job' then job = e[2][j + 1] end
          if e[2][j] == prefix .. 's' then slot = e[2][j + 1] end
        end
      elseif stream == KEYS[1] then
        local record = redis.call('HGET', KEYS[8], id)
        if record then job, payload, slot = unpack(cjson.decode(record), 2) end
      end
    end
    if payload ~= '' then redis.call('DEL', payload) end
    if redis.call('XDEL', stream, id) == 0 then gone = gone + 1 end
    if stream == KEYS[1] then redis.call('HDEL', KEYS[8], id) end
    if gid ~= '' then
      redis.call('HSET', KEYS[2], gid, 't')
      redis.call('RPUSH', KEYS[4], gid)
    end
    if outcome == 'trained' then
      redis.call('INCR', KEYS[5])
    elseif slot ~= '0' and tonumber(redis.call('GET', KEYS[3]) or '0') > 0 then
      redis.call('DECR', KEYS[3])
    end
    if job ~= '' then redis.call('HINCRBY', ARGV[1] .. job, outcome, 1) end
    acked = acked + 1
  end
end
for _ = 1, redis.call('LLEN', KEYS[4]) - tonumber(ARGV[2]) do
  redis.call('HDEL', KEYS[2], redis.call('LPOP', KEYS[4]))
end
return {acked, gone}
"""

# KEYS: groups stream, newer stream, trainer epoch, group records (the entry's leaves with it). ARGV: entry id, this
# trainer's epoch, then the parked entry's field/value pairs. Moves a group of a schema newer than this trainer reads to
# groups:newer, only while its entry is pending (a call run again after a lost reply parks nothing twice): not consumed,
# not counted for its job, its admission slot and payload key kept (the parked entry owns the key). Returns -1 fenced, 1
# parked, 0 not pending.
_PARK = _fence_lua("KEYS[3]", "ARGV[2]") + """
if redis.call('XACK', KEYS[1], '""" + TRAINER_GROUP + """', ARGV[1]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return 1
"""

# KEYS: newer stream, groups stream, trainer epoch, group records. ARGV: this trainer's epoch, then ids of groups:newer
# entries. Each entry still there goes back into groups with the fields it was written with (its f.<name> ones), and its
# record (as a put writes it), and leaves groups:newer, so a call run again after a lost reply moves nothing twice.
# Returns how many moved, -1 when fenced.
_RESTORE = _fence_lua("KEYS[3]", "ARGV[1]") + """
local moved = 0
for i = 2, #ARGV do
  local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])[1]
  if e then
    local written, f = {}, {}
    for j = 1, #e[2], 2 do
      if string.sub(e[2][j], 1, 2) == 'f.' then
        written[#written + 1] = string.sub(e[2][j], 3)
        written[#written + 1] = e[2][j + 1]
        f[written[#written - 1]] = e[2][j + 1]
      end
    end
    local id = redis.call('XADD', KEYS[2], '*', unpack(written))
    redis.call('HSET', KEYS[4], id, cjson.encode({f.gid or '', f.job or '', f.p or '', f.s or ''}))
    redis.call('XDEL', KEYS[1], ARGV[i])
    moved = moved + 1
  end
end
return moved
"""


class GroupTooLarge(ValueError):
    """A group whose encoded payload is longer than Redis takes in one argument (``ReplayBuffer.payload_limit``):
    nothing was sent or written, and its task is still pending for its worker to fail."""


class BufferClosed(RuntimeError):
    """The buffer was closed while a put was waiting for room."""


class TrainerFenced(RuntimeError):
    """A newer trainer of the run started (``ReplayBuffer.fence``): this one must take and ack nothing more. Starting
    it again cannot help; the newer one owns the run."""


class ReplayBuffer:
    """Producer side (``put``) and trainer side (``take``/``ack``) of the groups stream."""

    max_payload_bytes = MAX_PAYLOAD_BYTES  # the longest encoded group a put sends, whatever the server takes

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        config: BufferConfig,
        consumer: str = "trainer",
        metrics: BufferMetrics | None = None,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.config = config
        self.consumer = consumer
        self.metrics = metrics or BufferMetrics()
        self._put = client.register_script(_PUT)
        self._ack = client.register_script(_ACK)
        self._fence = client.register_script(_FENCE)
        self._move_aside = client.register_script(_MOVE_ASIDE)
        self._park = client.register_script(_PARK)
        self._restore = client.register_script(_RESTORE)
        # an entry deleted while pending (an operator's XDEL or trim) is ended as it is found (``_GROUP_GONE``)
        gone = Gone(_GROUP_GONE, (keys.group_records, keys.admitted, keys.group_state, keys.groups_consumed),
                    (keys.job_prefix, config.dedup_window))
        self._reclaimer = Reclaimer(client, keys.groups, TRAINER_GROUP, consumer, config.claim_idle_ms,
                                    own_every_s=config.claim_idle_ms / 1000, gone=gone)
        # entry id -> (group id, job id, payload key or '' when inline, slot: its field s): taken, not yet acked
        self._held: dict[str, tuple[str, str, str, str]] = {}
        # entry id -> (group id, outcome) acked by this process, the last dedup_window of them: one that comes back
        # pending (Redis lost the ack: appendfsync everysec, a restart) is acked again, not trained again
        self._acked: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._epoch: int | None = None
        # when to move back (again: Redis may lose a restore) the groups an older trainer parked for this one's schema
        self._next_restore = 0.0
        self._left_newer = 0  # groups:newer entries of a schema this trainer does not read either, as last logged
        self._server_max_bulk: int | None = None  # the server's proto-max-bulk-len, read at the first train put
        self._closed = threading.Event()

    def ensure_group(self) -> None:
        """Create the groups stream and the ``trainer`` consumer group (idempotent)."""
        try:
            self.redis.xgroup_create(self.keys.groups, TRAINER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def close(self) -> None:
        """Wake and fail any put waiting for room (shutdown)."""
        self._closed.set()

    def fence(self) -> int:
        """Become the run's trainer: take a trainer epoch above every earlier trainer's (once; the first take or ack
        does it if the trainer did not). A trainer of the run still running (launched twice, or not yet dead when a
        supervisor restarted it) is refused its next take or ack (``TrainerFenced``), and its next checkpoint or
        commit of a push (``check_fence``): it used to go on training and acking groups as trained that the newer
        trainer, which resumed from an earlier checkpoint, never saw. Returns this trainer's epoch."""
        if self._epoch is None:
            self._epoch = int(self.redis.incr(self.keys.trainer_epoch))
            log.info("%s: this trainer is epoch %d; an older trainer of the run takes, acks, checkpoints and pushes "
                     "nothing more", self.keys.trainer_epoch, self._epoch)
        return self._epoch

    def _fenced(self, refused: str) -> TrainerFenced:
        """The error for a write a newer trainer's epoch refused (``refused`` names it), logged and counted."""
        current = self.redis.get(self.keys.trainer_epoch)
        error = TrainerFenced(
            f"{self.keys.trainer_epoch} is {current.decode() if current else None}: a newer trainer of run "
            f"{self.keys.run} started (this one is epoch {self._epoch}); this one takes, acks, checkpoints and pushes "
            "nothing more, and the newer one takes back what it held")
        log.error("%s (refused: %s)", error, refused)
        self.metrics.fenced_refusals.inc()
        return error

    def check_fence(self, refused: str = "a checkpoint or a push's commit") -> None:
        """Raise ``TrainerFenced`` once a newer trainer of the run started (one round trip). Take and ack check it
        themselves; the trainer also checks it before what outlives its next take: a checkpoint, which a newer
        trainer would resume from, and each push's commit, after which the servers serve its weights."""
        if int(self._fence([self.keys.trainer_epoch], [self.fence()])) < 0:
            raise self._fenced(refused)

    def fenced_write(self, write: Callable[[redis.client.Pipeline], object], refused: str) -> None:
        """Run the writes ``write`` queues on a MULTI only while this trainer is the run's newest: the epoch is
        WATCHed from its check to the EXEC, so a newer trainer that starts in between aborts the MULTI, and the check,
        run again, refuses it (``TrainerFenced``; ``refused`` names the write in the log). For writes no script of
        this buffer checks (the trainer's start and end in the run's status, its budget): a fenced trainer made them
        over the newer one's. As the scripts' check, only a newer epoch fences (a Redis that lost it gets ours back)."""
        mine = self.fence()

        def attempt(pipe: redis.client.Pipeline) -> None:
            current = int(pipe.get(self.keys.trainer_epoch) or 0)
            if current > mine:
                raise self._fenced(refused)
            pipe.multi()
            if current < mine:
                pipe.set(self.keys.trainer_epoch, mine)
            write(pipe)

        self.redis.transaction(attempt, self.keys.trainer_epoch)

    def fenced_script(self, lua: str, refused: str) -> Callable[[Sequence[str], Sequence[object]], object]:
        """``lua`` as a script whose writes are made only while this trainer is the run's newest: the check and the
        writes in one call, one round trip where ``fenced_write`` takes three, for what the trainer writes at every
        step (its status, a device turn) or once a push is committed (the version). Called with its own keys and
        args; the trainer epoch and this trainer's epoch are passed after them (its last KEYS and ARGV). Refused as
        ``fenced_write`` is (``TrainerFenced``, logged naming ``refused``, counted); else returns what ``lua``
        returns, which is never -1."""
        script = self.redis.register_script(_fence_lua("KEYS[#KEYS]", "ARGV[#ARGV]") + lua)

        def run(keys: Sequence[str], args: Sequence[object]) -> object:
            result = script([*keys, self.keys.trainer_epoch], [*args, self.fence()])
            if result == -1:
                raise self._fenced(refused)
            return result

        return run

    # producer side

    def payload_limit(self) -> int:
        """The longest encoded group a put sends: ``max_payload_bytes``, or the server's ``proto-max-bulk-len`` where
        lower (an external Redis configured below its 512 MiB default closes the connection on a longer argument, which
        the client retried as an outage, for ever). Read once; a server that refuses CONFIG GET (a managed Redis that
        renames or denies it) is taken to have the default, logged once."""
        if self._server_max_bulk is None:
            try:
                self._server_max_bulk = int(self.redis.config_get("proto-max-bulk-len")["proto-max-bulk-len"])
            except (redis.ResponseError, KeyError, ValueError) as exc:
                self._server_max_bulk = MAX_PAYLOAD_BYTES
                log.warning("%s: CONFIG GET proto-max-bulk-len gave no limit (%s: %s): taking Redis's default, %d "
                            "bytes; a group over the server's own limit makes it close the connection",
                            self.keys.groups, type(exc).__name__, exc, MAX_PAYLOAD_BYTES)
        return min(self.max_payload_bytes, self._server_max_bulk)

    def _queue_put(self, pipe: redis.client.Pipeline, group: TrajectoryGroup, task: TaskEntry | None) -> None:
        """Queue one put on a MULTI pipeline: a train group's payload SET under a fresh key, then the script that
        writes the entry naming it, or deletes it (duplicate, full, task gone). An eval group's entry holds its
        results."""
        train = group.kind == "train"
        if group.kind not in ("train", "eval"):
            raise ValueError(f"group {group.group_id}.kind: {group.kind!r} is not train or eval")
        reward_sum = float(group.rewards.sum())
        if not math.isfinite(reward_sum):
            raise ValueError(f"group {group.group_id}: rewards {group.rewards.tolist()} are not all finite")
        keys = [
            self.keys.groups if train else self.keys.eval(group.job_id),
            self.keys.group_state,
            self.keys.job(group.job_id),
            task.stream if task else self.keys.tasks(group.kind),
            self.keys.admitted_ids,
            self.keys.groups_consumed,
            self.keys.entries(group.job_id),
            self.keys.task_gids(group.kind),
            self.keys.group_records,
        ]
        if train:
            payload = encode_group(group)
            if len(payload) > (limit := self.payload_limit()):
                raise GroupTooLarge(
                    f"group {group.group_id} (job {group.job_id}): encoded payload is {len(payload)} bytes, over the "
                    f"{limit} Redis takes in one argument (proto-max-bulk-len); its samples hold "
                    f"{sum(s.token_ids.size for s in group.samples)} tokens: not written")
            keys.append(self.keys.payload(group.group_id, secrets.token_hex(8)))
            pipe.set(keys[-1], payload)
        args = [
            group.group_id, group.job_id, self.config.max_groups if train else 0,
            task.entry_id if task else "", repr(reward_sum), len(group.samples), self.config.dedup_window,
        ]
        self._put(keys, args, client=pipe)

    def try_put(self, group: TrajectoryGroup, task: TaskEntry | None = None) -> int:
        """One attempt: ``WRITTEN``, ``DUPLICATE`` (its task is acked all the same), ``FULL`` or ``TASK_GONE``
        (the task is pending for no one, so the group is not written; logged with why, as far as the put's call can
        tell, and counted: mostly this worker lost its lease and the task was ended meanwhile, by another worker, by
        the reclaim or sweep of a task deleted by hand, or by a delete of its job). Raises ``GroupTooLarge`` (nothing
        sent) for a group longer than Redis takes."""
        if task is not None and task.group_id != group.group_id:
            raise ValueError(f"group {group.group_id} does not belong to task {task.entry_id} ({task.group_id})")
        pipe = self.redis.pipeline(transaction=True)
        self._queue_put(pipe, group, task)
        result = int(pipe.execute()[-1])
        if result == DUPLICATE:
            self.metrics.duplicates_dropped.inc()
            log.info("group %s was written before: dropped this copy (its task acked)", group.group_id)
        elif result <= TASK_GONE:
            self.metrics.task_gone_dropped.inc()
            log.warning("group %s: its task (entry %s of %s) is pending for no one: %s; dropped, not written",
                        group.group_id, task.entry_id if task else "", task.stream if task else "",
                        _TASK_GONE_WHY[result])
            return TASK_GONE
        return result

    def put(self, group: TrajectoryGroup, task: TaskEntry | None = None, timeout_s: float | None = None) -> bool:
        """Write a group (train: ``groups``; eval: ``eval:<job>``) and ack its task in the same atomic step.

        Waits with backoff while the buffer is full. Returns True when the group is in the buffer (written now
        or before), False when it was not written: ``timeout_s`` passed first (its task not acked), or the task
        was no longer pending (``TASK_GONE``). Raises ``BufferClosed`` if the buffer is closed meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 0.005
        waited = False
        while (result := self.try_put(group, task)) == FULL:
            if not waited:
                self.metrics.backpressure_waits.inc()
                waited = True
            while True:  # poll cheaply, without the payload, until there is room
                if deadline is not None and time.monotonic() + delay > deadline:
                    return False
                if self._closed.wait(delay):
                    raise BufferClosed(f"buffer closed while group {group.group_id} waited for room")
                delay = min(delay * 2, 0.5)
                if self.room() > 0:
                    break
        return result != TASK_GONE

    def room(self) -> int:
        """How many train groups fit now (a cheap check before sending payloads; ``try_put`` is the atomic one)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(self.keys.groups)
        pipe.xpending(self.keys.groups, TRAINER_GROUP)
        length, pending = pipe.execute()
        return self.config.max_groups - (length - pending["pending"])

    def put_many(self, groups: Sequence[TrajectoryGroup]) -> list[int]:
        """Pipelined ``try_put`` of train groups without tasks (bulk loads, benchmarks), as many as there is
        room for; ``FULL`` marks a group not written."""
        if any(g.kind != "train" for g in groups):
            raise ValueError("put_many takes train groups only")
        room = self.room()
        pipe = self.redis.pipeline(transaction=True)
        for group in groups[: max(room, 0)]:
            self._queue_put(pipe, group, None)
        results = [int(x) for x in pipe.execute()[1::2]] if room > 0 else []  # each put is a SET then the script
        return results + [FULL] * (len(groups) - len(results))

    # trainer side

    def take(self, max_groups: int, timeout_s: float) -> list[tuple[str, TrajectoryGroup]]:
        """Up to ``max_groups`` (entry id, group), waiting at most ``timeout_s`` to fill the batch.

        Pending groups of a dead trainer (or of this consumer's previous life, or whose ack Redis lost: this
        consumer's own pending entries are scanned again every ``claim_idle_ms``, skipping those it holds, which it
        acks itself however long its step takes) come first. Groups already
        consumed, or held or acked by this process, are acked away as duplicates; malformed entries are moved aside,
        and groups of a schema newer than this trainer reads are parked in ``groups:newer``. The first take moves back
        the parked groups this trainer reads. Raises ``TrainerFenced`` once a newer trainer of the run started (what
        this one read stays pending for it)."""
        deadline = time.monotonic() + timeout_s
        self.check_fence("a take")
        if time.monotonic() >= self._next_restore:
            self._restore_newer()
        got = self._reclaimer.claim(max_groups, held=self._held, acked=self._acked)
        if got.ended:
            log.warning("%s: %d pending group(s) had been deleted from the stream (an XDEL or trim by hand); acked "
                        "them away and gave their admission slots back; lost for their jobs (payload deleted, never "
                        "trained): %s", self.keys.groups, len(got.ended), named(got.ended))
            self.metrics.deleted_pending.labels(stream="groups").inc(len(got.ended))
        if got.swept:
            log.warning("%s: %d group(s) had been deleted from the stream before any delivery (an XDEL or trim by "
                        "hand); ended them by their records, giving their admission slots back; lost for their jobs "
                        "(payload deleted, never trained): %s", self.keys.groups, len(got.swept), named(got.swept))
            self.metrics.deleted_undelivered.labels(stream="groups").inc(len(got.swept))
        self._ack_again(got.acked, "came back pending (Redis lost their ack), deleted from the stream by hand")
        out = self._accept([(entry_id, fields) for entry_id, _n, fields in got.claimed])
        if out:
            self.metrics.redeliveries.labels(stream="groups").inc(len(out))
        while len(out) < max_groups:
            block = int((deadline - time.monotonic()) * 1000)
            reply = self.redis.xreadgroup(
                TRAINER_GROUP, self.consumer, {self.keys.groups: ">"}, count=max_groups - len(out),
                block=min(block, READ_BLOCK_MS) if block > 0 else None,
            )
            entries = [(i.decode(), f) for _s, batch in reply or [] for i, f in batch]
            out += self._accept(entries)
            if block <= 0:
                break
        self.check_fence("a take")
        return out

    def _ack_again(self, entry_ids: list[str], lost: str = "came back pending (Redis lost their ack)") -> None:
        """Ack again, with the outcome it had, each entry this process acked that is back (``lost`` says how): Redis
        lost the ack (``appendfsync everysec`` and a restart), and the group was trained or dropped already."""
        if not entry_ids:
            return
        self._ack_outcomes([(e, *self._acked[e], "", "", "") for e in entry_ids])  # job '': read from the entry
        self.metrics.duplicates_dropped.inc(len(entry_ids))
        log.warning("%s: %d entries acked before %s: acked again, not delivered: %s", self.keys.groups,
                    len(entry_ids), lost, ", ".join(entry_ids))

    def drained(self) -> bool:
        """No train task left to roll out and no group left to deliver: nothing more can arrive
        (until another job is submitted)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xlen(self.keys.tasks("train"))
        pipe.xlen(self.keys.groups)
        pipe.xpending(self.keys.groups, TRAINER_GROUP)
        tasks, groups, pending = pipe.execute()
        return tasks == 0 and groups - int(pending["pending"]) == 0

    def _payloads(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> list[bytes | None]:
        """Each entry's encoded group: from its payload key (one MGET for all), or inline (field ``g``)."""
        named = [fields[b"p"] for _, fields in entries if b"p" in fields]
        stored = iter(self.redis.mget(named) if named else [])
        return [next(stored) if b"p" in fields else fields.get(b"g") for _, fields in entries]

    def _accept(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> list[tuple[str, TrajectoryGroup]]:
        self._ack_again([entry_id for entry_id, _ in entries if entry_id in self._acked])
        entries = [(entry_id, fields) for entry_id, fields in entries if entry_id not in self._acked]
        # (entry id, group, payload key or '' when inline, slot: the entry's field s)
        decoded: list[tuple[str, TrajectoryGroup, str, str]] = []
        for (entry_id, fields), payload in zip(entries, self._payloads(entries), strict=True):
            try:
                if payload is None:
                    raise SchemaError(f"payload key {fields[b'p'].decode(errors='replace')} is missing"
                                      if b"p" in fields else "missing field p (the payload key) or g (the group)")
                decoded.append((entry_id, decode_group(payload), fields.get(b"p", b"").decode(),
                                fields.get(b"s", b"").decode()))
            except NewerSchema as exc:
                self._park_newer(entry_id, fields, exc)
            except SchemaError as exc:
                self._move_malformed(entry_id, fields, payload, f"group entry {entry_id}: {exc}")
        decoded = self._drop_cancelled(decoded)
        if not decoded:
            return []
        states = self.redis.hmget(self.keys.group_state, [g.group_id for _, g, *_ in decoded])
        held = {gid for gid, *_ in self._held.values()}
        out, duplicates, payloads = [], [], []
        for (entry_id, group, payload_key, slot), state in zip(decoded, states, strict=True):
            if entry_id in self._held:
                continue
            if state == b"t" or group.group_id in held:
                duplicates.append(entry_id)
                if payload_key:
                    payloads.append(payload_key)
                continue
            held.add(group.group_id)
            self._held[entry_id] = (group.group_id, group.job_id, payload_key, slot)
            out.append((entry_id, group))
        if duplicates:
            def drop(pipe: redis.client.Pipeline) -> None:
                pipe.xack(self.keys.groups, TRAINER_GROUP, *duplicates)
                pipe.xdel(self.keys.groups, *duplicates)
                pipe.hdel(self.keys.group_records, *duplicates)
                if payloads:
                    pipe.delete(*payloads)

            # a fenced trainer's view of what is held or trained is stale: these entries are the newer one's to judge
            self.fenced_write(drop, "acking duplicates away")
            self.metrics.duplicates_dropped.inc(len(duplicates))
            log.info("%s: acked away %d duplicate entries (groups already trained on or held): %s",
                     self.keys.groups, len(duplicates), ", ".join(duplicates))
        return out

    def _drop_cancelled(
        self, items: list[tuple[str, TrajectoryGroup, str, str]],
    ) -> list[tuple[str, TrajectoryGroup, str, str]]:
        """Ack away the groups of cancelled jobs (job counter ``cancelled``, admission slot given back, never
        trained); returns the others. Items are (entry id, group, payload key, slot)."""
        jobs = sorted({g.job_id for _, g, *_ in items})
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.hget(self.keys.job(job), "state")
        cancelled = {job for job, state in zip(jobs, pipe.execute(), strict=True) if state == b"cancelled"}
        dropped = [(e, g.group_id, "cancelled", g.job_id, p, s) for e, g, p, s in items if g.job_id in cancelled]
        if dropped:
            acked = self._ack_outcomes(dropped)
            self.metrics.cancelled.labels(stream="groups").inc(acked)
            log.info("dropped %d group(s) of cancelled job(s) %s", acked, ", ".join(sorted(cancelled)))
        return [item for item in items if item[1].job_id not in cancelled]

    def _move_malformed(self, entry_id: str, fields: dict[bytes, bytes], payload: bytes | None, error: str) -> None:
        """Move an entry that does not decode aside, with its fields and its payload (nothing accepted is lost), and
        ack it as ``malformed`` in the same MULTI: its job counts it and its admission slot is given back, since
        it will never train."""
        log.warning("%s: moved to %s: %s", self.keys.groups, self.keys.groups_malformed, error)
        raw = {b"f." + k: v for k, v in fields.items()}
        if payload is not None and b"p" in fields:
            raw[b"payload"] = payload
        letter = {"stream": self.keys.groups, "entry_id": entry_id, "error": error, **raw}
        keys = [self.keys.groups, self.keys.groups_malformed, self.keys.trainer_epoch]
        if job := fields.get(b"job", b"").decode(errors="replace"):
            keys += [self.keys.job(job), self.keys.entries(job)]
        pipe = self.redis.pipeline(transaction=True)
        self._move_aside(keys, [entry_id, self.fence(), *(x for pair in letter.items() for x in pair)], client=pipe)
        item = (entry_id, fields.get(b"gid", b""), "malformed", fields.get(b"job", b""), fields.get(b"p", b""),
                fields.get(b"s", b""))
        self._ack(*self._ack_script_args([item]), client=pipe)
        self._acked_count(pipe.execute()[-1], "moving a group aside")
        self.metrics.malformed.labels(stream="groups").inc()

    def _park_newer(self, entry_id: str, fields: dict[bytes, bytes], error: NewerSchema) -> None:
        """Keep a group of a schema newer than this trainer reads (a rolling upgrade that upgraded the producers
        first) for a trainer that reads it, in ``groups:newer``: it is in flight, not broken, so its job counts nothing
        yet and it keeps its admission slot and its payload key. Out of ``groups``, it is not read again here."""
        parked = {"schema": error.version, "entry_id": entry_id, **{b"f." + k: v for k, v in fields.items()}}
        keys = [self.keys.groups, self.keys.groups_newer, self.keys.trainer_epoch, self.keys.group_records]
        done = int(self._park(keys, [entry_id, self.fence(), *(x for pair in parked.items() for x in pair)]))
        if done < 0:
            raise self._fenced("parking a group of a newer schema")
        if done:
            self.metrics.newer_schema.labels(action="parked").inc()
            log.warning("%s: moved to %s for a trainer that reads it (upgrade the trainer; the group keeps its "
                        "admission slot meanwhile): group entry %s: %s", self.keys.groups, self.keys.groups_newer,
                        entry_id, error)

    def _restore_newer(self) -> None:
        """Move back into ``groups`` the groups an older trainer parked for a schema that this one reads. Done at the
        first take, past this trainer's fence, so an older trainer still running parks none after it, and again every
        ``claim_idle_ms``: Redis may lose a restore (``appendfsync everysec`` and a crash), parking its groups again.
        One this trainer holds from that restore stays parked, and its ack finds it there (the ack script looks for a
        group whose entry is gone in ``groups:newer``); one it acked is acked there again. Restored again, either would
        come back under a new entry id, which the trainer does not know: delivered as a new group, trained twice."""
        self._next_restore = time.monotonic() + self.config.claim_idle_ms / 1000
        parked, left = {}, 0  # groups:newer entry id -> (group id, schema version), of the groups this trainer reads
        for entry_id, fields in self.redis.xrange(self.keys.groups_newer):
            version = fields.get(b"schema", b"")
            if version.isdigit() and not reads_version(int(version)):
                left += 1
                continue
            parked[entry_id] = (fields.get(b"f.gid", b"").decode(), version.decode(errors="replace"))
        if parked:
            gids = {gid for gid, _ in parked.values()}
            held = {gid: e for e, (gid, *_) in self._held.items() if gid in gids}
            acked = {gid: e for e, (gid, _) in self._acked.items() if gid in gids}
            if held:
                log.warning("%s: Redis lost the restore of %d group(s) this trainer holds (entries %s): left there, "
                            "for their acks to find", self.keys.groups_newer, len(held), ", ".join(held.values()))
            self._ack_again(list(acked.values()),
                            f"are in {self.keys.groups_newer} again (Redis lost the restore that moved them out)")
            parked = {e: (gid, v) for e, (gid, v) in parked.items() if gid not in held and gid not in acked}
        moved = int(self._restore([self.keys.groups_newer, self.keys.groups, self.keys.trainer_epoch,
                                   self.keys.group_records],
                                  [self.fence(), *parked])) if parked else 0
        if moved < 0:
            raise self._fenced("moving parked groups back")
        if moved:
            self.metrics.newer_schema.labels(action="restored").inc(moved)
            log.info("%s: moved %d group(s) of schema_version %s back into %s: this trainer reads them",
                     self.keys.groups_newer, moved, ", ".join(sorted({v for _, v in parked.values()})),
                     self.keys.groups)
        if left and left != self._left_newer:
            log.warning("%s: %d group(s) of a schema newer than this trainer reads are left there for a trainer that "
                        "reads it", self.keys.groups_newer, left)
        self._left_newer = left

    def reject(self, entry_id: str, error: str) -> None:
        """Move a group this trainer took aside, as a decode failure is (``groups:malformed``, its job counting it
        ``malformed``, its admission slot given back): one it cannot train on (``error`` says why), which would
        otherwise stay pending and fail the trainer's step again after every restart."""
        [(_, fields)] = self.redis.xrange(self.keys.groups, entry_id, entry_id) or [(None, {})]
        payload = self.redis.get(fields[b"p"]) if b"p" in fields else fields.get(b"g")
        self._move_malformed(entry_id, fields, payload, f"group entry {entry_id}: {error}")
        self._held.pop(entry_id, None)

    def ack(
        self,
        entry_ids: Sequence[str],
        group_ids: Sequence[str],
        stale_group_ids: Sequence[str] = (),
        degenerate_group_ids: Sequence[str] = (),
    ) -> int:
        """Ack consumed groups and mark their ids consumed, atomically. Groups in ``stale_group_ids`` were
        dropped by the staleness filter, those in ``degenerate_group_ids`` by dynamic sampling (all rewards
        equal): their admission is released, so the rollout replaces them, and they count as ``stale_dropped``
        or ``degenerate_dropped``.

        Idempotent: an entry no longer pending changes nothing. Returns how many entries were acked. Raises
        ``TrainerFenced`` (nothing acked) once a newer trainer of the run started."""
        if len(entry_ids) != len(group_ids):
            raise ValueError(f"ack: {len(entry_ids)} entry ids but {len(group_ids)} group ids")
        outcomes = {gid: "stale_dropped" for gid in stale_group_ids}
        outcomes.update((gid, "degenerate_dropped") for gid in degenerate_group_ids)
        items = []
        for entry_id, gid in zip(entry_ids, group_ids, strict=True):
            held = self._held.get(entry_id)
            # job '': the script reads job, payload key and slot from the entry
            job, payload_key, slot = held[1:] if held is not None and held[0] == gid else ("", "", "")
            items.append((entry_id, gid, outcomes.get(gid, "trained"), job, payload_key, slot))
        return self._ack_outcomes(items)

    def _ack_script_args(self, items: Sequence[tuple[str | bytes, ...]]) -> tuple[list[str], list[str | bytes | int]]:
        """KEYS and ARGV of the ack script for (entry id, group id, job counter, job id, payload key, slot) items."""
        args: list[str | bytes | int] = [self.keys.job_prefix, self.config.dedup_window, self.fence()]
        for item in items:
            args += item
        k = self.keys
        keys = [k.groups, k.group_state, k.admitted, k.groups_consumed, k.trained, k.trainer_epoch, k.groups_newer,
                k.group_records]
        return keys, args

    def _ack_outcomes(self, items: Sequence[tuple[str, str, str, str, str, str]]) -> int:
        """Ack (entry id, group id, job counter, job id, payload key, slot) items in one Lua call (job '': the script
        reads job, payload key and slot from the entry); forget them as held, remember them as acked."""
        acked = self._acked_count(self._ack(*self._ack_script_args(items)), "an ack")
        for entry_id, gid, outcome, *_ in items:
            self._held.pop(entry_id, None)
            self._acked[entry_id] = (gid, outcome)
        while len(self._acked) > self.config.dedup_window:
            self._acked.popitem(last=False)
        return acked

    def _acked_count(self, reply: int | list[int], refused: str) -> int:
        """How many entries the ack script's ``reply`` says it acked; raises ``TrainerFenced`` (``refused`` names the
        write) when it was refused. Entries it found pending but deleted from the stream (an XDEL or trim by hand
        while the trainer held them) are logged and counted: acked all the same, their slots given back or trained."""
        if isinstance(reply, int):  # -1: the fence's
            raise self._fenced(refused)
        acked, gone = (int(n) for n in reply)
        if gone:
            log.warning("%s: %d group(s) acked had been deleted from the stream while pending (an XDEL or trim by "
                        "hand)", self.keys.groups, gone)
            self.metrics.deleted_pending.labels(stream="groups").inc(gone)
        return acked
