"""The task queue: a job's tasks in Redis streams, read by rollout servers with consumer group ``rollout``.

Delivery is at least once. A server acks a task only in the same atomic step that writes its group
(``ReplayBuffer.put(group, task=entry)``); a server that dies leaves its tasks pending, and live servers
claim entries idle longer than ``claim_idle_ms`` (live servers renew the lease of what they hold).
A task delivered more than ``max_attempts`` times, or failed that often, goes to the dead-letter stream
with its error; an entry that cannot be parsed goes to the malformed stream. Neither ever stops a consumer.

Each task gets a run-unique group id ``<job>:<seq>:<task_id>`` at submit time, so the same task submitted
twice (two jobs, two epochs) makes two groups. A submit may carry an idempotency key (the API's ``Idempotency-Key``):
the first submit under a key claims it for its job, in the same Lua call that adds the tasks, and a later one under
it adds nothing (``IdempotencyKeyUsed``) for ``IDEMPOTENCY_TTL_S``.

Each job keeps an index of its entries in the run-wide streams (``Keys.entries``), written in the calls that add and
remove them, so deleting a cancelled job finds its tasks without reading the whole task stream.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from buffer.keys import ROLLOUT_GROUP, TASK_KINDS, TRAINER_FINISHED_FIELDS, TRAINER_GROUP, Keys
from buffer.metrics import TASK_STREAMS, BufferMetrics
from buffer.streams import KEPT_LUA, RENEW_LUA, Gone, Reclaimer, named
from core.config import BufferConfig

log = logging.getLogger(__name__)

SUBMIT_CHUNK = 1000
# a cancelled job's tasks one Lua call of a delete removes at most (``_CANCEL_QUEUED``): about 10 ms of Redis's one
# thread (six to ten commands a task), where a job of api.max_job_tasks in one call held it for 13-16 s (Redis 6.2)
CANCEL_BATCH = 1000
# how long an idempotency key names its job: a client's retries come within minutes; Stripe keeps its keys a day
IDEMPOTENCY_TTL_S = 24 * 3600

# KEYS: task stream, job hash, jobs index, the job's entries (``Keys.entries``: each task added goes in), the stream's
# task records (``Keys.task_gids``: each task added names its group there), then the idempotency key's key when the
# submit has one. ARGV: job, kind, spec ('' but in the first chunk), now, submit id,
# chunk index, the spec's fingerprint ('' without a key), the key's TTL in seconds, the spec's summary
# (``summarize_spec``: stored with the spec, so never one without the other), the job hashes' key prefix, (task id,
# task)... Returns the job seq of the submit's first task, or {job, same spec (1 or 0)} when the idempotency key names
# another job (nothing added: every chunk of the MULTI finds it so). The first chunk under a key claims it for this
# job (``<job>:<fingerprint>``, expiring after the TTL) and keeps the key's fingerprint (the last part of its key) in
# the job's ``idempotency`` field, so deleting the job frees the key; a claim naming a job that no longer exists
# (deleted) is void, and taken over. Being checked and claimed in the call that adds the tasks, two submits under one
# key cannot both add theirs. Each chunk marks the job's ``submit`` field ``<submit id>:<chunk>:<first seq>``: a MULTI
# that runs again (the client retrying after a lost reply) finds its own chunks marked and adds nothing.
_SUBMIT = """
local n, chunk = (#ARGV - 10) / 2, tonumber(ARGV[6])
if KEYS[6] then
  local claim = redis.call('GET', KEYS[6])
  local job, fingerprint
  if claim then job, fingerprint = string.match(claim, '^([^:]*):(.*)$') end
  if not claim or (job ~= ARGV[1] and redis.call('EXISTS', ARGV[10] .. (job or '')) == 0) then
    redis.call('SET', KEYS[6], ARGV[1] .. ':' .. ARGV[7], 'EX', ARGV[8])
    redis.call('HSET', KEYS[2], 'idempotency', string.match(KEYS[6], '[^:]*$'))
  elseif job ~= ARGV[1] then
    return {job, fingerprint == ARGV[7] and 1 or 0}
  end
end
local mark = redis.call('HGET', KEYS[2], 'submit')
local id, done, first
if mark then id, done, first = string.match(mark, '^(.*):(%d+):(%d+)$') end
if id == ARGV[5] and tonumber(done) >= chunk then return tonumber(first) end
local kind = redis.call('HGET', KEYS[2], 'kind')
if kind and kind ~= ARGV[2] then
  return redis.error_reply('job ' .. ARGV[1] .. ' is a ' .. kind .. ' job, cannot add ' .. ARGV[2] .. ' tasks')
end
local base = redis.call('HINCRBY', KEYS[2], 'submitted', n) - n
if chunk == 0 then first = base end
redis.call('HSET', KEYS[2], 'submit', ARGV[5] .. ':' .. chunk .. ':' .. first)
redis.call('HSETNX', KEYS[2], 'kind', ARGV[2])
redis.call('HSETNX', KEYS[2], 'created', ARGV[4])
if ARGV[3] ~= '' and redis.call('HSETNX', KEYS[2], 'spec', ARGV[3]) == 1 then
  redis.call('HSET', KEYS[2], 'spec_summary', ARGV[9])
end
if redis.call('HGET', KEYS[2], 'state') ~= 'cancelled' then redis.call('HSET', KEYS[2], 'state', 'running') end
redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[4])
local added, gids = {}, {}
for i = 0, n - 1 do
  local gid = ARGV[1] .. ':' .. (base + i) .. ':' .. ARGV[11 + 2 * i]
  local id = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'kind', ARGV[2], 'gid', gid, 'task', ARGV[12 + 2 * i])
  added[i + 1] = 't' .. id
  gids[2 * i + 1], gids[2 * i + 2] = id, gid
end
redis.call('SADD', KEYS[4], unpack(added))
redis.call('HSET', KEYS[5], unpack(gids))
return first
"""

# Ack one delivery, only if it is still pending for the consumer that ends it (ARGV: group, entry id, consumer).
# XACK alone acks whoever holds the entry: a worker that lost its lease (frozen past it) would end the task that
# another worker took over and is rolling out, whose group would then be dropped (its task gone).
_ACK_OWN = """
local held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)[1]
if not held or held[2] ~= ARGV[3] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
"""

# Dead-letter one delivery (KEYS: task stream, dead letters, job hash, admitted, admitted ids, the job's entries, the
# stream's task records; ARGV:
# ..., gid, job, kind, task, deliveries, error). The dead letter takes the task's place in the job's entries (one the
# job's entries did not hold, written by an older API, stays out of them: so nothing adds to the entries of a deleted
# job).
_DEAD_LETTER = _ACK_OWN + """
local dead = redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[5], 'kind', ARGV[6], 'gid', ARGV[4], 'task', ARGV[7],
  'deliveries', ARGV[8], 'error', ARGV[9], 'entry_id', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[7], ARGV[2])
