"""One Redis or Valkey node, through redis.asyncio (hiredis parser when installed).

Every state change is one Lua script from :mod:`._scripts`. Waiters sleep on a per-name
pub/sub channel that the release script publishes to; all waiters of a coordinator share
one pub/sub connection (:class:`_Subscriber`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from .._backoff import Backoff
from .._clock import Clock
from .._errors import BackendError, map_backend_errors
from .._validate import check_number
from .._wakeup import WakeHub, WakeSlot
from . import _scripts
from .base import Attempt, Backend, Claim, LockInfo, owner_of

__all__ = ("RedisBackend",)

logger = logging.getLogger("asynclock.redis")

_DRIVER_ERRORS = (RedisError, OSError)
# The watchdog's batch goes out in chunks: one script call must not block the server long.
_EXTEND_CHUNK = 512


def describe_pool(pool: ConnectionPool) -> str:
    """``host:port/db`` or the socket path of a pool, never its credentials."""
    kw = pool.connection_kwargs
    if "path" in kw:
        where = f"unix://{kw['path']}"
    else:
        where = f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
    return f"{where}/{kw.get('db', 0)}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisBackend(Backend):
    """Locks on one Redis/Valkey node.

    ``client`` is a ``redis.asyncio.Redis`` the application owns: it is not closed by
    ``aclose()``. Keys are ``{prefix}:{{name}}`` (the lock), ``{prefix}:{{name}}:fence``
    (the fence counter) and the channel ``{prefix}:{{name}}:wake``. The fence counter
    expires ``fence_retention`` seconds (at least 2 ttl) after the lock was last taken or
    renewed; fences then continue from the server's clock in microseconds (README).
    """

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = "asynclock",
        fence_retention: float = 3600.0,
        clock: Clock | None = None,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> None:
        super().__init__(clock=clock, drift_factor=drift_factor, drift_base=drift_base)
        if not isinstance(client, Redis):
            raise TypeError(f"client must be a redis.asyncio.Redis, got {type(client).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be non-empty and free of '{{' and '}}', got {prefix!r}")
        self._client = client
        self._link = _Link(client.connection_pool)
        self._prefix = prefix
        self._retention_ms = math.ceil(
            check_number("fence_retention", fence_retention, positive=True) * 1000
        )
        self._owns_client = False
        self._where = f"Redis {describe_pool(client.connection_pool)}"
        self._errors = map_backend_errors(self._where, _DRIVER_ERRORS)
        self._hub = WakeHub()
        self._subscriber = _Subscriber(client.connection_pool, self._hub, self._where)

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 64, **options: Any) -> RedisBackend:
        """A backend on a client of its own (closed by ``aclose()``) with a blocking pool.

        Under load, extra concurrent operations queue for a free connection rather than
        fail. ``options`` not meant for :class:`RedisBackend` go to the connection pool.
        """
        own = {k: options.pop(k) for k in _BACKEND_OPTIONS if k in options}
        pool_options: dict[str, Any] = {
            "socket_connect_timeout": 5.0,
            "socket_timeout": 5.0,
            # Wait this long for a free connection of the bounded pool, then BackendError.
            "timeout": 5.0,
            # No retries inside redis-py: a release retried after a lost reply would report
            # "not owned" for a lock it did release. asynclock retries where it is safe.
            "retry": Retry(NoBackoff(), 0),
        }
        if not url.startswith("unix://"):
            pool_options["socket_keepalive"] = True
        pool_options.update(options)
        pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, **pool_options)
        # Builds a connection object without connecting: unknown options fail here, at the
        # call, rather than at the first lock.
        pool.make_connection()  # type: ignore[no-untyped-call]
        backend = cls(Redis.from_pool(pool), **own)
        backend._owns_client = True
        return backend

    # -- keys ------------------------------------------------------------------------

    def _keys(self, claim: Claim) -> tuple[str, str, str]:
        keys = claim.handle
        if keys is None:
            base = f"{self._prefix}:{{{claim.name}}}"
            keys = claim.handle = (base, f"{base}:fence", f"{base}:wake")
        return keys  # type: ignore[no-any-return]

    def channel(self, name: str) -> str:
        """The pub/sub channel that wakes waiters for ``name``."""
        return f"{self._prefix}:{{{name}}}:wake"

    # -- scripts ---------------------------------------------------------------------

    async def _eval(self, script: _scripts.Script, numkeys: int, *args: Any) -> Any:
        execute = self._link.execute
        with self._errors:
            try:
                return await execute("EVALSHA", script.sha, numkeys, *args)
            except NoScriptError:
                # After a restart or SCRIPT FLUSH: load it and try once more.
                logger.debug("script %s not loaded on %s; loading", script.name, self._where)
                await execute("SCRIPT", "LOAD", script.source)
                return await execute("EVALSHA", script.sha, numkeys, *args)

    # -- the Backend interface -------------------------------------------------------

    def _retention_for(self, ttl: float) -> int:
        """ms the fence counter outlives the lock's last use: never less than 2 ttl."""
        return max(self._retention_ms, math.ceil(ttl * 2000))

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        lock_key, fence_key, _ = self._keys(claim)
        reply = await self._eval(
            _scripts.ACQUIRE,
            2,
            lock_key,
            fence_key,
            claim.value,
            math.ceil(ttl * 1000),
            self._retention_for(ttl),
        )
        if reply > 0:
            return Attempt(int(reply))
        return Attempt(None, -reply / 1000 if reply < 0 else None)

    async def extend(self, claim: Claim, ttl: float) -> bool:
        lock_key, fence_key, _ = self._keys(claim)
        reply = await self._eval(
            _scripts.EXTEND,
            2,
            lock_key,
            fence_key,
            claim.value,
            math.ceil(ttl * 1000),
            self._retention_for(ttl),
        )
        return bool(reply == 1)

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        results: list[bool | None] = []
        for start in range(0, len(items), _EXTEND_CHUNK):
            chunk = items[start : start + _EXTEND_CHUNK]
            keys: list[str] = []
            args: list[Any] = []
            for claim, ttl in chunk:
                lock_key, fence_key, _ = self._keys(claim)
                keys += (lock_key, fence_key)
                args += (claim.value, math.ceil(ttl * 1000), self._retention_for(ttl))
            try:
                replies = await self._eval(_scripts.EXTEND_MANY, len(keys), *keys, *args)
            except BackendError as exc:
                logger.warning(
                    "renewal of %d leases failed on %s: %s", len(chunk), self._where, exc
                )
                results += [None] * len(chunk)
            else:
                results += [reply == 1 for reply in replies]
        return results

    async def release(self, claim: Claim) -> bool:
        lock_key, _, channel = self._keys(claim)
        reply = await self._eval(_scripts.RELEASE, 2, lock_key, channel, claim.value)
        return bool(reply == 1)

    async def inspect(self, name: str) -> LockInfo | None:
        base = f"{self._prefix}:{{{name}}}"
        reply = await self._eval(_scripts.INSPECT, 2, base, f"{base}:fence")
        if reply is None:
            return None
        value, pttl, fence = reply
        expires_in = math.inf if pttl < 0 else pttl / 1000
        return LockInfo(name, owner_of(_text(value)), expires_in, int(fence or 0))

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return _Waiter(self._hub, self._subscriber, self.channel(name))

    async def aclose(self) -> None:
        await self._subscriber.aclose()
        await self._link.aclose()
        if self._owns_client:
            await self._client.aclose()

    def describe(self) -> str:
        return f"RedisBackend {self._where[len('Redis ') :]} prefix={self._prefix!r}"

    # -- introspection for tests and stats -------------------------------------------

    @property
    def client(self) -> Redis:
        """The redis.asyncio client in use."""
        return self._client

    def waiting(self, name: str | None = None) -> int:
        """Tasks of this coordinator waiting for a wake-up (for ``name``, or all)."""
        return self._hub.waiting(None if name is None else self.channel(name))

    def subscribed(self) -> list[str]:
        """Channels the shared pub/sub connection is subscribed to (or subscribing)."""
        return self._subscriber.channels()


