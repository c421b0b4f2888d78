"""A lease the application drops while it is held: warned about, and its lock given back.

The coordinator references its leases weakly, so a lease from ``acquire()`` that nothing
references any more is collected: its lock is released in the background (it is not
renewed until ``aclose()``), and a ``ResourceWarning`` names it, as asyncio does for a
transport that was never closed.
"""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

import asynclock
from tests.conftest import MakeCoord


def _collect() -> None:
    gc.collect()


def _drop(leases: list[asynclock.Lease]) -> None:
    """Drop the only references to ``leases`` and collect."""
    leases.clear()
    gc.collect()


class TestDroppedLease:
    async def test_a_dropped_lease_warns_and_gives_its_lock_back(
        self, make_coord: MakeCoord
    ) -> None:
        """Dropped while held: a ResourceWarning naming the lock, the lease leaves
        ``coord.held`` and the stats, and another holder gets the lock long before the
        TTL (30 s) would have freed it, with a greater fence."""
        coord, other = make_coord(), make_coord()
        leases = [await coord.lock("dropped", ttl=30).acquire()]
        fence = leases[0].fence
        with pytest.warns(ResourceWarning, match="'dropped' was dropped while held"):
            _drop(leases)
        taken = await other.lock("dropped", ttl=30, timeout=10).acquire()
        assert taken.fence > fence
        assert coord.held == []
        assert coord.stats().held == 0
        assert coord.stats().releases == 1
        await taken.release()

    async def test_a_dropped_lease_is_not_renewed(self, make_coord: MakeCoord) -> None:
        """Nothing keeps a dropped lease alive: not the coordinator's list, not the
        watchdog's schedule. (The old behaviour renewed it until ``aclose()``.)"""
        coord = make_coord()
        leases = [await coord.lock("unrenewed", ttl=3).acquire()]
        with pytest.warns(ResourceWarning):
            _drop(leases)
        renewals = coord.stats().renewals
        # Two renewal periods (ttl/3 each) pass: a lease still scheduled would be renewed.
        await asyncio.sleep(2.5)
        assert coord.stats().renewals == renewals
        assert not await coord.is_locked("unrenewed")

    async def test_leases_that_ended_warn_nothing(self, make_coord: MakeCoord) -> None:
        """Released, lost (the coordinator closed) or still referenced: no warning."""
        coord = make_coord()
        released = await coord.lock("ended-a", ttl=30).acquire()
        await released.release()
        kept = await coord.lock("ended-b", ttl=30).acquire()
        closing = make_coord()
        lost = await closing.lock("ended-c", ttl=30).acquire()
        await closing.aclose()
        assert lost.lost
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            del released, lost
            _collect()
        assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []
        assert coord.held == [kept]
        await kept.release()

    async def test_a_lease_inside_async_with_is_never_collected(
        self, make_coord: MakeCoord
    ) -> None:
        """The block holds its lease even when the body keeps no name for it."""
        coord = make_coord()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            async with coord.lock("block", ttl=30):
                _collect()
                assert len(coord.held) == 1
        assert seen == []
        assert coord.held == []

    async def test_a_lease_kept_alive_by_its_warning_is_over(self, make_coord: MakeCoord) -> None:
        """A recorded warning keeps its source (the lease) alive: that lease is released,
        with no validity left, never renewed, and counted once (released, not lost)."""
        coord, other = make_coord(), make_coord()
        leases = [await coord.lock("revived", ttl=1.5).acquire()]
        fence = leases[0].fence
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _drop(leases)
        (warned,) = [w for w in seen if issubclass(w.category, ResourceWarning)]
        revived = warned.source
        assert isinstance(revived, asynclock.Lease)
        assert not revived.held
        assert revived.expires_in == 0
        taken = await other.lock("revived", ttl=30, timeout=10).acquire()
        assert taken.fence > fence
        await asyncio.sleep(1.2)  # two renewal periods of the revived lease's TTL
        stats = coord.stats()
        assert (stats.held, stats.releases, stats.losses) == (0, 1, 0)
        assert len(coord._engine.watchdog) == 0
        await taken.release()

    async def test_a_lease_dropped_just_before_aclose_is_given_back(
        self, make_coord: MakeCoord
    ) -> None:
        """Dropped, then the coordinator closed at once (before the give-back ran): the
        close gives the lock back as it does for the leases it still holds."""
        coord, other = make_coord(), make_coord()
        leases = [await coord.lock("closing", ttl=30).acquire()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            _drop(leases)
        await coord.aclose()
        taken = await other.lock("closing", ttl=30, timeout=10).acquire()
        assert coord.stats().releases == 1
        await taken.release()
