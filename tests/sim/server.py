"""The simulated server: the memory backend's lock table on the server's own clock.

Requests are applied atomically when they arrive (one event of the world), by the real
:class:`~asynclock.backends.MemoryBackend` running on a drifting clock, so TTL expiry,
fences, owners, shared/writer-preferred locks, semaphores and fair queues are exactly the
memory backend's. What the memory backend does in-process, the server does over the wire
instead: wake-ups and topic messages go to each subscribed client's pub/sub connection,
like Redis pub/sub, and a waiter that gives up leaves the queue by a request of its own.

The server also keeps the record the invariant checks read: every grant (fence, time,
who), every applied release, and the server-side expiry of each holder.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from asynclock._wakeup import WakeHub
from asynclock.backends.base import Claim, LockInfo
from asynclock.backends.memory import MemoryBackend

from .loop import DriftClock

__all__ = ("Grant", "Server")

T = TypeVar("T")

#: (client id, connection epoch): who receives a subscription's messages.
Subscriber = tuple[int, int]


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the memory backend's methods) to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    coro.close()
    raise RuntimeError("a server operation suspended")


@dataclass
class Grant:
    """One lock or permit granted by the server."""

    value: str
    name: str
    kind: str  # "lock" or "permit"
    fence: int
    at: float  # virtual time of the grant
    client: int
    op: int  # the workload operation that asked, -1 if none
    label: str
    ttl: float
    #: Granted after a release of the same claim had already run (a request that landed
    #: late, after its sender gave up and gave it back): only its TTL can end it.
    orphan: bool = False


class _ServerHub(WakeHub):
    """The table's wake-up hub, turned into pub/sub messages to subscribed clients."""

    __slots__ = ("_server",)

    def __init__(self, server: Server) -> None:
        super().__init__()
        self._server = server

    def notify_one(self, key: Hashable) -> None:
        self._server.publish_wake(str(key), "one", None)

    def notify_tag(self, key: Hashable, tag: str) -> None:
        self._server.publish_wake(str(key), "tag", tag)

    def notify_all(self, key: Hashable | None = None) -> None:
        if key is not None:
            self._server.publish_wake(str(key), "all", None)


