"""The backend interface: one atomic attempt per method, no loops.

Waiting, retries, deadlines, the watchdog, lease-loss delivery and cancellation live once,
above the backends, in ``asynclock._lock`` and ``asynclock._watchdog``. A backend only
answers single questions ("take it if free", "extend it if still mine", "delete it if
still mine") atomically, and offers a wake-up source for waiters. A new backend is one
file that subclasses :class:`Backend`.
"""

from __future__ import annotations

import abc
import asyncio
import math
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .._clock import Clock, LoopClock
from .._errors import BackendError
from .._validate import check_number
from .._wakeup import Mailbox, WakeSlot

__all__ = ("Attempt", "Backend", "Claim", "LockInfo", "owner_of")

#: Owner tokens are ``secrets.token_hex(16)``: 128 random bits, 32 hex characters.
TOKEN_CHARS = 32


class Claim:
    """One acquisition's identity, as the backend sees it.

    ``value`` is what the server stores for the holder: the lease's random owner token,
    a colon, and the coordinator's identity (so ``inspect`` can say who holds a lock
    without revealing a token that is only ever compared, never shown). ``handle`` is
    the backend's own per-lease state (cached key names, a pinned connection).
    ``recheck`` is the longest a waiter sleeps between attempts (its backoff's maximum):
    a backend that queues waiters keeps a place at least that long after each attempt.

    What is claimed:

    - a lock (the default): one holder at a time;
    - ``shared``: a reader of a read-write lock; readers share ``name``, a non-shared
      claim (a writer) excludes everyone. Writers are preferred: once a writer was
      refused, new readers are refused until it got the lock (or gave up and its place
      lapsed), so a stream of readers cannot starve it;
    - ``limit > 0``: a permit of the counting semaphore ``name``: at most ``limit``
      holders at once, each with its own expiry and fence. Semaphores live apart from
      locks of the same name;
    - ``fair``: a lock granted in arrival order: an attempt is refused while a live
      waiter that came earlier is queued, and a release wakes the first in line.
    """

    __slots__ = (
        "ended",
        "fair",
        "floor",
        "handle",
        "limit",
        "name",
        "recheck",
        "shared",
        "token",
        "value",
    )

    def __init__(
        self,
        name: str,
        token: str,
        owner: str,
        shared: bool,
        *,
        recheck: float = 1.0,
        limit: int = 0,
        fair: bool = False,
    ) -> None:
        self.name = name
        self.token = token
        self.value = f"{token}:{owner}"
        self.shared = shared
        self.recheck = recheck
        self.limit = limit
        self.fair = fair
        self.handle: Any = None
        # Set by the backend when the server certainly ended this claim's current grant
        # (see Backend.on_hold_lost); reset by the backend at the claim's next grant.
        self.ended = False
        # The shortest TTL of an extend of this claim that a backend reported confirmed
        # while one of its servers had not answered (Redlock: a majority confirmed, a
        # straggler's copy is still on its way, perhaps on a connection given up). That
        # copy may land after a later, longer extend and cut its expiry there: the lease
        # counts any later confirmation for at most this long.
        self.floor = math.inf

    def reissue(self) -> None:
        """Give the claim a fresh random token (same identity) for its next attempt.

        For a backend whose attempts must not share a holder value: a request of an
        earlier attempt that reaches the server late (a release on a connection the
        client gave up on) names that attempt's value, and so can never touch a grant
        made with the new one. Call it only before an attempt, never while a lease holds
        the claim: extend and release use the value of the attempt that was granted.
        """
        owner = self.value[len(self.token) + 1 :]
        self.token = secrets.token_hex(TOKEN_CHARS // 2)
        self.value = f"{self.token}:{owner}"

    def __repr__(self) -> str:
        kind = f"limit={self.limit}" if self.limit else f"shared={self.shared}"
        return f"<Claim {self.name!r} {kind}{' fair' if self.fair else ''}>"


def owner_of(value: str) -> str:
    """The identity part of a stored ``token:identity`` value (the whole value if foreign)."""
    token, sep, owner = value.partition(":")
    return owner if sep and len(token) == TOKEN_CHARS else value


class Attempt(NamedTuple):
    """The answer to one ``try_acquire``.

    ``fence`` is set when the lock was granted. Otherwise ``retry_after`` (seconds) is how
    long the current holder's lease has left, when the backend knows it: a waiter need not
    sleep longer than that, since an expiring lease publishes no wake-up. ``start`` is set
    by backends that may hold the request in a server-side queue: the moment (on the
    backend's clock) from which the lease's local validity counts.
    """

    # A NamedTuple, not a dataclass: one is made per attempt, on the hot path.
    fence: int | None
    retry_after: float | None = None
    start: float | None = None


@dataclass(frozen=True, slots=True)
class LockInfo:
    """What ``coord.inspect(name)`` reports about a held lock.

    ``owner`` is the holder's coordinator identity (``host:pid:random`` unless set),
    ``expires_in`` the seconds the server will keep the lease without renewal (``inf`` if
    the backend has no server-side expiry), ``fence`` the holder's fencing token.
    """

    name: str
    owner: str
    expires_in: float
    fence: int


@asynccontextmanager
async def _silent_mailbox() -> AsyncIterator[Mailbox]:
    yield Mailbox()


class Backend(abc.ABC):
    """Base class of every backend.

    Subclasses implement the abstract methods as single atomic operations and translate
    their driver's errors into :class:`~asynclock.BackendError`. Arguments:

    - ``clock``: the monotonic clock leases and deadlines are measured on (default: the
      event loop's).
    - ``drift_factor`` / ``drift_base``: a lease is believed valid for
      ``ttl - (ttl * drift_factor + drift_base)`` seconds after the acquire request was
      sent, so the client always gives up before the server does.
    """

    #: True when ``try_acquire(wait=...)`` can wait in the server's own lock queue.
    native_wait: ClassVar[bool] = False
    #: True when ``shared=True`` (reader) leases are supported, writers preferred.
    supports_shared: ClassVar[bool] = False
    #: True when semaphore permits (``Claim.limit > 0``) are supported.
    supports_semaphore: ClassVar[bool] = False
    #: True when fair (first-come, first-served) locks are supported.
    supports_fair: ClassVar[bool] = False

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> None:
        self.clock: Clock = clock if clock is not None else LoopClock()
        self.drift_factor = check_number("drift_factor", drift_factor)
        self.drift_base = check_number("drift_base", drift_base)
        if self.drift_factor >= 0.5:
            raise ValueError(f"drift_factor must be < 0.5, got {drift_factor!r}")
        self._hold_lost: list[Callable[[Claim], None]] = []

    def on_hold_lost(self, callback: Callable[[Claim], None]) -> None:
        """Have ``callback(claim)`` called (in the event loop, not awaited) when the backend
        knows that ``claim``'s hold on the server has ended (PostgreSQL: the session that
        held the lock died), so that its lease is declared lost at once instead of at its
        next renewal. Coordinators register here."""
        self._hold_lost.append(callback)

    def _hold_ended(self, claim: Claim) -> None:
        """For subclasses: ``claim``'s hold on the server certainly ended (see
        :meth:`on_hold_lost`)."""
        claim.ended = True  # also read by an acquire that has not made its lease yet
        for callback in list(getattr(self, "_hold_lost", ())):
            callback(claim)

    def check_name(self, name: str) -> None:
        """Raise ``ValueError`` for a valid name this backend cannot lock (default: none).

        Called at the call that names it (``coord.lock()``, ``inspect()``, ...), before
        anything is sent.
        """
        del name  # every valid name is lockable unless a backend says otherwise

    def straggle(self) -> float:
        """Seconds, beyond a lease's TTL, during which an interrupted acquire of this
        client may still reach the server after a later request was answered (0: it
        cannot, requests never overtake each other).

        An interrupted acquire is given back at once; when that release finds nothing,
        the acquire may still be on its way (on a connection that was dropped or timed
        out, on another pooled connection, through a proxy), so the coordinator keeps
        looking for ``ttl`` plus this long. Redis: the socket timeout.
        """
        return 0.0

    def ordered_after_cancel(self) -> bool:
        """True when a request interrupted by a *cancel* cannot be overtaken by the next
        one (the connection it went out on stays, in order): then a give-back that found
        nothing need not look again (:meth:`straggle`). Default: False."""
        return False

    async def leave(self, claim: Claim) -> None:  # noqa: B027 - optional hook
        """Leave whichever waiter queue a refused attempt of ``claim`` joined (called
        when the acquire stops before it waited: its place would keep others out until
        it lapses). Default: nothing (no queue, or the server's own)."""

    def drift(self, ttl: float) -> float:
        """Seconds a lease of ``ttl`` is cut short locally, for clock drift and latency."""
        return ttl * self.drift_factor + self.drift_base

    @abc.abstractmethod
    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        """Take ``claim.name`` for ``ttl`` seconds if it is free; one atomic attempt.

        On success the fence is strictly greater than any earlier grant of the name.
        ``wait`` only matters to backends with :attr:`native_wait`: how long the request
        may wait in the server's queue (None: without bound). The backend may set
        ``claim.handle`` for its later calls about this claim.
        """

    @abc.abstractmethod
    async def extend(self, claim: Claim, ttl: float) -> bool:
        """Reset the claim's server-side expiry to ``ttl`` if it is still held by it.

        Returns False, and changes nothing, when the lock expired or has another holder:
        an extend never revives a lock.
        """

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        """Extend several claims at once, as the watchdog does for leases due together.

        Per item: True extended, False refused (no longer held), None unknown (a backend
        error, or no answer within a third of the smallest TTL of the batch; the caller
        retries). The items answer on their own: one that hangs (a stalled connection)
        reads as unknown without holding back the others' answers, which would otherwise
        all come too late (the batch is answered as a whole). Backends override this to
        send one request per node.
        """

        async def one(claim: Claim, ttl: float) -> bool | None:
            try:
                return await self.extend(claim, ttl)
            except BackendError:
                return None

        if len(items) == 1:
            return [await one(*items[0])]
        tasks = [asyncio.ensure_future(one(c, t)) for c, t in items]
        try:
            done, _ = await asyncio.wait(tasks, timeout=min(t for _, t in items) / 3)
        finally:
            for task in tasks:
                task.cancel()  # those still waiting: unknown (no-op for finished ones)
        return [task.result() if task in done else None for task in tasks]

    @abc.abstractmethod
    async def release(self, claim: Claim) -> bool:
        """Delete the claim's lock if it still holds it and wake a waiter.

        Returns False, touching nothing, when the claim no longer holds the lock.
        """

    @abc.abstractmethod
    async def inspect(self, name: str) -> LockInfo | None:
        """The current holder of ``name``, or None if it is free."""

    async def owns(self, claim: Claim, fence: int) -> bool:
        """True if the server holds ``claim``'s lock for the acquisition granted ``fence``.

        Read-only. The default asks :meth:`inspect`: the holder it reports must carry this
        claim's identity and this fence (fences are unique per acquisition of a name).
        That names one holder only, so a backend where several hold one name (readers,
        semaphore permits) overrides this or raises ``NotImplementedError`` for them.
        """
        if claim.shared or claim.limit:
            raise NotImplementedError(
                f"{type(self).__name__} cannot tell whether a shared lease or permit is still "
                "held; only an exclusive one"
            )
        info = await self.inspect(claim.name)
        return info is not None and info.fence == fence and info.owner == owner_of(claim.value)

    @abc.abstractmethod
    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        """A wake-up slot for a task about to wait for ``name``.

        Entering registers (and, where it takes I/O, subscribes) *before* the caller's next
        attempt, so a release after that attempt is never missed; leaving unregisters.
        """

    async def publish(self, topic: str, message: str) -> None:  # noqa: B027 - optional hook
        """Send ``message`` to every listener of ``topic``, best effort.

        Elections announce their leaders with it. A backend that cannot notify keeps this
        no-op; observers then look again when the leader's lease could have ended.
        """

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        """A mailbox that receives ``topic``'s messages from entering until leaving
        (subscribed by the time ``__aenter__`` returns)."""
        return _silent_mailbox()

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Close what the backend opened itself; clients passed in stay open."""

    def describe(self) -> str:
        """A short, password-free description for reprs, logs and errors."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"<{self.describe()}>"
