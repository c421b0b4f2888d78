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

The watchdog keeps its own entry per lease (:class:`Watch`: the lease's claim, the
sequence number of its current heap entry, its renewal failures in a row) and talks to
the lease through the renewal protocol (:class:`Renewable`): the lease says what its
validity and interval are and changes its own state when told how a renewal ended.
Entries reference leases weakly: a lease the application dropped without releasing it
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
from typing import Protocol

from ._clock import Timer
from ._stats import Recorder
from .backends.base import Backend, Claim

__all__ = ("Renewable", "Watch", "Watchdog")

logger = logging.getLogger("asynclock")

# Renewals due within this window of the earliest one go out in the same batch.
_COALESCE = 0.02
# Rebuild the heap when it holds this many times more entries than live leases.
_COMPACT_FACTOR = 3
_COMPACT_MIN = 1024


class Renewable(Protocol):
    """The renewal protocol: what the watchdog reads of a lease and tells it.

    The lease changes its own state; the watchdog only decides when to renew it and
    reports how each renewal ended.
    """

    @property
    def ttl(self) -> float:
        """The TTL a renewal asks for now."""
        ...

    @property
    def valid_until(self) -> float:
        """When the lease's local validity ends (the clock's time): its deadline."""
        ...

    @property
    def renew_interval(self) -> float:
        """Seconds from a confirmed request to the next renewal."""
        ...

    @property
    def renews(self) -> bool:
        """True if the watchdog renews it (else only its deadline is watched)."""
        ...

    @property
    def renewing(self) -> bool:
        """True while an extend request of it is in flight (one at a time)."""
        ...

    @property
    def releasing(self) -> bool:
        """True while a release of it that failed goes on in the background."""
        ...

    def retry_delay(self, failures: int) -> float:
        """Seconds before the next try after ``failures`` failed renewals in a row."""
        ...

    def begin_request(self) -> None:
        """An extend request (a renewal) of the lease leaves."""
        ...

    def end_request(self) -> None:
        """The extend request in flight has answered, failed or been abandoned."""
        ...

    def confirmed(self, start: float, ttl: float) -> None:
        """The server confirmed a request for ``ttl`` sent at ``start``."""
        ...

    def unconfirmed(self, start: float, ttl: float) -> None:
        """A request for ``ttl`` sent at ``start`` may have run, unconfirmed."""
        ...

    def mark_lost(self, reason: str) -> None:
        """The lease is lost (a refused renewal, or its validity ran out)."""
        ...


class Watch:
    """The watchdog's entry for one lease: what it renews and where its schedule is.

    ``seq`` is the sequence number of the lease's current heap entry (-1 once it is no
    longer watched: every entry of it is stale); ``failures`` counts its failed renewals
    in a row. The lease is referenced weakly (see the module docstring).
    """

    __slots__ = ("claim", "failures", "lease", "seq")

    def __init__(self, lease: Renewable, claim: Claim) -> None:
        self.lease = weakref.ref(lease)
        self.claim = claim
        self.seq = -1
        self.failures = 0

    def __repr__(self) -> str:
        return f"<Watch {self.claim.name!r} seq={self.seq} failures={self.failures}>"


