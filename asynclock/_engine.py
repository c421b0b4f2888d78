"""The engine a coordinator's locks run on: what Lock, Lease and Election are given.

One :class:`Engine` per coordinator, built and owned by it. It holds the backend and its
clock, the recorder (stats, spans, logs), the background tasks, the renewal scheduler
(the watchdog), and the state every lock of the coordinator shares: the leases held now,
the acquires on their way and their wake-up slots, the event loop of first use, and
whether the coordinator is closing. Locks and leases act on it through its methods
(give a claim back in the background, leave a waiter queue, register or forget a held
lease), never on the coordinator: the coordinator is the public face (it builds locks,
elections and decorators and answers ``stats()``, ``held`` and ``inspect()``), the
engine is what they run on, and :meth:`Engine.aclose` ends it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Coroutine, Iterator
from typing import Any, Generic, Protocol, TypeVar

from ._backoff import Backoff
from ._cancel import finish_shielded
from ._errors import BackendError, CoordinatorClosed
from ._stats import Recorder
from ._tasks import TaskSet
from ._validate import check_name
from ._wakeup import Mailbox, WakeSlot
from ._watchdog import Renewable, Watch, Watchdog
from .backends.base import Backend, Claim, Interrupted, LockInfo

__all__ = ("Engine", "HeldLease")

logger = logging.getLogger("asynclock")

# How long aclose() waits for releases and clean-ups still in flight.
_CLOSE_TIMEOUT = 5.0
# The least local validity a lease may have (see Engine.check_validity).
_MIN_VALIDITY = 0.001


class HeldLease(Renewable, Protocol):
    """What the engine asks of a lease it holds (besides the renewal protocol)."""

    def in_body_of(self, task: asyncio.Task[Any] | None) -> bool:
        """True while ``task`` runs this lease's ``async with`` body."""
        ...

    def end_released(self) -> None:
        """End released, the lock given back in the background (a close from inside the
        lease's own body)."""
        ...

    def end_after_background_release(self, released: bool) -> None:
        """The background release of this lease (its own release failed) has finished."""
        ...


L = TypeVar("L", bound=HeldLease)