class Server:
    """The lock server: a memory table on ``clock``, reached through the network."""

    def __init__(self, clock: DriftClock) -> None:
        self.clock = clock
        self.mem = MemoryBackend(clock=clock)
        table = self.mem._table
        table.hub = _ServerHub(self)
        self.table = table
        # Lock-name and topic subscriptions: per name, per subscriber, a count.
        self.subs: dict[str, dict[Subscriber, int]] = {}
        self.topics: dict[str, dict[Subscriber, int]] = {}
        #: Sends a message to a subscriber's pub/sub connection: (subscriber, message).
        self.push: Callable[[Subscriber, tuple[str, str, str, str | None]], None] = lambda _s, _m: (
            None
        )
        self.grants: dict[str, Grant] = {}
        self.released: dict[str, float] = {}  # claim value -> when a release of it ran
        #: Per operation, the (name, claim value) of every acquire request it sent.
        self.attempted: dict[int, set[tuple[str, str]]] = {}
        self.top_fence: dict[tuple[str, str], int] = {}
        #: Called on each grant (the invariant checks).
        self.on_grant: Callable[[Grant], None] = lambda _g: None
        self.on_stale: Callable[[str, str], None] = lambda _op, _v: None
        #: Called on each release that took a holder off (claim value, virtual time).
        self.on_release: Callable[[str, float], None] = lambda _v, _t: None

    # -- requests ------------------------------------------------------------------

    def apply(  # noqa: PLR0911 - one branch per request kind reads best
        self, client: int, op: str, args: tuple[Any, ...], now: float
    ) -> Any:
        """Apply one request atomically; the reply."""
        mem = self.mem
        if op == "acquire":
            claim, ttl, wait, op_id, label = args
            self.attempted.setdefault(op_id, set()).add((claim.name, claim.value))
            attempt = run_sync(mem.try_acquire(claim, ttl, wait=wait))
            if attempt.fence is not None:
                kind = "permit" if claim.limit else "lock"
                grant = Grant(
                    claim.value,
                    claim.name,
                    kind,
                    attempt.fence,
                    now,
                    client,
                    op_id,
                    label,
                    ttl,
                    orphan=claim.value in self.released,
                )
                self.grants[claim.value] = grant
                self.on_grant(grant)
            return attempt
        if op == "extend":
            claim, ttl = args
            held = self._holds(claim)
            ok = run_sync(mem.extend(claim, ttl))
            self._check_owner("extend", claim, held, ok)
            return ok
        if op == "extend_many":
            (items,) = args
            held_before = [self._holds(claim) for claim, _ in items]
            many = run_sync(mem.extend_many(items))
            for (claim, _), held, extended in zip(items, held_before, many, strict=True):
                self._check_owner("extend", claim, held, bool(extended))
            return many
        if op == "release":
            (claim,) = args
            held = self._holds(claim)
            ok = run_sync(mem.release(claim))
            self._check_owner("release", claim, held, ok)
            self.released.setdefault(claim.value, now)
            if ok:
                self.on_release(claim.value, now)
            return ok
        if op == "inspect":
            (name,) = args
            info: LockInfo | None = run_sync(mem.inspect(name))
            return info
        if op == "dequeue":
            name, tag = args
            self._dequeue(name, tag)
            return None
        if op == "publish":
            topic, message = args
            for who in list(self.topics.get(topic, {})):
                self.push(who, ("msg", topic, message, None))
            return None
        raise ValueError(f"unknown request {op!r}")

    def _holds(self, claim: Claim) -> bool:
        """True if ``claim`` holds an unexpired lease (or permit) now."""
        holders = (self.table.permits if claim.limit else self.table.holders).get(claim.name)
        holder = None if holders is None else holders.get(claim.value)
        return holder is not None and holder.expires_at > self.clock.now()

    def _check_owner(self, op: str, claim: Claim, held: bool, ok: bool) -> None:
        """A release or extend may only succeed for the claim that holds the lock."""
        if ok and not held:
            self.on_stale(op, claim.value)

    def _dequeue(self, name: str, tag: str) -> None:
        """A waiter gave up: what the memory backend's waiter does when it is left."""
        table = self.table
        waiting = table.writer_waiting.get(name)
        if waiting is not None and waiting[1] == tag:
            del table.writer_waiting[name]
            table.hub.notify_all(name)
        queue = table.queues.get(name)
        if queue and queue.pop(tag, None) is not None:
            now = self.clock.now()
            first = next(iter(table.queue(name, now)), None)
            if first is not None and table.live(name, now) is None:
                table.hub.notify_tag(name, first)

    # -- pub/sub ---------------------------------------------------------------------

    def subscribe(self, who: Subscriber, channel: str, topic: bool) -> None:
        """Count one subscription of ``who`` to a lock name or topic."""
        table = self.topics if topic else self.subs
        counts = table.setdefault(channel, {})
        counts[who] = counts.get(who, 0) + 1

    def unsubscribe(self, who: Subscriber, channel: str, topic: bool) -> None:
        """Drop one subscription of ``who`` (nothing if it has none)."""
        table = self.topics if topic else self.subs
        counts = table.get(channel)
        if counts is None or who not in counts:
            return
        counts[who] -= 1
        if counts[who] <= 0:
            del counts[who]
        if not counts:
            del table[channel]

    def drop_subscriber(self, who: Subscriber) -> None:
        """A pub/sub connection closed: forget all of its subscriptions."""
        for table in (self.subs, self.topics):
            for channel in list(table):
                counts = table[channel]
                counts.pop(who, None)
                if not counts:
                    del table[channel]

    def publish_wake(self, name: str, kind: str, tag: str | None) -> None:
        """A release's wake-up for ``name``: to every client subscribed to it."""
        for who in list(self.subs.get(name, {})):
            self.push(who, ("wake", name, kind, tag))

    # -- what the checks read ------------------------------------------------------

    def expiry(self, claim: Claim) -> float | None:
        """The server's expiry of ``claim`` in virtual time, None if it holds nothing."""
        holders = (self.table.permits if claim.limit else self.table.holders).get(claim.name)
        if holders is None:
            return None
        holder = holders.get(claim.value)
        if holder is None:
            return None
        return self.clock.real(holder.expires_at)

    def queued(self, name: str, value: str) -> float | None:
        """When ``value``'s live place in a waiter line of ``name`` lapses (virtual
        time; a fair lock's queue, or a waiting writer's mark), or None if it has none."""
        now = self.clock.now()
        until = self.table.queues.get(name, {}).get(value)
        writer = self.table.writer_waiting.get(name)
        if writer is not None and writer[1] == value:
            until = max(until or 0.0, writer[0])
        if until is None or until <= now:
            return None
        return self.clock.real(until)

    def held_values(self) -> list[tuple[str, str, float]]:
        """Every unexpired holder: (name, claim value, expiry in virtual time)."""
        now = self.clock.now()
        out = []
        for table in (self.table.holders, self.table.permits):
            for name, holders in table.items():
                for value, holder in holders.items():
                    if holder.expires_at > now:
                        out.append((name, value, self.clock.real(holder.expires_at)))
        return out