class Watchdog:
    """Schedules renewals and validity deadlines for a coordinator's leases.

    Each watched lease has exactly one current heap entry, identified by its
    :class:`Watch`'s ``seq``; older entries of the lease, and entries of a lease that was
    collected, are stale and skipped when popped.
    """

    def __init__(self, backend: Backend, spawn: Callable[..., None], recorder: Recorder) -> None:
        self._backend = backend
        self._recorder = recorder
        self._clock = backend.clock
        self._spawn = spawn
        self._heap: list[tuple[float, int, Watch]] = []
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

    def watch(self, lease: Renewable, claim: Claim, start: float) -> Watch:
        """Start watching a lease of ``claim`` granted to a request sent at ``start``; its
        entry, which the lease hands back to the methods below."""
        watch = Watch(lease, claim)
        self._live += 1
        if lease.renews:
            self._push(watch, start + lease.renew_interval)
        else:
            self._push(watch, lease.valid_until)
        return watch

    def reschedule(self, watch: Watch, when: float) -> None:
        """Replace the lease's next action (after a manual extend)."""
        lease = watch.lease()
        if lease is not None:
            self._push(watch, when if lease.renews else lease.valid_until)

    def retry(self, watch: Watch) -> None:
        """The lease's own extend request failed or was interrupted: renew it after the
        backoff its renewal failures so far call for (not counting that one), or at its
        deadline if that comes first."""
        lease = watch.lease()
        if lease is not None:
            delay = lease.retry_delay(watch.failures)
            self.reschedule(watch, min(self._clock.now() + delay, lease.valid_until))

    def expire_at(self, watch: Watch, when: float) -> None:
        """Replace the lease's next action by its loss at ``when`` (a release pending)."""
        self._push(watch, when)

    def forget(self, watch: Watch) -> None:
        """The lease left the HELD state: drop it from the schedule."""
        if self.unwatch(watch):
            self.dropped()

    @staticmethod
    def unwatch(watch: Watch) -> bool:
        """Make every entry of the lease stale; True if it was watched. One attribute
        write: safe from any thread (a lease collected during a garbage collection), with
        :meth:`dropped` called later, in the loop."""
        watched = watch.seq >= 0
        watch.seq = -1
        return watched

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

    def _push(self, watch: Watch, when: float) -> None:
        seq = watch.seq = next(self._seq)
        heapq.heappush(self._heap, (when, seq, watch))
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
        batch: list[tuple[Watch, Renewable]] = []
        deferred: list[tuple[Watch, Renewable]] = []
        self._firing = True
        try:
            while heap and heap[0][0] <= now + _COALESCE:
                entry = heapq.heappop(heap)
                lease = _current(entry)
                if lease is None:
                    continue  # stale
                if now >= lease.valid_until:
                    lease.mark_lost("not renewed before its local validity ran out")
                elif lease.renews and not lease.renewing:
                    batch.append((entry[2], lease))
                else:
                    # Not renewing now: its next action is its deadline.
                    deferred.append((entry[2], lease))
        finally:
            self._firing = False
        for watch, lease in deferred:
            self._push(watch, lease.valid_until)
        if batch:
            self._send(batch, now)
        if heap and heap[0][0] < self._timer_at:
            self._arm(heap[0][0])

    def _send(self, batch: list[tuple[Watch, Renewable]], now: float) -> None:
        for watch, lease in batch:
            lease.begin_request()
            # If the renewal hangs, the lease is lost at the end of its validity.
            self._push(watch, lease.valid_until)
        self.batches += 1
        last = max(lease.valid_until for _, lease in batch)
        # Each renewal asks for the TTL the lease has now; its reply is read against that
        # TTL, not against whatever the lease's ttl is when the reply comes.
        ttls = [lease.ttl for _, lease in batch]
        self._spawn(self._renew(batch, ttls, now, last - now), name="asynclock-renew")

    async def _renew(
        self, batch: list[tuple[Watch, Renewable]], ttls: list[float], start: float, bound: float
    ) -> None:
        backend = self._backend
        results: list[bool | None]
        sent = time.perf_counter()
        try:
            async with asyncio.timeout(max(bound, 0.0)):
                items = [(watch.claim, ttl) for (watch, _), ttl in zip(batch, ttls, strict=True)]
                results = await backend.extend_many(items)
        except TimeoutError:
            results = [None] * len(batch)
        except Exception:
            logger.exception("renewal of %d leases failed unexpectedly", len(batch))
            results = [None] * len(batch)
        except BaseException:
            # Cancelled (the coordinator is closing): each request's outcome is unknown.
            for (watch, lease), ttl in zip(batch, ttls, strict=True):
                lease.end_request()
                if watch.seq >= 0:
                    lease.unconfirmed(start, ttl)
            raise
        self._recorder.renewed(
            sum(r is True for r in results),
            sum(r is False for r in results),
            sum(r is None for r in results),
            time.perf_counter() - sent,
        )
        now = self._clock.now()
        for (watch, lease), ttl, extended in zip(batch, ttls, results, strict=True):
            lease.end_request()
            if watch.seq < 0:
                continue  # released or lost meanwhile
            if lease.releasing:
                # A release went out after this renewal and has no answer yet: the server
                # ran the two in some order, and the release's own clean-up (or the loss
                # at the lease's old deadline, scheduled then) decides how it ends.
                continue
            if extended:
                self.renewals += 1
                watch.failures = 0
                lease.confirmed(start, ttl)
                self._push(watch, start + lease.renew_interval)
            elif extended is False:
                lease.mark_lost("renewal refused: the lock expired or has another holder")
            else:
                lease.unconfirmed(start, ttl)  # it may have run, unconfirmed
                delay = lease.retry_delay(watch.failures)
                watch.failures += 1
                self._push(watch, min(now + delay, lease.valid_until))


def _current(entry: tuple[float, int, Watch]) -> Renewable | None:
    """The lease of a heap entry that is its current one, or None for a stale entry."""
    watch = entry[2]
    if watch.seq != entry[1]:
        return None
    return watch.lease()
