"""One Redis or Valkey node, through redis.asyncio (hiredis parser when installed).

Every state change is one Lua script from :mod:`._scripts` (locks, fair locks, readers
of read-write locks, semaphore permits). Waiters sleep on a per-name pub/sub channel that
the release scripts publish to; all waiters of a coordinator share one pub/sub connection
(:class:`_Subscriber`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote, urlsplit

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, RedisError, ResponseError

from ..._backoff import Backoff
from ..._clock import Clock
from ..._errors import BackendError, map_backend_errors
from ..._tasks import TaskSet
from ..._validate import check_number
from ..._wakeup import Mailbox, WakeHub, WakeSlot
from ..base import Attempt, Backend, Claim, LockInfo, owner_of
from . import scripts as _scripts
from .pipe import Pipe, pipe_for

__all__ = ("RedisBackend",)

logger = logging.getLogger("asynclock.redis")

_DRIVER_ERRORS = (RedisError, OSError)
# The watchdog's batch goes out in chunks: one script call must not block the server long.
_EXTEND_CHUNK = 512


def describe_pool(pool: ConnectionPool) -> str:
    """``host:port/db`` or the socket path of a pool, never its credentials."""
    kw = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        return f"sentinel service {pool.service_name}/{kw.get('db', 0)}"
    if "path" in kw:
        where = f"unix://{kw['path']}"
    else:
        where = f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
    return f"{where}/{kw.get('db', 0)}"


Call = tuple[_scripts.Script, int, tuple[Any, ...]]


class Keys(NamedTuple):
    """The names behind one lock; they share the hash tag ``{name}``.

    The keys of read-write locks and semaphores are properties, made when asked for:
    a plain lock never pays for their names.
    """

    lock: str
    fence: str
    channel: str
    queue: str  # exclusive waiters in arrival order (a sorted set)
    due: str  # when each waiter's place in the queue lapses (a hash)

    @property
    def released(self) -> str:
        """Values whose release of the lock (or of a reader) ran lately (a sorted set:
        SHA1 of the value -> when that memory ends, ms): a release sent again finds its
        own."""
        return self.lock + ":released"

    @property
    def readers(self) -> str:
        """Readers holding the name (a sorted set: value -> expiry, ms)."""
        return self.lock + ":readers"

    @property
    def reader_grants(self) -> str:
        """Each reader's fence (a hash)."""
        return self.lock + ":readers:grants"

    @property
    def reader_queue(self) -> str:
        return self.lock + ":readers:queue"

    @property
    def reader_due(self) -> str:
        return self.lock + ":readers:due"

    @property
    def permits(self) -> str:
        """Holders of the semaphore ``name`` (a sorted set: value -> expiry, ms)."""
        return self.lock + ":permits"

    @property
    def permit_fence(self) -> str:
        """The semaphore's own fence counter."""
        return self.lock + ":permits:fence"

    @property
    def permit_grants(self) -> str:
        return self.lock + ":permits:grants"

    @property
    def permit_queue(self) -> str:
        return self.lock + ":permits:queue"

    @property
    def permit_due(self) -> str:
        return self.lock + ":permits:due"

    @property
    def permit_released(self) -> str:
        """Values whose permit's release ran lately (as :attr:`released`)."""
        return self.lock + ":permits:released"


# A waiter keeps its place in the queue for its longest sleep between attempts (it renews
# the place with each attempt) plus this margin; one that died drops out after that, and
# until then a release may wake it in vain (the others then wake by their own timers).
QUEUE_MARGIN_MS = 1000

# How long a wake-up channel stays subscribed after its last waiter got the lock.
LINGER = 1.0

# A release is remembered on the server (so that the same release sent again answers
# "released", not "not held") for the socket timeout, within which a request sent again
# on a new connection lands, plus this margin, which covers the background give-back
# after a cancelled or failed release (its first try goes out at once, bounded by 2 s).
RELEASED_MARGIN_MS = 5000


def _noscript(error: ResponseError) -> bool:
    """The server does not know the script (after a restart or SCRIPT FLUSH). redis-py's
    connections raise NoScriptError ("No matching script."); ours keep the server's text."""
    return isinstance(error, NoScriptError) or str(error).startswith("NOSCRIPT")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# No CLIENT SETINFO on connect: a new connection then costs no round trip, so one to a
# node that stopped answering fails by the node's own timeout, not inside connect().
# redis-py >= 7 says so with driver_info=None; older versions with lib_name/lib_version.
try:
    import redis.driver_info as _driver_info  # noqa: F401 - only probing for the newer API

    _NO_SETINFO: dict[str, Any] = {"driver_info": None}
except ImportError:  # pragma: no cover - older redis-py
    _NO_SETINFO = {"lib_name": None, "lib_version": None}


def _pack(args: tuple[Any, ...]) -> bytes:
    """RESP for one command. hiredis (a dependency) packs in C, several times faster than
    redis-py's asyncio packer, which packs in Python: µs per command on the hot path."""
    packed: bytes = hiredis.pack_command(args)
    return packed


def client_from_url(url: str, *, max_connections: int = 64, **options: Any) -> Redis | RedisCluster:
    """A redis.asyncio client with asynclock's defaults, for a backend to own.

    A bounded *blocking* pool (extra callers queue for a connection), 5 s connect and read
    timeouts, TCP keepalive, RESP2 and no handshake commands (a new connection costs no
    round trip), and no retries inside redis-py: asynclock decides itself what is sent
    again and when, within each request's own deadline. ``options`` override these and
    reach the pool; a misspelt one fails here, not at the first lock.
    """
    pool_options: dict[str, Any] = {
        "socket_connect_timeout": 5.0,
        "socket_timeout": 5.0,
        "timeout": 5.0,  # how long to wait for a free connection of the pool
        "retry": Retry(NoBackoff(), 0),
        # RESP2: with RESP3 (redis-py 8's default) every new connection first says HELLO
        # and asks for maintenance notifications, two round trips before the first lock.
        "protocol": 2,
        **_NO_SETINFO,
    }
    if not url.startswith("unix://"):
        pool_options["socket_keepalive"] = True
    if url.startswith("redis+sentinel://"):
        return _sentinel_client(url, max_connections, {**pool_options, **options})
    if url.startswith("redis+cluster://"):
        return _cluster_client(url, max_connections, {**pool_options, **options})
    pool_options.update(options)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, **pool_options)
    if url.startswith("unix://") and not pool.connection_kwargs.get("path"):
        # (the URL itself is not shown: it may carry a password)
        raise ValueError("unix:// URL names no socket path: write unix:///path/to/redis.sock")
    try:
        pool.make_connection()  # type: ignore[no-untyped-call]  # builds, does not connect
    except RedisError as exc:  # a bad option value: protocol=9, ssl_cert_reqs=bogus
        raise ValueError(f"bad Redis connection option: {exc}") from None
    return Redis.from_pool(pool)


def _parameters(*functions: Callable[..., Any]) -> set[str]:
    """The keyword parameters of ``functions`` (``__init__`` along each class's MRO)."""
    names: set[str] = set()
    for function in functions:
        if isinstance(function, type):
            chain = [vars(c)["__init__"] for c in function.__mro__ if "__init__" in vars(c)]
        else:
            chain = [function]
        for member in chain:
            try:
                parameters = inspect.signature(member).parameters.values()
            except (TypeError, ValueError):  # a builtin's __init__ (object's)
                continue
            names.update(
                p.name
                for p in parameters
                if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            )
    return names


def backend_options(url: str) -> tuple[frozenset[str], frozenset[str]]:
    """The options a client of ``url`` takes: ``(asynclock's, redis-py's)``.

    Asynclock's are :meth:`RedisBackend.from_url`'s (``max_connections`` and the
    backend's own); redis-py's are those of the connection (and pool) classes the URL's
    client is built on: ``Connection``, ``SSLConnection`` or ``UnixDomainSocketConnection``
    and ``BlockingConnectionPool``; ``Sentinel`` and its connection; ``RedisCluster``.
    """
    ours = frozenset({"max_connections", *_BACKEND_OPTIONS})
    scheme = urlsplit(url).scheme.lower()
    if scheme == "redis+cluster":
        theirs = _parameters(RedisCluster)
    elif scheme == "redis+sentinel":
        theirs = _parameters(Sentinel, SentinelManagedConnection)
        theirs |= {"sentinel_username", "sentinel_password"}
    else:
        connection = {"rediss": SSLConnection, "unix": UnixDomainSocketConnection}
        theirs = _parameters(BlockingConnectionPool, connection.get(scheme, Connection))
    return ours, frozenset(theirs - ours)


