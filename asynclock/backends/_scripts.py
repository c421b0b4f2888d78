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

__all__ = ("ACQUIRE", "EXTEND", "EXTEND_MANY", "INSPECT", "RAISE_FENCE", "RELEASE", "Script")


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua source and its SHA1, for ``EVALSHA``."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())  # noqa: S324 - Redis names scripts by SHA1


ACQUIRE = Script(
    "acquire",
    """
-- KEYS[1] lock key, KEYS[2] fence counter key
-- ARGV[1] holder value, ARGV[2] ttl in ms, ARGV[3] how long the fence counter outlives use (ms)
-- ARGV[4] (optional) a floor for the fence: Redlock proposes one value to every node
-- Returns the new fence (> 0) when granted; otherwise minus the holder's remaining ms,
-- or 0 when that is unknown (a key without expiry, set by someone else).
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
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
  return tonumber(redis.call('GET', KEYS[2]) or 0)
end
local pttl = redis.call('PTTL', KEYS[1])
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
-- ARGV[1] holder value
-- Deletes the lock and wakes waiters only if ARGV[1] still holds it. Returns 1 or 0.
-- The message names the release (a digest, not the token), so that Redlock waiters can
-- count the nodes one release reached.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[2], redis.sha1hex(ARGV[1]))
  return 1
end
return 0
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
