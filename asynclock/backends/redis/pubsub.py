"""Wake-ups over pub/sub: the node's pub/sub client, and the waiters and listeners on it.

A waiter registers a slot in the backend's wake-up hub, then subscribes to its inbox
channel; the release scripts publish there, and the subscriber turns each message into a
wake-up in the hub (or a message in a listener's mailbox).
One node has one :class:`Subscriber` (one pub/sub connection for every waiter of a
coordinator); a Redis Cluster has a :class:`ShardedSubscriber`, one per node. Redlock
shares one hub between the subscribers of all its nodes (:attr:`Subscriber.hub`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from ..._backoff import Backoff
from ..._cancel import undo_on_interrupt
from ..._errors import BackendError, map_backend_errors
from ..._tasks import TaskSet
from ..._types import ExcType, ExcValue, Traceback
from ..._wakeup import Mailbox, WakeHub, WakeSlot
from .transport import DRIVER_ERRORS, text

__all__ = ("LINGER", "Listener", "ShardedSubscriber", "Subscriber", "Waiter")

logger = logging.getLogger("asynclock.redis")

# How long a wake-up channel stays subscribed after its last waiter got the lock.
LINGER = 1.0

# Replies of shard channels (Cluster), handled as their plain counterparts.
_SHARD_KINDS = frozenset(("smessage", "ssubscribe", "sunsubscribe"))


class Waiter:
    """``backend.waiter(name)``: a slot in ``hub`` for ``channel`` (the name's wake-up
    channel), registered before subscribing to ``inbox`` (this backend's channel of the
    name) on ``subscriber``.

    The slot's ``tag`` is the waiting claim's value (set by the lock): a release that
    names it in its message wakes this slot alone ("*" wakes every slot of the name: the
    readers after a writer). Leaving without the lock (timed out, cancelled) takes the
    claim out of whichever of the name's waiter queues it is in (lock, readers, permits):
    ``dequeue(value)`` does that, best effort, in a task of ``tasks``.
    """

    __slots__ = ("_channel", "_dequeue", "_hub", "_inbox", "_slot", "_subscriber", "_tasks")

    def __init__(
        self,
        hub: WakeHub,
        subscriber: Subscriber | ShardedSubscriber,
        tasks: TaskSet,
        *,
        channel: str,
        inbox: str,
        dequeue: Callable[[str], Awaitable[None]],
    ) -> None:
        self._hub = hub
        self._subscriber = subscriber
        self._tasks = tasks
        self._channel = channel
        self._inbox = inbox
        self._dequeue = dequeue
        self._slot: WakeSlot | None = None

    async def __aenter__(self) -> WakeSlot:
        slot = self._slot = self._hub.register(self._channel)
        with undo_on_interrupt(self._hub.unregister, slot):
            await self._subscriber.subscribe(self._inbox)
        return slot

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        slot = self._slot
        assert slot is not None
        self._hub.unregister(slot)
        if exc_type is None or slot.tag is None:
            # Granted: the acquire script took the claim out of the queue already.
            await self._subscriber.unsubscribe(self._inbox, confirm=False)
            return
        # A waiter that gives up (cancelled, timed out) leaves the queue, and leaves only
        # once the server has dropped its subscription: both round trips at once. In a
        # task of the backend's: a cancel landing here (a second one, a timeout firing
        # while a LockTimeout leaves) must not stop them before they start, which kept
        # the place in the queue until it lapsed and the channel subscribed for good.
        self._tasks.spawn_unless_closed(
            self._leave(slot.tag), name=f"asynclock-leave-wait:{self._channel}"
        )
        # Not waited for: the caller's deadline and cancel come first (a server that
        # stopped answering would hold a LockTimeout back). The leave goes on in the
        # background, owned by the backend, which aclose() waits for (bounded). One turn
        # of the loop lets it start. The caller's next request may still reach the server
        # before the DEQUEUE: a retry then queues behind its own old place, and the
        # DEQUEUE, finding that place first in line, wakes the retry (see scripts.DEQUEUE).
        await asyncio.sleep(0)

    async def _leave(self, value: str) -> None:
        try:
            await asyncio.gather(
                self._dequeue(value),
                self._subscriber.unsubscribe(self._inbox, confirm=True),
            )
        except BackendError as exc:  # best effort: the place lapses by itself
            logger.debug("leaving the wait on %s failed: %s", self._channel, exc)


class Listener:
    """``backend.listen(topic)``: a mailbox fed by the shared pub/sub connection."""

    __slots__ = ("_channel", "_mailbox", "_subscriber")

    def __init__(self, subscriber: Subscriber | ShardedSubscriber, channel: str) -> None:
        self._subscriber = subscriber
        self._channel = channel
        self._mailbox = Mailbox()

    async def __aenter__(self) -> Mailbox:
        self._subscriber.deliver(self._channel, self._mailbox)
        with undo_on_interrupt(self._subscriber.undeliver, self._channel, self._mailbox):
            await self._subscriber.subscribe(self._channel)
        return self._mailbox

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        self._subscriber.undeliver(self._channel, self._mailbox)
        await self._subscriber.unsubscribe(self._channel, confirm=False)


class _Mailboxes(dict[str, set[Mailbox]]):
    """The listeners' mailboxes of each channel."""

    def add(self, channel: str, mailbox: Mailbox) -> None:
        self.setdefault(channel, set()).add(mailbox)

    def remove(self, channel: str, mailbox: Mailbox) -> None:
        mailboxes = self.get(channel)
        if mailboxes is not None:
            mailboxes.discard(mailbox)
            if not mailboxes:
                del self[channel]


