"""The Lua scripts behind every Redis state change: one source for every Redis backend.

Each script is one atomic step. They are called by SHA1 (computed here, without I/O) and
loaded with ``SCRIPT LOAD`` only when the server answers ``NOSCRIPT``. Every key a script
touches shares the hash tag ``{name}``, so a lock, its fence counter, its queues and its
wake-up channels live in one Cluster slot.

Stored value of a lock key: ``<token>:<identity>``; the token is 128 random bits that only
its holder knows (compared, never returned), the identity is who holds it (returned by
``inspect``). While readers hold a read-write lock, the lock key holds :data:`READERS`
instead, expiring with the last reader: a writer's ``SET NX`` then fails like on any held
lock, so the exclusive path costs nothing more for read-write locks.

Keys of a name (``P`` = ``prefix:{name}``):

- ``P`` the lock (or :data:`READERS`), ``P:fence`` its fence counter, ``P:wake`` the
  wake-up channel (``P:wake:<client>`` each client's inbox on it);
- ``P:released`` the holder values released lately (see below), of the lock and its
  readers;
- ``P:queue`` / ``P:due`` the waiters for the exclusive lock, in arrival order, and when
  each one's place lapses (with its client's inbox); a live entry is also what keeps new
  readers out (writer preference);
- ``P:readers`` (sorted set: reader -> expiry, ms of server time), ``P:readers:grants``
  (reader -> fence), ``P:readers:queue`` / ``P:readers:due`` the waiting readers;
- ``P:permits`` (sorted set: holder -> expiry), ``P:permits:grants`` (holder -> fence),
  ``P:permits:fence`` the semaphore's own counter, ``P:permits:queue`` / ``P:permits:due``
  its waiters, ``P:permits:released`` its permits released lately: a semaphore shares
  nothing but the wake-up channel with the lock ``name``.

Every script gives the same answer when run twice with the same holder value, so a
request may be sent again after its reply was lost (a connection that closed before
answering, a give-back after a cancelled release). Acquires find their own grant. A
release that finds its value gone answers 1 again if that value's release ran lately:
each release that succeeds remembers the SHA1 of the value it released (a sorted set
scored by when the memory ends, ms of server time) for a window the caller passes, at
most :data:`RELEASED_CAP` values per name, those whose memory ends first forgotten first
(within one ms, in the order of their SHA1s); a grant forgets its own value, so a lease
granted again with the same value (a grant given back and retried) and then expired is
reported as not held, never as released.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = (
    "ACQUIRE",
    "ACQUIRE_FAIR",
    "ACQUIRE_PERMIT",
    "ACQUIRE_SHARED",
    "DEQUEUE",
    "EXTEND",
    "EXTEND_MANY",
    "EXTEND_PERMIT",
    "EXTEND_SHARED",
    "INSPECT",
    "RAISE_FENCE",
    "READERS",
    "RELEASE",
    "RELEASED_CAP",
    "RELEASE_PERMIT",
    "RELEASE_SHARED",
    "Script",
    "sharded",
)

#: The lock key's value while readers hold it (never a ``token:identity`` value).
READERS = "readers"

#: How many released values a name remembers at most (see the module's docstring): the
#: memory of a hot lock stays small, a few KB per name (a listpack on the server).
RELEASED_CAP = 64


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua source and its SHA1, for ``EVALSHA``."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())  # noqa: S324 - Redis names scripts by SHA1


_SHARDED: dict[str, Script] = {}


def sharded(script: Script) -> Script:
    """The variant of ``script`` for Redis Cluster: wake-ups go out with ``SPUBLISH``.

    Sharded pub/sub delivers a message only within the shard that owns the channel's slot
    (the lock's slot: the channels share its hash tag), instead of broadcasting it over the
    cluster bus to every node. Same source otherwise; the same script for scripts that
    publish nothing.
    """
    variant = _SHARDED.get(script.name)
    if variant is None:
        source = script.source.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
        variant = script if source == script.source else Script(f"{script.name}_sharded", source)
        _SHARDED[script.name] = variant
    return variant


# -- Lua shared by several scripts ------------------------------------------------------

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# fence = max(last fence + 1, server time in microseconds, floor): strictly increasing
# while the counter lives, and still increasing after a restart that lost it (given the
# server's clock does not step back). %d, not tostring: Lua 5.1 prints large numbers
# with 14 significant digits.
_FENCE = """
local function next_fence(counter, floor, retention)
  local t = redis.call('TIME')
  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if fence < floor then
    fence = floor
  end
  local last = tonumber(redis.call('GET', counter) or 0)
  if fence <= last then
    fence = last + 1
  end
  redis.call('SET', counter, string.format('%d', fence), 'PX', retention)
  return fence
end
"""

# Join a waiter queue, keeping one's place when already in it, until a deadline the
# caller renews with each attempt (``stay`` ms from now). Scores are microseconds, and a
# newcomer always goes after the last one (even within one microsecond): the queue is
# arrival order, which fair locks hand the lock out in.
_JOIN = """
local function join(queue, due, value, stay, inbox)
  local t = redis.call('TIME')
  local at = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')[2]
  if last and tonumber(last) >= at then
    at = tonumber(last) + 1
  end
  redis.call('ZADD', queue, 'NX', string.format('%d', at), value)
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', due, value, string.format('%d', now + stay) .. ':' .. inbox)
  for _, key in ipairs({queue, due}) do
    if redis.call('PTTL', key) < stay then
      redis.call('PEXPIRE', key, stay)
    end
  end
end

local function leave(queue, due, value)
  redis.call('ZREM', queue, value)
  redis.call('HDEL', due, value)
end
"""

# Holders with their own expiry (readers, permits): a sorted set holder -> expiry (ms of
# server time) and a hash holder -> fence; the keys expire with their last holder.
# (Commands beyond the plain lock's: ZCARD only; see the README's ACL.)
_HOLDERS = """
local function drop_expired(set, grants, now)
  for _, holder in ipairs(redis.call('ZRANGE', set, '-inf', now, 'BYSCORE')) do
    redis.call('ZREM', set, holder)
    redis.call('HDEL', grants, holder)
  end
end

-- The last expiry among the holders (nil if none), which every key of theirs gets.
local function keep_until(set, grants, now, lock)
  local last = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')[2]
  if last then
    local left = math.max(tonumber(last) - now, 1)
    for _, key in ipairs({set, grants, lock}) do
      redis.call('PEXPIRE', key, left)
    end
  end
  return last
end
"""

# Released values: a release that succeeded remembers ``id`` (the SHA1 of the value) for
# ``window`` ms, so that the same release run again (its reply was lost) answers 1 again;
# a grant forgets its value. Bounded per name: RELEASED_CAP values (the ones whose memory
# ends first go first), and the key lives no longer than the longest window.
_RELEASED = """
local function remember(released, id, now, window)
  redis.call('ZADD', released, string.format('%d', now + window), id)
  local old = redis.call('ZRANGE', released, 0, -(RELEASED_CAP + 1))
  if #old > 0 then
    redis.call('ZREM', released, unpack(old))
  end
  if redis.call('PTTL', released) < window then
    redis.call('PEXPIRE', released, window)
  end
end

-- 1 if ``id`` was released within its window (a release run again), else 0.
local function released_lately(released, id, now)
  local until_ = redis.call('ZSCORE', released, id)
  if until_ and tonumber(until_) > now then
    return 1
  end
  return 0
end
""".replace("RELEASED_CAP", str(RELEASED_CAP))

# A holder with its own expiry (reader, permit) gives its value back: taken out of the
# holders' ``set`` and ``grants``, and remembered as released (``id``, its SHA1) if its
# lease had not ended and ``live`` (the caller's own condition) holds. Returns nil when
# it was released now, else the script's answer: 0 when it was not held (or its lease
# had ended), 1 when its release ran lately (the same release sent again).
_GIVE_BACK = (
    _RELEASED
    + """
local function give_back(set, grants, released, value, id, now, window, live)
  local mine = redis.call('ZSCORE', set, value)
  if not mine then
    return released_lately(released, id, now)
  end
  redis.call('ZREM', set, value)
  redis.call('HDEL', grants, value)
  if tonumber(mine) <= now or not live then
    return 0  -- its lease had ended
  end
  remember(released, id, now, window)
  return nil
end
"""
)

# The oldest waiter whose place has not expired, its client's inbox and when its place
# lapses, dropping the lapsed ones ahead of it. Not bounded per call, so that a release
# always finds the oldest live waiter however many dead places lead the queue (a process
# killed with many waiters queued): each lapsed place is read and dropped once, so the
# work over time is bounded by the number of joins (a few commands per place), read in
# batches of 32.
_NEXT_WAITER = """
local function next_waiter(queue, due)
  local now = nil
  while true do
    local heads = redis.call('ZRANGE', queue, 0, 31)
    if #heads == 0 then
      return nil
    end
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    local lapsed = {}
    for _, head in ipairs(heads) do
      local until_, inbox = string.match(redis.call('HGET', due, head) or '', '^(%d+):(.*)$')
      if until_ and tonumber(until_) > now then
        if #lapsed > 0 then
          redis.call('ZREM', queue, unpack(lapsed))
          redis.call('HDEL', due, unpack(lapsed))
        end
        return head, inbox, tonumber(until_) - now
      end
      lapsed[#lapsed + 1] = head
    end
    redis.call('ZREM', queue, unpack(lapsed))
    redis.call('HDEL', due, unpack(lapsed))
  end
end
"""

# Wake-ups go to a waiter's client inbox, "<release id> <waiter>", so that only that
# waiter tries; "<release id> *" wakes every waiter of the name at that client (readers:
# all of them can go at once); "<release id>" on the lock's channel itself wakes one
# waiter per listening client (Redlock's waiters, which do not queue).
_WAKE = (
    _NEXT_WAITER
    + """
-- Wake the oldest live waiter of a queue; true if there was one.
local function wake_next(channel, id, queue, due)
  local target, inbox = next_waiter(queue, due)
  if target then
    redis.call('PUBLISH', channel .. ':' .. inbox, id .. ' ' .. target)
    return true
  end
  return false
end

-- Wake every live waiting reader: one message per client that has any.
local function wake_readers(channel, id, rqueue, rdue)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local told = {}
  for _, reader in ipairs(redis.call('ZRANGE', rqueue, 0, -1)) do
    local until_, inbox = string.match(redis.call('HGET', rdue, reader) or '', '^(%d+):(.*)$')
    if until_ and tonumber(until_) > now then
      if not told[inbox] then
        told[inbox] = true
        redis.call('PUBLISH', channel .. ':' .. inbox, id .. ' *')
      end
    else
      redis.call('ZREM', rqueue, reader)
      redis.call('HDEL', rdue, reader)
    end
  end
end

-- The lock came free: a waiting writer (exclusive waiter) first, in arrival order;
-- else every waiting reader; with nobody queued, the lock's channel.
local function hand_on(channel, id, queue, due, rqueue, rdue)
  if wake_next(channel, id, queue, due) then
    return
  end
  if redis.call('EXISTS', rdue) == 1 then
    wake_readers(channel, id, rqueue, rdue)
  else
    redis.call('PUBLISH', channel, id)
  end
end
"""
)

# -- exclusive locks --------------------------------------------------------------------

ACQUIRE = Script(
    "acquire",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key, KEYS[3] released values
-- KEYS[4] waiter queue, KEYS[5] waiters' expiry times (optional: a caller that waits)
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] how long the fence counter outlives use (ms)
-- ARGV[4] (optional) a floor for the fence: Redlock proposes one value to every node
-- ARGV[5], ARGV[6] (with KEYS[4..5]) how long a refused caller keeps its place in the
-- waiter queue (ms), and the suffix of the channel it listens on (its client's inbox)
-- Returns the new fence (> 0) when granted; otherwise minus the holder's remaining ms,
-- or 0 when that is unknown (a key without expiry, set by someone else) or the caller
-- is queued behind another waiter (only the first live waiter retries when the lease ends).
-- Readers hold the lock key too (its value is then the readers' mark), so a writer is
-- refused while any reader holds; a refused writer's place in the queue keeps new
-- readers out until it got the lock or its place lapsed (writer preference).
-- A grant forgets that its value was released (a retry of a grant given back).
"""
    + _FENCE
    + _JOIN
    + _NEXT_WAITER
    + """
local queued = #KEYS >= 5
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('ZREM', KEYS[3], redis.sha1hex(ARGV[1]))
  if queued then
    leave(KEYS[4], KEYS[5], ARGV[1])
  end
  return next_fence(KEYS[2], tonumber(ARGV[4] or 0), ARGV[3])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  -- Already ours: this is a retry of a request whose reply was lost. Same grant, and
  -- its fence, unless the counter was evicted: then a new one (its reply never arrived,
  -- so nobody saw the old one; 0 would read as "refused" and leave us waiting on us).
  -- Renewed to a full ttl from now (its sender counts the lease from the retry), which is
  -- also a write: a WAIT after it (sync_replicas) on the retry's connection counts only
  -- replicas that have the key, not those that merely have that connection's (no) writes.
  -- Never shortened: a stale copy (a client library's own resend, landing late) must not
  -- cut the expiry of a lease its owner has extended since.
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  if queued then
    leave(KEYS[4], KEYS[5], ARGV[1])
  end
  local fence = tonumber(redis.call('GET', KEYS[2]) or 0)
  if fence > 0 then
    return fence
  end
  return next_fence(KEYS[2], tonumber(ARGV[4] or 0), ARGV[3])
end
local pttl = redis.call('PTTL', KEYS[1])
if queued then
  -- A release wakes the oldest live waiter only.
  join(KEYS[4], KEYS[5], ARGV[1], tonumber(ARGV[5]), ARGV[6])
  if next_waiter(KEYS[4], KEYS[5]) ~= ARGV[1] then
    -- Only the first waiter comes back when the holder's lease ends (a holder that
    -- died publishes nothing): the others wait for the wake-up of its release, or
    -- their own (jittered) backoff, not all at the same millisecond.
    return 0
  end
end
if pttl < 0 then
  return 0
end
return -pttl
""",
)

ACQUIRE_FAIR = Script(
    "acquire_fair",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key, KEYS[3] waiter queue, KEYS[4] expiry times
-- KEYS[5] released values
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] fence retention (ms)
-- ARGV[4] how long a refused caller keeps its place in the queue (ms; 0: it does not
-- queue, it tried once), ARGV[5] its client's inbox
-- ACQUIRE in arrival order: refused while the first live waiter in the queue is someone
-- else, even when the lock is free, so nobody barges. A dead waiter's place lapses after
-- its stay, and it is skipped from then on. Returns the fence (> 0), or minus the ms
-- after which trying again makes sense (the holder's lease, or the first waiter's place,
-- ends), or 0 when unknown or queued behind the first waiter.
"""
    + _FENCE
    + _JOIN
    + _NEXT_WAITER
    + """
local stay = tonumber(ARGV[4])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])  -- a retry of a granted request: see ACQUIRE
  end
  leave(KEYS[3], KEYS[4], ARGV[1])
  local fence = tonumber(redis.call('GET', KEYS[2]) or 0)
  if fence > 0 then
    return fence
  end
  return next_fence(KEYS[2], 0, ARGV[3])  -- the counter was evicted (see ACQUIRE)
