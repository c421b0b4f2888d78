"""The backend interface: one atomic attempt per method, no loops.

Waiting, retries, deadlines, the watchdog, lease-loss delivery and cancellation live once,
above the backends, in the engine (``asynclock._engine``, ``_lock``, ``_watchdog``). A
backend answers single questions atomically: take a :class:`Claim` of some :class:`Kind`
if free, extend it if still its own, release it if still its own, give back what an
interrupted acquire may have left; and it offers :class:`Wakeups` for waiters. A new
backend is one file that subclasses :class:`Backend`, declares its :attr:`Backend.kinds`,
and passes :func:`asynclock.testing.check_backend`.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import math
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .._clock import Clock, LoopClock
from .._errors import BackendError
from .._kind import PERMIT, SHARED, Kind
from .._validate import check_number
from .._wakeup import Mailbox, WakeSlot

__all__ = (
    "TOKEN_CHARS",
    "Attempt",
    "Backend",
    "Claim",
    "GiveBack",
    "Interrupted",
    "Kind",
    "LockInfo",
    "Wakeups",
    "owner_of",
)

#: Owner tokens are ``secrets.token_hex(16)``: 128 random bits, 32 hex characters.
TOKEN_CHARS = 32


class Claim:
    """One acquisition's identity, as the backend sees it.

    ``kind`` is what is claimed (:class:`Kind`); ``limit`` is a permit's semaphore size
    (at least 1 for :attr:`Kind.PERMIT`, 0 for every other kind: a ``ValueError``
    otherwise). ``value`` is what the server stores for the holder: the lease's random
    owner token, a colon, and the coordinator's identity (so ``inspect`` can say who
    holds a lock without revealing a token that is only ever compared, never shown).
    ``handle`` is the backend's own per-lease state (cached key names, a pinned
    connection). ``recheck`` is the longest a waiter sleeps between attempts (its
    backoff's maximum): a backend that queues waiters keeps a place at least that long
    after each attempt.
    """

    __slots__ = (
        "ended",
        "floor",
        "handle",
        "kind",
        "limit",
        "name",
        "recheck",
        "token",
        "value",
    )

    def __init__(
        self,
        name: str,
        token: str,
        owner: str,
        kind: Kind = Kind.EXCLUSIVE,
        *,
        limit: int = 0,
        recheck: float = 1.0,
    ) -> None:
        if not isinstance(kind, Kind):
            raise TypeError(f"kind must be an asynclock.backends.Kind, got {kind!r}")
        if (kind is PERMIT) != (limit >= 1):
            raise ValueError(
                f"a {kind.value} claim takes "
                f"{'a limit of at least 1' if kind is PERMIT else 'no limit'}, got {limit}"
            )
        self.name = name
        self.token = token
        self.value = f"{token}:{owner}"
        self.kind = kind
        self.limit = limit
        self.recheck = recheck
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
        limit = f" limit={self.limit}" if self.limit else ""
        return f"<Claim {self.name!r} {self.kind.value}{limit}>"


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


class Interrupted(enum.Enum):
    """How an acquire stopped without a lease: what :meth:`Backend.give_back` undoes."""

    #: The last attempt was answered (refused), and the acquire stopped before it waited
    #: again (a timeout, a cancel): nothing was granted, but a backend that queues
    #: waiters may keep the attempt's place in line.
    ANSWERED = "answered"
    #: The attempt was cancelled on its way (a caller's cancel, the acquire's own
    #: deadline): the server may have granted it, or may yet.
    CANCELLED = "cancelled"
    #: The attempt failed on its way (a socket timeout, a reset connection): the server
    #: may have granted it, or may yet.
    FAILED = "failed"


class GiveBack(NamedTuple):
    """The answer to one :meth:`Backend.give_back`.

    ``released``: the claim held the lock, and now does not. ``late``: seconds, beyond the
    lease's TTL, during which the interrupted request may still reach the server after
    this answer (it went out on a connection that was given up, another pooled
    connection, through a proxy). 0 when it cannot: it was answered, or requests never
    overtake each other. While ``late`` > 0 and nothing was released, the coordinator
    gives back again at growing intervals, up to ``ttl + late`` after the first try.
    """

    released: bool
    late: float = 0.0


class Wakeups(abc.ABC):
    """How waiters learn that a name may be free, and elections hear announcements.

    The half of a backend that carries no lock state: a wake-up is only ever a hint to
    try again (a waiter also looks again on its own when a holder's lease could have
    ended), so a lost or duplicated message costs latency, never safety.
    """

    #: True when ``try_acquire(wait=...)`` can wait in the server's own lock queue.
    native_wait: ClassVar[bool] = False

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


@asynccontextmanager
async def _silent_mailbox() -> AsyncIterator[Mailbox]:
    yield Mailbox()


class Backend(Wakeups):
    """Base class of every backend: lock state on a server, plus its :class:`Wakeups`.

    Subclasses implement the abstract methods as single atomic operations and translate
    their driver's errors into :class:`~asynclock.BackendError`; the contract kit
    (:func:`asynclock.testing.check_backend`) checks them against a real server.
    Arguments:

    - ``clock``: the monotonic clock leases and deadlines are measured on (default: the
      event loop's).
    - ``drift_factor`` / ``drift_base``: a lease is believed valid for
      ``ttl - (ttl * drift_factor + drift_base)`` seconds after the acquire request was
      sent, so the client always gives up before the server does.
    """

    #: The claim kinds this backend grants; the one place a backend declares them.
    kinds: ClassVar[frozenset[Kind]] = frozenset({Kind.EXCLUSIVE})

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

    def drift(self, ttl: float) -> float:
        """Seconds a lease of ``ttl`` is cut short locally, for clock drift and latency."""
        return ttl * self.drift_factor + self.drift_base

    @abc.abstractmethod
    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        """Take ``claim.name`` for ``ttl`` seconds if it is free; one atomic attempt.

        On success the fence is strictly greater than any earlier grant of the name.
        ``wait`` only matters to backends with :attr:`~Wakeups.native_wait`: how long the request
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

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        """Undo what an acquire of ``claim`` that stopped without a lease may have left on
        the server; one attempt, which the coordinator repeats (in the background, with
        backoff) until it is answered or the TTL has passed.

        After :attr:`Interrupted.ANSWERED`, leave the waiter queue the refused attempt may
        have joined. Otherwise also release the grant that may have landed, and say in
        :attr:`GiveBack.late` how much longer the request may still land. The default
        releases, and reports that nothing can land late (no queue of its own, requests in
        order): right for a backend whose requests never overtake each other.
        """
        if interrupted is Interrupted.ANSWERED:
            return GiveBack(False)
        return GiveBack(await self.release(claim))

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
        if claim.kind in (SHARED, PERMIT):
            raise NotImplementedError(
                f"{type(self).__name__} cannot tell whether a shared lease or permit is still "
                "held; only an exclusive one"
            )
        info = await self.inspect(claim.name)
        return info is not None and info.fence == fence and info.owner == owner_of(claim.value)

    async def aclose(self) -> None:
        """Close what the backend opened itself; clients passed in stay open."""

    def describe(self) -> str:
        """A short, password-free description for reprs, logs and errors."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"<{self.describe()}>"
