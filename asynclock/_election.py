"""Leader election on a lock: leadership is a lease, the term is its fence.

The election ``NAME`` is the lock ``election:NAME``, held with the candidate's identity
as owner. A new leader announces itself (``elected TERM IDENTITY``) on the backend's
topic ``election:NAME`` and a resigning one says so (``resigned TERM IDENTITY``), so that
``observe()`` follows changes without polling (Redis pub/sub, PostgreSQL LISTEN/NOTIFY,
in-process for memory). A leader that crashes announces nothing: observers look again
when its lease could have ended.

Only candidates lead: a holder of the election's lock that is not an asynclock lease (a
PostgreSQL session that took the key by hand reads as owner ``pid N``, fence 0 and no
expiry) is no leader for ``leader()`` and ``observe()``; ``inspect()`` still shows it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn, Protocol

from ._backoff import Backoff
from ._cancel import CancelMark
from ._clock import Clock
from ._engine import Engine
from ._errors import BackendError, CoordinatorClosed, LeadershipLost, LockError, LockLost
from ._lease import Lease
from ._lock import Lock
from ._types import ExcType, ExcValue, Traceback
from ._validate import MAX_NAME_BYTES, check_name, check_ttl

if TYPE_CHECKING:
    from .backends.base import LockInfo

__all__ = ("Election", "Leadership", "Term")

logger = logging.getLogger("asynclock")

_PREFIX = "election:"
# The shortest pause between two campaigns of one candidate.
_REST = 0.05


def default_identity() -> str:
    """``host:pid:random``: unique per process, readable in ``leader()``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class Term:
    """One term of leadership: ``fence`` is the term number, strictly increasing across
    terms — pass it to the resources the leader writes to."""

    name: str
    identity: str
    fence: int
    lease: Lease = field(repr=False, compare=False)

    @property
    def expires_in(self) -> float:
        """Seconds of local validity left in this term."""
        return self.lease.expires_in


