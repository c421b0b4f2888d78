"""Redis clients from URLs: one node, a Sentinel-managed master, or a Redis Cluster.

This module owns how asynclock makes a ``redis.asyncio`` client of its own (the URL
schemes, the connection defaults, which keyword options go to redis-py and which to the
backend), how a client is named in messages (never with its credentials) and how such a
client is closed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

__all__ = (
    "BACKEND_OPTIONS",
    "backend_options",
    "client_from_url",
    "close_client",
    "describe_client",
    "describe_pool",
)

# The keyword options of RedisBackend.from_url that are the backend's, not the pool's.
BACKEND_OPTIONS = (
    "prefix",
    "fence_retention",
    "sync_replicas",
    "sync_timeout",
    "clock",
    "drift_factor",
    "drift_base",
)

# No CLIENT SETINFO on connect: a new connection then costs no round trip, so one to a
# node that stopped answering fails by the node's own timeout, not inside connect().
# redis-py >= 7 says so with driver_info=None; older versions with lib_name/lib_version.
try:
    import redis.driver_info as _driver_info  # noqa: F401 - only probing for the newer API

    _NO_SETINFO: dict[str, Any] = {"driver_info": None}
except ImportError:  # pragma: no cover - older redis-py
    _NO_SETINFO = {"lib_name": None, "lib_version": None}


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


def describe_client(client: Redis | RedisCluster) -> str:
    """Where ``client`` connects (as :func:`describe_pool`; ``Cluster h:p,h:p`` for a
    cluster client's startup nodes), never its credentials."""
    if isinstance(client, RedisCluster):
        return f"Cluster {','.join(client.nodes_manager.startup_nodes)}"
    return describe_pool(client.connection_pool)


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
    ours = frozenset({"max_connections", *BACKEND_OPTIONS})
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
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **credentials, **options)  # type: ignore[no-untyped-call,unused-ignore]
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


async def close_client(client: Redis | RedisCluster) -> None:
    """Close a client made by :func:`client_from_url`, and for Sentinel the clients of
    the sentinels it asked."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    sentinel: Sentinel | None = getattr(pool, "asynclock_sentinel", None)
    if sentinel is not None:
        for sentinel_client in sentinel.sentinels:
            await sentinel_client.aclose()
