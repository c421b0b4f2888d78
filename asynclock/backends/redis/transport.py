"""Send a command or a script call to one node, and get its reply.

A node is reached over one of three links: the pipelined connection (:mod:`.pipe`) where
the pool's settings allow it; redis-py's own connections (:class:`_Link`: TLS, Sentinel,
credential providers, and ``sync_replicas``, whose ``WAIT`` blocks its connection); or
the cluster client (:class:`_ClusterLink`), which routes each command by its keys' slot.
:class:`Transport` runs script calls over whichever link a node has: by SHA1, loading a
script the server does not know and sending the call once more. Driver errors become
:class:`~asynclock.BackendError` here, and a cancel that redis-py swallowed is raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, RedisError, ResponseError

from ..._cancel import CancelMark
from ..._errors import map_backend_errors
from ..._tasks import TaskSet
from . import scripts
from .calls import Call
from .pipe import Pipe, pack, pipe_for

__all__ = ("DRIVER_ERRORS", "Link", "Transport", "link_for", "text")

logger = logging.getLogger("asynclock.redis")

#: The driver's errors, which become ``BackendError``.
DRIVER_ERRORS = (RedisError, OSError)


def text(value: bytes | str) -> str:
    """A reply as text (RESP2 replies are bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def _noscript(error: ResponseError) -> bool:
    """The server does not know the script (after a restart or SCRIPT FLUSH). redis-py's
    connections raise NoScriptError ("No matching script."); ours keep the server's text."""
    return isinstance(error, NoScriptError) or str(error).startswith("NOSCRIPT")


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

    __slots__ = ("_closed", "_idle", "_keep", "_pool")

    def __init__(self, pool: ConnectionPool, keep: int = 16) -> None:
        self._pool = pool
        # Never more than a quarter of a bounded pool: the application may share it.
        self._keep = min(keep, max(1, getattr(pool, "max_connections", keep) // 4))
        self._idle: list[AbstractConnection] = []
        self._closed = False

    async def execute(self, *args: Any) -> Any:
        mark = CancelMark()
        try:
            async with self.pinned() as run:
                return await run(*args)
        except RedisConnectionError as exc:
            mark.raise_if_swallowed(exc)
            if not isinstance(exc.__context__, ReadOnlyError):
                raise
        # Sentinel: the master we were connected to was demoted and refused the command
        # (it did not run); the connection was dropped and a new one asks the sentinels.
        async with self.pinned() as run:
            return await run(*args)

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[_Run]:
        """One connection for several commands in a row (``WAIT`` after a write)."""
        if self._closed:
            raise RedisConnectionError("the coordinator was closed")
        # Marked before any await: a connect (Sentinel asks the sentinels) can swallow a
        # cancel as a send can (see the module docstring).
        mark = CancelMark()
        idle = self._idle
        kept = bool(idle)
        if kept:
            conn = idle.pop()
        else:
            conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]

        async def run(*args: Any) -> Any:
            await conn.send_packed_command(pack(args), check_health=False)
            reply = await conn.read_response()
            mark.raise_if_swallowed()
            return reply

        try:
            if kept:
                reader = getattr(conn, "_reader", None)
                if reader is not None and reader.at_eof():
                    # Closed by the server while idle (restart, timeout): reconnect
                    # first, rather than fail one command on a dead socket.
                    await conn.disconnect(nowait=True)
                if not conn.is_connected:
                    # connect(), not the implicit reconnect of a send: a Sentinel-managed
                    # connection asks the sentinels for the master only in connect().
                    await conn.connect()  # type: ignore[no-untyped-call]
            yield run
        finally:
            if self.closed():
                # Closed while this command was in flight: the pool may already have
                # been disconnected; this connection must not outlive it.
                await conn.disconnect(nowait=True)
            elif len(idle) < self._keep:
                idle.append(conn)
            else:
                await self._pool.release(conn)

    def closed(self) -> bool:
        """True once aclose() began (re-read after awaits)."""
        return self._closed

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._pool.release(conn)


class _Run(Protocol):
    async def __call__(self, *args: Any) -> Any: ...


_CLUSTER_SEND_TRIES = 3


class _ClusterLink:
    """Commands through the cluster client, which routes each by its keys' slot and
    follows ``MOVED``/``ASK`` and failovers.

    The cluster client's per-node pools raise ``MaxConnectionsError`` when exhausted
    instead of queueing; at most ``max_connections`` commands are in flight here, so a
    burst of acquires waits for a connection as it does on one node.
    """

    __slots__ = ("_client", "_closed", "_loading", "_slots", "_tasks")

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        self._closed = False
        self._tasks = TaskSet("Redis Cluster script loads")
        limit = int(client.get_connection_kwargs().get("max_connections") or 100)
        self._slots = asyncio.Semaphore(limit)
        self._loading: dict[str, asyncio.Future[None]] = {}

    async def load(self, script: scripts.Script) -> None:
        """``SCRIPT LOAD`` on every primary, once however many callers found it missing
        at the same moment (a burst of first acquires, or after a failover)."""
        loading = self._loading.get(script.sha)
        if loading is None:
            # Quiet: its error reaches every caller waiting for it.
            loading = self._loading[script.sha] = self._tasks.spawn(
                self._load(script), name=f"asynclock-script-load:{script.name}", quiet=True
            )
            loading.add_done_callback(lambda _: self._loading.pop(script.sha, None))
        await asyncio.shield(loading)

    async def _load(self, script: scripts.Script) -> None:
        async with self._slots:
            await self._client.script_load(script.source)

    async def execute(self, *args: Any) -> Any:
        if self._closed:
            raise RedisConnectionError("the coordinator was closed")
        async with self._slots:
            mark = CancelMark()
            for attempt in range(_CLUSTER_SEND_TRIES):
                try:
                    reply = await self._client.execute_command(*args)
                except Exception as exc:
                    mark.raise_if_swallowed(exc)
                    if not isinstance(exc, AttributeError):
                        raise
                    # redis-py 8.1's cluster client can send on a connection that another
                    # task closed meanwhile (seen in failovers and under bursts): "'NoneType'
                    # object has no attribute 'writelines'". Nothing was sent, so sending
                    # again on another connection is safe.
                    if attempt == _CLUSTER_SEND_TRIES - 1:
                        raise RedisConnectionError(
                            f"cluster connection closed under the command: {exc}"
                        ) from exc
                else:
                    mark.raise_if_swallowed()
                    return reply
            raise AssertionError("not reached")

    async def aclose(self) -> None:
        self._closed = True
        await self._tasks.close(5.0)


Link = Pipe | _Link | _ClusterLink


def link_for(client: Redis | RedisCluster, *, pipelined: bool) -> Link:
    """The link to ``client``'s node: the pipelined connection if ``pipelined`` and the
    pool's settings allow it, else redis-py's connections; a cluster client's own."""
    if isinstance(client, RedisCluster):
        return _ClusterLink(client)
    pool = client.connection_pool
    fast = pipe_for(pool) if pipelined else None
    return fast or _Link(pool)


class Transport:
    """Script calls and commands over one node's ``link``, described as ``where`` in
    errors (never with credentials)."""

    __slots__ = ("_cluster", "_errors", "_link", "_where")

    def __init__(self, link: Link, where: str) -> None:
        self._link = link
        self._cluster = isinstance(link, _ClusterLink)
        self._where = where
        self._errors = map_backend_errors(where, DRIVER_ERRORS)

    async def execute(self, *args: Any) -> Any:
        """One command's reply. Raises ``BackendError``."""
        with self._errors:
            return await self._link.execute(*args)

    async def run(self, call: Call) -> Any:
        """Run a script call: its raw reply. Raises ``BackendError``."""
        script, numkeys, args = call
        if self._cluster:
            script = scripts.sharded(script)
        execute = self._link.execute
        # A cancel swallowed by a first command must not be replaced by the error of a
        # second one (the NOSCRIPT reload below, a reconnect).
        with CancelMark(), self._errors:
            try:
                reply = await execute("EVALSHA", script.sha, numkeys, *args)
            except ResponseError as exc:
                if not _noscript(exc):
                    raise
                # After a restart, a failover or SCRIPT FLUSH: load it, try once more.
                logger.debug("script %s not loaded on %s; loading", script.name, self._where)
                await self._load(script, execute)
                reply = await execute("EVALSHA", script.sha, numkeys, *args)
        return reply

    async def _load(self, script: scripts.Script, execute: _Run) -> None:
        link = self._link
        if isinstance(link, _ClusterLink):
            await link.load(script)  # on every primary
        else:
            await execute("SCRIPT", "LOAD", script.source)

    async def run_synced(
        self, call: Call, undo: Call, replicas: int, timeout_ms: int
    ) -> tuple[int, int]:
        """The acquire script, then ``WAIT replicas timeout_ms`` on the same connection if
        it was granted: ``(acquire reply, replicas confirmed)``; a refused acquire waits
        for none. ``undo`` gives the grant back when fewer than ``replicas`` confirmed.
        Only on redis-py's connections (a node without ``sync_replicas`` never comes
        here). Raises ``BackendError``.

        No ``READONLY`` retry here, unlike :meth:`_Link.execute`, and none is needed: a
        demoted master refuses the script at its first write, so a refused acquire holds
        nothing and fails with ``BackendError`` like any unreachable server. Sentinel
        demotes a master and kills its clients in one transaction, and a kept connection
        closed meanwhile is reconnected (to the new master) before use; ``READONLY`` then
        only comes from a demotion Sentinel has not made yet, where sending again would
        ask the same sentinels for the same node. A grant is also never re-sent here:
        were it (a retry after a lost reply), the script renews its own grant, a write
        that ``WAIT`` waits for (see ``ACQUIRE``)."""
        link = self._link
        assert isinstance(link, _Link)  # sync_replicas never uses the pipelined link
        mark = CancelMark()
        try:
            return await self._run_synced(link, call, undo, replicas, timeout_ms)
        except Exception as exc:
            mark.raise_if_swallowed(exc)  # not replaced by the error
            raise

    async def _run_synced(
        self, link: _Link, call: Call, undo: Call, wanted: int, timeout_ms: int
    ) -> tuple[int, int]:
        script, numkeys, args = call
        with self._errors:
            async with link.pinned() as run:
                try:
                    reply = int(await run("EVALSHA", script.sha, numkeys, *args))
                except ResponseError as exc:
                    if not _noscript(exc):
                        raise
                    await self._load(script, run)
                    reply = int(await run("EVALSHA", script.sha, numkeys, *args))
                if reply <= 0:
                    return reply, wanted
                confirmed = int(await run("WAIT", wanted, timeout_ms))
                if confirmed < wanted:
                    # Not durable enough for the caller: give the grant back now.
                    await self.run(undo)
        return reply, confirmed