class Subscriber:
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
        self,
        pool: _Source,
        hub: WakeHub,
        where: str,
        *,
        inbox: str,
        sharded: bool = False,
        on_dropped: Callable[[Subscriber, str, int], None] | None = None,
    ) -> None:
        self._pool = pool
        # Where wake-ups go (Redlock sets one hub for all its nodes).
        self.hub = hub
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
        self._mailboxes = _Mailboxes()
        # Told (this subscriber, channel, references) when the server drops a wanted
        # subscription by itself (Cluster: its slot moved); the channel is forgotten here
        # first.
        self._dropped = on_dropped
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
        self._mailboxes.add(channel, mailbox)

    def undeliver(self, channel: str, mailbox: Mailbox) -> None:
        self._mailboxes.remove(channel, mailbox)

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
            with map_backend_errors(self._where, DRIVER_ERRORS):
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
            except DRIVER_ERRORS as exc:
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
            with map_backend_errors(self._where, DRIVER_ERRORS):
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
        self.hub.notify_all()
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
        kind = text(reply[0])
        if kind in _SHARD_KINDS:  # smessage, ssubscribe, sunsubscribe
            kind = kind[1:]
        if kind == "message":
            self._on_message(text(reply[1]), reply[2])
        elif kind == "subscribe":
            self._on_subscribed(text(reply[1]))
        elif kind == "unsubscribe":
            self._on_unsubscribed(text(reply[1]))
            return int(reply[2]) == 0
        elif kind == "pong":
            self._wake_everyone()
        return False

    def _on_message(self, channel: str, payload: bytes | str) -> None:
        mailboxes = self._mailboxes.get(channel)
        if mailboxes is None:
            # "<release id>" on a lock's channel, "<release id> <waiter>" on our inbox for
            # it (see scripts.RELEASE); slots are kept under the lock's channel.
            if channel.endswith(self._inbox):
                channel = channel[: -len(self._inbox)]
            release, _, target = text(payload).partition(" ")
            if target == "*":
                self.hub.notify_all(channel)  # every waiting reader may go
            else:
                self.hub.announce(channel, release, target or None)
        else:
            for mailbox in mailboxes:
                mailbox.put(text(payload))

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
        self._dropped(self, channel, refs)

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


