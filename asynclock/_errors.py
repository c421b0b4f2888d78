"""The exception hierarchy, and the one place where driver errors become ours."""

from __future__ import annotations

from typing import Literal

from ._types import ExcType, ExcValue, Traceback

__all__ = (
    "BackendError",
    "CoordinatorClosed",
    "LeadershipLost",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "QuorumError",
    "map_backend_errors",
    "name_error",
)


class LockError(Exception):
    """Base class of every error asynclock raises on purpose.

    ``name`` is the lock (or election) the error is about, or None when it is about no
    one lock (a backend error outside an acquire, a closed coordinator). Pass it as the
    keyword argument ``name``; it is kept when the error is pickled.
    """

    name: str | None

    def __init__(self, *args: object, name: str | None = None) -> None:
        super().__init__(*args)
        self.name = name


class LockTimeout(LockError, TimeoutError):
    """The lock could not be acquired before the caller's ``timeout`` ran out.

    The message says why: another holder had it (and who, when the backend knows), or
    the server did not answer in time (then the ``TimeoutError`` is chained as
    ``__cause__``). A timeout from contention has no cause.
    """


class LockLost(LockError):
    """A held lease ended before its holder released it.

    Raised by ``async with coord.lock(...)`` when the renewal was refused or could not be
    confirmed before the lease's local validity ran out. When the body was cancelled
    because of the loss, the ``CancelledError`` is chained as ``__cause__``.
    """


class LeadershipLost(LockLost):
    """Leadership ended while the leader's body was still running."""


class LockNotOwned(LockError):
    """Release or extend of a lease that this holder no longer holds.

    The server's state is untouched: another holder's lease is never released or
    extended by mistake.
    """


class BackendError(LockError):
    """The server could not be reached or answered in a way asynclock does not expect.

    The driver's exception is chained as ``__cause__``.
    """


class QuorumError(BackendError):
    """Redlock could not reach a majority of its nodes in time."""


class CoordinatorClosed(LockError, RuntimeError):
    """The coordinator was closed (``aclose()``) before or while it was used.

    A shutdown, not an outage: not a :class:`BackendError`, so code that retries backend
    errors stops instead. Also a ``RuntimeError``, as using a closed object is.
    """


class map_backend_errors:
    """Turn a driver's exceptions into :class:`BackendError`, chaining the original.

    ``with map_backend_errors("Redis 127.0.0.1:6379", (RedisError, OSError)):`` wraps the
    driver call. Our own :class:`LockError` subclasses and cancellation pass through.
    A class rather than ``@contextmanager`` because it sits on the acquire hot path and
    one instance per backend is reused for every call.
    """

    __slots__ = ("_errors", "_where")

    def __init__(self, where: str, errors: tuple[type[BaseException], ...]) -> None:
        self._where = where
        self._errors = errors

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> Literal[False]:
        if exc is None or isinstance(exc, LockError) or not isinstance(exc, self._errors):
            return False
        detail = str(exc) or type(exc).__name__
        raise BackendError(f"{self._where}: {detail}") from exc


def name_error(exc: BaseException, name: str) -> None:
    """Tell a :class:`LockError` raised by the engine or a backend which lock it is about."""
    if isinstance(exc, LockError) and exc.name is None:
        exc.name = name