end
local first, _, lapses = next_waiter(KEYS[3], KEYS[4])
if (first == nil or first == ARGV[1])
    and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('ZREM', KEYS[5], redis.sha1hex(ARGV[1]))  -- see ACQUIRE
  leave(KEYS[3], KEYS[4], ARGV[1])
  return next_fence(KEYS[2], 0, ARGV[3])
end
if stay > 0 then
  join(KEYS[3], KEYS[4], ARGV[1], stay, ARGV[5])
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 and lapses then
  return -math.max(lapses, 1)
end
if stay > 0 and first ~= nil and first ~= ARGV[1] then
  return 0  -- queued behind the first waiter: only it retries when the lease ends (ACQUIRE)
end
if pttl < 0 then
  return 0
end
return -pttl
""",
)

RELEASE = Script(
    "release",
    """
-- KEYS[1] lock key, KEYS[2] wake-up channel (declared so Cluster routes it with the lock)
-- KEYS[3] waiter queue, KEYS[4] waiters' expiry times, KEYS[5] readers' queue,
-- KEYS[6] readers' expiry times, KEYS[7] released values
-- ARGV[1] holder value, ARGV[2] how long the release is remembered (ms)
-- Deletes the lock and wakes waiters only if ARGV[1] still holds it. Returns 1 (also
-- when run again: ARGV[1] released it within ARGV[2] ms) or 0.
-- The message names the release (a digest, not the token), so that Redlock waiters can
-- count the nodes one release reached, and whom it wakes: the oldest live exclusive
-- waiter if any (a writer first), else every waiting reader.
"""
    + _NOW
    + _RELEASED
    + _WAKE
    + """
