"""In-process backend: a lock table in this process's memory.

It behaves like the server backends (TTLs, fences, wake-ups, loss) and runs on an
injectable clock, so it suits tests, single-process applications and the embedded
default. Coordinators made by ``connect("memory://NAME")`` in one process share the table
of that NAME; ``MemoryBackend()`` has a table of its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from .._clock import Clock
from .._kind import FAIR, PERMIT, SHARED
from .._wakeup import Mailbox, WakeHub, WakeSlot
from .base import Attempt, Backend, Claim, GiveBack, Interrupted, Kind, LockInfo, owner_of

__all__ = ("MemoryBackend",)

# A queued waiter keeps its place this long beyond its longest sleep between attempts.
_QUEUE_MARGIN = 1.0


def _left(holders: dict[str, _Holder], now: float) -> float:
    return max(h.expires_at for h in holders.values()) - now


class _Holder:
    __slots__ = ("expires_at", "fence")

    def __init__(self, expires_at: float, fence: int) -> None:
        self.expires_at = expires_at
        self.fence = fence


class _Table:
    """Holders per name (several when shared), fences per name, and the waiters' hub.

    Coordinators on several event loops (threads) may share a table: every operation
    holds ``mutex`` while it reads or changes the table (none awaits meanwhile), and
    wake-ups reach other loops thread-safely (see :mod:`asynclock._wakeup`).
    """

    __slots__ = (
        "__weakref__",
        "exclusive",
        "fences",
        "holders",
        "hub",
        "mutex",
        "permit_fences",
        "permits",
        "queues",
        "topics",
        "writer_waiting",
    )

    def __init__(self, fences: tuple[dict[str, int], dict[str, int]] | None = None) -> None:
        self.mutex = threading.RLock()
        self.holders: dict[str, dict[str, _Holder]] = {}
        self.exclusive: dict[str, bool] = {}
        # Fences per name, and per semaphore apart (a shared table's outlive it).
        self.fences, self.permit_fences = fences if fences is not None else ({}, {})
        self.hub = WakeHub()
        self.topics: dict[str, set[Mailbox]] = {}
        # Semaphores: permit holders per name, apart from the locks.
        self.permits: dict[str, dict[str, _Holder]] = {}
        # Fair locks: waiters in arrival order, each with the time its place lapses.
        self.queues: dict[str, dict[str, float]] = {}
        # Read-write locks: until when a waiting writer keeps new readers out, and who.
        self.writer_waiting: dict[str, tuple[float, str]] = {}

    def queue(self, name: str, now: float) -> dict[str, float]:
        """The live waiters of the fair lock ``name``, first in line first."""
        queue = self.queues.setdefault(name, {})
        for value in [v for v, until in queue.items() if until <= now]:
            del queue[value]
        return queue

    def live(self, name: str, now: float) -> dict[str, _Holder] | None:
        """The unexpired holders of ``name`` (expired ones are dropped), or None if free."""
        holders = self.holders.get(name)
        if holders is None:
            return None
        for value in [v for v, h in holders.items() if h.expires_at <= now]:
            del holders[value]
        if not holders:
            del self.holders[name]
            del self.exclusive[name]
            return None
        return holders


# Tables shared by name between coordinators of this process; a table lives as long as a
# backend uses it, its fence counters as long as the process: a name's fences never go
# back, however coordinators come and go.
_shared_tables: weakref.WeakValueDictionary[str, _Table] = weakref.WeakValueDictionary()
_shared_fences: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
_shared_mutex = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child is another process: its ``memory://`` tables start empty (the
    parent's holders are not the child's) under fresh mutexes (one that a parent thread
    held at the fork would never be released in the child); fence counters carry on."""
    global _shared_mutex  # noqa: PLW0603 - replaced, not shared, in the child
    _shared_mutex = threading.Lock()
    _shared_tables.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class MemoryBackend(Backend):
    """Locks in this process's memory.

    ``MemoryBackend()`` is isolated; ``MemoryBackend.shared("NAME")`` (what
    ``connect("memory://NAME")`` uses) shares one table with every other backend of that
    name in the process. ``clock`` drives expiry; pass the same clock to several backends
    that share a table.
    """

    kinds = frozenset(Kind)

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> None:
        super().__init__(clock=clock, drift_factor=drift_factor, drift_base=drift_base)
        self._table = _Table()
        self._label = "memory"

    @classmethod
    def shared(
        cls,
        name: str = "",
        *,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> MemoryBackend:
        """A backend on the process-wide table called ``name``."""
        backend = cls(drift_factor=drift_factor, drift_base=drift_base)
        with _shared_mutex:  # coordinators of several threads may connect at once
            table = _shared_tables.get(name)
            if table is None:
                fences = _shared_fences.setdefault(name, ({}, {}))
                table = _shared_tables[name] = _Table(fences)
        backend._table = table
        backend._label = f"memory://{name}"
        return backend

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        with self._table.mutex:
            kind = claim.kind
            if kind is PERMIT:
                return self._permit(claim, ttl)
            shared = kind is SHARED
            table = self._table
            name = claim.name
            now = self.clock.now()
            stay = now + claim.recheck + _QUEUE_MARGIN
            holders = table.live(name, now)
            if kind is FAIR:
                queue = table.queue(name, now)
                first = next(iter(queue), claim.value)
                if holders is not None or first != claim.value:
                    if wait != 0:  # a try-once never waits: it takes no place in the line
                        queue[claim.value] = stay  # joins at the end, or keeps its place
                    left = None if holders is None else _left(holders, now)
                    return Attempt(None, left)
                queue.pop(claim.value, None)
            elif shared and name in table.writer_waiting:
                until, _ = table.writer_waiting[name]
                if until > now:
                    # A writer waits: readers queue behind it, even while readers hold.
                    return Attempt(None, until - now)
                del table.writer_waiting[name]
            if holders is not None and not (shared and not table.exclusive[name]):
                if not shared and wait != 0:  # a writer that will wait, not try once
                    table.writer_waiting[name] = (stay, claim.value)
                return Attempt(None, _left(holders, now))
            if not shared:
                table.writer_waiting.pop(name, None)
            fence = table.fences[name] = table.fences.get(name, 0) + 1
            if holders is None:
                holders = table.holders[name] = {}
                table.exclusive[name] = not shared
            holders[claim.value] = _Holder(now + ttl, fence)
            if shared:
                # Let the next waiter see whether it can share too.
                table.hub.notify_one(name)
            return Attempt(fence)

    def _permit(self, claim: Claim, ttl: float) -> Attempt:
        table = self._table
        name = claim.name
        now = self.clock.now()
        permits = table.permits.setdefault(name, {})
        for value in [v for v, h in permits.items() if h.expires_at <= now]:
            del permits[value]
        if len(permits) >= claim.limit:
            return Attempt(None, min(h.expires_at for h in permits.values()) - now)
        fence = table.permit_fences[name] = table.permit_fences.get(name, 0) + 1
        permits[claim.value] = _Holder(now + ttl, fence)
        return Attempt(fence)

    def _holders(self, claim: Claim, now: float) -> dict[str, _Holder] | None:
        if claim.kind is PERMIT:
            permits = self._table.permits.get(claim.name)
            if permits is None:
                return None
            for value in [v for v, h in permits.items() if h.expires_at <= now]:
                del permits[value]
            return permits
        return self._table.live(claim.name, now)

    async def extend(self, claim: Claim, ttl: float) -> bool:
        with self._table.mutex:
            now = self.clock.now()
            holders = self._holders(claim, now)
            holder = None if holders is None else holders.get(claim.value)
            if holder is None:
                return False
            holder.expires_at = now + ttl
            return True

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        return [await self.extend(claim, ttl) for claim, ttl in items]

    async def release(self, claim: Claim) -> bool:
        with self._table.mutex:
            table = self._table
            now = self.clock.now()
            holders = self._holders(claim, now)
            if holders is None or holders.pop(claim.value, None) is None:
                return False
            if claim.kind is PERMIT:
                table.hub.notify_one(claim.name)  # one permit came free
            elif not holders:
                del table.holders[claim.name]
                del table.exclusive[claim.name]
                fair = claim.kind is FAIR
                first = next(iter(table.queue(claim.name, now)), None) if fair else None
                if first is not None:
                    table.hub.notify_tag(claim.name, first)  # the first in line, and only it
                elif claim.kind is SHARED or claim.name in table.writer_waiting:
                    table.hub.notify_all(claim.name)  # the writer, or every reader
                else:
                    table.hub.notify_one(claim.name)
            return True

    async def owns(self, claim: Claim, fence: int) -> bool:
        with self._table.mutex:
            holders = self._holders(claim, self.clock.now())
            holder = None if holders is None else holders.get(claim.value)
            return holder is not None and holder.fence == fence

    async def inspect(self, name: str) -> LockInfo | None:
        with self._table.mutex:
            now = self.clock.now()
            holders = self._table.live(name, now)
            if holders is None:
                return None
            value, holder = max(holders.items(), key=lambda item: item[1].fence)
            return LockInfo(name, owner_of(value), holder.expires_at - now, holder.fence)

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return self._waiter(name)

    @asynccontextmanager
    async def _waiter(self, name: str) -> AsyncIterator[WakeSlot]:
        table = self._table
        with table.mutex:
            slot = table.hub.register(name)
        try:
            yield slot
        finally:
            with table.mutex:
                table.hub.unregister(slot)
                if slot.tag is not None:
                    self._leave(name, slot.tag)

    def _leave(self, name: str, value: str) -> None:
        """``value`` stops waiting for ``name`` without the lock (timed out, cancelled).
        Call with the table's mutex held."""
        table = self._table
        # A writer that gives up stops keeping readers out.
        waiting = table.writer_waiting.get(name)
        if waiting is not None and waiting[1] == value:
            del table.writer_waiting[name]
            table.hub.notify_all(name)
        # A fair waiter leaves the line; if the lock is free, the next in line may go.
        queue = table.queues.get(name)
        if queue and queue.pop(value, None) is not None:
            now = self.clock.now()
            first = next(iter(table.queue(name, now)), None)
            if first is not None and table.live(name, now) is None:
                table.hub.notify_tag(name, first)

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        with self._table.mutex:
            self._leave(claim.name, claim.value)
        if interrupted is Interrupted.ANSWERED:
            return GiveBack(False)
        return GiveBack(await self.release(claim))

    async def publish(self, topic: str, message: str) -> None:
        with self._table.mutex:
            for mailbox in self._table.topics.get(topic, ()):
                mailbox.put(message)

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return self._listen(topic)

    @asynccontextmanager
    async def _listen(self, topic: str) -> AsyncIterator[Mailbox]:
        mailbox = Mailbox()
        table = self._table
        with table.mutex:
            table.topics.setdefault(topic, set()).add(mailbox)
        try:
            yield mailbox
        finally:
            with table.mutex:
                listeners = table.topics.get(topic)
                if listeners is not None:
                    listeners.discard(mailbox)
                    if not listeners:
                        del table.topics[topic]

    def drop(self, name: str) -> bool:
        """Delete ``name``'s lock as if it had expired, without waking anyone.

        For tests that simulate a lost lease (the memory equivalent of ``DEL`` on a Redis
        key): every holder of ``name``, shared ones included, loses it behind its back.
        Its next renewal (or ``extend()``) is refused, so the lease is lost: with
        ``cancel_on_lost`` the body is cancelled and the ``async with`` raises
        ``LockLost``; its ``release()`` raises ``LockNotOwned``. Waiters are not woken;
        they find the lock free at their next attempt. The name's fence counter stays.

        Args:
            name: the lock's name, as given to ``coord.lock()``.

        Returns:
            True if the lock was held, False if it was free.
        """
        with self._table.mutex:
            table = self._table
            table.exclusive.pop(name, None)
            return table.holders.pop(name, None) is not None

    def waiting(self, name: str | None = None) -> int:
        """Tasks waiting on this backend's table (for ``name``, or all)."""
        with self._table.mutex:
            return self._table.hub.waiting(name)

    def describe(self) -> str:
        return f"MemoryBackend {self._label}"
