"""The simulated network and the client backend that talks through it.

Every backend call of the engine is a request on one of the client's connections: a
message with a seeded delay to the server, applied there at its arrival, and a reply with
a seeded delay back. Connections are FIFO (like TCP); a client has a small pool of them,
so requests on different connections can overtake each other. Each request has a
deadline (the socket timeout): when it passes, the request fails with ``BackendError``
and its connection is reset, as redis-py does.

Faults, all drawn from the seed: delay spikes; resets of a connection, which fail every
request in flight on it with ``BackendError`` whether or not the server ran it (decided
at random: run before the reset, dropped, or, where enabled, landing late after it);
partitions of a client, which hold messages both ways until they heal; and pub/sub
connection resets, which drop the client's subscriptions (its waiters are woken and
fall back on their timers).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from asynclock._errors import BackendError
from asynclock._wakeup import Mailbox, WakeHub, WakeSlot
from asynclock.backends.base import Attempt, Backend, Claim, GiveBack, Interrupted, Kind, LockInfo

from .loop import SimClock, SimLoop, World
from .server import Server, Subscriber

__all__ = ("CURRENT_OP", "Net", "NetConfig", "SimBackend")

#: The workload operation the current task runs (claims are attributed to it).
CURRENT_OP: ContextVar[int] = ContextVar("CURRENT_OP", default=-1)


@dataclass
class NetConfig:
    """The network's behaviour for one seed."""

    latency: float = 0.001  # mean one-way delay
    spike_p: float = 0.0  # chance of a delay spike per message
    spike: float = 0.2  # longest spike
    socket_timeout: float = 0.5
    pool: int = 2  # command connections per client
    apply_on_reset: float = 0.5  # a request on a reset connection ran before the reset
    late_p: float = 0.0  # ...or lands late, after the reset (else: dropped)
    sub_fail_raises: bool = True  # a failed subscribe raises (else: waits unsubscribed)
    partitions: list[tuple[float, float, int]] = field(default_factory=list)  # start,end,client
    trace: bool = False


class SlotN(WakeSlot):
    """A client wake slot with a deterministic hash (its registration number)."""

    __slots__ = ("_n",)

    def __init__(self, hub: WakeHub, key: str, n: int) -> None:
        super().__init__(hub, key)
        self._n = n

    def __hash__(self) -> int:
        return self._n


