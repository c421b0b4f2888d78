"""Blocking leader election: :class:`Election`, :class:`Leadership`, :class:`Term`."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn, cast

from .._backoff import Backoff
from .._election import Election as AsyncElection
from .._election import Leadership as AsyncLeadership
from .._election import Term as AsyncTerm
from .._errors import BackendError, CoordinatorClosed, LeadershipLost, LockError, LockLost
from .._types import ExcType, ExcValue, Traceback
from ._bridge import Bridge, Interrupt
from ._lock import Lease, make_lease

__all__ = ("Election", "Leadership", "Term")

logger = logging.getLogger("asynclock")

# The shortest pause between two campaigns of one candidate (as in async run()).
_REST = 0.05


@dataclass(frozen=True, slots=True)
class Term:
    """One term of leadership: ``fence`` is the term number, strictly increasing across
    terms. ``lease`` is the blocking :class:`Lease` behind it: ``term.check()`` raises
    :class:`~asynclock.LeadershipLost` once the term is lost."""

    name: str
    identity: str
    fence: int
    lease: Lease = field(repr=False, compare=False)

    @property
    def expires_in(self) -> float:
        """Seconds of local validity left in this term."""
        return self.lease.expires_in

    @property
    def lost(self) -> bool:
        """True once the term was lost."""
        return self.lease.lost

    def check(self) -> None:
        """Raise :class:`~asynclock.LeadershipLost` if the term was lost."""
        self.lease.check()


class Election:
    """Leader election among candidates that use the same ``name`` (blocking API); made
    by :meth:`Coordinator.election`."""

    def __init__(self, bridge: Bridge, make: Callable[[], AsyncElection]) -> None:
        self._bridge = bridge
        self._make = make
        core = make()
        self._core = (bridge.generation, core)
        self.name = core.name
        self.ttl = core.ttl
        self.identity = core.identity
        self.retry: Backoff = core.retry

    def _current(self) -> tuple[int, AsyncElection]:
        generation, core = self._core
        if generation != self._bridge.generation:
            generation = self._bridge.generation
            self._core = generation, (core := self._make())
        return generation, core

    def leadership(self) -> Leadership:
        """``with election.leadership() as term:`` waits until this candidate leads.

        The body is not stopped if leadership is lost (a thread cannot be cancelled):
        ``term.lost`` turns true, ``term.check()`` raises, and the block then raises
        :class:`~asynclock.LeadershipLost`. Leaving the block resigns.
        """

        def make() -> AsyncLeadership:
            return self._current()[1].leadership()  # (after a fork: the child's election)

        return Leadership(self._bridge, make)

    def leader(self) -> str | None:
        """The identity of the current leader, or None."""
        return self._bridge.call(self._current()[1].leader)

    def observe(self) -> Iterator[str | None]:
        """The current leader (None when there is none), then each change, in order.
        Close the iterator (or leave the ``for`` loop) to stop observing."""
        bridge = self._bridge
        generation = bridge.generation
        changes = cast(AsyncGenerator[str | None, None], self._current()[1].observe())

        async def step() -> str | None:
            return await anext(changes)

        try:
            while True:
                bridge.check_generation(generation, "this observe() iterator")
                try:
                    leader = bridge.call(step)
                except StopAsyncIteration:
                    return
                yield leader
        finally:
            # (Not in a child of a fork: the generator is the parent's. Not from the loop
            # thread, where a collection may drop the iterator: ask the loop to close it.)
            if not bridge.closed and generation == bridge.generation:
                if bridge.thread.in_loop_thread():
                    bridge.thread.spawn(changes.aclose)
                else:
                    bridge.call(changes.aclose, interrupt=Interrupt.FINISH)

    def run(self, callback: Callable[[Term], object]) -> NoReturn:
        """Campaign forever: lead, call ``callback(term)`` while leading, campaign again.

        ``callback`` is a plain function taking the :class:`Term`. It is not stopped when
        leadership is lost: it should call ``term.check()`` between steps (or watch
        ``term.lost``). After each term the candidate pauses (``retry``'s backoff, growing
        with short terms in a row), as :meth:`asynclock.Election.run` does; lost
        leadership and backend errors campaign again, any other exception resigns and
        ends ``run()``, and so does :class:`~asynclock.CoordinatorClosed`.
        """
        if not callable(callback):
            raise TypeError(f"callback must be a function taking a Term, got {callback!r}")
        if inspect.iscoroutinefunction(callback):
            raise TypeError(
                f"callback {getattr(callback, '__qualname__', callback)!r} is an async def: "
                "the blocking API calls plain functions (asynclock.Election.run takes "
                "async ones)"
            )
        short = 0
        while True:
            began: float | None = None
            ended: BaseException | None = None
            try:
                with self.leadership() as term:
                    began = time.monotonic()
                    callback(term)
            except CoordinatorClosed:
                raise
            except (LockLost, BackendError) as exc:
                ended = exc
            if began is not None and time.monotonic() - began >= self.ttl:
                short = 0
            delay = max(_REST, self.retry.delay(short))
            short += 1
            if isinstance(ended, LockError):
                logger.warning(
                    "election %r: %s; campaigning again in %.2fs", self.name, ended, delay
                )
            elif ended is not None:
                logger.error(
                    "election %r: %s; campaigning again in %.2fs",
                    self.name,
                    ended,
                    delay,
                    exc_info=ended,
                )
            time.sleep(delay)

    def __repr__(self) -> str:
        return (
            f"<asynclock.sync.Election {self.name!r} identity={self.identity!r} ttl={self.ttl:g}>"
        )


class Leadership:
    """What :meth:`Election.leadership` returns: ``with`` it waits until this candidate
    leads and gives the :class:`Term`; leaving the block resigns (and raises
    :class:`~asynclock.LeadershipLost` if the term was lost inside it)."""

    __slots__ = ("_bridge", "_core", "_make", "_terms")

    def __init__(self, bridge: Bridge, make: Callable[[], AsyncLeadership]) -> None:
        self._bridge = bridge
        self._make = make
        self._core = (bridge.generation, make())
        # The term of each thread inside ``with``, with its generation.
        self._terms: dict[int, tuple[Term, AsyncTerm, AsyncLeadership, int]] = {}

    def _current(self) -> tuple[int, AsyncLeadership]:
        generation, core = self._core
        if generation != self._bridge.generation:  # forked: the parent's
            generation = self._bridge.generation
            self._core = generation, (core := self._make())
        return generation, core

    def __enter__(self) -> Term:
        ident = threading.get_ident()
        entered = self._terms.get(ident)
        if (
            entered is not None
            and entered[0].lease.lost
            and self._core[0] != (self._bridge.generation)
        ):
            del self._terms[ident]  # forked inside this thread's block: the parent's
        if ident in self._terms:
            raise RuntimeError("this leadership is already entered by this thread")
        bridge = self._bridge
        generation, leadership = self._current()
        granted: list[AsyncTerm] = []
        try:
            core = bridge.call(_take, leadership, granted)
            lease = make_lease(bridge, core.lease, generation, LeadershipLost)
            term = Term(core.name, core.identity, core.fence, lease)
            self._terms[ident] = (term, core, leadership, generation)
        except BaseException:
            # Interrupted between the grant and the block: resign in the background.
            if granted:
                self._terms.pop(ident, None)
                bridge.thread.spawn(lambda: leadership.resign(granted[0], _interrupt()))
            raise
        return term

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        entry = None
        try:
            entry = self._terms.pop(threading.get_ident(), None)
            if entry is None:
                raise RuntimeError("this leadership was not entered by this thread")  # noqa: TRY301 - the interrupt handling below wraps it too
            term, core, leadership, _ = entry
            _resign(leadership, term, core, exc)
        except BaseException as error:
            if not isinstance(error, Exception):
                # An interrupt, perhaps before the resignation was on its way: resign in
                # the background (a no-op once the term has ended).
                entry = entry or self._terms.pop(threading.get_ident(), None)
                if entry is not None:
                    _, core, leadership, _ = entry
                    self._bridge.thread.spawn(lambda: _resign_unheld(leadership, core))
            raise


async def _resign_unheld(leadership: AsyncLeadership, term: AsyncTerm) -> None:
    if term.lease.held:
        await leadership.resign(term, _interrupt())


async def _take(leadership: AsyncLeadership, granted: list[AsyncTerm]) -> AsyncTerm:
    """Lead; the term also goes into ``granted``, in the step it is won (see Lock)."""
    term = await leadership.take()
    granted.append(term)
    return term


def _interrupt() -> BaseException:
    import asyncio  # noqa: PLC0415 - only for this rare path

    return asyncio.CancelledError("interrupted before its block began")


def _resign(
    leadership: AsyncLeadership,
    term: Term,
    core: AsyncTerm,
    exc: BaseException | None,
) -> None:
    """Resign ``term`` after its body ended with ``exc``; raise LeadershipLost if lost."""

    async def resign(exc: BaseException | None) -> None:
        await leadership.resign(core, exc)

    term.lease.end_block(exc, resign)
