"""A lost lease stops a body that is busy with real driver calls.

The loss cancels the body; a driver may swallow that cancel: redis-py sends under
``asyncio.wait_for``, which on Python 3.11 returns the inner result when the cancel lands
as it finishes. The cancel is sent again until the body leaves the block (level-
triggered), so the body stops all the same. Run on each Python the package supports
(3.11, 3.12, 3.13) to see it hold there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest
from redis.asyncio import Redis

import asynclock
from asynclock import LockLost

TTL = 0.9
ROUNDS = 15
# Round trips a body may start once its lease is marked lost (seen: 1 or 2).
MOST_CALLS_AFTER_LOSS = 10


@pytest.fixture
async def raw(asynclock_redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(asynclock_redis_url)
    yield client
    await client.aclose()


@pytest.fixture(params=["redis-py", "asyncpg"])
async def driver_call(
    request: pytest.FixtureRequest, asynclock_redis_url: str, asynclock_postgres_dsn: str
) -> AsyncIterator[Callable[[], Awaitable[object]]]:
    """One round trip on a real driver, as a body would make them."""
    if request.param == "redis-py":
        client = Redis.from_url(asynclock_redis_url)
        yield client.ping
        await client.aclose()
    else:
        conn = await asyncpg.connect(asynclock_postgres_dsn)

        async def select() -> object:
            return await conn.fetchval("SELECT 1")

        yield select
        await conn.close()


async def test_a_lost_lease_stops_a_body_busy_with_driver_calls(
    raw: Redis,
    driver_call: Callable[[], Awaitable[object]],
    asynclock_redis_url: str,
    namespace: str,
) -> None:
    """The lock key is deleted behind the holder's back while its body makes round trip
    after round trip: each time, the body stops within a renewal period (plus slack)
    and ``async with`` raises LockLost, having started at most a few round trips after
    the lease was marked lost. (On Python 3.11 redis-py swallows a cancel that lands as
    a send finishes: with cancels sent a millisecond apart, a body ran hundreds of round
    trips after the loss, for up to a second under CPU load; they are now sent on every
    loop turn at first, and one lands while the body waits for a reply.)"""
    async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
        for _ in range(ROUNDS):
            tampered_at = 0.0
            calls_after_loss = 0
            with pytest.raises(LockLost) as caught:
                async with coord.lock("busy", ttl=TTL) as lease:
                    await raw.delete(f"{namespace}:{{busy}}")
                    tampered_at = time.monotonic()
                    while True:
                        if lease.lost:
                            # A count, not a time: it does not depend on the machine.
                            calls_after_loss += 1
                            assert calls_after_loss <= MOST_CALLS_AFTER_LOSS, "the body ran on"
                        await driver_call()
            # Noticed at the next renewal (TTL / 3), with room for a loaded machine.
            assert time.monotonic() - tampered_at < TTL / 3 + 1.0
            assert isinstance(caught.value.__cause__, asyncio.CancelledError)
            # Nothing of the cancel is left pending for the next await.
            await asyncio.sleep(0)
