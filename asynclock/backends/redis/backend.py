"""``RedisBackend``: the Backend contract on one Redis or Valkey node, a Sentinel-managed
master, or a Redis Cluster.

Every state change is one Lua script (:mod:`.scripts`): locks, fair locks, readers of
read-write locks, semaphore permits. This module decides which call each operation
makes (:mod:`.calls`, on the names of :mod:`.keys`) and what its reply means; the call
goes out over the node's link (:mod:`.transport`), and waiters sleep on pub/sub
(:mod:`.pubsub`). It is also the node that Redlock composes: what Redlock needs of a
node is public here (:meth:`RedisBackend.sender`, :attr:`~RedisBackend.subscriber`,
:meth:`~RedisBackend.share_hub`, :attr:`~RedisBackend.address`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from ..._clock import Clock
from ..._errors import BackendError
from ..._kind import PERMIT, SHARED
from ..._tasks import TaskSet
from ..._validate import check_number
from ..._wakeup import Mailbox, WakeHub, WakeSlot
from ..base import Attempt, Backend, Claim, GiveBack, Interrupted, Kind, LockInfo, owner_of
from .calls import EXTEND_CHUNK, RELEASED_MARGIN_MS, Call, Calls
from .clients import BACKEND_OPTIONS, client_from_url, close_client, describe_client
from .keys import Keys, KeySchema, check_prefix
from .pipe import Callback, Pipe
from .pubsub import Listener, ShardedSubscriber, Subscriber, Waiter
from .transport import Link, Transport, link_for, text

__all__ = ("RedisBackend",)

logger = logging.getLogger("asynclock.redis")


class RedisBackend(Backend):
    """Locks on one Redis/Valkey node, a Sentinel-managed master, or a Redis Cluster.

    ``client`` is a ``redis.asyncio.Redis`` (a plain one, or ``Sentinel.master_for()``'s)
    or a ``redis.asyncio.cluster.RedisCluster`` the application owns: it is not closed by
    ``aclose()``. Keys are ``{prefix}:{{name}}`` (the lock), ``{prefix}:{{name}}:fence``
    (the fence counter) and the channel ``{prefix}:{{name}}:wake``: one hash tag, one
    Cluster slot. The fence counter expires ``fence_retention`` seconds (at least 2 ttl)
    after the lock was last taken or renewed; fences then continue from the server's clock
    in microseconds (README).

    Read-write locks, semaphores and fair locks (:class:`~asynclock.backends.Kind`)
    run on the same node or slot; their keys are listed in :mod:`.scripts`. Readers hold
    the lock key itself (with a mark, expiring with the last reader), so writers and
    plain locks of the name exclude them at no extra cost.

    ``sync_replicas=N`` (not on Cluster): after a grant, ``WAIT N`` on the same connection
    until N replicas have the key, at most ``sync_timeout`` seconds; fewer confirmations
    fail the acquire with ``BackendError`` (and the grant is released). It makes losing a
    lock in a failover less likely, not impossible: fences still decide (README).
    """

    kinds = frozenset(Kind)

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
        check_prefix(prefix)
        if isinstance(sync_replicas, bool) or not isinstance(sync_replicas, int):
            raise TypeError(f"sync_replicas must be an int, got {type(sync_replicas).__name__}")
        if sync_replicas < 0:
            raise ValueError(f"sync_replicas must be >= 0, got {sync_replicas}")
        self._sync_replicas = sync_replicas
        self._sync_timeout_ms = math.ceil(
            check_number("sync_timeout", sync_timeout, positive=True) * 1000
        )
        if isinstance(client, RedisCluster) and sync_replicas:
            raise ValueError(
                "sync_replicas is not supported on Redis Cluster (WAIT needs the "
                "connection that wrote, which the cluster client does not expose)"
            )
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._address = describe_client(client)
        self._where = f"Redis {self._address}"
        # This backend's own id: its queued waiters are woken on channels ending in it.
        self._schema = KeySchema(prefix, inbox=secrets.token_hex(8), cluster=self._cluster)
        self._prefix = prefix
        # The fast pipelined connection where the pool's settings allow it, else
        # redis-py's (Sentinel, TLS, ...; and for WAIT, which blocks its connection).
        self._link: Link = link_for(client, pipelined=not sync_replicas)
        self._transport = Transport(self._link, self._where)
        self._hub = WakeHub()
        self._subscriber: Subscriber | ShardedSubscriber
        inbox = self._schema.inbox_suffix
        if isinstance(client, RedisCluster):
            self._subscriber = ShardedSubscriber(client, self._hub, self._where, inbox=inbox)
        else:
            pool = client.connection_pool
            self._subscriber = Subscriber(pool, self._hub, self._where, inbox=inbox)
        retention_ms = math.ceil(
            check_number("fence_retention", fence_retention, positive=True) * 1000
        )
        self._owns_client = False
        self._calls = Calls(
            inbox=self._schema.inbox_id,
            retention_ms=retention_ms,
            released_ms=math.ceil(self._socket_timeout() * 1000) + RELEASED_MARGIN_MS,
        )
        # Waiters leaving the queue and their channel after giving up (see Waiter).
        self._tasks = TaskSet(f"waiters of {self._where}")

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 64, **options: Any) -> RedisBackend:
        """A backend on a client of its own (closed by ``aclose()``) with a blocking pool.

        ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://h:p,h:p/service[/db]``
        and ``redis+cluster://h:p[,h:p]``. Under load, extra concurrent operations queue for
        a free connection rather than fail (Sentinel and Cluster pools raise instead).
        ``options`` not meant for :class:`RedisBackend` go to the connection pool.
        """
        own = {k: options.pop(k) for k in BACKEND_OPTIONS if k in options}
        backend = cls(client_from_url(url, max_connections=max_connections, **options), **own)
        backend._owns_client = True
        return backend

    # -- what Redlock composes -------------------------------------------------------

    @property
    def address(self) -> str:
        """Where this node is: ``host:port/db``, ``unix://path/db``, ``sentinel service
        name/db`` or ``Cluster h:p,h:p``; never credentials."""
        return self._address

    @property
    def subscriber(self) -> Subscriber | ShardedSubscriber:
        """The node's pub/sub client: ``subscribe(channel)``, ``unsubscribe(channel,
        confirm=)``, and ``deliver``/``undeliver`` of a channel's messages to a mailbox.
        Its wake-ups go to this backend's hub (see :meth:`share_hub`)."""
        return self._subscriber

    def share_hub(self, hub: WakeHub) -> None:
        """Deliver this node's wake-ups to ``hub`` (Redlock: one hub for all its nodes)."""
        self._hub = hub
        self._subscriber.hub = hub

    def sender(self) -> Callable[[bytes, Callback], None] | None:
        """How to send a packed request (:func:`.pipe.pack`) on this node's pipelined
        connection right now: a function of ``(request, callback)`` that writes it at once
        and hands its reply, or the error, to ``callback``. None when the node has no
        connected pipelined connection (TLS, Sentinel, ``sync_replicas``, not connected
        yet): use :meth:`run` then. No I/O here."""
        link = self._link
        proto = link.ready() if isinstance(link, Pipe) else None
        return None if proto is None else proto.request

    # -- keys ------------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        """On Cluster, a name starting with ``}`` is refused: its keys ``prefix:{}…`` have
        an empty hash tag, so Cluster would hash each whole key and scatter the lock and
        its fence over different slots (``CROSSSLOT``)."""
        self._schema.check_name(name)

    def keys(self, name: str) -> Keys:
        """The lock key, fence counter key, wake-up channel and waiter queue of ``name``
        (and, as properties, its readers' and its semaphore's keys)."""
        return self._schema.keys(name)

    def _claim_keys(self, claim: Claim) -> Keys:
        keys = claim.handle
        if keys is None:
            keys = claim.handle = self._schema.keys(claim.name)
        return keys  # type: ignore[no-any-return]

    def channel(self, name: str) -> str:
        """The pub/sub channel that wakes waiters for ``name`` (Redlock's, which do not
        queue; queued waiters hear their own :meth:`inbox`)."""
        return self._schema.channel(name)

    def inbox(self, name: str) -> str:
        """The channel on which this backend's queued waiters for ``name`` are woken."""
        return self._schema.inbox(name)

    def topic_channel(self, topic: str) -> str:
        """The pub/sub channel of a topic (an election's announcements)."""
        return self._schema.topic_channel(topic)

    async def run_id(self) -> str:
        """The server's ``run_id`` (``INFO server``): one per server process, whatever
        address it was reached by. Raises :class:`BackendError` if it cannot be read."""
        reply = await self._transport.execute("INFO", "server")
        if isinstance(reply, dict):  # parsed by redis-py
            found = reply.get("run_id")
        else:
            fields = dict(
                line.partition(":")[::2] for line in text(reply).splitlines() if ":" in line
            )
            found = fields.get("run_id")
        if not found:
            raise BackendError(f"{self._where} reported no run_id in INFO server")
        return str(found)

    # -- script calls (also the building blocks of Redlock) ---------------------------
    #
    # Each operation is a call (script, number of keys, arguments): the same for every
    # node, which is what lets Redlock send one packed command to all of them. They are
    # built by :class:`.calls.Calls`; see there for what each script answers.

    @property
    def calls(self) -> Calls:
        """The script-call builders of this node (the same for every node of a Redlock)."""
        return self._calls

    async def run(self, call: Call) -> Any:
        """Run a call on this node: the script's raw reply. Raises ``BackendError``."""
        return await self._transport.run(call)

    async def acquire_keys(
        self, keys: Keys, value: str, ttl: float, floor: int | None = None
    ) -> int:
        """:meth:`Calls.acquire <.calls.Calls.acquire>`'s reply, run on this node."""
        return int(await self.run(self._calls.acquire(keys, value, ttl, floor)))

    async def extend_keys(self, keys: Keys, value: str, ttl: float) -> bool:
        """Whether :meth:`Calls.extend <.calls.Calls.extend>` extended, run on this node."""
        return bool(await self.run(self._calls.extend(keys, value, ttl)) == 1)

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
        for start in range(0, len(items), EXTEND_CHUNK):
            chunk = items[start : start + EXTEND_CHUNK]
            replies = await self._transport.run(self._calls.extend_many(chunk))
            results += [reply == 1 for reply in replies]
        return results

    async def release_keys(self, keys: Keys, value: str) -> bool:
        """Whether :meth:`Calls.release <.calls.Calls.release>` released, run on this node."""
        return bool(await self.run(self._calls.release(keys, value)) == 1)

    async def inspect_keys(self, keys: Keys) -> tuple[str, float, int] | None:
        """``(holder value, seconds left, fence counter)`` or None when free; while
        readers hold, the reader whose lease ends last and its fence."""
        reply = await self._transport.run(self._calls.inspect(keys))
        if reply is None:
            return None
        value, pttl, fence = reply
        return text(value), (math.inf if pttl < 0 else pttl / 1000), int(fence or 0)

    # -- the Backend interface -------------------------------------------------------

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        # A caller that will wait joins the queue in the same script, so that a release
        # wakes it alone rather than every waiter of every client.
        queue = None if wait == 0 else claim.recheck
        keys = self._claim_keys(claim)
        call = self._calls.acquire_claim(keys, claim, ttl, queue)
        if self._sync_replicas:
            reply = await self._acquire_synced(call, self._calls.release_claim(keys, claim))
        else:
            reply = int(await self.run(call))
        if reply > 0:
            return Attempt(reply)
        return Attempt(None, -reply / 1000 if reply < 0 else None)

    async def _acquire_synced(self, call: Call, undo: Call) -> int:
        """The acquire, then ``WAIT`` for ``sync_replicas`` (see
        :meth:`.transport.Transport.run_synced`); too few confirmations raise
        ``BackendError`` (the grant was given back)."""
        wanted = self._sync_replicas
        reply, confirmed = await self._transport.run_synced(
            call, undo, wanted, self._sync_timeout_ms
        )
        if confirmed < wanted:
            raise BackendError(
                f"{self._where}: the lock reached {confirmed} of the {wanted} replicas "
                f"sync_replicas asks for within {self._sync_timeout_ms / 1000:g}s"
            )
        return reply

    async def extend(self, claim: Claim, ttl: float) -> bool:
        call = self._calls.extend_claim(self._claim_keys(claim), claim, ttl)
        return bool(await self.run(call) == 1)

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        # Locks go in batches (one script call per chunk); readers and permits, each in
        # a set of its own, one call each, all at once.
        alone = (PERMIT, SHARED)
        plain = [i for i, (claim, _) in enumerate(items) if claim.kind not in alone]
        results: list[bool | None] = [None] * len(items)
        others = [i for i, (claim, _) in enumerate(items) if claim.kind in alone]
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
        call = self._calls.release_claim(self._claim_keys(claim), claim)
        return bool(await self.run(call) == 1)

    async def inspect(self, name: str) -> LockInfo | None:
        found = await self.inspect_keys(self._schema.keys(name))
        if found is None:
            return None
        value, expires_in, fence = found
        return LockInfo(name, owner_of(value), expires_in, fence)

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        keys = self._schema.keys(name)
        return Waiter(
            self._hub,
            self._subscriber,
            self._tasks,
            channel=keys.channel,
            inbox=self._schema.inbox(name),
            dequeue=functools.partial(self._dequeue, keys),
        )

    async def _dequeue(self, keys: Keys, value: str) -> None:
        """Leave the waiter queue, best effort: a place lapses on its own anyway."""
        try:
            await self.run(self._calls.dequeue(keys, value))
        except BackendError as exc:
            logger.debug("leaving the waiter queue on %s failed: %s", self._where, exc)

    async def publish(self, topic: str, message: str) -> None:
        command = "SPUBLISH" if self._cluster else "PUBLISH"
        await self._transport.execute(command, self._schema.topic_channel(topic), message)

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return Listener(self._subscriber, self._schema.topic_channel(topic))

    async def aclose(self) -> None:
        # Give-ups on their way out of the queue (each bounded by the socket timeout): a
        # waiter waits for its leave only briefly, so closing is where they finish.
        await self._tasks.close(5.0)
        await self._subscriber.aclose()
        await self._link.aclose()
        if self._owns_client:
            await close_client(self._client)

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        keys = self._claim_keys(claim)
        if interrupted is Interrupted.ANSWERED:
            await self._dequeue(keys, claim.value)
            return GiveBack(False)
        # The attempt may also have joined the waiter queue: leave it in the same round
        # trip (after the release, on a pipelined link).
        released, _ = await asyncio.gather(self.release(claim), self._dequeue(keys, claim.value))
        return GiveBack(released, self.late_landing(interrupted))

    def late_landing(self, interrupted: Interrupted) -> float:
        """Seconds, beyond a lease's TTL, during which an acquire interrupted as
        ``interrupted`` may still reach this server after a later request was answered
        (:attr:`GiveBack.late`; Redlock asks each of its nodes).

        0 after a cancel on the pipelined connection: it abandons the cancelled request's
        reply and keeps going, so the give-back follows it in order. Otherwise the socket
        timeout: a timed-out request's connection is dropped and the give-back goes out on
        a new one (or another pooled connection), which a proxy may deliver first.
        """
        if interrupted is Interrupted.ANSWERED:
            return 0.0
        if interrupted is Interrupted.CANCELLED and isinstance(self._link, Pipe):
            return 0.0
        return self._socket_timeout()

    def _socket_timeout(self) -> float:
        if isinstance(self._client, RedisCluster):
            kwargs = self._client.get_connection_kwargs()
        else:
            kwargs = self._client.connection_pool.connection_kwargs
        return float(kwargs.get("socket_timeout") or 5.0)

    def describe(self) -> str:
        return f"RedisBackend {self._address} prefix={self._prefix!r}"

    # -- introspection for tests and stats -------------------------------------------

    @property
    def client(self) -> Redis | RedisCluster:
        """The redis.asyncio client in use."""
        return self._client

    def waiting(self, name: str | None = None) -> int:
        """Tasks of this coordinator waiting for a wake-up (for ``name``, or all)."""
        return self._hub.waiting(None if name is None else self._schema.channel(name))

    def subscribed(self) -> list[str]:
        """Channels the shared pub/sub connection is subscribed to (or subscribing)."""
        return self._subscriber.channels()