def _hosts(url: str) -> tuple[dict[str, Any], list[tuple[str, int]], str]:
    """``(credentials, [(host, port)], path)`` of ``scheme://[user:pass@]h:p,h:p/path``."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError(
            f"{parts.scheme}:// URLs take no query string: pass options as keyword arguments"
        )
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    credentials: dict[str, Any] = {}
    if userinfo:
        user, has_password, password = userinfo.partition(":")
        if user:
            credentials["username"] = unquote(user)
        if has_password:
            credentials["password"] = unquote(password)
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host:
            host, port = item.strip(), ""
        host = host.strip("[]")
        if not host:
            raise ValueError(f"{parts.scheme}:// URL has an empty host")
        try:
            number = int(port) if port else 26379 if "sentinel" in parts.scheme else 6379
        except ValueError:
            raise ValueError(f"{parts.scheme}:// URL has a bad port {port!r}") from None
        if not 0 < number < 65536:
            raise ValueError(f"{parts.scheme}:// URL has a port out of range: {number}")
        hosts.append((host, number))
    return credentials, hosts, parts.path


def _sentinel_client(url: str, max_connections: int, options: dict[str, Any]) -> Redis:
    """``redis+sentinel://[user:pass@]h:p,h:p/service[/db]``: a client of the service's
    current master, which asks the sentinels again whenever a connection is (re)made and
    drops connections to a master that was demoted."""
    credentials, hosts, path = _hosts(url)
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ValueError("redis+sentinel:// URL names no service: .../service_name")
    if db:
        if not db.isdigit():
            raise ValueError(f"redis+sentinel:// URL has a bad database number {db!r}")
        options["db"] = int(db)
    options.pop("timeout", None)  # a blocking pool's option: Sentinel's pool does not block
    sentinel_kwargs = {
        key: options[key]
        for key in ("socket_connect_timeout", "socket_timeout", "protocol", *_NO_SETINFO)
        if key in options
    }
    for key in ("sentinel_username", "sentinel_password"):
        if key in options:
            sentinel_kwargs[key.removeprefix("sentinel_")] = options.pop(key)
    given = options.pop("sentinel_kwargs", None)  # the caller's own, over ours
    if given is not None:
        if not isinstance(given, dict):
            raise TypeError(f"sentinel_kwargs must be a dict, got {type(given).__name__}")
        sentinel_kwargs.update(given)
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **credentials, **options)  # type: ignore[no-untyped-call]
    client: Redis = sentinel.master_for(service, max_connections=max_connections)
    client.connection_pool.asynclock_sentinel = sentinel  # type: ignore[attr-defined]
    return client


def _cluster_client(url: str, max_connections: int, options: dict[str, Any]) -> RedisCluster:
    """``redis+cluster://[user:pass@]h:p[,h:p]``: a cluster client that follows ``MOVED``
    and ``ASK`` and refreshes its slot map after a failover."""
    credentials, hosts, path = _hosts(url)
    if path.strip("/"):
        raise ValueError("redis+cluster:// URLs take no database or path (Cluster has db 0)")
    # No blocking pool for Cluster; and its own retries, which follow MOVED/ASK and
    # failovers (a script they re-send after a lost reply is harmless: see the README).
    for key in ("timeout", "retry"):
        options.pop(key, None)
    # By default the client closes every connection to every node after each fifth MOVED
    # reply (``reinitialize_steps=5``) to reload its slot map. The commands in flight on
    # those connections fail with "Connection closed by server" and are sent again. On a
    # healthy cluster the few MOVED replies of its start-up did that in a loop (16-30
    # spurious ``LockLost`` in a 36-task run, from releases sent again before releases
    # answered again: each resend still costs a reconnect and a round trip). Without
    # it, a MOVED moves just that slot to the node it names (failovers too); a lost
    # connection still reloads the whole map.
    options.setdefault("reinitialize_steps", 0)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in hosts],
        max_connections=max_connections,
        **credentials,
        **options,
    )


class RedisBackend(Backend):
    """Locks on one Redis/Valkey node, a Sentinel-managed master, or a Redis Cluster.

    ``client`` is a ``redis.asyncio.Redis`` (a plain one, or ``Sentinel.master_for()``'s)
    or a ``redis.asyncio.cluster.RedisCluster`` the application owns: it is not closed by
    ``aclose()``. Keys are ``{prefix}:{{name}}`` (the lock), ``{prefix}:{{name}}:fence``
    (the fence counter) and the channel ``{prefix}:{{name}}:wake``: one hash tag, one
    Cluster slot. The fence counter expires ``fence_retention`` seconds (at least 2 ttl)
    after the lock was last taken or renewed; fences then continue from the server's clock
    in microseconds (README).

    Read-write locks, semaphores and fair locks (``Claim.shared``, ``limit``, ``fair``)
    run on the same node or slot; their keys are listed in :mod:`._scripts`. Readers hold
    the lock key itself (with a mark, expiring with the last reader), so writers and
    plain locks of the name exclude them at no extra cost.

    ``sync_replicas=N`` (not on Cluster): after a grant, ``WAIT N`` on the same connection
    until N replicas have the key, at most ``sync_timeout`` seconds; fewer confirmations
    fail the acquire with ``BackendError`` (and the grant is released). It makes losing a
    lock in a failover less likely, not impossible: fences still decide (README).
    """

    supports_shared = True
    supports_semaphore = True
    supports_fair = True

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        prefix: str = "asynclock",
        fence_retention: float = 3600.0,
        sync_replicas: int = 0,
        sync_timeout: float = 1.0,
        clock: Clock | None = None,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> None:
        super().__init__(clock=clock, drift_factor=drift_factor, drift_base=drift_base)
        if not isinstance(client, Redis | RedisCluster):
            raise TypeError(
                "client must be a redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster, "
                f"got {type(client).__name__}"
            )
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be non-empty and free of '{{' and '}}', got {prefix!r}")
        if isinstance(sync_replicas, bool) or not isinstance(sync_replicas, int):
            raise TypeError(f"sync_replicas must be an int, got {type(sync_replicas).__name__}")
        if sync_replicas < 0:
            raise ValueError(f"sync_replicas must be >= 0, got {sync_replicas}")
        self._sync_replicas = sync_replicas
        self._sync_timeout_ms = math.ceil(
            check_number("sync_timeout", sync_timeout, positive=True) * 1000
        )
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._link: _Link | Pipe | _ClusterLink
        self._subscriber: _Subscriber | _ShardedSubscriber
        self._inbox = secrets.token_hex(8)
        self._hub = WakeHub()
        if isinstance(client, RedisCluster):
            if sync_replicas:
                raise ValueError(
                    "sync_replicas is not supported on Redis Cluster (WAIT needs the "
                    "connection that wrote, which the cluster client does not expose)"
                )
            nodes = ",".join(client.nodes_manager.startup_nodes)
            self._where = f"Redis Cluster {nodes}"
            self._link = _ClusterLink(client)
            self._subscriber = _ShardedSubscriber(
                client, self._hub, self._where, inbox=f":{self._inbox}"
            )
        else:
            pool = client.connection_pool
            self._where = f"Redis {describe_pool(pool)}"
            # The fast pipelined connection where the pool's settings allow it, else
            # redis-py's (Sentinel, TLS, ...; and for WAIT, which blocks its connection).
            fast = None if sync_replicas else pipe_for(pool)
            self._link = fast or _Link(pool)
            # The suffix of this backend's wake-up channels: a release names the waiter it
            # wakes and publishes to its client's channel alone.
            self._subscriber = _Subscriber(pool, self._hub, self._where, inbox=f":{self._inbox}")
        self._prefix = prefix
        self._retention_ms = math.ceil(
            check_number("fence_retention", fence_retention, positive=True) * 1000
        )
        self._owns_client = False
        self._errors = map_backend_errors(self._where, _DRIVER_ERRORS)
        self._released_ms = math.ceil(self.straggle() * 1000) + RELEASED_MARGIN_MS
        # Waiters leaving the queue and their channel after giving up (see _Waiter).
        self._tasks = TaskSet(f"waiters of {self._where}")

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 64, **options: Any) -> RedisBackend:
        """A backend on a client of its own (closed by ``aclose()``) with a blocking pool.

        ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://h:p,h:p/service[/db]``
        and ``redis+cluster://h:p[,h:p]``. Under load, extra concurrent operations queue for
        a free connection rather than fail (Sentinel and Cluster pools raise instead).
        ``options`` not meant for :class:`RedisBackend` go to the connection pool.
        """
        own = {k: options.pop(k) for k in _BACKEND_OPTIONS if k in options}
        backend = cls(client_from_url(url, max_connections=max_connections, **options), **own)
        backend._owns_client = True
        return backend

    def _share_hub(self, hub: WakeHub) -> None:
        """Deliver wake-ups to ``hub`` (Redlock: one hub for all its nodes)."""
        self._hub = hub
        self._subscriber._hub = hub

    # -- keys ------------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        """On Cluster, a name starting with ``}`` is refused: its keys ``prefix:{}…`` have
        an empty hash tag, so Cluster would hash each whole key and scatter the lock and
        its fence over different slots (``CROSSSLOT``)."""
        if self._cluster and name.startswith("}"):
            raise ValueError(
                f"lock name {name!r} starts with '}}', which Redis Cluster cannot keep in one "
                "slot (its keys would have an empty hash tag); use a name that does not "
                "start with '}'"
            )

    def keys(self, name: str) -> Keys:
        """The lock key, fence counter key, wake-up channel and waiter queue of ``name``
        (and, as properties, its readers' and its semaphore's keys)."""
        base = f"{self._prefix}:{{{name}}}"
        return Keys(base, f"{base}:fence", f"{base}:wake", f"{base}:queue", f"{base}:due")

    def _claim_keys(self, claim: Claim) -> Keys:
        keys = claim.handle
        if keys is None:
            keys = claim.handle = self.keys(claim.name)
        return keys  # type: ignore[no-any-return]

    def channel(self, name: str) -> str:
        """The pub/sub channel that wakes waiters for ``name`` (Redlock's, which do not
        queue; queued waiters hear their own :meth:`inbox`)."""
        return f"{self._prefix}:{{{name}}}:wake"

    def inbox(self, name: str) -> str:
        """The channel on which this backend's queued waiters for ``name`` are woken."""
        return f"{self._prefix}:{{{name}}}:wake:{self._inbox}"

    def topic_channel(self, topic: str) -> str:
        """The pub/sub channel of a topic (an election's announcements)."""
        return f"{self._prefix}:{{{topic}}}:news"

    async def run_id(self) -> str:
        """The server's ``run_id`` (``INFO server``): one per server process, whatever
        address it was reached by. Raises :class:`BackendError` if it cannot be read."""
        with self._errors:
            reply = await self._link.execute("INFO", "server")
        if isinstance(reply, dict):  # parsed by redis-py
            found = reply.get("run_id")
        else:
            fields = dict(
                line.partition(":")[::2] for line in _text(reply).splitlines() if ":" in line
            )
            found = fields.get("run_id")
        if not found:
            raise BackendError(f"{self._where} reported no run_id in INFO server")
        return str(found)

    # -- one node's operations (also the building blocks of Redlock) ------------------

    async def _eval(self, script: _scripts.Script, numkeys: int, *args: Any) -> Any:
        if self._cluster:
            script = _scripts.sharded(script)
        execute = self._link.execute
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            with self._errors:
                try:
                    reply = await execute("EVALSHA", script.sha, numkeys, *args)
                except ResponseError as exc:
                    if not _noscript(exc):
                        raise
                    # After a restart, a failover or SCRIPT FLUSH: load it, try once more.
                    logger.debug("script %s not loaded on %s; loading", script.name, self._where)
                    await self._load(script, execute)
                    reply = await execute("EVALSHA", script.sha, numkeys, *args)
        except Exception as exc:
            # A cancel swallowed by a first command must not be replaced by the error of
            # a second one (the NOSCRIPT reload above, a reconnect).
            _raise_swallowed_cancel(task, cancels, exc)
            raise
        _raise_swallowed_cancel(task, cancels)
        return reply

    async def _load(self, script: _scripts.Script, execute: _Run) -> None:
        link = self._link
        if isinstance(link, _ClusterLink):
            await link.load(script)  # on every primary
        else:
            await execute("SCRIPT", "LOAD", script.source)

    async def _acquire_synced(self, call: Call, undo: Call) -> int:
        """The acquire script, then ``WAIT`` on the same connection if it was granted
        (``undo`` gives the grant back when too few replicas confirmed).

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
        wanted = self._sync_replicas
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            reply, confirmed = await self._run_synced(link, call, undo)
        except Exception as exc:
            _raise_swallowed_cancel(task, cancels, exc)  # not replaced by the error
            raise
        if confirmed < wanted:
            raise BackendError(
                f"{self._where}: the lock reached {confirmed} of the {wanted} replicas "
                f"sync_replicas asks for within {self._sync_timeout_ms / 1000:g}s"
            )
        return reply

    async def _run_synced(self, link: _Link, call: Call, undo: Call) -> tuple[int, int]:
        """``(acquire reply, replicas confirmed)``; a refused acquire waits for none."""
        script, numkeys, args = call
        wanted = self._sync_replicas
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
                confirmed = int(await run("WAIT", wanted, self._sync_timeout_ms))
                if confirmed < wanted:
                    # Not durable enough for the caller: give the grant back now.
                    await self.run(undo)
        return reply, confirmed

    def retention_ms(self, ttl: float) -> int:
        """ms the fence counter outlives the lock's last use: never less than 2 ttl."""
        return max(self._retention_ms, math.ceil(ttl * 2000))

    # Each operation is a call (script, number of keys, arguments): the same for every
    # node, which is what lets Redlock send one packed command to all of them.

    def acquire_call(
        self,
        keys: Keys,
        value: str,
        ttl: float,
        floor: int | None = None,
        *,
        queue: float | None = None,
    ) -> Call:
        """The acquire script: the new fence (> 0), or minus the holder's ms left (<= 0).

        ``floor``: the fence is at least this (Redlock proposes one value to all nodes).
        ``queue``: if refused, join the waiter queue, keeping the place this many seconds
        (the caller waits for a wake-up on :meth:`inbox` and tries again within that time).
        """
        ttl_ms = math.ceil(ttl * 1000)
        retention = self.retention_ms(ttl)
        if queue is not None:
            stay = math.ceil(queue * 1000) + QUEUE_MARGIN_MS
            args: tuple[Any, ...] = (
                keys.lock, keys.fence, keys.released, keys.queue, keys.due,
                value, ttl_ms, retention, floor or 0, stay, self._inbox,
            )  # fmt: skip
            return _scripts.ACQUIRE, 5, args
        args = (keys.lock, keys.fence, keys.released, value, ttl_ms, retention)
        if floor is not None:
            args += (floor,)
        return _scripts.ACQUIRE, 3, args

    def raise_fence_call(self, keys: Keys, value: str, fence: int, ttl: float) -> Call:
        """Redlock's second step: lift the fence counter to ``fence`` if still holding."""
        return (
            _scripts.RAISE_FENCE,
            2,
            (keys.lock, keys.fence, value, fence, self.retention_ms(ttl)),
        )

    def extend_call(self, keys: Keys, value: str, ttl: float) -> Call:
        args = (keys.lock, keys.fence, value, math.ceil(ttl * 1000), self.retention_ms(ttl))
        return _scripts.EXTEND, 2, args

    def released_ms(self) -> int:
        """How long the server remembers a release (ms), so that the same release sent
        again answers "released": the socket timeout (a request sent again on a new
        connection lands within it) plus :data:`RELEASED_MARGIN_MS`."""
        return self._released_ms

    def release_call(self, keys: Keys, value: str) -> Call:
        """Delete the lock if ``value`` holds it: 1, also when sent again; else 0."""
        args = (
            keys.lock, keys.channel, keys.queue, keys.due, keys.reader_queue, keys.reader_due,
            keys.released, value, self._released_ms,
        )  # fmt: skip
        return _scripts.RELEASE, 7, args

    def dequeue_call(self, keys: Keys, value: str) -> Call:
        """Leave whichever waiter queue of the name the waiter is in (it gave up),
        passing on a wake-up."""
        args = (
            keys.lock, keys.channel, keys.queue, keys.due, keys.reader_queue, keys.reader_due,
            keys.permit_queue, keys.permit_due, value,
        )  # fmt: skip
        return _scripts.DEQUEUE, 8, args

    # Fair locks, readers and semaphore permits (single-node calls; Redlock has none).

    def _stay(self, queue: float | None) -> int:
        return 0 if queue is None else math.ceil(queue * 1000) + QUEUE_MARGIN_MS

    def fair_call(self, keys: Keys, value: str, ttl: float, *, queue: float | None) -> Call:
        """ACQUIRE in arrival order: refused while an earlier live waiter is queued."""
        args = (
            keys.lock, keys.fence, keys.queue, keys.due, keys.released,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl), self._stay(queue), self._inbox,
        )  # fmt: skip
        return _scripts.ACQUIRE_FAIR, 5, args

    def shared_call(self, keys: Keys, value: str, ttl: float, *, queue: float | None) -> Call:
        """A reader's acquire: granted while no writer holds or waits."""
        args = (
            keys.lock, keys.fence, keys.readers, keys.reader_grants,
            keys.queue, keys.due, keys.reader_queue, keys.reader_due, keys.released,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl), self._stay(queue), self._inbox,
        )  # fmt: skip
        return _scripts.ACQUIRE_SHARED, 9, args

    def extend_shared_call(self, keys: Keys, value: str, ttl: float) -> Call:
        args = (
            keys.lock, keys.fence, keys.readers, keys.reader_grants,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl),
        )  # fmt: skip
        return _scripts.EXTEND_SHARED, 4, args

    def release_shared_call(self, keys: Keys, value: str) -> Call:
        """Give back a reader's lease: 1, also when sent again; else 0."""
        args = (
            keys.lock, keys.channel, keys.queue, keys.due, keys.reader_queue, keys.reader_due,
            keys.readers, keys.reader_grants, keys.released, value, self._released_ms,
        )  # fmt: skip
        return _scripts.RELEASE_SHARED, 9, args

    def permit_call(
        self, keys: Keys, value: str, ttl: float, limit: int, *, queue: float | None
    ) -> Call:
        """A semaphore permit: granted while fewer than ``limit`` unexpired ones are held."""
        args = (
            keys.permits, keys.permit_fence, keys.permit_grants,
            keys.permit_queue, keys.permit_due, keys.channel, keys.permit_released,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl), limit, self._stay(queue),
            self._inbox,
        )  # fmt: skip
        return _scripts.ACQUIRE_PERMIT, 7, args

    def extend_permit_call(self, keys: Keys, value: str, ttl: float) -> Call:
        args = (
            keys.permits, keys.permit_fence, keys.permit_grants,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl),
        )  # fmt: skip
        return _scripts.EXTEND_PERMIT, 3, args

    def release_permit_call(self, keys: Keys, value: str) -> Call:
        """Give back a permit: 1, also when sent again; else 0."""
        args = (
            keys.permits, keys.channel, keys.permit_queue, keys.permit_due,
            keys.permit_grants, keys.permit_released, value, self._released_ms,
        )  # fmt: skip
        return _scripts.RELEASE_PERMIT, 6, args

    def _extend_call(self, claim: Claim, ttl: float) -> Call:
        keys = self._claim_keys(claim)
        if claim.limit:
            return self.extend_permit_call(keys, claim.value, ttl)
        if claim.shared:
            return self.extend_shared_call(keys, claim.value, ttl)
        return self.extend_call(keys, claim.value, ttl)

    def _release_call(self, claim: Claim) -> Call:
        keys = self._claim_keys(claim)
        if claim.limit:
            return self.release_permit_call(keys, claim.value)
        if claim.shared:
            return self.release_shared_call(keys, claim.value)
        return self.release_call(keys, claim.value)

    async def run(self, call: Call) -> Any:
        """Run a call on this node: the script's raw reply."""
        script, numkeys, args = call
        return await self._eval(script, numkeys, *args)

    async def acquire_keys(
        self, keys: Keys, value: str, ttl: float, floor: int | None = None
    ) -> int:
        return int(await self.run(self.acquire_call(keys, value, ttl, floor)))

    async def extend_keys(self, keys: Keys, value: str, ttl: float) -> bool:
        return bool(await self.run(self.extend_call(keys, value, ttl)) == 1)

    async def extend_many_keys(self, items: Sequence[tuple[Keys, str, float]]) -> list[bool]:
        """EXTEND for many locks, one script call per chunk. Raises ``BackendError``."""
        client = self._client
        if isinstance(client, RedisCluster) and len(items) > 1:
            # A script's keys must share a slot: one batch per slot, all at once.
            by_slot: dict[int, list[int]] = {}
            for index, (lock_keys, _, _) in enumerate(items):
                by_slot.setdefault(client.keyslot(lock_keys.lock), []).append(index)
            groups = list(by_slot.values())
            replies = await asyncio.gather(
                *(self._extend_chunks([items[i] for i in group]) for group in groups)
            )
            results = [False] * len(items)
            for group, extended in zip(groups, replies, strict=True):
                for index, ok in zip(group, extended, strict=True):
                    results[index] = ok
            return results
        return await self._extend_chunks(items)

    async def _extend_chunks(self, items: Sequence[tuple[Keys, str, float]]) -> list[bool]:
        results: list[bool] = []
        for start in range(0, len(items), _EXTEND_CHUNK):
            chunk = items[start : start + _EXTEND_CHUNK]
            keys: list[str] = []
            args: list[Any] = []
            for lock_keys, value, ttl in chunk:
                keys += (lock_keys.lock, lock_keys.fence)
                args += (value, math.ceil(ttl * 1000), self.retention_ms(ttl))
            replies = await self._eval(_scripts.EXTEND_MANY, len(keys), *keys, *args)
            results += [reply == 1 for reply in replies]
        return results

    async def release_keys(self, keys: Keys, value: str) -> bool:
        return bool(await self.run(self.release_call(keys, value)) == 1)

    async def inspect_keys(self, keys: Keys) -> tuple[str, float, int] | None:
        """``(holder value, seconds left, fence counter)`` or None when free; while
        readers hold, the reader whose lease ends last and its fence."""
        reply = await self._eval(
            _scripts.INSPECT, 4, keys.lock, keys.fence, keys.readers, keys.reader_grants
        )
        if reply is None:
            return None
        value, pttl, fence = reply
        return _text(value), (math.inf if pttl < 0 else pttl / 1000), int(fence or 0)

    # -- the Backend interface -------------------------------------------------------

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        # A caller that will wait joins the queue in the same script, so that a release
        # wakes it alone rather than every waiter of every client.
        queue = None if wait == 0 else claim.recheck
        keys = self._claim_keys(claim)
        value = claim.value
        if claim.limit:
            call = self.permit_call(keys, value, ttl, claim.limit, queue=queue)
        elif claim.shared:
            call = self.shared_call(keys, value, ttl, queue=queue)
        elif claim.fair:
            call = self.fair_call(keys, value, ttl, queue=queue)
        else:
            call = self.acquire_call(keys, value, ttl, queue=queue)
        if self._sync_replicas:
            reply = await self._acquire_synced(call, self._release_call(claim))
        else:
            reply = int(await self.run(call))
        if reply > 0:
            return Attempt(reply)
        return Attempt(None, -reply / 1000 if reply < 0 else None)

    async def extend(self, claim: Claim, ttl: float) -> bool:
        return bool(await self.run(self._extend_call(claim, ttl)) == 1)

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        # Locks go in batches (one script call per chunk); readers and permits, each in
        # a set of its own, one call each, all at once.
        plain = [i for i, (claim, _) in enumerate(items) if not (claim.limit or claim.shared)]
        results: list[bool | None] = [None] * len(items)
        others = [i for i, (claim, _) in enumerate(items) if claim.limit or claim.shared]
        if others:
            replies = await asyncio.gather(
                *(self.extend(*items[i]) for i in others), return_exceptions=True
            )
            for i, reply in zip(others, replies, strict=True):
                if isinstance(reply, BaseException) and not isinstance(reply, BackendError):
                    raise reply
                results[i] = reply if isinstance(reply, bool) else None
        if not plain:
            return results
        try:
            extended = await self.extend_many_keys(
                [(self._claim_keys(items[i][0]), items[i][0].value, items[i][1]) for i in plain]
            )
        except BackendError as exc:
            logger.warning("renewal of %d leases failed on %s: %s", len(plain), self._where, exc)
            return results
        for i, ok in zip(plain, extended, strict=True):
            results[i] = ok
        return results

    async def release(self, claim: Claim) -> bool:
        return bool(await self.run(self._release_call(claim)) == 1)

    async def inspect(self, name: str) -> LockInfo | None:
        found = await self.inspect_keys(self.keys(name))
        if found is None:
            return None
        value, expires_in, fence = found
        return LockInfo(name, owner_of(value), expires_in, fence)

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return _Waiter(self, self.keys(name), self.inbox(name))

    async def _dequeue(self, keys: Keys, value: str) -> None:
        """Leave the waiter queue, best effort: a place lapses on its own anyway."""
        try:
            await self.run(self.dequeue_call(keys, value))
        except BackendError as exc:
            logger.debug("leaving the waiter queue on %s failed: %s", self._where, exc)

    async def publish(self, topic: str, message: str) -> None:
        command = "SPUBLISH" if self._cluster else "PUBLISH"
        with self._errors:
            await self._link.execute(command, self.topic_channel(topic), message)

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return _Listener(self._subscriber, self.topic_channel(topic))

    async def aclose(self) -> None:
        # Give-ups on their way out of the queue (each bounded by the socket timeout): a
        # waiter waits for its leave only briefly, so closing is where they finish.
        await self._tasks.close(5.0)
        await self._subscriber.aclose()
        await self._link.aclose()
        if self._owns_client:
            await self._client.aclose()
            pool = getattr(self._client, "connection_pool", None)
            sentinel: Sentinel | None = getattr(pool, "asynclock_sentinel", None)
            if sentinel is not None:
                for sentinel_client in sentinel.sentinels:
                    await sentinel_client.aclose()

    async def leave(self, claim: Claim) -> None:
        await self._dequeue(self._claim_keys(claim), claim.value)

    def ordered_after_cancel(self) -> bool:
        # The pipelined connection abandons a cancelled request's reply and keeps going:
        # the give-back's release follows it on the same connection.
        return isinstance(self._link, Pipe)

    def straggle(self) -> float:
        # Even the pipelined connection: a timed-out request's connection is dropped and
        # the give-back goes out on a new one, which a proxy may deliver first.
        if isinstance(self._client, RedisCluster):
            kwargs = self._client.get_connection_kwargs()
        else:
            kwargs = self._client.connection_pool.connection_kwargs
        return float(kwargs.get("socket_timeout") or 5.0)

    def describe(self) -> str:
        return f"RedisBackend {self._where[len('Redis ') :]} prefix={self._prefix!r}"

    # -- introspection for tests and stats -------------------------------------------

    @property
    def client(self) -> Redis | RedisCluster:
        """The redis.asyncio client in use."""
        return self._client

    def waiting(self, name: str | None = None) -> int:
        """Tasks of this coordinator waiting for a wake-up (for ``name``, or all)."""
        return self._hub.waiting(None if name is None else self.channel(name))

    def subscribed(self) -> list[str]:
        """Channels the shared pub/sub connection is subscribed to (or subscribing)."""
        return self._subscriber.channels()


