"""PostgreSQL-only helpers: the name-to-key mapping and transaction-level advisory locks.

Session locks (``coord.lock()`` on a ``postgresql://`` coordinator) live in
``asynclock.backends.postgres``. The functions here work on any asyncpg connection, so
they can be used inside the application's own transactions.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal, overload

import asyncpg

from ._errors import BackendError, LockError, LockTimeout
from ._validate import check_name, check_timeout

__all__ = (
    "DEFAULT_NAMESPACE",
    "IDENTITY_TABLE",
    "NoTransactionError",
    "advisory_key",
    "advisory_xact_lock",
    "fence_sequence_sql",
    "identity_table_sql",
    "permit_key",
    "quote_ident",
)

#: The namespace mixed into every key unless another is configured.
DEFAULT_NAMESPACE = "asynclock"

#: The table (in the coordinator's schema) that keeps holder identities that
#: ``application_name`` cannot show whole: longer than about 25 bytes, or not printable
#: ASCII. Created on first need; one small row per such identity, never deleted by
#: asynclock (delete old rows at will: ``inspect()`` then shows ``#`` and a digest).
IDENTITY_TABLE = "asynclock_identities"


class NoTransactionError(LockError, RuntimeError):
    """``advisory_xact_lock`` was called on a connection with no open transaction."""


def advisory_key(name: str, namespace: str = DEFAULT_NAMESPACE) -> int:
    """The 64-bit advisory-lock key of ``name``: stable, documented, any language can
    compute it.

    ``key = first 8 bytes of SHA-256(UTF-8(namespace) + b"\\x00" + UTF-8(name))``, read as a
    big-endian *signed* 64-bit integer (PostgreSQL's ``bigint``). Locks taken with this
    one-argument (``bigint``) form never conflict with the two-``int4`` form
    (``pg_advisory_lock(int, int)``): PostgreSQL tags them differently.

    >>> advisory_key("invoice:42")
    -3222681048253742227
    """
    check_name(name)
    check_name(namespace, "namespace")
    return key_in(namespace.encode() + b"\x00", name)


def key_in(prefix: bytes, name: str) -> int:
    """:func:`advisory_key` for ``prefix = UTF-8(namespace) + b"\\x00"``, unchecked."""
    digest = hashlib.sha256(prefix + name.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def permit_prefix(namespace: str, name: str) -> bytes:
    """The bytes every permit key of semaphore ``name`` is hashed from, before the slot.

    ``UTF-8(namespace) + b"\\x00" + UTF-8(name) + b"\\xff"``: the same start as a lock's
    key, then a byte that never occurs in UTF-8, so no lock name hashes the same input.
    """
    return namespace.encode() + b"\x00" + name.encode() + b"\xff"


def permit_key(name: str, slot: int, namespace: str = DEFAULT_NAMESPACE) -> int:
    """The 64-bit advisory-lock key of permit ``slot`` (0 to limit - 1) of semaphore ``name``.

    ``key = first 8 bytes of SHA-256(UTF-8(namespace) + b"\\x00" + UTF-8(name) + b"\\xff" +
    ASCII(decimal slot))``, big-endian signed, like :func:`advisory_key`. ``0xFF`` never
    occurs in UTF-8, so permit keys and lock keys are hashed from different inputs: a
    semaphore never shares keys with the lock of the same name.

    >>> permit_key("api-quota", 0) == permit_key("api-quota", 0, "asynclock")
    True
    """
    check_name(name)
    check_name(namespace, "namespace")
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ValueError(f"slot must be an int >= 0, got {slot!r}")
    digest = hashlib.sha256(permit_prefix(namespace, name) + str(slot).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def waiting_key(name: str, namespace: str = DEFAULT_NAMESPACE) -> int:
    """The key permit waiters of semaphore ``name`` hold (shared) while they wait.

    ``SHA-256(permit_prefix + b"waiting")``: not a decimal slot, so never a permit key. A
    release that cannot take it exclusively knows someone waits and sends a NOTIFY.
    """
    digest = hashlib.sha256(permit_prefix(namespace, name) + b"waiting").digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def lock_ids(key: int) -> tuple[int, int]:
    """``(classid, objid)`` under which ``pg_locks`` shows a ``bigint`` key (objsubid 1)."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


def quote_ident(identifier: str) -> str:
    """A PostgreSQL identifier, double-quoted."""
    if not isinstance(identifier, str) or not identifier or "\x00" in identifier:
        raise ValueError(f"not a valid PostgreSQL identifier: {identifier!r}")
    return '"' + identifier.replace('"', '""') + '"'


def fence_sequence_sql(schema: str, sequence: str) -> str:
    """The SQL that creates the fence sequence (run it by hand if the role may not)."""
    return f"CREATE SEQUENCE IF NOT EXISTS {quote_ident(schema)}.{quote_ident(sequence)} CACHE 1;"


def identity_table_sql(schema: str) -> str:
    """The SQL that creates the identity table (run it by hand if the role may not)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_ident(schema)}.{quote_ident(IDENTITY_TABLE)} "
        "(digest text PRIMARY KEY, identity text NOT NULL);"
    )


async def ensure_identity_table(conn: asyncpg.Connection[Any], schema: str) -> None:
    """Create the identity table if it does not exist; a clear error if we may not."""
    sql = identity_table_sql(schema)
    qualified = f"{quote_ident(schema)}.{quote_ident(IDENTITY_TABLE)}"
    try:
        async with conn.transaction():
            await conn.execute(sql)
    except asyncpg.exceptions.InsufficientPrivilegeError as exc:
        raise BackendError(
            f"the role may not create the table {qualified} ({exc}), which keeps holder "
            "identities too long or not ASCII for application_name; run this once as a "
            f"role that may, or use identities of printable ASCII that fit:\n    {sql}\n"
            f"    GRANT SELECT, INSERT ON {qualified} TO <role>;"
        ) from exc
    except (asyncpg.exceptions.UniqueViolationError, asyncpg.exceptions.DuplicateTableError):
        return  # created concurrently (IF NOT EXISTS is not atomic)


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
      caller's transaction), ``0`` tries once, ``> 0`` waits at most that long
      (``lock_timeout``, inside a savepoint so that a timeout leaves the caller's
      transaction usable). Then :class:`LockTimeout`.
    - ``shared``: a shared lock (``pg_advisory_xact_lock_shared``).
    - ``fence``: also return a fencing token from the coordinator's fence sequence
      (created if missing), strictly greater than every fence handed out before.

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
    lock_fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    sequence = f"{quote_ident(schema)}.{quote_ident(fence_sequence)}"
    next_fence = f"nextval('{sequence}')" if fence else "NULL::bigint"
    try:
        if fence:
            await ensure_fence_sequence(conn, schema, fence_sequence)
        if wait is None:
            return await conn.fetchval(f"SELECT {next_fence} FROM {lock_fn}($1)", key)  # type: ignore[no-any-return]
        if wait == 0:
            row = await conn.fetchrow(
                f"SELECT ok, CASE WHEN ok THEN {next_fence} END AS fence "
                f"FROM (SELECT pg_try_{lock_fn[3:]}($1) AS ok) AS attempt",
                key,
            )
            assert row is not None
            if not row["ok"]:
                raise LockTimeout(f"lock {name!r} is held (timeout=0: tried once)")
            return row["fence"]  # type: ignore[no-any-return]
        async with conn.transaction():  # a savepoint: a timeout rolls back only this
            return await conn.fetchval(  # type: ignore[no-any-return]
                "WITH saved AS (SELECT current_setting('lock_timeout') AS old), "
                "limited AS (SELECT old, set_config('lock_timeout', $2, true) FROM saved), "
                f"locked AS (SELECT old, {lock_fn}($1) FROM limited) "
                f"SELECT {next_fence} FROM locked, LATERAL "
                "(SELECT set_config('lock_timeout', locked.old, true)) AS restored",
                key,
                _timeout_ms(wait),
            )
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


async def ensure_fence_sequence(conn: asyncpg.Connection[Any], schema: str, sequence: str) -> None:
    """Create the fence sequence if it does not exist; a clear error if we may not."""
    qualified = f"{quote_ident(schema)}.{quote_ident(sequence)}"
    sql = fence_sequence_sql(schema, sequence)
    try:
        # In a transaction of its own (a savepoint if one is open): a failure must not
        # abort the caller's transaction.
        async with conn.transaction():
            found = await conn.fetchrow(
                "SELECT seqcache, seqincrement, seqcycle FROM pg_sequence"
                " WHERE seqrelid = to_regclass($1)",
                qualified,
            )
            if found is None:
                await conn.execute(sql)
                return
    except asyncpg.exceptions.InsufficientPrivilegeError as exc:
        raise BackendError(
            f"the role may not create or use the fence sequence {qualified} ({exc}); "
            f"run this once as a role that may, then let this role use it:\n    {sql}\n"
            f"    GRANT USAGE ON SCHEMA {quote_ident(schema)} TO <role>;\n"
            f"    GRANT USAGE ON SEQUENCE {qualified} TO <role>;"
        ) from exc
    except (asyncpg.exceptions.UniqueViolationError, asyncpg.exceptions.DuplicateTableError):
        # Created concurrently by another coordinator: IF NOT EXISTS is not atomic, and
        # the loser of the race gets one of these two errors depending on timing.
        return
    cache, increment, cycle = found
    if cache != 1 or increment <= 0 or cycle:
        # Each session caches its own range of values with CACHE > 1: a session that took
        # 1..20 hands out 2 after another handed out 21, and fences go backwards.
        raise BackendError(
            f"the fence sequence {qualified} was created with CACHE {cache}, INCREMENT "
            f"{increment}{' CYCLE' if cycle else ''}: fences would not always increase. "
            f"Fix it once with:\n    ALTER SEQUENCE {qualified} CACHE 1 INCREMENT 1 NO CYCLE;"
        )
