"""PostgreSQL session advisory locks through asyncpg, with a real TTL and fences.

A lease holds one connection out of the pool for its whole life (a *session*): the
advisory lock belongs to that session and ends with it. Each step is one statement, so
one round trip:

- acquire: an ``application_name`` that names the holder (fence not known yet), then
  ``pg_advisory_lock`` (or ``_shared``) waiting in the server's own lock queue under a
  statement-local ``lock_timeout``, then the fence step
  (:func:`~.sql.fence_select`: the server's clock in µs, never below the
  sequence's ``nextval``, serialised per name by a transaction-level lock on the name's
  fence key), then session settings that give the lease a server-side TTL:
  ``idle_session_timeout`` equal to the lease's ttl (PostgreSQL >= 14), TCP keepalives,
  and an ``application_name`` that names holder, fence and ttl for ``inspect``. Named
  before the lock is taken, a granted session is never seen under a name that is not
  ours. If the lock is not granted the statement takes nothing.
- heartbeat (the watchdog's renewal): any statement resets the idle timer; it also
  checks that the session is still the one that took the lock (a transaction-pooling
  proxy would hand us another).
- release: ``pg_advisory_unlock`` and the session settings restored, then the connection
  goes back to the pool.

A connection that failed or was interrupted mid-statement is terminated instead of being
returned: ending the session is what certainly releases its locks. A statement that
failed with ``lock_timeout`` may have taken its lock before it failed (in the fence
step: its fence key, or ``nextval()`` behind a migration's ``ALTER SEQUENCE``): session
locks do not roll back with their statement, so every advisory lock of the session is
dropped before the connection is used again (or it is ended).
A connection that ends under a held lease (asyncpg's termination listener) loses the
lease at once (:meth:`Backend.on_hold_lost`).

Every statement has a bound: the request timeout (``request_timeout``), beyond what it
may wait for a lock on the server (a wait in the queue: its ``lock_timeout``, from the
caller's deadline, or none; a try's fence step: 1 s). Given explicitly to each statement,
it also keeps a pool's ``command_timeout`` off our waits. A statement not answered in
time has its connection terminated: that is the only bound on a silent server, and the
session's locks end with it (a lease on it is lost). A short statement (setup,
``inspect``, ``publish``) interrupted by a cancel has its connection terminated too:
returning it to the pool would wait for the server to confirm the cancel. ``aclose()``
is bounded as a whole, and ends our sessions on the server (``pg_terminate_backend``)
rather than leave a waiting one to notice its closed socket at its next client check.

A waiting acquire first tries (``pg_try_advisory_lock``), and that statement also sets
(on a connection's first such try: they stay until it goes back to the pool)
``client_connection_check_interval`` (1 s) for the session, and lifts the session's
``statement_timeout`` and ``transaction_timeout`` (PostgreSQL >= 17), which would end a
wait in the queue: the server arms them when a statement (or its transaction) starts,
so set inside the waiting statement they would not apply, and a waiter whose process
died would stay queued.

Read-write locks are shared (readers) and exclusive (writers) locks on the same key.
PostgreSQL's lock manager prefers writers by itself: a request that conflicts with a
queued one waits behind it, so once a writer waits, new readers queue after it, and
``pg_try_advisory_lock_shared`` is refused (the try-first step cannot barge). A writer
behind a stream of readers waits only for the readers already inside.

Fair locks need nothing more: the queue is first come, first served, a release hands the
lock to the first waiter inside the server (a try from outside cannot take it in
between), and a waiter whose session ends (its process killed: the check above) leaves
the queue.

Semaphores: permit ``i`` (0 to limit - 1) of semaphore ``name`` is the advisory key
``first 8 bytes of SHA-256(UTF-8(namespace) + b"\\x00" + UTF-8(name) + b"\\xff" +
ASCII(decimal i))`` (:func:`asynclock.postgres.permit_key`): ``0xFF`` never occurs in
UTF-8, so no lock name hashes to the same input. A permit is a session lock like any
other (TTL from ``idle_session_timeout``, renewal by heartbeat, its own fence from the
fence step, serialised by the semaphore's own fence key, released when its session
ends). One statement takes the first free slot: a
recursive CTE tries the slots one by one from a random start, each step only if the one
before failed, so at most one slot is ever taken. A caller that waits cannot wait in the
server's queue for "any of n keys"; it LISTENs on the semaphore's channel, holds the
semaphore's *waiting flag* (``SHA-256(... + b"\\xff" + b"waiting")``, shared) and scans
again when woken. A release NOTIFYs the channel only if it cannot take the flag
exclusively, that is, only if someone waits (a NOTIFY costs a commit record). A holder
whose session died sends no NOTIFY: waiters also scan again every ``recheck`` seconds
(the retry backoff's maximum). ``inspect()`` reports locks only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import asyncpg

from ..._clock import Clock
from ..._errors import BackendError
from ..._kind import PERMIT, SHARED
from ..._pgkeys import DEFAULT_NAMESPACE, advisory_key, fence_ids, key_in, lock_ids
from ..._tasks import TaskSet
from ..._validate import check_name, check_number
from ..._wakeup import Mailbox, WakeHub, WakeSlot
from ..base import Attempt, Backend, Claim, Kind, LockInfo
from .dsn import describe_dsn, usable_dsn
from .errors import DRIVER_ERRORS, MapErrors, gone, unanswered
from .holders import (
    APP_PREFIX,
    DIGEST_MARK,
    holder_info,
    identified,
    identity_of,
    inline,
    shown,
    store_identity,
)
from .notify import Listener, topic_channel
from .schema import IDENTITY_TABLE, ensure_fence_sequence, quote_ident
from .sessions import Conn, Permit, Session, SessionPool, session_args
from .sql import (
    HOLD_FLAG,
    IDLE,
    NO_FLAG,
    TAKE_FLAG,
    TRY,
    TRY_BEFORE_WAIT,
    TRY_FENCE_WAIT_MS,
    WAIT,
    Statements,
)

__all__ = ("PostgresBackend",)

logger = logging.getLogger("asynclock.postgres")

# The largest lock_timeout PostgreSQL accepts (INT_MAX milliseconds).
_MAX_TIMEOUT_MS = 2**31 - 1
# The default request_timeout: how long a statement may go unanswered (beyond what it may
# wait in the server's lock queue) before its connection is closed; as Redis's default
# socket timeout.
_REQUEST_TIMEOUT = 5.0
# asyncpg reads timeout=None as the connection's command_timeout (an application's pool
# may set one): a statement allowed to wait in the server's queue without bound gets this
# instead (about 317 years).
_NO_BOUND = 1e10
# Where an acquire statement's lock_timeout is among its parameters ($5).
_LOCK_TIMEOUT_ARG = 4
# How long aclose() takes at most, in all (each statement on its way also within the
# request timeout): as the Redis backend's.
_CLOSE_TIMEOUT = 5.0
# How long aclose() lets the server take to end sessions it was asked to end.
_EXIT_WAIT_MS = 1000
# How many lock names' keys a backend remembers: each costs two SHA-256 to derive, a
# measurable share of the backend's own CPU in a lease.
_KEYS_KEPT = 1024


async def _keep_as_is(conn: asyncpg.Connection[Any]) -> None:
    """Pool reset for our own pool: connections come back in the state they left."""


class PostgresBackend(Backend):
    """Session advisory locks on PostgreSQL, over an asyncpg pool.

    ``pool`` is an ``asyncpg.Pool`` the application owns (not closed by ``aclose()``).
    Names map to 64-bit keys with :func:`asynclock.postgres.advisory_key` under
    ``namespace``. Fences are the server's clock in µs, serialised per name, with the
    sequence ``schema.fence_sequence`` as their floor (created on first use; if the role
    may not, the error says what SQL to run): they strictly increase per name whatever
    schema or sequence each coordinator uses (see :mod:`asynclock.postgres`).

    Each held lease pins one server connection until it is released: the number of
    leases held at once (plus acquires waiting in the server's queue) is bounded by the
    pool's ``max_size``, and across processes by the server's ``max_connections``. A few
    connections (at most a quarter of ``max_size``) stay checked out between leases, so
    that a lease does not pay for a pool checkout; ``aclose()`` gives them back. A
    semaphore waiter also pins its connection while it waits, and one more connection
    LISTENs while anyone in this process waits for a permit or observes an election.
    ``inspect()``, ``publish()`` and LISTEN use a kept connection if there is one, else
    wait at most ``pool_timeout`` seconds for the pool, then raise ``BackendError``.

    ``request_timeout`` (seconds, default 5) bounds every statement beyond what it may
    wait for a lock on the server: one not answered in time has its connection closed
    (and with its session whatever it held: a lease on it is lost) and raises
    ``BackendError``. ``aclose()`` takes at most about 5 s.

    Holder identities that ``application_name`` cannot keep whole (too long, or not
    printable ASCII) are stored in the table ``schema.asynclock_identities`` (created on
    first need; see :data:`asynclock.postgres.IDENTITY_TABLE`).
    """

    native_wait = True
    # Readers and writers: PostgreSQL's lock queue already prefers writers (a new shared
    # request that conflicts with a queued exclusive one waits behind it, and
    # pg_try_advisory_lock_shared is refused then), so a stream of readers cannot starve
    # a writer. Fair locks: the server's queue is first come, first served, and a release
    # hands the lock to the first waiter inside the server, so a try from outside cannot
    # barge in: every exclusive lock here is fair, Kind.FAIR needs nothing more.
    kinds = frozenset(Kind)

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
        pool_timeout: float = 10.0,
        request_timeout: float = _REQUEST_TIMEOUT,
    ) -> None:
        super().__init__(clock=clock, drift_factor=drift_factor, drift_base=drift_base)
        if not isinstance(pool, asyncpg.Pool):
            raise TypeError(f"pool must be an asyncpg.Pool, got {type(pool).__name__}")
        check_name(namespace, "namespace")
        quote_ident(schema)
        quote_ident(fence_sequence)
        pool_timeout = check_number("pool_timeout", pool_timeout, positive=True)
        self._request_timeout = check_number("request_timeout", request_timeout, positive=True)
        self._namespace = namespace
        self._key_prefix = namespace.encode() + b"\x00"
        self._schema = schema
        self._sequence_name = fence_sequence
        self._sequence = f"{quote_ident(schema)}.{quote_ident(fence_sequence)}"
        self._identities = f"{quote_ident(schema)}.{quote_ident(IDENTITY_TABLE)}"
        # Identities stored in the identity table by this backend (see _register).
        self._registered: set[str] = set()
        # Lock name -> its advisory key and fence key (see _keys).
        self._key_cache: dict[str, tuple[int, tuple[int, int]]] = {}
        self._owns_pool = False
        self._pool_started = False
        # from_dsn(): makes the pool again at first use, in the loop that uses it.
        self._make_pool: Callable[[], asyncpg.Pool[Any]] | None = None
        args = getattr(pool, "_connect_args", ())
        dsn = args[0] if args and isinstance(args[0], str) else ""
        self._where = f"PostgreSQL {describe_dsn(dsn)}" if dsn else "PostgreSQL pool"
        self._errors = MapErrors(self._where, self._request_timeout)
        self._sql: Statements | None = None
        self._setup_lock: asyncio.Lock | None = None
        self._hub = WakeHub()
        # Work that must finish whatever happens to its caller (give-backs, UNLISTENs,
        # LISTENing again): aclose() waits for it.
        self._background = TaskSet("PostgreSQL")
        # The connections we hold: pinned to claims, kept idle between leases, borrowed.
        self._sessions = SessionPool(
            pool,
            where=self._where,
            pool_timeout=pool_timeout,
            request_timeout=self._request_timeout,
            background=self._background,
            on_lost=self._hold_ended,
        )
        # LISTEN/NOTIFY for announcements and permit wake-ups: one listening connection.
        self._listener = Listener(
            self._sessions,
            self._hub,
            errors=self._errors,
            request_timeout=self._request_timeout,
            background=self._background,
            ready=self._statements,
        )
        self._idle_default = "0"

    @classmethod
    def from_dsn(cls, dsn: str, *, max_connections: int = 32, **options: Any) -> PostgresBackend:
        """A backend on a pool of its own (created on first use, closed by ``aclose()``).

        ``options`` not meant for :class:`PostgresBackend` go to ``asyncpg.create_pool``;
        its connect ``timeout`` defaults to ``request_timeout``.
        """
        own = {k: options.pop(k) for k in _BACKEND_OPTIONS if k in options}
        # A new connection to a server that does not answer is given up on as a statement
        # is (asyncpg's own connect timeout is 60 s).
        options.setdefault("timeout", own.get("request_timeout", _REQUEST_TIMEOUT))
        dsn = usable_dsn(dsn)

        def make_pool(loop: asyncio.AbstractEventLoop | None = None) -> asyncpg.Pool[Any]:
            return asyncpg.create_pool(
                dsn, min_size=0, max_size=max_connections, reset=_keep_as_is, loop=loop, **options
            )

        # An asyncpg pool belongs to the loop it is made in, and connect() may run outside
        # any (at import time): this one only describes the pool until the first use
        # makes the real one in the running loop (_statements). Its loop is never run.
        placeholder = asyncio.new_event_loop()
        try:
            backend = cls(make_pool(placeholder), **own)
        finally:
            placeholder.close()
        backend._owns_pool = True
        backend._make_pool = make_pool
        return backend

    # -- setup -----------------------------------------------------------------------

    def _ready(self) -> Statements | None:
        return self._sql

    async def _statements(self) -> Statements:
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
                    if self._make_pool is not None:
                        # In the running loop (from_dsn).
                        self._sessions.pool = self._make_pool()
                    await self._sessions.pool  # connects nothing: min_size is 0
                    self._pool_started = True
                async with self._sessions.borrowed() as conn:
                    version = conn.get_server_version()
                    within = self._request_timeout
                    await ensure_fence_sequence(
                        conn, self._schema, self._sequence_name, timeout=within
                    )
                    # Behind a transaction-pooling proxy (PgBouncer pool_mode=transaction)
                    # consecutive statements may run on different server sessions, and a
                    # session lock is stranded on whichever took it.
                    first = await conn.fetchval("SELECT pg_backend_pid()", timeout=within)
                    second = await conn.fetchval("SELECT pg_backend_pid()", timeout=within)
                    if version.major >= 14:
                        # What a connection has when no lease uses it (role or database
                        # defaults included): what a release sets back.
                        self._idle_default = await conn.fetchval(
                            f"SELECT reset_val FROM pg_settings WHERE name = '{IDLE}'",
                            timeout=within,
                        )
            if first != second:
                raise BackendError(
                    f"{self._where}: two statements on one connection ran in different "
                    "server sessions: a transaction-pooling proxy (PgBouncer "
                    "pool_mode=transaction?) is in the way. Session locks need session "
                    "pooling or a direct connection; use asynclock.postgres."
                    "advisory_xact_lock inside transactions instead."
                )
            if version.major < 14:
                logger.warning(
                    "%s is PostgreSQL %d: without idle_session_timeout a frozen client "
                    "keeps its locks until its TCP connection dies (keepalives)",
                    self._where,
                    version.major,
                )
            self._sql = self._sessions.statements = Statements(self._sequence, version.major)
            return self._sql

    # -- the Backend interface -------------------------------------------------------

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        if self._sessions.closing:
            raise BackendError(f"{self._where}: the backend was closed")
        clock = self.clock
        began = clock.now()
        sql = self._sql or await self._statements()
        owner = identity_of(claim.value)
        if owner not in self._registered and not inline(owner, math.ceil(ttl * 1000)):
            await self._register(owner, math.ceil(ttl * 1000))
        if claim.kind is PERMIT:
            permit = await self._take_permit(sql, claim, math.ceil(ttl * 1000), wait, began)
            if permit is None:
                return Attempt(None)
            session, row, sent = permit
            session.conn.configured = True
            session.key = int(row["key"])
            session.fence = int(row["fence"])
            session.pid = row["pid"]
            # A scan is granted at once or not at all: validity counts from its sending.
            return Attempt(session.fence, start=None if sent == began else sent)
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
        self, sql: Statements, claim: Claim, ttl_ms: int, wait: float | None, began: float
    ) -> tuple[Session, asyncpg.Record] | None:
        """Run the acquire statement on a connection; the session and its row if granted.

        A kept connection may have died while idle (server restart, an idle timeout set by
        the DBA): then the statement fails before it could take anything, and one more try
        on a connection from the pool is safe.
        """
        key, fence_key = self._keys(claim.name)
        idle = self._sessions.idle
        for prefer_kept in (True, False):
            if prefer_kept and idle and not idle[-1].raw.is_closed():
                conn: Conn | None = idle.pop()  # the common case, without a coroutine
            else:
                conn = await self._sessions.checkout(wait, prefer_kept=prefer_kept)
            if conn is None:
                return None  # no connection within the caller's timeout
            session = claim.handle = self._sessions.open_session(claim, conn, key, ttl_ms)
            configure = not conn.configured
            # Try first: the statement that waits in the server's queue costs more (its
            # lock and check timeouts), so it is sent only when the lock is held.
            mode = TRY if wait == 0 else TRY_BEFORE_WAIT
            bound = self._lock_bound(mode, wait, began)
            tail, settings = session_args(sql, session, claim.value, configure)
            args: list[object] = [session.key, tail, *fence_key, bound, *settings]
            # Waits made unbounded by an earlier try-before-wait on this connection still
            # are (session settings, reset only when it goes back to the pool): the plain
            # try's text, with the same parameters, does not set them again.
            text = TRY if mode == TRY_BEFORE_WAIT and conn.unbounded else mode
            try:
                statement = sql.acquire[configure, text, claim.kind is SHARED]
                row = await conn.raw.fetchrow(statement, *args, timeout=self._within(bound))
                if mode == TRY_BEFORE_WAIT:
                    conn.unbounded = True  # committed with the statement
                if row is None and wait != 0:
                    bound = args[_LOCK_TIMEOUT_ARG] = self._lock_bound(WAIT, wait, began)
                    statement = sql.acquire[configure, WAIT, claim.kind is SHARED]
                    row = await conn.raw.fetchrow(statement, *args, timeout=self._within(bound))
            except asyncpg.exceptions.LockNotAvailableError:
                # lock_timeout ended the statement: in the queue (nothing taken), or in the
                # fence step *after* the grant (its fence key, or nextval() behind a
                # migration's ALTER SEQUENCE). A session lock does not roll back with its
                # failed statement: drop whatever the session holds before the
                # connection is used again.
                if not await self._sessions.unlock_all(session):
                    claim.handle = None
                    return None  # the session was ended instead: its locks went with it
                row = None
            except DRIVER_ERRORS as exc:
                # Unanswered in time (TimeoutError): the connection is closed, and the lock
                # with its session if it was granted after all.
                claim.handle = None
                self._sessions.end_session(session)
                if gone(exc) and prefer_kept and conn.configured and not self._sessions.closing:
                    continue
                raise self._failed(exc) from exc
            # A cancellation propagates with the session still on the claim: the caller's
            # clean-up releases it (the lock may have been granted just before the cancel).
            if row is None:  # timed out in the queue, or tried once and it is held
                claim.handle = None
                await self._sessions.checkin(session)
                return None
            return session, row
        raise AssertionError("not reached: the second pass never continues")

    async def _take_permit(
        self, sql: Statements, claim: Claim, ttl_ms: int, wait: float | None, began: float
    ) -> tuple[Session, asyncpg.Record, float] | None:
        """A free permit slot of ``claim``'s semaphore, waiting up to ``wait`` for one.

        Try first; then, to wait: listen for the semaphore's releases, hold its waiting
        flag (so releases know to NOTIFY) and scan again at each wake-up, or every
        ``claim.recheck`` seconds at the latest (a holder whose session died sends no
        NOTIFY). The session, its granted row and when the granting scan was sent.
        """
        permit = Permit(self._namespace, claim.name)
        taken = await self._first_scan(
            sql, claim=claim, ttl_ms=ttl_ms, wait=wait, began=began, permit=permit
        )
        if taken is None:
            return None
        session, row = taken
        if row is not None:
            return session, row, began
        if wait == 0:
            claim.handle = None
            # The scan took nothing: the session is clean.
            await self._sessions.checkin(session)
            return None
        clock = self.clock
        deadline = None if wait is None else began + wait
        async with self._listener.permit_waiter(permit.channel) as slot:
            while True:
                sent = clock.now()
                flag = HOLD_FLAG if session.flagged else TAKE_FLAG
                row = await self._scan(sql, session, claim, flag=flag, sent=sent, deadline=deadline)
                if row is not None:
                    session.flagged = False
                    return session, row, sent
                now = clock.now()
                if deadline is not None and now >= deadline:
                    break
                until = now + claim.recheck
                await slot.wait(clock, until if deadline is None else min(until, deadline))
        # Timed out: drop the waiting flag and give the connection back.
        async with session.lock:
            if session.flagged and not session.ended():
                try:
                    await session.conn.raw.fetchval(sql.unflag, timeout=self._request_timeout)
                except DRIVER_ERRORS as exc:
                    claim.handle = None
                    self._sessions.end_session(session)
                    if gone(exc):
                        return None
                    raise self._failed(exc) from exc
                session.flagged = False
            claim.handle = None
            if not session.ended():
                await self._sessions.checkin(session)
        return None

    async def _first_scan(
        self,
        sql: Statements,
        *,
        claim: Claim,
        ttl_ms: int,
        wait: float | None,
        began: float,
        permit: Permit,
    ) -> tuple[Session, asyncpg.Record | None] | None:
        """The try-first scan on a connection (a kept one first, as in :meth:`_take`)."""
        for prefer_kept in (True, False):
            conn = await self._sessions.checkout(wait, prefer_kept=prefer_kept)
            if conn is None:
                return None  # no connection within the caller's timeout
            session = claim.handle = self._sessions.open_session(claim, conn, 0, ttl_ms, permit)
            try:
                row = await self._scan(sql, session, claim, flag=NO_FLAG, sent=began, deadline=None)
            except BackendError as exc:
                cause = exc.__cause__
                if (
                    cause
                    and gone(cause)
                    and prefer_kept
                    and conn.configured
                    and not self._sessions.closing
                ):
                    continue
                raise
            return session, row
        raise AssertionError("not reached: the second pass never continues")

    async def _scan(
        self,
        sql: Statements,
        session: Session,
        claim: Claim,
        *,
        flag: int,
        sent: float,
        deadline: float | None,
    ) -> asyncpg.Record | None:
        """One scan of the semaphore's slots on the claim's session; the row if granted.

        A driver error ends the session (whatever it took ends with it) and raises
        BackendError. A cancellation leaves the session on the claim for the caller's
        clean-up, which releases whatever the scan may have taken.
        """
        permit = session.permit
        assert permit is not None
        conn = session.conn
        configure = not conn.configured
        # Where this scan starts: concurrent scans spread over the slots.
        start = random.randrange(claim.limit)  # noqa: S311 - load spreading, no secret
        bound = str(TRY_FENCE_WAIT_MS)
        if flag == TAKE_FLAG:
            # Other waiters hold the flag shared; only a release takes it (exclusively,
            # for an instant). Bounded all the same.
            left = claim.recheck if deadline is None else max(0.0, deadline - sent)
            bound = str(max(1, math.ceil(min(left, claim.recheck) * 1000)))
        tail, settings = session_args(sql, session, claim.value, configure)
        args: list[object] = [
            permit.prefix,
            claim.limit,
            start,
            tail,
            *permit.fence_key,
            bound,
            *settings,
        ]
        if flag != NO_FLAG:
            args.append(permit.flag)
        try:
            row = await conn.raw.fetchrow(
                sql.scan[configure, flag], *args, timeout=self._within(bound)
            )
        except asyncpg.exceptions.LockNotAvailableError:
            # The flag was not had in time (nothing taken), or the fence step (its fence
            # key, or nextval()) ran out of lock_timeout after a slot was taken (a permit
            # would leak: session locks do not roll back with the statement). Drop
            # everything the session holds, the waiting flag included (the next scan
            # takes it again).
            session.flagged = False
            if not await self._sessions.unlock_all(session):
                raise BackendError(
                    f"{self._where}: a permit scan failed and its session could not be "
                    "cleaned; it was ended"
                ) from None
            return None
        except DRIVER_ERRORS as exc:
            session.flagged = False
            self._sessions.end_session(session)
            raise self._failed(exc) from exc
        if flag == TAKE_FLAG and row is None:
            session.flagged = True
        return row

    def _lock_bound(self, mode: str, wait: float | None, began: float) -> str:
        """The ``lock_timeout`` (ms, text) of an acquire statement (see
        :class:`Statements`): a try's bound on its fence step, or what is left of the
        caller's wait ("0": no server-side limit)."""
        if mode == TRY:
            return str(TRY_FENCE_WAIT_MS)
        left = None if wait is None else wait - (self.clock.now() - began)
        if left is None or left * 1000 > _MAX_TIMEOUT_MS:
            # No server-side limit: lock_timeout stops at INT_MAX ms (24.8 days), and a
            # longer wait ends by the caller's own deadline instead.
            return "0"
        return str(max(1, math.ceil(left * 1000)))

    def _keys(self, name: str) -> tuple[int, tuple[int, int]]:
        """The advisory key of lock ``name`` and its fence key (:func:`fence_ids`)."""
        keys = self._key_cache.get(name)
        if keys is None:
            if len(self._key_cache) >= _KEYS_KEPT:
                self._key_cache.clear()
            key = key_in(self._key_prefix, name)
            keys = self._key_cache[name] = (key, fence_ids(key))
        return keys

    def _within(self, lock_timeout_ms: str) -> float:
        """How long to wait for the answer to a statement that may wait this long (a
        ``lock_timeout`` in ms; "0": no limit) for a lock on the server."""
        if lock_timeout_ms == "0":
            return _NO_BOUND
        return int(lock_timeout_ms) / 1000 + self._request_timeout

    def _failed(self, exc: BaseException) -> BackendError:
        """The BackendError for a driver error ``exc`` (chain it)."""
        if isinstance(exc, TimeoutError):
            return unanswered(self._where, self._request_timeout)
        return BackendError(f"{self._where}: {exc}")

    async def extend(self, claim: Claim, ttl: float) -> bool:
        session = claim.handle
        if not isinstance(session, Session) or session.done:
            return False
        sql = self._sql or await self._statements()
        ttl_ms = math.ceil(ttl * 1000)
        owner = identity_of(claim.value)
        if ttl_ms != session.ttl_ms and owner not in self._registered:
            await self._register(owner, ttl_ms)  # a new TTL may leave no room for it
        async with session.lock:
            if session.ended():
                return False
            # Chosen under the session's lock: the TTL the session has is the one the
            # last statement on it set, never one a concurrent statement is about to set.
            if ttl_ms == session.ttl_ms:
                statement, args = sql.heartbeat, []
            else:
                text = shown(identity_of(claim.value), ttl_ms)
                name = f"{APP_PREFIX}{session.fence}:{ttl_ms}:{text}"
                statement, args = sql.heartbeat_new_ttl, [name]
                if sql.has_idle_timeout:
                    args.append(str(ttl_ms))
            try:
                pid = await session.conn.raw.fetchval(
                    statement, *args, timeout=self._request_timeout
                )
            except BaseException as exc:
                # The statement may or may not have set the new TTL: make the next one set
                # it again (0 is no TTL's value) rather than trust either.
                session.ttl_ms = 0
                if isinstance(exc, TimeoutError):
                    # Unanswered: the request ends here, and so does the session (closing
                    # the connection is the only bound on it). Its lock goes with it, so
                    # the lease is lost: nothing can confirm it any more.
                    self._sessions.end_session(session)
                    self._hold_ended(claim)
                    raise self._failed(exc) from exc
                if gone(exc):
                    self._sessions.end_session(session)
                    return False
                if isinstance(exc, asyncpg.PostgresError):
                    raise BackendError(f"{self._where}: {exc}") from exc
                raise
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
        if not isinstance(session, Session):
            return False
        within = self._request_timeout
        sql = self._sql
        try:
            if sql is not None and not session.lock.locked():
                # Nothing queued on the session: the statement's own timeout bounds the
                # release, and giving the connection back gets what is left of it (an
                # asyncio.timeout here costs a fifth of the backend's own CPU per lease).
                loop = asyncio.get_running_loop()
                return await self._release(session, sql, loop.time() + within)
            async with asyncio.timeout(within):
                return await self._release(session, sql or await self._statements(), None)
        except TimeoutError:
            # No answer: a silent server, or a statement stuck on the session. The unlock
            # may or may not have run; ending the session ends its locks either way (the
            # server frees them as it sees the connection close, at the latest after the
            # session's idle_session_timeout). The caller hears of a failed release.
            self._sessions.end_session(session)
            raise BackendError(
                f"{self._where}: release not answered within {within:g} s (the request "
                "timeout); its session was closed, which gives the lock back"
            ) from None

    async def _release(self, session: Session, sql: Statements, deadline: float | None) -> bool:
        """Unlock and give the session back; ``deadline`` (loop time) bounds it unless the
        caller does (None)."""
        async with session.lock:
            if session.ended():
                return session.released
            permit = session.permit
            if permit is None:
                statement = sql.release[session.shared]
                args: list[object] = [session.key]
            else:
                # An interrupted scan may have taken a slot we never heard of: then the
                # key is unknown (None) and every lock of the session goes.
                statement = sql.release_permit
                args = [session.key or None, permit.flag, permit.channel]
            if sql.has_idle_timeout:
                args.append(self._idle_default)
            # Bounded by release() (with the wait for the session's lock) or by the
            # deadline; an explicit timeout also keeps a pool's command_timeout out.
            loop = asyncio.get_running_loop()
            within = _NO_BOUND if deadline is None else deadline - loop.time()
            try:
                unlocked = await session.conn.raw.fetchval(statement, *args, timeout=within)
            except asyncio.CancelledError:
                # The statement may or may not have run; asyncpg cancels it on the server
                # and the connection stays usable. The caller's clean-up calls again.
                session.interrupted = True
                raise
            except TimeoutError:
                raise  # not answered by the deadline: release() ends the session
            except DRIVER_ERRORS as exc:
                self._sessions.end_session(session)
                if gone(exc):
                    return False  # the session, and its lock, were already gone
                raise self._failed(exc) from exc
            # Only this live session could have unlocked its own lock: after an interrupted
            # release, "not held" means the interrupted statement did it.
            session.released = bool(unlocked) or session.interrupted
            await self._sessions.checkin(
                session, None if deadline is None else max(0.0, deadline - loop.time())
            )
            return session.released

    async def inspect(self, name: str) -> LockInfo | None:
        sql = await self._statements()
        classid, objid = lock_ids(advisory_key(name, self._namespace))
        with self._errors:
            async with self._sessions.borrowed() as conn:
                rows = await conn.fetch(sql.inspect, classid, objid, timeout=self._request_timeout)
                best: LockInfo | None = None
                for row in rows:
                    info = holder_info(name, row)
                    # The newest fence; ours before a foreign holder (also fence 0) when
                    # ours has no fence yet (granted, fence step still running).
                    rank = (info.fence, math.isfinite(info.expires_in))
                    if best is None or rank > (best.fence, math.isfinite(best.expires_in)):
                        best = info
                if (
                    best is not None
                    and math.isfinite(best.expires_in)  # ours, not a foreign name
                    and best.owner.startswith(DIGEST_MARK)
                ):
                    best = await identified(
                        conn,
                        best,
                        schema=self._schema,
                        table=self._identities,
                        within=self._request_timeout,
                    )
        return best

    async def _register(self, identity: str, ttl_ms: int) -> None:
        """Store ``identity`` in the identity table if application_name cannot show it
        (once per identity and backend; the table is created on first need)."""
        if identity in self._registered or inline(identity, ttl_ms):
            return
        with self._errors:
            async with self._sessions.borrowed() as conn:
                await store_identity(
                    conn,
                    identity,
                    schema=self._schema,
                    table=self._identities,
                    within=self._request_timeout,
                )
        self._registered.add(identity)

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

    async def publish(self, topic: str, message: str) -> None:
        await self._statements()
        with self._errors:
            async with self._sessions.borrowed() as conn:
                await conn.execute(
                    "SELECT pg_notify($1, $2)",
                    topic_channel(self._key_prefix, topic),
                    message,
                    timeout=self._request_timeout,
                )

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return self._listen(topic)

    @asynccontextmanager
    async def _listen(self, topic: str) -> AsyncIterator[Mailbox]:
        mailbox = Mailbox()
        async with self._listener.subscribed(topic_channel(self._key_prefix, topic), mailbox):
            yield mailbox

    async def aclose(self) -> None:
        """Close what the backend opened, within about 5 s in all, whatever the server does.

        Sessions still ours (acquires waiting in the server's queue, leases not released
        in time) are ended on the server and their connections closed; connections kept
        between leases and the listening one go back to the pool reset (closed instead
        if the server does not answer in time); a pool of our own is closed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_TIMEOUT

        def left() -> float:
            return max(0.0, min(self._request_timeout, deadline - loop.time()))

        self._sessions.begin_closing()
        sessions = list(self._sessions.active)
        for session in sessions:
            self._sessions.let_go(session)
        await self._end_server_sessions(sessions, left())
        for session in sessions:
            self._sessions.end_session(session)
        idle = self._sessions.take_idle()
        channels = self._listener.drop_all()
        within = left()
        await asyncio.gather(
            *(self._sessions.to_pool(conn, within) for conn in idle),
            self._listener.stop_listening(channels, within),
        )
        await self._background.close(max(0.0, deadline - loop.time()))
        if self._owns_pool and self._pool_started:
            try:
                # Each connection says goodbye and waits for the server to hang up.
                async with asyncio.timeout(left()):
                    await self._sessions.pool.close()
            except TimeoutError:
                self._sessions.pool.terminate()

    async def _end_server_sessions(self, sessions: list[Session], within: float) -> None:
        """Have the server end ``sessions`` and wait until they are gone (PostgreSQL >=
        14), within ``within`` seconds: a session waiting in the lock queue reads its
        socket only at its next client check (``client_connection_check_interval``, 1 s),
        so closing our end alone would leave it on the server after ``aclose()``. Best
        effort: where it cannot be done (no answer, a role that may not end them),
        closing the connections ends them a moment later."""
        sql = self._sql
        pids = [
            session.conn.raw.get_server_pid()
            for session in sessions
            if not session.gone and not session.conn.raw.is_closed()
        ]
        if not pids or sql is None or within <= 0:
            return
        args: list[object] = [pids, _EXIT_WAIT_MS] if sql.has_idle_timeout else [pids]
        with contextlib.suppress(Exception):
            async with asyncio.timeout(within), self._sessions.borrowed() as conn:
                await conn.fetchval(sql.end_sessions, *args, timeout=_NO_BOUND)

    def describe(self) -> str:
        return f"PostgresBackend {self._where[len('PostgreSQL ') :]} namespace={self._namespace!r}"

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        """The asyncpg pool in use (:meth:`from_dsn`: made at the first use, in its
        event loop; before that, a pool that is never started)."""
        return self._sessions.pool

    def key(self, name: str) -> int:
        """The advisory-lock key of ``name`` in this backend's namespace."""
        return advisory_key(name, self._namespace)


_BACKEND_OPTIONS = (
    "namespace",
    "schema",
    "fence_sequence",
    "clock",
    "drift_factor",
    "drift_base",
    "pool_timeout",
    "request_timeout",
)