# Replies of shard channels (Cluster), handled as their plain counterparts.
_SHARD_KINDS = frozenset(("smessage", "ssubscribe", "sunsubscribe"))

_BACKEND_OPTIONS = (
    "prefix",
    "fence_retention",
    "sync_replicas",
    "sync_timeout",
    "clock",
    "drift_factor",
    "drift_base",
)


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
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            async with self.pinned() as run:
                return await run(*args)
        except RedisConnectionError as exc:
            _raise_swallowed_cancel(task, cancels, exc)
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
        # Counted before any await: a connect (Sentinel asks the sentinels) can swallow a
        # cancel as a send can (see _raise_swallowed_cancel).
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        idle = self._idle
        kept = bool(idle)
        if kept:
            conn = idle.pop()
        else:
            conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]

        async def run(*args: Any) -> Any:
            await conn.send_packed_command(_pack(args), check_health=False)
            reply = await conn.read_response()
            _raise_swallowed_cancel(task, cancels)
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


def _raise_swallowed_cancel(
    task: asyncio.Task[Any] | None, cancels: int, error: Exception | None = None
) -> None:
    """Raise the ``CancelledError`` of a cancel that arrived during redis-py commands and
    did not surface (``cancels``: ``task.cancelling()`` before them). redis-py sends and
    connects under ``asyncio.wait_for``, which on Python 3.11 returns the inner result
    when the cancel lands as it finishes. The reply (or ``error``, which a cancel in
    flight must not be replaced by) is dropped; the caller undoes what it may have done,
    as for any interrupted request."""
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError from error


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

    async def load(self, script: _scripts.Script) -> None:
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

    async def _load(self, script: _scripts.Script) -> None:
        async with self._slots:
            await self._client.script_load(script.source)

    async def execute(self, *args: Any) -> Any:
        if self._closed:
            raise RedisConnectionError("the coordinator was closed")
        async with self._slots:
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            for attempt in range(_CLUSTER_SEND_TRIES):
                try:
                    reply = await self._client.execute_command(*args)
                except Exception as exc:
                    _raise_swallowed_cancel(task, cancels, exc)
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
                    _raise_swallowed_cancel(task, cancels)
                    return reply
            raise AssertionError("not reached")

    async def aclose(self) -> None:
        self._closed = True
        await self._tasks.close(5.0)