if redis.call('SREM', KEYS[6], 't' .. ARGV[2]) == 1 then redis.call('SADD', KEYS[6], 'd' .. dead) end
redis.call('HINCRBY', KEYS[3], 'dead_lettered', 1)
if redis.call('HDEL', KEYS[5], ARGV[4]) == 1 then redis.call('DECR', KEYS[4]) end
return 1
"""

# Move an entry that cannot be parsed (KEYS: task stream, malformed stream, the stream's task records, then its job's
# hash when its job id could be read; ARGV: group, entry id, consumer, then the malformed entry's fields and values)
# aside, once: its job, if it still exists, counts it ``dead_lettered`` (a task that will never be rolled out, so the
# job can end), as no other counter ends a task that has no group.
_MALFORMED = _ACK_OWN + """
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('HINCRBY', KEYS[4], 'dead_lettered', 1) end
return 1
"""

# End a cancelled job's task, acked or never delivered (its stream, entry id and group id; the keys of its job hash, its
# job's entries, admitted, admitted ids, the stream's task records): deleted, out of the job's entries and the records,
# counted ``cancelled``, its admission slot given back. A rollout server's ``_CANCEL`` and a delete's ``remove_task``
# (``_TASK_REMOVAL``) both end one so.
_END_CANCELLED = """
local function end_cancelled(stream, id, gid, job, entries, admitted, admitted_ids, gids)
  redis.call('XDEL', stream, id)
  redis.call('HDEL', gids, id)
  redis.call('SREM', entries, 't' .. id)
  redis.call('HINCRBY', job, 'cancelled', 1)
  if gid and redis.call('HDEL', admitted_ids, gid) == 1 then redis.call('DECR', admitted) end
end
"""

# Ack one delivery of a cancelled job's task (KEYS: task stream, job hash, admitted, admitted ids, the job's entries,
# the stream's task records; ARGV: ..., gid) and end it (``_END_CANCELLED``).
_CANCEL = _ACK_OWN + _END_CANCELLED + """
end_cancelled(KEYS[1], ARGV[2], ARGV[4], KEYS[2], KEYS[5], KEYS[3], KEYS[4], KEYS[6])
return 1
"""

# gone(id) of a task stream (``buffer.streams.Gone``; KEYS after the stream: its task records, admitted, admitted ids;
# ARGV from 7: the job hashes' key prefix, the job entries' key prefix). A task deleted by hand (an XDEL, a trim),
# pending or never delivered, will never be rolled out: its record names its group, whose admission slot and admitted
# id go back, and whose job counts it ``dead_lettered`` (as a malformed task: no other counter ends a task that has no
# group; a job is ``<job>:<seq>:<task id>``'s first part) and no longer lists it in its entries. A task written before
# records has none: acked away only.
_TASK_GONE = """
local function gone(id)
  local gid = redis.call('HGET', KEYS[2], id)
  if not gid then return false end
  redis.call('HDEL', KEYS[2], id)
  if redis.call('HDEL', KEYS[4], gid) == 1 and tonumber(redis.call('GET', KEYS[3]) or '0') > 0 then
    redis.call('DECR', KEYS[3])
  end
  local job = string.match(gid, '^[^:]*')
  if redis.call('EXISTS', ARGV[7] .. job) == 1 then redis.call('HINCRBY', ARGV[7] .. job, 'dead_lettered', 1) end
  redis.call('SREM', ARGV[8] .. job, 't' .. id)
  return gid
end
"""

# the job counters of a train job's tasks that will never be trained (or were): ``submitted`` less their sum
# is what is still to train
TRAIN_ENDS = ("trained", "stale_dropped", "degenerate_dropped", "dead_lettered", "cancelled", "malformed", "lost")
# the job hash's counters, in the order the API shows them
JOB_COUNTERS = ("submitted", "completed", "dead_lettered", "trained", "stale_dropped", "degenerate_dropped",
                "cancelled", "malformed", "lost", "samples")
# the job hash's fields a listing reads (``TaskQueue.job_summaries``): all but ``spec``, which may hold thousands of
# inline tasks, and ``submit``
_LISTED = ("kind", "state", "created", *JOB_COUNTERS, "reward_sum", "spec_summary")

# Cancel a job (KEYS: job hash; ARGV: TRAIN_ENDS) that has something left to end, in one step: an eval job with a task
# not yet rolled out (its groups are finished once written), a train job with a group not yet trained or dropped
# (its task not rolled out yet, or its group still in the buffer: the trainer acks those away unread), so a job whose
# last task or group finishes between a read and a write stays done. Returns the job's state after: ``cancelled``,
# ``done``, or false for an unknown job.
_CANCEL_JOB = """
local h = redis.call('HMGET', KEYS[1], 'state', 'submitted', 'kind')
if not h[1] then return false end
if h[1] == 'cancelled' then return 'cancelled' end
local ends = h[3] == 'train' and ARGV or {'completed', 'dead_lettered'}
local left = tonumber(h[2]) or 0
for _, n in ipairs(redis.call('HMGET', KEYS[1], unpack(ends))) do left = left - (tonumber(n) or 0) end
if left <= 0 then return 'done' end
redis.call('HSET', KEYS[1], 'state', 'cancelled')
return 'cancelled'
"""

# Lua shared by the scripts that walk a job's entries and delete it (``_CANCEL_QUEUED``, ``_DELETE_JOB``,
# ``_DROP_ASIDE``), whose KEYS they read: KEYS as ``_DELETE_JOB``'s. ``set_aside``: move a member of the job's entries
# that names a dead letter (``d<id>``, in ``tasks:dead``) or a malformed group (``g<id>``, in ``groups:malformed``) into
# the job's set aside (``Keys.entries_aside``), the rest of the index of its entries: true for such a member. Only
# moved, never deleted, so a delete that is then refused loses nothing, and the entries the delete's own call reads
# whole are few (``_DELETE_JOB``).
_ASIDE = """
local aside = {d = KEYS[8], g = KEYS[10]}
local function set_aside(m)
  if not aside[string.sub(m, 1, 1)] then return false end
  redis.call('SMOVE', KEYS[5], KEYS[17], m)
  return true
end
"""

# Lua shared by the scripts that remove a cancelled job's tasks (``_CANCEL_QUEUED``, then ``_DELETE_JOB``), whose KEYS
# they read: KEYS as ``_DELETE_JOB``'s. ``task_at``: the job's task at ``id`` in ``stream``, nil once it is neither
# there nor pending (one deleted by hand while pending is its pending delivery, its group id read from its record,
# ``records_of``: ended here, as the reclaim that finds it would, not left there with its record dropped, its slot held
# for good and its job never deleted), else {id, its group id, its pending delivery (nil when queued), whether a live
# consumer holds it (pending, and renewed within ``idle`` ms, buffer.claim_idle_ms: a live server renews what it holds,
# and any other would take one idle longer over; or, deleted by hand, held under its lease key, ``lease`` .. id, which
# the renewal sets instead, ``Keys.task_leases``, as the reclaim reads it)}. ``remove_task``: end such a task that no
# live consumer holds as a rollout server's ``_CANCEL`` ends it (acked if pending, then ``_END_CANCELLED``); a train
# task that was pending also has its group id consumed in ``groups:state``, so the server that held it, frozen rather
# than dead, finds it so when it wakes: a server of this version is refused admission for a task it no longer holds
# (``LeaseLost``), and an older one's ``try_admit`` (or one without the task) admits it at no cost, taking no slot that
# nothing gives back; its put is a duplicate either way. Only those: consuming every removed task's id would push the
# ids of groups still to come out of the dedup window (an eval task takes no slot, and its late put writes nothing
# either way). ``trim_consumed``: keep the last ``window`` consumed ids.
_TASK_REMOVAL = KEPT_LUA + _END_CANCELLED + """
local function field(fields, name)
  for j = 1, #fields, 2 do
    if fields[j] == name then return fields[j + 1] end
  end
