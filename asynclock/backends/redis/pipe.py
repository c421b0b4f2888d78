"""A pipelined Redis connection: an ``asyncio.Protocol`` with a hiredis reader.

redis-py's asyncio client sends a command by checking a connection out of a pool,
packing it in Python, writing, and reading the reply through a ``StreamReader`` — several
awaits and allocations per command, about as much time as the Lua script it runs. For the
handful of commands asynclock sends per lock, one connection per node carries every
request in flight (requests are answered in order on a connection), replies are parsed in
``data_received`` and handed straight to whoever waits: one write and one wake-up per
command, and for Redlock one write per node and one wake-up per fan-out.

It serves plain TCP and Unix-socket connections, with AUTH and SELECT; anything else (TLS,
credential providers, Sentinel, Cluster) stays on redis-py's connections
(:func:`pipe_for`). A request that gets no answer within the socket timeout breaks the
connection it went out on: every request in flight on it fails, and the next one
reconnects (and is watched on its new connection in turn).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
from redis.asyncio.connection import Connection, ConnectionPool, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._cancel import CancelMark

__all__ = ("Callback", "Pipe", "StaleConnection", "pack", "pipe_for")

Callback = Callable[[Any], None]

# Connection options redis-py may carry that this connection does not implement: with any
# of them set, asynclock keeps using redis-py's own connections.
_UNSUPPORTED = ("credential_provider", "client_name", "ssl", "ssl_context", "redis_connect_func")


def pack(args: tuple[Any, ...]) -> bytes:
    """RESP for one command, packed in C by hiredis."""
    packed: bytes = hiredis.pack_command(args)
    return packed


class StaleConnection(RedisConnectionError):
    """The connection closed before any reply to requests sent on it while it was idle:
    typically the server had dropped it already (timeout, CLIENT KILL, restart), and the
    request is sent once more on a new connection. Every asynclock script gives the same
    answer when run twice with the same holder value, so sending again is safe."""


class _Protocol(asyncio.Protocol):
    """Requests go out in order; replies come back in order and settle them in turn.

    With a ``timeout``, the connection watches its own requests: when the oldest one has
    waited that long, the connection is aborted and everything in flight on it fails.
    One timer per connection, armed for the oldest request's deadline; a connection that
    is lost cancels its timer, and a new one arms its own.
    """

    def __init__(self, timeout: float | None = None, where: str = "the server") -> None:
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._pending: deque[Callback] = deque()
        self._sent: deque[float] = deque()
        self._transport: asyncio.Transport | None = None
        self._silent = False  # nothing received since a request went out on an idle line
        self._timeout = timeout
        self._where = where
        self._watch: asyncio.TimerHandle | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        self._silent = False
        pending = self._pending
        sent = self._sent
        while (reply := reader.gets()) is not False:
            if pending:
                sent.popleft()
                pending.popleft()(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or RedisConnectionError("connection closed by the server")
        if self._silent:
            stale = StaleConnection(f"connection closed before any reply: {self.lost}")
            self._fail(stale)
        else:
            self._fail(self.lost)

    def _fail(self, error: BaseException) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        pending, self._pending = self._pending, deque()
        self._sent.clear()
        for callback in pending:
            callback(error)

    @property
    def alive(self) -> bool:
        return self.lost is None and self._transport is not None

    def request(self, data: bytes, callback: Callback) -> None:
        """Send one packed command; ``callback`` gets its reply (an exception on error)."""
        assert self._transport is not None
        if self.lost is not None:
            # Lost after it was handed out (a connect shared by several callers resumes
            # them a loop turn later): nothing was sent, so it may be sent again.
            callback(StaleConnection(f"connection lost before the request was sent: {self.lost}"))
            return
        self._transport.write(data)
        if not self._pending:
            self._silent = True
        self._pending.append(callback)
        self._sent.append(time.monotonic())
        if self._watch is None and self._timeout is not None:
            self._arm(self._sent[0])

    def _arm(self, oldest: float) -> None:
        assert self._timeout is not None
        delay = max(0.0, oldest + self._timeout - time.monotonic())
        self._watch = asyncio.get_running_loop().call_later(delay, self._check)

    def _check(self) -> None:
        """At the oldest request's deadline: abort if it is still unanswered, else watch
        the request that is oldest now."""
        self._watch = None
        if not self._sent or not self.alive:
            return
        assert self._timeout is not None
        oldest = self._sent[0]
        if time.monotonic() - oldest >= self._timeout:
            self.abort(RedisTimeoutError(f"no reply from {self._where} within {self._timeout:g}s"))
        else:
            self._arm(oldest)

    def oldest(self) -> float | None:
        """When the oldest unanswered request was sent."""
        return self._sent[0] if self._sent else None

    def abort(self, error: BaseException) -> None:
        """Give up on this connection: fail what is in flight, close the socket."""
        if self.lost is None:
            self.lost = error
        self._fail(error)
        if self._transport is not None:
            self._transport.abort()


def _settle(fut: asyncio.Future[Any], reply: Any) -> None:
    if fut.done():
        return  # the caller gave up (cancelled, timed out)
    if isinstance(reply, BaseException):
        fut.set_exception(reply)
    else:
        fut.set_result(reply)


class Pipe:
    """One node's pipelined connection, connected on first use and after a loss."""

    def __init__(
        self,
        *,
        host: str = "localhost",
        port: int = 6379,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        connect_timeout: float | None = 5.0,
        timeout: float | None = 5.0,
    ) -> None:
        self._host = host
        self._port = port
        self._path = path
        self._username = username
        self._password = password
        self._db = db
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._proto: _Protocol | None = None
        # The connect on its way, shared by every caller that needs the connection
        # meanwhile: its failure is theirs, so no caller starts another after it.
        self._connecting: asyncio.Task[_Protocol] | None = None
        self._closed = False

    def ready(self) -> _Protocol | None:
        """The connected protocol, if there is one (no I/O)."""
        proto = self._proto
        return proto if proto is not None and proto.alive else None

    async def protocol(self) -> _Protocol:
        """The connected protocol, connecting first if needed.

        Callers that need a connection while one is being made wait for that one: they
        share its outcome, the error of a failed connect included, so every request ends
        within one connect timeout however many callers queue up (each starting its own
        connect after the one before it failed, the k-th waited k connect timeouts).
        """
        proto = self.ready()
        if proto is not None:
            return proto
        if self._closed:
            raise RedisConnectionError("the coordinator was closed")
        connecting = self._connecting
        if connecting is None:
            connecting = self._connecting = asyncio.ensure_future(self._connect())
            connecting.add_done_callback(self._connected)
        mark = CancelMark()
        try:
            # Shielded: a caller that gives up must not cancel the others' connect (it is
            # bounded by the connect timeout, and aclose() cancels it).
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            if connecting.cancelled() and not mark.rose():
                # aclose() stopped the connect: no cancel of this caller's.
                raise RedisConnectionError("the coordinator was closed") from None
            raise

    def _connected(self, connecting: asyncio.Task[_Protocol]) -> None:
        if self._connecting is connecting:
            self._connecting = None
        if connecting.cancelled():
            return
        error = connecting.exception()  # retrieved: every caller may have left meanwhile
        if error is not None:
            return
        proto = connecting.result()
        if self._closed:  # closed while connecting: this socket must not live on
            proto.abort(RedisConnectionError("the coordinator was closed"))
        else:
            self._proto = proto

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        where = self._where()

        def factory() -> _Protocol:
            return _Protocol(self._timeout, where)

        proto: _Protocol | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._path is not None:
                    _, proto = await loop.create_unix_connection(factory, self._path)
                else:
                    _, proto = await loop.create_connection(factory, self._host, self._port)
                await self._handshake(proto)
        except BaseException as exc:
            # Timed out, cancelled (Redlock cancels connects past node_timeout), refused or
            # failed handshake: a socket that was made must not outlive the attempt.
            if proto is not None:
                proto.abort(RedisConnectionError(f"connecting to {where} was abandoned"))
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"timed out connecting to {where}") from exc
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"error connecting to {where}: {exc}") from exc
            raise
        return proto

    async def _handshake(self, proto: _Protocol) -> None:
        commands: list[tuple[Any, ...]] = []
        if self._password is not None:
            if self._username:
                commands.append(("AUTH", self._username, self._password))
            else:
                commands.append(("AUTH", self._password))
        if self._db:
            commands.append(("SELECT", self._db))
        for command in commands:
            await self._send(proto, command)  # an error reply: _connect closes the socket

    async def _send(self, proto: _Protocol, args: tuple[Any, ...]) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        proto.request(pack(args), lambda reply: _settle(fut, reply))
        return await fut

    async def execute(self, *args: Any) -> Any:
        """One command; its reply, or the error (a ResponseError for an error reply).

        Sent once more on a new connection if the one it went out on turns out to have
        been dropped while idle (:class:`StaleConnection`).
        """
        proto = self.ready() or await self.protocol()
        sent = time.monotonic()
        try:
            return await self._send(proto, args)
        except StaleConnection:
            if self._timeout is None:
                return await self._send(await self.protocol(), args)
            # Sent once more, but still due by the first send's deadline: a request ends
            # within the socket timeout, not within two of them.
            try:
                async with asyncio.timeout(max(0.0, sent + self._timeout - time.monotonic())):
                    return await self._send(await self.protocol(), args)
            except TimeoutError as exc:
                raise RedisTimeoutError(
                    f"no reply from {self._where()} within {self._timeout:g}s"
                ) from exc

    def request(self, proto: _Protocol, data: bytes, callback: Callback) -> None:
        """Send packed ``data`` on ``proto`` (from :meth:`ready`); no waiting here."""
        proto.request(data, callback)

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` was called."""
        return self._closed

    async def aclose(self) -> None:
        self._closed = True
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()  # _connect() aborts a socket it made
            await asyncio.wait({connecting})
        proto, self._proto = self._proto, None
        if proto is not None:
            proto.abort(RedisConnectionError("the coordinator was closed"))

    def _where(self) -> str:
        return f"unix://{self._path}" if self._path else f"{self._host}:{self._port}"


def pipe_for(pool: ConnectionPool) -> Pipe | None:
    """A :class:`Pipe` with the pool's connection settings, or None when the pool needs
    something only redis-py's connections do (TLS, credential providers, …)."""
    kwargs = pool.connection_kwargs
    if pool.connection_class not in (Connection, UnixDomainSocketConnection):
        return None
    if any(kwargs.get(option) for option in _UNSUPPORTED):
        return None
    common: dict[str, Any] = {
        "username": kwargs.get("username"),
        "password": kwargs.get("password"),
        "db": int(kwargs.get("db") or 0),
        "connect_timeout": kwargs.get("socket_connect_timeout", 5.0),
        "timeout": kwargs.get("socket_timeout", 5.0),
    }
    if pool.connection_class is UnixDomainSocketConnection:
        return Pipe(path=kwargs["path"], **common)
    return Pipe(host=kwargs.get("host", "localhost"), port=int(kwargs.get("port", 6379)), **common)
