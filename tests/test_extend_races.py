"""Renewals and ``extend()`` racing on one lease: local validity never exceeds the server's.

The memory backend on a manual clock, behind a gate that holds each extend request until
the test lets it through, in the order the test chooses: the server (the memory table)
runs a request when its gate opens, and the reply may then be lost. Every interleaving
here is exact, not a timing.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest

import asynclock
from asynclock import BackendError, Lease
from asynclock.backends import Claim, MemoryBackend
from asynclock.testing import ManualClock


class _Request:
    """An extend request on its way: the server runs it when the test lets it through,
    whether or not its caller is still waiting for the reply."""

    def __init__(self, run: Callable[[], Awaitable[bool]], ttl: float) -> None:
        self.run = run
        self.ttl = ttl
        self.reply: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


class GatedMemory(MemoryBackend):
    """A memory backend whose extend requests wait at a gate while ``gated`` is set.

    :meth:`let_through` runs the oldest waiting request on the server and delivers its
    reply, or loses it (the caller gets ``BackendError``), as a connection reset would.
    """

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.gated = False
        self.in_flight: list[_Request] = []

    async def extend(self, claim: Claim, ttl: float) -> bool:
        run = functools.partial(super().extend, claim, ttl)
        if not self.gated:
            return await run()
        request = _Request(run, ttl)
        self.in_flight.append(request)
        return await request.reply

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        results: list[bool | None] = []
        for claim, ttl in items:
            try:
                results.append(await self.extend(claim, ttl))
            except BackendError:
                results.append(None)
        return results

    async def let_through(self, *, reply: bool = True) -> float:
        """Run the oldest waiting request on the server; return the TTL it asked for."""
        request = self.in_flight.pop(0)
        extended = await request.run()
        if not request.reply.done():  # its caller may have been cancelled meanwhile
            if reply:
                request.reply.set_result(extended)
            else:
                request.reply.set_exception(BackendError("connection reset: reply lost"))
        await ManualClock.settle()
        return request.ttl

    async def lose_reply_run_later(self) -> Callable[[], Awaitable[bool]]:
        """The oldest request's caller hears nothing (a reset) while the request itself
        is still on its way (held by a proxy, say): returns what runs it on the server."""
        request = self.in_flight.pop(0)
        request.reply.set_exception(BackendError("connection reset: reply lost"))
        await ManualClock.settle()
        return request.run

    async def refuse_next(self) -> None:
        """Fail the oldest waiting request before it reaches the server."""
        request = self.in_flight.pop(0)
        request.reply.set_exception(BackendError("connection refused: not sent"))
        await ManualClock.settle()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start=1000.0)


@pytest.fixture
async def backend(clock: ManualClock) -> GatedMemory:
    return GatedMemory(clock)


@pytest.fixture
async def coord(backend: GatedMemory) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.Coordinator(backend) as coord:
        yield coord


async def assert_not_beyond_the_server(coord: asynclock.Coordinator, lease: Lease) -> None:
    """Invariant 1: the lease's local validity ends no later than the server's expiry."""
    info = await coord.inspect(lease.name)
    assert info is not None, "the server no longer has the lease"
    assert lease.expires_in <= info.expires_in, (
        f"the lease believes {lease.expires_in:.3f}s, the server keeps {info.expires_in:.3f}s"
    )


class TestRenewalRacingExtend:
    async def test_a_renewal_never_overtakes_an_extend_in_flight(
        self, coord: asynclock.Coordinator, backend: GatedMemory, clock: ManualClock
    ) -> None:
        """extend(3.0) in flight when the watchdog's renewal (ttl 0.3) falls due: the old
        code sent the renewal behind it and then believed 3 s while the server kept 0.3 s."""
        lease = await coord.lock("race", ttl=0.3).acquire()
        backend.gated = True
        extending = asyncio.create_task(lease.extend(3.0))
        await ManualClock.settle()
        await clock.advance(0.1)  # the renewal falls due while extend(3.0) is in flight
        asked = [await backend.let_through()]
        while backend.in_flight:  # whatever was sent behind it runs after it, in order
            asked.append(await backend.let_through())
        await extending
        backend.gated = False
        await assert_not_beyond_the_server(coord, lease)
        assert lease.ttl == 3.0
        assert asked == [3.0]  # one request at a time per lease: no 0.3 s renewal behind it
        await clock.advance(2.0)  # renewed every second now, at its new ttl
        await assert_not_beyond_the_server(coord, lease)
        assert lease.held
        await lease.release()

    async def test_an_extend_waits_for_the_renewal_in_flight(
        self, coord: asynclock.Coordinator, backend: GatedMemory, clock: ManualClock
    ) -> None:
        """A renewal (ttl 3) in flight, then extend(0.5): the extend goes after the renewal
        has answered, and the lease believes what the last request asked for."""
        lease = await coord.lock("wait", ttl=3.0).acquire()
        backend.gated = True
        await clock.advance(1.0)  # the renewal is sent and held at the gate
        assert [request.ttl for request in backend.in_flight] == [3.0]
        extending = asyncio.create_task(lease.extend(0.5))
        await ManualClock.settle()
        assert [request.ttl for request in backend.in_flight] == [3.0], "sent behind a renewal"
        assert await backend.let_through() == 3.0
        assert await backend.let_through() == 0.5
        await extending
        backend.gated = False
        await assert_not_beyond_the_server(coord, lease)
        assert lease.expires_in <= 0.5
        await lease.release()

    @pytest.mark.parametrize("outcome", ["reply lost", "cancelled"])
    async def test_an_extend_of_unknown_outcome_never_overstates(
        self,
        coord: asynclock.Coordinator,
        backend: GatedMemory,
        clock: ManualClock,
        outcome: str,
    ) -> None:
        """extend(1.0) of a 30 s lease runs on the server but its caller never hears back
        (reply lost, or cancelled): the lease must assume the shorter expiry."""
        lease = await coord.lock("unknown", ttl=30.0).acquire()
        backend.gated = True
        extending = asyncio.create_task(lease.extend(1.0))
        await ManualClock.settle()
        if outcome == "reply lost":
            await backend.let_through(reply=False)
            with pytest.raises(BackendError):
                await extending
        else:
            extending.cancel()
            await ManualClock.settle()
            await backend.let_through()  # the request had left: the server runs it anyway
        backend.gated = False
        assert lease.held
        await assert_not_beyond_the_server(coord, lease)
        assert lease.expires_in <= 1.0
        await lease.release()

    @pytest.mark.parametrize(
        ("ttl", "late_ttl"), [(10.0, 0.8), (0.3, 0.3)], ids=["shorter", "same"]
    )
    async def test_a_request_that_lands_after_a_later_one_never_overstates(
        self,
        coord: asynclock.Coordinator,
        backend: GatedMemory,
        clock: ManualClock,
        ttl: float,
        late_ttl: float,
    ) -> None:
        """extend(late_ttl) loses its reply and reaches the server only after the next
        renewal was confirmed on another connection: the lease must never believe more
        than the server keeps, then or at any later renewal."""
        lease = await coord.lock("late", ttl=ttl).acquire()
        backend.gated = True
        extending = asyncio.create_task(lease.extend(late_ttl))
        await ManualClock.settle()
        run_late = await backend.lose_reply_run_later()
        with pytest.raises(BackendError):
            await extending
        await clock.advance(0.05)  # the watchdog retries: a renewal at the lease's ttl
        assert [request.ttl for request in backend.in_flight] == [ttl]
        await backend.let_through()
        await clock.advance(0.01)
        await run_late()  # the lost extend lands now, after the confirmed renewal
        await assert_not_beyond_the_server(coord, lease)
        backend.gated = False
        for _ in range(20):  # and at every renewal from now on
            await clock.advance(late_ttl / 4)
            assert lease.held
            await assert_not_beyond_the_server(coord, lease)
        await lease.release()

    async def test_a_failed_extend_leaves_the_lease_renewed(
        self, coord: asynclock.Coordinator, backend: GatedMemory, clock: ManualClock
    ) -> None:
        """An extend that failed before reaching the server does not stop the watchdog:
        the lease is renewed and outlives several TTLs."""
        lease = await coord.lock("renewed", ttl=0.6).acquire()
        backend.gated = True
        extending = asyncio.create_task(lease.extend(0.6))
        await ManualClock.settle()
        await backend.refuse_next()
        with pytest.raises(BackendError):
            await extending
        backend.gated = False
        for _ in range(10):
            await clock.advance(0.2)
            assert lease.held, "lost: the watchdog stopped renewing after the failed extend"
            await assert_not_beyond_the_server(coord, lease)
        await lease.release()