class ShardedSubscriber:
    """Redis Cluster: a :class:`Subscriber` (``SSUBSCRIBE``) per node, each channel on the
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
        self._hub = hub
        self._where = where
        self._inbox = inbox
        self._nodes: dict[str, Subscriber] = {}
        self._route: dict[str, Subscriber] = {}
        self._refs: dict[str, int] = {}
        # References (counted in _refs) with no subscription on any node.
        self._orphans: dict[str, int] = {}
        self._mailboxes = _Mailboxes()
        self._closed = False
        # Subscriptions moved to a slot's new owner.
        self._tasks = TaskSet(f"sharded pub/sub of {where}")

    @property
    def hub(self) -> WakeHub:
        """Where wake-ups go, on every node's subscriber."""
        return self._hub

    @hub.setter
    def hub(self, hub: WakeHub) -> None:
        self._hub = hub
        for subscriber in self._nodes.values():
            subscriber.hub = hub

    def channels(self) -> list[str]:
        return [channel for sub in self._nodes.values() for channel in sub.channels()]

    def deliver(self, channel: str, mailbox: Mailbox) -> None:
        self._mailboxes.add(channel, mailbox)
        subscriber = self._route.get(channel)
        if subscriber is not None:
            subscriber.deliver(channel, mailbox)

    def undeliver(self, channel: str, mailbox: Mailbox) -> None:
        self._mailboxes.remove(channel, mailbox)
        subscriber = self._route.get(channel)
        if subscriber is not None:
            subscriber.undeliver(channel, mailbox)

    async def _owner(self, channel: str) -> Subscriber:
        if self._closed:
            raise BackendError(f"{self._where}: the coordinator is closed")
        with map_backend_errors(self._where, DRIVER_ERRORS):
            await self._client.initialize()  # learns the slot map once
            node = self._client.get_node_from_key(channel)
        if node is None:
            raise BackendError(f"{self._where}: no node serves the slot of {channel!r}")
        subscriber = self._nodes.get(node.name)
        if subscriber is None:
            subscriber = self._nodes[node.name] = Subscriber(
                node,
                self._hub,
                f"{self._where} ({node.name})",
                inbox=self._inbox,
                sharded=True,
                on_dropped=self._moved,
            )
        return subscriber

    async def subscribe(self, channel: str) -> None:
        """Subscribe on the slot's owner; if that fails (a stale slot map during a
        failover, a dead node), learn the slot map again and try its new owner. If that
        fails too, go on unsubscribed: the waiter then retries on its timers."""
        for attempt in range(2):
            subscriber = self._route.get(channel)
            if subscriber is None:
                if attempt:
                    with map_backend_errors(self._where, DRIVER_ERRORS):
                        await self._client.nodes_manager.initialize()
                subscriber = await self._owner(channel)
                if channel not in self._route:  # nobody routed it meanwhile
                    self._route[channel] = subscriber
                    for mailbox in self._mailboxes.get(channel, ()):
                        subscriber.deliver(channel, mailbox)
                subscriber = self._route[channel]
            self._refs[channel] = self._refs.get(channel, 0) + 1
            try:
                with undo_on_interrupt(self._forget, channel):
                    await subscriber.subscribe(channel)
            except BackendError as exc:
                if self._closed:
                    raise
                logger.info("%s: subscribing to %s failed (%s)", self._where, channel, exc)
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

    def _forget(self, channel: str) -> Subscriber | None:
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

    def _moved(self, subscriber: Subscriber, channel: str, refs: int) -> None:
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
                with map_backend_errors(self._where, DRIVER_ERRORS):
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
        self._hub.notify_all(key)
        for mailbox in self._mailboxes.get(channel, ()):
            mailbox.put("")

    async def aclose(self) -> None:
        self._closed = True
        for subscriber in list(self._nodes.values()):
            await subscriber.aclose()
        await self._tasks.close(5.0)  # resubscribes: they fail now, closed
