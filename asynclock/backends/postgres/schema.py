"""The schema objects asynclock uses on PostgreSQL: identifiers, the fence sequence and
the identity table.

Each is created on first need (:func:`ensure_fence_sequence`,
:func:`ensure_identity_table`), inside a savepoint when the caller's transaction is open
so that a failure leaves it usable; a role that may not create one gets an error with
the SQL to run by hand (:func:`fence_sequence_sql`, :func:`identity_table_sql`). The
fence sequence's settings are checked: fences rely on ``CACHE 1``, a positive increment
and no cycle.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg

from ..._errors import BackendError

__all__ = (
    "IDENTITY_TABLE",
    "ensure_fence_sequence",
    "ensure_identity_table",
    "fence_sequence_sql",
    "identity_table_sql",
    "quote_ident",
)

#: The table (in the coordinator's schema) that keeps holder identities that
#: ``application_name`` cannot show whole: longer than about 25 bytes, or not printable
#: ASCII. Created on first need; one small row per such identity, never deleted by
#: asynclock (delete old rows at will: ``inspect()`` then shows ``#`` and a digest).
IDENTITY_TABLE = "asynclock_identities"


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


def _own_transaction(conn: asyncpg.Connection[Any]) -> AbstractAsyncContextManager[object]:
    """A savepoint if a transaction is open (a failure must not abort the caller's
    transaction), else nothing: each statement is a transaction of its own. No statement
    of ours to BEGIN and COMMIT, which asyncpg sends without a timeout."""
    if conn.is_in_transaction():
        savepoint: AbstractAsyncContextManager[object] = conn.transaction()
        return savepoint
    return contextlib.nullcontext()


async def ensure_identity_table(
    conn: asyncpg.Connection[Any], schema: str, *, timeout: float | None = None
) -> None:
    """Create the identity table if it does not exist; a clear error if we may not.

    ``timeout`` bounds each statement (asyncpg's ``timeout``: ``TimeoutError``)."""
    sql = identity_table_sql(schema)
    qualified = f"{quote_ident(schema)}.{quote_ident(IDENTITY_TABLE)}"
    try:
        async with _own_transaction(conn):
            await conn.execute(sql, timeout=timeout)
    except asyncpg.exceptions.InsufficientPrivilegeError as exc:
        raise BackendError(
            f"the role may not create the table {qualified} ({exc}), which keeps holder "
            "identities too long or not ASCII for application_name; run this once as a "
            f"role that may, or use identities of printable ASCII that fit:\n    {sql}\n"
            f"    GRANT SELECT, INSERT ON {qualified} TO <role>;"
        ) from exc
    except (asyncpg.exceptions.UniqueViolationError, asyncpg.exceptions.DuplicateTableError):
        return  # created concurrently (IF NOT EXISTS is not atomic)


async def ensure_fence_sequence(
    conn: asyncpg.Connection[Any], schema: str, sequence: str, *, timeout: float | None = None
) -> None:
    """Create the fence sequence if it does not exist; a clear error if we may not.

    ``timeout`` bounds each statement (asyncpg's ``timeout``: ``TimeoutError``)."""
    qualified = f"{quote_ident(schema)}.{quote_ident(sequence)}"
    sql = fence_sequence_sql(schema, sequence)
    try:
        async with _own_transaction(conn):
            found = await conn.fetchrow(
                "SELECT seqcache, seqincrement, seqcycle FROM pg_sequence"
                " WHERE seqrelid = to_regclass($1)",
                qualified,
                timeout=timeout,
            )
            if found is None:
                await conn.execute(sql, timeout=timeout)
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
