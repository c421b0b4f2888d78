"""PostgreSQL session advisory locks through asyncpg, with a real TTL and fences.

A lease holds one connection out of the pool for its whole life (a *session*): the
advisory lock belongs to that session and ends with it. Each step is one statement, so
one round trip:

- acquire: an ``application_name`` that names the holder (fence not known yet), then
  ``pg_advisory_lock`` (or ``_shared``) waiting in the server's own lock queue under a
  statement-local ``lock_timeout``, then the fence step
  (:func:`asynclock.postgres.fence_select`: the server's clock in µs, never below the
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
import hashlib
import logging
import math
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Literal, Protocol
from urllib.parse import quote, unquote, urlsplit

import asyncpg

from .._backoff import Backoff
from .._clock import Clock
from .._errors import BackendError, LockError, map_backend_errors
from .._tasks import TaskSet
from .._validate import check_name, check_number
from .._wakeup import Mailbox, WakeHub, WakeSlot
from ..postgres import (
    DEFAULT_NAMESPACE,
    IDENTITY_TABLE,
    TRY_FENCE_WAIT_MS,
    advisory_key,
    ensure_fence_sequence,
    ensure_identity_table,
    fence_ids,
    fence_select,
    key_in,
    lock_ids,
    lock_timeout_sql,
    permit_fence_ids,
    permit_prefix,
    quote_ident,
    waiting_key,
)
from .base import Attempt, Backend, Claim, LockInfo

__all__ = ("PostgresBackend",)

logger = logging.getLogger("asynclock.postgres")

# asyncpg's InternalClientError: a protocol state it cannot handle (seen when a frozen
# process resumes with the server's goodbye and a heartbeat due in the same instant).
_CONFUSED = asyncpg.exceptions._base.InternalClientError
_DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, _CONFUSED, OSError)


def _unusable(proxy: Any) -> bool:
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


def _gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the session ended under the statement (the server closed it,
    the network failed), as opposed to a statement that went unanswered (TimeoutError, an
    OSError too), whose session may live on until its connection is closed."""
    return isinstance(exc, _SESSION_GONE) and not isinstance(exc, TimeoutError)


def _answered(exc: BaseException, conn: Any) -> bool:
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


class _MapErrors(map_backend_errors):
    """:class:`map_backend_errors`, with a message that says so when a statement went
    unanswered for the request timeout (the driver's TimeoutError says nothing)."""

    __slots__ = ("_timeout",)

    def __init__(self, where: str, timeout: float) -> None:
        super().__init__(where, _DRIVER_ERRORS)
        self._timeout = timeout

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if isinstance(exc, TimeoutError) and not isinstance(exc, LockError):
            raise _unanswered(self._where, self._timeout) from exc
        return super().__exit__(exc_type, exc, tb)


def _unanswered(where: str, timeout: float) -> BackendError:
    return BackendError(
        f"{where}: no answer within the request timeout ({timeout:g} s); the connection "
        "was closed, and what its session held ends with it"
    )


_APP_PREFIX = "asynclock:"
# The largest lock_timeout PostgreSQL accepts (INT_MAX milliseconds).
_MAX_TIMEOUT_MS = 2**31 - 1
# Session settings a connection carries while asynclock uses it, restored when it goes
# back to the pool. idle_session_timeout is also reset after every lease.
_IDLE = "idle_session_timeout"
# Everything a lease may change on its session; RESET when a connection leaves us (with
# transaction_timeout on PostgreSQL >= 17: _Statements.reset).
_RESET = (
    "RESET application_name; RESET tcp_keepalives_idle; RESET tcp_keepalives_interval; "
    "RESET idle_session_timeout; RESET client_connection_check_interval; "
    "RESET statement_timeout"
)
# Waits set statement_timeout to 0 (no limit) for the session before they wait: a role or
# database statement_timeout would end a wait in the queue with an error, and the server
# arms statement_timeout when a statement starts, so it must be set by the statement
# before. The wait itself is bounded by its lock_timeout and the caller's deadline; our
# other statements are short. RESET when the connection goes back to the pool.
_UNBOUNDED = "set_config('statement_timeout', '0', false)"
# How often a server backend waiting in the lock queue checks that its client is still
# there (PostgreSQL >= 14): a killed waiter leaves the queue within this.
_CHECK_INTERVAL_MS = 1000
# How long a connection is kept out of the pool for the next lease after its last one
# (back-to-back leases skip the pool's checkout): then it goes back to the pool, where
# others may be queued.
_KEEP_IDLE = 1.0
# The default request_timeout: how long a statement may go unanswered (beyond what it may
# wait in the server's lock queue) before its connection is closed; as Redis's default
# socket timeout.
_REQUEST_TIMEOUT = 5.0
# asyncpg reads timeout=None as the connection's command_timeout (an application's pool
# may set one): a statement allowed to wait in the server's queue without bound gets this
# instead (about 317 years).
_NO_BOUND = 1e10
# How long aclose() takes at most, in all (each statement on its way also within the
# request timeout): as the Redis backend's.
_CLOSE_TIMEOUT = 5.0
# How long aclose() lets the server take to end sessions it was asked to end.
_EXIT_WAIT_MS = 1000
# Lock acquire statements: try once; try before a wait; wait in the queue.
_TRY, _TRY_BEFORE_WAIT, _WAIT = "try", "try-before-wait", "wait"
# Permit scans: not waiting; the first scan of a wait (takes the waiting flag); later
# scans of a wait (the flag is held).
_NO_FLAG, _TAKE_FLAG, _HOLD_FLAG = 0, 1, 2


async def _keep_as_is(conn: asyncpg.Connection[Any]) -> None:
    """Pool reset for our own pool: connections come back in the state they left."""


