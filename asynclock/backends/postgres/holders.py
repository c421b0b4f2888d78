"""How a holder is named on the server, and read back for ``inspect()``.

A session of ours carries ``asynclock:<fence>:<ttl ms>:<identity>`` as its
``application_name`` (:data:`APP_PREFIX`; fence 0 until the fence step ran), which
``pg_stat_activity`` shows beside the session's locks. An identity that
``application_name`` cannot keep whole is shown as ``#`` and the start of its digest,
and stored in the identity table (:data:`~.schema.IDENTITY_TABLE`) under its whole
digest: :func:`store_identity` writes it there, :func:`identified` finds it again.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import asyncpg

from ..base import LockInfo
from .schema import IDENTITY_TABLE, ensure_identity_table, quote_ident

__all__ = (
    "APP_PREFIX",
    "DIGEST_MARK",
    "holder_info",
    "identified",
    "identity_of",
    "inline",
    "shown",
    "store_identity",
)

APP_PREFIX = "asynclock:"

# application_name keeps at most 63 bytes (NAMEDATALEN - 1; longer is cut) of printable
# ASCII (other characters are replaced or escaped): a holder's identity is shown there as
# itself only when it survives that whatever the fence (a bigint: up to 19 digits) and
# the TTL. Any other identity is shown as "#" and the start of its digest (as much as fits
# beside the widest fence and the TTL, at least 64 bits), and the identity itself is
# stored once in a table (IDENTITY_TABLE) under its whole digest, where inspect() finds
# it by that start. Storing it is safer than bounding identities: the default
# host:pid:random identity of a host with a long name (a Kubernetes pod's) must be
# reported as it is, and an identity cut or escaped would name another holder, or one
# holder under two names (observe()).
_APP_NAME_BYTES = 63
_FENCE_DIGITS = 19
DIGEST_MARK = "#"
_DIGEST_CHARS = 32
_MIN_DIGEST_CHARS = 16
# The identity tables of other schemas that the role may read ($1 the table's name, $2 the
# backend's own schema), for holders whose coordinators use another schema.
_IDENTITY_TABLES = (
    "SELECT n.nspname AS schema FROM pg_class AS c "
    "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
    "WHERE c.relname = $1 AND c.relkind IN ('r', 'p') AND n.nspname <> $2 "
    "AND has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT') "
    "ORDER BY n.nspname"
)


def identity_of(value: str) -> str:
    """The identity part of a claim's ``token:identity`` value."""
    return value.partition(":")[2]


# inline() and shown() run on every acquire, mostly for the same few identities and
# TTLs: remembered.
@functools.lru_cache(maxsize=256)
def inline(identity: str, ttl_ms: int) -> bool:
    """Whether ``identity`` survives in application_name as itself (see above)."""
    size = len(APP_PREFIX) + _FENCE_DIGITS + len(str(ttl_ms)) + 2 + len(identity)
    return (
        size <= _APP_NAME_BYTES
        and identity.isascii()
        and identity.isprintable()
        and not identity.startswith(DIGEST_MARK)
    )


def _digest(identity: str) -> str:
    """The key of ``identity`` in the identity table (128 bits of SHA-256, hex)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:_DIGEST_CHARS]


@functools.lru_cache(maxsize=256)
def shown(identity: str, ttl_ms: int) -> str:
    """What application_name carries for ``identity``: itself, or its digest form."""
    if inline(identity, ttl_ms):
        return identity
    room = _APP_NAME_BYTES - len(APP_PREFIX) - _FENCE_DIGITS - len(str(ttl_ms)) - 2
    chars = max(_MIN_DIGEST_CHARS, min(_DIGEST_CHARS, room - len(DIGEST_MARK)))
    return DIGEST_MARK + _digest(identity)[:chars]


def holder_info(name: str, row: asyncpg.Record) -> LockInfo:
    """The holder of ``name`` that a row of ``pg_locks`` joined with ``pg_stat_activity``
    shows (``pid``, ``application_name``, ``state``, ``idle_for``): ours with its fence
    and what is left of its TTL, else a foreign holder (fence 0, no expiry)."""
    app = row["application_name"] or ""
    if app.startswith(APP_PREFIX):
        fence_text, _, rest = app[len(APP_PREFIX) :].partition(":")
        ttl_text, _, owner = rest.partition(":")
        if fence_text.isdigit() and ttl_text.isdigit():
            ttl = int(ttl_text) / 1000
            idle_for = row["idle_for"]
            if row["state"] == "idle" and idle_for is not None:
                expires_in = max(0.0, ttl - idle_for)
            else:
                expires_in = ttl
            return LockInfo(name, owner, expires_in, int(fence_text))
    # Not one of ours (an application's own lock on the key, or a transaction lock).
    return LockInfo(name, app or f"pid {row['pid']}", math.inf, 0)


async def store_identity(
    conn: Any, identity: str, *, schema: str, table: str, within: float
) -> None:
    """Store ``identity`` under its digest in the identity table ``table`` (``schema``'s,
    quoted), creating the table on first need; a row already there is kept. ``within``
    bounds each statement (asyncpg's ``timeout``: ``TimeoutError``)."""
    insert = (
        f"INSERT INTO {table} (digest, identity) VALUES ($1, $2) ON CONFLICT (digest) DO NOTHING"
    )
    try:
        await conn.execute(insert, _digest(identity), identity, timeout=within)
    except asyncpg.exceptions.UndefinedTableError:
        await ensure_identity_table(conn, schema, timeout=within)
        await conn.execute(insert, _digest(identity), identity, timeout=within)


async def identified(
    conn: Any, info: LockInfo, *, schema: str, table: str, within: float
) -> LockInfo:
    """``info`` with the identity its digest stands for (see :func:`inline`).

    Looked up in the identity table ``table`` (``schema``'s, quoted), else in the
    identity table of every other schema the role may read: the holder's coordinator may
    use another ``schema``. ``info`` as it is if no table has the row (it was deleted),
    the start of the digest names two identities, or it is too short to name one.
    ``within`` bounds each statement (asyncpg's ``timeout``: ``TimeoutError``).
    """
    start = info.owner[len(DIGEST_MARK) :]
    if len(start) < _MIN_DIGEST_CHARS:
        return info
    lookup = "SELECT identity FROM {} WHERE left(digest, $2) = $1"
    try:
        rows = await conn.fetch(
            f"{lookup.format(table)} LIMIT 2", start, len(start), timeout=within
        )
    except asyncpg.exceptions.UndefinedTableError:
        rows = []
    if not rows:
        tables = await conn.fetch(_IDENTITY_TABLES, IDENTITY_TABLE, schema, timeout=within)
        if tables:
            # UNION: one identity stored under several schemas is one row.
            union = " UNION ".join(
                lookup.format(f"{quote_ident(row['schema'])}.{quote_ident(IDENTITY_TABLE)}")
                for row in tables
            )
            try:
                rows = await conn.fetch(f"{union} LIMIT 2", start, len(start), timeout=within)
            except asyncpg.PostgresError:
                return info  # a table of that name that is not ours
    if len(rows) != 1:
        return info
    return LockInfo(info.name, rows[0]["identity"], info.expires_in, info.fence)
