"""Requests sent again: a stale copy of an acquire never shortens a lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
from redis.asyncio import Redis

import asynclock
from asynclock import LockTimeout
from asynclock.backends import RedisBackend
from asynclock.backends.redis import Call, Keys

from .conftest import redis_backend

Kind = Literal["lock", "fair", "reader", "permit"]


@pytest.fixture
async def raw(asynclock_redis_url: str) -> AsyncIterator[Redis]:
    """A plain client on the shared server, to look behind the library's back."""
    client = Redis.from_url(asynclock_redis_url)
    yield client
    await client.aclose()


def value_of(coord: asynclock.Coordinator, lease: asynclock.Lease) -> str:
    """What the server stores for ``lease``: its token and its coordinator's identity."""
    return f"{lease.token}:{coord.identity}"


def acquire_call(backend: RedisBackend, kind: Kind, keys: Keys, value: str, ttl: float) -> Call:
    """The acquire request of ``kind`` (trying once), as the backend sends it."""
    if kind == "reader":
        return backend.shared_call(keys, value, ttl, queue=None)
    if kind == "permit":
        return backend.permit_call(keys, value, ttl, 1, queue=None)
    if kind == "fair":
        return backend.fair_call(keys, value, ttl, queue=None)
    return backend.acquire_call(keys, value, ttl)


def lock_of(coord: asynclock.Coordinator, kind: Kind, ttl: float, **options: Any) -> asynclock.Lock:
    """The lock (a read-write lock's reader, a semaphore of 1) of ``kind`` on "n"."""
    if kind == "reader":
        return coord.rwlock("n", ttl=ttl, **options).read()
    if kind == "permit":
        return coord.semaphore("n", 1, ttl=ttl, **options)
    return coord.lock("n", ttl=ttl, fair=kind == "fair", **options)


class TestStaleAcquireCopies:
    @pytest.mark.parametrize("kind", ["reader", "permit"])
    async def test_a_stale_acquire_never_shortens_an_extended_lease(
        self, redis_coord: asynclock.Coordinator, raw: Redis, kind: Kind
    ) -> None:
        """A copy of a reader's (a permit's) first acquire, landing after ``extend(30)``,
        keeps the 30 s on the server: a writer (a second permit) is still refused once the
        first ttl has passed."""
        coord = redis_coord
        backend = redis_backend(coord)
        keys = backend.keys("n")
        lease = await lock_of(coord, kind, 0.3, renew=False).acquire()
        await lease.extend(30)
        stale = acquire_call(backend, kind, keys, value_of(coord, lease), 0.3)
        assert int(await backend.run(stale)) == lease.fence  # the same grant, not shortened
        members = keys.readers if kind == "reader" else keys.permits
        until = await raw.zscore(members, value_of(coord, lease))
        assert until is not None
        (now_s, now_us) = await raw.time()
        assert until - (now_s * 1000 + now_us // 1000) > 25_000
        if kind == "reader":
            assert await raw.pttl(keys.lock) > 25_000
        await asyncio.sleep(0.4)  # past the first ttl
        other = coord.rwlock("n", timeout=0).write() if kind == "reader" else None
        with pytest.raises(LockTimeout):
            await (other or coord.semaphore("n", 1, timeout=0)).acquire()
        assert lease.held
        await lease.release()