local id = redis.sha1hex(ARGV[1])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  remember(KEYS[7], id, now_ms(), tonumber(ARGV[2]))
  hand_on(KEYS[2], id, KEYS[3], KEYS[4], KEYS[5], KEYS[6])
  return 1
end
return released_lately(KEYS[7], id, now_ms())
""",
)

DEQUEUE = Script(
    "dequeue",
    """
-- KEYS[1] lock key, KEYS[2] wake-up channel, KEYS[3] waiter queue, KEYS[4] expiry times,
-- KEYS[5] readers' queue, KEYS[6] their expiry times, KEYS[7] semaphore waiters' queue,
-- KEYS[8] their expiry times
-- ARGV[1] the value of a waiter that gave up (timed out, cancelled)
-- Leaves whichever queue it is in. A wake-up it may have taken goes on: to the next
-- exclusive waiter (or the readers) if the lock is free; to the readers if it was the
-- last writer keeping them out; to the next semaphore waiter. The first waiter of a
-- held lock wakes the next, which becomes first. Returns 1 if it was
-- queued, else 0.
"""
    + _WAKE
    + """
local id = 'dequeue:' .. redis.sha1hex(ARGV[1])
local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
local was = redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if was == 1 then
  local holder = redis.call('GET', KEYS[1])
  if not holder then
    hand_on(KEYS[2], id, KEYS[3], KEYS[4], KEYS[5], KEYS[6])
  elseif holder == 'READERS_MARK' and not next_waiter(KEYS[3], KEYS[4]) then
    wake_readers(KEYS[2], id, KEYS[5], KEYS[6])
  elseif head == ARGV[1] then
    -- The first waiter left a held lock: the new first one (which sleeps on its
    -- backoff, see ACQUIRE) tries once, and learns that it retries when the lease ends.
    wake_next(KEYS[2], id, KEYS[3], KEYS[4])
  end
