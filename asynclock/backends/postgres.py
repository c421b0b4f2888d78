"""PostgreSQL session advisory locks through asyncpg, with a real TTL and fences.

A lease holds one connection out of the pool for its whole life (a *session*): the
advisory lock belongs to that session and ends with it. Each step is one statement, so
one round trip:

- acquire: ``pg_advisory_lock`` (or ``_shared``) waiting in the server's own lock queue
  under a statement-local ``lock_timeout``, then the fence (``nextval`` of a sequence),
  then session settings that give the lease a server-side TTL: ``idle_session_timeout``
  equal to the lease's ttl (PostgreSQL >= 14), TCP keepalives, and an
  ``application_name`` that names holder, fence and ttl for ``inspect``. If the lock is
  not granted the statement fails and every setting reverts with it.
- heartbeat (the watchdog's renewal): any statement resets the idle timer; it also
  checks that the session is still the one that took the lock (a transaction-pooling
  proxy would hand us another).
- release: ``pg_advisory_unlock`` and the session settings restored, then the connection
  goes back to the pool.

A connection that failed or was interrupted mid-statement is terminated instead of being
returned: ending the session is what certainly releases its locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from .._backoff import Backoff
from .._clock import Clock
from .._errors import BackendError, map_backend_errors
from .._validate import check_name
from .._wakeup import Mailbox, WakeHub, WakeSlot
from ..postgres import (
    DEFAULT_NAMESPACE,
    advisory_key,
    ensure_fence_sequence,
    key_in,
    lock_ids,
    quote_ident,
)
from .base import Attempt, Backend, Claim, LockInfo

__all__ = ("PostgresBackend",)

logger = logging.getLogger("asynclock.postgres")

# asyncpg's InternalClientError: a protocol state it cannot handle (seen when a frozen
# process resumes with the server's goodbye and a heartbeat due in the same instant).
_CONFUSED = asyncpg.exceptions._base.InternalClientError
_DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, _CONFUSED, OSError)
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
_APP_PREFIX = "asynclock:"
# The largest lock_timeout PostgreSQL accepts (INT_MAX milliseconds).
_MAX_TIMEOUT_MS = 2**31 - 1
# Session settings a connection carries while asynclock uses it, restored when it goes
# back to the pool. idle_session_timeout is also reset after every lease.
_IDLE = "idle_session_timeout"
# Everything a lease may change on its session; RESET when a connection leaves us.
_RESET = (
    "RESET application_name; RESET tcp_keepalives_idle; RESET tcp_keepalives_interval; "
    "RESET idle_session_timeout"
)


async def _keep_as_is(conn: asyncpg.Connection[Any]) -> None:
    """Pool reset for our own pool: connections come back in the state they left."""


def _describe_dsn(dsn: str) -> str:
    parts = urlsplit(dsn)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{host}{port}{parts.path or '/'}"


class _Conn:
    """A connection taken out of the pool; ``configured`` once its keepalives are set.

    ``raw`` is the asyncpg connection behind the pool's proxy: statements go to it
    directly while we hold it (the proxy's per-call indirection is measurable on a
    two-statement lease); the proxy is what goes back to the pool.
    """

    __slots__ = ("configured", "proxy", "raw")

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.raw = getattr(proxy, "_con", None) or proxy
        self.configured = False


class _Session:
    """The connection pinned for one lease."""

    __slots__ = (
        "conn",
        "done",
        "fence",
        "interrupted",
        "key",
        "lock",
        "pid",
        "released",
        "shared",
        "ttl_ms",
    )

    def __init__(self, conn: _Conn, key: int, shared: bool, ttl_ms: int) -> None:
        self.conn = conn
        self.key = key
        self.shared = shared
        self.ttl_ms = ttl_ms
        self.fence = 0
        self.pid = 0
        # One statement at a time on the connection: heartbeat, extend and release.
        self.lock = asyncio.Lock()
        self.done = False
        self.released = False
        # A release statement was interrupted: the lock may already be unlocked.
        self.interrupted = False

    def ended(self) -> bool:
        """True once the session was given back or terminated (re-read after awaits)."""
        return self.done


class _Statements:
    """The SQL for one server version and configuration, built once.

    Acquire statements come in variants: waiting (``lock_timeout``) or trying once,
    exclusive or shared, and setting TCP keepalives (on a connection's first lease) or
    not. Parameters: ``$1`` key, ``$2`` the application_name tail
    (``<ttl ms>:<identity>``), ``$3`` idle_session_timeout (PostgreSQL >= 14), then the
    keepalives (first lease), then ``lock_timeout`` and
    ``client_connection_check_interval`` (waiting).
    """

    def __init__(self, sequence: str, has_idle_timeout: bool) -> None:
        self.has_idle_timeout = has_idle_timeout
        self.acquire: dict[tuple[bool, bool, bool], str] = {}
        for configure in (False, True):
            for wait in (False, True):
                for shared in (False, True):
                    self.acquire[configure, wait, shared] = self._acquire(
                        sequence, configure=configure, wait=wait, shared=shared
                    )
        unlock = {False: "pg_advisory_unlock", True: "pg_advisory_unlock_shared"}
        reset_idle = f", set_config('{_IDLE}', $2, false)" if has_idle_timeout else ""
        self.release = {
            shared: f"SELECT {fn}($1) AS released{reset_idle}" for shared, fn in unlock.items()
        }
        # Any statement resets the server's idle timer; the pid tells whether it ran on
        # the session that holds the lock.
        self.heartbeat = "SELECT pg_backend_pid()"
        new_ttl = "set_config('application_name', $1, false)"
        if has_idle_timeout:
            new_ttl += f", set_config('{_IDLE}', $2, false)"
        self.heartbeat_new_ttl = f"SELECT pg_backend_pid(), {new_ttl}"
        self.inspect = (
            "SELECT l.pid, a.application_name, a.state, "
            "EXTRACT(EPOCH FROM (clock_timestamp() - a.state_change))::float8 AS idle_for "
            "FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND l.classid = $1 AND l.objid = $2 "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )

    def _acquire(self, sequence: str, *, configure: bool, wait: bool, shared: bool) -> str:
        n = 3
        named = f"'{_APP_PREFIX}' || granted.fence || ':' || $2"
        assign = [f"set_config('application_name', {named}, false)"]
        if self.has_idle_timeout:
            assign.append(f"set_config('{_IDLE}', $3, false)")
            n = 4
        columns = ["granted.fence", "pg_backend_pid() AS pid"]
        source = "granted"
        if configure:
            assign += [
                f"set_config('tcp_keepalives_idle', ${n}, false)",
                f"set_config('tcp_keepalives_interval', ${n + 1}, false)",
            ]
            n += 2
        granted_row = f"SELECT {', '.join(columns + assign)} FROM {source}"
        fence = f"nextval('{sequence}')"
        kind = "_shared" if shared else ""
        if not wait:
            return (
                f"WITH attempt AS (SELECT pg_try_advisory_lock{kind}($1) AS ok), "
                f"granted AS (SELECT {fence} AS fence FROM attempt WHERE ok) {granted_row}"
            )
        local = f"set_config('lock_timeout', ${n}, true)"
        if self.has_idle_timeout:
            # Let the server notice a client that died while it waits in the queue.
            local += f", set_config('client_connection_check_interval', ${n + 1}, true)"
        return (
            f"WITH limited AS (SELECT {local}), "
            f"locked AS (SELECT pg_advisory_lock{kind}($1) FROM limited), "
            f"granted AS (SELECT {fence} AS fence FROM locked) {granted_row}"
        )


class PostgresBackend(Backend):
    """Session advisory locks on PostgreSQL, over an asyncpg pool.

    ``pool`` is an ``asyncpg.Pool`` the application owns (not closed by ``aclose()``).
    Names map to 64-bit keys with :func:`asynclock.postgres.advisory_key` under
    ``namespace``. Fences come from the sequence ``schema.fence_sequence``, created on
    first use (if the role may not, the error says what SQL to run).

    Each held lease pins one server connection until it is released: the number of
    leases held at once (plus acquires waiting in the server's queue) is bounded by the
    pool's ``max_size``, and across processes by the server's ``max_connections``. A few
    connections (at most a quarter of ``max_size``) stay checked out between leases, so
    that a lease does not pay for a pool checkout; ``aclose()`` gives them back.
    """

    native_wait = True
    supports_shared = True

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        schema: str = "public",
        fence_sequence: str = "asynclock_fence",
        clock: Clock | None = None,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> None:
        super().__init__(clock=clock, drift_factor=drift_factor, drift_base=drift_base)
        if not isinstance(pool, asyncpg.Pool):
            raise TypeError(f"pool must be an asyncpg.Pool, got {type(pool).__name__}")
        check_name(namespace, "namespace")
        quote_ident(schema)
        quote_ident(fence_sequence)
        self._pool = pool
        self._namespace = namespace
        self._key_prefix = namespace.encode() + b"\x00"
        self._schema = schema
        self._sequence_name = fence_sequence
        self._sequence = f"{quote_ident(schema)}.{quote_ident(fence_sequence)}"
        self._owns_pool = False
        self._pool_started = False
        args = getattr(pool, "_connect_args", ())
        dsn = args[0] if args and isinstance(args[0], str) else ""
        self._where = f"PostgreSQL {_describe_dsn(dsn)}" if dsn else "PostgreSQL pool"
        self._errors = map_backend_errors(self._where, _DRIVER_ERRORS)
        self._sql: _Statements | None = None
        self._setup_lock: asyncio.Lock | None = None
        self._hub = WakeHub()
        # Sessions between checkout and give-back: waiting, holding or releasing.
        self._sessions: set[_Session] = set()
        # Clean connections kept out of the pool between leases.
        self._idle: list[_Conn] = []
        self._keep = max(1, min(8, pool.get_max_size() // 4))
        # LISTEN/NOTIFY for announcements: mailboxes by channel, one listening connection.
        self._listeners: dict[str, set[Mailbox]] = {}
        self._listen_conn: Any = None
        self._listen_lock: asyncio.Lock | None = None
        # Connections on their way back to the pool after a cancelled give-back.
        self._background: set[asyncio.Future[None]] = set()
        self._idle_default = "0"
        self._closing = False

    @classmethod
    def from_dsn(cls, dsn: str, *, max_connections: int = 32, **options: Any) -> PostgresBackend:
        """A backend on a pool of its own (created on first use, closed by ``aclose()``).

        ``options`` not meant for :class:`PostgresBackend` go to ``asyncpg.create_pool``.
        """
        own = {k: options.pop(k) for k in _BACKEND_OPTIONS if k in options}
        pool = asyncpg.create_pool(
            dsn, min_size=0, max_size=max_connections, reset=_keep_as_is, **options
        )
        backend = cls(pool, **own)
        backend._owns_pool = True
        return backend

    # -- setup -----------------------------------------------------------------------

    def _ready(self) -> _Statements | None:
        return self._sql

    async def _statements(self) -> _Statements:
        """Start our own pool, learn the server, make sure the fence sequence exists."""
        if self._sql is not None:
            return self._sql
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        async with self._setup_lock:
            ready = self._ready()  # set by whoever held the lock before us
            if ready is not None:
                return ready
            with self._errors:
                if self._owns_pool and not self._pool_started:
                    await self._pool  # connects nothing: min_size is 0
                    self._pool_started = True
                async with self._pool.acquire() as conn:
                    version = conn.get_server_version()
                    await ensure_fence_sequence(conn, self._schema, self._sequence_name)
                    # Behind a transaction-pooling proxy (PgBouncer pool_mode=transaction)
                    # consecutive statements may run on different server sessions, and a
                    # session lock is stranded on whichever took it.
                    first = await conn.fetchval("SELECT pg_backend_pid()")
                    second = await conn.fetchval("SELECT pg_backend_pid()")
                    if version.major >= 14:
                        # What a connection has when no lease uses it (role or database
                        # defaults included): what a release sets back.
                        self._idle_default = await conn.fetchval(
                            f"SELECT reset_val FROM pg_settings WHERE name = '{_IDLE}'"
                        )
            if first != second:
                raise BackendError(
                    f"{self._where}: two statements on one connection ran in different "
                    "server sessions: a transaction-pooling proxy (PgBouncer "
                    "pool_mode=transaction?) is in the way. Session locks need session "
                    "pooling or a direct connection; use asynclock.postgres."
                    "advisory_xact_lock inside transactions instead."
                )
            has_idle_timeout = version.major >= 14
            if not has_idle_timeout:
                logger.warning(
                    "%s is PostgreSQL %d: without idle_session_timeout a frozen client "
                    "keeps its locks until its TCP connection dies (keepalives)",
                    self._where,
                    version.major,
                )
            self._sql = _Statements(self._sequence, has_idle_timeout)
            return self._sql

    # -- the Backend interface -------------------------------------------------------

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        clock = self.clock
        began = clock.now()
        sql = self._sql or await self._statements()
        taken = await self._take(sql, claim, math.ceil(ttl * 1000), wait, began)
        if taken is None:
            return Attempt(None)
        session, row = taken
        session.conn.configured = True
        session.fence = int(row["fence"])
        session.pid = row["pid"]
        if clock.now() - began <= self.drift(ttl):
            return Attempt(session.fence)
        # It waited in the queue: count validity from a heartbeat sent now, not from
        # before the wait.
        start = clock.now()
        if not await self.extend(claim, ttl):
            raise BackendError(f"{self._where}: the session died right after the grant")
        return Attempt(session.fence, start=start)

    async def _take(
        self, sql: _Statements, claim: Claim, ttl_ms: int, wait: float | None, began: float
    ) -> tuple[_Session, asyncpg.Record] | None:
        """Run the acquire statement on a connection; the session and its row if granted.

        A kept connection may have died while idle (server restart, an idle timeout set by
        the DBA): then the statement fails before it could take anything, and one more try
        on a connection from the pool is safe.
        """
        key = key_in(self._key_prefix, claim.name)
        idle = self._idle
        for prefer_kept in (True, False):
            if prefer_kept and idle and not idle[-1].raw.is_closed():
                conn: _Conn | None = idle.pop()  # the common case, without a coroutine
            else:
                conn = await self._checkout(wait, prefer_kept=prefer_kept)
            if conn is None:
                return None  # no connection within the caller's timeout
            session = claim.handle = _Session(conn, key, claim.shared, ttl_ms)
            self._sessions.add(session)
            configure = not conn.configured
            # Try first: the statement that waits in the server's queue costs more (its
            # lock and check timeouts), so it is sent only when the lock is held.
            args = self._acquire_args(
                sql, session, claim.value, configure=configure, wait=0, began=began
            )
            try:
                row = await conn.raw.fetchrow(sql.acquire[configure, False, claim.shared], *args)
                if row is None and wait != 0:
                    args = self._acquire_args(
                        sql, session, claim.value, configure=configure, wait=wait, began=began
                    )
                    statement = sql.acquire[configure, True, claim.shared]
                    row = await conn.raw.fetchrow(statement, *args)
            except asyncpg.exceptions.LockNotAvailableError:
                row = None
            except _DRIVER_ERRORS as exc:
                claim.handle = None
                await self._end_session(session)
                if isinstance(exc, _SESSION_GONE) and prefer_kept and conn.configured:
                    continue
                raise BackendError(f"{self._where}: {exc}") from exc
            # A cancellation propagates with the session still on the claim: the caller's
            # clean-up releases it (the lock may have been granted just before the cancel).
            if row is None:  # timed out in the queue, or tried once and it is held
                claim.handle = None
                await self._checkin(session)
                return None
            return session, row
        raise AssertionError("not reached: the second pass never continues")

    def _acquire_args(
        self,
        sql: _Statements,
        session: _Session,
        value: str,
        *,
        configure: bool,
        wait: float | None,
        began: float,
    ) -> list[object]:
        ttl_ms = session.ttl_ms
        args: list[object] = [session.key, f"{ttl_ms}:{_owner(value)}"]
        if sql.has_idle_timeout:
            args.append(str(ttl_ms))
        if configure:
            seconds = max(1, ttl_ms // 3000)
            args += (str(seconds), str(max(1, seconds // 3)))
        if wait != 0:
            left = None if wait is None else wait - (self.clock.now() - began)
            if left is None or left * 1000 > _MAX_TIMEOUT_MS:
                # No server-side limit: lock_timeout stops at INT_MAX ms (24.8 days), and a
                # longer wait ends by the caller's own deadline instead.
                args.append("0")
            else:
                args.append(str(max(1, math.ceil(left * 1000))))
            if sql.has_idle_timeout:
                args.append(str(max(1000, ttl_ms // 3)))
        return args

    async def extend(self, claim: Claim, ttl: float) -> bool:
        session = claim.handle
        if not isinstance(session, _Session) or session.done:
            return False
        sql = self._sql or await self._statements()
        ttl_ms = math.ceil(ttl * 1000)
        if ttl_ms == session.ttl_ms:
            statement, args = sql.heartbeat, []
        else:
            name = f"{_APP_PREFIX}{session.fence}:{ttl_ms}:{_owner(claim.value)}"
            statement, args = sql.heartbeat_new_ttl, [name]
            if sql.has_idle_timeout:
                args.append(str(ttl_ms))
        async with session.lock:
            if session.ended():
                return False
            try:
                pid = await session.conn.raw.fetchval(statement, *args)
            except _SESSION_GONE:
                await self._end_session(session)
                return False
            except asyncpg.PostgresError as exc:
                raise BackendError(f"{self._where}: {exc}") from exc
            session.ttl_ms = ttl_ms
        if pid != session.pid:
            logger.error(
                "%s: lease on %r renewed on server session %s but taken on %s: a "
                "transaction-pooling proxy is in the way; the lease is lost",
                self._where,
                claim.name,
                pid,
                session.pid,
            )
            return False
        return True

    async def release(self, claim: Claim) -> bool:
        session = claim.handle
        if not isinstance(session, _Session):
            return False
        sql = self._sql or await self._statements()
        async with session.lock:
            if session.ended():
                return session.released
            args: list[object] = [session.key]
            if sql.has_idle_timeout:
                args.append(self._idle_default)
            try:
                unlocked = await session.conn.raw.fetchval(sql.release[session.shared], *args)
            except asyncio.CancelledError:
                # The statement may or may not have run; asyncpg cancels it on the server
                # and the connection stays usable. The caller's clean-up calls again.
                session.interrupted = True
                raise
            except _DRIVER_ERRORS as exc:
                await self._end_session(session)
                if isinstance(exc, _SESSION_GONE):
                    return False  # the session, and its lock, were already gone
                raise BackendError(f"{self._where}: {exc}") from exc
            # Only this live session could have unlocked its own lock: after an interrupted
            # release, "not held" means the interrupted statement did it.
            session.released = bool(unlocked) or session.interrupted
            await self._checkin(session)
            return session.released

    async def inspect(self, name: str) -> LockInfo | None:
        sql = await self._statements()
        classid, objid = lock_ids(advisory_key(name, self._namespace))
        with self._errors:
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(sql.inspect, classid, objid)
        best: LockInfo | None = None
        for row in rows:
            info = _holder_info(name, row)
            if best is None or info.fence > best.fence:
                best = info
        return best

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        # Waiting happens in the server's lock queue (native_wait); a slot keeps the
        # interface whole for callers that ask anyway.
        return self._waiter(name)

    @asynccontextmanager
    async def _waiter(self, name: str) -> AsyncIterator[WakeSlot]:
        slot = self._hub.register(name)
        try:
            yield slot
        finally:
            self._hub.unregister(slot)

    # -- announcements (LISTEN/NOTIFY) -------------------------------------------------

    def _topic_channel(self, topic: str) -> str:
        # NOTIFY channels are identifiers: at most 63 bytes, so a digest of the topic.
        digest = hashlib.sha256(self._key_prefix + topic.encode()).hexdigest()
        return f"asynclock_{digest[:40]}"

    async def publish(self, topic: str, message: str) -> None:
        await self._statements()
        with self._errors:
            async with self._pool.acquire() as conn:
                await conn.execute("SELECT pg_notify($1, $2)", self._topic_channel(topic), message)

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return self._listen(topic)

    @asynccontextmanager
    async def _listen(self, topic: str) -> AsyncIterator[Mailbox]:
        await self._statements()
        channel = self._topic_channel(topic)
        mailbox = Mailbox()
        if self._listen_lock is None:
            self._listen_lock = asyncio.Lock()
        async with self._listen_lock:
            listeners = self._listeners.setdefault(channel, set())
            listeners.add(mailbox)
            if len(listeners) == 1:
                try:
                    conn = await self._listening()
                    with self._errors:
                        await conn.add_listener(channel, self._on_notify)
                except BaseException:
                    listeners.discard(mailbox)
                    del self._listeners[channel]
                    raise
        try:
            yield mailbox
        finally:
            async with self._listen_lock:
                listeners = self._listeners.get(channel, set())
                listeners.discard(mailbox)
                if not listeners:
                    self._listeners.pop(channel, None)
                    conn = self._listen_conn
                    if conn is not None and not conn.is_closed():
                        with contextlib.suppress(*_DRIVER_ERRORS):
                            await conn.remove_listener(channel, self._on_notify)
                    if not self._listeners:
                        await self._stop_listening()

    async def _listening(self) -> Any:
        """The connection that LISTENs, taken out of the pool while anyone listens."""
        if self._listen_conn is None or self._listen_conn.is_closed():
            with self._errors:
                conn = await self._pool.acquire()
            conn.add_termination_listener(self._on_listen_lost)
            self._listen_conn = conn
        return self._listen_conn

    async def _stop_listening(self) -> None:
        conn, self._listen_conn = self._listen_conn, None
        if conn is None:
            return
        try:
            conn.remove_termination_listener(self._on_listen_lost)
            await conn.execute("UNLISTEN *")
            await asyncio.shield(self._pool.release(conn))
        except Exception:
            await self._terminate(conn)

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for mailbox in self._listeners.get(channel, ()):
            mailbox.put(payload)

    def _on_listen_lost(self, conn: Any) -> None:
        """The LISTEN connection died: listeners look again, and we listen again."""
        if conn is not self._listen_conn:
            return
        self._listen_conn = None
        for mailboxes in self._listeners.values():
            for mailbox in mailboxes:
                mailbox.put("")
        if self._listeners and not self._closing:
            task = asyncio.ensure_future(self._relisten())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _relisten(self) -> None:
        backoff = Backoff(initial=0.05, maximum=2.0)
        for attempt in range(1_000_000):
            if self._closing or not self._listeners:
                return
            try:
                assert self._listen_lock is not None
                async with self._listen_lock:
                    conn = await self._listening()
                    for channel in self._listeners:
                        await conn.add_listener(channel, self._on_notify)
            except (BackendError, *_DRIVER_ERRORS):
                await asyncio.sleep(backoff.delay(attempt))
                continue
            for mailboxes in self._listeners.values():
                for mailbox in mailboxes:
                    mailbox.put("")
            return

    async def aclose(self) -> None:
        self._closing = True
        # Whatever still waits in the server's queue (or was not released in time) ends
        # with its session.
        for session in list(self._sessions):
            await self._end_session(session)
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._to_pool(conn)
        self._listeners.clear()
        await self._stop_listening()
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)
        if self._owns_pool and self._pool_started:
            try:
                await asyncio.wait_for(self._pool.close(), 10)
            except TimeoutError:
                self._pool.terminate()

    def describe(self) -> str:
        return f"PostgresBackend {self._where[len('PostgreSQL ') :]} namespace={self._namespace!r}"

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        """The asyncpg pool in use."""
        return self._pool

    def key(self, name: str) -> int:
        """The advisory-lock key of ``name`` in this backend's namespace."""
        return advisory_key(name, self._namespace)

    # -- connections -----------------------------------------------------------------

    async def _checkout(self, wait: float | None, *, prefer_kept: bool) -> _Conn | None:
        """A kept connection, or one from the pool within ``wait`` (None: no bound)."""
        while prefer_kept and self._idle:
            conn = self._idle.pop()
            if not conn.raw.is_closed():
                return conn
            with contextlib.suppress(Exception):
                await self._pool.release(conn.proxy)
        pool = self._pool
        if wait == 0 and pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size():
            return None  # try once: an exhausted pool is as good as a held lock
        try:
            return _Conn(await pool.acquire(timeout=wait or None))
        except TimeoutError:
            return None
        except _DRIVER_ERRORS as exc:
            raise BackendError(f"{self._where}: {exc}") from exc

    async def _checkin(self, session: _Session) -> None:
        """The session is over and its connection clean: keep it, or give it back."""
        session.done = True
        self._sessions.discard(session)
        if len(self._idle) < self._keep and not self._closing:
            self._idle.append(session.conn)
        else:
            await self._to_pool(session.conn)

    async def _to_pool(self, conn: _Conn) -> None:
        """Reset what asynclock may have changed and return the connection to the pool."""
        try:
            await conn.raw.execute(_RESET)
        except asyncio.CancelledError:
            # Finish in the background: asyncpg is cancelling the RESET on the server, and
            # terminating the connection under that cancellation trips asyncpg up.
            task = asyncio.ensure_future(self._to_pool(conn))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        except Exception:
            await self._terminate(conn.proxy)
        else:
            # Shielded: a cancel here must not leave the connection checked out forever.
            await asyncio.shield(self._pool.release(conn.proxy))

    async def _end_session(self, session: _Session) -> None:
        """Terminate the connection (its locks end with the session) and free the slot."""
        session.done = True
        self._sessions.discard(session)
        await self._terminate(session.conn.proxy)

    async def _terminate(self, proxy: Any) -> None:
        with contextlib.suppress(Exception):
            proxy.terminate()
        with contextlib.suppress(Exception):
            await asyncio.shield(self._pool.release(proxy))


_BACKEND_OPTIONS = (
    "namespace",
    "schema",
    "fence_sequence",
    "clock",
    "drift_factor",
    "drift_base",
)


def _owner(value: str) -> str:
    """The identity part of a claim's ``token:identity`` value."""
    return value.partition(":")[2]


def _holder_info(name: str, row: asyncpg.Record) -> LockInfo:
    app = row["application_name"] or ""
    if app.startswith(_APP_PREFIX):
        fence_text, _, rest = app[len(_APP_PREFIX) :].partition(":")
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