class Election:
    """Leader election among candidates that use the same ``name``.

    Made by :meth:`Coordinator.election`. ``ttl`` is how long a term lasts without
    renewal (a crashed leader is replaced within about that), ``identity`` what
    :meth:`leader` reports for this candidate.
    """

    def __init__(
        self, engine: Engine[Lease], name: str, *, ttl: float, identity: str, retry: Backoff
    ) -> None:
        self._engine = engine
        self.name = name
        self.ttl = ttl
        self.identity = identity
        self.retry = retry
        self._lock_name = _PREFIX + name
        self._topic = _PREFIX + name

    def leadership(self) -> Leadership:
        """``async with election.leadership() as term:`` waits until this candidate leads.

        The body is cancelled if leadership is lost, and the block then raises
        :class:`LeadershipLost`. Leaving the block resigns.
        """
        lock = Lock(
            self._engine,
            self._lock_name,
            ttl=self.ttl,
            timeout=None,
            renew=True,
            cancel_on_lost=True,
            retry=self.retry,
            shared=False,
            owner=self.identity,
            lost_error=LeadershipLost,
        )
        return Leadership(self, lock, self._publish)

    async def _publish(self, kind: str, fence: int) -> None:
        """Say ``kind`` (``elected``, ``resigned``) for the term ``fence`` on the topic."""
        await self._engine.backend.publish(self._topic, f"{kind} {fence} {self.identity}")

    async def leader(self) -> str | None:
        """The identity of the current leader, or None (also while the election's lock is
        held by something that is not a candidate)."""
        info = await self._holder()
        return None if info is None else info.owner

    async def _holder(self) -> LockInfo | None:
        """The election lock's holder if it is a candidate: every asynclock lease has an
        expiry, so a holder without one (``expires_in`` inf) is someone else's lock."""
        info = await self._engine.inspect(self._lock_name)
        return info if info is not None and math.isfinite(info.expires_in) else None

    async def observe(self) -> AsyncIterator[str | None]:
        """The current leader (None when there is none), then each change, in order.

        Survives connection losses and server restarts: while the backend cannot be
        reached it keeps looking again with the election's backoff (on the coordinator's
        clock, as every wait of an election: a ``ManualClock`` moves it), and resumes from the
        leader it finds then. Only the first look raises :class:`BackendError` (nothing
        to observe from yet).
        """
        engine = self._engine
        clock = engine.clock
        async with engine.backend.listen(self._topic) as mailbox:
            with engine.observing(mailbox):
                # Listening first, reading second: a change between the two is not missed.
                info = await self._holder()
                leader = None if info is None else info.owner
                term = 0 if info is None else info.fence
                yield leader
                expires = math.inf if info is None else info.expires_in
                while True:
                    # Without news, look again when the leader's lease could have ended
                    # (a crashed leader says nothing), or after a ttl when there is none.
                    wait = expires if math.isfinite(expires) else self.ttl
                    message = await mailbox.get(clock, clock.now() + wait + 0.05)
                    seen = _parse(message) if message else None
                    if seen is None:  # a timeout, or "look again" after a lost connection
                        info = await self._look_again()
                        now_leader = None if info is None else info.owner
                        now_term = 0 if info is None else info.fence
                        expires = math.inf if info is None else info.expires_in
                        if (now_leader, now_term) != (leader, term):
                            changed = now_leader != leader
                            leader, term = now_leader, now_term
                            if changed:
                                yield leader
                        continue
                    kind, seen_term, identity = seen
                    if kind == "elected" and seen_term > term:
                        term = seen_term
                        if identity != leader:
                            leader = identity
                            yield leader
                        # When to look again if the new leader says nothing more: when its
                        # own lease could end (its ttl may differ from this candidate's).
                        info = await self._look_again()
                        same = info is not None and info.owner == identity
                        expires = info.expires_in if info is not None and same else 0.0
                    elif (
                        kind == "resigned"
                        and seen_term >= term
                        and leader is not None
                        and identity == leader
                    ):
                        # (Only the current leader's: a late resignation of an earlier one
                        # must not hide a leader whose term is not known yet.)
                        term, leader, expires = seen_term, None, math.inf
                        yield None

    async def _look_again(self) -> LockInfo | None:
        """The election's holder (:meth:`_holder`) once the backend answers (with
        backoff)."""
        failures = 0
        while True:
            try:
                return await self._holder()
            except BackendError as exc:
                delay = self.retry.delay(failures)
                failures += 1
                logger.warning(
                    "observing election %r: %s; looking again in %.2fs", self.name, exc, delay
                )
                await sleep_on(self._engine.clock, delay)

    async def run(self, callback: Callable[[Term], Awaitable[object]]) -> NoReturn:
        """Campaign forever: lead, call ``callback(term)`` while leading, campaign again.

        ``callback`` is an ``async def`` taking the :class:`Term`; it is cancelled when
        leadership is lost. After each term the candidate pauses before campaigning again,
        for the election's ``retry`` backoff, which grows with each short term in a row
        (one that lasted less than a ``ttl``; a longer one starts the count again): after
        the callback returned (a callback that returns at once costs one term per pause,
        not a busy loop), and after lost leadership, a backend error, or a callback that
        raised :class:`BackendError` or :class:`LockLost`. The pauses follow the
        coordinator's clock (a ``ManualClock`` moves them too).

        A callback raising anything else resigns and ends ``run()`` with that exception:
        ``run()`` is a building block inside a task its caller owns, and the caller
        decides what a bug means (the web integrations' leader tasks restart it with a
        backoff and report it). :class:`CoordinatorClosed` ends it too; cancelling
        ``run()`` resigns and stops.

        Raises ``TypeError`` at once for a callback that is not an ``async def`` taking
        one argument.
        """
        check_callback(callback)
        clock = self._engine.clock
        await campaign(self, callback, clock=clock, pauses=self.retry, restart_bugs=False)

    def __repr__(self) -> str:
        return f"<Election {self.name!r} identity={self.identity!r} ttl={self.ttl:g}>"


