"""Blocking :class:`Lock`, :class:`Lease` and :class:`ReadWriteLock`: the async core's,
driven from the coordinator's loop thread.

A thread cannot be cancelled, so a lost lease does not stop its body. What happens
instead: renewals go on in the loop thread while the body works; when the lease is lost
(a renewal refused, or its validity ran out), ``lease.lost`` turns true and
``lease.check()`` raises :class:`~asynclock.LockLost`, the lock's ``on_lost`` callback
runs in a thread of its own, and leaving the ``with`` block raises ``LockLost``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from .._errors import CoordinatorClosed, LockLost, LockNotOwned
from .._lease import Lease as AsyncLease
from .._lock import Lock as AsyncLock
from .._types import ExcType, ExcValue, Traceback
from ._bridge import Bridge, Interrupt

__all__ = ("Lease", "Lock", "LossCallback", "ReadWriteLock")

logger = logging.getLogger("asynclock")

LossCallback = Callable[["Lease"], object]

# The leases each thread holds inside ``with`` blocks (any lock of any coordinator), to
# refuse a thread that would wait for its own lease.
_entered: dict[int, list[Lease]] = {}


class Lease:
    """One holder's hold on a lock, from grant to release or loss (blocking API).

    ``name``, ``token``, ``fence`` (pass it to the resource you protect), ``ttl``,
    ``expires_in``, ``lost``, ``held`` as on :class:`asynclock.Lease`. The lease is renewed
    in the coordinator's loop thread while the caller's thread works. Nothing cancels a
    thread: check ``lost`` or call :meth:`check` between steps of long work.
    """

    __slots__ = ("__weakref__", "_bridge", "_core", "_generation", "_lost_error", "_permit")

    def __init__(
        self,
        bridge: Bridge,
        core: AsyncLease,
        generation: int,
        lost_error: type[LockLost] = LockLost,
        *,
        permit: bool = False,
    ) -> None:
        self._bridge = bridge
        self._core = core
        self._generation = generation
        self._lost_error = lost_error
        self._permit = permit

    @property
    def name(self) -> str:
        """The lock's name."""
        return self._core.name

    @property
    def token(self) -> str:
        """The random owner token of this acquisition."""
        return self._core.token

    @property
    def fence(self) -> int:
        """Strictly greater than the fence of every earlier holder of the name."""
        return self._core.fence

    @property
    def ttl(self) -> float:
        """The lease's length in seconds (what each renewal resets it to)."""
        return self._core.ttl

    @property
    def expires_in(self) -> float:
        """Seconds of local validity left (0 once lost or released)."""
        return 0.0 if self._forked() else self._core.expires_in

    @property
    def lost(self) -> bool:
        """True once the lease was lost: a renewal was refused, or its local validity ran
        out (however busy the loop thread was), or it belongs to the parent of a fork."""
        core = self._core
        if self._forked() or core.lost:
            return True
        return core.held and core.expires_in <= 0

    @property
    def held(self) -> bool:
        """True while the lease is held: neither released nor lost."""
        return not self.lost and self._core.held

    @property
    def reason(self) -> str:
        """Why the lease was lost ("" unless :attr:`lost`)."""
        return self._why() if self.lost else ""

    def check(self) -> None:
        """Return if the lease is still held; raise :class:`~asynclock.LockLost` if it
        was lost (see :attr:`lost`), :class:`~asynclock.LockNotOwned` if it was released.

        Local and cheap (no request): call it between steps of long work, and before
        acting on what the lock protects.
        """
        if self.lost:
            raise self._loss()
        if not self._core.held:
            raise LockNotOwned(
                f"lease on {self.name!r} (fence {self.fence}) was released", name=self.name
            )

    def _loss(self) -> LockLost:
        return self._lost_error(
            f"lease on {self.name!r} (fence {self.fence}) lost: {self._why()}", name=self.name
        )

    def _why(self) -> str:
        if self._forked():
            return "it was acquired by the parent process, before fork()"
        if self._core.lost:
            return self._core.reason or "lost"
        return "its local validity ran out"

    def extend(self, ttl: float | None = None) -> None:
        """Reset the lease to ``ttl`` seconds (default: its ``ttl``) from now; see
        :meth:`asynclock.Lease.extend`."""
        self._check_process()
        self._bridge.call(self._core.extend, ttl)

    def owned(self) -> bool:
        """Ask the server whether this lease still holds the lock."""
        self._check_process()
        return self._bridge.call(self._core.owned)

    def release(self) -> None:
        """Release the lock; see :meth:`asynclock.Lease.release`. An interrupt of the
        calling thread does not stop it half-way: it finishes in the loop thread."""
        self._check_process()
        self._bridge.call(self._core.release, interrupt=Interrupt.FINISH)

    def try_release(self) -> bool:
        """Release the lock; False instead of :class:`~asynclock.LockNotOwned`."""
        self._check_process()
        return self._bridge.call(self._core.try_release, interrupt=Interrupt.FINISH)

    def when_lost(self, callback: LossCallback) -> None:
        """Call ``callback(lease)`` in a thread of its own when this lease is lost (once; at
        once if it already was). Not when it is released. An exception it raises is
        logged."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._check_process()
        self._bridge.call(_add_loss_callback, self, callback)

    # -- for the blocks of this package (Lock, Leadership, the decorators) -------------

    def end_block(
        self,
        exc: BaseException | None,
        finish: Callable[[BaseException | None], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        """Leave a ``with`` block of this lease whose body ended with ``exc`` (None: it
        returned): release (or ``finish(exc)`` in the loop, which does), and raise the
        lease's loss error if it was lost (internal to :mod:`asynclock.sync`).

        A ``KeyboardInterrupt`` or ``SystemExit`` in flight wins, as a cancel does in
        async code: neither a loss nor a failed release replaces it (the release then
        goes on in the background).
        """
        in_flight = isinstance(exc, BaseException) and not isinstance(exc, Exception)
        if in_flight:
            exc = asyncio.CancelledError(f"{type(exc).__name__} in the calling thread")
        core = self._core
        if self._forked():
            if not in_flight:
                raise self._loss() from exc
            return
        try:
            if finish is None:
                self._bridge.call(
                    core.end_block, None, exc, self._lost_error, interrupt=Interrupt.FINISH
                )
            else:
                self._bridge.call(finish, exc, interrupt=Interrupt.FINISH)
        except CoordinatorClosed:
            # Closed meanwhile: the close ended the lease (lost, or released when the
            # close came from inside this block), and the loop can no longer leave it.
            if core.lost and not in_flight:
                raise self._loss() from exc
        except LockLost:
            if not in_flight:
                raise

    def give_back(self) -> None:
        """Give back, in the background, a lease the caller will never hold (an exception
        came between its grant and the caller, or before its block's release was on its
        way): it ends released, quietly, and the lock goes back to the server. A no-op
        once it has ended, while a failed release goes on, and for a lease of the parent
        in a forked child (internal to :mod:`asynclock.sync`)."""
        if self._forked():
            return  # the parent's lease (this is a forked child): never ours to give back
        core = self._core
        self._bridge.thread.spawn(lambda: _end_unheld(core))

    def blocks(self, bridge: Bridge, name: str) -> bool:
        """True if an exclusive or shared acquire of ``name`` on ``bridge``'s coordinator
        would wait for this lease (internal: the re-entry check)."""
        return self._bridge is bridge and self.name == name and not self._permit and self.held

    def core_on(self, bridge: Bridge) -> AsyncLease | None:
        """The async lease behind this one if it is ``bridge``'s (internal: close())."""
        return self._core if self._bridge is bridge else None

    @property
    def inherited(self) -> bool:
        """True in a forked child for a lease of the parent."""
        return self._forked()

    def watch_loss(self, callback: LossCallback) -> None:
        """In the loop: run ``callback(self)`` in a thread of its own when this lease is
        lost. Not in the loop's executor: closing the loop waits for that, and a callback
        may itself close the coordinator, or take long (internal)."""

        def lost(_: AsyncLease) -> None:
            threading.Thread(
                target=_run_callback,
                args=(callback, self),
                name=f"asynclock-on-lost {self.name}",
                daemon=True,
            ).start()

        self._core.when_lost(lost)

    def _forked(self) -> bool:
        return self._generation != self._bridge.generation

    def _check_process(self) -> None:
        if self._forked():
            raise self._loss()

    def __repr__(self) -> str:
        if self.held:
            state = f"expires_in={self.expires_in:.1f}s"
        else:
            state = "lost" if self.lost else "released"
        return f"<asynclock.sync.Lease {self.name!r} fence={self.fence} {state}>"


