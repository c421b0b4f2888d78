"""A grant racing a cancel is never lost: whatever the server granted is given back.

The memory backend on a manual clock, whose waiter's exit suspends (as a Redlock or Redis
waiter's unsubscribe does) at a gate the test holds while it cancels the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest

import asynclock
from asynclock._wakeup import WakeSlot
from asynclock.backends import MemoryBackend
from asynclock.testing import ManualClock


class SlowToLeave(MemoryBackend):
    """A waiter's exit waits at ``gate`` (an unsubscribe on its way) while ``hold`` is set."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.hold = False
        self.leaving = 0
        self.gate = asyncio.Event()

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return self._slow_waiter(name)

    @asynccontextmanager
    async def _slow_waiter(self, name: str) -> AsyncIterator[WakeSlot]:
        async with super().waiter(name) as slot:
            try:
                yield slot
            finally:
                if self.hold:
                    self.leaving += 1
                    await self.gate.wait()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start=1000.0)


@pytest.fixture
async def backend(clock: ManualClock) -> SlowToLeave:
    return SlowToLeave(clock)


@pytest.fixture
async def coord(backend: SlowToLeave) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.Coordinator(backend) as coord:
        yield coord


class TestGrantRacingACancel:
    async def test_a_grant_cancelled_while_leaving_the_wait_is_given_back(
        self, coord: asynclock.Coordinator, backend: SlowToLeave
    ) -> None:
        """The waiter is granted, then cancelled while its wait is being left: no Lease
        reaches it, so the grant must go back to the server at once (not at its TTL)."""
        holder = await coord.lock("job", ttl=30).acquire()
        waiting = asyncio.create_task(coord.lock("job", ttl=30).acquire())
        await ManualClock.settle()
        backend.hold = True
        await holder.release()  # wakes the waiter: its next attempt is granted
        await ManualClock.settle()
        assert backend.leaving == 1, "the waiter did not reach its exit"
        waiting.cancel()
        await ManualClock.settle()
        assert waiting.cancelled()
        assert coord.held == []
        assert not await coord.is_locked("job"), "the grant was kept until its TTL"
        async with coord.lock("job", ttl=30, timeout=0):
            pass


class Overtaken(MemoryBackend):
    """A backend whose acquire requests travel on other connections than its releases:
    an interrupted acquire still reaches the server ``late`` seconds later, after the
    give-back's release (redis-py's pooled connections: Sentinel, TLS, sync_replicas)."""

    late = 0.5  # after GiveBack.late: one look after that would miss it

    async def give_back(
        self, claim: asynclock.backends.Claim, interrupted: asynclock.backends.Interrupted
    ) -> asynclock.backends.GiveBack:
        answer = await super().give_back(claim, interrupted)
        if interrupted is asynclock.backends.Interrupted.ANSWERED:
            return answer
        return answer._replace(late=0.3)

    async def try_acquire(
        self, claim: asynclock.backends.Claim, ttl: float, *, wait: float | None = 0.0
    ) -> asynclock.backends.Attempt:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            loop = asyncio.get_running_loop()
            loop.call_later(self.late, lambda: loop.create_task(self._land(claim, ttl)))
            raise
        raise AssertionError("not reached")

    landed: float | None = None

    async def _land(self, claim: asynclock.backends.Claim, ttl: float) -> None:
        attempt = await MemoryBackend.try_acquire(self, claim, ttl)
        assert attempt.fence is not None
        self.landed = asyncio.get_running_loop().time()


async def test_an_interrupted_acquire_that_lands_after_its_give_back_is_released() -> None:
    """The give-back of a cancelled acquire finds nothing (the request is still on its
    way on another connection); it keeps looking and releases what landed, within a
    second of landing rather than after the TTL (30 s)."""
    backend = Overtaken()
    loop = asyncio.get_running_loop()
    async with asynclock.Coordinator(backend) as coord:
        task = asyncio.create_task(coord.lock("late", ttl=30).acquire())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.6)
        assert backend.landed is not None  # the straggler landed after the give-back
        while await coord.is_locked("late"):
            assert loop.time() - backend.landed < 1.0, "a landed straggler stayed held"
            await asyncio.sleep(0.01)


class SilentThenOvertaken(MemoryBackend):
    """The server answers no give-back for longer than the TTL; then the interrupted
    acquire, still on its way on another connection, lands."""

    silent_for = 2.5  # seconds after the cancel, beyond the TTL (2 s)
    lands_after = 2.8
    late = 1.5  # what the give-back answers once the server is back

    def __init__(self) -> None:
        super().__init__()
        self.cancelled_at = 0.0
        self.landed: float | None = None
        self.landing = asyncio.Event()

    async def try_acquire(
        self, claim: asynclock.backends.Claim, ttl: float, *, wait: float | None = 0.0
    ) -> asynclock.backends.Attempt:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.cancelled_at = loop.time()
            loop.call_later(self.lands_after, lambda: loop.create_task(self._land(claim, ttl)))
            raise
        raise AssertionError("not reached")

    async def _land(self, claim: asynclock.backends.Claim, ttl: float) -> None:
        attempt = await MemoryBackend.try_acquire(self, claim, ttl)
        assert attempt.fence is not None
        self.landed = asyncio.get_running_loop().time()
        self.landing.set()

    async def give_back(
        self, claim: asynclock.backends.Claim, interrupted: asynclock.backends.Interrupted
    ) -> asynclock.backends.GiveBack:
        if asyncio.get_running_loop().time() - self.cancelled_at < self.silent_for:
            raise asynclock.BackendError("no answer")
        answer = await super().give_back(claim, interrupted)
        return answer._replace(late=self.late)


