"""Lease: one holder's hold on a lock, from grant to release or loss.

Its states (held, lost, released), validity and fence, ``extend()`` and ``release()``,
the renewal protocol the watchdog drives (``_watchdog.Renewable``), and how a loss
reaches the body of ``async with`` (cancelled, and cancelled again until it leaves).
Granting is ``_lock``'s.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import warnings
from collections.abc import Callable

from ._backoff import Backoff
from ._cancel import CancelMark
from ._engine import Engine
from ._errors import (
    LockError,
    LockLost,
    LockNotOwned,
    name_error,
)
from ._kind import PERMIT
from ._validate import check_ttl
from ._watchdog import Watch
from .backends.base import Claim

__all__ = ("Lease",)

logger = logging.getLogger("asynclock")

# A lost lease's body is cancelled again, until it leaves the block: a cancel the body
# swallowed must not let it run on. On every turn of the event loop for the first
# _REDELIVER_EAGER seconds (see Lease._cancel_body), then after these delays (doubling
# up to the second), so that a body that swallows every cancel costs little CPU.
_REDELIVER_EAGER = 0.05
_REDELIVER_FIRST = 0.001
_REDELIVER_MAX = 0.005


def _call_safely(callback: Callable[[Lease], object], lease: Lease) -> None:
    """A loss callback's error is logged: it must not stop the loss's delivery."""
    try:
        callback(lease)
    except Exception:
        logger.exception("the loss callback of %r (fence %d) raised", lease.name, lease.fence)


class _State(enum.Enum):
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


_HELD = _State.HELD
_LOST = _State.LOST
_RELEASED = _State.RELEASED


class Lease:
    """One holder's hold on a lock, from grant to release or loss.

    Attributes: ``name``, ``token`` (the random owner token this acquisition wrote),
    ``fence`` (strictly greater than the fence of every earlier holder of the name: pass
    it to the resource you protect), ``ttl``, ``expires_in`` (seconds of local validity
    left), ``lost``. A lease is created by :meth:`Lock.acquire` or ``async with``.
    """

    __slots__ = (
        "__weakref__",
        "_cancel_on_lost",
        "_cancels",
        "_claim",
        "_engine",
        "_entry",
        "_in_body",
        "_interval",
        "_on_loss",
        "_quiet",
        "_reason",
        "_releasing",
        "_renew",
        "_renewing",
        "_retry",
        "_state",
        "_task",
        "_ttl_floor",
        "_valid_until",
        "_watch",
        "fence",
        "ttl",
    )

    def __init__(
        self,
        engine: Engine[Lease],
        claim: Claim,
        fence: int,
        ttl: float,
        start: float,
        *,
        renew: bool,
        cancel_on_lost: bool,
        retry: Backoff,
    ) -> None:
        self._engine = engine
        self._claim = claim
        self.fence = fence
        self.ttl = ttl
        self._valid_until = start + ttl - engine.backend.drift(ttl)
        self._interval = ttl / 3
        self._renew = renew
        self._cancel_on_lost = cancel_on_lost
        self._retry = retry
        self._state = _HELD
        self._reason = ""
        self._releasing = False  # a release failed: it goes on in the background
        # Set by ``async with``: the task to cancel on loss, and its cancel count on entry.
        self._task: asyncio.Task[object] | None = None
        self._entry: CancelMark | None = None
        self._in_body = False
        self._on_loss: list[Callable[[Lease], object]] | None = None  # see when_lost()
        self._cancels = 0  # cancels sent to that task because the lease was lost
        # True while an extend request (the watchdog's renewal or extend()) is in flight:
        # one at a time, so that the last reply is from the request the server ran last.
        self._renewing = False
        self._quiet: asyncio.Event | None = None  # set when none is; made on first need
        # The smallest TTL of an extend request whose outcome is unknown (see unconfirmed).
        self._ttl_floor = math.inf
        # Held from here: the engine's key for it, which is also its watchdog entry.
        self._watch: Watch | None = None
        self._watch = engine.hold(self, claim, start)

    @property
    def name(self) -> str:
        """The lock's name."""
        return self._claim.name

    @property
    def token(self) -> str:
        """The random owner token of this acquisition (128 bits from ``secrets``)."""
        return self._claim.token

    @property
    def expires_in(self) -> float:
        """Seconds of local validity left (0 once lost or released)."""
        if self._state is not _HELD:
            return 0.0
        return max(0.0, self._valid_until - self._engine.clock.now())

    @property
    def lost(self) -> bool:
        """True once the lease was lost (refused renewal, or validity ran out)."""
        return self._state is _LOST

    @property
    def held(self) -> bool:
        """True while the lease is held: neither released nor lost."""
        return self._state is _HELD

    @property
    def reason(self) -> str:
        """Why the lease was lost ("" unless :attr:`lost`)."""
        return self._reason if self._state is _LOST else ""

    async def extend(self, ttl: float | None = None) -> None:
        """Reset the lease to ``ttl`` seconds (default: its current ``ttl``) from now.

        One extend request per lease is in flight at a time: a call made while the
        watchdog's renewal (or another ``extend()``) is on its way is sent after that one
        has answered. If the call fails or is cancelled after its request left, the server
        may have applied it: the lease then counts on the shorter of its validity and
        ``ttl`` from before the request, and the watchdog keeps renewing it.

        Raises :class:`LockNotOwned` if the lease is no longer held (then it is lost, and
        with ``cancel_on_lost`` the body of ``async with`` is cancelled), ``BackendError``
        if the server could not be reached (the lease stays held and the watchdog retries,
        unless the backend had to end the session that held it: PostgreSQL does when the
        request goes unanswered, and the lease is then lost).
        """
        engine = self._engine
        new_ttl = self.ttl if ttl is None else engine.check_validity(check_ttl(ttl))
        engine.check_loop()
        while True:  # checked again after waiting: the lease may have ended meanwhile
            if self._state is not _HELD:
                raise LockNotOwned(
                    f"lease on {self.name!r} is {self._state.value}; cannot extend", name=self.name
                )
            if self._ttl_floor == 0.0:
                raise LockNotOwned(
                    f"lease on {self.name!r} has a release pending; cannot extend", name=self.name
                )
            if not self._renewing:
                break
            if self._quiet is None:
                self._quiet = asyncio.Event()
            await self._quiet.wait()
        backend = engine.backend
        watchdog = engine.watchdog
        start = engine.clock.now()
        shorter = start + new_ttl - backend.drift(new_ttl)
        if shorter < self._valid_until:
            # A shorter TTL: the server may apply it long before its reply comes back, and
            # from then on keeps the lock only that long. Believe it from now on.
            self._valid_until = shorter
            watchdog.expire_at(self._held_watch(), shorter)
        extended: bool | None = None
        self.begin_request()
        try:
            extended = await backend.extend(self._claim, new_ttl)
        except LockError as exc:
            name_error(exc, self.name)
            raise
        finally:
            self.end_request()
            if extended is None and self._state is _HELD and not self._releasing:
                # Failed or cancelled after the request may have left: it may have run.
                self.unconfirmed(start, new_ttl)
                watchdog.retry(self._held_watch())
        if self._state is not _HELD:
            raise LockNotOwned(
                f"lease on {self.name!r} was {self._state.value} while extending", name=self.name
            )
        if self._releasing:
            # A release went out while this extend was on its way and has no answer yet:
            # it decides how the lease ends (its schedule is left as it set it).
            raise LockNotOwned(
                f"lease on {self.name!r} has a release pending; not extended", name=self.name
            )
        if not extended:
            self.mark_lost("extend refused: the lock expired or has another holder")
            raise LockNotOwned(
                f"lease on {self.name!r} is no longer held; not extended", name=self.name
            )
        self.ttl = new_ttl
        self.confirmed(start, new_ttl)
        watchdog.reschedule(self._held_watch(), start + self._interval)

    async def owned(self) -> bool:
        """Ask the server whether it still holds the lock for this lease.

        True if the lock's current holder on the server is this acquisition (its token and
        fence), False if the lock expired, has another holder, or this lease was released
        or lost (then without asking). A False answer does not end the lease by itself:
        the next renewal is refused and marks it lost. Compares nothing locally: unlike
        :attr:`held` and :attr:`expires_in`, it costs a round trip.

        Raises ``BackendError`` if the server could not be reached, and
        ``NotImplementedError`` for a shared lease or a semaphore permit on a backend that
        cannot tell one holder of a shared name from another (only memory can).
        """
        self._engine.check_loop()
        if self._state is not _HELD or self._releasing:
            return False
        try:
            return await self._engine.backend.owns(self._claim, self.fence)
        except LockError as exc:
            name_error(exc, self.name)
            raise

    # -- the renewal protocol (asynclock._watchdog.Renewable), for the engine ----------

    @property
    def valid_until(self) -> float:
        """When the local validity ends, on the backend's clock (engine-internal: the
        watchdog's deadline for it)."""
        return self._valid_until

    @property
    def renew_interval(self) -> float:
        """Seconds from a confirmed request to the next renewal (engine-internal)."""
        return self._interval

    @property
    def renews(self) -> bool:
        """True if the watchdog renews the lease (engine-internal: False with
        ``renew=False``, and once a release is pending)."""
        return self._renew

    @property
    def renewing(self) -> bool:
        """True while an extend request of the lease (a renewal or :meth:`extend`) is in
        flight (engine-internal)."""
        return self._renewing

    @property
    def releasing(self) -> bool:
        """True while a release that failed or was cancelled goes on in the background
        (engine-internal)."""
        return self._releasing

    def retry_delay(self, failures: int) -> float:
        """Seconds before the next renewal after ``failures`` failed ones in a row, from
        the lease's backoff (engine-internal)."""
        return self._retry.delay(failures)

    def begin_request(self) -> None:
        """An extend request of this lease leaves (see :attr:`renewing`; engine-internal)."""
        self._renewing = True
        if self._quiet is not None:
            self._quiet.clear()

    def end_request(self) -> None:
        """The extend request in flight has answered, failed or been abandoned
        (engine-internal)."""
        self._renewing = False
        if self._quiet is not None:
            self._quiet.set()

    def unconfirmed(self, start: float, ttl: float) -> None:
        """A request for ``ttl`` sent at ``start`` may have run on the server, unconfirmed:
        never believe the lease lasts longer than that request would have left it.

        Nor later: a request whose reply was lost may still reach the server after the
        next one was confirmed (sent on a connection that then broke, held by a proxy),
        and the server then keeps at least ``ttl`` from after the confirmed request ran.
        So from now on a confirmed request counts for at most this ``ttl``
        (:meth:`confirmed`): a lost shorter ``extend()`` makes the lease behave as if
        that shorter TTL had been set, renewed as often as it needs (engine-internal).
        """
        drift = self._engine.backend.drift(ttl)
        self._valid_until = min(self._valid_until, start + ttl - drift)
        self._ttl_floor = min(self._ttl_floor, ttl)

    def confirmed(self, start: float, ttl: float) -> None:
        """The server confirmed a request for ``ttl`` sent at ``start`` (the last to run
        of those this lease has confirmed, as one is in flight at a time;
        engine-internal)."""
        effective = min(ttl, self._ttl_floor, self._claim.floor)
        self._valid_until = start + effective - self._engine.backend.drift(effective)
        self._interval = effective / 3

    def _held_watch(self) -> Watch:
        """The lease's watchdog entry (every lease has one once made)."""
        watch = self._watch
        assert watch is not None  # set at the end of __init__
        return watch

    async def release(self) -> None:
        """Release the lock: delete it on the server if this lease still holds it.

        Raises :class:`LockNotOwned` when the lease was already released or lost, or the
        server says another holder (or nobody) has the lock; nothing is touched then.
        If the call fails or is cancelled, the lease stays held (``held`` is still true)
        but is no longer renewed and has no validity left (``expires_in`` is 0: the
        release may already have run), ``extend()`` raises :class:`LockNotOwned`, and the
        release goes on in the background until the server confirms or the TTL has run
        out. A later ``release()`` tries again: it returns once the server confirms the
        release (the interrupted one's included, whether it or the background one got
        the answer), and raises :class:`LockNotOwned` only if the server says the lock
        was not this lease's (it had expired, or has another holder).
        """
        self._engine.check_loop()
        if self._state is not _HELD:
            if self._releasing and self._state is _RELEASED:
                # The interrupted release was confirmed in the background: this call is
                # its retry (once; a call after it is a second release).
                self._releasing = False
                return
            raise LockNotOwned(
                f"lease on {self.name!r} is {self._state.value}; not released", name=self.name
            )
        if not await self.try_release():
            raise LockNotOwned(
                f"lease on {self.name!r} was no longer held at release", name=self.name
            )
        self._releasing = False

    async def try_release(self) -> bool:
        """Release on the server; True if it confirmed, False if the lock was not ours
        (engine-internal: :meth:`release` and leaving ``async with``)."""
        tracer = self._engine.recorder.tracer
        if tracer is None:
            return await self._release_once()
        with tracer.start_as_current_span(
            "asynclock.release",
            attributes={"asynclock.lock.name": self.name, "asynclock.lock.fence": self.fence},
        ):
            return await self._release_once()

    async def _release_once(self) -> bool:
        engine = self._engine
        sent = engine.clock.now()
        try:
            released = await engine.backend.release(self._claim)
        except BaseException as error:
            name_error(error, self.name)
            if isinstance(error, Exception):
                engine.recorder.release_failed()
            # Unconfirmed: keep the token and the HELD state ("release pending"), stop
            # renewing, and let the background clean-up finish the job (it marks the
            # lease released). The release may have run already: like an extend to 0 of
            # unknown outcome, it leaves no validity from the moment it left, for good.
            # A retried release that fails again keeps the first one's deadline (its
            # validity is already spent: that would be a loss at once).
            if self._state is _HELD and not self._releasing:
                deadline = self._valid_until
                self._releasing = True
                self._renew = False
                self.unconfirmed(sent, 0.0)
                # Lost at its old deadline if the clean-up never hears back.
                engine.watchdog.expire_at(self._held_watch(), deadline)
            engine.release_in_background(self._claim, self.ttl, self)
            raise
        if released:
            self._end(_RELEASED)
        else:
            self._end(_LOST, "the lock was no longer held at release")
        return released

    # -- state changes -----------------------------------------------------------------

    def _end(self, state: _State, reason: str = "") -> bool:
        """Leave the HELD state (counted and logged); False if it had already been left."""
        if self._state is not _HELD:
            return False
        self._state = state
        self._reason = reason
        engine = self._engine
        engine.forget(self._held_watch())
        if state is _RELEASED:
            engine.recorder.released(self.name, self.fence)
        else:
            engine.recorder.lost(self.name, self.fence, reason)
            callbacks, self._on_loss = self._on_loss, None
            for callback in callbacks or ():
                _call_safely(callback, self)
        return True

    def _released_after_loss(self) -> None:
        """The body ended within its validity and the server confirmed the release, but
        the lease was marked lost while the release was in flight (its validity ran out,
        or a renewal that arrived after the release was refused). The server held the
        lock for this lease until the release, so nothing ran unprotected: the lease ends
        released, and its block without LockLost (a completed call is not retried). Not
        when a cancel was sent to the body for the loss: that cancel must be answered."""
        self._state = _RELEASED
        self._reason = ""
        self._engine.recorder.released_after_loss(self.name, self.fence)

    def end_after_background_release(self, released: bool) -> None:
        """The background release of a lease whose own release failed has finished
        (engine-internal)."""
        if released:
            self._end(_RELEASED)
        else:
            self._end(_LOST, "the lock was no longer held when its release was retried")

    def mark_lost(self, reason: str) -> None:
        """Mark the lease lost: stop renewing, cancel the body, clean up on the server
        (engine-internal: the watchdog, the coordinator's close, a refused extend)."""
        if not self._end(_LOST, reason):
            return
        task = self._task
        if self._cancel_on_lost and self._in_body and task is not None and not task.done():
            loop = asyncio.get_running_loop()
            self._cancel_body(task, loop.time() + _REDELIVER_EAGER, _REDELIVER_FIRST)
        # Whatever the server still has of ours goes now, not when its TTL runs out.
        self._engine.release_in_background(self._claim, self.ttl)

    def _cancel_body(self, task: asyncio.Task[object], eager_until: float, delay: float) -> None:
        """Cancel the body, and again while it has not left the block.

        Level-triggered, as a cancelled scope is in anyio and Trio: a single cancel can be
        swallowed before the body sees it, and the body would then run on unprotected.
        ``asyncio.wait_for`` on Python 3.11 (redis-py sends every command under it)
        returns the result of an inner call that finished in the loop turn before the
        cancel lands: a body busy with redis-py calls swallowed hundreds of cancels sent
        a millisecond apart, and ran on for a second under CPU load. A cancel sent on
        every loop turn also lands in the turns where the body waits for a reply, where
        nothing swallows it: such a body stops within a round trip or two. After
        ``eager_until`` (loop time) the cancels are spaced out (``delay``, doubling), so
        that a body that swallows every cancel does not keep the loop busy. Each cancel is
        counted and taken back with ``uncancel()`` when the block is left.
        """
        if not self._in_body or task.done():
            return
        self._cancels += 1
        task.cancel(f"asynclock: lease on {self.name!r} lost: {self._reason}")
        loop = asyncio.get_running_loop()
        if loop.time() < eager_until:
            loop.call_soon(self._cancel_body, task, eager_until, delay)
        else:
            loop.call_later(
                delay, self._cancel_body, task, eager_until, min(delay * 2, _REDELIVER_MAX)
            )

    def end_released(self) -> None:
        """End the lease released, and give its lock back in the background: nothing to
        cancel, no loss to report (engine-internal). For a close from inside the lease's
        own body (its body is the caller), and for a grant that an interrupt kept from
        its blocking caller (``asynclock.sync``: nobody ever held it)."""
        if self._end(_RELEASED):
            self._engine.release_in_background(self._claim, self.ttl)

    def when_lost(self, callback: Callable[[Lease], object]) -> None:
        """Call ``callback(lease)`` in the event loop when this lease is lost (once; at
        once if it already was). Not when it is released. The callback must not block:
        it runs where renewals run. An exception it raises is logged. The blocking API
        (:mod:`asynclock.sync`) hands it on to a thread from here."""
        if self._state is _LOST:
            _call_safely(callback, self)
        elif self._state is _HELD:
            if self._on_loss is None:
                self._on_loss = []
            self._on_loss.append(callback)

    # -- ``async with``, for Lock ------------------------------------------------------

    def enter_body(self, task: asyncio.Task[object] | None) -> None:
        """``task`` enters the ``async with`` body of this lease: it is the task to cancel
        on loss, from its cancel count now (engine-internal)."""
        self._task = task
        self._entry = CancelMark(task) if task is not None else None
        self._in_body = True

    def leave_body(self) -> None:
        """The body of ``async with`` has ended: no more cancels for a loss
        (engine-internal)."""
        self._in_body = False

    def in_body_of(self, task: asyncio.Task[object] | None) -> bool:
        """True while ``task`` runs this lease's ``async with`` body (engine-internal)."""
        return self._in_body and self._task is task

    def would_block(self, engine: Engine[Lease], name: str) -> bool:
        """True if an acquire of ``name`` on ``engine`` would wait for this lease: it is
        held there, and not as a semaphore permit (engine-internal)."""
        claim = self._claim
        return (
            self._engine is engine
            and claim.name == name
            and self._state is _HELD
            and claim.kind is not PERMIT
        )

    async def end_block(
        self,
        task: asyncio.Task[object] | None,
        exc: BaseException | None,
        lost_error: type[LockLost],
    ) -> None:
        """Leave ``async with`` after its body ended with ``exc`` (None: it returned):
        release the lease, then report a loss as ``lost_error`` (engine-internal).

        Raises ``lost_error`` for a lost lease unless an outside cancel must win, and a
        release's error unless a cancel is in flight (then the release goes on in the
        background).
        """
        if self._state is _HELD and not self._releasing and self.expires_in <= 0:
            # The body outlived its validity (it blocked the loop, or the watchdog's timer
            # has not run yet): it may have run unprotected, whatever the release says.
            self.mark_lost("its local validity ran out before its block ended")
        if self._state is _HELD:
            try:
                released = await self.try_release()
            except Exception as error:
                if not isinstance(exc, asyncio.CancelledError):
                    raise
                # A cancel is in flight: it must end the task, not an error of the clean-up
                # (a caller retrying on BackendError would run on after task.cancel()). The
                # release goes on in the background until the server confirms or the TTL ends.
                logger.warning(
                    "release of %r (fence %d) failed while its task was being cancelled; "
                    "finishing it in the background: %s",
                    self.name,
                    self.fence,
                    error,
                )
                return
            if released and self._state is _LOST and not self._cancels:
                self._released_after_loss()
        if self._state is _LOST:
            await self._deliver_loss(task, exc, lost_error)  # raises, unless an outside cancel

    async def _deliver_loss(
        self,
        task: asyncio.Task[object] | None,
        exc: BaseException | None,
        lost_error: type[LockLost],
    ) -> None:
        """Raise ``lost_error`` (a :class:`LockLost`) for this lost lease, unless an outside
        cancel must win.

        The ``asyncio.timeout`` pattern: our cancel is ours only if ``uncancel()`` brings
        the task back to the count it had on entry.
        """
        error = lost_error(
            f"lease on {self.name!r} (fence {self.fence}) lost: {self._reason}", name=self.name
        )
        cancelled = isinstance(exc, asyncio.CancelledError)
        entry = self._entry
        if not self._cancels or task is None or entry is None:
            if cancelled:
                return  # an outside cancel: let it propagate
            raise error from exc
        if not entry.take_back(self._cancels):
            if cancelled:
                return  # cancelled from outside as well: the outside cancel wins
            raise error from exc
        if not cancelled:
            # Our cancel did not surface as the body's exception: the body swallowed it, or
            # it is still pending (the loss was noticed inside this task). On 3.11/3.12
            # uncancel() leaves a pending cancel in place; let it fire here, not in the
            # caller's next await.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError as pending:
                if entry.rose():
                    raise  # a new cancel from outside arrived meanwhile
                exc = exc or pending
        raise error from exc

    def __del__(self) -> None:
        # Dropped while held, without release(): nothing references the lease but the
        # engine's weak references, so nothing can release it any more. Give its lock
        # back (in the coordinator's loop: this may run in any thread, during a garbage
        # collection) and warn, as asyncio does for a transport never closed.
        watch = self._watch
        if self._state is not _HELD or self._releasing or watch is None:
            return
        # Ended here, first: whatever keeps the object alive after this (a recorded
        # warning does: its source is this lease) sees a released lease, never one still
        # valid or renewed by the watchdog (whose weak references outlive __del__ when
        # the count of references dropped to zero).
        engine = self._engine
        self._state = _RELEASED
        watched = engine.watchdog.unwatch(watch)
        loop = engine.loop
        try:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(
                    engine.release_dropped, watch, self._claim, self.ttl, self.fence, watched
                )
        except RuntimeError:  # the loop closed meanwhile: the server's TTL ends the lock
            pass
        # Last: with warnings turned into errors, this raises (and is reported as an
        # exception ignored in __del__), after the lock was given back.
        warnings.warn(
            f"a lease on {self.name!r} was dropped while held, without release(): "
            "its lock is released now; release it, or use 'async with'",
            ResourceWarning,
            source=self,
            stacklevel=1,
        )

    def __repr__(self) -> str:
        held = self._state is _HELD
        state = f"expires_in={self.expires_in:.1f}s" if held else self._state.value
        return f"<Lease {self.name!r} fence={self.fence} {state}>"