end
local function holder(stream, group, id)  -- {id, consumer, idle ms, deliveries} of a pending entry, else nil
  local held = redis.pcall('XPENDING', stream, group, id, id, 1)
  if held.err then return nil end  -- no such consumer group: nothing was delivered from the stream
  return held[1]
end
local function records_of(stream) return stream == KEYS[6] and KEYS[20] or KEYS[21] end
local function task_at(stream, id, idle, lease)
  local e = redis.call('XRANGE', stream, id, id)[1]
  local held = holder(stream, '""" + ROLLOUT_GROUP + """', id)
  if not (e or held) then return nil end
  local gid = e and field(e[2], 'gid') or redis.call('HGET', records_of(stream), id)
  return {id, gid, held, held ~= nil and (held[3] < idle or kept(id, lease))}
end
local function remove_task(stream, t)
  local id, gid, held = t[1], t[2], t[3]
  if held then redis.call('XACK', stream, '""" + ROLLOUT_GROUP + """', id) end
  end_cancelled(stream, id, gid, KEYS[1], KEYS[5], KEYS[14], KEYS[15], records_of(stream))
  if held and gid and stream == KEYS[6] then
    redis.call('HSET', KEYS[12], gid, 't')
    redis.call('RPUSH', KEYS[13], gid)
  end
end
local function trim_consumed(window)
  for _ = 1, redis.call('LLEN', KEYS[13]) - window do
    redis.call('HDEL', KEYS[12], redis.call('LPOP', KEYS[13]))
  end
end
"""

# Walk one batch of a job's entries before its delete (KEYS as ``_DELETE_JOB``'s; ARGV: buffer.claim_idle_ms, the dedup
# window, the train and eval task leases' key prefixes, then up to ``CANCEL_BATCH`` members of its entries). A dead
# letter or malformed group is set aside (``set_aside``), whatever the job's state. A task member ``t<id>`` of a
# cancelled job that no live consumer holds is removed as ``_TASK_REMOVAL``'s ``remove_task`` ends it, and one whose
# entry is no longer in its stream leaves the entries; a task of a job not cancelled is left alone (checked in each
# call). Returns how many tasks it removed, or -1 for a job no longer there (deleted meanwhile: the walk stops).
_CANCEL_QUEUED = _TASK_REMOVAL + _ASIDE + """
local h = redis.call('HMGET', KEYS[1], 'kind', 'state')
if not h[1] then return -1 end
local stream, task_lease = KEYS[6], ARGV[3]
if h[1] ~= 'train' then stream, task_lease = KEYS[7], ARGV[4] end
local removed = 0
for i = 5, #ARGV do
  if not set_aside(ARGV[i]) and h[2] == 'cancelled' then
    local t = task_at(stream, string.sub(ARGV[i], 2), tonumber(ARGV[1]), task_lease)
    if not t then
      redis.call('SREM', KEYS[5], ARGV[i])
      redis.call('HDEL', records_of(stream), string.sub(ARGV[i], 2))
    elseif not t[4] then
      remove_task(stream, t)
      removed = removed + 1
    end
  end
