"""Injectable monotonic time.

Everything in asynclock that reads the time or waits for a moment goes through a
:class:`Clock`: lease validity, acquire deadlines, the watchdog's schedule, and the memory
backend's expiry. Production uses :class:`LoopClock` (the event loop's monotonic clock);
tests of the memory backend use ``asynclock.testing.ManualClock`` to move time by hand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ("Clock", "LoopClock", "Timer")


class Timer(Protocol):
    """A scheduled callback that can be cancelled (``asyncio.TimerHandle`` fits)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds and callbacks at a moment of that time."""

    def now(self) -> float:
        """Monotonic time in seconds."""
        ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        """Run ``callback`` (on the running event loop) once ``now() >= when``."""
        ...


class LoopClock:
    """The running event loop's clock (``time.monotonic`` on asyncio's default loop)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        loop = asyncio.get_running_loop()
        # Convert rather than assume loop.time() is time.monotonic(): uvloop keeps its own.
        return loop.call_later(max(0.0, when - time.monotonic()), callback)

    def __repr__(self) -> str:
        return "LoopClock()"
