"""A cancel landing in an election's announcements never leaves leadership behind.

The memory backend on a manual clock, with announcements (``publish``) held at a gate
while the test cancels the campaign or takes the lease away: every interleaving is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

import asynclock
from asynclock import LeadershipLost
from asynclock.backends import MemoryBackend
from asynclock.testing import ManualClock


class HeldAnnouncements(MemoryBackend):
    """Announcements wait at a gate while ``hold`` is set; ``held`` lists them."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.hold = False
        self.held: list[str] = []
        self.gate = asyncio.Event()

    async def publish(self, topic: str, message: str) -> None:
        if self.hold:
            self.held.append(message.split(" ", 1)[0])
            await self.gate.wait()
        await super().publish(topic, message)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start=1000.0)


@pytest.fixture
async def backend(clock: ManualClock) -> HeldAnnouncements:
    return HeldAnnouncements(clock)


@pytest.fixture
async def coord(backend: HeldAnnouncements) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.Coordinator(backend) as coord:
        yield coord


async def nothing_held(coord: asynclock.Coordinator) -> bool:
    return coord.held == [] and not await coord.is_locked("election:boss")


class TestCancelDuringAnnouncements:
    async def test_cancel_while_announcing_elected_gives_the_lease_back(
        self, coord: asynclock.Coordinator, backend: HeldAnnouncements
    ) -> None:
        """Cancelled between the grant and the caller getting its term (in "elected"):
        the lease is released, not renewed forever, and the task ends cancelled."""
        backend.hold = True
        election = coord.election("boss", ttl=5, identity="a")
        entered = []

        async def campaign() -> None:
            async with election.leadership():
                entered.append(True)

        task = asyncio.create_task(campaign())
        await ManualClock.settle()
        assert backend.held == ["elected"]
        task.cancel()
        await ManualClock.settle()
        assert task.cancelled()
        assert entered == []
        assert await nothing_held(coord)

    async def test_cancel_while_announcing_resigned_still_releases(
        self, coord: asynclock.Coordinator, backend: HeldAnnouncements
    ) -> None:
        """Cancelled while announcing "resigned" on the way out: released all the same."""
        election = coord.election("boss", ttl=5, identity="a")

        async def campaign() -> None:
            async with election.leadership():
                backend.hold = True

        task = asyncio.create_task(campaign())
        await ManualClock.settle()
        assert backend.held == ["resigned"]
        task.cancel()
        await ManualClock.settle()
        assert task.cancelled()
        assert await nothing_held(coord)

    async def test_a_loss_while_announcing_is_leadership_lost(
        self,
        coord: asynclock.Coordinator,
        backend: HeldAnnouncements,
        clock: ManualClock,
    ) -> None:
        """The lease lost while "elected" is on its way: LeadershipLost, and the loss's
        cancel is taken back (the task's cancel count is restored), no raw cancel."""
        backend.hold = True
        election = coord.election("boss", ttl=3, identity="a")
        outcome: list[object] = []

        async def campaign() -> None:
            try:
                async with election.leadership():
                    outcome.append("entered")
            except LeadershipLost:
                task = asyncio.current_task()
                assert task is not None
                outcome.append(("LeadershipLost", task.cancelling()))
                raise

        task = asyncio.create_task(campaign())
        await ManualClock.settle()
        assert backend.held == ["elected"]
        backend._table.holders.clear()  # the lease is gone behind the holder's back
        await clock.advance(1.1)  # the renewal is refused: lost
        assert task.done()
        assert outcome == [("LeadershipLost", 0)]
        assert isinstance(task.exception(), LeadershipLost)
        assert coord.held == []

    async def test_run_cancelled_in_its_announcement_leaves_nothing(
        self, coord: asynclock.Coordinator, backend: HeldAnnouncements
    ) -> None:
        """run() cancelled while its announcement is on its way stops leading at once."""
        backend.hold = True
        election = coord.election("boss", ttl=5, identity="a")

        async def callback(term: asynclock.Term) -> None:
            await asyncio.sleep(3600)

        task = asyncio.create_task(election.run(callback))
        await ManualClock.settle()
        task.cancel()
        await ManualClock.settle()
        assert task.cancelled()
        assert await nothing_held(coord)