end
trim_consumed(tonumber(ARGV[2]))
return removed
"""

# Delete a job, in one step (KEYS: job hash, jobs index, trajectories stream, eval results stream, the job's entries,
# train and eval task streams, dead letters, groups, malformed groups, newer groups, group state, consumed ids list,
# admitted, admitted ids, trainer hash, the job's set aside (``Keys.entries_aside``), the trainer's lease
# (``Keys.trainer_alive``), the deleted jobs whose set aside is left to remove (``Keys.deleted_aside``); ARGV: job id,
# the idempotency keys' prefix, buffer.claim_idle_ms, the dedup window, the train and eval task leases' key prefixes,
# TRAIN_ENDS). A finished one (every task ended:
# an eval job's completed, dead-lettered or cancelled; a train job's every group ended too, TRAIN_ENDS) goes at once. A
# cancelled one goes with what is left of it: its tasks in the task stream (found through the job's entries, never by
# reading the stream whole; ``delete_job`` removed those no one held in batches of ``_CANCEL_QUEUED`` before, so few are
# left but what a live consumer holds) and its groups in ``groups`` and ``groups:newer`` (read whole: buffer.max_groups
# bounds what is undelivered, admission what is parked; and those deleted by hand while pending, each found in the
# trainer's pending list and named by its record, ``Keys.group_records``), each ended as an ack would end it (a task as
# ``_TASK_REMOVAL``'s ``remove_task`` ends it; a group's payload key deleted and its id consumed, admission slots given
# back, pending deliveries acked). A task pending for a consumer that has not renewed it for claim_idle_ms is no one's
# (a live server renews what it holds; any other would take it over; one deleted by hand is held while the lease key
# its server's renewal sets instead is there, ``task_at``), nor is a group pending for a trainer that stopped
# (its end in the trainer hash, as ``ClusterView.trainer_end`` reads it) or whose lease (``Keys.trainer_alive``) is
# gone: it lapsed (the trainer was killed without recording its end; or it was frozen, or cut off from Redis, past the
# lease's TTL, and its ack of a group this call removed then finds the group's id consumed and acks and counts nothing),
# or the trainer is one from before the lease, which keeps none (the same for its acks). While a live consumer holds a
# task or group of it, or something its counters say is left is in none of these places (an older API's tasks, which it
# did not index), nothing is done. So once it is deleted no entry of it is pending or queued anywhere, and every script
# that writes to a job's keys does so only for an entry still pending (put, dead letter, cancel, requeue) or still in
# its stream (the trainer's ack): no late write brings any of them back. Its submit's idempotency claim goes too while
# the claim still names it. Its dead letters and malformed groups do not go in this call: ``delete_job``'s walk set them
# aside before (``set_aside``), so the entries this call reads whole are few (the tasks live consumers hold, and what
# was dead-lettered, moved aside or requeued since the walk); it sets aside those few, and the set aside, which outlives
# the job hash, is listed in ``Keys.deleted_aside`` and removed in batches after it (``_DROP_ASIDE``): a job's 100,000
# dead letters XDEL'd in this call held Redis 6.2 for a third of a second, every other client waiting (about 5 ms the
# longest call in batches, ``bench/job_delete.py --dead-letters``). Returns {kind, 0, tasks removed, groups removed}
# once deleted; {kind, left} for a job neither finished nor cancelled; {kind, left, tasks held by live consumers, groups
# held by a running trainer, left in no place found, the lease of that trainer ('' when none holds any), the holding
# consumers...} for a cancelled one refused; false for an unknown job.
_DELETE_JOB = _TASK_REMOVAL + _ASIDE + """
local h = redis.call('HMGET', KEYS[1], 'kind', 'submitted', 'idempotency', 'state')
if not h[1] then return false end
local train = h[1] == 'train'
local ends = train and {unpack(ARGV, 7)} or {'completed', 'dead_lettered', 'cancelled'}
local left = tonumber(h[2]) or 0
for _, n in ipairs(redis.call('HMGET', KEYS[1], unpack(ends))) do left = left - (tonumber(n) or 0) end
if left > 0 and h[4] ~= 'cancelled' then return {h[1], left} end
local entries = redis.call('SMEMBERS', KEYS[5])
local stream, task_lease = KEYS[6], ARGV[5]
if not train then stream, task_lease = KEYS[7], ARGV[6] end
local tasks, groups, rolling, holders, training, lease = {}, {}, 0, {}, 0, false
if left > 0 then
  for _, m in ipairs(entries) do
    local t = string.sub(m, 1, 1) == 't' and task_at(stream, string.sub(m, 2), tonumber(ARGV[3]), task_lease)
    if t and t[4] then
      rolling = rolling + 1
      holders[t[3][2]] = true
    elseif t then
      tasks[#tasks + 1] = t
    end
  end
  if train then
    local finished = redis.call('HMGET', KEYS[16], '""" + "', '".join(TRAINER_FINISHED_FIELDS[:2]) + """')
    lease = redis.call('GET', KEYS[18])
    local running = lease and not (finished[1] and finished[2])
    local function found(id, fields, held)
      if held and running then
        training = training + 1
      else
        groups[#groups + 1] = {KEYS[9], id, fields, '', held}
      end
    end
    local listed = {}
    for _, e in ipairs(redis.call('XRANGE', KEYS[9], '-', '+')) do
      listed[e[1]] = true
      if field(e[2], 'job') == ARGV[1] then found(e[1], e[2], holder(KEYS[9], '""" + TRAINER_GROUP + """', e[1])) end
    end
    local pel = redis.pcall('XPENDING', KEYS[9], '""" + TRAINER_GROUP + """')
    if not pel.err and pel[1] > 0 then
      for _, p in ipairs(redis.call('XPENDING', KEYS[9], '""" + TRAINER_GROUP + """', '-', '+', pel[1])) do
        local record = not listed[p[1]] and redis.call('HGET', KEYS[22], p[1])
        if record then
          local gid, job, payload, slot = unpack(cjson.decode(record))
          local fields = {}
          for name, value in pairs({gid = gid, p = payload, s = slot}) do
            if value ~= '' then
              fields[#fields + 1] = name
              fields[#fields + 1] = value
            end
          end
          if job == ARGV[1] then found(p[1], fields, p) end
        end
      end
    end
    for _, e in ipairs(redis.call('XRANGE', KEYS[11], '-', '+')) do
      if field(e[2], 'f.job') == ARGV[1] then groups[#groups + 1] = {KEYS[11], e[1], e[2], 'f.'} end
    end
  end
  local unfound = left - rolling - training - #tasks - #groups
  if rolling + training > 0 or unfound > 0 then
    local refused = {h[1], left, rolling, training, math.max(unfound, 0), training > 0 and lease or ''}
    for consumer in pairs(holders) do refused[#refused + 1] = consumer end
    return refused
  end
end
for _, t in ipairs(tasks) do remove_task(stream, t) end
for _, g in ipairs(groups) do
  local key, id, fields, prefix = g[1], g[2], g[3], g[4]
  if g[5] then redis.call('XACK', key, '""" + TRAINER_GROUP + """', id) end
  local payload, gid = field(fields, prefix .. 'p'), field(fields, prefix .. 'gid')
  if payload then redis.call('DEL', payload) end
  redis.call('XDEL', key, id)
  if key == KEYS[9] then redis.call('HDEL', KEYS[22], id) end
  if gid then
    redis.call('HSET', KEYS[12], gid, 't')
    redis.call('RPUSH', KEYS[13], gid)
  end
  if field(fields, prefix .. 's') ~= '0' and tonumber(redis.call('GET', KEYS[14]) or '0') > 0 then
    redis.call('DECR', KEYS[14])
  end
end
trim_consumed(tonumber(ARGV[4]))
for _, m in ipairs(entries) do set_aside(m) end
if redis.call('EXISTS', KEYS[17]) == 1 then redis.call('SADD', KEYS[19], ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4], KEYS[5])
redis.call('HDEL', KEYS[2], ARGV[1])
if h[3] then
  local claim = redis.call('GET', ARGV[2] .. h[3])
  if claim and string.sub(claim, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then redis.call('DEL', ARGV[2] .. h[3]) end
end
return {h[1], 0, #tasks, #groups}
"""

# Remove one batch of a deleted job's dead letters and malformed groups (KEYS as ``_DELETE_JOB``'s; ARGV: up to
# ``CANCEL_BATCH`` members of its set aside): each out of its stream and out of the set. Only once the job is gone
# (checked in each call): a job's set aside holds its dead letters while it exists, also after a refused delete, and a
# job submitted again under a deleted one's id (the API never reuses one) keeps what it holds until it is deleted
# too. Returns how many it removed, or -1 for a job that exists.
_DROP_ASIDE = _ASIDE + """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
for i = 1, #ARGV do
  redis.call('XDEL', aside[string.sub(ARGV[i], 1, 1)], string.sub(ARGV[i], 2))
  redis.call('SREM', KEYS[17], ARGV[i])
end
return #ARGV
"""

# Keep a job's spec summary (KEYS: job hash; ARGV: the summary) only while the job has its spec: a job deleted since
# its spec was read gets no hash back.
_KEEP_SUMMARY = """
if redis.call('HEXISTS', KEYS[1], 'spec') == 1 then return redis.call('HSETNX', KEYS[1], 'spec_summary', ARGV[1]) end
return 0
"""

# Put a pending task back at the tail as a new entry carrying its attempt count (KEYS: task stream, the job's entries
# and the stream's task records, where the new entry takes the old one's place; ARGV: ..., gid, job, kind, task,
# attempts, error). Admission is kept (a hand-back), or released when KEYS[4] and KEYS[5] (admitted, admitted ids) are
# given (a failed attempt: its retry
# waits at the tail behind the backlog, so its slot goes to the next task; with max_staleness 0 a kept slot would leave
# no room for any task, the retry included, and the run would stall).
_REQUEUE = _ACK_OWN + """
local again = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[5], 'kind', ARGV[6], 'gid', ARGV[4], 'task', ARGV[7],
  'attempts', ARGV[8], 'error', ARGV[9])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[3], again, ARGV[4])
if redis.call('SREM', KEYS[2], 't' .. ARGV[2]) == 1 then redis.call('SADD', KEYS[2], 't' .. again) end
if #KEYS == 5 and redis.call('HDEL', KEYS[5], ARGV[4]) == 1 then redis.call('DECR', KEYS[4]) end
return 1
"""


@dataclass(frozen=True)
class Deletion:
    """What ``TaskQueue.delete_job`` did with a job: deleted it (``left`` 0), or refused, saying what holds it."""

    kind: str
    left: int  # its tasks (eval) or groups (train) its counters say are not ended; 0: deleted
    removed_tasks: int = 0  # a cancelled job's tasks no one held, removed (before a refusal too, as a server would)
    removed_groups: int = 0  # deleted: a cancelled train job's groups still in the buffer, removed with it
    rolling_out: int = 0  # refused: its tasks held by live rollout servers (``servers``)
    training: int = 0  # refused: its groups held by a trainer that has not stopped and whose lease holds
    unfound: int = 0  # refused: what its counters say is left but the delete finds nowhere (an older API's tasks)
    servers: tuple[str, ...] = ()
    trainer: str = ""  # refused for ``training``: that trainer's lease (``Keys.trainer_alive``: pid, host, epoch)


class IdempotencyKeyUsed(Exception):
    """A submit's idempotency key already names a job, submitted under it before (within ``IDEMPOTENCY_TTL_S``):
    nothing was added. ``same_spec``: that job has the same spec, so this is a retry of its submit (answer with that
    job); otherwise the key was reused for another job."""

    def __init__(self, job_id: str, same_spec: bool) -> None:
        how = "the same spec" if same_spec else "another spec"
        super().__init__(f"the idempotency key was used for job {job_id}, with {how}")
        self.job_id = job_id
        self.same_spec = same_spec


@dataclass
class TaskEntry:
    """One delivered task: what a rollout server needs to make and write its group."""

    stream: str
    entry_id: str
    job_id: str
    kind: str
    group_id: str
    task: dict[str, Any]
    deliveries: int
    consumer: str  # the one it was delivered to: only it may end the task (fail, dead-letter, cancel, hand back)
    last_error: str = ""


class TaskQueue:
    """Submit, read, reclaim, fail and dead-letter tasks; one object per process, shared by its consumers."""

    def __init__(
        self, client: redis.Redis, keys: Keys, config: BufferConfig, metrics: BufferMetrics | None = None
    ) -> None:
        self.redis = client
        self.keys = keys
        self.config = config
        self.metrics = metrics or BufferMetrics()
        self._submit = client.register_script(_SUBMIT)
        self._dead_letter = client.register_script(_DEAD_LETTER)
        self._malformed = client.register_script(_MALFORMED)
        self._cancel = client.register_script(_CANCEL)
        self._cancel_job = client.register_script(_CANCEL_JOB)
        self._cancel_queued = client.register_script(_CANCEL_QUEUED)
        self._delete_job = client.register_script(_DELETE_JOB)
        self._drop_aside = client.register_script(_DROP_ASIDE)
        self._keep_summary = client.register_script(_KEEP_SUMMARY)
        self._requeue = client.register_script(_REQUEUE)
        self._renew = client.register_script(RENEW_LUA)
        self._reclaimers: dict[tuple[str, str], Reclaimer] = {}

    def ensure_groups(self) -> None:
        """Create the streams and the ``rollout`` consumer group (idempotent; reads from the start)."""
        for kind in TASK_KINDS:
            try:
                self.redis.xgroup_create(self.keys.tasks(kind), ROLLOUT_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def submit(
        self, job_id: str, tasks: Sequence[Mapping[str, Any]], kind: str = "train", spec: str | None = None,
        idempotency_key: str | None = None,
    ) -> list[str]:
        """Enqueue tasks (dicts of the ``Task`` model) of a job; returns their group ids.

        All or nothing: the chunks (a Lua call per ``SUBMIT_CHUNK`` tasks, so no one command carries a whole job)
        go in one MULTI/EXEC, which Redis runs whole, with nothing else in between (about 10 ms per chunk), or
        not at all. A write refused for memory fails every chunk at its first write (Redis decides that once, as
        EXEC starts; a chunk refused as it is queued aborts the EXEC), so a failed submit writes nothing.
        ``spec`` (the job's rollout parameters as JSON) is stored on the first submit of the job, with its summary
        (``summarize_spec``) in the same call, which a listing reads instead (``job_summaries``). The client
        retries a MULTI whose reply was lost (Redis restarting, a connection reset), and Redis may have run it:
        the submit's id in the job hash makes that rerun add nothing (the last submit of a job is remembered).
        With ``idempotency_key`` (``spec`` then required: a retry is told apart from a reuse by it) the first chunk
        claims the key for this job, checked in the same call, or finds it naming another job: then nothing is
        added and ``IdempotencyKeyUsed`` says which job, and whether its spec was the same.
        """
        stream = self.keys.tasks(kind)
        if not job_id or ":" in job_id:
            raise ValueError(f"job_id {job_id!r}: must be non-empty and contain no ':'")
        if idempotency_key is not None and spec is None:
            raise ValueError("idempotency_key: a submit under one needs its spec, which a retry must repeat")
        args: list[str] = []
        for i, task in enumerate(tasks):
            task_id = task.get("task_id")
            if not isinstance(task_id, str) or not task_id:
                raise ValueError(f"tasks[{i}].task_id: expected a non-empty string, got {task_id!r}")
            args += [task_id, json.dumps(task, separators=(",", ":"))]
        if not args:
            return []
        summary = "" if spec is None else summarize_spec(spec)
        now, submit_id = f"{time.time():.3f}", secrets.token_hex(8)
        keys = [stream, self.keys.job(job_id), self.keys.jobs, self.keys.entries(job_id), self.keys.task_gids(kind)]
        fingerprint = ""
        if idempotency_key is not None:
            keys.append(self._idempotency_key(idempotency_key))
            fingerprint = _fingerprint(spec or "")
        pipe = self.redis.pipeline(transaction=True)
        for i, start in enumerate(range(0, len(args), 2 * SUBMIT_CHUNK)):
            chunk = args[start : start + 2 * SUBMIT_CHUNK]
            head = (spec or "", summary) if i == 0 else ("", "")  # sent once: an inline spec is as big as its tasks
            self._submit(keys, [job_id, kind, head[0], now, submit_id, i, fingerprint, IDEMPOTENCY_TTL_S, head[1],
                                self.keys.job_prefix, *chunk], client=pipe)
        first = pipe.execute()[0]
        if isinstance(first, list):
            raise IdempotencyKeyUsed(first[0].decode(), first[1] == 1)
        return [f"{job_id}:{int(first) + i}:{task_id}" for i, task_id in enumerate(args[::2])]

    def check_idempotency_key(self, idempotency_key: str, spec: str) -> None:
        """Raise ``IdempotencyKeyUsed`` when the key already names a job, so a retry is answered before the checks a
        new job needs (a train job retried after the trainer finished would be refused). ``submit`` checks again in
        the call that claims the key: that check decides, this one only answers early."""
        claim = self.redis.get(self._idempotency_key(idempotency_key))
        if claim is not None:
            job_id, _, fingerprint = claim.decode().partition(":")
            if self.redis.exists(self.keys.job(job_id)):  # a claim naming a deleted job is void
                raise IdempotencyKeyUsed(job_id, fingerprint == _fingerprint(spec))

    def _idempotency_key(self, idempotency_key: str) -> str:
        """The Redis key of a client's idempotency key: hashed, so a key of any length or bytes names one of ours."""
        return self.keys.idempotency(_fingerprint(idempotency_key))

    def job(self, job_id: str) -> dict[str, str]:
        """The job hash: ``spec`` (JSON), ``kind``, ``state`` and counters (``submitted``, ``completed``,
        ``dead_lettered``, ``cancelled``, ``trained``, ``stale_dropped``, ``samples``, ``reward_sum``), as strings. A
        running job whose every task has a written group or a dead letter reads as ``done``."""
        return _job_state(_decoded(self.redis.hgetall(self.keys.job(job_id))))

    def job_state(self, job_id: str) -> str | None:
        """The job's stored ``state`` alone (``cancelled`` once cancelled; None for an unknown job or one that has
        none): one small read where the spec, which may hold thousands of inline tasks, is not needed."""
        state = self.redis.hget(self.keys.job(job_id), "state")
        return None if state is None else state.decode()

    def cancel_job(self, job_id: str) -> str | None:
        """Mark ``cancelled`` an eval job with tasks not rolled out yet, or a train job with groups not trained yet
        (tasks not rolled out, or groups still in the buffer, which the trainer then acks away unread; the groups of
        a step it already took are trained), whether or not the trainer is running; a done (every group trained or
        dropped) or cancelled one is left as it is. Returns the job's state after (``cancelled`` or ``done``), None
        for an unknown job."""
        state = self._cancel_job([self.keys.job(job_id)], list(TRAIN_ENDS))
        return None if state is None else state.decode()

    def delete_job(self, job_id: str) -> Deletion | None:
        """Delete a finished or cancelled job: its hash, its id in the index, its trajectories and eval results, its
        entries index, and its submit's idempotency claim, all in one step (``_DELETE_JOB``), then its dead letters and
        malformed groups. A cancelled job goes with its tasks and groups that no rollout server or trainer holds,
        removed as if acked away, whether or not any server or trainer runs; one a live consumer holds keeps it (a
        trainer is live while its lease, ``Keys.trainer_alive``, holds and it has not recorded its end), and a job
        neither finished nor cancelled is kept, with its dead letters. Before that step its entries are walked in
        batches (``_walk_entries``): its tasks no one holds removed, its dead letters and malformed groups set aside, so
        that step finds few; after it, what it set aside is removed in batches (``_drop_deleted_aside``), with what
        an earlier delete interrupted before it left. None for an unknown job (a second delete finds it so)."""
        keys = self._deletion_keys(job_id)
        queued = self._walk_entries(keys, cancelled=self.job_state(job_id) == "cancelled")
        found = self._delete_job(keys, [job_id, self.keys.idempotency(""), self.config.claim_idle_ms,
                                        self.config.dedup_window, *self._leases(), *TRAIN_ENDS])
        self._drop_deleted_aside()
        if found is None:
            return None
        kind, left, *counts = found
        if not left:
            tasks, groups = counts
            if tasks or groups or queued:
                log.info("job %s deleted with what was left of it: %d task(s) and %d group(s) no one held, removed",
                         job_id, queued + tasks, groups)
            return Deletion(kind.decode(), 0, removed_tasks=queued + tasks, removed_groups=groups)
        if queued:
            log.info("job %s: %d task(s) of it no one held removed; the job is kept (%d left)", job_id, queued, left)
        if not counts:
            return Deletion(kind.decode(), left, removed_tasks=queued)
        rolling_out, training, unfound, trainer, *servers = counts
        return Deletion(kind.decode(), left, removed_tasks=queued, rolling_out=rolling_out, training=training,
                        unfound=unfound, servers=tuple(sorted(s.decode() for s in servers)), trainer=trainer.decode())

    def _deletion_keys(self, job_id: str) -> list[str]:
        """The KEYS of ``_DELETE_JOB`` and of the scripts sharing its Lua, for ``job_id``."""
        k = self.keys
        return [k.job(job_id), k.jobs, k.trajectories(job_id), k.eval(job_id), k.entries(job_id), k.tasks("train"),
                k.tasks("eval"), k.tasks_dead, k.groups, k.groups_malformed, k.groups_newer,
                k.group_state, k.groups_consumed, k.admitted, k.admitted_ids, k.trainer, k.entries_aside(job_id),
                k.trainer_alive, k.deleted_aside, k.task_gids("train"), k.task_gids("eval"), k.group_records]

    def _leases(self) -> list[str]:
        """The ARGV of ``_TASK_REMOVAL``'s ``task_at``, for a task a live server holds deleted by hand: the train and
        eval task leases' key prefixes (``Keys.task_leases``)."""
        return [self.keys.task_leases("train"), self.keys.task_leases("eval")]

    def _drop_deleted_aside(self) -> None:
        """Remove the sets aside of the deleted jobs ``Keys.deleted_aside`` lists (the one just deleted, and any a
        delete interrupted before it removed them left), in batches (``_DROP_ASIDE``); a job listed that exists again
        (submitted under a deleted one's id) keeps its set until it is deleted."""
        for member in self.redis.smembers(self.keys.deleted_aside):
            job_id = member.decode()
            keys = self._deletion_keys(job_id)
            dropped = self._in_batches(keys[16], self._drop_aside, keys, [])
            if dropped:
                log.info("job %s: %d of its dead letters and malformed groups removed", job_id, dropped)
            if not self.redis.exists(keys[16]):
                self.redis.srem(self.keys.deleted_aside, member)

    def _walk_entries(self, keys: list[str], cancelled: bool) -> int:
        """Before a delete's step, walk the job's entries (``_CANCEL_QUEUED``): a cancelled job's tasks that no live
        consumer holds removed, and any job's dead letters and malformed groups set aside (moved, not deleted: a
        delete then refused loses none). A job read as not cancelled has its tasks skipped by the scan. ``keys``:
        ``_DELETE_JOB``'s. Returns how many tasks it removed."""
        return self._in_batches(keys[4], self._cancel_queued, keys,
                                [self.config.claim_idle_ms, self.config.dedup_window, *self._leases()],
                                None if cancelled else "[dg]*")

    def _in_batches(self, key: str, script: Script, keys: list[str], args: list[Any], match: str | None = None) -> int:
        """Hand the members of the set ``key`` to ``script`` (``keys``; ``args``, then the members), ``CANCEL_BATCH``
        a Lua call, walking it with SSCAN: one call for the entries of a job of ``api.max_job_tasks`` held Redis for
        seconds, every other client of the run answered BUSY. Stops at a call that returns -1 (the job is not what
        the script works on any more). Returns the sum of what the calls returned."""
        total, cursor = 0, 0
        while True:
            cursor, members = self.redis.sscan(key, cursor, match=match, count=CANCEL_BATCH)
            for start in range(0, len(members), CANCEL_BATCH):
                done = script(keys, [*args, *members[start : start + CANCEL_BATCH]])
                if done < 0:
                    return total
                total += done
            if not cursor:
                return total

    def job_summaries(self, job_ids: Sequence[str]) -> list[dict[str, str]]:
        """``job`` of each id ({} for an unknown one) as a listing shows it, in one round trip: its ``spec`` is the
        spec's summary (``summarize_spec``), and the spec itself, which may hold thousands of inline tasks, is never
        read. A job stored before summaries were (an older API wrote it, before or during a rolling upgrade) has its
        summary made from its spec once, and kept."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.keys.job(job_id), *_LISTED)
            pipe.hstrlen(self.keys.job(job_id), "spec")
        replies = pipe.execute()
        jobs = [{name: value.decode() for name, value in zip(_LISTED, values, strict=True) if value is not None}
                for values in replies[::2]]
        unsummarized = [i for i, (job, spec_len) in enumerate(zip(jobs, replies[1::2], strict=True))
                        if spec_len and "spec_summary" not in job]
        if unsummarized:
            self._summarize([job_ids[i] for i in unsummarized], [jobs[i] for i in unsummarized])
        for job in jobs:
            if "spec_summary" in job:
                job["spec"] = job.pop("spec_summary")
        return [_job_state(job) for job in jobs]

    def _summarize(self, job_ids: Sequence[str], jobs: Sequence[dict[str, str]]) -> None:
        """Make and keep the summaries of jobs stored with a spec but none (into ``jobs``, as read): the one read of
        their specs a listing makes. The summary of a spec, which never changes once stored, is always the same, so
        API replicas that do this at once agree."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "spec")
        for job_id, job, spec in zip(job_ids, jobs, pipe.execute(), strict=True):
            if spec is not None:  # None: deleted since the listing read it
                job["spec_summary"] = summarize_spec(spec.decode())
                self._keep_summary([self.keys.job(job_id)], [job["spec_summary"]], client=pipe)
        pipe.execute()
        log.info("stored the spec summaries of %d job(s) written without one: %s", len(job_ids), ", ".join(job_ids))

    def read(
        self, consumer: str, count: int, block_ms: int = 0, kinds: Sequence[str] = ("eval", "train")
    ) -> list[TaskEntry]:
        """Up to ``count`` tasks: this consumer's own pending ones first (after a restart), then idle ones
        of dead consumers, then new ones (eval before train). Blocks up to ``block_ms`` only when idle."""
        out: list[TaskEntry] = []
        for kind in kinds:
            if len(out) < count:
                out += self.reclaim(consumer, count - len(out), kind)
        for kind in kinds:
            if len(out) < count:
                out += self._read_new(consumer, {self.keys.tasks(kind): ">"}, count - len(out), None)
        if not out and block_ms > 0:
            streams = {self.keys.tasks(kind): ">" for kind in kinds}
            got = self._read_new(consumer, streams, 1, block_ms)
            for extra in got[count:]:
                self.hand_back(extra)
            out = got[:count]
        return out

    def _read_new(self, consumer: str, streams: dict[str, str], count: int, block_ms: int | None) -> list[TaskEntry]:
        reply = self.redis.xreadgroup(ROLLOUT_GROUP, consumer, streams, count=count, block=block_ms)
        out = []
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                entry = self._parse(stream.decode(), entry_id.decode(), fields, consumer, delivered=1)
                if entry is not None:
                    out.append(entry)
        return out

    def reclaim(self, consumer: str, count: int, kind: str) -> list[TaskEntry]:
        """This consumer's own pending tasks (all after a restart; then, every ``claim_idle_ms``, those it left
        idle that long: a task it dropped without an ack), then tasks idle past ``claim_idle_ms`` in other
        consumers' pending lists. A live consumer renews the tasks it works on (``renew``), so they are not handed to
        it again. Tasks deleted by hand are ended once, each by the record it left (``_TASK_GONE``: its admission slot
        given back, its job counting it ``dead_lettered``), logged naming its entry and counted: one pending once it
        is idle past ``claim_idle_ms`` and no live server holds it under a lease (``renew``), acked away; one never
        delivered by the sweep of the records (every ``claim_idle_ms``, ``Reclaimer``)."""
        stream = self.keys.tasks(kind)
        reclaimer = self._reclaimers.get((consumer, kind))
        if reclaimer is None:
            gone = Gone(_TASK_GONE, (self.keys.task_gids(kind), self.keys.admitted, self.keys.admitted_ids),
                        (self.keys.job_prefix, self.keys.entries("")))
            reclaimer = Reclaimer(self.redis, stream, ROLLOUT_GROUP, consumer, self.config.claim_idle_ms,
                                  own_every_s=self.config.claim_idle_ms / 1000, gone=gone,
                                  lease=self.keys.task_leases(kind))
            self._reclaimers[(consumer, kind)] = reclaimer
        got = reclaimer.claim(count)
        label = TASK_STREAMS[kind]
        if got.ended:
            log.warning("%s: %d pending task(s) had been deleted from the stream; acked them away, ending %d of them "
                        "(admission slot given back, counted dead_lettered for their jobs): %s", stream,
                        len(got.ended), sum(1 for _, gid in got.ended if gid), named(got.ended))
            self.metrics.deleted_pending.labels(stream=label).inc(len(got.ended))
        if got.swept:
            log.warning("%s: %d task(s) had been deleted from the stream before any delivery (an XDEL or trim by "
                        "hand); ended them by their records (admission slot given back, counted dead_lettered for "
                        "their jobs): %s", stream, len(got.swept), named(got.swept))
            self.metrics.deleted_undelivered.labels(stream=label).inc(len(got.swept))
        if got.claimed:
            self.metrics.redeliveries.labels(stream=label).inc(len(got.claimed))
        out = [self._parse(stream, entry_id, fields, consumer, delivered=n) for entry_id, n, fields in got.claimed]
        return [e for e in out if e is not None]

    def _parse(
        self, stream: str, entry_id: str, fields: dict[bytes, bytes], consumer: str, delivered: int
    ) -> TaskEntry | None:
        """A ``TaskEntry``, or None after moving a malformed entry aside or dead-lettering an exhausted one."""
        try:
            text = {k.decode(): v.decode() for k, v in fields.items()}
            missing = [k for k in ("job_id", "kind", "gid", "task") if k not in text]
            if missing:
                raise ValueError(f"missing field(s) {', '.join(missing)}")
            if text["kind"] not in TASK_KINDS:
                raise ValueError(f"kind {text['kind']!r} is not one of {', '.join(TASK_KINDS)}")
            task = json.loads(text["task"])
            if not isinstance(task, dict):
                raise ValueError(f"task: expected a JSON object, got {type(task).__name__}")
            entry = TaskEntry(
                stream, entry_id, text["job_id"], text["kind"], text["gid"], task,
                deliveries=int(text.get("attempts", "0")) + delivered, consumer=consumer,
                last_error=text.get("error", ""),
            )
        except (UnicodeDecodeError, ValueError) as exc:
            self._move_malformed(stream, entry_id, fields, consumer, f"task entry {entry_id}: {exc}")
            return None
        if entry.deliveries > self.config.max_attempts:
            last = f"; last error: {entry.last_error}" if entry.last_error else ""
            self.dead_letter(entry, f"delivered {entry.deliveries} times without completing{last}")
            return None
        return entry

    def _move_malformed(
        self, stream: str, entry_id: str, fields: Mapping[bytes, bytes], consumer: str, error: str
    ) -> None:
        """Move an unparseable entry to the malformed stream with the error and its raw fields (``_MALFORMED``),
        unless another consumer took it over meanwhile."""
        raw = [x for k, v in fields.items() for x in (b"f." + k, v)]
        keys = [stream, self.keys.tasks_malformed, self._gids_of(stream)]
        try:
            keys.append(self.keys.job(fields[b"job_id"].decode()))
        except (KeyError, UnicodeDecodeError):
            pass  # no job to count it on
        if self._malformed(keys, [ROLLOUT_GROUP, entry_id, consumer, "stream", stream, "entry_id", entry_id,
                                  "error", error, *raw]):
            log.warning("%s: moved to %s: %s", stream, self.keys.tasks_malformed, error)
            self.metrics.malformed.labels(stream="tasks").inc()

    def _gids_of(self, stream: str) -> str:
        """The task records (``Keys.task_gids``) of a task stream."""
        return {self.keys.tasks(kind): self.keys.task_gids(kind) for kind in TASK_KINDS}[stream]

    def _entry_args(self, entry: TaskEntry) -> list[Any]:
        return [ROLLOUT_GROUP, entry.entry_id, entry.consumer, entry.group_id, entry.job_id, entry.kind,
                json.dumps(entry.task, separators=(",", ":"))]

    def dead_letter(self, entry: TaskEntry, error: str) -> bool:
        """Move a task to the dead-letter stream and release its admission; False if it was no longer pending for
        its consumer."""
        keys = [entry.stream, self.keys.tasks_dead, self.keys.job(entry.job_id), self.keys.admitted,
                self.keys.admitted_ids, self.keys.entries(entry.job_id), self.keys.task_gids(entry.kind)]
        moved = self._pending(entry, "dead-lettered",
                              self._dead_letter(keys, [*self._entry_args(entry), entry.deliveries, error]))
        if moved:
            self.metrics.dead_letters.inc()
            log.warning("task %s (job %s) dead-lettered: %s", entry.group_id, entry.job_id, error)
        return moved

    def cancel(self, entry: TaskEntry) -> bool:
        """Ack a task of a cancelled job without rolling it out: the job counts it ``cancelled`` (not a dead
        letter: dead letters are failures). False if it was no longer pending for its consumer."""
        keys = [entry.stream, self.keys.job(entry.job_id), self.keys.admitted, self.keys.admitted_ids,
                self.keys.entries(entry.job_id), self.keys.task_gids(entry.kind)]
        done = self._pending(entry, "cancelled", self._cancel(keys, self._entry_args(entry)))
        if done:
            self.metrics.cancelled.labels(stream="tasks").inc()
            log.info("task %s of cancelled job %s acked away unrolled", entry.group_id, entry.job_id)
        return done

    def fail(self, entry: TaskEntry, error: str) -> bool:
        """Record a failed attempt: requeue the task with the error and release its admission, or dead-letter it
        once attempts are spent.

        Returns True if the task was dead-lettered."""
        if entry.deliveries >= self.config.max_attempts:
            return self.dead_letter(entry, error)
        keys = [entry.stream, self.keys.entries(entry.job_id), self.keys.task_gids(entry.kind), self.keys.admitted,
                self.keys.admitted_ids]
        self._pending(entry, "requeued", self._requeue(keys, [*self._entry_args(entry), entry.deliveries, error]))
        return False

    def hand_back(self, entry: TaskEntry) -> bool:
        """Give a task back unprocessed (shutdown, or read one too many): requeued, this delivery not counted.
        False if it was no longer pending for its consumer."""
        return self._pending(entry, "handed back", self._requeue(
            [entry.stream, self.keys.entries(entry.job_id), self.keys.task_gids(entry.kind)],
            [*self._entry_args(entry), entry.deliveries - 1, entry.last_error]))

    @staticmethod
    def _pending(entry: TaskEntry, action: str, done: int) -> bool:
        """Whether a script found the task still pending for its consumer (``done``); if not, log that nothing was
        done: the consumer lost its lease and another one took the task over, or ended it."""
        if not done:
            log.warning("task %s (job %s) not %s: entry %s of %s is no longer pending for %s (another consumer took "
                        "it over, or ended it)", entry.group_id, entry.job_id, action, entry.entry_id, entry.stream,
                        entry.consumer)
        return bool(done)

    def renew(self, consumer: str, entries: Sequence[TaskEntry]) -> list[TaskEntry]:
        """Reset the idle time of tasks this consumer still holds, so live work is not reclaimed; a task deleted by hand
        while it holds it is held by a lease key instead (``Keys.task_leases``, for ``claim_idle_ms``), so it writes
        its group however long it takes (before, the first reclaim past ``claim_idle_ms`` ended it as
        ``dead_lettered`` and its finished group was refused as task-gone).

        Returns the entries that another consumer has claimed meanwhile (the lease was lost). One acked meanwhile
        (its group finished while the renewal was on its way) is pending for no one, and was not lost."""
        by_stream: dict[str, list[TaskEntry]] = {}
        for e in entries:
            by_stream.setdefault(e.stream, []).append(e)
        lost = []
        for stream, group in by_stream.items():
            args = [ROLLOUT_GROUP, consumer, self.keys.task_leases(group[0].kind), self.config.claim_idle_ms]
            taken = {i.decode() for i in self._renew([stream], [*args, *(e.entry_id for e in group)])}
            lost += [e for e in group if e.entry_id in taken]
        return lost


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def summarize_spec(spec: str) -> str:
    """A job's spec as a listing shows it: without its source's ``tasks``, an inline source saying how many it gave
    (``task_count``), so a page of jobs stays small whatever they hold."""
    summary = json.loads(spec)
    source = summary.get("source")
    if isinstance(source, dict) and "tasks" in source:
        tasks = source.pop("tasks")
        if isinstance(tasks, list):
            source["task_count"] = len(tasks)
    return json.dumps(summary, separators=(",", ":"))


def _decoded(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def _job_state(job: dict[str, str]) -> dict[str, str]:
    """A job hash, ``state`` reading ``done`` once every task is finished."""
    finished = int(job.get("completed", 0)) + int(job.get("dead_lettered", 0))
    if job.get("state") == "running" and finished >= int(job.get("submitted", 0)):
        job["state"] = "done"
    return job
