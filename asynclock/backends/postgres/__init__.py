"""PostgreSQL session advisory locks through asyncpg: :class:`PostgresBackend`.

One module per layer, each depending only on those listed before it (and on
``asynclock._pgkeys``, the name-to-key derivation shared with ``asynclock.postgres``):

- ``dsn``: reading DSNs as asyncpg does, and showing them without credentials;
- ``errors``: what a driver error says about its connection, and ``BackendError``;
- ``schema``: identifiers, the fence sequence and the identity table;
- ``holders``: how a holder is named on the server (``application_name``, the identity
  table) and read back for ``inspect()``;
- ``sql``: the fence step and every statement of a lease, built once per server version;
- ``sessions``: the connections taken out of the pool and the sessions pinned on them;
- ``notify``: LISTEN/NOTIFY, for announcements and permit wake-ups;
- ``backend``: :class:`PostgresBackend`, which composes them.
"""

from __future__ import annotations

from .backend import PostgresBackend as PostgresBackend

__all__ = ("PostgresBackend",)
