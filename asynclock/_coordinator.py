"""``connect()`` and :class:`Coordinator`: the entry point that builds locks and owns the
watchdog, the background clean-ups and the backend."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib.util
import inspect
import itertools
import logging
import weakref
from collections.abc import Callable, Collection, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar
from urllib.parse import urlsplit

from . import _decorators
from ._backoff import Backoff
from ._election import Election, check_election, default_identity
from ._errors import BackendError, CoordinatorClosed
from ._lock import Lease, Lock, ReadWriteLock
from ._stats import CoordinatorStats, Recorder
from ._tasks import TaskSet
from ._validate import check_name, check_timeout, check_ttl
from ._wakeup import Mailbox, WakeSlot
from ._watchdog import Watchdog
from .backends.base import Backend, Claim, LockInfo
from .backends.memory import MemoryBackend

__all__ = ("Coordinator", "connect")

logger = logging.getLogger("asynclock")

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT_RETRY = Backoff()
# Permits of one semaphore: each is a member of a set the acquire scans.
_MAX_PERMITS = 10_000
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_SCHEMES = (
    "memory",
    *_REDIS_SCHEMES,
    "redis+sentinel",
    "redis+cluster",
    "postgresql",
    "postgres",
)
# How long aclose() waits for releases and clean-ups still in flight.
_CLOSE_TIMEOUT = 5.0
# The least local validity a lease may have (see Coordinator._check_validity).
_MIN_VALIDITY = 0.001


class Coordinator:
    """Locks on one backend, with one watchdog for all of their leases.

    ``Coordinator(backend)`` wraps a backend built from clients the application owns
    (they are not closed by :meth:`aclose`); :func:`connect` builds both from a URL.
    ``identity`` names this coordinator in ``inspect()`` results and is the identity of
    its elections' candidates unless :meth:`election` is given one (default
    ``host:pid:random``). ``telemetry``: OpenTelemetry metrics and spans when
    ``opentelemetry-api`` is installed (None, the default), never (False). Use it as an
    async context manager, or call :meth:`aclose`.
    """

    def __init__(
        self, backend: Backend, *, identity: str | None = None, telemetry: bool | None = None
    ) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend must be an asynclock.backends.Backend, got {type(backend).__name__}"
            )
        if identity is not None:
            check_name(identity, "identity")
        self._backend = backend
        self.identity = identity or default_identity()
        # The leases held now, by a key of their own, in grant order. Weak: a lease the
        # application dropped without releasing it is collected, and its lock given back
        # (Lease.__del__ and _release_dropped).
        self._held: dict[int, weakref.ref[Lease]] = {}
        self._keys = itertools.count()
        self._tasks = TaskSet(f"coordinator {self.identity!r}")
        # Wake-up slots of this coordinator's waiting acquires, and the mailboxes of its
        # elections' observers: woken by aclose().
        self._waiting: set[WakeSlot] = set()
        self._observers: set[Mailbox] = set()
        self._recorder = Recorder(type(backend).__name__, telemetry)
        self._watchdog = Watchdog(backend, self._spawn, self._recorder)
        self._closed = False
        self._shut = asyncio.Event()  # set by aclose()
        # The close on its way (see aclose): every aclose() call waits for this one.
        self._closing: asyncio.Future[None] | None = None
        # The event loop of the first use: asyncio objects (connections, pools, timers)
        # belong to one loop, so a use from another one fails at once (_check_open).
        self._loop: asyncio.AbstractEventLoop | None = None
        # Acquires on their way: aclose() lets them give back what they were granted
        # before it closes the backend.
        self._in_flight = 0
        self._drained: asyncio.Event | None = None
        # The backend tells us when a hold certainly ended on the server (a PostgreSQL
        # session that died): that lease is lost now, not at its next renewal.
        backend.on_hold_lost(self._hold_lost)

    @property
    def backend(self) -> Backend:
        """The backend this coordinator's locks live on."""
        return self._backend

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` was called."""
        return self._closed

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
    ) -> Lock:
        """A lock on ``name``; use ``async with coord.lock(name) as lease:``.

        - ``ttl``: lease length in seconds (finite, > 0); every lease has one.
        - ``timeout``: ``None`` waits until acquired, ``0`` tries once, ``> 0`` waits at
          most that long; then :class:`~asynclock.LockTimeout`.
        - ``renew``: extend the lease every ``ttl/3`` while it is held.
        - ``cancel_on_lost``: cancel the body when the lease is lost; ``async with`` then
          raises :class:`~asynclock.LockLost`. With False the body runs on, ``lease.lost``
          turns true and leaving the block raises ``LockLost``.
        - ``retry``: the :class:`Backoff` between attempts when no wake-up comes.
        - ``shared``: a shared (reader) lease, where the backend supports it; see
          :meth:`rwlock`.
        - ``fair``: first come, first served: waiters get the lock in the order they
          first tried, and a release wakes the first in line only. A waiter that dies
          keeps its place until its backoff's maximum plus a second has passed.

        Raises ``TypeError``/``ValueError`` at once for bad arguments.
        """
        common = self._check(name, ttl, timeout, retry, renew, cancel_on_lost, shared, fair)
        if shared:
            self._require("supports_shared", "shared=True")
        if fair and shared:
            raise ValueError("fair=True is for exclusive locks, not shared=True")
        if fair:
            self._require("supports_fair", "fair=True")
        return Lock(self, name, **common, shared=shared, fair=fair)

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
    ) -> Lock:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once.

        ``async with coord.semaphore("api-quota", 5) as permit:`` — each permit is a
        :class:`Lease` like a lock's: its own TTL, renewal, fence, loss and cancellation;
        a crashed holder's permit expires with its TTL. Every holder of one semaphore
        must use the same ``limit``. The other arguments are :meth:`lock`'s. Semaphores
        live apart from locks of the same name.
        """
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, got {type(limit).__name__}")
        if not 1 <= limit <= _MAX_PERMITS:
            raise ValueError(f"limit must be from 1 to {_MAX_PERMITS}, got {limit}")
        common = self._check(name, ttl, timeout, retry, renew, cancel_on_lost)
        self._require("supports_semaphore", "semaphores")
        return Lock(self, name, **common, shared=False, limit=limit)

    def rwlock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
    ) -> ReadWriteLock:
        """A read-write lock: ``async with rw.read():`` shares ``name`` with other
        readers, ``async with rw.write():`` excludes everyone.

        Writers are preferred: once a writer waits, new readers wait behind it, so a
        steady stream of readers cannot starve it; it gets in as soon as the readers
        already inside have left (or their leases ended). The arguments are
        :meth:`lock`'s, for both sides.
        """
        common = self._check(name, ttl, timeout, retry, renew, cancel_on_lost)
        self._require("supports_shared", "read-write locks")
        read, write = (Lock(self, name, **common, shared=shared) for shared in (True, False))
        return ReadWriteLock(name, read, write)

    def _check(
        self,
        name: object,
        ttl: object,
        timeout: object,
        retry: Backoff | None,
        *flags: bool,
    ) -> dict[str, Any]:
        """Validate what every lock-like object takes; the Lock arguments they share."""
        self._backend.check_name(check_name(name))
        names = ("renew", "cancel_on_lost", "shared", "fair")
        for flag, value in zip(names, flags, strict=False):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
        if retry is None:
            retry = _DEFAULT_RETRY
        elif not isinstance(retry, Backoff):
            raise TypeError(f"retry must be an asynclock.Backoff, got {type(retry).__name__}")
        return {
            "ttl": self._check_validity(check_ttl(ttl)),
            "timeout": check_timeout(timeout),
            "renew": flags[0],
            "cancel_on_lost": flags[1],
            "retry": retry,
        }

    def _check_validity(self, ttl: float) -> float:
        """``ttl`` if a lease of it keeps at least 1 ms of local validity on this backend,
        else ValueError.

        A lease is believed valid for ``ttl - drift(ttl)``: with (next to) nothing left,
        every grant would come too late to hand over and be given back, and a waiting
        acquire would retry forever (thousands of commands a second).
        """
        backend = self._backend
        if ttl - backend.drift(ttl) < _MIN_VALIDITY:
            least = (backend.drift_base + _MIN_VALIDITY) / (1 - backend.drift_factor)
            raise ValueError(
                f"ttl must be at least {least * 1000:.2f} ms on {backend.describe()}: a "
                f"lease of {ttl!r} s keeps less than {_MIN_VALIDITY * 1000:g} ms of local "
                f"validity after the drift allowance (ttl * {backend.drift_factor:g} + "
                f"{backend.drift_base * 1000:g} ms)"
            )
        return ttl

    def _require(self, flag: str, what: str) -> None:
        if not getattr(self._backend, flag):
            raise ValueError(
                f"{what} {'is' if what.endswith('True') else 'are'} not supported by "
                f"{type(self._backend).__name__} (supported: memory, Redis, PostgreSQL)"
            )

    def election(
        self,
        name: str,
        *,
        ttl: float = 10.0,
        identity: str | None = None,
        retry: Backoff | None = None,
    ) -> Election:
        """Leader election ``name`` among every candidate that uses it.

        ``ttl``: a term lasts that long without renewal (a crashed leader is replaced
        within about ``ttl``); ``identity``: what :meth:`Election.leader` reports for this
        candidate (default: this coordinator's :attr:`identity`); ``retry``: the backoff
        between attempts.
        """
        name, seconds, who = check_election(name, ttl, identity)
        who = self.identity if who is None else who
        self._check_validity(seconds)
        if retry is not None and not isinstance(retry, Backoff):
            raise TypeError(f"retry must be an asynclock.Backoff, got {type(retry).__name__}")
        return Election(self, name, ttl=seconds, identity=who, retry=retry or _DEFAULT_RETRY)

    def singleton(
        self, template: str, *, ttl: float = 60.0
    ) -> Callable[
        [Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R | None]]
    ]:
        """Decorate an ``async def`` to run only if no other call with the same lock name
        is running (anywhere): otherwise the call is skipped and returns None.

        The name comes from ``template`` formatted with the call's arguments, defaults
        included (``"report:{day}"``); a field that is not a parameter of the function
        is a ``ValueError`` when decorating.
        """
        return _decorators.singleton(self, template, ttl=ttl)

    def locked(
        self, template: str, *, ttl: float = 30.0, timeout: float | None = None
    ) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
        """Decorate an ``async def`` to run under the lock named by ``template`` (formatted
        with the call's arguments), waiting up to ``timeout`` for it (then
        :class:`~asynclock.LockTimeout`)."""
        return _decorators.locked(self, template, ttl=ttl, timeout=timeout)

    async def inspect(self, name: str) -> LockInfo | None:
        """Who holds ``name`` now (owner identity, seconds left, fence), or None if free."""
        self._backend.check_name(check_name(name))
        self._check_open()
        return await self._backend.inspect(name)

    async def is_locked(self, name: str) -> bool:
        """True if someone holds ``name`` now."""
        return await self.inspect(name) is not None

    def stats(self) -> CoordinatorStats:
        """Counters since this coordinator began, gauges now, latency summaries."""
        return self._recorder.snapshot(len(self._held))

    @property
    def held(self) -> list[Lease]:
        """The leases this coordinator holds now."""
        return [lease for ref in list(self._held.values()) if (lease := ref()) is not None]

    # -- lifecycle -------------------------------------------------------------------

    async def aclose(self) -> None:
        """Release every lease still held, stop the watchdog, and close what
        :func:`connect` opened. Idempotent.

        The bodies of other tasks' leases are cancelled as on loss (their blocks raise
        :class:`~asynclock.LockLost`); a lease whose own body calls ``aclose()`` is
        released instead, and its block ends without error. The close runs to its end
        even if the call is cancelled, and a later ``aclose()`` waits for it. It is
        bounded: about 5 s for acquires and releases still in flight, then the backend's
        own close (up to its request or socket timeout more, over a server that stopped
        answering). Raises ``RuntimeError`` when called from another event loop than the
        coordinator's.
        """
        closing = self._closing
        if closing is None:
            self._check_loop()
            self._closed = True
            self._shut.set()
            me = asyncio.current_task()
            for lease in self.held:
                if lease._in_body and lease._task is me:
                    lease._end_by_own_close()  # its body is the caller: nothing to cancel
                else:
                    lease._lose("the coordinator was closed")
            for slot in list(self._waiting):
                slot._wake()  # waiting acquires see the coordinator closed and raise
            for mailbox in list(self._observers):
                mailbox.put("")  # observers look again, and see it closed
            self._watchdog.close()
            closing = self._closing = asyncio.ensure_future(self._close())
            closing.add_done_callback(_retrieve)
        # Shielded: a cancelled caller (or one whose own lease's loss cancels it) must not
        # stop the close half-way with server connections still open.
        await asyncio.shield(closing)

    async def _close(self) -> None:
        """The awaited part of :meth:`aclose`, run once as a task of its own. Acquires on
        their way and background clean-ups share one bound of :data:`_CLOSE_TIMEOUT`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_TIMEOUT
        if self._in_flight and not self._backend.native_wait:
            # A request on its way may still be granted: the acquire then gives it back
            # (a background task, awaited below) while the backend can still send. (A
            # wait in the server's own queue ends with its session, which closing ends.)
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._drained.wait()
        # From then on nothing is started in the background (see _spawn).
        await self._tasks.close(max(deadline - loop.time(), 0.0))
        await self._backend.aclose()

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"held={len(self._held)}"
        return f"<Coordinator {self._backend.describe()} identity={self.identity!r} {state}>"

    # -- for Lock, Lease and Watchdog --------------------------------------------------

    @contextlib.contextmanager
    def _observing(self, mailbox: Mailbox) -> Iterator[None]:
        """An election observer's mailbox, told to look again when the coordinator
        closes (observe() then raises CoordinatorClosed instead of sleeping on)."""
        self._observers.add(mailbox)
        try:
            yield
        finally:
            self._observers.discard(mailbox)

    def _acquire_ended(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and self._drained is not None:
            self._drained.set()

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed("this Coordinator is closed")
        self._check_loop()

    def _check_loop(self) -> None:
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

    def _hold(self, lease: Lease, start: float) -> None:
        key = lease._key = next(self._keys)
        self._held[key] = weakref.ref(lease)
        self._watchdog.watch(lease, start)

    def _hold_lost(self, claim: Claim) -> None:
        """The backend knows ``claim``'s hold on the server ended: lose its lease (the
        body is cancelled, as on any loss). Rare, so a scan of the held leases."""
        for lease in self.held:
            if lease._claim is claim:
                lease._lose("the server ended the session that held the lock")
                return

    def _forget(self, lease: Lease) -> None:
        self._held.pop(lease._key, None)
        self._watchdog.forget(lease)

    def _release_dropped(
        self, key: int, claim: Claim, ttl: float, fence: int, watched: bool
    ) -> None:
        """A lease still held was garbage-collected (the application dropped it without
        releasing it): count it released and give its lock back in the background. Called
        soon after, in the coordinator's loop (the collection may run in any thread)."""
        if self._held.pop(key, None) is None:
            return
        if watched:
            self._watchdog.dropped()
        self._recorder.released(claim.name, fence)
        logger.warning(
            "a lease on %r was dropped without release(): its lock is released now "
            "(release it, or use 'async with')",
            claim.name,
        )
        # Also while closing: aclose() waits for the give-back as for its own (one
        # dropped just before aclose() is no longer among the leases it releases).
        self._discard(claim, ttl)

    def _spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run a background task that aclose() waits for (bounded); none once aclose()
        has closed them (an acquire that fails after that has nothing left to send on:
        the backend is closing, and what it took ends by its TTL)."""
        self._tasks.spawn_unless_closed(coro, name=name)

    def _discard(
        self,
        claim: Claim,
        ttl: float,
        lease: Lease | None = None,
        *,
        in_flight: bool = False,
        error: BaseException | None = None,
    ) -> None:
        """Delete ``claim``'s lock on the server in the background, if it still holds it.

        Used after a cancelled or failed acquire (the grant may have landed), a failed or
        cancelled release, and a loss. Retries with backoff until the server answers or
        ``ttl`` has passed (by then the server dropped the lock itself). A ``lease``
        still held when the server confirms is marked released.

        ``in_flight``: the acquire request was interrupted on its way. It may have joined
        a waiter queue (left here too), and on a backend whose requests can overtake each
        other (:meth:`Backend.straggle` > 0: a reconnect, another pooled connection, a
        proxy) it may still land after this release found nothing. Then the give-back
        looks again at growing intervals (up to 1 s) for ``ttl`` plus that straggle
        time: a late grant is given back within a second of landing. Not after a plain
        cancel on a connection that keeps order (``error``; the pipelined Redis link).
        """
        backend = self._backend
        ordered = isinstance(error, asyncio.CancelledError) and backend.ordered_after_cancel()
        straggle = backend.straggle() if in_flight and not ordered else 0.0
        self._spawn(
            self._discard_task(claim, ttl, lease, in_flight=in_flight, straggle=straggle),
            name=f"asynclock-discard:{claim.name}",
        )

    def _leave(self, claim: Claim) -> None:
        """Leave the waiter queue ``claim`` joined, in the background (a waiter that
        stopped before it could wait: its place would keep others out until it lapses).
        Also while closing: aclose() waits for it (bounded) before closing the backend."""
        self._spawn(self._leave_task(claim), name=f"asynclock-leave:{claim.name}")

    async def _leave_task(self, claim: Claim) -> None:
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self._backend.leave(claim)
        except (BackendError, TimeoutError) as exc:
            logger.debug("leaving the queue of %r failed (%s); the place lapses", claim.name, exc)

    async def _discard_task(
        self,
        claim: Claim,
        ttl: float,
        lease: Lease | None,
        *,
        in_flight: bool = False,
        straggle: float = 0.0,
    ) -> None:
        loop = asyncio.get_running_loop()
        backend = self._backend
        give_up = loop.time() + ttl
        look_until = give_up + straggle if straggle > 0 else 0.0
        per_try = min(max(ttl / 4, 0.1), 2.0)
        backoff = Backoff(initial=0.05, maximum=1.0)
        polls = Backoff(initial=0.05, maximum=min(1.0, max(ttl / 4, 0.05)), jitter=False)
        attempt = looks = 0
        while True:
            # While closing, a try may take what aclose() grants its background work: a
            # slow link must not turn a give-back into a lock or a queue place left on
            # the server (aclose() cancels what is still running after that).
            closing = self._closed
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT if closing else per_try):
                    if in_flight:
                        # The attempt may also have joined the waiter queue: leave it in
                        # the same round trip (after the release, on a pipelined link).
                        released, _ = await asyncio.gather(
                            backend.release(claim), backend.leave(claim)
                        )
                    else:
                        released = await backend.release(claim)
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
            if released or self._closed or loop.time() >= look_until:
                if lease is not None:
                    lease._end_after_discard(released)
                return
            # Nothing there yet: the interrupted acquire may still land. Look again soon
            # (at once when the coordinator closes).
            delay = polls.delay(looks)
            looks += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(delay, look_until - loop.time())):
                    await self._shut.wait()


def _retrieve(closing: asyncio.Future[None]) -> None:
    """Mark a close's error as seen: every caller of aclose() may have been cancelled."""
    if not closing.cancelled():
        closing.exception()


def _scheme(url: str) -> str:
    return urlsplit(url).scheme.lower() if "://" in url else ""


def _keywords(*functions: Callable[..., Any]) -> set[str]:
    """The keyword parameters of ``functions``."""
    names: set[str] = set()
    for function in functions:
        names.update(
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
    return names


def _check_options(
    what: str,
    options: dict[str, Any],
    ours: Collection[str],
    theirs: Collection[str] = (),
    driver: str = "",
) -> None:
    """TypeError naming each of ``options`` that is neither ``ours`` (asynclock's) nor
    ``theirs`` (``driver``'s), with the closest accepted name and every accepted one:
    otherwise a typo reaches the driver and fails there, in its words."""
    accepted = {"identity", *ours, *theirs}
    unknown = sorted(set(options) - accepted)
    if not unknown:
        return
    guesses = [
        f"{name!r} (did you mean {close[0]!r}?)"
        if (close := difflib.get_close_matches(name, accepted, n=1))
        else repr(name)
        for name in unknown
    ]
    listed = f"asynclock's: {', '.join(sorted({'identity', *ours}))}"
    if theirs:
        listed += f"; {driver}'s: {', '.join(sorted(set(theirs) - set(ours)))}"
    raise TypeError(
        f"unknown option{'s' if len(unknown) > 1 else ''} for {what}: {', '.join(guesses)}"
        f" (accepted: {listed})"
    )


def _need_driver(module: str, extra: str, what: str) -> None:
    """``ModuleNotFoundError`` saying which extra to install if ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{what} needs the {module} package, which is not installed: "
            f"pip install 'asynclock[{extra}]'",
            name=module,
        )


def _connect_redlock(urls: list[object], options: dict[str, Any]) -> Coordinator:
    for url in urls:
        if not isinstance(url, str):
            raise TypeError(f"Redlock targets must be URL strings, got {type(url).__name__}")
        if _scheme(url) not in _REDIS_SCHEMES:
            raise ValueError(
                f"Redlock nodes must be redis://, rediss:// or unix:// URLs, got scheme "
                f"{_scheme(url)!r}"
            )
    _need_driver("redis", "redis", "Redlock")
    from .backends.redis import backend_options  # noqa: PLC0415 - as for one node
    from .backends.redlock import RedlockBackend  # noqa: PLC0415 - redis-py loads on first use

    ours = {"node_timeout", *_keywords(RedlockBackend.__init__, RedlockBackend.from_urls)}
    ours -= {"self", "cls", "clients", "urls"}
    theirs: set[str] = set()
    for url in urls:
        theirs |= backend_options(str(url))[1]
    _check_options("Redlock", options, ours, theirs, "redis-py")
    identity = options.pop("identity", None)
    backend = RedlockBackend.from_urls([str(url) for url in urls], **options)
    return Coordinator(backend, identity=identity)


def connect(target: str | Sequence[str], **options: Any) -> Coordinator:
    """A :class:`Coordinator` for a URL. No I/O happens until the first use.

    ``memory://`` and ``memory://NAME`` (in-process; the same NAME shares one lock table),
    ``redis://``, ``rediss://`` and ``unix://`` (one Redis/Valkey node),
    ``redis+sentinel://host:port,host:port/service`` (the master Sentinel names),
    ``redis+cluster://host:port`` (Redis Cluster),
    ``postgresql://`` and ``postgres://`` (PostgreSQL advisory locks). ``options``:
    ``identity``, ``drift_factor``, ``drift_base``; for Redis ``prefix``,
    ``fence_retention``, ``sync_replicas`` and ``sync_timeout`` (not on Cluster),
    ``max_connections`` (default 64) and redis-py pool options; for
    PostgreSQL ``namespace``, ``schema``, ``fence_sequence``, ``max_connections`` (default
    32) and ``asyncpg.create_pool`` options. A list of Redis URLs (3 or more) is Redlock
    over those independent nodes, with ``node_timeout`` (default 0.05 s) and the Redis
    options. The coordinator closes what it opened in
    :meth:`Coordinator.aclose`.

    Raises ``TypeError`` for a target that is neither a URL nor a list of them, or for
    unknown options; ``ValueError`` for an unsupported scheme or fewer than 3 Redlock
    nodes; ``ModuleNotFoundError`` naming the extra to install when the URL's driver is
    missing (``asynclock[redis]`` brings redis-py, ``asynclock[postgres]`` asyncpg).
    """
    if not isinstance(target, str):
        given: object = target  # checked at run time, whatever the annotation says
        if isinstance(given, list | tuple):
            return _connect_redlock(list(given), options)
        raise TypeError(
            f"target must be a URL string or a list of Redis URLs, got {type(target).__name__}"
        )
    scheme = _scheme(target)
    if scheme not in _SCHEMES:
        shown = f"scheme {scheme!r}" if scheme else "a URL without a scheme"
        raise ValueError(
            f"unsupported target: {shown} (accepted: {', '.join(s + '://' for s in _SCHEMES)}, "
            "or a list of redis:// URLs for Redlock)"
        )
    identity = options.pop("identity", None)
    backend: Backend
    if scheme == "memory":
        _check_options("memory://", options, ("drift_factor", "drift_base"))
        backend = MemoryBackend.shared(target.split("://", 1)[1], **options)
    elif scheme in ("postgresql", "postgres"):
        # Each driver loads when a URL first needs it: Redis users never import asyncpg,
        # PostgreSQL users never import redis-py.
        _need_driver("asyncpg", "postgres", f"{scheme}://")
        import asyncpg  # noqa: PLC0415 - see above

        from .backends.postgres import PostgresBackend  # noqa: PLC0415 - see above

        ours = _keywords(PostgresBackend.__init__, PostgresBackend.from_dsn) - {"self", "pool"}
        # What from_dsn() sets itself is not the caller's to pass.
        theirs = _keywords(asyncpg.create_pool, asyncpg.connect)
        theirs -= {"dsn", "min_size", "max_size", "reset", "loop", "connect_kwargs"}
        _check_options(f"{scheme}://", options, ours - {"dsn"}, theirs, "asyncpg")
        backend = PostgresBackend.from_dsn(target, **options)
    else:
        _need_driver("redis", "redis", f"{scheme}://")
        from .backends.redis import RedisBackend, backend_options  # noqa: PLC0415 - see above

        _check_options(f"{scheme}://", options, *backend_options(target), "redis-py")
        backend = RedisBackend.from_url(target, **options)
    return Coordinator(backend, identity=identity)
