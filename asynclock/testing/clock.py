"""A clock that moves only when told: virtual time for the memory backend."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

__all__ = ("ManualClock",)


class _ManualTimer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Virtual monotonic time for tests of the memory backend.

    Pass the same instance to ``MemoryBackend(clock=clock)``; the coordinator, its locks,
    leases and watchdog then live on it. Nothing happens until the test moves time with
    :meth:`advance` (which lets the event loop run between timers, as real time would)
    or :meth:`jump` (which fires the due timers at once, without yielding).
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], object]) -> _ManualTimer:
        timer = _ManualTimer(callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def _pop_due(self, until: float) -> _ManualTimer | None:
        while self._timers and self._timers[0][0] <= until:
            when, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self._now = max(self._now, when)
                return timer
        return None

    async def advance(self, seconds: float, *, settle: int = 20) -> None:
        """Move time forward by ``seconds``, firing timers in order.

        After each timer (and at the end) the event loop runs ``settle`` times, so tasks
        woken by a timer (a renewal, a waiter) act before time moves on.
        """
        if seconds < 0:
            raise ValueError(f"cannot move a monotonic clock back ({seconds!r})")
        until = self._now + seconds
        while (timer := self._pop_due(until)) is not None:
            timer.callback()
            await self.settle(settle)
        self._now = until
        await self.settle(settle)

    def jump(self, seconds: float) -> None:
        """Move time forward and fire every timer due, without letting tasks run between."""
        if seconds < 0:
            raise ValueError(f"cannot move a monotonic clock back ({seconds!r})")
        until = self._now + seconds
        while (timer := self._pop_due(until)) is not None:
            timer.callback()
        self._now = until

    @staticmethod
    async def settle(rounds: int = 20) -> None:
        """Let the event loop run ``rounds`` times without moving virtual time."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"<ManualClock now={self._now:.3f} timers={len(self._timers)}>"
