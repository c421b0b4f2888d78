"""What asyncpg's errors say about a connection, and how they become ``BackendError``.

A driver error either ends the session under a statement (:func:`gone`: its locks went
with it), leaves the connection ready for the next statement (:func:`answered`: the
server replied with an error), or leaves it in a state only closing it ends without
waiting on the server (cancelled, unanswered, broken). :class:`MapErrors` is the one
translation into :class:`BackendError`.
"""

from __future__ import annotations

from typing import Any, Literal

import asyncpg

from ..._errors import BackendError, LockError, map_backend_errors
from ..._types import ExcType, ExcValue, Traceback

__all__ = (
    "DRIVER_ERRORS",
    "MapErrors",
    "answered",
    "gone",
    "unanswered",
    "unusable",
)

# asyncpg's InternalClientError: a protocol state it cannot handle (seen when a frozen
# process resumes with the server's goodbye and a heartbeat due in the same instant).
_CONFUSED = asyncpg.exceptions.InternalClientError
DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, _CONFUSED, OSError)


def unusable(proxy: Any) -> bool:
    """Whether a pool connection can no longer be used: closed, or already released to
    the pool (a terminated connection is released at once, while its termination
    listeners run a moment later; asyncpg refuses every call on it, ``is_closed()``
    included, with InterfaceError)."""
    try:
        return bool(proxy.is_closed())
    except asyncpg.InterfaceError:
        return True


# The session is gone (or unusable): its locks went with it.
_SESSION_GONE = (
    asyncpg.PostgresConnectionError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    _CONFUSED,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.IdleSessionTimeoutError,
    OSError,
)


def gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the session ended under the statement (the server closed it,
    the network failed), as opposed to a statement that went unanswered (TimeoutError, an
    OSError too), whose session may live on until its connection is closed."""
    return isinstance(exc, _SESSION_GONE) and not isinstance(exc, TimeoutError)


def answered(exc: BaseException, conn: Any) -> bool:
    """Whether the connection ``exc`` came out of is ready for the next statement: the
    server answered with an error (or our code raised after an answer), nothing is still
    on its way, no transaction is open. Anything else (cancelled, timed out, broken)
    leaves it in a state only closing it ends without waiting on the server."""
    if not isinstance(exc, asyncpg.PostgresError | LockError):
        return False
    try:
        return not conn.is_closed() and not conn.is_in_transaction()
    except Exception:  # a proxy already given back
        return False


class MapErrors(map_backend_errors):
    """:class:`map_backend_errors`, with a message that says so when a statement went
    unanswered for the request timeout (the driver's TimeoutError says nothing)."""

    __slots__ = ("_place", "_timeout")

    def __init__(self, where: str, timeout: float) -> None:
        super().__init__(where, DRIVER_ERRORS)
        self._place = where
        self._timeout = timeout

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> Literal[False]:
        if isinstance(exc, TimeoutError) and not isinstance(exc, LockError):
            raise unanswered(self._place, self._timeout) from exc
        return super().__exit__(exc_type, exc, tb)


def unanswered(where: str, timeout: float) -> BackendError:
    """The BackendError for a statement on ``where`` not answered within ``timeout``."""
    return BackendError(
        f"{where}: no answer within the request timeout ({timeout:g} s); the connection "
        "was closed, and what its session held ends with it"
    )
