"""Web framework integrations: ``asynclock.integrations.fastapi`` and
``asynclock.integrations.aiohttp``.

Each needs its framework (``pip install 'asynclock[fastapi]'`` or
``'asynclock[aiohttp]'``); importing one without it raises an ``ImportError`` that names
the extra. This package itself imports neither framework: it holds what both share —
lock names from URL templates, the HTTP answers to a refused or lost lock, and the
leader-only background tasks — as private helpers.

The HTTP answers, on both frameworks:

- ``423 Locked`` with ``Retry-After`` (whole seconds, at least 1: the holder's remaining
  TTL rounded up, or 1 when unknown) when another holder kept the lock past ``timeout``
  (contention, and only that: after a timeout the server is asked who holds the lock);
- ``503 Service Unavailable`` with ``Retry-After: 1`` when the lock server cannot be
  reached (:class:`~asynclock.BackendError`, raised at once whatever the timeout), or
  when ``timeout`` ran out with the server not answering (and it does not answer, or
  names no holder, when asked who holds the lock);
- ``503 Service Unavailable`` when the lease was lost while the handler ran (the handler
  was cancelled; what it did before is not undone: that is what fences are for) — unless
  the response had already started (a streamed body under FastAPI's
  ``scope="request"``): its status was sent, so the stream is cut instead, the client
  sees an incomplete body (the connection closes before the body's end), and the loss
  is logged;
- ``400 Bad Request`` when the lock name built from the URL is not a valid lock name
  (longer than 1024 UTF-8 bytes).

When the handler has finished and the release fails (the server did not confirm), the
handler's outcome stands — its response, or its own exception such as an
``HTTPException(404)`` — and the failure is logged and counted in
``stats().release_failures``; the release goes on in the background until the server
confirms or the TTL ends. A 500 would invite the client to retry a request that
completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._coordinator import Coordinator, connect
from .._decorators import leave, template_fields
from .._election import Election, Term, check_election
from .._errors import BackendError, LockLost, LockTimeout
from .._lock import Lease
from .._validate import check_timeout, check_ttl

__all__ = ()

logger = logging.getLogger("asynclock")

#: A leader-only job: called with the :class:`~asynclock.Term` while this instance leads.
LeaderCallback = Callable[[Term], Awaitable[object]]

# How long a 423 answer may spend asking who holds the lock, for its Retry-After.
_INSPECT_TIMEOUT = 1.0


class _Refusal(Exception):
    """The lock could not be held for the request: the status, text and headers to answer."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers or {}


class _Template:
    """A lock name template such as ``"invoice:{invoice_id}"``, checked when made."""

    __slots__ = ("fields", "text")

    def __init__(self, template: object) -> None:
        self.fields = template_fields(template, what="path parameters")
        self.text = str(template)

    def missing(self, available: Iterable[str]) -> list[str]:
        """The fields that ``available`` path parameter names do not provide, sorted."""
        return sorted(self.fields - set(available))

    def format(self, params: Mapping[str, Any], where: str) -> str:
        """The lock name for a request whose path parameters are ``params``.

        Raises ``RuntimeError`` (a programming error: answered 500) when the route lacks
        a field of the template.
        """
        missing = self.missing(params)
        if missing:
            raise RuntimeError(
                f"lock template {self.text!r} needs path parameter(s) "
                f"{', '.join(map(repr, missing))}, which {where} does not have (its path "
                f"parameters: {', '.join(map(repr, sorted(params))) or 'none'})"
            )
        return self.text.format(**params)

    def __repr__(self) -> str:
        return repr(self.text)


def _check_lock_options(ttl: object, timeout: object) -> tuple[float, float | None]:
    """Validate ``ttl`` and ``timeout`` when the dependency or decorator is made."""
    return check_ttl(ttl), check_timeout(timeout)


async def _holder_ttl(coord: Coordinator, name: str) -> float | None:
    """Seconds left of the holder's lease (inf if unknown, 0 when free), or None when
    the server does not answer within ``_INSPECT_TIMEOUT``."""
    try:
        async with asyncio.timeout(_INSPECT_TIMEOUT):
            info = await coord.inspect(name)
    except (BackendError, TimeoutError):
        return None
    return 0.0 if info is None else info.expires_in


def _unanswered(exc: LockTimeout) -> bool:
    """The deadline ran out while a request to the server was in flight (the lock raises
    that ``LockTimeout`` from the ``TimeoutError`` of its own bound)."""
    cause = exc.__cause__
    return isinstance(cause, TimeoutError) and not isinstance(cause, LockTimeout)


