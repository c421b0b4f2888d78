"""What a user's code looks like to ``mypy --strict`` (checked in CI, never run): the
decorators keep an ``async def`` a coroutine function, and what users hold has a public
type of ``asynclock``."""

from __future__ import annotations

import asyncio
from typing import assert_type

import asynclock

coord = asynclock.connect("memory://typing")


@coord.locked("user:{user_id}", ttl=10, timeout=2)
async def update(user_id: int) -> str:
    return f"user {user_id}"


@coord.singleton("report:{day}", ttl=60)
async def report(day: str) -> int:
    return len(day)


async def main() -> None:
    """Tasks made from decorated calls, and the public types of what a user holds."""
    updated = asyncio.create_task(update(1))
    assert_type(updated, asyncio.Task[str])
    reported = asyncio.create_task(report("monday"))
    assert_type(reported, asyncio.Task[int | None])

    assert_type(coord, asynclock.Coordinator)
    lock = coord.lock("invoice:42", ttl=30)
    assert_type(lock, asynclock.Lock)
    async with lock as lease:
        assert_type(lease, asynclock.Lease)
    rw = coord.rwlock("catalog")
    assert_type(rw, asynclock.ReadWriteLock)
    election = coord.election("scheduler")
    assert_type(election, asynclock.Election)
    leadership = election.leadership()
    assert_type(leadership, asynclock.Leadership)
    async with leadership as term:
        assert_type(term, asynclock.Term)
    assert_type(await coord.inspect("invoice:42"), asynclock.LockInfo | None)
    assert_type(coord.stats(), asynclock.CoordinatorStats)
