"""Argument checks shared by every public entry point.

A value of the wrong type raises ``TypeError``; a value of the right type that is not
allowed raises ``ValueError``. Messages name the argument, what is accepted and what came.
"""

from __future__ import annotations

import math

__all__ = ("MAX_NAME_BYTES", "check_name", "check_number", "check_timeout", "check_ttl")

#: Longest lock name accepted, in UTF-8 bytes (not characters): a Redis key is
#: ``prefix:{name}:fence``, and names travel in every command, so they stay short.
MAX_NAME_BYTES = 1024


def check_number(what: str, value: object, *, positive: bool = False) -> float:
    """Return ``value`` as a float if it is a finite real number (``> 0`` if ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return number


def check_ttl(ttl: object, what: str = "ttl") -> float:
    """A lease length: a finite number of seconds > 0. There is no 'forever'."""
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