class Leadership:
    """What :meth:`Election.leadership` returns: ``async with`` it waits until this
    candidate leads and gives the :class:`Term`; leaving the block resigns.

    Raises :class:`~asynclock.LeadershipLost` from the block when the term is lost (its
    body is cancelled first), :class:`~asynclock.BackendError` when the server cannot be
    reached while campaigning.
    """

    __slots__ = ("_election", "_lock", "_publish", "_terms")

    def __init__(
        self,
        election: Election,
        lock: Lock,
        publish: Callable[[str, int], Awaitable[None]],
    ) -> None:
        self._election = election
        self._lock = lock  # the election's lock, held with the candidate's identity
        self._publish = publish  # publishes "KIND FENCE IDENTITY" on its topic
        self._terms: dict[asyncio.Task[object] | None, Term] = {}

    async def __aenter__(self) -> Term:
        election = self._election
        lease = await self._lock.__aenter__()
        task = asyncio.current_task()
        term = Term(election.name, election.identity, lease.fence, lease)
        self._terms[task] = term
        try:
            await self._announce("elected", term)
        except BaseException as exc:
            # Cancelled (from outside, or by our own loss) while announcing: the caller
            # never gets the term, so give the lease back here, and let the lock turn
            # its own loss cancel into LeadershipLost.
            self._terms.pop(task, None)
            await self._lock.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return term

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        term = self._terms.pop(asyncio.current_task(), None)
        # "resigned" goes out before the release, so that observers see the gap before
        # the next leader's "elected". A cancel landing on it must not skip the release:
        # the lock then leaves with the exception actually in flight.
        try:
            if term is not None and term.lease.held:
                await self._announce("resigned", term)
        except BaseException as interrupted:
            await self._lock.__aexit__(type(interrupted), interrupted, interrupted.__traceback__)
            raise
        await self._lock.__aexit__(exc_type, exc, tb)

    # -- for a holder that is not a task (the blocking API's threads) -----------------

    async def take(self) -> Term:
        """Wait until this candidate leads; the :class:`Term`, tied to no task (nothing
        is cancelled on loss: ``term.lease.lost`` turns true). End it with :meth:`resign`.
        A cancel while announcing gives the lease back."""
        election = self._election
        lease = await self._lock.acquire()
        term = Term(election.name, election.identity, lease.fence, lease)
        try:
            await self._announce("elected", term)
        except BaseException as exc:
            await lease.end_block(None, exc, LeadershipLost)
            raise
        return term

    async def resign(self, term: Term, exc: BaseException | None) -> None:
        """End a term from :meth:`take` after code that ended with ``exc`` (None: it
        returned): announce the resignation, release, and raise
        :class:`LeadershipLost` if the term was lost (see ``Lease.end_block``)."""
        try:
            if term.lease.held:
                await self._announce("resigned", term)
        except BaseException as interrupted:
            await term.lease.end_block(None, interrupted, LeadershipLost)
            raise
        await term.lease.end_block(None, exc, LeadershipLost)

    async def _announce(self, kind: str, term: Term) -> None:
        """Best effort: observers also look again on their own. A cancel that arrived
        while the server failed is raised as the cancel, never swallowed with the error."""
        mark = CancelMark()
        try:
            await self._publish(kind, term.fence)
        except BackendError as exc:
            mark.raise_if_swallowed(exc)


class CampaignWatch(Protocol):
    """What a campaign reports as it goes (the integrations' leader tasks keep a state)."""

    def campaigning(self) -> None:
        """Waiting to lead."""

    def leading(self, term: Term) -> None:
        """Leading ``term``; the callback runs."""

    def pausing(self, ended: BaseException | None, delay: float) -> None:
        """A term or attempt ended (``ended`` is None when the callback returned); the
        next campaign starts in ``delay`` seconds."""


class _Silent:
    def campaigning(self) -> None:
        pass

    def leading(self, term: Term) -> None:
        pass

    def pausing(self, ended: BaseException | None, delay: float) -> None:
        pass


