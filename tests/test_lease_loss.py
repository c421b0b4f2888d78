"""How a lost lease reaches the code it protected: cancellation, LockLost, uncancel.

These run on the memory backend with a manual clock, so time moves only when the test
says and every interleaving is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

import asynclock
from asynclock import LockLost, LockNotOwned
from asynclock.backends import MemoryBackend
from asynclock.testing import ManualClock

from ._deadline import ends


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start=1000.0)


@pytest.fixture
async def backend(clock: ManualClock) -> MemoryBackend:
    return MemoryBackend(clock=clock)


@pytest.fixture
async def coord(backend: MemoryBackend) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.Coordinator(backend) as coord:
        yield coord


async def start_holder(
    coord: asynclock.Coordinator, name: str = "job", **options: object
) -> tuple[asyncio.Task[None], asyncio.Event, list[str]]:
    """A task that holds ``name`` and sleeps in its body; records how the body ended."""
    entered = asyncio.Event()
    log: list[str] = []

    async def body() -> None:
        try:
            async with coord.lock(name, **options) as lease:  # type: ignore[arg-type]
                log.append(f"fence={lease.fence}")
                entered.set()
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    log.append("body cancelled")
                    raise
        except LockLost:
            log.append("LockLost")
            raise

    task = asyncio.create_task(body())
    await entered.wait()
    return task, entered, log


class TestLossCancelsTheBody:
    async def test_refused_renewal_cancels_and_raises_lock_lost(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """A lock deleted behind the holder's back: the next renewal is refused, the body
        is cancelled and ``async with`` raises LockLost chained from CancelledError."""
        task, _, log = await start_holder(coord, ttl=9.0)
        assert backend.drop("job")
        await clock.advance(3.0)  # the renewal at ttl/3 finds the lock gone
        with pytest.raises(LockLost) as caught:
            await ends(task, "no renewal at ttl/3 was refused, or its loss did not stop the body")
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)
        assert "refused" in str(caught.value)
        assert log[1:] == ["body cancelled", "LockLost"]
        assert coord.held == []

    async def test_validity_running_out_cancels(
        self, coord: asynclock.Coordinator, clock: ManualClock
    ) -> None:
        """If no renewal could be confirmed, the body is cancelled when validity ends,
        before the server's TTL: ttl - drift after the acquire request."""
        task, _, log = await start_holder(coord, ttl=10.0)
        # Jump without letting the renewal task run: as if every renewal hung.
        clock.jump(10.0 - 0.1 - 0.002 + 1e-6)
        with pytest.raises(LockLost, match="validity"):
            await ends(task, "the end of local validity did not stop the body")
        assert log[1:] == ["body cancelled", "LockLost"]

    async def test_renewal_keeps_the_lease(
        self, coord: asynclock.Coordinator, clock: ManualClock
    ) -> None:
        """A renewed lease stays held through many TTLs."""
        lease = await coord.lock("long", ttl=3.0).acquire()
        for _ in range(20):
            await clock.advance(1.0)
        assert lease.held
        assert not lease.lost
        assert 1.5 < lease.expires_in <= 3.0
        await lease.release()

    async def test_renew_false_loses_at_ttl(
        self, coord: asynclock.Coordinator, clock: ManualClock
    ) -> None:
        """Without renewal the lease ends at its TTL, and so does the body."""
        task, _, _ = await start_holder(coord, ttl=5.0, renew=False)
        await clock.advance(4.9)
        assert not task.done()
        await clock.advance(0.1)
        with pytest.raises(LockLost):
            await ends(task, "the end of an unrenewed lease did not stop the body")


