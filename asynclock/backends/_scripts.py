"""The Lua scripts behind every Redis state change: one source for every Redis backend.

Each script is one atomic step. They are called by SHA1 (computed here, without I/O) and
loaded with ``SCRIPT LOAD`` only when the server answers ``NOSCRIPT``. Every key a script
touches shares the hash tag ``{name}``, so a lock, its fence counter and its wake-up channel
live in one Cluster slot.

Stored value of a lock key: ``<token>:<identity>``; the token is 128 random bits that only
its holder knows (compared, never returned), the identity is who holds it (returned by
``inspect``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = (
    "ACQUIRE",
    "DEQUEUE",
    "EXTEND",
    "EXTEND_MANY",
    "INSPECT",
    "RAISE_FENCE",
    "RELEASE",
    "Script",
    "sharded",
)


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


ACQUIRE = Script(
    "acquire",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key
-- KEYS[3] waiter queue, KEYS[4] waiters' expiry times (optional: a caller that waits)
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] how long the fence counter outlives use (ms)
-- ARGV[4] (optional) a floor for the fence: Redlock proposes one value to every node
-- ARGV[5], ARGV[6] (with KEYS[3..4]) how long a refused caller keeps its place in the
-- waiter queue (ms), and the suffix of the channel it listens on (its client's inbox)
-- Returns the new fence (> 0) when granted; otherwise minus the holder's remaining ms,
-- or 0 when that is unknown (a key without expiry, set by someone else).
local queued = #KEYS >= 4
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if queued then
    redis.call('ZREM', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
  end
  -- fence = max(last fence + 1, server time in microseconds, floor): strictly increasing
  -- while the counter lives, and still increasing after a restart that lost it (given
  -- the server's clock does not step back).
  local t = redis.call('TIME')
  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local floor = tonumber(ARGV[4] or 0)
  if fence < floor then
    fence = floor
  end
  local last = tonumber(redis.call('GET', KEYS[2]) or 0)
  if fence <= last then
    fence = last + 1
  end
  -- %d, not tostring: Lua 5.1 prints large numbers with 14 significant digits.
  redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', ARGV[3])
  return fence
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  -- Already ours: this is a retry of a request whose reply was lost. Same grant.
  if queued then
    redis.call('ZREM', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
  end
  return tonumber(redis.call('GET', KEYS[2]) or 0)
end
local pttl = redis.call('PTTL', KEYS[1])
if queued then
  -- Join the waiter queue (keeping one's place when already in it), until a deadline
  -- the caller renews with each attempt: a release wakes the oldest live waiter only.
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local stay = tonumber(ARGV[5])
  redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1])
  redis.call('HSET', KEYS[4], ARGV[1], string.format('%d', now + stay) .. ':' .. ARGV[6])
  for i = 3, 4 do
    if redis.call('PTTL', KEYS[i]) < stay then
      redis.call('PEXPIRE', KEYS[i], stay)
    end
  end
end
if pttl < 0 then
  return 0
end
return -pttl
""",
)

# Lua shared by RELEASE and DEQUEUE: the oldest waiter whose place has not expired and
# its client's inbox (dropping expired ones on the way, a bounded number per call).
_NEXT_WAITER = """
local function next_waiter(queue, due)
  local now = nil
  for _ = 1, 16 do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then
      return nil
    end
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    local until_, inbox = string.match(redis.call('HGET', due, head) or '', '^(%d+):(.*)$')
    if until_ and tonumber(until_) > now then
      return head, inbox
    end
    redis.call('ZREM', queue, head)
    redis.call('HDEL', due, head)
  end
  return nil
end

-- The wake-up: "<release id> <waiter>" on the channel of the oldest live waiter's client
-- (it alone hears it); with no waiter queued, "<release id>" on the lock's channel, which
-- wakes one waiter per listening client (Redlock's waiters, which do not queue).
local function wake(channel, id, queue, due)
  local target, inbox = next_waiter(queue, due)
  if target then
    redis.call('PUBLISH', channel .. ':' .. inbox, id .. ' ' .. target)
  else
    redis.call('PUBLISH', channel, id)
  end
end
"""

RELEASE = Script(
    "release",
    """
-- KEYS[1] lock key, KEYS[2] wake-up channel (declared so Cluster routes it with the lock)
-- KEYS[3] waiter queue, KEYS[4] waiters' expiry times
-- ARGV[1] holder value
-- Deletes the lock and wakes a waiter only if ARGV[1] still holds it. Returns 1 or 0.
-- The message names the release (a digest, not the token), so that Redlock waiters can
-- count the nodes one release reached, and the oldest live waiter in the queue, if any.
"""
    + _NEXT_WAITER
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  wake(KEYS[2], redis.sha1hex(ARGV[1]), KEYS[3], KEYS[4])
  return 1
end
return 0
""",
)

DEQUEUE = Script(
    "dequeue",
    """
-- KEYS[1] lock key, KEYS[2] wake-up channel, KEYS[3] waiter queue, KEYS[4] expiry times
-- ARGV[1] the value of a waiter that gave up (timed out, cancelled)
-- Leaves the queue; if the lock is free, the wake-up this waiter may have taken goes on
-- to the next one. Returns 1 if it was queued, else 0.
"""
    + _NEXT_WAITER
    + """
local was = redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if was == 1 and redis.call('EXISTS', KEYS[1]) == 0 then
  wake(KEYS[2], 'dequeue:' .. redis.sha1hex(ARGV[1]), KEYS[3], KEYS[4])
end
return was
""",
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
-- KEYS[1] lock key, KEYS[2] fence counter key
-- Returns nil when free, else {holder value, remaining ms (-1: no expiry), fence or ''}.
local value = redis.call('GET', KEYS[1])
if not value then
  return false
end
return {value, redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or ''}
""",
)
