"""A candidate process for the multi-process election tests.

    python -m tests._campaigner BACKEND_URL ELECTION IDENTITY TTL RESOURCE_REDIS_URL

Campaigns with ``election.run()``; while leading it writes its term to a fenced resource
(a Redis key that keeps the largest term and refuses smaller ones) every 20 ms. Prints
one line per event, with ``time.monotonic()`` (shared by all processes on Linux):
``lead TERM T``, ``write TERM OK T`` (OK is 1 accepted / 0 refused; T as it was sent),
``stop TERM T``.
"""

from __future__ import annotations

import asyncio
import sys
import time

from redis.asyncio import Redis

import asynclock

FENCED_WRITE = """
local current = tonumber(redis.call('GET', KEYS[1]) or 0)
if tonumber(ARGV[1]) >= current then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


def say(*words: object, at: float | None = None) -> None:
    print(*words, time.monotonic() if at is None else at, flush=True)


async def main(url: str, name: str, identity: str, ttl: float, resource_url: str) -> None:
    resource = Redis.from_url(resource_url)
    write = resource.register_script(FENCED_WRITE)
    async with asynclock.connect(url) as coord:
        election = coord.election(name, ttl=ttl, identity=identity)

        async def lead(term: asynclock.Term) -> None:
            say("lead", term.fence)
            try:
                while True:
                    sent = time.monotonic()  # a write is timed as it is decided
                    accepted = await write(keys=[f"resource:{name}"], args=[term.fence])
                    say("write", term.fence, int(accepted), at=sent)
                    await asyncio.sleep(0.02)
            finally:
                say("stop", term.fence)

        say("ready", 0)
        await election.run(lead)


if __name__ == "__main__":
    url, name, identity, ttl, resource_url = sys.argv[1:6]
    asyncio.run(main(url, name, identity, float(ttl), resource_url))
