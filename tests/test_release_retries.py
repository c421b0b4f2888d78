"""Requests sent again, and releases tried again: a stale copy of an acquire never
shortens a lease, a release run twice answers "released" twice (but never for a lease that
had expired), and a cancelled ``release()`` ends released, in the background or by a retry.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
from pytest_asynclock.proxy import FaultProxy
from redis.asyncio import Redis

import asynclock
from asynclock import LockNotOwned, LockTimeout
from asynclock.backends import RedisBackend
from asynclock.backends.redis import Call, Keys
from asynclock.backends.redis.scripts import RELEASED_CAP

from .conftest import MakeCoord, eventually, redis_backend

Kind = Literal["lock", "fair", "reader", "permit"]
KINDS: tuple[Kind, ...] = ("lock", "fair", "reader", "permit")


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
        return backend.calls.shared(keys, value, ttl, queue=None)
    if kind == "permit":
        return backend.calls.permit(keys, value, ttl, 1, queue=None)
    if kind == "fair":
        return backend.calls.fair(keys, value, ttl, queue=None)
    return backend.calls.acquire(keys, value, ttl)


def release_call(backend: RedisBackend, kind: Kind, keys: Keys, value: str) -> Call:
    """The release request of ``kind``, as the backend sends it (a fair lock's is a
    lock's)."""
    if kind == "reader":
        return backend.calls.release_shared(keys, value)
    if kind == "permit":
        return backend.calls.release_permit(keys, value)
    return backend.calls.release(keys, value)


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


class TestReleaseSentAgain:
    @pytest.mark.parametrize("kind", KINDS)
    async def test_a_release_run_twice_answers_released_twice(
        self, redis_coord: asynclock.Coordinator, kind: Kind
    ) -> None:
        """The same release run a second time (its first reply lost) answers 1 again, and
        the lease whose release it was then ends released, not lost."""
        coord = redis_coord
        backend = redis_backend(coord)
        lease = await lock_of(coord, kind, 10).acquire()
        call = release_call(backend, kind, backend.keys("n"), value_of(coord, lease))
        assert await backend.run(call) == 1
        assert await backend.run(call) == 1
        await lease.release()  # a third time, through the lease
        assert coord.stats().losses == 0
        assert not await coord.is_locked("n")

    @pytest.mark.parametrize("kind", KINDS)
    async def test_a_release_never_answers_released_for_an_expired_grant(
        self, redis_coord: asynclock.Coordinator, kind: Kind
    ) -> None:
        """A value released, granted again (a grant given back, then retried) and expired:
        its release answers 0, whatever its earlier release left behind; so does a value
        that expired without ever being released."""
        backend = redis_backend(redis_coord)
        keys = backend.keys("n")
        value = f"{secrets.token_hex(16)}:test"
        assert int(await backend.run(acquire_call(backend, kind, keys, value, 10))) > 0
        assert await backend.run(release_call(backend, kind, keys, value)) == 1
        assert int(await backend.run(acquire_call(backend, kind, keys, value, 0.05))) > 0
        await asyncio.sleep(0.1)  # expired
        assert await backend.run(release_call(backend, kind, keys, value)) == 0
        never = f"{secrets.token_hex(16)}:test"
        assert int(await backend.run(acquire_call(backend, kind, keys, never, 0.05))) > 0
        await asyncio.sleep(0.1)
        assert await backend.run(release_call(backend, kind, keys, never)) == 0

    async def test_released_values_are_bounded_in_time_and_number(
        self, redis_coord: asynclock.Coordinator, raw: Redis
    ) -> None:
        """A name remembers at most RELEASED_CAP released values (the oldest go first),
        each for its window only, in a key that expires with the last window."""
        backend = redis_backend(redis_coord)
        keys = backend.keys("n")
        values = [f"{secrets.token_hex(16)}:test" for _ in range(RELEASED_CAP + 3)]
        for value in values:
            assert int(await backend.run(acquire_call(backend, "lock", keys, value, 10))) > 0
            assert await backend.run(release_call(backend, "lock", keys, value)) == 1
            # Memories end in whole ms, and those that end in the same ms go in the order
            # of their SHA1s: one release per ms, so that the oldest end first.
            await asyncio.sleep(0.002)
        assert await raw.zcard(keys.released) == RELEASED_CAP
        assert 0 < await raw.pttl(keys.released) <= backend.calls.released_ms()
        assert await backend.run(release_call(backend, "lock", keys, values[0])) == 0
        assert await backend.run(release_call(backend, "lock", keys, values[-1])) == 1
        # A window of 50 ms: run again after it, the release answers 0.
        value = f"{secrets.token_hex(16)}:test"
        assert int(await backend.run(acquire_call(backend, "lock", keys, value, 10))) > 0
        script, numkeys, args = release_call(backend, "lock", keys, value)
        short: Call = (script, numkeys, (*args[:-1], 50))
        assert await backend.run(short) == 1
        await asyncio.sleep(0.1)
        assert await backend.run(short) == 0

    async def test_a_release_resent_after_a_dropped_connection_is_no_loss(
        self, asynclock_redis_url: str, namespace: str, raw: Redis
    ) -> None:
        """The connection closes after the release ran but before its reply came: the
        release is sent again on a new connection, and the block ends without LockLost
        (it raised "no longer held at release", with 9.8 s of validity left)."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            url = proxy.url_for(asynclock_redis_url)
            async with asynclock.connect(url, prefix=namespace) as coord:
                keys = redis_backend(coord).keys("n")

                async def cut_once_released() -> int:
                    """Once the release ran on the server, cut the line its reply (held
                    by the proxy's latency) is on; the connections made until then."""
                    while await raw.exists(keys.lock):  # noqa: ASYNC110 - the server's state
                        await asyncio.sleep(0.005)
                    made = proxy.stats.connections
                    proxy.reset()
                    return made

                async with coord.lock("n", ttl=10) as lease:
                    assert lease.expires_in > 9
                    proxy.set_latency(0.3)
                    cutter = asyncio.create_task(cut_once_released())
                made = await cutter
                assert proxy.stats.connections == made + 1  # sent again, on a new one
                stats = coord.stats()
                assert (stats.losses, stats.releases) == (0, 1)
                assert not await raw.exists(keys.lock)


class TestCancelledRelease:
    """A ``release()`` cancelled while its request is on its way, on every backend."""

    @staticmethod
    async def cancelled_release(lease: asynclock.Lease, steps: int) -> bool:
        """Start ``lease.release()``, let the loop run ``steps`` times, cancel it: True if
        the cancel landed (False: the release had finished already, as in memory)."""
        task = asyncio.create_task(lease.release())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        if task.cancelled():
            return True
        assert outcome is None
        return False

    @pytest.mark.parametrize("steps", [1, 2, 3])
    async def test_a_retried_release_succeeds(
        self, make_coord: MakeCoord, caplog: pytest.LogCaptureFixture, steps: int
    ) -> None:
        """Retried at once, the release returns (the lock was ours: the cancelled request
        or the background give-back released it); a second release after it is refused."""
        caplog.set_level(logging.WARNING, logger="asynclock")
        coord = make_coord()
        lease = await coord.lock("n", ttl=5).acquire()
        if await self.cancelled_release(lease, steps):
            await lease.release()
        assert not lease.held
        with pytest.raises(LockNotOwned):
            await lease.release()
        assert coord.stats().losses == 0
        assert not lease.lost
        assert not await coord.is_locked("n")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    @pytest.mark.parametrize("steps", [1, 2, 3])
    async def test_the_background_give_back_ends_it_released(
        self, make_coord: MakeCoord, caplog: pytest.LogCaptureFixture, steps: int
    ) -> None:
        """Not retried, the release finishes in the background and the lease ends
        released, not lost (it counted a loss and logged a WARNING); a release() after
        that returns."""
        caplog.set_level(logging.WARNING, logger="asynclock")
        coord = make_coord()
        lease = await coord.lock("n", ttl=5).acquire()
        cancelled = await self.cancelled_release(lease, steps)
        assert await eventually(lambda: not lease.held, 5.0)
        assert not lease.lost
        assert coord.stats().losses == 0
        if cancelled:
            await lease.release()  # the retry of the interrupted one
        assert not await coord.is_locked("n")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    async def test_a_retry_cancelled_too_still_ends_released(
        self, make_coord: MakeCoord, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A retried release cancelled as well keeps the first one's deadline: the lease
        ends released in the background (it was lost at once: its validity was spent)."""
        caplog.set_level(logging.WARNING, logger="asynclock")
        coord = make_coord()
        lease = await coord.lock("n", ttl=5).acquire()
        if await self.cancelled_release(lease, 1):
            await self.cancelled_release(lease, 1)
        assert await eventually(lambda: not lease.held, 5.0)
        assert not lease.lost
        assert coord.stats().losses == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    async def test_a_task_cancelled_while_leaving_async_with(
        self, make_coord: MakeCoord, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A task cancelled while its block's release is on its way ends cancelled, and
        the lease ends released in the background: no loss, no WARNING."""
        caplog.set_level(logging.WARNING, logger="asynclock")
        coord = make_coord()
        gate = asyncio.Event()

        async def body() -> None:
            async with coord.lock("n", ttl=5):
                await gate.wait()

        task = asyncio.create_task(body())
        assert await eventually(lambda: bool(coord.held))
        gate.set()
        await asyncio.sleep(0)  # the block ends: its release goes out
        task.cancel()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        assert task.cancelled() or outcome is None  # None: released already (memory)
        assert await eventually(lambda: not coord.held, 5.0)
        assert coord.stats().losses == 0
        assert not await coord.is_locked("n")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class TestReleaseRacingARenewal:
    @pytest.mark.parametrize("renewal", ["watchdog", "extend"])
    async def test_a_cancelled_release_with_a_renewal_on_its_way(
        self, asynclock_redis_url: str, namespace: str, renewal: str
    ) -> None:
        """A release cancelled while a renewal (the watchdog's, or extend()) is still on its
        way over a slow link: the renewal's answer leaves the lease to its release, which
        ends it released in the background, and release() tried again returns. The answer
        rescheduled the lease over the release's deadline, with no validity left: it was
        lost at once, and the retry raised LockNotOwned."""
        async with (
            FaultProxy.from_url(asynclock_redis_url) as proxy,
            asynclock.connect(proxy.url_for(asynclock_redis_url), prefix=namespace) as coord,
        ):
            lease = await coord.lock("racing", ttl=3.0).acquire()
            proxy.set_latency(0.1)  # every request takes about 0.2 s from now on
            extending: asyncio.Future[None] | None = None
            if renewal == "watchdog":
                assert await eventually(lambda: lease._renewing, 3.0)
            else:
                extending = asyncio.ensure_future(lease.extend())
                await asyncio.sleep(0.02)
            releasing = asyncio.ensure_future(lease.release())
            await asyncio.sleep(0.03)  # its request has left
            releasing.cancel()
            await asyncio.gather(releasing, return_exceptions=True)
            if extending is not None:
                with pytest.raises(LockNotOwned):  # released, or a release pending
                    await extending
            assert await eventually(lambda: not lease.held, 5.0)
            assert not lease.lost
            await lease.release()  # the retry of the interrupted one
            assert coord.stats().losses == 0
            proxy.heal()
            assert not await coord.is_locked("racing")
