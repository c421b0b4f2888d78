"""Exponential backoff with full jitter, used while waiting and between renewal retries."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._validate import check_number

__all__ = ("Backoff",)

# Past this many doublings every step is the cap; also keeps ``multiplier ** n`` finite.
_MAX_EXPONENT = 64


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between attempts: ``initial * multiplier ** attempt``, capped at ``maximum``.

    With ``jitter`` (the default) each delay is a uniform draw below the current step
    ("full jitter"), so waiters that failed together do not retry together.

    While waiting for a lock, a wake-up from the holder's release ends a delay early; the
    backoff only bounds how long a waiter sleeps when no wake-up comes (a holder that
    crashed, a lost connection). The watchdog uses the same delays between renewal
    retries after a backend error.

    Raises ``TypeError`` for non-numbers and ``ValueError`` unless
    ``0 < initial <= maximum`` (finite) and ``multiplier >= 1``.
    """

    initial: float = 0.01
    maximum: float = 1.0
    multiplier: float = 2.0
    jitter: bool = True

    def __post_init__(self) -> None:
        check_number("initial", self.initial, positive=True)
        check_number("maximum", self.maximum, positive=True)
        check_number("multiplier", self.multiplier, positive=True)
        if self.maximum < self.initial:
            raise ValueError(
                f"Backoff maximum must be >= initial, got initial={self.initial!r} "
                f"maximum={self.maximum!r}"
            )
        if self.multiplier < 1:
            raise ValueError(f"Backoff multiplier must be >= 1, got {self.multiplier!r}")
        if not isinstance(self.jitter, bool):
            raise TypeError(f"Backoff jitter must be a bool, got {type(self.jitter).__name__}")

    def step(self, attempt: int) -> float:
        """The un-jittered step for the 0-based ``attempt``: the upper bound of its delay."""
        if attempt >= _MAX_EXPONENT:
            return float(self.maximum)
        return float(min(self.maximum, self.initial * self.multiplier ** max(attempt, 0)))

    def delay(self, attempt: int) -> float:
        """The delay before retry number ``attempt`` (0-based), jittered if enabled."""
        step = self.step(attempt)
        if self.jitter:
            # random() is in [0, 1): a draw strictly below the step, never a busy zero loop
            # in expectation. Security does not matter here.
            return step * random.random()  # noqa: S311
        return step

    def __repr__(self) -> str:
        return (
            f"Backoff(initial={self.initial!r}, maximum={self.maximum!r}, "
            f"multiplier={self.multiplier!r}, jitter={self.jitter!r})"
        )
