"""A virtual-time asyncio event loop and the world it polls instead of sockets.

:class:`SimLoop` is a ``BaseEventLoop`` whose ``time()`` is virtual and whose "selector"
never blocks: where a real loop would wait for I/O, it advances the :class:`World` (the
simulated network and server) to the next event, or to the next timer of the loop. Events
of the world that reach the client (a reply, a reset, a wake-up) are handed to the loop
like ready sockets. A client pause stalls the loop: virtual time jumps while the world
goes on and the client runs nothing.

Tasks get a deterministic hash (their creation number), so that sets of tasks iterate in
the same order on every run of a seed, whatever the memory addresses. The loop's
``create_connection`` connects through the world's simulated network, if it has one
(:class:`Connector`, :mod:`tests.sim.wire`): there are no sockets.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Coroutine, Generator
from contextvars import Context
from typing import Any, Protocol, TypeVar

from asynclock._clock import Timer

__all__ = ("Connector", "Deadlock", "DriftClock", "SimClock", "SimLoop", "SimTask", "World")

T = TypeVar("T")


class Deadlock(Exception):
    """Nothing is ready, no timer is armed and the world has no event left."""


class SimTask(asyncio.Task[T]):
    """A task hashed by its creation number (deterministic set iteration)."""

    def __init__(
        self,
        coro: Generator[Any, None, T] | Coroutine[Any, Any, T],
        *,
        loop: SimLoop,
        name: str | None = None,
        context: Context | None = None,
    ) -> None:
        self._sim_n = loop.next_task_number()
        super().__init__(coro, loop=loop, name=name, context=context)

    def __hash__(self) -> int:
        return self._sim_n


class World:
    """Events outside the client process, in virtual-time order.

    ``schedule(when, fn)`` runs ``fn`` at ``when`` from inside the loop's poll (the server
    and the network act there, between the client's steps). ``deliver(when, fn)`` hands
    ``fn`` to the client: it runs as a ready callback of the loop at ``when``, or at the
    end of a pause that covers ``when``.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, bool, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._pauses: list[tuple[float, float]] = []  # (start, end), sorted by start
        self.all_pauses: list[tuple[float, float]] = []
        self.paused_until = -1.0
        #: Called after each event of the world (the invariant checks).
        self.after_event: Callable[[], None] | None = None
        self.events_run = 0
        #: Where the loop's ``create_connection`` connects (a simulated network of
        #: servers speaking their own protocol, :class:`tests.sim.wire.Wire`), if any.
        self.connector: Connector | None = None

    def schedule(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a server or network action) at virtual time ``when``."""
        heapq.heappush(self._events, (max(when, self.now), next(self._seq), False, fn))

    def deliver(self, when: float, fn: Callable[[], None]) -> None:
        """Hand ``fn`` to the client loop at ``when`` (later if the client is paused)."""
        heapq.heappush(self._events, (max(when, self.now), next(self._seq), True, fn))

    def pause(self, start: float, duration: float) -> None:
        """Stall the client loop from ``start`` for ``duration`` seconds."""
        self._pauses.append((start, start + duration))
        self._pauses.sort()
        self.all_pauses.append((start, start + duration))

    def paused_within(self, start: float, end: float) -> bool:
        """True if a client pause overlaps ``[start, end]``."""
        return any(s <= end and e >= start for s, e in self.all_pauses)

    def next_time(self) -> float | None:
        """When the next event is due, or None when there is none."""
        return self._events[0][0] if self._events else None

    def advance(self, target: float | None) -> list[Callable[[], None]]:
        """Run the world up to ``target`` (None: until a client event), return what
        reaches the client. Stops at the first client event (time is then its time)."""
        out: list[Callable[[], None]] = []
        while True:
            if self._pauses and (target is None or self._pauses[0][0] <= target):
                start, end = self._pauses[0]
                nxt = self.next_time()
                if start <= self.now or nxt is None or start <= nxt:
                    # The client stalls: the world runs on; client events wait until the end.
                    self._pauses.pop(0)
                    start = max(start, self.now)
                    self.now = start
                    self.paused_until = end
                    while self._events and self._events[0][0] <= end:
                        when, _, to_client, fn = heapq.heappop(self._events)
                        self.now = max(self.now, when)
                        if to_client:
                            out.append(fn)
                        else:
                            self._run(fn)
                    self.now = max(self.now, end)
                    return out
            if not self._events:
                if target is not None:
                    self.now = max(self.now, target)
                return out
            when = self._events[0][0]
            if target is not None and when > target:
                self.now = max(self.now, target)
                return out
            _, _, to_client, fn = heapq.heappop(self._events)
            self.now = max(self.now, when)
            if to_client:
                out.append(fn)
                # Every other client event due at the same moment comes along.
                while self._events and self._events[0][0] <= self.now and self._events[0][2]:
                    out.append(heapq.heappop(self._events)[3])
                return out
            self._run(fn)

    def _run(self, fn: Callable[[], None]) -> None:
        fn()
        self.events_run += 1
        if self.after_event is not None:
            self.after_event()


class Connector(Protocol):
    """A simulated network that the loop's ``create_connection`` connects through."""

    async def connect(
        self, factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]: ...