class TestOutsideCancel:
    async def test_outside_cancel_propagates_as_cancelled_error(
        self, coord: asynclock.Coordinator
    ) -> None:
        """A cancel from elsewhere is a CancelledError, not LockLost, and frees the lock."""
        task, _, log = await start_holder(coord)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log[1:] == ["body cancelled"]
        assert not await coord.is_locked("job")

    async def test_outside_cancel_and_loss_together_outside_wins(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """When the loss and an outside cancel land together, CancelledError propagates."""
        task, _, _ = await start_holder(coord, ttl=3.0)
        backend.drop("job")
        task.cancel()  # outside, first
        clock.jump(0.0)
        await clock.advance(1.0)  # renewal refused while the task is being cancelled
        with pytest.raises(asyncio.CancelledError):
            await task

    async def test_cancel_counts_are_restored(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """After LockLost is caught, the task's cancelling() count is what it was."""
        counts: list[int] = []

        async def body() -> None:
            try:
                async with coord.lock("job", ttl=3.0):
                    backend.drop("job")
                    await asyncio.sleep(3600)
            except LockLost:
                task = asyncio.current_task()
                assert task is not None
                counts.append(task.cancelling())
                await asyncio.sleep(0)  # no leftover cancel fires here
                counts.append(-1)

        task = asyncio.create_task(body())
        await clock.settle()
        await clock.advance(1.0)
        await ends(task, "no renewal at ttl/3 was refused, or its loss did not stop the body")
        assert counts == [0, -1]


class TestLossRacingTheEndOfTheBody:
    async def test_loss_noticed_inside_the_task_does_not_leak_a_cancel(
        self, coord: asynclock.Coordinator, clock: ManualClock
    ) -> None:
        """Loss detected in the holder's own task just as the body ends: the pending
        cancel is absorbed (3.11/3.12 uncancel() leaves it), LockLost is raised, and the
        caller's next await is not cancelled."""
        after: list[str] = []

        async def body() -> None:
            try:
                async with coord.lock("job", ttl=3.0, renew=False):
                    # No await: the validity timer fires inside this task, which then
                    # leaves the body with a cancel pending.
                    clock.jump(3.0)
            except LockLost:
                after.append("LockLost")
            await asyncio.sleep(0)
            after.append("next await ran")

        await asyncio.create_task(body())
        assert after == ["LockLost", "next await ran"]

    async def test_refused_extend_inside_the_body(
        self, coord: asynclock.Coordinator, backend: MemoryBackend
    ) -> None:
        """extend() refused inside the body raises LockNotOwned; leaving raises LockLost."""
        seen: list[str] = []

        async def body() -> None:
            async with coord.lock("job", ttl=3.0) as lease:
                backend.drop("job")
                try:
                    await lease.extend()
                except LockNotOwned:
                    seen.append("LockNotOwned")
                    raise

        with pytest.raises(LockLost) as caught:
            await asyncio.create_task(body())
        assert seen == ["LockNotOwned"]
        assert isinstance(caught.value.__cause__, LockNotOwned)

    async def test_body_that_swallows_the_cancel_still_gets_lock_lost(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """A body that catches the CancelledError and returns still raises LockLost on exit."""

        async def body() -> str:
            async with coord.lock("job", ttl=3.0):
                backend.drop("job")
                with contextlib.suppress(asyncio.CancelledError):  # bad practice, but it happens
                    await asyncio.sleep(3600)
            return "returned"

        task = asyncio.create_task(body())
        await clock.settle()
        await clock.advance(1.0)
        with pytest.raises(LockLost):
            await ends(task, "no renewal at ttl/3 was refused, or its loss did not stop the body")

    async def test_a_swallowed_cancel_is_sent_again_until_the_body_leaves(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """The loss's cancel swallowed once (as Python 3.11's wait_for does when the call
        it waits for finishes as the cancel arrives): the body must not run on
        unprotected; it is cancelled again at its next await, and LockLost follows."""
        steps: list[str] = []

        async def body() -> None:
            async with coord.lock("job", ttl=3.0):
                backend.drop("job")
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)  # the first cancel lands here, swallowed
                steps.append("went on")
                await asyncio.sleep(3600)  # must be cancelled again
                steps.append("ran unprotected")

        task = asyncio.create_task(body())
        await clock.settle()
        await clock.advance(1.0)  # the renewal is refused: lost
        with pytest.raises(LockLost):
            await ends(task, "the loss's cancel was not sent again after the body swallowed it")
        assert steps == ["went on"]
        current = asyncio.current_task()
        assert current is not None
        assert current.cancelling() == 0


class TestWithoutCancellation:
    async def test_cancel_on_lost_false_runs_on(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """cancel_on_lost=False: the body runs on, lease.lost turns true, exit raises."""
        progress: list[bool] = []

        async def body() -> None:
            async with coord.lock("job", ttl=3.0, cancel_on_lost=False) as lease:
                backend.drop("job")
                for _ in range(3):
                    await clock.advance(1.0)
                    progress.append(lease.lost)

        with pytest.raises(LockLost):
            await asyncio.create_task(body())
        assert progress == [True, True, True]

    async def test_acquire_outside_async_with_is_marked_not_cancelled(
        self, coord: asynclock.Coordinator, backend: MemoryBackend, clock: ManualClock
    ) -> None:
        """A lease from acquire() turns lost but cancels nobody."""
        lease = await coord.lock("job", ttl=3.0).acquire()
        backend.drop("job")
        await clock.advance(1.0)
        assert lease.lost
        assert lease.expires_in == 0.0
        with pytest.raises(LockNotOwned):
            await lease.release()


class TestMemoryBackendOnAManualClock:
    async def test_waiter_takes_over_at_expiry(
        self, coord: asynclock.Coordinator, clock: ManualClock
    ) -> None:
        """A waiter sleeps until the holder's TTL ends, then takes the lock."""
        gone = await coord.lock("job", ttl=30.0, renew=False).acquire()
        waiter = asyncio.create_task(
            coord.lock("job", ttl=30.0, retry=asynclock.Backoff(60.0, 60.0)).acquire()
        )
        await clock.advance(29.0)
        assert not waiter.done()
        await clock.advance(1.5)
        lease = await waiter
        assert lease.fence > gone.fence
        assert gone.lost
        await lease.release()

    async def test_shared_leases(self, coord: asynclock.Coordinator) -> None:
        """Shared leases overlap; an exclusive one waits for all of them."""
        r1 = await coord.lock("rw", shared=True).acquire()
        r2 = await coord.lock("rw", shared=True, timeout=0).acquire()
        with pytest.raises(asynclock.LockTimeout):
            await coord.lock("rw", timeout=0).acquire()
        await r1.release()
        await r2.release()
        writer = await coord.lock("rw", timeout=0).acquire()
        with pytest.raises(asynclock.LockTimeout):
            await coord.lock("rw", shared=True, timeout=0).acquire()
        await writer.release()

    async def test_repr_shows_state(self, coord: asynclock.Coordinator) -> None:
        """Reprs show name, fence and remaining validity, then the final state."""
        lease = await coord.lock("job", ttl=30.0).acquire()
        assert repr(lease) == f"<Lease 'job' fence={lease.fence} expires_in=29.7s>"
        await lease.release()
        assert repr(lease) == f"<Lease 'job' fence={lease.fence} released>"
        assert "MemoryBackend" in repr(coord)