class ClientHub(WakeHub):
    """A client's local wake-up hub, whose slots hash deterministically."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        super().__init__()
        self._count = itertools.count()

    def register(self, key: Any) -> WakeSlot:
        slot = SlotN(self, key, next(self._count))
        self._slots.setdefault(key, {})[slot] = None
        return slot


class Conn:
    """One FIFO connection of a client; ``epoch`` changes at each reset."""

    __slots__ = ("client", "epoch", "index", "last_down", "last_up", "pending")

    def __init__(self, client: int, index: int) -> None:
        self.client = client
        self.index = index  # -1: the pub/sub connection
        self.epoch = 0
        self.last_up = 0.0
        self.last_down = 0.0
        self.pending: dict[int, Request] = {}


class Request:
    """A request in flight: sent, maybe applied, waiting for its reply."""

    __slots__ = (
        "applied",
        "args",
        "conn",
        "deadline",
        "epoch",
        "fate",
        "fut",
        "id",
        "op",
        "sent",
        "timer",
    )

    def __init__(
        self, rid: int, conn: Conn, op: str, args: tuple[Any, ...], fut: asyncio.Future[Any]
    ) -> None:
        self.id = rid
        self.conn = conn
        self.epoch = conn.epoch
        self.op = op
        self.args = args
        self.fut = fut
        self.sent = 0.0
        self.deadline = 0.0
        self.applied = False
        self.fate = ""  # after a reset: "late" (runs when it lands) or "drop"
        self.timer: asyncio.TimerHandle | None = None


class Net:
    """Message passing between clients and the server, with the seed's faults."""

    def __init__(
        self,
        *,
        world: World,
        loop: SimLoop,
        server: Server,
        rng: random.Random,
        config: NetConfig,
        record: Callable[[str, str], None],
    ) -> None:
        self.world = world
        self.loop = loop
        self.server = server
        self.rng = rng
        self.cfg = config
        self.record = record
        self.clients: dict[int, SimBackend] = {}
        self._ids = itertools.count()
        #: Per client, the end of the last fault that touched it (reset, partition).
        self.last_fault: dict[int, float] = {}
        #: Every fault of the network, in order: (client, start, end). A reset (a socket
        #: timeout's included) and a late landing last an instant; a delay spike lasts
        #: from its message's sending to its arrival. Partitions are in the config.
        self.fault_log: list[tuple[int, float, float]] = []
        self._spikes = 0
        self.requests_done = 0
        #: Every request must end by its deadline: the worst lateness seen.
        self.late_by = 0.0
        #: Called after each request left (the workload's cancels at suspension points).
        self.on_send: Callable[[str], None] | None = None
        server.push = self._push

    # -- timing ----------------------------------------------------------------------

    def delay(self) -> float:
        """One message's one-way delay."""
        d = self.rng.expovariate(1.0 / self.cfg.latency) if self.cfg.latency > 0 else 0.0
        if self.cfg.spike_p and self.rng.random() < self.cfg.spike_p:
            d += self.rng.uniform(0.0, self.cfg.spike)
            self._spikes += 1
        return d

    def _transit(self, client: int, sent: float) -> float:
        """When a message sent at ``sent`` arrives, partitions holding it until healed."""
        spikes = self._spikes
        arrive = sent + self.delay()
        if self._spikes != spikes:
            self.fault_log.append((client, sent, arrive))
        for start, end, who in self.cfg.partitions:
            if who in (-1, client) and start <= arrive and end > sent:
                arrive = max(arrive, end + self.delay())
        return arrive

    # -- requests --------------------------------------------------------------------

    def send(self, conn: Conn, op: str, args: tuple[Any, ...]) -> Request:
        """Put a request on the wire; its reply (or failure) resolves ``request.fut``."""
        loop = self.loop
        req = Request(next(self._ids), conn, op, args, loop.create_future())
        now = self.world.now
        req.sent = now
        req.deadline = now + self.cfg.socket_timeout
        conn.pending[req.id] = req
        arrive = max(self._transit(conn.client, now), conn.last_up)
        conn.last_up = arrive
        self.world.schedule(arrive, lambda: self._arrive(req))
        req.timer = loop.call_at(req.deadline, self._timeout, req)
        if self.on_send is not None:
            self.on_send(op)
        return req

    def _arrive(self, req: Request) -> None:
        conn = req.conn
        if req.epoch != conn.epoch:
            # A subscription lives and dies with its connection: never late.
            if req.fate != "late" or req.applied or conn.index < 0:
                return
            self.record("late", f"{req.op} #{req.id} lands after its connection's reset")
            # Part of that reset: what it does (a renewal extending a lease its client
            # already gave up) is the fault's doing, and the give-back bound counts from it.
            self.last_fault[conn.client] = max(
                self.last_fault.get(conn.client, -1.0), self.world.now
            )
            self.fault_log.append((conn.client, self.world.now, self.world.now))
            self._apply(req)
            return
        result = self._apply(req)
        back = max(self._transit(conn.client, self.world.now), conn.last_down)
        conn.last_down = back
        self.world.deliver(back, lambda: self._reply(req, result))

    def _apply(self, req: Request) -> Any:
        req.applied = True
        conn = req.conn
        if conn.index < 0:
            who = (conn.client, req.epoch)
            channel, topic = req.args
            if req.op == "sub":
                self.server.subscribe(who, channel, topic)
            else:
                self.server.unsubscribe(who, channel, topic)
            self.record("server", f"{req.op} c{conn.client} {channel}")
            return None
        result = self.server.apply(conn.client, req.op, req.args, self.world.now)
        self.record("server", self._describe(req, result))
        return result

    def _describe(self, req: Request, result: Any) -> str:
        """A request as the trace shows it (claims by label, never by token)."""
        backend = self.clients[req.conn.client]
        args = req.args
        if req.op == "acquire":
            return f"acquire {backend.label(args[0])} ttl {args[1]:g} -> {result.fence}"
        if req.op in ("extend", "release"):
            extra = f" ttl {args[1]:g}" if req.op == "extend" else ""
            return f"{req.op} {backend.label(args[0])}{extra} -> {result}"
        if req.op == "extend_many":
            items = " ".join(f"{backend.label(c)}:{t:g}" for c, t in args[0])
            return f"renew {items} -> {result}"
        return f"{req.op} c{req.conn.client} {args[0]}"

    def _reply(self, req: Request, result: Any) -> None:
        if req.epoch != req.conn.epoch or req.conn.pending.pop(req.id, None) is None:
            return
        self._finish(req)
        if not req.fut.done():
            req.fut.set_result(result)

    def _finish(self, req: Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        self.requests_done += 1
        now = self.world.now
        if now > req.deadline and not self.world.paused_within(req.deadline, now):
            self.late_by = max(self.late_by, now - req.deadline)

    def _timeout(self, req: Request) -> None:
        if req.conn.pending.get(req.id) is req:
            self.record("timeout", f"{req.op} #{req.id} on c{req.conn.client}")
            self.reset(req.conn, "socket timeout")

    def reset(self, conn: Conn, why: str) -> None:
        """Reset ``conn``: every request in flight on it fails with BackendError."""
        client = conn.client
        old = conn.epoch
        conn.epoch += 1
        conn.last_up = conn.last_down = self.world.now
        self.last_fault[client] = self.world.now
        self.fault_log.append((client, self.world.now, self.world.now))
        failed = list(conn.pending.values())
        conn.pending.clear()
        for req in failed:
            if not req.applied:
                r = self.rng.random()
                if r < self.cfg.apply_on_reset:
                    self._apply(req)  # it ran just before the connection broke
                elif r < self.cfg.apply_on_reset + self.cfg.late_p:
                    req.fate = "late"
                else:
                    req.fate = "drop"
        self.record("reset", f"c{client} conn {conn.index} ({why}): {len(failed)} failed")
        if conn.index < 0:
            self.server.drop_subscriber((client, old))
            backend = self.clients.get(client)
            if backend is not None:
                backend._lost_subscriptions()
        for req in failed:
            self._finish(req)
            if not req.fut.done():
                req.fut.set_exception(BackendError(f"connection reset ({why}) during {req.op}"))

    def reset_random(self) -> None:
        """A fault event: reset one connection of one client (the client notices now)."""
        if not self.clients:
            return
        client = self.rng.choice(sorted(self.clients))
        backend = self.clients[client]
        conns = [*backend.conns, backend.sub]
        conn = conns[self.rng.randrange(len(conns))]
        self.world.deliver(self.world.now, lambda: self.reset(conn, "fault"))

    # -- pub/sub -----------------------------------------------------------------------

    def _push(self, who: Subscriber, message: tuple[str, str, str, str | None]) -> None:
        client, epoch = who
        backend = self.clients.get(client)
        if backend is None:
            return
        conn = backend.sub
        if conn.epoch != epoch:
            return
        back = max(self._transit(client, self.world.now), conn.last_down)
        conn.last_down = back
        self.world.deliver(back, lambda: backend._on_push(epoch, message))


class SimBackend(Backend):
    """A client backend whose every call is a request over :class:`Net`.

    Redis-like: a pool of command connections and one pub/sub connection; waiters
    subscribe to the lock's name before their next attempt, and a waiter that gives up
    leaves the server's queue and unsubscribes; elections publish on topics.
    """

    kinds = frozenset(Kind)

    def __init__(self, net: Net, client: int, clock: SimClock) -> None:
        super().__init__(clock=clock)
        self.sim_clock = clock
        self.net = net
        self.client = client
        self.conns = [Conn(client, i) for i in range(net.cfg.pool)]
        self.sub = Conn(client, -1)
        self.hub = ClientHub()
        self.mailboxes: dict[str, list[Mailbox]] = {}
        self.closed = False
        self.labels: dict[str, str] = {}
        self._labels = itertools.count()
        #: Claim values whose release request is in flight.
        self.releasing: dict[str, int] = {}
        #: When the first release of each claim value left (client clock).
        self.first_release: dict[str, float] = {}
        #: Extend requests in flight per claim value, until the engine read their reply.
        self.extending: dict[str, list[Request]] = {}
        net.clients[client] = self

    def label(self, claim: Claim) -> str:
        """A short deterministic name for a claim (tokens are random)."""
        value = claim.value
        label = self.labels.get(value)
        if label is None:
            label = self.labels[value] = f"c{self.client}.{next(self._labels)}"
        return label

    async def _call(
        self, op: str, *args: Any, conn: Conn | None = None, values: Sequence[str] = ()
    ) -> Any:
        """Send a request and wait for its reply; ``values``: the claims it extends."""
        if self.closed:
            raise BackendError("the simulated backend is closed")
        if conn is None:
            conn = self.conns[self.net.rng.randrange(len(self.conns))]
        req = self.net.send(conn, op, args)
        for value in values:
            self.extending.setdefault(value, []).append(req)
        try:
            return await req.fut
        finally:
            for value in values:
                reqs = self.extending[value]
                reqs.remove(req)
                if not reqs:
                    del self.extending[value]

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        label = self.label(claim)
        result: Attempt = await self._call("acquire", claim, ttl, wait, CURRENT_OP.get(), label)
        return result

    async def extend(self, claim: Claim, ttl: float) -> bool:
        return bool(await self._call("extend", claim, ttl, values=(claim.value,)))

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        try:
            values = [claim.value for claim, _ in items]
            results: list[bool | None] = await self._call("extend_many", list(items), values=values)
        except BackendError:
            return [None] * len(items)
        return results

    async def release(self, claim: Claim) -> bool:
        value = claim.value
        self.first_release.setdefault(value, self.clock.now())
        self.releasing[value] = self.releasing.get(value, 0) + 1
        try:
            return bool(await self._call("release", claim))
        finally:
            left = self.releasing[value] - 1
            if left:
                self.releasing[value] = left
            else:
                del self.releasing[value]

    def extend_in_window(self, value: str) -> bool:
        """True while an extend of ``value`` has run on the server and the engine has not
        read its reply yet: the lease still counts on its validity from before (see
        ``Checker``)."""
        return any(req.applied for req in self.extending.get(value, ()))

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        if interrupted is Interrupted.ANSWERED:
            await self._call("dequeue", claim.name, claim.value)
            return GiveBack(False)
        # The release and the queue's leave go out together, as on Redis.
        released, _ = await asyncio.gather(
            self.release(claim), self._call("dequeue", claim.name, claim.value)
        )
        return GiveBack(released, self.late_landing(interrupted))

    def late_landing(self, interrupted: Interrupted) -> float:
        """How late an interrupted request can still land: this network's worst delay
        (a spike, the longest partition) beyond a socket timeout."""
        del interrupted  # the pooled connections keep no order, even after a cancel
        cfg = self.net.cfg
        longest = max((end - start for start, end, _ in cfg.partitions), default=0.0)
        return cfg.socket_timeout + cfg.spike + longest + 30 * cfg.latency

    async def inspect(self, name: str) -> LockInfo | None:
        info: LockInfo | None = await self._call("inspect", name)
        return info

    async def publish(self, topic: str, message: str) -> None:
        await self._call("publish", topic, message)

    # -- pub/sub -------------------------------------------------------------------------

    async def _subscribe(self, channel: str, topic: bool) -> int | None:
        """Subscribe and wait for the confirmation; the epoch subscribed in (None if the
        subscription failed and the caller goes on without it)."""
        epoch = self.sub.epoch
        try:
            await self._call("sub", channel, topic, conn=self.sub)
        except BackendError:
            if self.net.cfg.sub_fail_raises or self.closed:
                raise
            return None
        return epoch

    async def _unsubscribe(self, channel: str, topic: bool, epoch: int | None) -> None:
        """Unsubscribe and wait for the confirmation, best effort."""
        if epoch is None or epoch != self.sub.epoch or self.closed:
            return  # that subscription died with its connection
        with contextlib.suppress(BackendError):
            await self._call("unsub", channel, topic, conn=self.sub)

    async def _dequeue(self, name: str, tag: str) -> None:
        with contextlib.suppress(BackendError):
            await self._call("dequeue", name, tag)

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return _Waiter(self, name)

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return self._listen(topic)

    @asynccontextmanager
    async def _listen(self, topic: str) -> AsyncIterator[Mailbox]:
        mailbox = Mailbox()
        self.mailboxes.setdefault(topic, []).append(mailbox)
        try:
            epoch = await self._subscribe(topic, True)
        except BaseException:
            self.mailboxes[topic].remove(mailbox)
            raise
        try:
            yield mailbox
        finally:
            self.mailboxes[topic].remove(mailbox)
            await self._unsubscribe(topic, True, epoch)

    def _on_push(self, epoch: int, message: tuple[str, str, str, str | None]) -> None:
        if epoch != self.sub.epoch or self.closed:
            return
        kind, channel, what, tag = message
        if kind == "msg":
            for mailbox in self.mailboxes.get(channel, ()):
                mailbox.put(what)
        elif what == "one":
            self.hub.notify_one(channel)
        elif what == "tag":
            assert tag is not None
            self.hub.notify_tag(channel, tag)
        else:
            self.hub.notify_all(channel)

    def _lost_subscriptions(self) -> None:
        """The pub/sub connection broke: messages may have been missed."""
        self.hub.notify_all()
        for mailboxes in self.mailboxes.values():
            for mailbox in mailboxes:
                mailbox.put("")

    async def aclose(self) -> None:
        self.closed = True
        for conn in [*self.conns, self.sub]:
            self.net.reset(conn, "closed")

    def describe(self) -> str:
        return f"SimBackend c{self.client}"


class _Waiter:
    """``backend.waiter(name)``: subscribed before the next attempt, left like Redis's."""

    __slots__ = ("_backend", "_epoch", "_name", "_slot")

    def __init__(self, backend: SimBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._slot: WakeSlot | None = None
        self._epoch: int | None = None

    async def __aenter__(self) -> WakeSlot:
        backend = self._backend
        slot = self._slot = backend.hub.register(self._name)
        try:
            self._epoch = await backend._subscribe(self._name, False)
        except BaseException:
            backend.hub.unregister(slot)
            raise
        return slot

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        slot = self._slot
        assert slot is not None
        backend = self._backend
        backend.hub.unregister(slot)
        if exc_type is None or slot.tag is None:
            await backend._unsubscribe(self._name, False, self._epoch)
            return
        await asyncio.gather(
            backend._dequeue(self._name, slot.tag),
            backend._unsubscribe(self._name, False, self._epoch),
        )