class _Waiter:
    """``backend.waiter(name)``: a hub slot, registered before subscribing.

    The slot's ``tag`` is the waiting claim's value (set by the lock): a release that
    names it in its message wakes this slot alone ("*" wakes every slot of the name: the
    readers after a writer). Leaving without the lock (timed out, cancelled) takes the
    claim out of whichever of the name's waiter queues it is in (lock, readers, permits).
    """

    __slots__ = ("_backend", "_inbox", "_keys", "_slot")

    def __init__(self, backend: RedisBackend, keys: Keys, inbox: str) -> None:
        self._backend = backend
        self._keys = keys
        self._inbox = inbox
        self._slot: WakeSlot | None = None

    async def __aenter__(self) -> WakeSlot:
        backend = self._backend
        slot = self._slot = backend._hub.register(self._keys.channel)
        try:
            await backend._subscriber.subscribe(self._inbox)
        except BaseException:
            backend._hub.unregister(slot)
            raise
        return slot

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        slot = self._slot
        assert slot is not None
        backend = self._backend
        backend._hub.unregister(slot)
        if exc_type is None or slot.tag is None:
            # Granted: the acquire script took the claim out of the queue already.
            await backend._subscriber.unsubscribe(self._inbox, confirm=False)
            return
        # A waiter that gives up (cancelled, timed out) leaves the queue, and leaves only
        # once the server has dropped its subscription: both round trips at once. In a
        # task of the backend's: a cancel landing here (a second one, a timeout firing
        # while a LockTimeout leaves) must not stop them before they start, which kept
        # the place in the queue until it lapsed and the channel subscribed for good.
        backend._tasks.spawn_unless_closed(
            self._leave(slot.tag), name=f"asynclock-leave-wait:{self._keys.channel}"
        )
        # Not waited for: the caller's deadline and cancel come first (a server that
        # stopped answering would hold a LockTimeout back). The leave goes on in the
        # background, owned by the backend, which aclose() waits for (bounded). One turn
        # of the loop lets it start. The caller's next request may still reach the server
        # before the DEQUEUE: a retry then queues behind its own old place, and the
        # DEQUEUE, finding that place first in line, wakes the retry (see _scripts).
        await asyncio.sleep(0)

    async def _leave(self, value: str) -> None:
        backend = self._backend
        try:
            await asyncio.gather(
                backend._dequeue(self._keys, value),
                backend._subscriber.unsubscribe(self._inbox, confirm=True),
            )
        except BackendError as exc:  # best effort: the place lapses by itself
            logger.debug("leaving the wait on %s failed: %s", self._keys.channel, exc)


