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
    and ``async with`` raises LockLost; no round trip starts more than a few ms after the
    lease was marked lost (on Python 3.11 redis-py swallows most of the first
    deliveries: the body runs on for some ms; bounded at 1 s for a loaded machine)."""
    async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
        for _ in range(ROUNDS):
            tampered_at = 0.0
            with pytest.raises(LockLost) as caught:
                async with coord.lock("busy", ttl=TTL) as lease:
                    await raw.delete(f"{namespace}:{{busy}}")
                    tampered_at = time.monotonic()
                    lost_at: float | None = None
                    while True:
                        if lease.lost:
                            lost_at = lost_at or time.monotonic()
                            # Calls started after the loss: the cancel is sent again at
                            # most 5 ms apart, so the body cannot run on for long (a few
                            # ms; the bound is for a loaded machine: without redelivery
                            # the body would run on until the test's timeout).
                            assert time.monotonic() - lost_at < 1.0, "the body ran on"
                        await driver_call()
            # Noticed at the next renewal (TTL / 3), with room for a loaded machine.
            assert time.monotonic() - tampered_at < TTL / 3 + 1.0
            assert isinstance(caught.value.__cause__, asyncio.CancelledError)
            # Nothing of the cancel is left pending for the next await.
            await asyncio.sleep(0)