async def _add_loss_callback(lease: Lease, callback: LossCallback) -> None:
    lease.watch_loss(callback)


class Lock:
    """A named lock with its options; made by :meth:`Coordinator.lock`.

    ``with lock as lease:`` waits for the lock (up to ``timeout``), runs the block, and
    releases; leaving it raises :class:`~asynclock.LockLost` if the lease was lost inside
    (see the module's note: the block is not stopped). ``lease = lock.acquire()`` and
    ``lease.release()`` do the same by hand. One ``Lock`` can be used by many threads;
    each acquisition gets its own :class:`Lease`. Locks are not reentrant.
    """

    __slots__ = ("_bridge", "_core", "_leases", "_made", "_on_lost", "name")

    def __init__(
        self,
        bridge: Bridge,
        make: Callable[[], AsyncLock],
        on_lost: LossCallback | None,
    ) -> None:
        self._bridge = bridge
        self._made = make
        core = make()  # checks the arguments now, in the caller's thread
        self._core = (bridge.generation, core)
        self.name = core.name
        self._on_lost = on_lost
        self._leases: dict[int, Lease] = {}  # the lease of each thread inside ``with``

    def _current(self) -> tuple[int, AsyncLock]:
        generation, core = self._core
        if generation != self._bridge.generation:  # forked: the parent's lock
            generation = self._bridge.generation
            self._core = generation, (core := self._made())
        return generation, core

    @property
    def ttl(self) -> float:
        """The lease length in seconds."""
        return self._core[1].ttl

    @property
    def timeout(self) -> float | None:
        """How long :meth:`acquire` waits (None: until acquired; 0: tries once)."""
        return self._core[1].timeout

    def acquire(self) -> Lease:
        """Wait for the lock (up to ``timeout``) and return the :class:`Lease`.

        Raises :class:`~asynclock.LockTimeout` when ``timeout`` runs out,
        ``BackendError`` at once when the server cannot be reached. An interrupt of the
        calling thread (``KeyboardInterrupt``) gives back whatever the server granted.
        """
        granted: list[Lease] = []
        try:
            return self._acquire(granted)
        except BaseException:
            if granted:  # an interrupt took the lease from the caller: give it back
                granted[0].give_back()
            raise

    def _acquire(self, granted: list[Lease]) -> Lease:
        """Acquire; the lease is also put in ``granted`` in the loop as it is made, so
        that an interrupt landing anywhere after the grant leaves it reachable (the
        caller gives it back)."""
        self._check_reentry()
        generation, core = self._current()
        bridge = self._bridge
        return bridge.call(_acquire, core, bridge, generation, self._on_lost, granted)

    def _check_reentry(self) -> None:
        """Refuse to wait for a lock this thread holds inside ``with``: it would wait for
        its own lease (until the timeout, or forever). Semaphore permits are apart."""
        if self._core[1].limit:
            return
        for lease in _entered.get(threading.get_ident(), ()):
            if lease.blocks(self._bridge, self.name):
                raise RuntimeError(
                    f"lock {self.name!r} is already held by this thread (fence "
                    f"{lease.fence}, in `with`): locks are not reentrant, and taking it "
                    "again would wait for this thread's own lease"
                )

    def __enter__(self) -> Lease:
        ident = threading.get_ident()
        inherited = self._leases.get(ident)
        if inherited is not None and inherited.inherited:
            # Forked inside this thread's block: that block is the parent's, not ours.
            self._forget(ident, inherited)
        if ident in self._leases:
            raise RuntimeError(f"lock {self.name!r} is already held by this thread (not reentrant)")
        granted: list[Lease] = []
        try:
            lease = self._acquire(granted)
            self._leases[ident] = lease
            _entered.setdefault(ident, []).append(lease)
        except BaseException:
            # Interrupted between the grant and the block (the ``with`` never starts, so
            # nothing else would leave it): give the lease back.
            if granted:
                self._forget(ident, granted[0])
                granted[0].give_back()
            raise
        return lease

    def give_back_entered(self) -> None:
        """Give back this thread's lease of this lock's block when the block's exit will
        not run: an exception raised into the thread (Celery's ``SoftTimeLimitExceeded``,
        a ``KeyboardInterrupt``) between the grant and the exit. A no-op once it was left
        (internal to :mod:`asynclock.sync` and its integrations)."""
        ident = threading.get_ident()
        lease = self._leases.get(ident)
        if lease is not None:
            self._forget(ident, lease)
            lease.give_back()

    def _forget(self, ident: int, lease: Lease) -> None:
        if self._leases.get(ident) is lease:
            del self._leases[ident]
        entered = _entered.get(ident)
        if entered is not None and lease in entered:
            entered.remove(lease)
            if not entered:
                del _entered[ident]

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        lease = None
        try:
            ident = threading.get_ident()
            lease = self._leases.get(ident)
            if lease is None:
                raise RuntimeError(f"lock {self.name!r} was not entered by this thread")  # noqa: TRY301
            self._forget(ident, lease)
            lease.end_block(exc)
        except BaseException:
            # Perhaps an exception raised into the thread (a KeyboardInterrupt, Celery's
            # SoftTimeLimitExceeded) before the release was on its way: make sure the
            # lease ends and its lock goes back. A no-op once the release has ended, or
            # when it goes on in the background (it failed), or the lease was lost.
            ident = threading.get_ident()
            lease = lease or self._leases.get(ident)
            if lease is not None:
                self._forget(ident, lease)
                lease.give_back()
            raise

    def __repr__(self) -> str:
        core = self._core[1]
        return (
            f"<asynclock.sync.Lock {self.name!r} ttl={core.ttl:g} timeout={core.timeout!r} "
            f"held_by_threads={len(self._leases)}>"
        )


