"""PostgreSQL-only helpers: the name-to-key mapping, the fence step and transaction-level
advisory locks.

Session locks (``coord.lock()`` on a ``postgresql://`` coordinator) live in
``asynclock.backends.postgres``. The functions here work on any asyncpg connection, so
they can be used inside the application's own transactions. The name-to-key functions
(:func:`advisory_key`, :func:`permit_key`, :func:`waiting_key`, :func:`fence_ids`,
:func:`permit_fence_ids`, :func:`lock_ids`) are the very ones session locks use.

Fences do not depend on the fence sequence's settings or durability. A fence is
``GREATEST(nextval(sequence), the server's clock in whole µs since the Unix epoch)``,
computed right after the lock was granted, while the statement holds a
transaction-level lock on the name's *fence key* (:func:`fence_ids`,
:func:`permit_fence_ids`); the statement then waits until the server's clock has left
that microsecond. The next fence of the name is computed only after that transaction
ended, so it reads a later microsecond: fences of one name strictly increase, also
between holders that overlap (readers, permits), whatever sequence, schema, cache,
persistence or ``synchronous_commit`` each coordinator uses, and across crashes, given a
server clock that does not step back. The sequence is the floor should the clock be far
behind the fences it handed out.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Literal, overload

import asyncpg

from ._errors import BackendError, LockError, LockTimeout
from ._pgkeys import (
    DEFAULT_NAMESPACE,
    advisory_key,
    fence_ids,
    key_in,
    lock_ids,
    permit_fence_ids,
    permit_key,
    permit_prefix,
    waiting_key,
)
from ._validate import check_name, check_timeout
from .backends.postgres.schema import (
    IDENTITY_TABLE,
    ensure_fence_sequence,
    ensure_identity_table,
    fence_sequence_sql,
    identity_table_sql,
    quote_ident,
)
from .backends.postgres.sql import TRY_FENCE_WAIT_MS, fence_select, lock_timeout_sql

# Every public name: the key derivation (asynclock._pgkeys) and the schema and SQL helpers
# (asynclock.backends.postgres) are defined where session locks use them too, and offered
# here.
__all__ = (
    "DEFAULT_NAMESPACE",
    "IDENTITY_TABLE",
    "TRY_FENCE_WAIT_MS",
    "NoTransactionError",
    "advisory_key",
    "advisory_xact_lock",
    "ensure_fence_sequence",
    "ensure_identity_table",
    "fence_ids",
    "fence_select",
    "fence_sequence_sql",
    "identity_table_sql",
    "key_in",
    "lock_ids",
    "lock_timeout_sql",
    "permit_fence_ids",
    "permit_key",
    "permit_prefix",
    "quote_ident",
    "waiting_key",
)


class NoTransactionError(LockError, RuntimeError):
    """``advisory_xact_lock`` was called on a connection with no open transaction."""


def _timeout_ms(seconds: float) -> str:
    # lock_timeout 0 means "no limit": never round a real wait down to it.
    return str(max(1, math.ceil(seconds * 1000)))


@overload
async def advisory_xact_lock(
    conn: asyncpg.Connection[Any],
    name: str,
    *,
    timeout: float | None = None,
    shared: bool = False,
    fence: Literal[False] = False,
    namespace: str = DEFAULT_NAMESPACE,
    schema: str = "public",
    fence_sequence: str = "asynclock_fence",
) -> None: ...


@overload
async def advisory_xact_lock(
    conn: asyncpg.Connection[Any],
    name: str,
    *,
    timeout: float | None = None,
    shared: bool = False,
    fence: Literal[True],
    namespace: str = DEFAULT_NAMESPACE,
    schema: str = "public",
    fence_sequence: str = "asynclock_fence",
) -> int: ...


async def advisory_xact_lock(
    conn: asyncpg.Connection[Any],
    name: str,
    *,
    timeout: float | None = None,
    shared: bool = False,
    fence: bool = False,
    namespace: str = DEFAULT_NAMESPACE,
    schema: str = "public",
    fence_sequence: str = "asynclock_fence",
) -> int | None:
    """Take the transaction-level advisory lock of ``name`` in ``conn``'s open transaction.

    The lock is released when that transaction commits or rolls back; there is nothing to
    release by hand. It conflicts with the session locks of ``coord.lock(name)`` on a
    PostgreSQL coordinator with the same ``namespace``.

    - ``timeout``: ``None`` waits in the server's lock queue as long as it takes (at most
      the server's own ``lock_timeout``, if one is set; running out of it aborts the
      caller's transaction, unless ``fence=True``), ``0`` tries once, ``> 0`` waits at
      most that long (``lock_timeout``, inside a savepoint so that a timeout leaves the
      caller's transaction usable). Then :class:`LockTimeout`.
    - ``shared``: a shared lock (``pg_advisory_xact_lock_shared``).
    - ``fence``: also return a fencing token, strictly greater than every fence handed out
      before for ``name`` (by session or transaction locks, whatever their ``schema`` and
      ``fence_sequence``); the fence sequence ``schema.fence_sequence`` is created if
      missing. The lock and the fence are taken inside a savepoint: if either fails,
      nothing is held and the caller's transaction stays usable.

    Raises :class:`NoTransactionError` when no transaction is open, ``BackendError`` for
    server errors.
    """
    check_name(name)
    wait = check_timeout(timeout)
    if not conn.is_in_transaction():
        raise NoTransactionError(
            "advisory_xact_lock needs an open transaction: call it inside "
            "`async with conn.transaction():`"
        )
    key = advisory_key(name, namespace)
    try:
        if not fence:
            await _take_xact(conn, name, key, shared=shared, wait=wait, savepoint=True)
            return None
        began = time.monotonic()
        await ensure_fence_sequence(conn, schema, fence_sequence)
        sequence = f"{quote_ident(schema)}.{quote_ident(fence_sequence)}"
        async with conn.transaction():  # a savepoint: a failure gives back the lock too
            await _take_xact(conn, name, key, shared=shared, wait=wait, savepoint=False)
            left = wait
            if left:  # what is left of the caller's timeout bounds the fence step
                left = max(left - (time.monotonic() - began), 0.001)
            return await _xact_fence(conn, key, sequence, left)
    except LockError:
        raise
    except asyncpg.exceptions.LockNotAvailableError as exc:
        if wait is None:  # the server's own lock_timeout (session, role or database)
            raise LockTimeout(
                f"lock {name!r} not acquired within the server's lock_timeout "
                "(timeout=None waits no longer than that)"
            ) from exc
        raise LockTimeout(f"lock {name!r} not acquired within {wait:g}s") from exc
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        raise BackendError(f"PostgreSQL: {exc}") from exc


async def _take_xact(
    conn: asyncpg.Connection[Any],
    name: str,
    key: int,
    *,
    shared: bool,
    wait: float | None,
    savepoint: bool,
) -> None:
    """Take the transaction lock of ``key``; LockTimeout if a try finds it held.

    A timed wait runs in a savepoint of its own unless the caller already opened one
    (``savepoint=False``), so that its timeout leaves the transaction usable."""
    lock_fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    if wait is None:
        await conn.fetchval(f"SELECT NULL FROM {lock_fn}($1)", key)
        return
    if wait == 0:
        if not await conn.fetchval(f"SELECT pg_try_{lock_fn[3:]}($1)", key):
            raise LockTimeout(f"lock {name!r} is held (timeout=0: tried once)")
        return
    # lock_timeout is set local to the transaction and put back after the lock: a
    # savepoint that is released (not rolled back) keeps what was set inside it.
    statement = (
        "WITH saved AS (SELECT current_setting('lock_timeout') AS old), "
        "limited AS (SELECT old, set_config('lock_timeout', $2, true) FROM saved), "
        f"locked AS (SELECT old, {lock_fn}($1) FROM limited) "
        "SELECT NULL FROM locked, LATERAL "
        "(SELECT set_config('lock_timeout', locked.old, true)) AS restored"
    )
    if not savepoint:
        await conn.fetchval(statement, key, _timeout_ms(wait))
        return
    async with conn.transaction():
        await conn.fetchval(statement, key, _timeout_ms(wait))


class _GiveBack(Exception):
    """Rolls back the fence step's savepoint once its fence was read."""


async def _xact_fence(
    conn: asyncpg.Connection[Any], key: int, sequence: str, wait: float | None
) -> int:
    """The fence for a transaction lock of ``key`` the caller holds: the fence step in a
    savepoint that is rolled back at once, which releases the fence key (a transaction
    lock would otherwise be held until the caller's transaction ends, serialising every
    holder of the name behind it) and the step's ``lock_timeout``."""
    if wait is None:
        limited = "(SELECT 1) AS limited"  # the session's own lock_timeout, if any
        bound = None
    elif wait == 0:
        limited = f"(SELECT {lock_timeout_sql('$3', unless_set=True)} OFFSET 0) AS limited"
        bound = str(TRY_FENCE_WAIT_MS)
    else:
        limited = f"(SELECT {lock_timeout_sql('$3', unless_set=False)} OFFSET 0) AS limited"
        bound = _timeout_ms(wait)
    statement = fence_select(sequence, granted_rows=limited, fence_key=("$1", "$2"))
    args: list[object] = [*fence_ids(key)]
    if bound is not None:
        args.append(bound)
    fence: int | None = None
    with contextlib.suppress(_GiveBack):
        async with conn.transaction():
            row = await conn.fetchrow(statement, *args)
            assert row is not None
            fence = row["fence"]
            raise _GiveBack
    assert fence is not None
    return fence
