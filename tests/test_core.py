"""Backoff, connect(), the memory tables, wake-up slots, and names as property tests."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynclock
from asynclock import Backoff
from asynclock._validate import MAX_NAME_BYTES
from asynclock._wakeup import WakeHub
from asynclock.backends import MemoryBackend
from asynclock.testing import ManualClock


class TestBackoff:
    def test_steps_grow_and_cap(self) -> None:
        """Steps double from initial and stop at maximum."""
        backoff = Backoff(initial=0.01, maximum=0.1, multiplier=2.0, jitter=False)
        assert [backoff.delay(i) for i in range(6)] == [0.01, 0.02, 0.04, 0.08, 0.1, 0.1]
        assert backoff.delay(10_000) == 0.1  # no overflow however long one waits

    def test_full_jitter_stays_below_the_step(self) -> None:
        """With jitter each delay is a uniform draw in [0, step)."""
        backoff = Backoff(initial=0.5, maximum=0.5)
        draws = [backoff.delay(3) for _ in range(2000)]
        assert all(0 <= d < 0.5 for d in draws)
        assert 0.2 < sum(draws) / len(draws) < 0.3  # mean of U(0, 0.5) is 0.25
        assert len(set(draws)) > 1900

    @pytest.mark.parametrize(
        ("options", "error"),
        [
            ({"initial": 0}, ValueError),
            ({"initial": -1}, ValueError),
            ({"initial": math.nan}, ValueError),
            ({"maximum": math.inf}, ValueError),
            ({"initial": 2.0, "maximum": 1.0}, ValueError),
            ({"multiplier": 0.5}, ValueError),
            ({"initial": "1"}, TypeError),
            ({"jitter": 1}, TypeError),
        ],
    )
    def test_bad_arguments(self, options: dict[str, object], error: type[Exception]) -> None:
        """Backoff rejects what it cannot use, naming the argument."""
        with pytest.raises(error):
            Backoff(**options)  # type: ignore[arg-type]


class TestConnect:
    async def test_memory_urls_share_a_table_by_name(self) -> None:
        """memory://NAME coordinators share locks; other names and MemoryBackend() do not."""
        async with (
            asynclock.connect("memory://shared-a") as a1,
            asynclock.connect("memory://shared-a") as a2,
            asynclock.connect("memory://shared-b") as b,
            asynclock.Coordinator(MemoryBackend()) as isolated,
            a1.lock("x"),
        ):
            assert await a2.is_locked("x")
            assert not await b.is_locked("x")
            assert not await isolated.is_locked("x")

    def test_memory_rejects_redis_options(self) -> None:
        """Options a backend does not take are a TypeError that lists the accepted ones."""
        with pytest.raises(TypeError, match="accepted"):
            asynclock.connect("memory://", prefix="x")

    async def test_closed_coordinator_refuses_work(self) -> None:
        """A closed coordinator raises on use; closing twice is fine."""
        coord = asynclock.connect("memory://closed")
        await coord.aclose()
        await coord.aclose()
        with pytest.raises(asynclock.CoordinatorClosed, match="closed") as raised:
            await coord.lock("x").acquire()
        assert isinstance(raised.value, asynclock.LockError)
        assert isinstance(raised.value, RuntimeError)  # as before, for callers catching it
        assert not isinstance(raised.value, asynclock.BackendError)  # shutdown, not outage
        with pytest.raises(asynclock.CoordinatorClosed):
            await coord.inspect("x")
        assert "closed" in repr(coord)

    async def test_aclose_ends_held_leases(self) -> None:
        """Leases still held when the coordinator closes are released and marked lost."""
        observer = asynclock.connect("memory://closing")
        coord = asynclock.connect("memory://closing")
        lease = await coord.lock("x").acquire()
        await coord.aclose()
        assert lease.lost
        assert not await observer.is_locked("x")
        await observer.aclose()

    def test_identity(self) -> None:
        """The default identity is host:pid:random; a given one is kept."""
        coord = asynclock.connect("memory://", identity="api-7")
        assert coord.identity == "api-7"
        default = asynclock.connect("memory://").identity
        assert default.count(":") == 2
        with pytest.raises(ValueError, match="identity"):
            asynclock.connect("memory://", identity="")

    def test_public_names(self) -> None:
        """The documented top-level names are exported and report the public module."""
        for name in (
            "connect",
            "Coordinator",
            "Lock",
            "Lease",
            "LockInfo",
            "Backoff",
            "LockError",
            "LockTimeout",
            "LockLost",
            "LeadershipLost",
            "LockNotOwned",
            "BackendError",
            "QuorumError",
            "CoordinatorClosed",
        ):
            assert name in asynclock.__all__
            assert getattr(asynclock, name).__module__ == "asynclock"
        assert issubclass(asynclock.LockTimeout, TimeoutError)
        assert issubclass(asynclock.LeadershipLost, asynclock.LockLost)
        assert issubclass(asynclock.QuorumError, asynclock.BackendError)
        assert issubclass(asynclock.CoordinatorClosed, asynclock.LockError)
        assert not issubclass(asynclock.CoordinatorClosed, asynclock.BackendError)