class _Listener:
    """``backend.listen(topic)``: a mailbox fed by the shared pub/sub connection."""

    __slots__ = ("_channel", "_mailbox", "_subscriber")

    def __init__(self, subscriber: _Subscriber | _ShardedSubscriber, channel: str) -> None:
        self._subscriber = subscriber
        self._channel = channel
        self._mailbox = Mailbox()

    async def __aenter__(self) -> Mailbox:
        self._subscriber.deliver(self._channel, self._mailbox)
        try:
            await self._subscriber.subscribe(self._channel)
        except BaseException:
            self._subscriber.undeliver(self._channel, self._mailbox)
            raise
        return self._mailbox

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._subscriber.undeliver(self._channel, self._mailbox)
        await self._subscriber.unsubscribe(self._channel, confirm=False)


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

    def __init__(
        self, pool: _Source, hub: WakeHub, where: str, *, inbox: str, sharded: bool = False
    ) -> None:
        self._pool = pool
        self._hub = hub
        self._where = where
        self._inbox = inbox  # the suffix of this client's own wake-up channels
        # Redis Cluster: shard channels (SSUBSCRIBE), served by the node owning the slot.
        self._subscribe = "SSUBSCRIBE" if sharded else "SUBSCRIBE"
        self._unsubscribe = "SUNSUBSCRIBE" if sharded else "UNSUBSCRIBE"
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
        # Channels whose messages are delivered to mailboxes rather than waking waiters.
        self._mailboxes: dict[str, set[Mailbox]] = {}
        # Told (channel, references) when the server drops a wanted subscription by
        # itself (Cluster: its slot moved); the channel is forgotten here first.
        self._dropped: Callable[[str, int], None] | None = None
        self._conn: AbstractConnection | None = None
        self._opened: set[AbstractConnection] = set()
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        # Channels nobody listens to any more, still subscribed for a moment (see
        # unsubscribe), with the timer that drops them; their refs are 0.
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        # The reader, unsubscribes of lingering channels, closes of broken connections.
        self._tasks = TaskSet(f"pub/sub of {where}")

    def channels(self) -> list[str]:
        """Channels subscribed (or being subscribed), lingering ones included."""
        return list(self._refs)

    def deliver(self, channel: str, mailbox: Mailbox) -> None:
        self._mailboxes.setdefault(channel, set()).add(mailbox)

    def undeliver(self, channel: str, mailbox: Mailbox) -> None:
        mailboxes = self._mailboxes.get(channel)
        if mailboxes is not None:
            mailboxes.discard(mailbox)
            if not mailboxes:
                del self._mailboxes[channel]

    async def subscribe(self, channel: str) -> None:
        if self._closed:
            raise BackendError(f"{self._where}: the coordinator is closed")
        refs = self._refs.get(channel, 0)
        self._refs[channel] = refs + 1
        lingering = self._lingering.pop(channel, None)
        if lingering is not None:
            lingering.cancel()  # still subscribed: nothing to send
        try:
            ready = self._ready.get(channel)
            if ready is None:  # not subscribed (nor lingering), or refused by the server
                ready = self._ready[channel] = asyncio.get_running_loop().create_future()
                if self._conn is not None:
                    await self._send(self._subscribe, channel)
                if self._reader is None:
                    # It connects if needed and subscribes every wanted channel.
                    self._reader = self._tasks.spawn(self._run(), name="asynclock-pubsub")
            async with asyncio.timeout(self._timeout):
                # Re-read: a lost connection replaces the future while we wait.
                await asyncio.shield(self._ready.get(channel, ready))
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
        """Drop one reference; the last one unsubscribes.

        With ``confirm`` (a waiter that gives up) it sends ``UNSUBSCRIBE`` and waits for the
        server's answer. Without (a waiter that got the lock), the subscription lingers for
        :data:`LINGER` seconds: nothing is sent on the way to the grant, and the next wait
        for the same lock (a hot lock, a worker loop) needs no new ``SUBSCRIBE``.
        """
        refs = self._refs.get(channel, 0) - 1
        if refs > 0:
            self._refs[channel] = refs
            return
        lingers = refs == 0 and channel in self._ready  # subscribed, not refused
        if not confirm and lingers and self._conn is not None and not self._closed:
            self._refs[channel] = 0
            loop = asyncio.get_running_loop()
            self._lingering[channel] = loop.call_later(LINGER, self._drop, channel)
            return
        await self._unsubscribe_now(channel, confirm=confirm)

    def _drop(self, channel: str) -> None:
        """A lingering channel's time is up: unsubscribe, unless someone came back."""
        self._lingering.pop(channel, None)
        if self._refs.get(channel) == 0:
            # Forget it now, not when the task runs: a subscribe in between must see
            # the channel unsubscribed and send its own SUBSCRIBE.
            self._forget(channel)
            # Quiet: if it fails, the connection broke and the reader starts over.
            self._tasks.spawn(
                self._send_unsubscribe(channel, confirm=False),
                name=f"asynclock-unsubscribe:{channel}",
                quiet=True,
            )

    def _forget(self, channel: str) -> None:
        self._refs.pop(channel, None)
        ready = self._ready.pop(channel, None)
        if ready is not None and not ready.done():
            ready.cancel()

    async def _unsubscribe_now(self, channel: str, *, confirm: bool) -> None:
        self._forget(channel)
        await self._send_unsubscribe(channel, confirm=confirm)

    async def _send_unsubscribe(self, channel: str, *, confirm: bool) -> None:
        if self._conn is None or channel in self._refs:
            # No connection (nothing subscribed), or wanted again meanwhile: its
            # SUBSCRIBE went out after ours would have, so it stands.
            return
        done = asyncio.get_running_loop().create_future() if confirm else None
        self._unsubscribing.setdefault(channel, deque()).append(done)
        try:
            await self._send(self._unsubscribe, channel)
        except BackendError:
            return  # the connection broke: nothing is subscribed on it any more
        if done is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout):
                    await asyncio.shield(done)

    async def _send(self, command: str, *channels: str) -> None:
        conn = self._conn
        if conn is None or self._closed:
            raise BackendError(f"{self._where}: pub/sub connection closed")
        if command == self._subscribe:
            for channel in channels:
                self._unconfirmed[channel] = self._unconfirmed.get(channel, 0) + 1
        try:
            with map_backend_errors(self._where, _DRIVER_ERRORS):
                await conn.send_command(command, *channels, check_health=False)
        finally:
            if self.is_closed():
                # aclose() ran meanwhile, and redis-py reconnects a closed connection on
                # send: do not let that socket outlive the coordinator.
                await conn.disconnect(nowait=True)

    def is_closed(self) -> bool:
        """True once aclose() began (re-read after awaits)."""
        return self._closed

    def _close_soon(self, conn: AbstractConnection) -> None:
        """Close a broken connection without waiting for it (from sync code or a reader);
        its failure is expected and not reported."""
        self._tasks.spawn(conn.disconnect(nowait=True), name="asynclock-close", quiet=True)

    def _restart(self, exc: BaseException) -> None:
        """Drop the connection and its reader; start over if anyone still waits."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()  # redis-py closes the connection of a cancelled read
        conn, self._conn = self._conn, None
        if conn is not None and reader is None:
            self._close_soon(conn)
        self._connection_lost(exc)
        if self._refs and not self._closed:
            self._reader = self._tasks.spawn(self._run(resync=True), name="asynclock-pubsub")

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
                    if not self._refs:
                        return  # everyone left while we connected: keep it for later
                    await self._read(conn)
                except BackendError as exc:
                    if conn is not None and self._conn is conn:
                        # An open connection broke: reconnect at once.
                        self._conn = None
                        self._close_soon(conn)
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
                await self._send(self._subscribe, *channels)
                if resync:
                    await self._send("PING")
        except BackendError:
            self._conn = None
            self._close_soon(conn)
            raise
        return conn

    async def _read(self, conn: AbstractConnection) -> None:
        """Dispatch replies until the server says nothing is subscribed and nobody waits."""
        while True:
            try:
                reply = await conn.read_response()
            except ResponseError as exc:
                # An error reply (Cluster: -MOVED, the slot is served elsewhere): the
                # connection is fine, the subscriptions waiting for an answer are not.
                self._refused(exc)
                continue
            except _DRIVER_ERRORS as exc:
                raise BackendError(f"{self._where}: {exc}") from exc
            if self._dispatch(reply) and not self._refs:
                return

    def _refused(self, exc: ResponseError) -> None:
        """The server refused a (S)SUBSCRIBE: whoever waits for one gets the error now."""
        error = BackendError(f"{self._where}: subscription refused: {exc}")
        for channel in list(self._unconfirmed):
            self._unconfirmed.pop(channel, None)
            ready = self._ready.pop(channel, None)
            if ready is not None and not ready.done():
                ready.set_exception(error)
                ready.exception()  # retrieved: its subscriber may have left already

    async def _connect(self) -> AbstractConnection:
        kwargs = dict(self._pool.connection_kwargs)
        # Our own reads block as long as needed; RESP2 keeps pub/sub replies plain.
        kwargs.update(socket_timeout=None, protocol=2, health_check_interval=0)
        conn: AbstractConnection = self._pool.connection_class(**kwargs)
        # Every connection ever opened, so that aclose() closes them whatever path left
        # one behind (a reader cancelled half-way through opening, say).
        self._opened = {c for c in self._opened if c.is_connected}
        self._opened.add(conn)
        try:
            with map_backend_errors(self._where, _DRIVER_ERRORS):
                await conn.connect()  # type: ignore[no-untyped-call]
        except BaseException:
            # Interrupted half-way (a cancel from aclose, a timeout): close what opened.
            await conn.disconnect(nowait=True)
            raise
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
        self._wake_everyone()

    def _wake_everyone(self) -> None:
        """Messages may have been missed: waiters try again, listeners look again."""
        self._hub.notify_all()
        for mailboxes in self._mailboxes.values():
            for mailbox in mailboxes:
                mailbox.put("")

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
        if kind in _SHARD_KINDS:  # smessage, ssubscribe, sunsubscribe
            kind = kind[1:]
        if kind == "message":
            self._on_message(_text(reply[1]), reply[2])
        elif kind == "subscribe":
            self._on_subscribed(_text(reply[1]))
        elif kind == "unsubscribe":
            self._on_unsubscribed(_text(reply[1]))
            return int(reply[2]) == 0
        elif kind == "pong":
            self._wake_everyone()
        return False

    def _on_message(self, channel: str, payload: bytes | str) -> None:
        mailboxes = self._mailboxes.get(channel)
        if mailboxes is None:
            # "<release id>" on a lock's channel, "<release id> <waiter>" on our inbox for
            # it (see _scripts.RELEASE); slots are kept under the lock's channel.
            if channel.endswith(self._inbox):
                channel = channel[: -len(self._inbox)]
            release, _, target = _text(payload).partition(" ")
            if target == "*":
                self._hub.notify_all(channel)  # every waiting reader may go
            else:
                self._hub.announce(channel, release, target or None)
        else:
            for mailbox in mailboxes:
                mailbox.put(_text(payload))

    def _on_subscribed(self, channel: str) -> None:
        left = self._unconfirmed.get(channel, 0) - 1
        if left > 0:
            self._unconfirmed[channel] = left
            return
        self._unconfirmed.pop(channel, None)
        ready = self._ready.get(channel)
        if ready is not None and not ready.done():
            ready.set_result(None)

    def _on_unsubscribed(self, channel: str) -> None:
        pending = self._unsubscribing.get(channel)
        if pending:
            done = pending.popleft()
            if not pending:
                del self._unsubscribing[channel]
            if done is not None and not done.done():
                done.set_result(None)
            return
        if channel not in self._refs:
            return
        # Not asked for: the server dropped the subscription. Cluster does so for the
        # shard channels of a slot that moved (a failover turned this node into a
        # replica, or a resharding): they now live on the slot's new owner.
        dropped = BackendError(f"{self._where}: the server dropped the subscription to {channel}")
        if self._dropped is None:
            # (Never seen from a plain server.) Start over: the reconnect subscribes
            # every wanted channel again, and wakes every waiter once confirmed.
            asyncio.get_running_loop().call_soon(self._restart, dropped)
            return
        refs = self._refs.pop(channel)
        timer = self._lingering.pop(channel, None)
        if timer is not None:
            timer.cancel()
        self._unconfirmed.pop(channel, None)
        ready = self._ready.pop(channel, None)
        if ready is not None and not ready.done():
            ready.set_exception(dropped)  # its subscriber tries the slot's new owner
            ready.exception()
        self._dropped(channel, refs)

    def hold(self, channel: str, count: int) -> bool:
        """Add ``count`` references to a subscribed channel (confirmed by the server);
        False, changing nothing, if it is not subscribed."""
        ready = self._ready.get(channel)
        if channel not in self._refs or ready is None or not ready.done():
            return False
        if ready.cancelled() or ready.exception() is not None:
            return False
        self._refs[channel] += count
        return True

    async def aclose(self) -> None:
        self._closed = True
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        reader, self._reader = self._reader, None
        cancelled: asyncio.CancelledError | None = None
        if reader is not None:
            reader.cancel()
            # Not `await reader` under suppress(CancelledError): that would also swallow a
            # cancel of the task calling aclose(). That cancel is raised once the rest of
            # the close has run.
            try:
                await asyncio.wait({reader})
            except asyncio.CancelledError as exc:
                cancelled = exc
        self._conn = None
        opened, self._opened = self._opened, set()
        for conn in opened:
            await conn.disconnect()
        closed = BackendError(f"{self._where}: the coordinator was closed")
        for ready in self._ready.values():
            if not ready.done():
                # An error, not a cancel: a cancelled future would cancel its waiter.
                ready.set_exception(closed)
                ready.exception()
        self._ready.clear()
        self._refs.clear()
        self._connection_lost(closed)
        await self._tasks.close(5.0)
        if cancelled is not None:
            raise cancelled


class _Source(Protocol):
    """Where a subscriber makes its connections: a connection pool or a cluster node."""

    @property
    def connection_class(self) -> type[AbstractConnection]: ...

    @property
    def connection_kwargs(self) -> dict[str, Any]: ...


class _ShardedSubscriber:
    """Redis Cluster: a :class:`_Subscriber` (``SSUBSCRIBE``) per node, each channel on the
    node that owns its slot, which is where the scripts' ``SPUBLISH`` delivers.

    A channel keeps its node while anyone listens. If that node dies, its subscriber wakes
    everyone (a release may have been missed) and keeps trying to reconnect; waiters then
    retry on their timers (the holder's TTL, the backoff) until they get the lock, and the
    next wait is routed to the slot's new owner. If the slot moves while its node lives (a
    ``CLUSTER FAILOVER``, a resharding), the node drops the subscription (``sunsubscribe``):
    the channel is subscribed again on the slot's new owner at once, and its waiters are
    woken to look again once that is confirmed (a release may have gone out in between).

    References are counted per channel (``_refs``, one per waiter or listener); those of
    them without a subscription on a node (``_orphans``: the server dropped it, or a
    subscribe failed twice and the waiter went on without wake-ups) are given back
    first, so that leaving never unsubscribes a node under a waiter that still counts on
    it; a later successful subscribe of the channel takes them over.
    """

    def __init__(self, client: RedisCluster, hub: WakeHub, where: str, *, inbox: str) -> None:
        self._client = client
        self._hub_ = hub
        self._where = where
        self._inbox = inbox
        self._nodes: dict[str, _Subscriber] = {}
        self._route: dict[str, _Subscriber] = {}
        self._refs: dict[str, int] = {}
        # References (counted in _refs) with no subscription on any node.
        self._orphans: dict[str, int] = {}
        self._mailboxes: dict[str, set[Mailbox]] = {}
        self._closed = False
        # Subscriptions moved to a slot's new owner.
        self._tasks = TaskSet(f"sharded pub/sub of {where}")

    @property
    def _hub(self) -> WakeHub:
        return self._hub_

    @_hub.setter
    def _hub(self, hub: WakeHub) -> None:
        self._hub_ = hub
        for subscriber in self._nodes.values():
            subscriber._hub = hub

    def channels(self) -> list[str]:
        return [channel for sub in self._nodes.values() for channel in sub.channels()]

    def deliver(self, channel: str, mailbox: Mailbox) -> None:
        self._mailboxes.setdefault(channel, set()).add(mailbox)
        subscriber = self._route.get(channel)
        if subscriber is not None:
            subscriber.deliver(channel, mailbox)

    def undeliver(self, channel: str, mailbox: Mailbox) -> None:
        mailboxes = self._mailboxes.get(channel)
        if mailboxes is not None:
            mailboxes.discard(mailbox)
            if not mailboxes:
                del self._mailboxes[channel]
        subscriber = self._route.get(channel)
        if subscriber is not None:
            subscriber.undeliver(channel, mailbox)

    async def _owner(self, channel: str) -> _Subscriber:
        if self._closed:
            raise BackendError(f"{self._where}: the coordinator is closed")
        with map_backend_errors(self._where, _DRIVER_ERRORS):
            await self._client.initialize()  # learns the slot map once
            node = self._client.get_node_from_key(channel)
        if node is None:
            raise BackendError(f"{self._where}: no node serves the slot of {channel!r}")
        subscriber = self._nodes.get(node.name)
        if subscriber is None:
            subscriber = self._nodes[node.name] = _Subscriber(
                node, self._hub_, f"{self._where} ({node.name})", inbox=self._inbox, sharded=True
            )
            subscriber._dropped = functools.partial(self._moved, subscriber)
        return subscriber

    async def subscribe(self, channel: str) -> None:
        """Subscribe on the slot's owner; if that fails (a stale slot map during a
        failover, a dead node), learn the slot map again and try its new owner. If that
        fails too, go on unsubscribed: the waiter then retries on its timers."""
        for attempt in range(2):
            subscriber = self._route.get(channel)
            if subscriber is None:
                if attempt:
                    with map_backend_errors(self._where, _DRIVER_ERRORS):
                        await self._client.nodes_manager.initialize()
                subscriber = await self._owner(channel)
                if channel not in self._route:  # nobody routed it meanwhile
                    self._route[channel] = subscriber
                    for mailbox in self._mailboxes.get(channel, ()):
                        subscriber.deliver(channel, mailbox)
                subscriber = self._route[channel]
            self._refs[channel] = self._refs.get(channel, 0) + 1
            try:
                await subscriber.subscribe(channel)
            except BackendError as exc:
                self._forget(channel)
                if self._closed:
                    raise
                logger.info("%s: subscribing to %s failed (%s)", self._where, channel, exc)
            except BaseException:
                self._forget(channel)
                raise
            else:
                # Subscribed: references without a subscription (see the class) share it.
                orphans = min(self._orphans.pop(channel, 0), self._refs.get(channel, 1) - 1)
                if orphans > 0 and not (
                    self._route.get(channel) is subscriber and subscriber.hold(channel, orphans)
                ):
                    self._orphans[channel] = orphans  # dropped again meanwhile: moving on
                return
        logger.warning(
            "%s: waiting on %s without wake-ups (its slot's node did not answer)",
            self._where,
            channel,
        )
        # A reference with no subscription: unsubscribe() gives it back without touching
        # the subscription a later waiter may have made on the node.
        self._refs[channel] = self._refs.get(channel, 0) + 1
        self._orphans[channel] = self._orphans.get(channel, 0) + 1

    def _forget(self, channel: str) -> _Subscriber | None:
        refs = self._refs.get(channel, 0) - 1
        if refs > 0:
            self._refs[channel] = refs
            return None
        self._refs.pop(channel, None)
        self._orphans.pop(channel, None)
        subscriber = self._route.pop(channel, None)
        if subscriber is not None:
            for mailbox in self._mailboxes.get(channel, ()):
                subscriber.undeliver(channel, mailbox)
        return subscriber

    async def unsubscribe(self, channel: str, *, confirm: bool) -> None:
        orphans = self._orphans.get(channel, 0)
        if orphans:
            # Counts are interchangeable: giving back a reference without a subscription
            # keeps the node's subscription for the waiters that remain.
            if orphans > 1:
                self._orphans[channel] = orphans - 1
            else:
                del self._orphans[channel]
            self._forget(channel)
            return
        subscriber = self._route.get(channel)
        self._forget(channel)
        if subscriber is not None:
            await subscriber.unsubscribe(channel, confirm=confirm)

    def _moved(self, subscriber: _Subscriber, channel: str, refs: int) -> None:
        """``subscriber``'s node dropped ``channel`` (its slot moved), with ``refs``
        references: they wait without a subscription until it is made on the new owner."""
        if self._route.get(channel) is not subscriber:
            return  # a lingering channel, routed nowhere: nobody waits on it
        del self._route[channel]
        for mailbox in self._mailboxes.get(channel, ()):
            subscriber.undeliver(channel, mailbox)
        if not refs or self._closed:
            return
        # (Never more than the references counted here: one whose subscribe was still
        # waiting for its confirmation is failed by the node and given back by itself.)
        orphans = min(self._orphans.get(channel, 0) + refs, self._refs.get(channel, 0))
        self._orphans[channel] = orphans
        logger.info("%s: %s moved off its node; subscribing on its new owner", self._where, channel)
        self._tasks.spawn(self._resubscribe(channel), name=f"asynclock-resubscribe:{channel}")

    async def _resubscribe(self, channel: str) -> None:
        """Subscribe ``channel`` on its slot's new owner for the waiters it still has,
        then wake them: a release may have gone out while it was not subscribed."""
        try:
            if self._orphans.get(channel):
                with map_backend_errors(self._where, _DRIVER_ERRORS):
                    await self._client.nodes_manager.initialize()  # learn the new owner
                if self._orphans.get(channel):
                    # As one more waiter: its subscribe takes the orphans over.
                    await self.subscribe(channel)
                    await self.unsubscribe(channel, confirm=False)
        except BackendError as exc:
            if self._closed:
                return
            logger.warning(
                "%s: subscribing to %s on its new node failed (%s); its waiters retry on "
                "their timers",
                self._where,
                channel,
                exc,
            )
        self._wake(channel)

    def _wake(self, channel: str) -> None:
        """Waiters on ``channel`` try again, its listeners look again."""
        key = channel[: -len(self._inbox)] if channel.endswith(self._inbox) else channel
        self._hub_.notify_all(key)
        for mailbox in self._mailboxes.get(channel, ()):
            mailbox.put("")

    async def aclose(self) -> None:
        self._closed = True
        for subscriber in list(self._nodes.values()):
            await subscriber.aclose()
        await self._tasks.close(5.0)  # resubscribes: they fail now, closed