end
was = was + redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
if redis.call('ZREM', KEYS[7], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[8], ARGV[1])
  wake_next(KEYS[2], id, KEYS[7], KEYS[8])
  was = 1
end
return math.min(was, 1)
""".replace("READERS_MARK", READERS),
)

RAISE_FENCE = Script(
    "raise_fence",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key
-- ARGV[1] holder value, ARGV[2] fence, ARGV[3] how long the fence counter outlives use (ms)
-- Redlock's second step: once a majority granted the lock, the lease's fence is the
-- largest counter among them plus one, written back here. Only while ARGV[1] still holds
-- the lock, and never lowering the counter. Returns 1 or 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if tonumber(ARGV[2]) > tonumber(redis.call('GET', KEYS[2]) or 0) then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  else
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  return 1
end
return 0
""",
)

EXTEND = Script(
    "extend",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] how long the fence counter outlives use (ms)
-- Resets the expiry only if ARGV[1] still holds the lock: an expired or re-taken lock is
-- never revived. The fence counter lives on as long as the lock does. Returns 1 or 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
""",
)

EXTEND_MANY = Script(
    "extend_many",
    """
-- KEYS[2i-1] lock key i, KEYS[2i] its fence counter key
-- ARGV[3i-2] holder value of lock i, ARGV[3i-1] its ttl in ms, ARGV[3i] fence retention (ms)
-- The watchdog's batch: EXTEND for every lock in one round trip. Returns 1/0 per lock.
local out = {}
for i = 1, #KEYS / 2 do
  if redis.call('GET', KEYS[2 * i - 1]) == ARGV[3 * i - 2] then
    redis.call('PEXPIRE', KEYS[2 * i - 1], ARGV[3 * i - 1])
    redis.call('PEXPIRE', KEYS[2 * i], ARGV[3 * i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
""",
)

INSPECT = Script(
    "inspect",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key, KEYS[3] readers, KEYS[4] readers' fences
-- Returns nil when free, else {holder value, remaining ms (-1: no expiry), fence or ''};
-- while readers hold, the reader whose lease ends last.
local value = redis.call('GET', KEYS[1])
if not value then
  return false
end
if value == 'READERS_MARK' then
  local reader = redis.call('ZRANGE', KEYS[3], -1, -1)[1]
  if reader then
    return {reader, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[4], reader) or ''}
  end
end
return {value, redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or ''}
""".replace("READERS_MARK", READERS),
)

# -- read-write locks: the reader's side (the writer's is the exclusive lock) ------------

ACQUIRE_SHARED = Script(
    "acquire_shared",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key (shared with writers: one fence order),
-- KEYS[3] readers (sorted set: value -> expiry ms), KEYS[4] readers' fences (hash),
-- KEYS[5] exclusive waiters' queue, KEYS[6] their expiry times,
-- KEYS[7] readers' queue, KEYS[8] their expiry times, KEYS[9] released values
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] fence retention (ms),
-- ARGV[4] how long a refused reader keeps its place (ms; 0: it does not queue),
-- ARGV[5] its client's inbox
-- Granted when no writer holds and no writer waits (a live place in the exclusive
-- queue: writers are preferred). The lock key then holds the readers' mark and expires
-- with the last reader. Returns the fence (> 0), or minus the ms after which trying
-- again makes sense, or 0 when unknown.
"""
    + _NOW
    + _FENCE
    + _JOIN
    + _HOLDERS
    + _NEXT_WAITER
    + """
local MARK = 'READERS_MARK'
local now = now_ms()
local holder = redis.call('GET', KEYS[1])
local mine = redis.call('ZSCORE', KEYS[3], ARGV[1])
if holder == MARK and mine and tonumber(mine) > now then
  -- A retry of a granted request: the same grant, renewed to a full ttl from now, never
  -- shortened (a stale copy must not cut a lease extended since; see ACQUIRE).
  local until_ = now + tonumber(ARGV[2])
  if tonumber(mine) < until_ then
    redis.call('ZADD', KEYS[3], 'XX', until_, ARGV[1])
  end
  keep_until(KEYS[3], KEYS[4], now, KEYS[1])
  leave(KEYS[7], KEYS[8], ARGV[1])
  return tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or 0)
