"""``@coord.singleton(...)`` and ``@coord.locked(...)`` for plain functions (blocking API).

As in async code, the call's own outcome wins over a release that failed (logged, and
finished in the background); a lease *lost* while the call ran raises
:class:`~asynclock.LockLost` when the call ends: the call may have run unprotected.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar

from .._decorators import namer
from .._errors import BackendError, LockTimeout
from ._lock import Lock

__all__ = ("leave", "locked", "run_held", "singleton")

logger = logging.getLogger("asynclock")

P = ParamSpec("P")
R = TypeVar("R")


class LockMaker(Protocol):
    """What the decorators make their locks with (a blocking Coordinator)."""

    def lock(self, name: str, *, ttl: float = ..., timeout: float | None = ...) -> Lock:
        """A lock on ``name``."""
        ...


def _check_plain(fn: Callable[..., Any]) -> None:
    if inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)!r} is an async def: the blocking API's "
            "decorators take plain functions (asynclock.Coordinator's take async ones)"
        )


def singleton(
    coord: LockMaker, template: str, *, ttl: float = 60.0
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the function only if nobody else runs it for the same name; otherwise skip
    the call and return None."""
    coord.lock("template-check", ttl=ttl)  # rejects a bad ttl now, at decoration

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        _check_plain(fn)
        name_for = namer(template, fn)

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R | None:
            lock = coord.lock(name_for(args, kwargs), ttl=ttl, timeout=0)
            try:
                lock.__enter__()
            except LockTimeout:
                return None  # someone else is at it
            return run_held(lock, fn, args, kwargs)

        return call

    return decorate


def locked(
    coord: LockMaker, template: str, *, ttl: float = 30.0, timeout: float | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Wait for the lock named from the call's arguments, then run the function."""
    coord.lock("template-check", ttl=ttl, timeout=timeout)  # bad arguments fail now

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        _check_plain(fn)
        name_for = namer(template, fn)

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            lock = coord.lock(name_for(args, kwargs), ttl=ttl, timeout=timeout)
            lock.__enter__()
            return run_held(lock, fn, args, kwargs)

        return call

    return decorate


def run_held(lock: Lock, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
    """Run ``fn`` in ``lock``'s block (entered by this thread), then leave it.

    An exception raised *into* the thread (Celery's ``SoftTimeLimitExceeded``, a
    ``KeyboardInterrupt``) may land on any line, also after ``fn`` returned and before
    the block was left: whatever ends this call, the lease is given back."""
    try:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            leave(lock, exc)  # may raise LockLost
            raise
        leave(lock, None)
    except BaseException:
        lock.give_back_entered()  # a no-op once the block was left
        raise
    return result


def leave(lock: Lock, exc: BaseException | None) -> None:
    """Leave ``lock``'s block after code that ended with ``exc``; a ``BackendError`` of
    the release is logged, not raised (the code's outcome wins)."""
    try:
        if exc is None:
            lock.__exit__(None, None, None)
        else:
            lock.__exit__(type(exc), exc, exc.__traceback__)
    except BackendError as error:
        logger.warning(
            "release of %r failed after its call ended; the call's outcome stands and the "
            "release goes on in the background: %s",
            lock.name,
            error,
        )