async def campaign(
    election: Election,
    callback: Callable[[Term], Awaitable[object]],
    *,
    clock: Clock,
    pauses: Backoff,
    restart_bugs: bool,
    watch: CampaignWatch | None = None,
) -> NoReturn:
    """The campaign loop behind :meth:`Election.run` and the integrations' leader tasks.

    Between terms it pauses for ``pauses.delay(n)`` on ``clock`` (the backend's), ``n``
    counting the short terms (under a ``ttl``) and failed attempts in a row. Lost
    leadership and backend errors are always retried; any other ``Exception`` from the
    callback is retried when ``restart_bugs``, else raised (after the term resigned).
    :class:`CoordinatorClosed` and cancellation always end the loop.
    """
    watch = watch or _Silent()
    short = 0
    while True:
        watch.campaigning()
        began: float | None = None
        ended: BaseException | None = None
        try:
            async with election.leadership() as term:
                began = clock.now()
                watch.leading(term)
                await callback(term)
        except CoordinatorClosed:
            raise
        except LockLost as exc:
            ended = exc
            what = f"leadership of {election.name!r} lost: {exc}"
        except BackendError as exc:
            ended = exc
            what = f"election {election.name!r}: {exc}"
        except Exception as exc:
            if not restart_bugs:
                raise
            ended = exc
            what = f"election {election.name!r}: the callback raised {exc!r}"
        if began is not None and clock.now() - began >= election.ttl:
            short = 0  # a healthy term: start the count again
        # At least a short rest: after a resignation another candidate gets its turn
        # instead of the same one winning again at once.
        delay = max(_REST, pauses.delay(short))
        short += 1
        watch.pausing(ended, delay)
        if ended is None:
            logger.debug(
                "election %r: the callback returned; campaigning again in %.2fs",
                election.name,
                delay,
            )
        elif isinstance(ended, LockError):
            logger.warning("%s; campaigning again in %.2fs", what, delay)
        else:
            logger.error("%s; campaigning again in %.2fs", what, delay, exc_info=ended)
        await sleep_on(clock, delay)


async def sleep_on(clock: Clock, seconds: float) -> None:
    """Sleep ``seconds`` of ``clock`` (real time on a ``LoopClock``, virtual on a
    ``ManualClock``)."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    timer = clock.call_at(clock.now() + seconds, wake)
    try:
        await fut
    finally:
        timer.cancel()


def check_callback(callback: object) -> None:
    """Refuse, at once, a leader callback that cannot work: not an ``async def`` (or an
    object whose ``__call__`` is one), or not callable with one argument (the Term)."""
    if not callable(callback):
        raise TypeError(
            f"callback must be an async def taking a Term, got {type(callback).__name__}"
        )
    call = getattr(callback, "__call__", None)  # noqa: B004 - the method, not callable()
    if not (inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(call)):
        shown = getattr(callback, "__qualname__", None) or type(callback).__name__
        raise TypeError(
            f"callback must be an async def taking a Term, got {shown!r}, which is not a "
            "coroutine function (a plain def would block the event loop; write async def)"
        )
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # no signature to check (some builtins)
        return
    try:
        signature.bind(None)
    except TypeError as exc:
        raise TypeError(f"callback must take the Term as its one argument: {exc}") from None


def _parse(message: str) -> tuple[str, int, str] | None:
    kind, _, rest = message.partition(" ")
    term, _, identity = rest.partition(" ")
    if kind not in ("elected", "resigned") or not term.isdigit():
        return None
    return kind, int(term), identity


def check_election(name: object, ttl: object, identity: object) -> tuple[str, float, str | None]:
    """Validate ``coord.election()``'s arguments; the identity stays None when not given
    (the coordinator's identity is the default)."""
    name = check_name(name)
    if len(name.encode()) > MAX_NAME_BYTES - len(_PREFIX):
        raise ValueError(
            f"election name must be at most {MAX_NAME_BYTES - len(_PREFIX)} UTF-8 bytes"
        )
    seconds = check_ttl(ttl)
    who = None if identity is None else check_name(identity, "identity")
    return name, seconds, who