_BACKEND_OPTIONS = ("prefix", "fence_retention", "clock", "drift_factor", "drift_base")


class _Link:
    """A few connections kept out of the client's pool for the hot path.

    Going through ``Redis.execute_command`` costs a pool checkout and check-in per
    command (an asyncio lock, a condition for a blocking pool, bookkeeping): about as much
    as our whole script. The link keeps up to ``keep`` connections it took from the pool
    (at most a quarter of the pool's ``max_connections``) and uses them directly, one
    command at a time each. Past that, it takes more from the pool, which still bounds the
    total (a blocking pool makes extra callers queue), and gives back what it cannot keep.
    No retries happen here: redis-py disconnects a connection on any error or
    cancellation, and the next command reconnects it.
    """

    __slots__ = ("_idle", "_keep", "_pool")

    def __init__(self, pool: ConnectionPool, keep: int = 16) -> None:
        self._pool = pool
        # Never more than a quarter of a bounded pool: the application may share it.
        self._keep = min(keep, max(1, getattr(pool, "max_connections", keep) // 4))
        self._idle: list[AbstractConnection] = []

    async def execute(self, *args: Any) -> Any:
        idle = self._idle
        if idle:
            conn = idle.pop()
            reader = getattr(conn, "_reader", None)
            if reader is not None and reader.at_eof():
                # Closed by the server while idle (restart, timeout): reconnect first,
                # rather than fail one command on a dead socket.
                await conn.disconnect(nowait=True)
        else:
            conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await conn.send_command(*args, check_health=False)
            return await conn.read_response()
        finally:
            if len(idle) < self._keep:
                idle.append(conn)
            else:
                await self._pool.release(conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._pool.release(conn)


class _Waiter:
    """``backend.waiter(name)``: a hub slot, registered before subscribing."""

    __slots__ = ("_channel", "_hub", "_slot", "_subscriber")

    def __init__(self, hub: WakeHub, subscriber: _Subscriber, channel: str) -> None:
        self._hub = hub
        self._subscriber = subscriber
        self._channel = channel
        self._slot: WakeSlot | None = None

    async def __aenter__(self) -> WakeSlot:
        slot = self._slot = self._hub.register(self._channel)
        try:
            await self._subscriber.subscribe(self._channel)
        except BaseException:
            self._hub.unregister(slot)
            raise
        return slot

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._slot is not None
        self._hub.unregister(self._slot)
        # A waiter that gives up (cancelled, timed out) leaves only once the server has
        # dropped its subscription; one that got the lock does not wait for that.
        await self._subscriber.unsubscribe(self._channel, confirm=exc_type is not None)


class _Subscriber:
    """The coordinator's one pub/sub connection, and a reader task while anyone waits.

    Channels are reference-counted: the first waiter on a name sends ``SUBSCRIBE`` and
    waits for the server's confirmation (so its next attempt cannot miss a release), the
    last one to leave sends ``UNSUBSCRIBE``. The reader task dispatches messages to the
    hub and ends when the server confirms that nothing is subscribed any more; the
    connection stays open for the next waiter. If the connection drops, every waiter is
    woken (a release may have been missed), and the reader reconnects (with backoff after
    a failed connect), subscribes again and wakes everyone once more when the server has
    confirmed (a ``PING`` sent after the ``SUBSCRIBE`` answers after it).
    """

    def __init__(self, pool: ConnectionPool, hub: WakeHub, where: str) -> None:
        self._pool = pool
        self._hub = hub
        self._where = where
        self._timeout = float(pool.connection_kwargs.get("socket_timeout") or 5.0)
        self._refs: dict[str, int] = {}
        # Resolved when the server confirmed the channel's subscription.
        self._ready: dict[str, asyncio.Future[None]] = {}
        # SUBSCRIBE commands sent per channel and not yet confirmed. Kept apart from
        # ``_refs`` because a channel can be dropped and re-added before the server
        # answered the first SUBSCRIBE: only the last confirmation means "subscribed".
        self._unconfirmed: dict[str, int] = {}
        # One entry per UNSUBSCRIBE sent, in order; a future where someone waits for it.
        self._unsubscribing: dict[str, deque[asyncio.Future[None] | None]] = {}
        self._conn: AbstractConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    def channels(self) -> list[str]:
        return list(self._refs)

    async def subscribe(self, channel: str) -> None:
        if self._closed:
            raise BackendError(f"{self._where}: the coordinator is closed")
        refs = self._refs.get(channel, 0)
        self._refs[channel] = refs + 1
        try:
            if refs == 0:
                self._ready[channel] = asyncio.get_running_loop().create_future()
                if self._conn is not None:
                    await self._send("SUBSCRIBE", channel)
                if self._reader is None:
                    # It connects if needed and subscribes every wanted channel.
                    self._reader = asyncio.create_task(self._run(), name="asynclock-pubsub")
            async with asyncio.timeout(self._timeout):
                await asyncio.shield(self._ready[channel])
        except BaseException as exc:
            await self.unsubscribe(channel, confirm=False)
            if isinstance(exc, TimeoutError):
                # An unanswered SUBSCRIBE: the connection is not trustworthy; start over.
                self._restart(exc)
                raise BackendError(
                    f"{self._where}: no confirmation of SUBSCRIBE within {self._timeout:g}s"
                ) from exc
            raise

    async def unsubscribe(self, channel: str, *, confirm: bool) -> None:
        """Drop one reference; the last one unsubscribes (and waits for it if ``confirm``)."""
        refs = self._refs.get(channel, 0) - 1
        if refs > 0:
            self._refs[channel] = refs
            return
        self._refs.pop(channel, None)
        ready = self._ready.pop(channel, None)
        if ready is not None and not ready.done():
            ready.cancel()
        if self._conn is None:
            return
        done = asyncio.get_running_loop().create_future() if confirm else None
        self._unsubscribing.setdefault(channel, deque()).append(done)
        try:
            await self._send("UNSUBSCRIBE", channel)
        except BackendError:
            return  # the connection broke: nothing is subscribed on it any more
        if done is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout):
                    await asyncio.shield(done)

    async def _send(self, command: str, *channels: str) -> None:
        conn = self._conn
        assert conn is not None
        if command == "SUBSCRIBE":
            for channel in channels:
                self._unconfirmed[channel] = self._unconfirmed.get(channel, 0) + 1
        with map_backend_errors(self._where, _DRIVER_ERRORS):
            await conn.send_command(command, *channels, check_health=False)

    def _restart(self, exc: BaseException) -> None:
        """Drop the connection and its reader; start over if anyone still waits."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()  # redis-py closes the connection of a cancelled read
        conn, self._conn = self._conn, None
        if conn is not None and reader is None:
            _close_soon(conn)
        self._connection_lost(exc)
        if self._refs and not self._closed:
            self._reader = asyncio.create_task(self._run(resync=True), name="asynclock-pubsub")

    async def _run(self, *, resync: bool = False) -> None:
        """Connect if needed, subscribe what is wanted, dispatch until nothing is."""
        backoff = Backoff(initial=0.05, maximum=2.0)
        failed_connects = 0
        try:
            while not self._closed:
                conn = self._conn
                try:
                    if conn is None:
                        conn = await self._open(resync)
                    failed_connects = 0
                    await self._read(conn)
                except BackendError as exc:
                    if conn is not None and self._conn is conn:
                        # An open connection broke: reconnect at once.
                        self._conn = None
                        _close_soon(conn)
                        self._connection_lost(exc)
                        resync = True
                        logger.warning("pub/sub connection to %s lost (%s)", self._where, exc)
                    else:
                        failed_connects += 1
                        self._fail_waiting(exc)
                    if not self._refs:
                        return
                    if failed_connects:
                        await asyncio.sleep(backoff.delay(failed_connects - 1))
                else:
                    return  # nothing subscribed: keep the connection, end the task
        finally:
            if self._reader is asyncio.current_task():
                self._reader = None

    async def _open(self, resync: bool) -> AbstractConnection:
        """A new connection, subscribed to every wanted channel."""
        conn = await self._connect()
        self._conn = conn
        self._unconfirmed.clear()
        channels = list(self._refs)
        try:
            if channels:
                await self._send("SUBSCRIBE", *channels)
                if resync:
                    await self._send("PING")
        except BackendError:
            self._conn = None
            _close_soon(conn)
            raise
        return conn

    async def _read(self, conn: AbstractConnection) -> None:
        """Dispatch replies until the server says nothing is subscribed and nobody waits."""
        while True:
            with map_backend_errors(self._where, _DRIVER_ERRORS):
                reply = await conn.read_response()
            if self._dispatch(reply) and not self._refs:
                return

    async def _connect(self) -> AbstractConnection:
        kwargs = dict(self._pool.connection_kwargs)
        # Our own reads block as long as needed; RESP2 keeps pub/sub replies plain.
        kwargs.update(socket_timeout=None, protocol=2, health_check_interval=0)
        conn: AbstractConnection = self._pool.connection_class(**kwargs)
        with map_backend_errors(self._where, _DRIVER_ERRORS):
            await conn.connect()  # type: ignore[no-untyped-call]
        return conn

    def _connection_lost(self, exc: BaseException) -> None:
        """The connection is gone: nothing is subscribed any more, anyone may have missed
        a release. Pending subscriptions are re-sent by the reconnect."""
        self._unconfirmed.clear()
        for pending in self._unsubscribing.values():
            for done in pending:
                if done is not None and not done.done():
                    done.set_result(None)
        self._unsubscribing.clear()
        self._hub.notify_all()

    def _fail_waiting(self, exc: BaseException) -> None:
        """A connect failed: whoever waits for a subscription gets the error now."""
        error = BackendError(f"{self._where}: pub/sub connection failed: {exc}")
        loop = asyncio.get_running_loop()
        for channel, ready in list(self._ready.items()):
            if not ready.done():
                ready.set_exception(error)
                ready.exception()  # retrieved: its subscriber may have left already
                self._ready[channel] = loop.create_future()

    def _dispatch(self, reply: Any) -> bool:
        """Handle one reply; True when the server says nothing is subscribed any more."""
        kind = _text(reply[0])
        if kind == "message":
            self._hub.notify_one(_text(reply[1]))
        elif kind == "subscribe":
            channel = _text(reply[1])
            left = self._unconfirmed.get(channel, 0) - 1
            if left > 0:
                self._unconfirmed[channel] = left
            else:
                self._unconfirmed.pop(channel, None)
                ready = self._ready.get(channel)
                if ready is not None and not ready.done():
                    ready.set_result(None)
        elif kind == "unsubscribe":
            channel = _text(reply[1])
            pending = self._unsubscribing.get(channel)
            if pending:
                done = pending.popleft()
                if not pending:
                    del self._unsubscribing[channel]
                if done is not None and not done.done():
                    done.set_result(None)
            return int(reply[2]) == 0
        elif kind == "pong":
            self._hub.notify_all()
        return False

    async def aclose(self) -> None:
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect()
        for ready in self._ready.values():
            ready.cancel()
        self._ready.clear()
        self._refs.clear()
        self._connection_lost(BackendError(f"{self._where}: closed"))


def _close_soon(conn: AbstractConnection) -> None:
    """Close a broken connection without waiting for it (from sync code or a reader)."""
    task = asyncio.ensure_future(conn.disconnect(nowait=True))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