async def _refusal_after_timeout(coord: Coordinator, name: str, exc: LockTimeout) -> _Refusal:
    """423 when another holder kept the lock; 503 when the server did not answer.

    A deadline that ran out with a request in flight is contention only if the server,
    asked who holds the lock, names a holder: a slow server and a deadline that cut a
    refused attempt short look the same from the exception alone.
    """
    left = await _holder_ttl(coord, name)
    if left is None or (left == 0 and _unanswered(exc)):
        return _unavailable(name, exc)
    seconds = max(1, math.ceil(left)) if math.isfinite(left) else 1
    return _Refusal(
        423,
        f"{name!r} is locked by another request; retry in {seconds}s",
        {"Retry-After": str(seconds)},
    )


def _unavailable(name: str, exc: BaseException) -> _Refusal:
    logger.warning("could not lock %r for a request: %s", name, exc)
    return _Refusal(503, "the lock service is unavailable; retry later", {"Retry-After": "1"})


@contextlib.asynccontextmanager
async def _hold(
    coord: Coordinator,
    name: str,
    *,
    ttl: float,
    timeout: float | None,  # noqa: ASYNC109 - coord.lock()'s timeout, passed through
) -> AsyncIterator[Lease]:
    """Hold ``coord.lock(name)`` around the handler; refusals become :class:`_Refusal`.

    Only this lock's own outcomes are translated: a ``LockTimeout`` or ``LockLost`` that
    the handler raises (from a lock of its own) passes through unchanged.
    """
    try:
        lock = coord.lock(name, ttl=ttl, timeout=timeout)
    except ValueError as exc:  # ttl and timeout were checked already: the name is bad
        raise _Refusal(400, f"no valid lock name from this URL: {exc}") from exc
    try:
        lease = await lock.__aenter__()
    except LockTimeout as exc:
        raise await _refusal_after_timeout(coord, name, exc) from exc
    except BackendError as exc:
        raise _unavailable(name, exc) from exc
    try:
        yield lease
    except BaseException as exc:
        try:
            await leave(lock, exc)
        except LockLost as lost:  # only ever this lease's loss
            raise _lost(name, lost) from lost
        raise
    try:
        await leave(lock, None)
    except LockLost as lost:
        raise _lost(name, lost) from lost


def _lost(name: str, exc: LockLost) -> _Refusal:
    logger.warning("lost the lock %r while handling a request: %s", name, exc)
    return _Refusal(503, f"lost the lock {name!r} while handling the request; it was interrupted")


# -- leader-only background tasks ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _LeaderSpec:
    """A registered leader-only task: ``coord.election(name, ...).run(callback)``."""

    name: str
    callback: LeaderCallback
    ttl: float
    identity: str | None

    @classmethod
    def make(cls, name: object, callback: object, ttl: object, identity: object) -> _LeaderSpec:
        """Validate the arguments now, so that a mistake fails at registration."""
        if not callable(callback):
            raise TypeError(
                f"callback must be an async function taking a Term, got {type(callback).__name__}"
            )
        checked_name, seconds, _ = check_election(name, ttl, identity)
        assert identity is None or isinstance(identity, str)  # checked just above
        return cls(checked_name, callback, seconds, identity)


def _start_leaders(coord: Coordinator, specs: Sequence[_LeaderSpec]) -> list[asyncio.Task[None]]:
    """One task per spec, campaigning forever; a crash is logged, not left unretrieved."""
    tasks: list[asyncio.Task[None]] = []
    for spec in specs:
        election = coord.election(spec.name, ttl=spec.ttl, identity=spec.identity)
        task = asyncio.get_running_loop().create_task(
            _campaign(election, spec.callback), name=f"asynclock-leader:{spec.name}"
        )
        task.add_done_callback(_report_crash)
        tasks.append(task)
    return tasks


async def _campaign(election: Election, callback: LeaderCallback) -> None:
    await election.run(callback)  # returns only by an exception: cancelled, or a crash


def _report_crash(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error(
            "leader task %r stopped: its callback raised; it is not restarted",
            task.get_name(),
            exc_info=exc,
        )


async def _stop_leaders(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the leader tasks (each resigns its term) and wait until they are done."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


def _make_coordinator(
    target: str | Sequence[str] | Coordinator, options: Mapping[str, Any]
) -> tuple[Coordinator, bool]:
    """The coordinator to use and whether we own it (and must close it)."""
    if isinstance(target, Coordinator):
        return target, False
    return connect(target, **options), True


def _check_target(target: object, options: Mapping[str, Any]) -> None:
    """Reject a target that is neither a URL, a list of URLs nor a Coordinator now."""
    if isinstance(target, Coordinator):
        if options:
            raise TypeError(
                f"connect options ({', '.join(sorted(options))}) apply to a URL, not to a "
                "Coordinator passed in"
            )
        if target.closed:
            raise ValueError("the Coordinator passed in is closed")
        return
    if isinstance(target, str):
        return
    if isinstance(target, list | tuple) and all(isinstance(url, str) for url in target):
        return
    raise TypeError(
        "expected a URL, a list of Redis URLs (Redlock) or an asynclock.Coordinator, got "
        f"{type(target).__name__}"
    )
