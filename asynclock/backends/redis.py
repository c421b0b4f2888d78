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
    expires ``fence_retention`` seconds after the last acquisition (fences then continue
    from the server's clock in microseconds; see the README).
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
    and uses them directly, one command at a time each. Past that, it takes more from the
    pool, which still bounds the total (a blocking pool makes extra callers queue), and
    gives back what it cannot keep. No retries happen here: redis-py disconnects a
    connection on any error or cancellation, and the next command reconnects it.
    """

    __slots__ = ("_idle", "_keep", "_pool")

    def __init__(self, pool: ConnectionPool, keep: int = 16) -> None:
        self._pool = pool
        self._keep = keep
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
        await self._subscriber.unsubscribe(self._channel)


class _Subscriber:
    """The coordinator's one pub/sub connection.

    Channels are reference-counted: the first waiter on a name sends ``SUBSCRIBE`` and
    waits for the server's confirmation (so its next attempt cannot miss a release), the
    last one to leave sends ``UNSUBSCRIBE``. A reader task dispatches messages to the
    hub. If the connection drops, every waiter is woken (messages may have been lost),
    and the reader reconnects with backoff, subscribes again and wakes everyone once more
    when the server confirmed.
    """

    def __init__(self, pool: ConnectionPool, hub: WakeHub, where: str) -> None:
        self._pool = pool
        self._hub = hub
        self._where = where
        self._timeout = float(pool.connection_kwargs.get("socket_timeout") or 5.0)
        self._refs: dict[str, int] = {}
        self._ready: dict[str, asyncio.Future[None]] = {}
        # SUBSCRIBE commands sent per channel and not yet confirmed. Kept apart from
        # ``_refs`` because a channel can be dropped and re-added before the server
        # answered the first SUBSCRIBE: only the last confirmation means "subscribed".
        self._unconfirmed: dict[str, int] = {}
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
                elif self._reader is None or self._reader.done():
                    self._start_reader(reconnect=False)
            async with asyncio.timeout(self._timeout):
                await asyncio.shield(self._ready[channel])
        except BaseException as exc:
            await self.unsubscribe(channel)
            if isinstance(exc, TimeoutError):
                # An unanswered SUBSCRIBE: the connection is not trustworthy; start over.
                self._restart(exc)
                raise BackendError(
                    f"{self._where}: no confirmation of SUBSCRIBE within {self._timeout:g}s"
                ) from exc
            raise

    async def unsubscribe(self, channel: str) -> None:
        refs = self._refs.get(channel, 0) - 1
        if refs > 0:
            self._refs[channel] = refs
            return
        self._refs.pop(channel, None)
        ready = self._ready.pop(channel, None)
        if ready is not None and not ready.done():
            ready.cancel()
        if self._conn is not None:
            # A failed write breaks the connection; the reader then reconnects.
            with contextlib.suppress(BackendError):
                await self._send("UNSUBSCRIBE", channel)

    async def _send(self, command: str, *channels: str) -> None:
        conn = self._conn
        assert conn is not None
        if command == "SUBSCRIBE":
            for channel in channels:
                self._unconfirmed[channel] = self._unconfirmed.get(channel, 0) + 1
        with map_backend_errors(self._where, _DRIVER_ERRORS):
            await conn.send_command(command, *channels, check_health=False)

    def _start_reader(self, *, reconnect: bool) -> None:
        self._reader = asyncio.create_task(self._run(reconnect), name="asynclock-pubsub")

    def _restart(self, exc: BaseException) -> None:
        """Drop the connection (its reader with it) and start over if anyone still waits."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self._conn = None
        self._connection_lost(exc)
        if self._refs and not self._closed:
            self._start_reader(reconnect=True)

    async def _run(self, reconnect: bool) -> None:
        """Connect, subscribe what is wanted, dispatch; reconnect while anyone waits."""
        backoff = Backoff(initial=0.05, maximum=2.0)
        failures = 0
        while not self._closed and self._refs:
            kwargs = dict(self._pool.connection_kwargs)
            # Our own reads block as long as needed; RESP2 keeps pub/sub replies plain.
            kwargs.update(socket_timeout=None, protocol=2, health_check_interval=0)
            conn = self._pool.connection_class(**kwargs)
            try:
                with map_backend_errors(self._where, _DRIVER_ERRORS):
                    await conn.connect()  # type: ignore[no-untyped-call]
                self._conn = conn
                self._unconfirmed.clear()
                channels = list(self._refs)
                if channels:
                    await self._send("SUBSCRIBE", *channels)
                if reconnect:
                    # Everyone waiting may have missed a release while we were away: once
                    # the server confirmed the subscriptions (PING answers after them),
                    # wake them all to try again.
                    with map_backend_errors(self._where, _DRIVER_ERRORS):
                        await conn.send_command("PING", check_health=False)
                failures = 0
                while True:
                    with map_backend_errors(self._where, _DRIVER_ERRORS):
                        reply = await conn.read_response()
                    self._dispatch(reply)
            except BackendError as exc:
                lost = exc
            finally:
                if self._conn is conn:
                    self._conn = None
                await conn.disconnect(nowait=True)
            failures += 1
            reconnect = True
            self._connection_lost(lost)
            if self._closed or not self._refs:
                return
            logger.warning("pub/sub connection to %s lost (%s); reconnecting", self._where, lost)
            await asyncio.sleep(backoff.delay(failures - 1))

    def _connection_lost(self, exc: BaseException) -> None:
        self._unconfirmed.clear()
        for channel, ready in list(self._ready.items()):
            if not ready.done():
                ready.set_exception(BackendError(f"{self._where}: pub/sub failed: {exc}"))
                # Mark retrieved: the subscriber that owns it may have left already.
                ready.exception()
            self._ready[channel] = asyncio.get_running_loop().create_future()
        self._hub.notify_all()

    def _dispatch(self, reply: Any) -> None:
        kind = _text(reply[0])
        if kind == "message":
            self._hub.notify_one(_text(reply[1]))
        elif kind == "subscribe":
            channel = _text(reply[1])
            left = self._unconfirmed.get(channel, 0) - 1
            if left > 0:
                self._unconfirmed[channel] = left
                return
            self._unconfirmed.pop(channel, None)
            ready = self._ready.get(channel)
            if ready is not None and not ready.done():
                ready.set_result(None)
        elif kind == "pong":
            self._hub.notify_all()

    async def aclose(self) -> None:
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        for ready in self._ready.values():
            ready.cancel()
        self._ready.clear()
        self._refs.clear()
        self._hub.notify_all()