class TestEventLoops:
    @pytest.mark.parametrize("kind", ["memory", "redis", "postgres", "redlock"])
    def test_a_second_event_loop_is_refused_at_once(
        self, request: pytest.FixtureRequest, namespace: str, kind: str
    ) -> None:
        """A coordinator made outside any loop and used in one: a use from another event
        loop (a second asyncio.run(), a test client's own loop) fails at once with an
        error that says so, lease methods included. It waited forever (timeout=None) or
        blamed the server."""
        if kind == "memory":
            coord = asynclock.connect(f"memory://{namespace}")
        elif kind == "redis":
            coord = asynclock.connect(request.getfixturevalue("asynclock_redis_url"))
        elif kind == "postgres":
            dsn = request.getfixturevalue("asynclock_postgres_dsn")
            coord = asynclock.connect(dsn, namespace=namespace)
        else:
            urls = request.getfixturevalue("asynclock_redlock_urls")
            coord = asynclock.connect(urls, prefix=namespace, node_timeout=0.25)

        async def use() -> None:
            async with coord.lock(f"{namespace}-loops", ttl=10, timeout=None):
                pass

        async def look() -> None:
            await coord.inspect("x")

        calls: list[Callable[[], Awaitable[None]]] = [use, look, coord.aclose]

        first = asyncio.new_event_loop()
        try:
            first.run_until_complete(use())
            lease = first.run_until_complete(coord.lock(f"{namespace}-held", ttl=10).acquire())
            calls += [lease.extend, lease.release]
            for call in calls:
                with pytest.raises(RuntimeError, match="another event loop"):
                    asyncio.run(asyncio.wait_for(call(), 30))
            first.run_until_complete(use())  # still fine in its own loop
            first.run_until_complete(lease.release())
            first.run_until_complete(coord.aclose())
        finally:
            first.close()


class TestWakeHub:
    async def test_wake_one_oldest_first(self) -> None:
        """A notification wakes the oldest waiting slot only."""
        clock = ManualClock()
        hub = WakeHub()
        slots = [hub.register("k") for _ in range(3)]
        waits = [asyncio.create_task(s.wait(clock, None)) for s in slots]
        await clock.settle()
        hub.notify_one("k")
        await clock.settle()
        assert [w.done() for w in waits] == [True, False, False]
        for w in waits[1:]:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    async def test_wake_before_wait_is_kept(self) -> None:
        """A notification that lands before the wait is not lost."""
        hub = WakeHub()
        slot = hub.register("k")
        hub.notify_one("k")
        assert await slot.wait(ManualClock(), None) is True

    async def test_unused_wake_passes_on(self) -> None:
        """A woken slot that leaves without using its wake-up hands it to the next."""
        hub = WakeHub()
        first, second = hub.register("k"), hub.register("k")
        hub.notify_one("k")
        assert [first.woken, second.woken] == [True, False]
        hub.unregister(first)
        assert second.woken
        hub.unregister(second)
        assert hub.waiting() == 0

    async def test_timeout_on_the_clock(self) -> None:
        """wait() returns False when its moment passes on the given clock."""
        clock = ManualClock()
        slot = WakeHub().register("k")
        waiting = asyncio.create_task(slot.wait(clock, 5.0))
        await clock.advance(4.0)
        assert not waiting.done()
        await clock.advance(1.0)
        assert await waiting is False


names = st.text(min_size=1, max_size=200).filter(
    lambda s: (
        len(s.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
    )
)


class TestNames:
    @settings(max_examples=200, deadline=None)
    @given(name=names)
    async def test_any_valid_name_locks_and_inspects(self, name: str) -> None:
        """Every accepted name can be locked, inspected and released."""
        async with asynclock.Coordinator(MemoryBackend()) as coord:
            async with coord.lock(name) as lease:
                info = await coord.inspect(name)
                assert info is not None
                assert info.name == name
                assert info.fence == lease.fence
            assert not await coord.is_locked(name)


class TestWakeUpsAtTheDeadline:
    async def test_a_wake_up_at_the_deadline_goes_to_the_next_waiter(self) -> None:
        """A waiter woken by a release in the instant its deadline passes gives up; the
        wake-up it did not use goes to the next waiter, which gets the lock at once instead
        of after its backoff (a minute here)."""
        clock = ManualClock()
        async with asynclock.Coordinator(MemoryBackend(clock=clock)) as coord:
            # A semaphore of one: its release wakes one waiter (a lock's wakes every
            # waiting writer on this backend).
            holder = await coord.semaphore("x", 1, ttl=600).acquire()
            slow = Backoff(initial=60.0, maximum=60.0, jitter=False)
            first = asyncio.create_task(coord.semaphore("x", 1, ttl=600, timeout=1.0).acquire())
            await clock.settle()
            second = asyncio.create_task(coord.semaphore("x", 1, ttl=600, retry=slow).acquire())
            await clock.settle()
            clock.jump(1.0)  # the first waiter's deadline: its timer has fired ...
            await holder.release()  # ... and the release wakes it in the same instant
            await clock.settle()
            with pytest.raises(asynclock.LockTimeout):
                await first
            lease = await asyncio.wait_for(second, 5)
            assert lease.held
            await lease.release()