async def _acquire(
    core: AsyncLock,
    bridge: Bridge,
    generation: int,
    on_lost: LossCallback | None,
    granted: list[Lease],
) -> Lease:
    """Acquire in the loop; a loss reaches ``on_lost`` from the grant on (no gap). The
    lease goes into ``granted`` in the same step as the grant returns here."""
    lease = Lease(bridge, await core.acquire(), generation, permit=core.limit > 0)
    granted.append(lease)
    if on_lost is not None:
        lease.watch_loss(on_lost)
    return lease


async def _end_unheld(core: AsyncLease) -> None:
    if core.held and not core.releasing:  # (ended meanwhile, or a release goes on)
        core.end_released()


def _run_callback(callback: LossCallback, lease: Lease) -> None:
    try:
        callback(lease)
    except Exception:
        logger.exception("the loss callback of %r (fence %d) raised", lease.name, lease.fence)


class ReadWriteLock:
    """A read-write lock; made by :meth:`Coordinator.rwlock`.

    ``with rw.read() as lease:`` holds a shared lease (readers overlap),
    ``with rw.write() as lease:`` an exclusive one; writers are preferred.
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
        return f"<asynclock.sync.ReadWriteLock {self.name!r} ttl={self._write.ttl:g}>"


def make_lease(
    bridge: Bridge, core: AsyncLease, generation: int, lost_error: type[LockLost]
) -> Lease:
    """A blocking lease on ``core`` (for the election's terms)."""
    return Lease(bridge, core, generation, lost_error)


def entered_by(ident: int, bridge: Bridge) -> list[AsyncLease]:
    """The async leases behind the ``with`` blocks thread ``ident`` is inside, on
    ``bridge``'s coordinator (a close from inside them releases them)."""
    cores = (lease.core_on(bridge) for lease in _entered.get(ident, ()))
    return [core for core in cores if core is not None]