# A URL DSN read leniently: credentials up to the last "@" that is followed by a host list
# (no "@", "/", "?" or "#" in it), then the path and query. For passwords with "#", "/",
# "?" or "@" that were not percent-encoded, which a URL parser cuts in the wrong place.
_LENIENT_DSN = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<auth>.*?)@(?P<hosts>[^@/?#]*)(?P<tail>[/?].*)?",
    re.DOTALL,
)


def _host_list_ok(hostspec: str) -> bool:
    """Whether asyncpg can read ``hostspec`` (``h1:5432,[::1]:5433,h3``): ports numeric,
    and no ``@`` (a password's, cut at its own ``@``)."""
    if "@" in hostspec:
        return False
    for item in hostspec.split(","):
        if item.startswith("["):
            _, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                return False
            port = rest[1:]
        else:
            port = item.partition(":")[2]
        if port and not port.isdigit():
            return False
    return True


def _split_dsn(dsn: str) -> tuple[str, str, str, str] | None:
    """``(scheme, credentials, host list, path and query)`` of a URL DSN, read as asyncpg
    reads it (``urllib.parse``, credentials before the first ``@``, several hosts
    separated by commas), else leniently (:data:`_LENIENT_DSN`); None if neither reads
    it. Never raises: the text may hold a password."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        parts = None
    # An "@" after the host list means the grammar cut a password at a raw "/" or "?"
    # ("app:2024/Secret@host": host "app", port 2024): read it leniently instead.
    strict = parts is not None and "@" not in parts.path + parts.query
    if parts is not None and strict and parts.scheme and not parts.fragment:
        auth, at, hostspec = parts.netloc.partition("@")
        if not at:
            auth, hostspec = "", parts.netloc
        if _host_list_ok(hostspec):
            query = f"?{parts.query}" if parts.query else ""
            return parts.scheme, auth, hostspec, parts.path + query
    found = _LENIENT_DSN.fullmatch(dsn)
    if found is None or not _host_list_ok(found["hosts"]):
        return None
    return found["scheme"], found["auth"], found["hosts"], found["tail"] or ""


def _describe_dsn(dsn: str) -> str:
    """``hosts/database`` of a DSN, without credentials (for reprs, logs and errors)."""
    split = _split_dsn(dsn)
    if split is None:
        return "(DSN not shown)"
    _, _, hostspec, tail = split
    path = tail.partition("?")[0]
    return f"{hostspec or 'localhost'}{path or '/'}"


def _usable_dsn(dsn: str) -> str:
    """``dsn`` as asyncpg will read it: unchanged if it does, else with its credentials
    percent-encoded (a password with an unescaped ``#``, ``/``, ``?`` or ``@``).

    Raises ValueError, naming no credentials, if it is no DSN at all."""
    split = _split_dsn(dsn)
    if split is None:
        raise ValueError(
            f"not a PostgreSQL DSN asyncpg can read: {_redacted(dsn)} (expected "
            "postgresql://user:password@host:port[,host:port...]/database?options)"
        )
    scheme, auth, hostspec, tail = split
    try:
        parts = urlsplit(dsn)
        as_is = parts.netloc.partition("@")[2] == hostspec and not parts.fragment
    except ValueError:
        as_is = False
    if as_is or not auth:
        return dsn
    user, colon, password = auth.partition(":")
    encoded = quote(unquote(user), safe="")
    if colon:
        encoded += ":" + quote(password, safe="")
    return f"{scheme}://{encoded}@{hostspec}{tail}"


def _redacted(dsn: str) -> str:
    """The scheme of a DSN and nothing else of what precedes its host list."""
    scheme = dsn.partition("://")[0] if "://" in dsn else ""
    return f"{scheme}://..." if scheme.isascii() and scheme.isalnum() else "(DSN not shown)"


class _Conn:
    """A connection taken out of the pool; ``configured`` once its keepalives are set.

    ``raw`` is the asyncpg connection behind the pool's proxy: statements go to it
    directly while we hold it (the proxy's per-call indirection is measurable on a
    two-statement lease); the proxy is what goes back to the pool.
    """

    __slots__ = ("configured", "idle_since", "proxy", "raw")

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.raw = getattr(proxy, "_con", None) or proxy
        self.configured = False
        self.idle_since = 0.0  # when it was last kept idle (loop time)


class _Permit:
    """What a semaphore claim needs to know besides its session: where its keys come
    from, the waiting flag's key, the fence key and the channel releases are announced
    on."""

    __slots__ = ("channel", "fence_key", "flag", "prefix")

    def __init__(self, namespace: str, name: str) -> None:
        self.prefix = permit_prefix(namespace, name)
        self.flag = waiting_key(name, namespace)
        self.fence_key = permit_fence_ids(name, namespace)
        digest = hashlib.sha256(self.prefix + b"released").hexdigest()
        self.channel = f"asynclock_p_{digest[:40]}"


class _Session:
    """The connection pinned for one lease."""

    __slots__ = (
        "conn",
        "done",
        "fence",
        "flagged",
        "gone",
        "interrupted",
        "key",
        "lock",
        "on_close",
        "permit",
        "pid",
        "released",
        "shared",
        "ttl_ms",
    )

    def __init__(
        self, conn: _Conn, key: int, shared: bool, ttl_ms: int, permit: _Permit | None = None
    ) -> None:
        self.conn = conn
        # A permit's key is known once a scan granted a slot (0 until then).
        self.key = key
        self.shared = shared
        self.ttl_ms = ttl_ms
        self.permit = permit
        # A waiting permit claim holds the semaphore's waiting flag.
        self.flagged = False
        self.fence = 0
        self.pid = 0
        # One statement at a time on the connection: heartbeat, extend and release.
        self.lock = asyncio.Lock()
        self.done = False
        self.released = False
        # A release statement was interrupted: the lock may already be unlocked.
        self.interrupted = False
        # The connection was terminated (and handed back to the pool as dead).
        self.gone = False
        # The termination listener on the connection while the session uses it.
        self.on_close: Any = None

    def ended(self) -> bool:
        """True once the session was given back or terminated (re-read after awaits)."""
        return self.done


class _Statements:
    """The SQL for one server version and configuration, built once.

    Lock acquire statements come in variants: trying once, trying before a wait (which
    also arms ``client_connection_check_interval`` and lifts ``statement_timeout`` and
    ``transaction_timeout`` for the wait), or waiting; exclusive or shared; setting TCP
    keepalives (on a connection's first lease) or not. Each names the session as ours
    (``asynclock:0:<ttl ms>:<identity>``: holder known, fence not yet) before it takes
    the lock, so that ``inspect()`` never sees the grant under a name that is not ours,
    then takes the lock, runs the fence step (:func:`asynclock.postgres.fence_select`) and
    names the session with its fence. Parameters: ``$1`` key, ``$2`` the application_name
    tail (``<ttl ms>:<identity>``), ``$3``/``$4`` the fence key, ``$5`` ``lock_timeout``
    (the wait's; for a try, the bound of its fence step unless the session has a
    ``lock_timeout`` of its own), then ``idle_session_timeout`` (PostgreSQL >= 14), then
    the keepalives (first lease).

    Permit scans (:attr:`scan`) take the first free slot of a semaphore; see
    :meth:`_scan`.
    """

    def __init__(self, sequence: str, version: int) -> None:
        self.has_idle_timeout = version >= 14
        # transaction_timeout (PostgreSQL >= 17) ends a session whose transaction, a single
        # statement's included, lasts longer: a wait in the queue is one. Setting or
        # resetting it is an error on older servers.
        has_transaction_timeout = version >= 17
        self.unbounded = [_UNBOUNDED]
        self.reset = _RESET
        if has_transaction_timeout:
            self.unbounded.append("set_config('transaction_timeout', '0', false)")
            self.reset += "; RESET transaction_timeout"
        self.acquire: dict[tuple[bool, str, bool], str] = {}
        for configure in (False, True):
            for mode in (_TRY, _TRY_BEFORE_WAIT, _WAIT):
                for shared in (False, True):
                    self.acquire[configure, mode, shared] = self._acquire(
                        sequence, configure=configure, mode=mode, shared=shared
                    )
        self.scan: dict[tuple[bool, int], str] = {
            (configure, flag): self._scan(sequence, configure=configure, flag=flag)
            for configure in (False, True)
            for flag in (_NO_FLAG, _TAKE_FLAG, _HOLD_FLAG)
        }
        unlock = {False: "pg_advisory_unlock", True: "pg_advisory_unlock_shared"}
        reset_idle = f", set_config('{_IDLE}', $2, false)" if self.has_idle_timeout else ""
        self.release = {
            shared: f"SELECT {fn}($1) AS released{reset_idle}" for shared, fn in unlock.items()
        }
        # A permit's session is pinned to it: whatever advisory lock it has (its slot, the
        # waiting flag of an interrupted wait) is the permit's. $1 the slot's key (NULL if
        # an interrupted scan never told us), $2 the waiting flag, $3 the NOTIFY channel.
        # The NOTIFY is sent only if a waiter holds the flag. It makes the statement's
        # transaction write a commit record; nothing in it needs to be durable, so the
        # commit does not wait for the WAL flush (measured: 9 ms -> 1 ms hand-off).
        reset_idle = f", set_config('{_IDLE}', $4, false)" if self.has_idle_timeout else ""
        self.release_permit = (
            "WITH quick AS (SELECT set_config('synchronous_commit', 'off', true)), "
            "slot AS (SELECT coalesce(pg_advisory_unlock($1::bigint), false) AS released "
            "FROM quick), "
            "cleared AS (SELECT released, pg_advisory_unlock_all() FROM slot), "
            "told AS (SELECT released, CASE "
            "WHEN NOT (released OR $1::bigint IS NULL) THEN false "
            "WHEN pg_try_advisory_lock($2::bigint) THEN NOT pg_advisory_unlock($2::bigint) "
            "ELSE pg_notify($3, 'released') IS NOT NULL END AS told FROM cleared) "
            f"SELECT released, told{reset_idle} FROM told"
        )
        # A waiter that gives up leaves the waiting flag (its only lock) behind.
        self.unflag = "SELECT pg_advisory_unlock_all()"
        # Any statement resets the server's idle timer; the pid tells whether it ran on
        # the session that holds the lock.
        self.heartbeat = "SELECT pg_backend_pid()"
        new_ttl = "set_config('application_name', $1, false)"
        if self.has_idle_timeout:
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
        # aclose(): sessions of ours the server still has (a waiter in the lock queue reads
        # its socket only at its next client check) are ended, and (PostgreSQL >= 14)
        # waited for until they are gone. $1 their pids, $2 how long to wait for each.
        wait = ", $2::bigint" if self.has_idle_timeout else ""
        self.end_sessions = (
            f"SELECT count(*) FILTER (WHERE pg_terminate_backend(pid{wait})) "
            "FROM unnest($1::int[]) AS pid"
        )

    def _granted_row(self, tail: int, first: int, *, configure: bool, extra: str = "") -> str:
        """The select list of a grant (from ``granted``, a :func:`fence_select`): fence,
        the fence step's ``waited`` (selected so that it runs), pid and the session's
        settings. ``$<tail>`` is the application_name tail; the idle timeout and the
        keepalives take the parameters from ``$<first>`` on."""
        n = first
        named = f"'{_APP_PREFIX}' || granted.fence || ':' || ${tail}"
        columns = [
            "granted.fence",
            "granted.waited",
            "pg_backend_pid() AS pid",
            f"set_config('application_name', {named}, false)",
        ]
        if self.has_idle_timeout:
            columns.append(f"set_config('{_IDLE}', ${n}, false)")
            n += 1
        if configure:
            columns += [
                f"set_config('tcp_keepalives_idle', ${n}, false)",
                f"set_config('tcp_keepalives_interval', ${n + 1}, false)",
            ]
        if extra:
            columns.append(extra)
        return ", ".join(columns)

    def _acquire(self, sequence: str, *, configure: bool, mode: str, shared: bool) -> str:
        # Each step a subquery over the one before (see fence_select): the session named,
        # then the lock, then the fence step, then the session's settings.
        columns = self._granted_row(2, 6, configure=configure)
        kind = "_shared" if shared else ""
        settings = [f"set_config('application_name', '{_APP_PREFIX}0:' || $2, false)"]
        if mode == _WAIT:
            settings.append(lock_timeout_sql("$5", unless_set=False))
            granted_rows = (
                f"(SELECT pg_advisory_lock{kind}($1) FROM (SELECT {', '.join(settings)} "
                "OFFSET 0) AS named OFFSET 0) AS locked"
            )
        else:
            settings.append(lock_timeout_sql("$5", unless_set=True))
            if mode == _TRY_BEFORE_WAIT:
                # The server arms the client-connection check, statement_timeout and
                # transaction_timeout when a statement (or its transaction) starts, from
                # the session's values: set in the waiting statement itself they would
                # come too late (measured: a killed waiter stayed queued). Session scope,
                # set here, before the wait; RESET when the connection goes back.
                settings += self.unbounded
                if self.has_idle_timeout:
                    settings.append(
                        "set_config('client_connection_check_interval', "
                        f"'{_CHECK_INTERVAL_MS}', false)"
                    )
            granted_rows = (
                f"(SELECT pg_try_advisory_lock{kind}($1) AS ok FROM (SELECT "
                f"{', '.join(settings)} OFFSET 0) AS named OFFSET 0) AS attempt WHERE ok"
            )
        fenced = fence_select(sequence, granted_rows=granted_rows, fence_key=("$3", "$4"))
        return f"SELECT {columns} FROM ({fenced}) AS granted"

    def _scan(self, sequence: str, *, configure: bool, flag: int) -> str:
        """Take the first free permit slot, at most one, in a single statement.

        ``$1`` the permit prefix (bytea), ``$2`` the limit, ``$3`` the slot to start at,
        ``$4`` the application_name tail, ``$5``/``$6`` the semaphore's fence key, ``$7``
        ``lock_timeout`` (for the waiting flag when taking it, else the bound of the
        fence step unless the session has its own), then idle timeout and keepalives,
        then (waiting) the waiting flag's key.

        The slots are tried one by one in a recursive CTE: each step runs only if the
        step before did not get its slot (``WHERE NOT s.ok``), so at most one
        ``pg_try_advisory_lock`` returns true; a recursive CTE is evaluated step by
        step, whatever the plan. Keys are computed by the server, as :func:`permit_key`
        does (no array of ``limit`` keys travels with every attempt).
        """
        flag_param = 8 + int(self.has_idle_timeout) + 2 * int(configure)
        extra = ""
        if flag != _NO_FLAG:
            # Granted: the waiter is a waiter no more.
            extra = f"pg_advisory_unlock_shared(${flag_param}::bigint)"
        columns = self._granted_row(4, 8, configure=configure, extra=extra)
        key = (
            "('x' || left(encode(sha256($1::bytea || convert_to((({step}) % $2::int)::text, "
            "'UTF8')), 'hex'), 16))::bit(64)::bigint"
        )
        if flag == _TAKE_FLAG:
            # Held before the scan: a release after the scan sees the flag and notifies.
            # From here the session waits idle between scans, up to the recheck interval:
            # a role's idle_session_timeout would end it (and the wait), so it is lifted,
            # as statement_timeout is for lock waits. A grant sets it to the lease's ttl
            # (the select list is evaluated after this CTE); RESET when the connection
            # goes back to the pool.
            lift = f", set_config('{_IDLE}', '0', false)" if self.has_idle_timeout else ""
            ctes = (
                f"limited AS (SELECT {lock_timeout_sql('$7', unless_set=False)}{lift}), "
                f"flagged AS (SELECT pg_advisory_lock_shared(${flag_param}::bigint) "
                "FROM limited), "
            )
            first_source = "flagged, "
        else:
            ctes = f"limited AS (SELECT {lock_timeout_sql('$7', unless_set=True)}), "
            first_source = "limited, "
        first_key = key.format(step="$3::int")
        next_key = key.format(step="s.step + 1 + $3::int")
        fenced = fence_select(
            sequence, granted_rows="scan WHERE ok", fence_key=("$5", "$6"), carry="key, "
        )
        return (
            f"WITH RECURSIVE {ctes}"
            "scan(step, key, ok) AS ("
            f"SELECT 0, k.key, pg_try_advisory_lock(k.key) FROM {first_source}"
            f"LATERAL (SELECT {first_key} AS key) AS k "
            "UNION ALL "
            "SELECT s.step + 1, k.key, pg_try_advisory_lock(k.key) FROM scan AS s, "
            f"LATERAL (SELECT {next_key} AS key) AS k "
            "WHERE NOT s.ok AND s.step + 1 < $2::int) "
            f"SELECT granted.key, {columns} FROM ({fenced}) AS granted"
        )


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
    # a writer.
    supports_shared = True
    # Fair locks: the server's queue is first come, first served, and a release hands the
    # lock to the first waiter inside the server, so a try from outside cannot barge in.
    # Every exclusive lock here is fair; claim.fair needs nothing more.
    supports_fair = True
    supports_semaphore = True

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
        self._pool = pool
        self._pool_timeout = check_number("pool_timeout", pool_timeout, positive=True)
        self._request_timeout = check_number("request_timeout", request_timeout, positive=True)
        self._namespace = namespace
        self._key_prefix = namespace.encode() + b"\x00"
        self._schema = schema
        self._sequence_name = fence_sequence
        self._sequence = f"{quote_ident(schema)}.{quote_ident(fence_sequence)}"
        self._identities = f"{quote_ident(schema)}.{quote_ident(IDENTITY_TABLE)}"
        # Identities stored in the identity table by this backend (see _register).
        self._registered: set[str] = set()
        self._owns_pool = False
        self._pool_started = False
        # from_dsn(): makes the pool again at first use, in the loop that uses it.
        self._make_pool: Callable[[], asyncpg.Pool[Any]] | None = None
        args = getattr(pool, "_connect_args", ())
        dsn = args[0] if args and isinstance(args[0], str) else ""
        self._where = f"PostgreSQL {_describe_dsn(dsn)}" if dsn else "PostgreSQL pool"
        self._errors = _MapErrors(self._where, self._request_timeout)
        self._sql: _Statements | None = None
        self._setup_lock: asyncio.Lock | None = None
        self._hub = WakeHub()
        # Sessions between checkout and give-back: waiting, holding or releasing.
        self._sessions: set[_Session] = set()
        # Clean connections kept out of the pool between leases.
        self._idle: list[_Conn] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._keep = max(1, min(8, pool.get_max_size() // 4))
        # LISTEN/NOTIFY for announcements: mailboxes by channel, one listening connection.
        self._listeners: dict[str, dict[_Sink, int]] = {}
        # Semaphores: one relay per channel from NOTIFY to the waiters of this process.
        self._relays: dict[str, _Relay] = {}
        self._listen_conn: Any = None
        self._listen_lock: asyncio.Lock | None = None
        self._relistening = False
        # Connections on their way back to the pool after a cancelled give-back.
        self._background = TaskSet("PostgreSQL")
        self._idle_default = "0"
        self._closing = False

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
        dsn = _usable_dsn(dsn)

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
                    if self._make_pool is not None:
                        self._pool = self._make_pool()  # in the running loop (from_dsn)
                    await self._pool  # connects nothing: min_size is 0
                    self._pool_started = True
                async with self._borrowed() as conn:
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
                            f"SELECT reset_val FROM pg_settings WHERE name = '{_IDLE}'",
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
            self._sql = _Statements(self._sequence, version.major)
            return self._sql

    # -- the Backend interface -------------------------------------------------------

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        if self._closing:
            raise BackendError(f"{self._where}: the backend was closed")
        clock = self.clock
        began = clock.now()
        sql = self._sql or await self._statements()
        owner = _owner(claim.value)
        if owner not in self._registered and not _inline(owner, math.ceil(ttl * 1000)):
            await self._register(owner, math.ceil(ttl * 1000))
        if claim.limit:
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
            session = claim.handle = self._open_session(claim, conn, key, ttl_ms)
            configure = not conn.configured
            # Try first: the statement that waits in the server's queue costs more (its
            # lock and check timeouts), so it is sent only when the lock is held.
            mode = _TRY if wait == 0 else _TRY_BEFORE_WAIT
            args, within = self._acquire_args(
                sql, session, claim.value, configure=configure, mode=mode, wait=wait, began=began
            )
            try:
                statement = sql.acquire[configure, mode, claim.shared]
                row = await conn.raw.fetchrow(statement, *args, timeout=within)
                if row is None and wait != 0:
                    args, within = self._acquire_args(
                        sql,
                        session,
                        claim.value,
                        configure=configure,
                        mode=_WAIT,
                        wait=wait,
                        began=began,
                    )
                    statement = sql.acquire[configure, _WAIT, claim.shared]
                    row = await conn.raw.fetchrow(statement, *args, timeout=within)
            except asyncpg.exceptions.LockNotAvailableError:
                # lock_timeout ended the statement: in the queue (nothing taken), or in the
                # fence step *after* the grant (its fence key, or nextval() behind a
                # migration's ALTER SEQUENCE). A session lock does not roll back with its
                # failed statement: drop whatever the session holds before the
                # connection is used again.
                if not await self._unlock_all(session):
                    claim.handle = None
                    return None  # the session was ended instead: its locks went with it
                row = None
            except _DRIVER_ERRORS as exc:
                # Unanswered in time (TimeoutError): the connection is closed, and the lock
                # with its session if it was granted after all.
                claim.handle = None
                self._end_session(session)
                if _gone(exc) and prefer_kept and conn.configured and not self._closing:
                    continue
                raise self._failed(exc) from exc
            # A cancellation propagates with the session still on the claim: the caller's
            # clean-up releases it (the lock may have been granted just before the cancel).
            if row is None:  # timed out in the queue, or tried once and it is held
                claim.handle = None
                await self._checkin(session)
                return None
            return session, row
        raise AssertionError("not reached: the second pass never continues")

    async def _take_permit(
        self, sql: _Statements, claim: Claim, ttl_ms: int, wait: float | None, began: float
    ) -> tuple[_Session, asyncpg.Record, float] | None:
        """A free permit slot of ``claim``'s semaphore, waiting up to ``wait`` for one.

        Try first; then, to wait: listen for the semaphore's releases, hold its waiting
        flag (so releases know to NOTIFY) and scan again at each wake-up, or every
        ``claim.recheck`` seconds at the latest (a holder whose session died sends no
        NOTIFY). The session, its granted row and when the granting scan was sent.
        """
        permit = _Permit(self._namespace, claim.name)
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
            await self._checkin(session)  # the scan took nothing: the session is clean
            return None
        clock = self.clock
        deadline = None if wait is None else began + wait
        async with self._permit_waiter(permit.channel) as slot:
            while True:
                sent = clock.now()
                flag = _HOLD_FLAG if session.flagged else _TAKE_FLAG
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
                except _DRIVER_ERRORS as exc:
                    claim.handle = None
                    self._end_session(session)
                    if _gone(exc):
                        return None
                    raise self._failed(exc) from exc
                session.flagged = False
            claim.handle = None
            if not session.ended():
                await self._checkin(session)
        return None

    async def _first_scan(
        self,
        sql: _Statements,
        *,
        claim: Claim,
        ttl_ms: int,
        wait: float | None,
        began: float,
        permit: _Permit,
    ) -> tuple[_Session, asyncpg.Record | None] | None:
        """The try-first scan on a connection (a kept one first, as in :meth:`_take`)."""
        for prefer_kept in (True, False):
            conn = await self._checkout(wait, prefer_kept=prefer_kept)
            if conn is None:
                return None  # no connection within the caller's timeout
            session = claim.handle = self._open_session(claim, conn, 0, ttl_ms, permit)
            try:
                row = await self._scan(
                    sql, session, claim, flag=_NO_FLAG, sent=began, deadline=None
                )
            except BackendError as exc:
                cause = exc.__cause__
                if cause and _gone(cause) and prefer_kept and conn.configured and not self._closing:
                    continue
                raise
            return session, row
        raise AssertionError("not reached: the second pass never continues")

    async def _scan(
        self,
        sql: _Statements,
        session: _Session,
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
        if flag == _TAKE_FLAG:
            # Other waiters hold the flag shared; only a release takes it (exclusively,
            # for an instant). Bounded all the same.
            left = claim.recheck if deadline is None else max(0.0, deadline - sent)
            bound = str(max(1, math.ceil(min(left, claim.recheck) * 1000)))
        tail, settings = _session_args(sql, session, claim.value, configure)
        args: list[object] = [
            permit.prefix,
            claim.limit,
            start,
            tail,
            *permit.fence_key,
            bound,
            *settings,
        ]
        if flag != _NO_FLAG:
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
            if not await self._unlock_all(session):
                raise BackendError(
                    f"{self._where}: a permit scan failed and its session could not be "
                    "cleaned; it was ended"
                ) from None
            return None
        except _DRIVER_ERRORS as exc:
            session.flagged = False
            self._end_session(session)
            raise self._failed(exc) from exc
        if flag == _TAKE_FLAG and row is None:
            session.flagged = True
        return row

    @asynccontextmanager
    async def _permit_waiter(self, channel: str) -> AsyncIterator[WakeSlot]:
        """A wake-up slot woken by the semaphore's release NOTIFYs (one waiter per NOTIFY
        in this process), subscribed before it is yielded."""
        key = ("permit", channel)
        slot = self._hub.register(key)
        try:
            async with self._relayed(channel, key):
                yield slot
        finally:
            self._hub.unregister(slot)

    def _acquire_args(
        self,
        sql: _Statements,
        session: _Session,
        value: str,
        *,
        configure: bool,
        mode: str,
        wait: float | None,
        began: float,
    ) -> tuple[list[object], float]:
        """The parameters of an acquire statement (see :class:`_Statements`), and how long
        to wait for its answer."""
        if mode == _TRY:
            bound = str(TRY_FENCE_WAIT_MS)
        else:
            left = None if wait is None else wait - (self.clock.now() - began)
            if left is None or left * 1000 > _MAX_TIMEOUT_MS:
                # No server-side limit: lock_timeout stops at INT_MAX ms (24.8 days), and a
                # longer wait ends by the caller's own deadline instead.
                bound = "0"
            else:
                bound = str(max(1, math.ceil(left * 1000)))
        tail, settings = _session_args(sql, session, value, configure)
        args: list[object] = [session.key, tail, *fence_ids(session.key), bound, *settings]
        return args, self._within(bound)

    def _within(self, lock_timeout_ms: str) -> float:
        """How long to wait for the answer to a statement that may wait this long (a
        ``lock_timeout`` in ms; "0": no limit) for a lock on the server."""
        if lock_timeout_ms == "0":
            return _NO_BOUND
        return int(lock_timeout_ms) / 1000 + self._request_timeout

    def _failed(self, exc: BaseException) -> BackendError:
        """The BackendError for a driver error ``exc`` (chain it)."""
        if isinstance(exc, TimeoutError):
            return _unanswered(self._where, self._request_timeout)
        return BackendError(f"{self._where}: {exc}")

    async def extend(self, claim: Claim, ttl: float) -> bool:
        session = claim.handle
        if not isinstance(session, _Session) or session.done:
            return False
        sql = self._sql or await self._statements()
        ttl_ms = math.ceil(ttl * 1000)
        owner = _owner(claim.value)
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
                shown = _shown(_owner(claim.value), ttl_ms)
                name = f"{_APP_PREFIX}{session.fence}:{ttl_ms}:{shown}"
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
                    self._end_session(session)
                    self._hold_ended(claim)
                    raise self._failed(exc) from exc
                if _gone(exc):
                    self._end_session(session)
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
        if not isinstance(session, _Session):
            return False
        within = self._request_timeout
        try:
            async with asyncio.timeout(within):
                return await self._release(session)
        except TimeoutError:
            # No answer: a silent server, or a statement stuck on the session. The unlock
            # may or may not have run; ending the session ends its locks either way (the
            # server frees them as it sees the connection close, at the latest after the
            # session's idle_session_timeout). The caller hears of a failed release.
            self._end_session(session)
            raise BackendError(
                f"{self._where}: release not answered within {within:g} s (the request "
                "timeout); its session was closed, which gives the lock back"
            ) from None

    async def _release(self, session: _Session) -> bool:
        sql = self._sql or await self._statements()
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
            try:
                # Bounded by release() (with the wait for the session's lock); the timeout
                # here only keeps a pool's command_timeout out.
                unlocked = await session.conn.raw.fetchval(statement, *args, timeout=_NO_BOUND)
            except asyncio.CancelledError:
                # The statement may or may not have run; asyncpg cancels it on the server
                # and the connection stays usable. The caller's clean-up calls again.
                session.interrupted = True
                raise
            except _DRIVER_ERRORS as exc:
                self._end_session(session)
                if _gone(exc):
                    return False  # the session, and its lock, were already gone
                raise self._failed(exc) from exc
            # Only this live session could have unlocked its own lock: after an interrupted
            # release, "not held" means the interrupted statement did it.
            session.released = bool(unlocked) or session.interrupted
            await self._checkin(session)
            return session.released

    async def inspect(self, name: str) -> LockInfo | None:
        sql = await self._statements()
        classid, objid = lock_ids(advisory_key(name, self._namespace))
        with self._errors:
            async with self._borrowed() as conn:
                rows = await conn.fetch(sql.inspect, classid, objid, timeout=self._request_timeout)
                best: LockInfo | None = None
                for row in rows:
                    info = _holder_info(name, row)
                    # The newest fence; ours before a foreign holder (also fence 0) when
                    # ours has no fence yet (granted, fence step still running).
                    rank = (info.fence, math.isfinite(info.expires_in))
                    if best is None or rank > (best.fence, math.isfinite(best.expires_in)):
                        best = info
                if (
                    best is not None
                    and math.isfinite(best.expires_in)  # ours, not a foreign name
                    and best.owner.startswith(_DIGEST_MARK)
                ):
                    best = await self._identified(conn, best)
        return best

    async def _identified(self, conn: Any, info: LockInfo) -> LockInfo:
        """``info`` with the identity its digest stands for (see :func:`_inline`).

        Looked up in this backend's identity table, else in the identity table of every
        other schema the role may read: the holder's coordinator may use another
        ``schema``. ``info`` as it is if no table has the row (it was deleted), the start
        of the digest names two identities, or it is too short to name one.
        """
        shown = info.owner[len(_DIGEST_MARK) :]
        if len(shown) < _MIN_DIGEST_CHARS:
            return info
        within = self._request_timeout
        lookup = "SELECT identity FROM {} WHERE left(digest, $2) = $1"
        try:
            rows = await conn.fetch(
                f"{lookup.format(self._identities)} LIMIT 2", shown, len(shown), timeout=within
            )
        except asyncpg.exceptions.UndefinedTableError:
            rows = []
        if not rows:
            tables = await conn.fetch(
                _IDENTITY_TABLES, IDENTITY_TABLE, self._schema, timeout=within
            )
            if tables:
                # UNION: one identity stored under several schemas is one row.
                union = " UNION ".join(
                    lookup.format(f"{quote_ident(row['schema'])}.{quote_ident(IDENTITY_TABLE)}")
                    for row in tables
                )
                try:
                    rows = await conn.fetch(f"{union} LIMIT 2", shown, len(shown), timeout=within)
                except asyncpg.PostgresError:
                    return info  # a table of that name that is not ours
        if len(rows) != 1:
            return info
        return LockInfo(info.name, rows[0]["identity"], info.expires_in, info.fence)

    async def _register(self, identity: str, ttl_ms: int) -> None:
        """Store ``identity`` in the identity table if application_name cannot show it
        (once per identity and backend; the table is created on first need)."""
        if identity in self._registered or _inline(identity, ttl_ms):
            return
        insert = (
            f"INSERT INTO {self._identities} (digest, identity) VALUES ($1, $2) "
            "ON CONFLICT (digest) DO NOTHING"
        )
        within = self._request_timeout
        with self._errors:
            async with self._borrowed() as conn:
                try:
                    await conn.execute(insert, _digest(identity), identity, timeout=within)
                except asyncpg.exceptions.UndefinedTableError:
                    await ensure_identity_table(conn, self._schema, timeout=within)
                    await conn.execute(insert, _digest(identity), identity, timeout=within)
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

    def _topic_channel(self, topic: str) -> str:
        # NOTIFY channels are identifiers: at most 63 bytes, so a digest of the topic.
        digest = hashlib.sha256(self._key_prefix + topic.encode()).hexdigest()
        return f"asynclock_{digest[:40]}"

    async def publish(self, topic: str, message: str) -> None:
        await self._statements()
        with self._errors:
            async with self._borrowed() as conn:
                await conn.execute(
                    "SELECT pg_notify($1, $2)",
                    self._topic_channel(topic),
                    message,
                    timeout=self._request_timeout,
                )

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return self._listen(topic)

    @asynccontextmanager
    async def _listen(self, topic: str) -> AsyncIterator[Mailbox]:
        mailbox = Mailbox()
        async with self._subscribed(self._topic_channel(topic), mailbox):
            yield mailbox

    @asynccontextmanager
    async def _relayed(self, channel: str, key: tuple[str, str]) -> AsyncIterator[None]:
        """Permit waiters of this process share one relay per channel: a NOTIFY wakes
        one of them, not all (any of them can take the free permit)."""
        relay = self._relays.get(channel)
        if relay is None:
            relay = self._relays[channel] = _Relay(self._hub, key)
        relay.users += 1
        try:
            async with self._subscribed(channel, relay):
                yield
        finally:
            relay.users -= 1
            if relay.users == 0 and self._relays.get(channel) is relay:
                del self._relays[channel]

    @asynccontextmanager
    async def _subscribed(self, channel: str, sink: _Sink) -> AsyncIterator[None]:
        """``sink`` receives the channel's NOTIFY payloads while inside (LISTEN done by
        the time it is entered)."""
        await self._statements()
        if self._listen_lock is None:
            self._listen_lock = asyncio.Lock()
        async with self._listen_lock:
            listeners = self._listeners.setdefault(channel, {})
            listeners[sink] = listeners.get(sink, 0) + 1
            if len(listeners) == 1 and listeners[sink] == 1:
                try:
                    conn = await self._listening()
                    with self._errors:
                        await self._on_listening(conn, conn.add_listener(channel, self._on_notify))
                except BaseException:
                    del self._listeners[channel]
                    if not self._listeners:  # give the listening connection back
                        self._in_background(self._stop_if_unused())
                    raise
        try:
            yield
        finally:
            # Finished even if the caller is cancelled meanwhile: an UNLISTEN cut short
            # would strand the listening connection outside the pool.
            await asyncio.shield(self._in_background(self._unsubscribe(channel, sink)))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run ``work`` to its end whatever happens to the caller (aclose waits for it)."""
        return self._background.spawn(work, name="asynclock-pg-background")

    async def _stop_if_unused(self) -> None:
        assert self._listen_lock is not None
        async with self._listen_lock:
            if not self._listeners:
                await self._stop_listening()

    async def _unsubscribe(self, channel: str, sink: _Sink) -> None:
        assert self._listen_lock is not None
        async with self._listen_lock:
            listeners = self._listeners.get(channel, {})
            if listeners.get(sink, 0) > 1:
                listeners[sink] -= 1
            else:
                listeners.pop(sink, None)
            if not listeners:
                self._listeners.pop(channel, None)
                conn = self._listen_conn
                if conn is not None and not _unusable(conn):
                    with contextlib.suppress(*_DRIVER_ERRORS):
                        await self._on_listening(
                            conn, conn.remove_listener(channel, self._on_notify)
                        )
                if not self._listeners:
                    await self._stop_listening()

    async def _listening(self) -> Any:
        """The connection that LISTENs, taken out of the pool while anyone listens."""
        if self._listen_conn is None or _unusable(self._listen_conn):
            with self._errors:
                conn = await self._pool_acquire()
            conn.add_termination_listener(self._on_listen_lost)
            self._listen_conn = conn
        return self._listen_conn

    async def _on_listening(self, conn: Any, step: Awaitable[None]) -> None:
        """``step`` (a LISTEN or UNLISTEN on the listening connection ``conn``) within the
        request timeout. Interrupted or unanswered, the connection is closed: listeners
        then look again and listen on another one (:meth:`_on_listen_lost`)."""
        try:
            async with asyncio.timeout(self._request_timeout):
                await step
        except BaseException as exc:
            if not _answered(exc, conn):
                self._terminate(conn)
            raise

    async def _stop_listening(
        self, channels: Iterable[str] = (), within: float | None = None
    ) -> None:
        """Give the listening connection back to the pool, after UNLISTEN (of ``channels``
        first: asyncpg's own record of them, which it warns about on release); closed
        instead if that is interrupted or not answered within ``within`` (default: the
        request timeout)."""
        conn, self._listen_conn = self._listen_conn, None
        if conn is None:
            return
        within = self._request_timeout if within is None else within
        with contextlib.suppress(Exception):
            conn.remove_termination_listener(self._on_listen_lost)
        try:
            async with asyncio.timeout(within):
                for channel in channels:
                    await conn.remove_listener(channel, self._on_notify)
                await conn.execute("UNLISTEN *")
        except BaseException as exc:
            self._terminate(conn)
            if not isinstance(exc, Exception):
                raise  # a cancel stays a cancel
            return
        await self._give_back(conn, within)

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
        # One relistening task at a time: its own failures (a LISTEN unanswered closes
        # the connection, which lands here again) are retried by its loop.
        if self._listeners and not self._closing and not self._relistening:
            self._relistening = True
            self._background.spawn(self._relisten(), name="asynclock-pg-relisten")

    async def _relisten(self) -> None:
        try:
            await self._listen_again()
        finally:
            self._relistening = False

    async def _listen_again(self) -> None:
        backoff = Backoff(initial=0.05, maximum=2.0)
        for attempt in range(1_000_000):
            if self._closing or not self._listeners:
                return
            try:
                assert self._listen_lock is not None
                async with self._listen_lock:
                    conn = await self._listening()
                    for channel in self._listeners:
                        await self._on_listening(conn, conn.add_listener(channel, self._on_notify))
            except (BackendError, *_DRIVER_ERRORS):
                await asyncio.sleep(backoff.delay(attempt))
                continue
            for mailboxes in self._listeners.values():
                for mailbox in mailboxes:
                    mailbox.put("")
            return

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

        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        sessions = list(self._sessions)
        for session in sessions:
            self._let_go(session)
        await self._end_server_sessions(sessions, left())
        for session in sessions:
            self._end_session(session)
        idle, self._idle = self._idle, []
        channels = list(self._listeners)
        self._listeners.clear()
        within = left()
        await asyncio.gather(
            *(self._to_pool(conn, within) for conn in idle),
            self._stop_listening(channels, within),
        )
        await self._background.close(max(0.0, deadline - loop.time()))
        if self._owns_pool and self._pool_started:
            try:
                # Each connection says goodbye and waits for the server to hang up.
                async with asyncio.timeout(left()):
                    await self._pool.close()
            except TimeoutError:
                self._pool.terminate()

    async def _end_server_sessions(self, sessions: list[_Session], within: float) -> None:
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
            async with asyncio.timeout(within), self._borrowed() as conn:
                await conn.fetchval(sql.end_sessions, *args, timeout=_NO_BOUND)

    def describe(self) -> str:
        return f"PostgresBackend {self._where[len('PostgreSQL ') :]} namespace={self._namespace!r}"

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        """The asyncpg pool in use (:meth:`from_dsn`: made at the first use, in its
        event loop; before that, a pool that is never started)."""
        return self._pool

    def key(self, name: str) -> int:
        """The advisory-lock key of ``name`` in this backend's namespace."""
        return advisory_key(name, self._namespace)

    # -- connections -----------------------------------------------------------------

    async def _pool_acquire(self) -> Any:
        """A connection from the pool for work that is not a lease's (setup, inspect,
        publish, LISTEN), within ``pool_timeout``: every held lease (and every acquire
        waiting in the server's queue) pins a connection, and an exhausted pool must not
        hang these calls forever."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            return await self._pool.acquire(timeout=self._pool_timeout)
        except TimeoutError as exc:
            if loop.time() - began < self._pool_timeout:
                # Before our bound: the connect timeout of a new connection.
                raise BackendError(
                    f"{self._where}: a new connection was not answered in time"
                ) from exc
            raise BackendError(
                f"{self._where}: no free connection in the pool within "
                f"{self._pool_timeout:g}s (pool size {self._pool.get_max_size()}; "
                f"{len(self._sessions)} pinned by leases and waiting acquires of this "
                "backend): raise max_connections, or hold fewer leases at once"
            ) from None

    @asynccontextmanager
    async def _borrowed(self) -> AsyncIterator[Any]:
        """A connection for one short statement: one kept idle between leases if there is
        one (it is ours, and counts against the pool's size), else one from the pool
        (:meth:`_pool_acquire`). A kept one goes back to the kept ones unless the
        statement failed (then to the pool, reset). A statement interrupted (cancelled,
        unanswered in time) leaves its connection closed at once: giving it back would
        wait on the server, and a cancel must end the caller as a cancel."""
        while self._idle:
            kept = self._idle.pop()
            if kept.raw.is_closed():
                self._terminate(kept.proxy)
                continue
            try:
                yield kept.raw
            except BaseException as exc:
                if _answered(exc, kept.raw):
                    self._background.spawn(self._to_pool(kept), name="asynclock-pg-to-pool")
                else:
                    self._terminate(kept.proxy)
                raise
            if self._closing:
                await self._to_pool(kept)
            else:
                self._idle.append(kept)  # keeps its idle_since: the sweeper still applies
            return
        proxy = await self._pool_acquire()
        try:
            yield proxy
        except BaseException as exc:
            if not _answered(exc, proxy):
                self._terminate(proxy)
                raise
            await self._give_back(proxy)
            raise
        await self._give_back(proxy)

    async def _checkout(self, wait: float | None, *, prefer_kept: bool) -> _Conn | None:
        """A kept connection, or one from the pool within ``wait`` (None: no bound)."""
        if self._closing:
            raise BackendError(f"{self._where}: the backend was closed")
        while prefer_kept and self._idle:
            conn = self._idle.pop()
            if not conn.raw.is_closed():
                return conn
            self._terminate(conn.proxy)
        pool = self._pool
        try:
            if wait == 0:
                if pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size():
                    return None  # try once: an exhausted pool is as good as a held lock
                # Room for a connection: a new one to a server that does not answer must
                # not hold the try forever.
                return _Conn(await self._pool_acquire())
            try:
                return _Conn(await pool.acquire(timeout=wait))
            except TimeoutError as exc:
                if wait is None:  # no bound of ours: the new connection's connect timeout
                    raise BackendError(f"{self._where}: no answer to a new connection") from exc
                return None  # no connection within the caller's timeout
        except _DRIVER_ERRORS as exc:
            raise BackendError(f"{self._where}: {exc}") from exc

    async def _checkin(self, session: _Session) -> None:
        """The session is over and its connection clean: keep it, or give it back."""
        session.done = True
        self._sessions.discard(session)
        self._unwatch(session)
        pool = self._pool
        # Kept only while the pool has room: when it is exhausted, someone may be queued
        # in pool.acquire(), which never looks at connections kept here.
        room = pool.get_idle_size() > 0 or pool.get_size() < pool.get_max_size()
        if room and len(self._idle) < self._keep and not self._closing:
            conn = session.conn
            loop = asyncio.get_running_loop()
            conn.idle_since = loop.time()
            self._idle.append(conn)
            if self._sweeper is None:
                self._sweeper = loop.call_later(_KEEP_IDLE, self._sweep_idle)
        else:
            await self._to_pool(session.conn)

    def _sweep_idle(self) -> None:
        """Give connections kept idle for ``_KEEP_IDLE`` back to the pool: the pool may
        have filled up since (the application's own acquires, inspect(), a queued
        acquire), and pool.acquire() never looks at connections kept here."""
        self._sweeper = None
        if self._closing:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        stale = [conn for conn in self._idle if now - conn.idle_since >= _KEEP_IDLE]
        if stale:
            self._idle = [conn for conn in self._idle if now - conn.idle_since < _KEEP_IDLE]
            for conn in stale:
                self._background.spawn(self._to_pool(conn), name="asynclock-pg-to-pool")
        if self._idle:
            first = min(conn.idle_since for conn in self._idle)
            self._sweeper = loop.call_later(max(first + _KEEP_IDLE - now, 0.01), self._sweep_idle)

    async def _to_pool(self, conn: _Conn, within: float | None = None) -> None:
        """Reset what asynclock may have changed and return the connection to the pool;
        closed instead if that is interrupted or not answered within ``within`` seconds
        (default: the request timeout)."""
        within = self._request_timeout if within is None else within
        try:
            await conn.raw.execute(
                self._sql.reset if self._sql is not None else _RESET, timeout=within
            )
        except BaseException as exc:
            self._terminate(conn.proxy)
            if not isinstance(exc, Exception):
                raise  # a cancel stays a cancel
        else:
            await self._give_back(conn.proxy, within)

    async def _give_back(self, proxy: Any, within: float | None = None) -> None:
        """Return a connection whose last statement was answered to the pool. The pool
        resets it on the server (an application's pool: ``RESET ALL`` and more), so that
        is bounded too: asyncpg closes a connection whose reset is not answered within
        ``within`` seconds (default: the request timeout)."""
        within = self._request_timeout if within is None else within
        with contextlib.suppress(Exception):
            await self._pool.release(proxy, timeout=within)

    def _open_session(
        self,
        claim: Claim,
        conn: _Conn,
        key: int,
        ttl_ms: int,
        permit: _Permit | None = None,
    ) -> _Session:
        """A session for ``claim`` on ``conn``, watched for the connection's end."""
        session = _Session(conn, key, claim.shared, ttl_ms, permit)
        self._sessions.add(session)
        claim.ended = False  # a new session: an earlier one's end is no news for it

        def closed(raw: object) -> None:
            self._session_died(session, claim)

        session.on_close = closed
        with contextlib.suppress(Exception):
            conn.raw.add_termination_listener(closed)
        return session

    def _unwatch(self, session: _Session) -> None:
        on_close, session.on_close = session.on_close, None
        if on_close is not None:
            with contextlib.suppress(Exception):
                session.conn.raw.remove_termination_listener(on_close)

    def _session_died(self, session: _Session, claim: Claim) -> None:
        """asyncpg saw the session's connection end (pg_terminate_backend, a server
        restart, a network error) while a claim used it: its advisory locks ended with it
        on the server, and another client may hold the name already. Tell the coordinator
        now, rather than at the lease's next renewal (up to ttl/3 later)."""
        if session.done:
            return  # ended by us, or given back
        self._end_session(session)
        self._hold_ended(claim)

    async def _unlock_all(self, session: _Session) -> bool:
        """Drop every advisory lock of ``session`` after a statement on it failed without
        ending it; True if done, False if the session had to be ended instead (its locks
        went with it). A session belongs to one claim: it holds nothing of anyone else's.

        Cancelled: the session stays on the claim, whose clean-up releases the claim's
        lock (or, for a permit, every lock of the session)."""
        sql = self._sql
        assert sql is not None
        try:
            await session.conn.raw.fetchval(sql.unflag, timeout=self._request_timeout)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._end_session(session)
            return False
        return True

    def _let_go(self, session: _Session) -> None:
        """The session is ours no more: its slot is free and its end is no news."""
        session.done = True
        self._sessions.discard(session)
        self._unwatch(session)

    def _end_session(self, session: _Session) -> None:
        """Close the session's connection at once (its locks end with the session) and
        free the slot."""
        self._let_go(session)
        if session.gone:
            return
        session.gone = True
        self._terminate(session.conn.proxy)

    def _terminate(self, proxy: Any) -> None:
        """Close a connection without a word to the server (which ends the session as it
        reads the closed socket); asyncpg frees its pool slot."""
        with contextlib.suppress(Exception):
            proxy.terminate()


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


class _Sink(Protocol):
    def put(self, message: str) -> None: ...


class _Relay:
    """Turns a semaphore's NOTIFYs into wake-ups of its waiters in this process."""

    __slots__ = ("hub", "key", "users")

    def __init__(self, hub: WakeHub, key: tuple[str, str]) -> None:
        self.hub = hub
        self.key = key
        self.users = 0

    def put(self, message: str) -> None:
        if message:
            self.hub.notify_one(self.key)  # one permit came free
        else:
            self.hub.notify_all(self.key)  # the LISTEN connection was lost: look again


def _session_args(
    sql: _Statements, session: _Session, value: str, configure: bool
) -> tuple[str, list[object]]:
    """The application_name tail of a granted session, and the parameters of its other
    settings: idle timeout, keepalives (first lease on the connection)."""
    ttl_ms = session.ttl_ms
    settings: list[object] = []
    if sql.has_idle_timeout:
        settings.append(str(ttl_ms))
    if configure:
        seconds = max(1, ttl_ms // 3000)
        settings += (str(seconds), str(max(1, seconds // 3)))
    return f"{ttl_ms}:{_shown(_owner(value), ttl_ms)}", settings


def _owner(value: str) -> str:
    """The identity part of a claim's ``token:identity`` value."""
    return value.partition(":")[2]


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
_DIGEST_MARK = "#"
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


def _inline(identity: str, ttl_ms: int) -> bool:
    """Whether ``identity`` survives in application_name as itself (see above)."""
    size = len(_APP_PREFIX) + _FENCE_DIGITS + len(str(ttl_ms)) + 2 + len(identity)
    return (
        size <= _APP_NAME_BYTES
        and identity.isascii()
        and identity.isprintable()
        and not identity.startswith(_DIGEST_MARK)
    )


def _digest(identity: str) -> str:
    """The key of ``identity`` in the identity table (128 bits of SHA-256, hex)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:_DIGEST_CHARS]


def _shown(identity: str, ttl_ms: int) -> str:
    """What application_name carries for ``identity``: itself, or its digest form."""
    if _inline(identity, ttl_ms):
        return identity
    room = _APP_NAME_BYTES - len(_APP_PREFIX) - _FENCE_DIGITS - len(str(ttl_ms)) - 2
    chars = max(_MIN_DIGEST_CHARS, min(_DIGEST_CHARS, room - len(_DIGEST_MARK)))
    return _DIGEST_MARK + _digest(identity)[:chars]


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