class _Selector:
    """What the loop polls: the world, advanced as far as the loop would block."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list[Callable[[], None]]:
        loop = self._loop
        world = loop.world
        target = None if timeout is None else world.now + timeout
        scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]
        if scheduled:
            # asyncio runs a timer up to one clock resolution early; a real clock would
            # have moved on by then, virtual time must be moved to it.
            head = scheduled[0].when()
            resolution: float = loop._clock_resolution  # type: ignore[attr-defined]
            if world.now < head <= world.now + resolution:
                target = head if target is None else max(target, head)
        if target is None and world.next_time() is None and not world._pauses:
            raise Deadlock("no task is ready, no timer armed and nothing on the wire")
        return world.advance(target)

    def close(self) -> None:
        """Nothing to close: there are no sockets."""


class SimLoop(asyncio.BaseEventLoop):
    """An event loop on virtual time that polls a :class:`World` instead of sockets.

    ``after_step`` runs after every iteration (the invariant checks); ``max_steps``
    bounds the iterations of one run (a livelock is reported, not waited out).
    """

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world
        self._selector = _Selector(self)
        self._task_numbers = itertools.count()
        self.after_step: Callable[[], None] | None = None
        self.steps = 0
        self.max_steps = 200_000

    def next_task_number(self) -> int:
        """A number for the next task (its hash)."""
        return next(self._task_numbers)

    def time(self) -> float:
        return self.world.now

    def create_task(  # type: ignore[override]
        self,
        coro: Generator[Any, None, T] | Coroutine[Any, Any, T],
        *,
        name: str | None = None,
        context: Context | None = None,
    ) -> asyncio.Task[T]:
        self._check_closed()  # type: ignore[attr-defined]
        return SimTask(coro, loop=self, name=name, context=context)

    async def create_connection(  # type: ignore[override]
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: str | None = None,
        port: int | None = None,
        **kwargs: Any,
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        """A connection over the world's simulated network (there are no sockets)."""
        connector = self.world.connector
        if connector is None or host is None or port is None:
            raise OSError(f"no simulated network reaches {host}:{port}")
        return await connector.connect(protocol_factory, host, port)

    def _process_events(self, event_list: list[Callable[[], None]]) -> None:
        for fn in event_list:
            self.call_soon(fn)

    def _write_to_self(self) -> None:
        """No other thread talks to this loop."""

    def _run_once(self) -> None:
        super()._run_once()  # type: ignore[misc]
        self.steps += 1
        if self.steps > self.max_steps:
            raise RuntimeError(f"livelock: more than {self.max_steps} loop steps")
        if self.after_step is not None:
            self.after_step()


class SimClock:
    """The client's monotonic clock: the loop's virtual time, plus an offset."""

    __slots__ = ("_loop", "offset")

    def __init__(self, loop: SimLoop, offset: float = 0.0) -> None:
        self._loop = loop
        self.offset = offset

    def now(self) -> float:
        return self._loop.world.now + self.offset

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        # Never early by a rounding error: at the loop's moment, now() >= when (a real
        # clock moves on past a hair's difference; virtual time would not).
        at = when - self.offset
        while at + self.offset < when:
            at = math.nextafter(at, math.inf)
        return self._loop.call_at(at, callback)

    def real(self, when: float) -> float:
        """This clock's ``when`` in virtual (real) time."""
        return when - self.offset


class DriftClock:
    """A server's clock: runs at ``1 + rate`` times virtual time, from ``offset``."""

    __slots__ = ("_world", "offset", "rate")

    def __init__(self, world: World, rate: float, offset: float) -> None:
        self._world = world
        self.rate = rate
        self.offset = offset

    def now(self) -> float:
        return self.offset + self._world.now * (1.0 + self.rate)

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        raise NotImplementedError("the simulated server never schedules callbacks")

    def real(self, when: float) -> float:
        """This clock's ``when`` in virtual (real) time."""
        return (when - self.offset) / (1.0 + self.rate)
