"""``@coord.singleton(...)`` and ``@coord.locked(...)``: a lock around a coroutine function,
named from the call's arguments.

When the call ends and its release fails (the server did not confirm), the call's own
outcome wins — its result is returned, its exception raised — and the failure is logged
and counted (``stats().release_failures``); the release goes on in the background until
the server confirms or the TTL ends. A caller retrying on ``BackendError`` would
otherwise run a completed call a second time. A lease *lost* while the call ran still
raises :class:`~asynclock.LockLost`: the call may have run unprotected.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import string
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar

from ._errors import BackendError, LockTimeout
from ._lock import Lock

__all__ = ("LockMaker", "leave", "locked", "namer", "run_held", "singleton", "template_fields")

logger = logging.getLogger("asynclock")

P = ParamSpec("P")
R = TypeVar("R")


Namer = Callable[[tuple[Any, ...], dict[str, Any]], str]


class LockMaker(Protocol):
    """What the decorators make their locks with (a :class:`~asynclock.Coordinator`)."""

    def lock(self, name: str, *, ttl: float = ..., timeout: float | None = ...) -> Lock:
        """A lock on ``name`` (see :meth:`Coordinator.lock <asynclock.Coordinator.lock>`)."""
        ...


def template_fields(template: object, *, what: str = "parameters") -> frozenset[str]:
    """The names a lock-name template uses (``{user_id}``, ``{order.id}`` -> ``order``).

    Raises ``TypeError`` for a non-str, ``ValueError`` for an empty or malformed template
    or a positional field (``{}``, ``{0}``): lock names come from named ``what``.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    if not template:
        raise ValueError("template must not be empty")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"template {template!r} is not a valid format string: {exc}") from None
    fields: set[str] = set()
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"template {template!r}: name the {what}, as in '{{user_id}}', not '{{{field}}}'"
            )
        fields.add(root)
    return frozenset(fields)


def _namer(template: str, fn: Callable[..., Any]) -> Namer:
    """:func:`namer` for an ``async def``."""
    fields = template_fields(template)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} must be an async def function")
    return namer(template, fn, fields)


def namer(template: str, fn: Callable[..., Any], fields: frozenset[str] | None = None) -> Namer:
    """A function from a call's arguments to the lock name; checks the template now
    (against ``fn``'s parameters)."""
    if fields is None:
        fields = template_fields(template)
    signature = inspect.signature(fn)
    for root in sorted(fields):
        if root not in signature.parameters:
            raise ValueError(
                f"template {template!r} names {root!r}, which {fn.__qualname__}() does not "
                f"take (its parameters: {', '.join(signature.parameters) or 'none'})"
            )

    def name_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return template.format(**bound.arguments)

    return name_for


def singleton(
    coord: LockMaker, template: str, *, ttl: float = 60.0
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R | None]]]:
    """Run the function only if nobody else is running it for the same name; otherwise
    skip the call and return None. See :meth:`Coordinator.singleton`."""
    coord.lock("template-check", ttl=ttl)  # rejects a bad ttl now, at decoration

    def decorate(
        fn: Callable[P, Coroutine[Any, Any, R]],
    ) -> Callable[P, Coroutine[Any, Any, R | None]]:
        name_for = _namer(template, fn)

        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> R | None:
            lock = coord.lock(name_for(args, kwargs), ttl=ttl, timeout=0)
            try:
                await lock.__aenter__()
            except LockTimeout:
                return None  # someone else is at it
            return await run_held(lock, fn, args, kwargs)

        return call

    return decorate


def locked(
    coord: LockMaker, template: str, *, ttl: float = 30.0, timeout: float | None = None
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Wait for the lock named from the call's arguments, then run the function. See
    :meth:`Coordinator.locked`."""
    coord.lock("template-check", ttl=ttl, timeout=timeout)  # bad arguments fail now

    def decorate(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        name_for = _namer(template, fn)

        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            lock = coord.lock(name_for(args, kwargs), ttl=ttl, timeout=timeout)
            await lock.__aenter__()
            return await run_held(lock, fn, args, kwargs)

        return call

    return decorate


async def run_held(
    lock: Lock, fn: Callable[..., Awaitable[R]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> R:
    """Run ``fn`` in ``lock``'s block (entered by this task), then leave it: the call's
    outcome wins over a failed release (see :func:`leave`)."""
    try:
        result = await fn(*args, **kwargs)
    except BaseException as exc:
        await leave(lock, exc)  # may raise LockLost
        raise
    await leave(lock, None)
    return result


async def leave(lock: Lock, exc: BaseException | None) -> None:
    """Leave ``lock``'s block entered by this task, after code that ended with ``exc``
    (None: it returned); the code's outcome wins over a release that failed.

    Raises :class:`~asynclock.LockLost` when the lease was lost (whatever ``exc``, as
    ``async with`` does); a ``BackendError`` of the release is logged, not raised (it is
    counted in ``stats().release_failures`` and finished in the background).
    """
    try:
        if exc is None:
            await lock.__aexit__(None, None, None)
        else:
            await lock.__aexit__(type(exc), exc, exc.__traceback__)
    except BackendError as error:
        logger.warning(
            "release of %r failed after its call ended; the call's outcome stands and the "
            "release goes on in the background: %s",
            lock.name,
            error,
        )
