"""Asking the server about a lease, and taking a lock the task already holds."""

from __future__ import annotations

import asyncio

import pytest

from asynclock.backends import Kind
from tests.conftest import MakeCoord


class TestOwned:
    async def test_owned_asks_the_server(self, make_coord: MakeCoord) -> None:
        """owned() is True while the server holds the lock for this lease, False once it
        expired and another holder took it, and False after release."""
        coord, other = make_coord(), make_coord()
        lease = await coord.lock("o", ttl=0.5, renew=False).acquire()
        assert await lease.owned()
        taken = await other.lock("o", ttl=30, timeout=5).acquire()  # after the expiry
        assert not await lease.owned()
        assert await taken.owned()
        await taken.release()
        assert not await taken.owned()


class TestReentry:
    async def test_taking_a_held_lock_again_in_the_same_task_raises(
        self, make_coord: MakeCoord
    ) -> None:
        """A task inside ``async with`` on a name that takes it again through another Lock
        gets a RuntimeError naming the re-entry at once, not a wait for its own lease."""
        coord = make_coord()
        async with coord.lock("r", ttl=30):
            with pytest.raises(RuntimeError, match="already held by this task"):
                async with coord.lock("r", ttl=30, timeout=None):
                    pass  # pragma: no cover - never entered
            with pytest.raises(RuntimeError, match="not reentrant"):
                await coord.lock("r", ttl=30, timeout=None).acquire()
        async with coord.lock("r", ttl=30, timeout=0):  # free again once left
            pass

    async def test_a_reader_taking_its_read_lock_again_raises(self, make_coord: MakeCoord) -> None:
        """A reader inside ``async with`` taking the same read lock again gets the
        re-entry error: behind a waiting writer it would wait for the writer, which waits
        for it."""
        coord = make_coord()
        if Kind.SHARED not in coord.backend.kinds:
            pytest.skip("no shared leases on this backend")
        rw = coord.rwlock("doc", ttl=30)
        async with rw.read():
            writer = asyncio.create_task(coord.rwlock("doc", ttl=30, timeout=5).write().acquire())
            await asyncio.sleep(0.05)  # the writer queues (the refusal needs no waiting)
            with pytest.raises(RuntimeError, match="already held by this task"):
                async with coord.rwlock("doc", ttl=30, timeout=1).read():
                    pass  # pragma: no cover - never entered
        lease = await asyncio.wait_for(writer, 10)
        await lease.release()
