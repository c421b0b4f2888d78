"""The peers, each used the way its documentation shows, on the same servers.

- redis-py's asyncio ``Lock`` (``client.lock(name, timeout=, sleep=)``), with its default
  ``sleep=0.1`` and with ``sleep=0.001``;
- python-redis-lock (``with redis_lock.Lock(conn, name, expire=)``): a synchronous
  library, so uncontended it blocks the event loop for each call and contended it runs
  one thread per waiter, as its documentation says for threads;
- pottery's ``AIORedlock`` (``async with AIORedlock(key=, masters=)``), one lock object
  per worker, on 1 and on N nodes;
- aioredlock (``await manager.lock(name, lock_timeout=)`` / ``manager.unlock(lock)``),
  one manager per application, on 1 and on N nodes. Its ``lock()`` gives up with
  ``LockError`` after 3 tries; a waiter that wants the lock calls it again.

Contended, every waiter gets its own client (its own connections), as a waiter in
another process would; the waiters share nothing but the server.

The blocking peers, for the rows of ``asynclock.sync`` (:func:`build_sync_peer`), are
timed from a thread with redis-py's blocking client:

- redis-py's ``redis.lock.Lock`` (``client.lock(name, timeout=, sleep=0.001)``): it
  polls, sleeping ``sleep`` between tries (0.1 s by default; 1 ms here, the smallest
  that is not a busy loop);
- python-redis-lock (``redis_lock.Lock(conn, name, expire=)``): a waiter blocks in
  ``BLPOP`` on a signal list that the release pushes to (it is woken, not polling);
- pottery's ``Redlock(key=, masters={client}, auto_release_time=)`` on one node: it polls,
  sleeping a random 0-0.2 s between tries (a class constant, no documented setting: left
  as shipped), and runs each acquire and release in a thread pool.

Peers are imported by name at run time (they are optional: the ``bench`` extra), so a
missing or broken one becomes a reason in the report rather than an import error.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ._measure import AsyncHold, Op, SyncHold

__all__ = (
    "PEER_LOGGERS",
    "SYNC_PEERS",
    "Peer",
    "PeerUnavailable",
    "SyncPeer",
    "build_peer",
    "build_sync_peer",
    "peer_label",
    "sync_peer_label",
)

BENCH_HINT = "pip install 'asynclock[bench]'"
LEASE_SECONDS = 30
#: redis-py's blocking ``Lock`` sleeps this long between tries (its default is 0.1 s).
SYNC_POLL_SECONDS = 0.001
#: The blocking peers, in the order of the report.
SYNC_PEERS = ("redis-py", "python-redis-lock", "pottery")
# Loggers of the peers: their error logs (a frozen node, a cancelled wait) would scribble
# over the progress display; the outcome is in the report instead.
PEER_LOGGERS = ("aioredis", "aioredlock", "pottery", "redis_lock")


class PeerUnavailable(Exception):
    """A peer that cannot be imported or set up here; the message says why."""


@dataclass
class Peer:
    """One peer set up on some nodes: how to time it, how to contend with it, how to close.

    ``hold(i)`` sets waiter ``i`` up (its own client) and gives it a fresh context manager
    per acquisition (async peers); ``hold_sync`` and ``nudge`` are the thread-based
    equivalent for a synchronous peer. Clients made for waiters join ``closers``.
    """

    label: str
    op: Op
    hold: Callable[[int], AsyncHold] | None = None
    hold_sync: Callable[[int], SyncHold] | None = None
    nudge: Callable[[], None] | None = None
    closers: list[Callable[[], Awaitable[object]]] = field(default_factory=list)

    async def close(self) -> None:
        """Close every client this peer opened; errors are ignored (the run is over)."""
        for close in self.closers:
            with contextlib.suppress(Exception):
                await close()


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PeerUnavailable(f"not installed ({BENCH_HINT}): {exc}") from None
    except Exception as exc:  # a broken install: say what broke
        raise PeerUnavailable(f"cannot be imported: {type(exc).__name__}: {exc}") from None


def build_peer(kind: str, urls: list[str], key: str, *, bound: float) -> Peer:
    """Set up peer ``kind`` on ``urls`` (one for single-node peers) using lock name ``key``.

    ``kind`` is one of ``redis-py``, ``redis-py-1ms``, ``python-redis-lock``,
    ``pottery``, ``aioredlock``. Raises :class:`PeerUnavailable`.
    """
    builders: dict[str, Callable[[], Peer]] = {
        "redis-py": lambda: _redis_py(urls[0], key, sleep=0.1),
        "redis-py-1ms": lambda: _redis_py(urls[0], key, sleep=0.001),
        "python-redis-lock": lambda: _python_redis_lock(urls[0], key, bound),
        "pottery": lambda: _pottery(urls, key),
        "aioredlock": lambda: _aioredlock(urls, key),
    }
    try:
        return builders[kind]()
    except PeerUnavailable:
        raise
    except Exception as exc:
        raise PeerUnavailable(f"cannot be set up: {type(exc).__name__}: {exc}") from None


def peer_label(kind: str, nodes: int) -> str:
    """The name a peer has in the report."""
    labels = {
        "redis-py": "redis-py Lock (sleep=0.1)",
        "redis-py-1ms": "redis-py Lock (sleep=0.001)",
        "python-redis-lock": "python-redis-lock (sync)",
        "pottery": "pottery AIORedlock",
        "aioredlock": "aioredlock",
    }
    label = labels[kind]
    if kind in ("pottery", "aioredlock"):
        label += f" {nodes} node{'s' if nodes > 1 else ''}"
    return label


def _redis_py(url: str, key: str, *, sleep: float) -> Peer:
    asyncio_redis = _import("redis.asyncio")
    client = asyncio_redis.Redis.from_url(url)

    async def op() -> None:
        async with client.lock(key, timeout=LEASE_SECONDS, sleep=sleep):
            pass

    def worker(_i: int) -> AsyncHold:
        own = asyncio_redis.Redis.from_url(url)
        peer.closers.append(own.aclose)

        def hold() -> AbstractAsyncContextManager[object]:
            lock: AbstractAsyncContextManager[object] = own.lock(
                key, timeout=LEASE_SECONDS, sleep=sleep
            )
            return lock

        return hold

    kind = "redis-py" if sleep == 0.1 else "redis-py-1ms"
    peer = Peer(peer_label(kind, 1), op, hold=worker, closers=[client.aclose])
    return peer


def _python_redis_lock(url: str, key: str, bound: float) -> Peer:
    redis_lock = _import("redis_lock")
    sync_redis = _import("redis")
    # Uncontended calls never block in BLPOP, so a socket timeout bounds a stuck server;
    # waiters do block there (up to the lock's expire), so their clients have none.
    quick = sync_redis.Redis.from_url(url, socket_timeout=bound, socket_connect_timeout=bound)
    clients = [quick]

    async def op() -> None:
        with redis_lock.Lock(quick, key, expire=LEASE_SECONDS):
            pass

    def worker(_i: int) -> SyncHold:
        own = sync_redis.Redis.from_url(url, socket_connect_timeout=bound)
        clients.append(own)

        def hold() -> AbstractContextManager[object]:
            lock: AbstractContextManager[object] = redis_lock.Lock(own, key, expire=LEASE_SECONDS)
            return lock

        return hold

    def nudge() -> None:
        # What a release sends: wakes one waiter blocked in BLPOP on the signal list.
        quick.lpush(f"lock-signal:{key}", 1)

    async def close() -> None:
        for client in clients:
            client.connection_pool.disconnect()
            client.close()

    return Peer(
        peer_label("python-redis-lock", 1),
        op,
        hold_sync=worker,
        nudge=nudge,
        closers=[close],
    )


def _pottery(urls: list[str], key: str) -> Peer:
    pottery = _import("pottery")
    asyncio_redis = _import("redis.asyncio")
    masters = [asyncio_redis.Redis.from_url(url) for url in urls]
    shared = pottery.AIORedlock(key=key, masters=masters, auto_release_time=LEASE_SECONDS)

    async def op() -> None:
        async with shared:
            pass

    def worker(_i: int) -> AsyncHold:
        own_masters = [asyncio_redis.Redis.from_url(url) for url in urls]
        peer.closers.extend(m.aclose for m in own_masters)
        # The lock object keeps its holder's uuid: one per worker, reused as documented.
        own = pottery.AIORedlock(key=key, masters=own_masters, auto_release_time=LEASE_SECONDS)

        def hold() -> AbstractAsyncContextManager[object]:
            lock: AbstractAsyncContextManager[object] = own
            return lock

        return hold

    peer = Peer(
        peer_label("pottery", len(urls)),
        op,
        hold=worker,
        closers=[m.aclose for m in masters],
    )
    return peer


def _aioredlock(urls: list[str], key: str) -> Peer:
    aioredlock = _import("aioredlock")
    manager = aioredlock.Aioredlock(list(urls))
    lock_error: type[Exception] = aioredlock.LockError

    async def op() -> None:
        lock = await manager.lock(key, lock_timeout=LEASE_SECONDS)
        await manager.unlock(lock)

    def worker(_i: int) -> AsyncHold:
        own = aioredlock.Aioredlock(list(urls))  # one lock manager per application
        peer.closers.append(own.destroy)

        @contextlib.asynccontextmanager
        async def hold() -> AsyncIterator[object]:
            while True:  # lock() tries 3 times, 0.1-0.3 s apart, then raises LockError
                try:
                    lock = await own.lock(key, lock_timeout=LEASE_SECONDS)
                    break
                except lock_error:
                    continue
            try:
                yield lock
            finally:
                await own.unlock(lock)

        return hold

    peer = Peer(
        peer_label("aioredlock", len(urls)),
        op,
        hold=worker,
        closers=[manager.destroy],
    )
    return peer


# -- blocking peers (for asynclock.sync) --------------------------------------------------


@dataclass
class SyncPeer:
    """A blocking peer on one node: ``op()`` times it, ``hold(i)`` sets thread ``i`` up
    (its own client) for a contended run, ``nudge()`` wakes threads blocked in the
    library's own wait, ``close()`` closes every client it opened."""

    label: str
    op: Callable[[], object]
    hold: Callable[[int], SyncHold]
    nudge: Callable[[], None]
    clients: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Close every client this peer opened; errors are ignored (the run is over)."""
        for client in self.clients:
            with contextlib.suppress(Exception):
                client.connection_pool.disconnect()
                client.close()


def sync_peer_label(kind: str) -> str:
    """The name a blocking peer has in the report."""
    return {
        "redis-py": f"redis-py Lock (sleep={SYNC_POLL_SECONDS:g})",
        "python-redis-lock": "python-redis-lock",
        "pottery": "pottery Redlock 1 node",
    }[kind]


def build_sync_peer(kind: str, url: str, key: str, *, bound: float) -> SyncPeer:
    """Set up blocking peer ``kind`` (one of :data:`SYNC_PEERS`) on ``url`` with lock
    name ``key``. Its uncontended client times out after ``bound`` seconds (no call of an
    uncontended lock blocks); its waiters' clients do not when the peer waits in a
    blocking command. Raises :class:`PeerUnavailable`."""
    builders: dict[str, Callable[[], SyncPeer]] = {
        "redis-py": lambda: _sync_redis_py(url, key, bound),
        "python-redis-lock": lambda: _sync_python_redis_lock(url, key, bound),
        "pottery": lambda: _sync_pottery(url, key, bound),
    }
    try:
        return builders[kind]()
    except PeerUnavailable:
        raise
    except Exception as exc:
        raise PeerUnavailable(f"cannot be set up: {type(exc).__name__}: {exc}") from None


def _sync_client(url: str, bound: float, *, blocking_waits: bool = False) -> Any:
    sync_redis = _import("redis")
    timeout = None if blocking_waits else bound
    return sync_redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=bound)


def _no_nudge() -> None:
    """Polling waiters need no wake-up: they see the flag at their next try."""


def _sync_redis_py(url: str, key: str, bound: float) -> SyncPeer:
    quick = _sync_client(url, bound)
    clients = [quick]

    def op() -> None:
        with quick.lock(key, timeout=LEASE_SECONDS, sleep=SYNC_POLL_SECONDS):
            pass

    def worker(_i: int) -> SyncHold:
        own = _sync_client(url, bound)
        clients.append(own)

        def hold() -> AbstractContextManager[object]:
            lock: AbstractContextManager[object] = own.lock(
                key, timeout=LEASE_SECONDS, sleep=SYNC_POLL_SECONDS
            )
            return lock

        return hold

    return SyncPeer(sync_peer_label("redis-py"), op, worker, _no_nudge, clients)


def _sync_python_redis_lock(url: str, key: str, bound: float) -> SyncPeer:
    redis_lock = _import("redis_lock")
    quick = _sync_client(url, bound)
    clients = [quick]

    def op() -> None:
        with redis_lock.Lock(quick, key, expire=LEASE_SECONDS):
            pass

    def worker(_i: int) -> SyncHold:
        own = _sync_client(url, bound, blocking_waits=True)  # waiters block in BLPOP
        clients.append(own)

        def hold() -> AbstractContextManager[object]:
            lock: AbstractContextManager[object] = redis_lock.Lock(own, key, expire=LEASE_SECONDS)
            return lock

        return hold

    def nudge() -> None:
        # What a release sends: wakes one waiter blocked in BLPOP on the signal list.
        quick.lpush(f"lock-signal:{key}", 1)

    return SyncPeer(sync_peer_label("python-redis-lock"), op, worker, nudge, clients)


def _sync_pottery(url: str, key: str, bound: float) -> SyncPeer:
    pottery = _import("pottery")
    quick = _sync_client(url, bound)
    clients = [quick]
    shared = pottery.Redlock(key=key, masters={quick}, auto_release_time=LEASE_SECONDS)

    def op() -> None:
        with shared:
            pass

    def worker(_i: int) -> SyncHold:
        own_client = _sync_client(url, bound)
        clients.append(own_client)
        # The lock object keeps its holder's uuid: one per thread, reused as documented.
        own = pottery.Redlock(key=key, masters={own_client}, auto_release_time=LEASE_SECONDS)

        def hold() -> AbstractContextManager[object]:
            lock: AbstractContextManager[object] = own
            return lock

        return hold

    return SyncPeer(sync_peer_label("pottery"), op, worker, _no_nudge, clients)
