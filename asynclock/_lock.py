"""Lock: waiting, deadlines, backoff, and the ``async with`` protocol; ReadWriteLock.

Everything here is backend-independent: a backend only makes single attempts
(``asynclock.backends.base.Backend``); this module decides when to try again, how long to
sleep, what to undo when a caller is cancelled, and hands each grant to a
:class:`~asynclock._lease.Lease`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import weakref
from contextlib import AbstractAsyncContextManager

from ._backoff import Backoff
from ._cancel import undo_on_interrupt
from ._engine import Engine
from ._errors import (
    BackendError,
    CoordinatorClosed,
    LockLost,
    LockTimeout,
    name_error,
)
from ._kind import EXCLUSIVE, FAIR, PERMIT, SHARED
from ._lease import Lease
from ._types import ExcType, ExcValue, Traceback
from ._wakeup import WakeSlot
from .backends.base import Attempt, Claim, Interrupted

__all__ = ("Lock", "ReadWriteLock")

# A waiter whose holder's lease is about to expire retries this long after the expiry,
# so that its attempt does not land a hair before the server drops the key.
_EXPIRY_MARGIN = 0.001
# How long past the caller's deadline a server-side wait may take to report its timeout.
_NATIVE_WAIT_SLACK = 0.5
# The least time the first attempt of an acquire is given to answer, whatever the timeout
# (a positive timeout is as patient as timeout=0 with a server that answers; one that does
# not is given up on after this, or the timeout if longer).
_FIRST_ANSWER = 0.25
# A grant whose reply comes with less than this share of its local validity left is
# given back rather than handed to a body that could not finish under it (seen: a body
# entered with expires_in=0 and wrote after another holder was granted).
_LATE_GRANT = 0.05
# What _attempt returns for such a grant: refused, worth trying again at once.
_LATE = Attempt(None, 0.0)


# The leases each task holds inside ``async with``, across every Lock of every coordinator:
# what re-entry detection looks at (see Lock._check_reentry). Weak: a task that ended
# leaves nothing behind.
_entered: weakref.WeakKeyDictionary[asyncio.Task[object], list[Lease]] = weakref.WeakKeyDictionary()


class Lock:
    """A named lock with its options; made by :meth:`Coordinator.lock`.

    Use ``async with lock as lease:`` (the body is cancelled if the lease is lost, and the
    block raises :class:`LockLost`), or ``lease = await lock.acquire()`` and
    ``await lease.release()``. One ``Lock`` can be used by many tasks; each acquisition
    gets its own :class:`Lease`. Locks are not reentrant.
    """

    __slots__ = (
        "_engine",
        "_leases",
        "_lost_error",
        "_owner",
        "cancel_on_lost",
        "fair",
        "kind",
        "limit",
        "name",
        "renew",
        "retry",
        "shared",
        "timeout",
        "ttl",
    )

    def __init__(
        self,
        engine: Engine[Lease],
        name: str,
        *,
        ttl: float,
        timeout: float | None,
        renew: bool,
        cancel_on_lost: bool,
        retry: Backoff,
        shared: bool,
        owner: str | None = None,
        lost_error: type[LockLost] = LockLost,
        limit: int = 0,
        fair: bool = False,
    ) -> None:
        self._engine = engine
        self.name = name
        # Who holds it, as inspect() shows (default: the coordinator's identity), and
        # what leaving a lost lease raises (elections raise LeadershipLost).
        self._owner = owner
        self._lost_error = lost_error
        self.ttl = ttl
        self.timeout = timeout
        self.renew = renew
        self.cancel_on_lost = cancel_on_lost
        self.retry = retry
        self.shared = shared
        self.limit = limit  # > 0: a semaphore permit (see Coordinator.semaphore)
        self.fair = fair
        self.kind = PERMIT if limit else SHARED if shared else EXCLUSIVE
        if fair:
            self.kind = FAIR
        # The lease of each task inside ``async with`` (several when shared).
        self._leases: dict[asyncio.Task[object] | None, Lease] = {}

    async def acquire(self) -> Lease:
        """Wait for the lock (up to ``timeout``) and return the :class:`Lease`.

        Raises :class:`LockTimeout` when ``timeout`` runs out, ``BackendError`` at once
        when the server cannot be reached. A lease from ``acquire()`` is renewed, and
        marked ``lost`` on loss, but no task is cancelled: use ``async with`` for that.
        If the caller is cancelled, whatever the server may already have granted is
        released in the background.
        """
        engine = self._engine
        engine.check_open()
        self._check_reentry()
        tracer = engine.recorder.tracer
        if tracer is None:
            return await self._acquire()
        with tracer.start_as_current_span(
            "asynclock.acquire",
            attributes={
                "asynclock.lock.name": self.name,
                "asynclock.backend": engine.recorder.backend,
            },
        ) as span:
            lease = await self._acquire()
            span.set_attribute("asynclock.lock.fence", lease.fence)
            return lease

    def _check_reentry(self) -> None:
        """Refuse to wait for a lock the calling task holds inside ``async with``: it would
        wait for its own lease (until the timeout, or forever). A reader too: behind a
        waiting writer (writer preference) it would wait for that writer, which waits for
        it. A task may take several permits of a semaphore; a lease from ``acquire()`` is
        not tied to a task (it may be handed to another), so it is not checked."""
        task = asyncio.current_task()
        leases = None if task is None else _entered.get(task)
        if not leases:
            return
        for lease in leases:
            if lease.would_block(self._engine, self.name) and not self.limit:
                raise RuntimeError(
                    f"lock {self.name!r} is already held by this task (fence {lease.fence}, "
                    "in `async with`): locks are not reentrant, and taking it again would "
                    "wait for this task's own lease"
                )

    async def _acquire(self) -> Lease:
        engine = self._engine
        recorder = engine.recorder
        claim = Claim(
            self.name,
            secrets.token_hex(16),
            self._owner or engine.identity,
            self.kind,
            limit=self.limit,
            recheck=self.retry.maximum,
        )
        began = time.perf_counter()
        recorder.started()
        engine.acquire_started()  # aclose() waits for these before closing the backend
        try:
            return await self._take(claim, began)
        except BaseException as exc:
            name_error(exc, self.name)
            recorder.failed(self.name, exc)
            raise
        finally:
            engine.acquire_ended()

    async def _take(self, claim: Claim, began: float) -> Lease:
        """Grants until one still has validity to hand over (or LockTimeout)."""
        clock = self._engine.clock
        deadline = None if self.timeout is None else clock.now() + self.timeout
        while True:
            attempt, start = await self._grant(claim, deadline)
            if attempt.start is not None:
                start = attempt.start
            if claim.ended:
                # The server ended the grant's session (PostgreSQL: terminated, restarted)
                # between the grant and here, when no lease could hear of it: nothing is
                # held any more. A backend error, as a connection lost while acquiring is.
                raise BackendError(
                    f"{self._engine.backend.describe()}: the server ended the session that "
                    f"was granted {self.name!r} before the lease was made"
                )
            left = self._left(start)
            if left > 0:
                return self._lease(claim, attempt, start, began)
            # Spent after _attempt checked it: leaving the wait took that long (a Redlock
            # unsubscribe waits up to node_timeout). Give it back and try again.
            await self._give_back_late(claim, deadline, -left)
            if self.timeout == 0 or (deadline is not None and clock.now() >= deadline):
                raise LockTimeout(
                    f"lock {self.name!r} was granted, but leaving the wait took the "
                    "lease's validity; given back"
                )

    def _lease(self, claim: Claim, attempt: Attempt, start: float, began: float) -> Lease:
        """The lease for a grant (no await between the grant and the caller holding it)."""
        engine = self._engine
        recorder = engine.recorder
        assert attempt.fence is not None
        if engine.closed:
            # Granted while the coordinator closed: no lease may outlive aclose(). Give
            # the grant back (aclose() waits for that before closing the backend).
            engine.release_in_background(claim, self.ttl)
            raise CoordinatorClosed(f"this Coordinator was closed while acquiring {self.name!r}")
        # Held (and renewed) from its making: Lease() registers it with the engine.
        lease = Lease(
            engine,
            claim,
            attempt.fence,
            self.ttl,
            start,
            renew=self.renew,
            cancel_on_lost=self.cancel_on_lost,
            retry=self.retry,
        )
        recorder.acquired(self.name, lease.fence, time.perf_counter() - began)
        return lease

    def _left(self, start: float) -> float:
        """How much validity a lease counted from ``start`` has beyond the late-grant
        margin now (<= 0: too late to hand over)."""
        engine = self._engine
        valid = self.ttl - engine.backend.drift(self.ttl)
        return valid - (engine.clock.now() - start) - _LATE_GRANT * valid

    def _held_elsewhere(self, *, unanswered: float = 0.0) -> LockTimeout:
        """The :class:`LockTimeout` of an acquire whose attempts the server refused (the
        lock had another holder) until the caller's timeout ran out. ``unanswered``: the
        seconds left for the last attempt, cut short by the deadline."""
        kind = "holders" if self.shared or self.limit else "holder"
        within = "" if self.timeout is None else f" within {self.timeout:g}s"
        last = (
            f"; the last attempt, sent {unanswered * 1000:.3g} ms before the deadline, "
            "had no answer yet"
            if unanswered
            else ""
        )
        return LockTimeout(
            f"lock {self.name!r} not acquired{within}: held by another {kind}{last}",
            name=self.name,
        )

    async def _give_back_late(self, claim: Claim, deadline: float | None, late: float) -> None:
        """Release a grant that came too late, now: before another attempt with the same
        claim could be granted (a background release could delete that one). Bounded
        like the attempt: by the caller's deadline, and by the lease itself (a server
        that does not answer drops it then anyway)."""
        engine = self._engine
        backend = engine.backend
        ttl = self.ttl
        engine.recorder.late_grant(self.name, _LATE_GRANT * (ttl - backend.drift(ttl)) - late)
        bound = ttl if deadline is None else max(deadline - engine.clock.now(), _EXPIRY_MARGIN)
        try:
            async with asyncio.timeout(bound):
                await backend.release(claim)
        except BaseException as exc:
            engine.release_in_background(claim, ttl)
            if isinstance(exc, TimeoutError):
                raise LockTimeout(
                    f"lock {self.name!r}: a grant came too late and "
                    f"{backend.describe()} did not confirm its release in time"
                ) from exc
            raise

    async def _grant(self, claim: Claim, deadline: float | None) -> tuple[Attempt, float]:
        """Attempts until granted (or LockTimeout): the grant and when validity starts."""
        engine = self._engine
        backend = engine.backend
        clock = engine.clock
        timeout = self.timeout
        start = clock.now()
        attempt = await self._attempt(claim, deadline, first=True)
        if attempt.fence is None:
            if timeout == 0:
                raise LockTimeout(
                    f"lock {self.name!r} is held by another holder (timeout=0: tried once)",
                    name=self.name,
                )
            if not backend.native_wait and deadline is not None and clock.now() >= deadline:
                # The first attempt's answer came after the deadline (it is given at least
                # _FIRST_ANSWER): refused, and no time left to wait. It joined the waiter
                # queue; leave it.
                engine.give_back_in_background(claim, self.ttl, Interrupted.ANSWERED)
                raise self._held_elsewhere()
            if backend.native_wait:
                # It waited in the server's queue already; only a grant that came too
                # late (given back) is worth another wait there.
                while attempt is _LATE and (deadline is None or clock.now() < deadline):
                    start = clock.now()
                    attempt = await self._attempt(claim, deadline)
                if attempt.fence is None:
                    raise self._held_elsewhere()
            else:
                attempt, start = await self._wait(claim, deadline)
        return attempt, start

    async def _wait(self, claim: Claim, deadline: float | None) -> tuple[Attempt, float]:
        """Try until granted; between attempts sleep until woken by a release, the
        holder's TTL ends or the backoff step passes. Returns the grant and its start.

        The first attempt already joined the server's waiter queue (Redis). A waiter that
        gives up leaves it, whatever the moment: while subscribing, while waiting (the
        waiter's exit does it), and while that exit is on its way (a second cancel, a
        timeout firing there): then it is left in the background, as it is when entering
        the wait failed.
        """
        engine = self._engine
        # Subscribe first, then try: a release between the failed attempt and the sleep
        # is recorded on the slot, never lost.
        waiter = engine.backend.waiter(self.name)
        # Stopped while subscribing, or while leaving the wait without the lock: the
        # first attempt's place in the queue would keep others out until it lapses.
        give_up = (engine.give_back_in_background, claim, self.ttl, Interrupted.ANSWERED)
        with undo_on_interrupt(*give_up):
            slot = await self._enter(waiter, deadline)
        slot.tag = claim.value  # a release that names this claim wakes this slot
        engine.waiting.add(slot)
        try:
            try:
                result = await self._wait_loop(claim, deadline, slot)
            finally:
                engine.waiting.discard(slot)
        except BaseException as exc:
            # Raised in place of ``exc`` if leaving fails, as ``async with`` would.
            with undo_on_interrupt(*give_up):
                await waiter.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        # Leaving the wait can suspend (an unsubscribe on its way) after the grant: a
        # cancel or an error there means no Lease will be made, so the grant goes back.
        with undo_on_interrupt(engine.release_in_background, claim, self.ttl):
            await waiter.__aexit__(None, None, None)
        return result

    async def _enter(
        self, waiter: AbstractAsyncContextManager[WakeSlot], deadline: float | None
    ) -> WakeSlot:
        """Enter the wait (subscribe to wake-ups), within the caller's deadline: a server
        slow to confirm the subscription ends the acquire with LockTimeout at the
        deadline, not with the subscriber's own (socket) timeout after it."""
        if deadline is None:
            return await waiter.__aenter__()
        bound = asyncio.timeout(max(deadline - self._engine.clock.now(), 0.0))
        try:
            async with bound:
                return await waiter.__aenter__()
        except TimeoutError as exc:
            if not bound.expired():
                raise
            raise LockTimeout(
                f"lock {self.name!r} not acquired within {self.timeout:g}s (subscribing to "
                f"its wake-ups on {self._engine.backend.describe()} took that long)"
            ) from exc

    async def _wait_loop(
        self, claim: Claim, deadline: float | None, slot: WakeSlot
    ) -> tuple[Attempt, float]:
        engine = self._engine
        clock = engine.clock
        retry = self.retry
        tries = 0
        while True:
            engine.check_open()
            start = clock.now()
            attempt = await self._attempt(claim, deadline)
            if attempt.fence is not None:
                return attempt, start
            now = clock.now()
            if deadline is not None and now >= deadline:
                raise self._held_elsewhere()
            pause = retry.delay(tries)
            tries += 1
            if attempt.retry_after is not None:
                pause = min(pause, attempt.retry_after + _EXPIRY_MARGIN)
            until = now + pause if deadline is None else min(now + pause, deadline)
            woken = await slot.wait(clock, until)
            if deadline is not None and clock.now() >= deadline:
                # Out of time: no attempt with nothing left to wait for its answer. A
                # wake-up it did not use goes to the next waiter when the slot is left.
                slot.woken = woken
                raise self._held_elsewhere()

    async def _attempt(
        self, claim: Claim, deadline: float | None, *, first: bool = False
    ) -> Attempt:
        """One ``try_acquire``, bounded by the caller's deadline (the ``first`` one of an
        acquire by at least :data:`_FIRST_ANSWER`), undone if interrupted; a grant that came
        too late to be of use is given back and reads as refused."""
        sent = self._engine.clock.now()
        attempt = await self._try(claim, deadline, first=first)
        if attempt.fence is None:
            return attempt
        left = self._left(sent if attempt.start is None else attempt.start)
        if left > 0:
            return attempt
        # The reply came so late that the lease is (almost) over before the body could
        # start: handing it over would run the body unprotected while another holder may
        # be granted any moment. Give it back and read it as refused.
        await self._give_back_late(claim, deadline, -left)
        return _LATE

    async def _try(self, claim: Claim, deadline: float | None, *, first: bool) -> Attempt:
        engine = self._engine
        backend = engine.backend
        stopped: BaseException | None = None  # the cancel our own deadline sent
        try:
            if deadline is None or self.timeout == 0:
                return await backend.try_acquire(claim, self.ttl, wait=self.timeout)
            remaining = max(deadline - engine.clock.now(), 0.0)
            # A backend that waits in the server's queue stops there at the deadline; our
            # own bound only catches a server that does not answer at all. The first
            # attempt of an acquire is always waited for a moment, however small the
            # timeout: a 1 ms timeout over a 1 ms link must still get a free lock.
            if backend.native_wait:
                bound = remaining + _NATIVE_WAIT_SLACK
            elif first:
                bound = max(remaining, _FIRST_ANSWER)
            else:
                bound = remaining
            own = asyncio.timeout(bound)
            try:
                async with own:
                    return await backend.try_acquire(claim, self.ttl, wait=remaining)
            except TimeoutError as exc:
                if own.expired():
                    stopped = exc.__cause__
                    if not first and bound < _FIRST_ANSWER:
                        # An earlier attempt of this acquire was refused, and this one was
                        # given only what was left of the caller's timeout: the deadline
                        # cut it short, not a silent server. Contention, not an outage.
                        raise self._held_elsewhere(unanswered=bound) from None
                raise LockTimeout(
                    f"lock {self.name!r} not acquired within {self.timeout:g}s: "
                    f"{backend.describe()} did not answer within {bound:.3g}s",
                    name=self.name,
                ) from exc
        except BaseException as exc:
            # The server may have granted the lock before we stopped listening (cancelled,
            # timed out, connection reset after the request left): take it back. A request
            # our deadline stopped was cancelled as a caller's cancel would: on a
            # connection that keeps order, the give-back follows it and need not poll.
            cancelled = isinstance(stopped or exc, asyncio.CancelledError)
            engine.give_back_in_background(
                claim, self.ttl, Interrupted.CANCELLED if cancelled else Interrupted.FAILED
            )
            if isinstance(exc, BackendError) and engine.closed:
                raise CoordinatorClosed("this Coordinator was closed while acquiring") from exc
            raise

    # -- async with --------------------------------------------------------------------

    async def __aenter__(self) -> Lease:
        task = asyncio.current_task()
        if task in self._leases:
            raise RuntimeError(f"lock {self.name!r} is already held by this task (not reentrant)")
        lease = await self.acquire()
        # From here to the body there is no await: the watchdog cannot interleave.
        lease.enter_body(task)
        self._leases[task] = lease
        if task is not None:
            _entered.setdefault(task, []).append(lease)
        return lease

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        task = asyncio.current_task()
        lease = self._leases.pop(task, None)
        if lease is None:
            raise RuntimeError(f"lock {self.name!r} was not entered by this task")
        lease.leave_body()
        if task is not None:
            entered = _entered.get(task)
            if entered is not None:
                entered.remove(lease)
                if not entered:
                    del _entered[task]
        await lease.end_block(task, exc, self._lost_error)

    def __repr__(self) -> str:
        return (
            f"<Lock {self.name!r} ttl={self.ttl:g} timeout={self.timeout!r} "
            f"held_by_tasks={len(self._leases)}>"
        )


class ReadWriteLock:
    """A read-write lock; made by :meth:`Coordinator.rwlock`.

    ``async with rw.read() as lease:`` holds a shared lease (readers overlap),
    ``async with rw.write() as lease:`` an exclusive one. Both are :class:`Lock` objects
    with everything a lock has (TTL, renewal, fences, loss, cancellation, ``acquire()``).
    Writers are preferred: a waiting writer keeps new readers out until it got in.
    """

    __slots__ = ("_read", "_write", "name")

    def __init__(self, name: str, read: Lock, write: Lock) -> None:
        self.name = name
        self._read = read
        self._write = write

    def read(self) -> Lock:
        """The shared side: many readers at once, none while a writer holds or waits."""
        return self._read

    def write(self) -> Lock:
        """The exclusive side: one writer, no readers."""
        return self._write

    def __repr__(self) -> str:
        return f"<ReadWriteLock {self.name!r} ttl={self._write.ttl:g}>"