class Engine(Generic[L]):
    """The backend, clock, recorder, background tasks and watchdog of one coordinator,
    and the operations its locks and leases share (see the module docstring).

    ``identity`` is the coordinator's; ``telemetry`` is :class:`Recorder`'s.
    """

    def __init__(self, backend: Backend, identity: str, telemetry: bool | None) -> None:
        self.backend = backend
        self.clock = backend.clock
        self.identity = identity
        self.recorder = Recorder(type(backend).__name__, telemetry)
        self.tasks = TaskSet(f"coordinator {identity!r}")
        self.watchdog = Watchdog(backend, self.spawn, self.recorder)
        # Wake-up slots of the waiting acquires: woken by aclose(), so that they see the
        # coordinator closed.
        self.waiting: set[WakeSlot] = set()
        # The leases held now, by their watchdog entry, in grant order. Weak: a lease the
        # application dropped without releasing it is collected, and its lock given back
        # (Lease.__del__ and release_dropped).
        self._held: dict[Watch, weakref.ref[L]] = {}
        # The mailboxes of the elections' observers: told to look again by aclose().
        self._observers: set[Mailbox] = set()
        self._closed = False
        self._shut = asyncio.Event()  # set by aclose()
        # The close on its way (see aclose): every aclose() call waits for this one.
        self._closing: asyncio.Future[None] | None = None
        # The event loop of the first use: asyncio objects (connections, pools, timers)
        # belong to one loop, so a use from another one fails at once (check_loop).
        self._loop: asyncio.AbstractEventLoop | None = None
        # Acquires on their way: aclose() lets them give back what they were granted
        # before it closes the backend.
        self._in_flight = 0
        # The longest GiveBack.late the backend has answered (see _release_task).
        self._late = 0.0
        self._drained: asyncio.Event | None = None

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` was called."""
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop of the first use (None before it)."""
        return self._loop

    # -- checks ----------------------------------------------------------------------

    def check_open(self) -> None:
        """:class:`CoordinatorClosed` once closed; RuntimeError from another loop."""
        if self._closed:
            raise CoordinatorClosed("this Coordinator is closed")
        self.check_loop()

    def check_loop(self) -> None:
        """Bind to the running event loop on first use; refuse any other loop after."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this Coordinator was first used in another event loop: its connections "
                "and tasks belong to that loop. Make a coordinator in the loop that uses "
                "it (in the application's lifespan or startup hook, or a test fixture), "
                "not at import time for several asyncio.run() calls"
            )

    def check_validity(self, ttl: float) -> float:
        """``ttl`` if a lease of it keeps at least 1 ms of local validity on this backend,
        else ValueError.

        A lease is believed valid for ``ttl - drift(ttl)``: with (next to) nothing left,
        every grant would come too late to hand over and be given back, and a waiting
        acquire would retry forever (thousands of commands a second).
        """
        backend = self.backend
        if ttl - backend.drift(ttl) < _MIN_VALIDITY:
            least = (backend.drift_base + _MIN_VALIDITY) / (1 - backend.drift_factor)
            raise ValueError(
                f"ttl must be at least {least * 1000:.2f} ms on {backend.describe()}: a "
                f"lease of {ttl!r} s keeps less than {_MIN_VALIDITY * 1000:g} ms of local "
                f"validity after the drift allowance (ttl * {backend.drift_factor:g} + "
                f"{backend.drift_base * 1000:g} ms)"
            )
        return ttl

    async def inspect(self, name: str) -> LockInfo | None:
        """Who holds ``name`` now (owner identity, seconds left, fence), or None if free."""
        self.backend.check_name(check_name(name))
        self.check_open()
        return await self.backend.inspect(name)

    # -- acquires on their way -------------------------------------------------------

    def acquire_started(self) -> None:
        """An acquire is on its way: aclose() waits for it before closing the backend."""
        self._in_flight += 1

    def acquire_ended(self) -> None:
        """An acquire counted by :meth:`acquire_started` returned or raised."""
        self._in_flight -= 1
        if self._in_flight == 0 and self._drained is not None:
            self._drained.set()

    # -- held leases -----------------------------------------------------------------

    def hold(self, lease: L, claim: Claim, start: float) -> Watch:
        """Register ``lease`` (of ``claim``, granted to a request sent at ``start``) as
        held, and start renewing it; its watchdog entry, the key to :meth:`forget`."""
        watch = self.watchdog.watch(lease, claim, start)
        self._held[watch] = weakref.ref(lease)
        return watch

    def forget(self, watch: Watch) -> None:
        """The lease of ``watch`` left the HELD state: no longer held nor renewed."""
        self._held.pop(watch, None)
        self.watchdog.forget(watch)

    def held(self) -> list[L]:
        """The leases held now, in grant order."""
        return [lease for ref in list(self._held.values()) if (lease := ref()) is not None]

    def count_held(self) -> int:
        """How many leases are held now (collected ones not yet given back included)."""
        return len(self._held)

    def hold_lost(self, claim: Claim) -> None:
        """The backend knows ``claim``'s hold on the server ended: lose its lease (the
        body is cancelled, as on any loss). Rare, so a scan of the held leases."""
        for watch, ref in list(self._held.items()):
            if watch.claim is claim and (lease := ref()) is not None:
                lease.mark_lost("the server ended the session that held the lock")
                return

    def release_dropped(
        self, watch: Watch, claim: Claim, ttl: float, fence: int, watched: bool
    ) -> None:
        """A lease still held was garbage-collected (the application dropped it without
        releasing it): count it released and give its lock back in the background. Called
        soon after, in the coordinator's loop (the collection may run in any thread)."""
        if self._held.pop(watch, None) is None:
            return
        if watched:
            self.watchdog.dropped()
        self.recorder.released(claim.name, fence)
        logger.warning(
            "a lease on %r was dropped without release(): its lock is released now "
            "(release it, or use 'async with')",
            claim.name,
        )
        # Also while closing: aclose() waits for the give-back as for its own (one
        # dropped just before aclose() is no longer among the leases it releases).
        self.release_in_background(claim, ttl)

    # -- background work -------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run a background task that aclose() waits for (bounded); none once aclose()
        has closed them (an acquire that fails after that has nothing left to send on:
        the backend is closing, and what it took ends by its TTL)."""
        self.tasks.spawn_unless_closed(coro, name=name)

    def release_in_background(self, claim: Claim, ttl: float, lease: L | None = None) -> None:
        """Delete ``claim``'s lock on the server in the background, if it still holds it.

        Used after a failed or cancelled release, a dropped lease, a loss, and a grant no
        Lease was made for. Retries with backoff until the server answers or ``ttl`` has
        passed (by then the server dropped the lock itself). A ``lease`` still held when
        the server confirms is marked released.
        """
        self.spawn(self._release_task(claim, ttl, lease), name=f"asynclock-discard:{claim.name}")

    def give_back_in_background(self, claim: Claim, ttl: float, interrupted: Interrupted) -> None:
        """Undo, in the background, what an acquire that stopped without a lease may have
        left on the server (:meth:`Backend.give_back`): its place in a waiter queue after
        :attr:`~Interrupted.ANSWERED` (one bounded try: a place lapses on its own), else
        also a grant that may have landed or may yet land: retried like
        :meth:`release_in_background`, and when the backend says the request may still
        land late (:attr:`GiveBack.late`) and nothing was released, tried again at growing
        intervals (up to 1 s) until ``ttl`` plus that long: a late grant is given back
        within a second of landing. Also while closing: aclose() waits for it (bounded).
        """
        if interrupted is Interrupted.ANSWERED:
            task = self._leave_task(claim)
        else:
            task = self._release_task(claim, ttl, None, interrupted=interrupted)
        self.spawn(task, name=f"asynclock-give-back:{claim.name}")

    async def _leave_task(self, claim: Claim) -> None:
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self.backend.give_back(claim, Interrupted.ANSWERED)
        except (BackendError, TimeoutError) as exc:
            logger.debug("leaving the queue of %r failed (%s); the place lapses", claim.name, exc)

    async def _release_task(
        self,
        claim: Claim,
        ttl: float,
        lease: L | None,
        *,
        interrupted: Interrupted | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        backend = self.backend
        give_up = loop.time() + ttl
        # Until the backend answers, it has not said how late the interrupted request may
        # land: a server silent for the whole TTL may still deliver it when it comes back.
        # Keep trying for the longest lateness it ever reported, and at least another TTL
        # (a grant landing later still is held at most its own TTL, no lease believing in
        # it: a longer look would shorten that by less than a TTL).
        look_until = give_up + max(self._late, ttl) if interrupted is not None else 0.0
        per_try = min(max(ttl / 4, 0.1), 2.0)
        backoff = Backoff(initial=0.05, maximum=1.0)
        polls = Backoff(initial=0.05, maximum=min(1.0, max(ttl / 4, 0.05)), jitter=False)
        attempt = looks = 0
        answered = False
        while True:
            # While closing, a try may take what aclose() grants its background work: a
            # slow link must not turn a give-back into a lock or a queue place left on
            # the server (aclose() cancels what is still running after that).
            closing = self._closed
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT if closing else per_try):
                    if interrupted is None:
                        released, late = await backend.release(claim), 0.0
                    else:
                        released, late = await backend.give_back(claim, interrupted)
            except (BackendError, TimeoutError) as exc:
                delay = backoff.delay(attempt)
                attempt += 1
                if self._closed and not closing:
                    continue  # closing began during this try: one more, with its bound
                if closing or loop.time() + delay >= max(give_up, look_until):
                    # Closing: one failed try is enough, the TTL ends what is left.
                    logger.info(
                        "could not release %r on the server (%s); its TTL ends it", claim.name, exc
                    )
                    return
                await asyncio.sleep(delay)
                continue
            if not answered:
                # The request may land up to ``late`` after the server answers again (at
                # once, usually: then that is ``ttl + late`` after the give-back began).
                answered = True
                self._late = max(self._late, late)
                look_until = max(give_up, loop.time()) + late if late > 0 else 0.0
            if released or self._closed or loop.time() >= look_until:
                if lease is not None:
                    lease.end_after_background_release(released)
                return
            # Nothing there yet: the interrupted acquire may still land. Look again soon
            # (at once when the coordinator closes).
            delay = polls.delay(looks)
            looks += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(delay, look_until - loop.time())):
                    await self._shut.wait()

    # -- elections' observers --------------------------------------------------------

    @contextlib.contextmanager
    def observing(self, mailbox: Mailbox) -> Iterator[None]:
        """An election observer's mailbox, told to look again when the coordinator
        closes (observe() then raises CoordinatorClosed instead of sleeping on)."""
        self._observers.add(mailbox)
        try:
            yield
        finally:
            self._observers.discard(mailbox)

    # -- closing ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Release every lease still held, stop the watchdog, and close the backend: the
        work of :meth:`Coordinator.aclose <asynclock.Coordinator.aclose>` (see there)."""
        closing = self._closing
        if closing is None:
            self.check_loop()
            self._closed = True
            self._shut.set()
            me = asyncio.current_task()
            for lease in self.held():
                if lease.in_body_of(me):
                    lease.end_released()  # its body is the caller: nothing to cancel
                else:
                    lease.mark_lost("the coordinator was closed")
            for slot in list(self.waiting):
                slot.wake()  # waiting acquires see the coordinator closed and raise
            for mailbox in list(self._observers):
                mailbox.put("")  # observers look again, and see it closed
            self.watchdog.close()
            closing = self._closing = asyncio.ensure_future(self._close())
            closing.add_done_callback(_retrieve)
        # Shielded: a cancelled caller (or one whose own lease's loss cancels it) must not
        # stop the close half-way with server connections still open. (Bounded by
        # _close itself.)
        await finish_shielded(closing)

    async def _close(self) -> None:
        """The awaited part of :meth:`aclose`, run once as a task of its own. Acquires on
        their way and background clean-ups share one bound of :data:`_CLOSE_TIMEOUT`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_TIMEOUT
        if self._in_flight and not self.backend.native_wait:
            # A request on its way may still be granted: the acquire then gives it back
            # (a background task, awaited below) while the backend can still send. (A
            # wait in the server's own queue ends with its session, which closing ends.)
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._drained.wait()
        # From then on nothing is started in the background (see spawn).
        await self.tasks.close(max(deadline - loop.time(), 0.0))
        await self.backend.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"held={len(self._held)}"
        return f"<Engine {self.backend.describe()} identity={self.identity!r} {state}>"


def _retrieve(closing: asyncio.Future[None]) -> None:
    """Mark a close's error as seen: every caller of aclose() may have been cancelled."""
    if not closing.cancelled():
        closing.exception()