async def test_a_late_grant_after_a_give_back_the_server_did_not_answer_is_released() -> None:
    """The give-back of a cancelled acquire gets no answer for longer than the TTL; when
    the server is back, the acquire lands after all: it is released within a second of
    landing, not left for its TTL."""
    backend = SilentThenOvertaken()
    loop = asyncio.get_running_loop()
    async with asynclock.Coordinator(backend) as coord:
        task = asyncio.create_task(coord.lock("silent", ttl=2.0).acquire())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await backend.landing.wait()
        assert backend.landed is not None
        while await coord.is_locked("silent"):
            assert loop.time() - backend.landed < 1.6, "a grant that landed late stayed held"
            await asyncio.sleep(0.01)


class SlowReplies(MemoryBackend):
    """The first ``slow`` grants reach the caller ``delay`` seconds after the server
    made them (a reply stuck behind a slow link)."""

    slow = 1
    delay = 0.25

    async def try_acquire(
        self, claim: asynclock.backends.Claim, ttl: float, *, wait: float | None = 0.0
    ) -> asynclock.backends.Attempt:
        attempt = await super().try_acquire(claim, ttl, wait=wait)
        if attempt.fence is not None and self.slow > 0:
            self.slow -= 1
            await asyncio.sleep(self.delay)
        return attempt


class TestLateGrant:
    async def test_a_grant_that_arrives_spent_is_given_back_and_tried_again(self) -> None:
        backend = SlowReplies()
        async with asynclock.Coordinator(backend) as coord:
            async with coord.lock("late", ttl=0.2, timeout=2) as lease:
                assert lease.expires_in > 0.1
                info = await coord.inspect("late")
                assert info is not None
                assert info.fence == lease.fence  # the second grant, not the spent one
            assert coord.stats().late_grants == 1

    async def test_a_spent_grant_with_timeout_zero_is_a_timeout(self) -> None:
        backend = SlowReplies()
        async with asynclock.Coordinator(backend) as coord:
            with pytest.raises(asynclock.LockTimeout):
                await coord.lock("late", ttl=0.2, timeout=0).acquire()
            assert not await coord.is_locked("late")  # given back at once, not at its TTL
            assert coord.stats().late_grants == 1

    @pytest.mark.parametrize("limit", [None, 5.0])
    async def test_a_late_grant_in_the_servers_queue_waits_there_again(
        self, limit: float | None
    ) -> None:
        """A backend that waits in the server's own queue (PostgreSQL) gets a late grant:
        it is given back and the acquire waits again (it raised TypeError for
        ``timeout=None`` and an early LockTimeout otherwise)."""
        backend = SlowReplies()
        backend.native_wait = True  # type: ignore[misc]
        async with asynclock.Coordinator(backend) as coord:
            lease = await coord.lock("late", ttl=0.2, timeout=limit).acquire()
            assert lease.expires_in > 0.1
            assert coord.stats().late_grants == 1
            await lease.release()

    async def test_giving_back_a_late_grant_keeps_to_the_deadline(self) -> None:
        """The give-back of a late grant is bounded by the caller's timeout: a server
        that stops answering right then does not hold the acquire past it."""

        class Unanswered(SlowReplies):
            async def release(self, claim: asynclock.backends.Claim) -> bool:
                await asyncio.sleep(30)
                raise AssertionError("not reached")

        async with asynclock.Coordinator(Unanswered()) as coord:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(asynclock.LockTimeout, match="did not confirm its release"):
                await coord.lock("late", ttl=0.2, timeout=1.0).acquire()
            assert loop.time() - start < 1.5

    async def test_a_grant_spent_while_leaving_the_wait_is_taken_again(self) -> None:
        """Leaving the wait (a Redlock unsubscribe waits up to node_timeout) took the
        grant's whole validity: it is given back and the acquire, which may wait forever,
        takes the lock again (it raised LockTimeout with ``timeout=None``)."""

        class SlowToLeaveAfterAGrant(MemoryBackend):
            def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
                inner = super().waiter(name)

                @asynccontextmanager
                async def slow() -> AsyncIterator[WakeSlot]:
                    async with inner as slot:
                        try:
                            yield slot
                        finally:
                            await asyncio.sleep(1.0)

                return slow()

        async with asynclock.Coordinator(SlowToLeaveAfterAGrant()) as coord:
            lock = coord.lock("x", ttl=1.0, timeout=None)
            holder = await lock.acquire()
            asyncio.get_running_loop().call_later(
                0.2, lambda: asyncio.ensure_future(holder.release())
            )
            lease = await lock.acquire()
            assert lease.expires_in > 0.5
            assert coord.stats().late_grants == 1
            await lease.release()
