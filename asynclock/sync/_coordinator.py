"""Blocking ``connect()`` and :class:`Coordinator`: the async coordinator, driven from a
loop thread of its own (see :mod:`asynclock.sync`)."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, Self, TypeVar

from .._backoff import Backoff
from .._coordinator import Coordinator as AsyncCoordinator
from .._coordinator import connect as async_connect
from .._lease import Lease as AsyncLease
from .._lock import Lock as AsyncLock
from .._lock import ReadWriteLock as AsyncReadWriteLock
from .._stats import CoordinatorStats
from .._types import ExcType, ExcValue, Traceback
from ..backends.base import Backend, LockInfo
from . import _decorators
from ._bridge import Bridge
from ._election import Election
from ._lock import Lease, Lock, LossCallback, ReadWriteLock, entered_by

__all__ = ("Coordinator", "connect")

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Coordinator:
    """Locks on one backend for threads and plain functions: the blocking twin of
    :class:`asynclock.Coordinator`.

    One event loop, in a daemon thread of its own (started on first use), runs the async
    coordinator: its renewals go on while the calling threads work. The coordinator is
    safe to share between threads. After ``fork()`` a coordinator from :func:`connect`
    makes a fresh loop and fresh connections in the child on first use (one made from a
    backend object raises ``RuntimeError`` there). Use it as a context manager, or call
    :meth:`close`; at interpreter exit, coordinators still open are closed.
    """

    def __init__(
        self, backend: Backend, *, identity: str | None = None, telemetry: bool | None = None
    ) -> None:
        self._bridge = Bridge(
            AsyncCoordinator(backend, identity=identity, telemetry=telemetry), None
        )
        _open.add(self)

    @classmethod
    def _connected(cls, rebuild: Callable[[], AsyncCoordinator]) -> Coordinator:
        coord = cls.__new__(cls)
        coord._bridge = Bridge(rebuild(), rebuild)
        _open.add(coord)
        return coord

    @property
    def identity(self) -> str:
        """This coordinator's name in ``inspect()`` results, and its candidates' identity."""
        return self._bridge.core().identity

    @identity.setter
    def identity(self, identity: str) -> None:
        self._bridge.core().identity = identity

    @property
    def backend(self) -> Backend:
        """The backend this coordinator's locks live on (in this process)."""
        return self._bridge.core().backend

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._bridge.closed

    def lock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
        shared: bool = False,
        fair: bool = False,
        on_lost: LossCallback | None = None,
    ) -> Lock:
        """A lock on ``name``; use ``with coord.lock(name) as lease:``.

        The arguments are :meth:`asynclock.Coordinator.lock`'s, plus ``on_lost``: a
        function called with the lease, in a thread of its own, if the lease is lost. A thread
        cannot be cancelled, so ``cancel_on_lost`` changes nothing here (it is accepted
        so that code moves between the two APIs unchanged): a lost lease's block runs on,
        ``lease.lost`` turns true, ``lease.check()`` raises, and leaving the block raises
        :class:`~asynclock.LockLost`.
        """
        _check_on_lost(on_lost)
        bridge = self._bridge

        def make() -> AsyncLock:
            return bridge.core().lock(
                name,
                ttl=ttl,
                timeout=timeout,
                renew=renew,
                cancel_on_lost=cancel_on_lost,
                retry=retry,
                shared=shared,
                fair=fair,
            )

        return Lock(bridge, make, on_lost)

    def semaphore(
        self,
        name: str,
        limit: int,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
        on_lost: LossCallback | None = None,
    ) -> Lock:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once; see
        :meth:`asynclock.Coordinator.semaphore` and :meth:`lock`."""
        _check_on_lost(on_lost)
        bridge = self._bridge

        def make() -> AsyncLock:
            return bridge.core().semaphore(
                name,
                limit,
                ttl=ttl,
                timeout=timeout,
                renew=renew,
                cancel_on_lost=cancel_on_lost,
                retry=retry,
            )

        return Lock(bridge, make, on_lost)

    def rwlock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
        on_lost: LossCallback | None = None,
    ) -> ReadWriteLock:
        """A read-write lock: ``with rw.read():`` shares ``name`` with other readers,
        ``with rw.write():`` excludes everyone; see :meth:`asynclock.Coordinator.rwlock`."""
        _check_on_lost(on_lost)
        bridge = self._bridge

        def make_both() -> AsyncReadWriteLock:
            return bridge.core().rwlock(
                name,
                ttl=ttl,
                timeout=timeout,
                renew=renew,
                cancel_on_lost=cancel_on_lost,
                retry=retry,
            )

        make_both()  # checks the arguments now

        def side(read: bool) -> Lock:
            def make() -> AsyncLock:
                both = make_both()
                return both.read() if read else both.write()

            return Lock(bridge, make, on_lost)

        return ReadWriteLock(name, side(True), side(False))

    def election(
        self,
        name: str,
        *,
        ttl: float = 10.0,
        identity: str | None = None,
        retry: Backoff | None = None,
    ) -> Election:
        """Leader election ``name`` among every candidate that uses it; see
        :meth:`asynclock.Coordinator.election`."""
        bridge = self._bridge
        return Election(
            bridge, lambda: bridge.core().election(name, ttl=ttl, identity=identity, retry=retry)
        )

    def singleton(
        self, template: str, *, ttl: float = 60.0
    ) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
        """Decorate a plain function to run only if no other call with the same lock name
        is running (anywhere): otherwise the call is skipped and returns None. The name
        comes from ``template`` formatted with the call's arguments (``"report:{day}"``).
        """
        return _decorators.singleton(self, template, ttl=ttl)

    def locked(
        self, template: str, *, ttl: float = 30.0, timeout: float | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorate a plain function to run under the lock named by ``template``, waiting
        up to ``timeout`` for it (then :class:`~asynclock.LockTimeout`)."""
        return _decorators.locked(self, template, ttl=ttl, timeout=timeout)

    def inspect(self, name: str) -> LockInfo | None:
        """Who holds ``name`` now (owner identity, seconds left, fence), or None if free."""
        return self._bridge.call(self._bridge.core().inspect, name)

    def is_locked(self, name: str) -> bool:
        """True if someone holds ``name`` now."""
        return self.inspect(name) is not None

    def stats(self) -> CoordinatorStats:
        """Counters since this coordinator began, gauges now, latency summaries."""
        stats: CoordinatorStats = self._bridge.call(_in_loop, self._bridge.core().stats)
        return stats

    @property
    def held(self) -> list[Lease]:
        """The leases this coordinator holds now (as blocking leases)."""
        bridge = self._bridge
        generation = bridge.generation
        held = bridge.call(_in_loop, lambda: bridge.core().held)
        return [Lease(bridge, lease, generation) for lease in held]

    @property
    def aio(self) -> AsyncCoordinator:
        """The :class:`asynclock.Coordinator` this one drives (in this process). It lives
        in the loop thread: use it there only, through :meth:`call`."""
        return self._bridge.core()

    def call(self, function: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run the coroutine function ``function(*args)`` on this coordinator's loop
        thread and return its result (or raise its exception): for the async API where
        the blocking one has no twin, ``coord.call(coord.aio.inspect, "jobs:42")``. An
        interrupt of the calling thread cancels it."""
        return self._bridge.call(function, *args)

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Release every lease still held, stop the watchdog and the loop thread, and
        close what :func:`connect` opened. Idempotent.

        Leases held by other threads' blocks are lost (those blocks raise
        :class:`~asynclock.LockLost` when they end); a lease whose block is the calling
        thread's is released, and its block ends without error. Bounded as
        :meth:`asynclock.Coordinator.aclose` is. An interrupt of the calling thread does
        not stop the close half-way.
        """
        bridge = self._bridge
        own: list[AsyncLease] = []
        try:
            own = entered_by(threading.get_ident(), bridge)
        finally:
            # However the line above was interrupted: the close runs (to its end).

            async def end_own() -> None:
                for lease in own:
                    lease.end_released()  # its block is the caller: nothing to cancel

            bridge.close(end_own if own else None)
            _open.discard(self)

    def __enter__(self) -> Self:
        if self._bridge.closed:
            from .._errors import CoordinatorClosed  # noqa: PLC0415 - rare path

            raise CoordinatorClosed("this Coordinator is closed")
        return self

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        self.close()

    def __repr__(self) -> str:
        bridge = self._bridge
        state = "closed" if bridge.closed else "open"
        return f"<asynclock.sync.Coordinator identity={bridge.identity!r} {state}>"


async def _in_loop(function: Callable[[], T]) -> T:
    """``function()`` in the loop thread: what reads the engine's state, which only that
    thread changes."""
    return function()


def _check_on_lost(on_lost: object) -> None:
    if on_lost is not None and not callable(on_lost):
        raise TypeError(f"on_lost must be a function taking the lease, got {on_lost!r}")


def connect(target: str | Sequence[str], **options: Any) -> Coordinator:
    """A blocking :class:`Coordinator` for a URL (or a list of Redis URLs: Redlock):
    the targets and options of :func:`asynclock.connect`, with its errors. No I/O and no
    thread until the first use.
    """
    if not isinstance(target, str) and isinstance(target, list):
        target = list(target)

    def rebuild() -> AsyncCoordinator:
        return async_connect(target, **dict(options))

    return Coordinator._connected(rebuild)


# Coordinators not closed yet: closed at interpreter exit (their leases released, not
# left to their TTLs).
_open: weakref.WeakSet[Coordinator] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for coord in list(_open):
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            coord.close()
