"""The connections the backend takes out of the pool, and the sessions pinned on them.

A lease holds one connection for its whole life (a :class:`Session`): its advisory lock
belongs to that server session and ends with it. :class:`SessionPool` hands connections
out (kept idle between leases if the pool has room, else from the pool), takes them back
clean (reset, then returned to the pool) and ends them: a connection whose statement
was interrupted or unanswered, or whose session may hold a lock it should not, is
closed instead of being returned, since ending the session is what certainly releases
its locks. A connection that ends under a session is reported at once (``on_lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from ..._cancel import undo_on_interrupt
from ..._errors import BackendError
from ..._kind import SHARED
from ..._pgkeys import permit_fence_ids, permit_prefix, waiting_key
from ..._tasks import TaskSet
from ..base import Claim
from .errors import DRIVER_ERRORS, answered
from .holders import identity_of, shown
from .sql import RESET, Statements

__all__ = ("Conn", "Permit", "Session", "SessionPool", "session_args")

# How long a connection is kept out of the pool for the next lease after its last one
# (back-to-back leases skip the pool's checkout): then it goes back to the pool, where
# others may be queued.
_KEEP_IDLE = 1.0


class Conn:
    """A connection taken out of the pool; ``configured`` once its keepalives are set,
    ``unbounded`` once a try-before-wait set what a wait in the queue needs (both are
    session settings that last until the connection goes back to the pool, reset).

    ``raw`` is the asyncpg connection behind the pool's proxy: statements go to it
    directly while we hold it (the proxy's per-call indirection is measurable on a
    two-statement lease); the proxy is what goes back to the pool. ``watched``: the
    claim and session using it, if any, told by :attr:`on_close` when it ends (one
    termination listener for as long as we hold the connection, not one per lease:
    adding and removing one costs more than a lease's own bookkeeping).
    """

    __slots__ = ("configured", "idle_since", "on_close", "proxy", "raw", "unbounded", "watched")

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.raw = getattr(proxy, "_con", None) or proxy
        self.configured = False
        self.unbounded = False
        self.idle_since = 0.0  # when it was last kept idle (loop time)
        self.watched: tuple[Session, Claim] | None = None
        self.on_close: Callable[[object], None] | None = None


class Permit:
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


class Session:
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
        "permit",
        "pid",
        "released",
        "shared",
        "ttl_ms",
    )

    def __init__(
        self, conn: Conn, key: int, shared: bool, ttl_ms: int, permit: Permit | None = None
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

    def ended(self) -> bool:
        """True once the session was given back or terminated (re-read after awaits)."""
        return self.done


def session_args(
    sql: Statements, session: Session, value: str, configure: bool
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
    return f"{ttl_ms}:{shown(identity_of(value), ttl_ms)}", settings


class SessionPool:
    """The connections of one backend, from the application's (or our own) asyncpg pool.

    ``active``: the sessions between checkout and give-back (waiting, holding or
    releasing); ``idle``: clean connections kept out of the pool between leases, at most
    a quarter of the pool's ``max_size`` (1 to 8), each for ``_KEEP_IDLE`` seconds.
    ``statements`` is set once the server is known (its RESET text and ``unflag``);
    ``closing`` once the backend closes (nothing is kept any more). ``on_lost(claim)`` is
    called when a session's connection ends while its claim uses it. Work that must
    finish whatever happens to its caller runs in ``background``.
    """

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        where: str,
        pool_timeout: float,
        request_timeout: float,
        background: TaskSet,
        on_lost: Callable[[Claim], None],
    ) -> None:
        self.pool = pool
        self._where = where
        self._pool_timeout = pool_timeout
        self._request_timeout = request_timeout
        self._background = background
        self._on_lost = on_lost
        self.statements: Statements | None = None
        self.closing = False
        # Sessions between checkout and give-back: waiting, holding or releasing.
        self.active: set[Session] = set()
        # Clean connections kept out of the pool between leases.
        self.idle: list[Conn] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._keep = max(1, min(8, pool.get_max_size() // 4))

    def _room(self) -> bool:
        """True if ``pool.acquire()`` would not wait: an idle connection, or room for a
        new one (asyncpg's public counts; its private queue would say it faster)."""
        pool = self.pool
        return bool(pool.get_idle_size() > 0 or pool.get_size() < pool.get_max_size())

    def begin_closing(self) -> None:
        """The backend closes: no connection is kept idle any more, none is checked out."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def take_idle(self) -> list[Conn]:
        """The connections kept idle, no longer kept: for the caller to give back."""
        idle, self.idle = self.idle, []
        return idle

    async def pool_acquire(self) -> Any:
        """A connection from the pool for work that is not a lease's (setup, inspect,
        publish, LISTEN), within ``pool_timeout``: every held lease (and every acquire
        waiting in the server's queue) pins a connection, and an exhausted pool must not
        hang these calls forever."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            return await self.pool.acquire(timeout=self._pool_timeout)
        except TimeoutError as exc:
            if loop.time() - began < self._pool_timeout:
                # Before our bound: the connect timeout of a new connection.
                raise BackendError(
                    f"{self._where}: a new connection was not answered in time"
                ) from exc
            raise BackendError(
                f"{self._where}: no free connection in the pool within "
                f"{self._pool_timeout:g}s (pool size {self.pool.get_max_size()}; "
                f"{len(self.active)} pinned by leases and waiting acquires of this "
                "backend): raise max_connections, or hold fewer leases at once"
            ) from None

    @asynccontextmanager
    async def borrowed(self) -> AsyncIterator[Any]:
        """A connection for one short statement: one kept idle between leases if there is
        one (it is ours, and counts against the pool's size), else one from the pool
        (:meth:`pool_acquire`). A kept one goes back to the kept ones unless the
        statement failed (then to the pool, reset). A statement interrupted (cancelled,
        unanswered in time) leaves its connection closed at once: giving it back would
        wait on the server, and a cancel must end the caller as a cancel."""
        while self.idle:
            kept = self.idle.pop()
            if kept.raw.is_closed():
                self.terminate(kept.proxy)
                continue
            try:
                yield kept.raw
            except BaseException as exc:
                if answered(exc, kept.raw):
                    self._background.spawn(self.to_pool(kept), name="asynclock-pg-to-pool")
                else:
                    self.terminate(kept.proxy)
                raise
            if self.closing:
                await self.to_pool(kept)
            else:
                self.idle.append(kept)  # keeps its idle_since: the sweeper still applies
            return
        proxy = await self.pool_acquire()
        try:
            yield proxy
        except BaseException as exc:
            if not answered(exc, proxy):
                self.terminate(proxy)
                raise
            await self.give_back(proxy)
            raise
        await self.give_back(proxy)

    async def checkout(self, wait: float | None, *, prefer_kept: bool) -> Conn | None:
        """A kept connection, or one from the pool within ``wait`` (None: no bound)."""
        if self.closing:
            raise BackendError(f"{self._where}: the backend was closed")
        while prefer_kept and self.idle:
            conn = self.idle.pop()
            if not conn.raw.is_closed():
                return conn
            self.terminate(conn.proxy)
        pool = self.pool
        try:
            if wait == 0:
                if not self._room():
                    return None  # try once: an exhausted pool is as good as a held lock
                # Room for a connection: a new one to a server that does not answer must
                # not hold the try forever.
                return Conn(await self.pool_acquire())
            try:
                return Conn(await pool.acquire(timeout=wait))
            except TimeoutError as exc:
                if wait is None:  # no bound of ours: the new connection's connect timeout
                    raise BackendError(f"{self._where}: no answer to a new connection") from exc
                return None  # no connection within the caller's timeout
        except DRIVER_ERRORS as exc:
            raise BackendError(f"{self._where}: {exc}") from exc

    async def checkin(self, session: Session, within: float | None = None) -> None:
        """The session is over and its connection clean: keep it, or give it back (within
        ``within`` seconds, default the request timeout; see :meth:`to_pool`)."""
        session.done = True
        self.active.discard(session)
        self._unwatch(session)
        # Kept only while the pool has room: when it is exhausted, someone may be queued
        # in pool.acquire(), which never looks at connections kept here.
        if len(self.idle) < self._keep and not self.closing and self._room():
            conn = session.conn
            loop = asyncio.get_running_loop()
            conn.idle_since = loop.time()
            self.idle.append(conn)
            if self._sweeper is None:
                self._sweeper = loop.call_later(_KEEP_IDLE, self._sweep_idle)
        else:
            await self.to_pool(session.conn, within)

    def _sweep_idle(self) -> None:
        """Give connections kept idle for ``_KEEP_IDLE`` back to the pool: the pool may
        have filled up since (the application's own acquires, inspect(), a queued
        acquire), and pool.acquire() never looks at connections kept here."""
        self._sweeper = None
        if self.closing:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        stale = [conn for conn in self.idle if now - conn.idle_since >= _KEEP_IDLE]
        if stale:
            self.idle = [conn for conn in self.idle if now - conn.idle_since < _KEEP_IDLE]
            for conn in stale:
                self._background.spawn(self.to_pool(conn), name="asynclock-pg-to-pool")
        if self.idle:
            first = min(conn.idle_since for conn in self.idle)
            self._sweeper = loop.call_later(max(first + _KEEP_IDLE - now, 0.01), self._sweep_idle)

    async def to_pool(self, conn: Conn, within: float | None = None) -> None:
        """Reset what asynclock may have changed and return the connection to the pool;
        closed instead if that is interrupted or not answered within ``within`` seconds
        (default: the request timeout)."""
        within = self._request_timeout if within is None else within
        self._forget(conn)
        try:
            with undo_on_interrupt(self.terminate, conn.proxy):
                await conn.raw.execute(
                    self.statements.reset if self.statements is not None else RESET,
                    timeout=within,
                )
        except Exception:
            return  # closed instead (a cancel stays a cancel)
        await self.give_back(conn.proxy, within)

    async def give_back(self, proxy: Any, within: float | None = None) -> None:
        """Return a connection whose last statement was answered to the pool. The pool
        resets it on the server (an application's pool: ``RESET ALL`` and more), so that
        is bounded too: asyncpg closes a connection whose reset is not answered within
        ``within`` seconds (default: the request timeout)."""
        within = self._request_timeout if within is None else within
        with contextlib.suppress(Exception):
            await self.pool.release(proxy, timeout=within)

    def open_session(
        self,
        claim: Claim,
        conn: Conn,
        key: int,
        ttl_ms: int,
        permit: Permit | None = None,
    ) -> Session:
        """A session for ``claim`` on ``conn``, watched for the connection's end."""
        session = Session(conn, key, claim.kind is SHARED, ttl_ms, permit)
        self.active.add(session)
        claim.ended = False  # a new session: an earlier one's end is no news for it
        conn.watched = (session, claim)
        if conn.on_close is None:

            def closed(raw: object) -> None:
                watched, conn.watched = conn.watched, None
                if watched is not None:
                    self._died(*watched)

            conn.on_close = closed
            with contextlib.suppress(Exception):
                conn.raw.add_termination_listener(closed)
        return session

    def _unwatch(self, session: Session) -> None:
        conn = session.conn
        if conn.watched is not None and conn.watched[0] is session:
            conn.watched = None

    def _forget(self, conn: Conn) -> None:
        """Remove our termination listener from a connection that leaves us."""
        conn.watched = None
        on_close, conn.on_close = conn.on_close, None
        if on_close is not None:
            with contextlib.suppress(Exception):
                conn.raw.remove_termination_listener(on_close)

    def _died(self, session: Session, claim: Claim) -> None:
        """asyncpg saw the session's connection end (pg_terminate_backend, a server
        restart, a network error) while a claim used it: its advisory locks ended with it
        on the server, and another client may hold the name already. Tell the coordinator
        now, rather than at the lease's next renewal (up to ttl/3 later)."""
        if session.done:
            return  # ended by us, or given back
        self.end_session(session)
        self._on_lost(claim)

    async def unlock_all(self, session: Session) -> bool:
        """Drop every advisory lock of ``session`` after a statement on it failed without
        ending it; True if done, False if the session had to be ended instead (its locks
        went with it). A session belongs to one claim: it holds nothing of anyone else's.

        Cancelled: the session stays on the claim, whose clean-up releases the claim's
        lock (or, for a permit, every lock of the session)."""
        sql = self.statements
        assert sql is not None
        try:
            await session.conn.raw.fetchval(sql.unflag, timeout=self._request_timeout)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.end_session(session)
            return False
        return True

    def let_go(self, session: Session) -> None:
        """The session is ours no more: its slot is free and its end is no news."""
        session.done = True
        self.active.discard(session)
        self._unwatch(session)

    def end_session(self, session: Session) -> None:
        """Close the session's connection at once (its locks end with the session) and
        free the slot."""
        self.let_go(session)
        if session.gone:
            return
        session.gone = True
        self.terminate(session.conn.proxy)

    def terminate(self, proxy: Any) -> None:
        """Close a connection without a word to the server (which ends the session as it
        reads the closed socket); asyncpg frees its pool slot."""
        with contextlib.suppress(Exception):
            proxy.terminate()