end
local wait = nil
if holder and holder ~= MARK then
  wait = redis.call('PTTL', KEYS[1])  -- a writer holds
else
  local writer, _, lapses = next_waiter(KEYS[5], KEYS[6])
  if writer then
    wait = lapses  -- a writer waits: after it, a release wakes us; or its place lapses
  end
end
if wait then
  local stay = tonumber(ARGV[4])
  if stay > 0 then
    join(KEYS[7], KEYS[8], ARGV[1], stay, ARGV[5])
  end
  if wait < 0 then
    return 0
  end
  return -math.max(wait, 1)
end
if holder ~= MARK then
  -- Free: readers that were left over (their mark deleted by hand) are gone too.
  redis.call('DEL', KEYS[3], KEYS[4])
else
  drop_expired(KEYS[3], KEYS[4], now)
end
local fence = next_fence(KEYS[2], 0, ARGV[3])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], string.format('%d', fence))
redis.call('ZREM', KEYS[9], redis.sha1hex(ARGV[1]))  -- see ACQUIRE
if holder ~= MARK then
  redis.call('SET', KEYS[1], MARK, 'PX', ARGV[2])
end
keep_until(KEYS[3], KEYS[4], now, KEYS[1])
leave(KEYS[7], KEYS[8], ARGV[1])
return fence
""".replace("READERS_MARK", READERS),
)

EXTEND_SHARED = Script(
    "extend_shared",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key, KEYS[3] readers, KEYS[4] readers' fences
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] fence retention (ms)
-- Renews a reader only while it holds (its expiry not passed, the readers' mark in
-- place); the lock key then lives as long as the last reader. Returns 1 or 0.
"""
    + _NOW
    + _HOLDERS
    + """
local now = now_ms()
local mine = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not mine or tonumber(mine) <= now or redis.call('GET', KEYS[1]) ~= 'READERS_MARK' then
  return 0
end
redis.call('ZADD', KEYS[3], 'XX', now + tonumber(ARGV[2]), ARGV[1])
keep_until(KEYS[3], KEYS[4], now, KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
""".replace("READERS_MARK", READERS),
)

