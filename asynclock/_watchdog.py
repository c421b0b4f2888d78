"""One renewal scheduler per coordinator, for all of its held leases.

A heap orders leases by the time of their next action: a renewal (every ``ttl/3``), a
retry after a failed renewal, or the end of local validity. A single timer on the clock
fires at the earliest entry; leases due within a short window are renewed together with
one ``extend_many`` call (one request per node), in one task per batch, so ten thousand
held leases cost one timer and a few short tasks, not ten thousand tasks.

A renewal refused by the server loses the lease at once. A renewal that fails (network,
timeout) is retried with the lease's backoff until its local validity ends; the validity
deadline is itself a heap entry, so a renewal that hangs on a frozen server cannot keep
a lease alive past it.

The heap references leases weakly: a lease the application dropped without releasing it
is not kept alive (and renewed) by its schedule (see ``Lease.__del__``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._clock import Timer
from ._stats import Recorder
from .backends.base import Backend

if TYPE_CHECKING:
    from ._lock import Lease

__all__ = ("Watchdog",)

logger = logging.getLogger("asynclock")

# Renewals due within this window of the earliest one go out in the same batch.
_COALESCE = 0.02
# Rebuild the heap when it holds this many times more entries than live leases.
_COMPACT_FACTOR = 3
_COMPACT_MIN = 1024


class Watchdog:
    """Schedules renewals and validity deadlines for a coordinator's leases.

    Each watched lease has exactly one current heap entry, identified by ``lease._seq``;
    older entries of the lease, and entries of a lease that was collected, are stale and
    skipped when popped.
    """

    def __init__(self, backend: Backend, spawn: Callable[..., None], recorder: Recorder) -> None:
        self._backend = backend
        self._recorder = recorder
        self._clock = backend.clock
        self._spawn = spawn
        self._heap: list[tuple[float, int, weakref.ref[Lease]]] = []
        self._seq = itertools.count()
        self._timer: Timer | None = None
        self._timer_at = float("inf")
        self._live = 0
        self._firing = False
        self._closed = False
        self.renewals = 0
        self.batches = 0

    def __len__(self) -> int:
        """Leases being watched."""
        return self._live

    def watch(self, lease: Lease, start: float) -> None:
        """Start watching a lease granted to a request sent at ``start``."""
        self._live += 1
        if lease._renew:
            self._push(lease, start + lease._interval)
        else:
            self._push(lease, lease._valid_until)

    def reschedule(self, lease: Lease, when: float) -> None:
        """Replace the lease's next action (after a manual extend)."""
        self._push(lease, when if lease._renew else lease._valid_until)

    def expire_at(self, lease: Lease, when: float) -> None:
        """Replace the lease's next action by its loss at ``when`` (a release pending)."""
        self._push(lease, when)

    def forget(self, lease: Lease) -> None:
        """The lease left the HELD state: drop it from the schedule."""
        if lease._seq < 0:
            return
        lease._seq = -1
        self.dropped()

    def dropped(self) -> None:
        """A watched lease left the schedule (released, lost, or collected)."""
        self._live -= 1
        heap = self._heap
        if not self._firing and len(heap) > max(_COMPACT_MIN, _COMPACT_FACTOR * self._live):
            # Released leases leave entries behind; drop them before they pile up.
            heap[:] = [entry for entry in heap if _current(entry) is not None]
            heapq.heapify(heap)

    def close(self) -> None:
        """Stop the timer for good; leases still held are the coordinator's to end."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")

    # -- the schedule ----------------------------------------------------------------

    def _push(self, lease: Lease, when: float) -> None:
        seq = lease._seq = next(self._seq)
        heapq.heappush(self._heap, (when, seq, weakref.ref(lease)))
        if when < self._timer_at:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._closed:
            return  # nothing is renewed after close(), whatever is pushed
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._clock.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = self._clock.now()
        heap = self._heap
        batch: list[Lease] = []
        deferred: list[Lease] = []
        self._firing = True
        try:
            while heap and heap[0][0] <= now + _COALESCE:
                lease = _current(heapq.heappop(heap))
                if lease is None:
                    continue  # stale
                if now >= lease._valid_until:
                    lease._lose("not renewed before its local validity ran out")
                elif lease._renew and not lease._renewing:
                    batch.append(lease)
                else:
                    deferred.append(lease)  # not renewing now: its next action is its deadline
        finally:
            self._firing = False
        for lease in deferred:
            self._push(lease, lease._valid_until)
        if batch:
            self._send(batch, now)
        if heap and heap[0][0] < self._timer_at:
            self._arm(heap[0][0])

    def _send(self, batch: list[Lease], now: float) -> None:
        for lease in batch:
            lease._begin_request()
            # If the renewal hangs, the lease is lost at the end of its validity.
            self._push(lease, lease._valid_until)
        self.batches += 1
        last = max(lease._valid_until for lease in batch)
        # Each renewal asks for the TTL the lease has now; its reply is read against that
        # TTL, not against whatever the lease's ttl is when the reply comes.
        ttls = [lease.ttl for lease in batch]
        self._spawn(self._renew(batch, ttls, now, last - now), name="asynclock-renew")

    async def _renew(
        self, batch: list[Lease], ttls: list[float], start: float, bound: float
    ) -> None:
        backend = self._backend
        results: list[bool | None]
        sent = time.perf_counter()
        try:
            async with asyncio.timeout(max(bound, 0.0)):
                items = [(lease._claim, ttl) for lease, ttl in zip(batch, ttls, strict=True)]
                results = await backend.extend_many(items)
        except TimeoutError:
            results = [None] * len(batch)
        except Exception:
            logger.exception("renewal of %d leases failed unexpectedly", len(batch))
            results = [None] * len(batch)
        except BaseException:
            # Cancelled (the coordinator is closing): each request's outcome is unknown.
            for lease, ttl in zip(batch, ttls, strict=True):
                lease._end_request()
                if lease._seq >= 0:
                    lease._assume(start, ttl)
            raise
        self._recorder.renewed(
            sum(r is True for r in results),
            sum(r is False for r in results),
            sum(r is None for r in results),
            time.perf_counter() - sent,
        )
        now = self._clock.now()
        for lease, ttl, extended in zip(batch, ttls, results, strict=True):
            lease._end_request()
            if lease._seq < 0:
                continue  # released or lost meanwhile
            if lease._releasing:
                # A release went out after this renewal and has no answer yet: the server
                # ran the two in some order, and the release's own clean-up (or the loss
                # at the lease's old deadline, scheduled then) decides how it ends.
                continue
            if extended:
                self.renewals += 1
                lease._failures = 0
                lease._confirmed(start, ttl)
                self._push(lease, start + lease._interval)
            elif extended is False:
                lease._lose("renewal refused: the lock expired or has another holder")
            else:
                lease._assume(start, ttl)  # it may have run, unconfirmed
                delay = lease._retry.delay(lease._failures)
                lease._failures += 1
                self._push(lease, min(now + delay, lease._valid_until))


def _current(entry: tuple[float, int, weakref.ref[Lease]]) -> Lease | None:
    """The lease of a heap entry that is its current one, or None for a stale entry."""
    lease = entry[2]()
    if lease is None or lease._seq != entry[1]:
        return None
    return lease
