"""Argument checks shared by every public entry point.

A value of the wrong type raises ``TypeError``; a value of the right type that is not
allowed raises ``ValueError``. Messages name the argument, what is accepted and what came.
"""

from __future__ import annotations

import math

__all__ = (
    "MAX_NAME_BYTES",
    "MAX_SECONDS",
    "check_name",
    "check_number",
    "check_timeout",
    "check_ttl",
)

#: Longest lock name accepted, in UTF-8 bytes (not characters): a Redis key is
#: ``prefix:{name}:fence``, and names travel in every command, so they stay short.
MAX_NAME_BYTES = 1024

#: The largest number :func:`check_number` accepts: 1e9 seconds, about 31.7 years. Seconds
#: travel to servers in milliseconds: far past this a server refuses the value, and past
#: about 1.8e305 s the milliseconds overflow to infinity (OverflowError, not ValueError).
MAX_SECONDS = 1e9


def check_number(what: str, value: object, *, positive: bool = False) -> float:
    """Return ``value`` as a float if it is a real number from 0 (excluded if ``positive``)
    to :data:`MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{what} must be from 0 to {MAX_SECONDS:g}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    if number > MAX_SECONDS:
        raise ValueError(f"{what} must be at most {MAX_SECONDS:g}, got {value!r}")
    return number


def check_ttl(ttl: object, what: str = "ttl") -> float:
    """A lease length: from 1 ms to :data:`MAX_SECONDS` seconds. There is no 'forever'."""
    seconds = check_number(what, ttl, positive=True)
    if seconds < 0.001:
        raise ValueError(f"{what} must be at least 0.001 s (1 ms), got {ttl!r}")
    return seconds


def check_timeout(timeout: object) -> float | None:
    """``None`` waits forever, ``0`` tries once, ``> 0`` waits at most that many seconds."""
    if timeout is None:
        return None
    return check_number("timeout", timeout)


def check_name(name: object, what: str = "name") -> str:
    """A lock name: a non-empty ``str`` of at most :data:`MAX_NAME_BYTES` UTF-8 bytes."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"{what} must not be empty")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be encodable as UTF-8 (no lone surrogates)") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{what} must be at most {MAX_NAME_BYTES} UTF-8 bytes, got {size} bytes")
    return name