RELEASE_SHARED = Script(
    "release_shared",
    """
-- KEYS[1] lock key, KEYS[2] wake-up channel, KEYS[3] exclusive waiters' queue,
-- KEYS[4] their expiry times, KEYS[5] readers' queue, KEYS[6] their expiry times,
-- KEYS[7] readers, KEYS[8] readers' fences, KEYS[9] released values
-- ARGV[1] holder value, ARGV[2] how long the release is remembered (ms)
-- Removes a reader that still holds. The last one out deletes the lock key and wakes
-- the oldest waiting writer (else the waiting readers). Returns 1 (also when run again,
-- as RELEASE) or 0.
"""
    + _NOW
    + _HOLDERS
    + _GIVE_BACK
    + _WAKE
    + """
local now = now_ms()
local id = redis.sha1hex(ARGV[1])
local marked = redis.call('GET', KEYS[1]) == 'READERS_MARK'
local answer = give_back(KEYS[7], KEYS[8], KEYS[9], ARGV[1], id, now, tonumber(ARGV[2]), marked)
if answer then
  return answer
end
drop_expired(KEYS[7], KEYS[8], now)
if keep_until(KEYS[7], KEYS[8], now, KEYS[1]) then
  return 1  -- other readers still hold
end
redis.call('DEL', KEYS[1])
hand_on(KEYS[2], id, KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return 1
""".replace("READERS_MARK", READERS),
)

# -- semaphores -------------------------------------------------------------------------

ACQUIRE_PERMIT = Script(
    "acquire_permit",
    """
-- KEYS[1] permits (sorted set: holder value -> expiry ms), KEYS[2] the semaphore's fence
-- counter, KEYS[3] holders' fences (hash), KEYS[4] waiters' queue, KEYS[5] their expiry
-- times, KEYS[6] wake-up channel, KEYS[7] released permits' values
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] fence retention (ms), ARGV[4] limit,
-- ARGV[5] how long a refused caller keeps its place (ms; 0: it does not queue),
-- ARGV[6] its client's inbox
-- Expired permits are dropped first; then granted while fewer than ARGV[4] are held.
-- The same holder asking again (a retry after a lost reply) gets its grant back,
-- renewed, never shortened (see ACQUIRE). Returns the fence (> 0), or minus the ms until
-- the first permit expires.
"""
    + _NOW
    + _FENCE
    + _JOIN
    + _HOLDERS
    + _WAKE
    + """
local now = now_ms()
drop_expired(KEYS[1], KEYS[3], now)
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
if mine then
  local until_ = now + tonumber(ARGV[2])
  if tonumber(mine) < until_ then
    redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[1])
  end
  keep_until(KEYS[1], KEYS[3], now)
  leave(KEYS[4], KEYS[5], ARGV[1])
  return tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or 0)
end
local held = redis.call('ZCARD', KEYS[1])
local limit = tonumber(ARGV[4])
if held < limit then
  local fence = next_fence(KEYS[2], 0, ARGV[3])
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], string.format('%d', fence))
  redis.call('ZREM', KEYS[7], redis.sha1hex(ARGV[1]))  -- see ACQUIRE
  keep_until(KEYS[1], KEYS[3], now)
  leave(KEYS[4], KEYS[5], ARGV[1])
  if held + 1 < limit and redis.call('EXISTS', KEYS[4]) == 1 then
    -- Room for more: the next waiter need not wait for a release (several permits
    -- freed at once wake the same first waiter; this passes the wake-up on).
    wake_next(KEYS[6], 'more:' .. redis.sha1hex(ARGV[1]), KEYS[4], KEYS[5])
  end
  return fence
end
local stay = tonumber(ARGV[5])
if stay > 0 then
  join(KEYS[4], KEYS[5], ARGV[1], stay, ARGV[6])
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
return -math.max(tonumber(first) - now, 1)
""",
)

EXTEND_PERMIT = Script(
    "extend_permit",
    """
-- KEYS[1] permits, KEYS[2] the semaphore's fence counter, KEYS[3] holders' fences
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] fence retention (ms)
-- Renews a permit only while it is held and unexpired: never revived. Returns 1 or 0.
"""
    + _NOW
    + _HOLDERS
    + """
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
local now = now_ms()
if not mine or tonumber(mine) <= now then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
keep_until(KEYS[1], KEYS[3], now)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
""",
)

RELEASE_PERMIT = Script(
    "release_permit",
    """
-- KEYS[1] permits, KEYS[2] wake-up channel, KEYS[3] waiters' queue, KEYS[4] their
-- expiry times, KEYS[5] holders' fences, KEYS[6] released permits' values
-- ARGV[1] holder value, ARGV[2] how long the release is remembered (ms)
-- Gives back a permit that is still held and wakes the oldest live waiter (only it: one
-- permit came free). Returns 1 (also when run again, as RELEASE) or 0 (not held, or
-- expired).
"""
    + _NOW
    + _GIVE_BACK
    + _WAKE
    + """
local now = now_ms()
local id = redis.sha1hex(ARGV[1])
local answer = give_back(KEYS[1], KEYS[5], KEYS[6], ARGV[1], id, now, tonumber(ARGV[2]), true)
if answer then
  return answer
end
wake_next(KEYS[2], id, KEYS[3], KEYS[4])
return 1
""",
)
