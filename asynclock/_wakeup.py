"""Wake-ups for waiters: one slot per waiting task, woken one at a time per release.

A waiter registers its slot *before* its attempt, so a release that lands between the
failed attempt and the wait still finds the slot and marks it woken: the wait then returns
at once and no wake-up is lost. A release wakes one slot (the oldest not yet woken), so
64 waiters do not stampede the server for one free lock; a woken waiter that leaves
without trying (cancelled, timed out) passes its wake-up to the next. A release that
names its waiter (a ``tag``: the Redis backend's queue picks one across all clients)
wakes that slot alone, and no slot of any other client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Hashable

from ._clock import Clock

__all__ = ("Mailbox", "WakeHub", "WakeSlot")

# Releases remembered per key while counting Redlock announcements. A Redlock release is
# announced by each node it reached, all within a few round trips; between two of them
# other releases of the name may come (contenders that got a minority give their nodes
# back, each announced by those nodes only, never reaching the quorum). Forgetting the
# release still being counted would lose its wake-up (the waiter then retries on its
# timer: later, never unsafe), so the window is far wider than such a burst of a
# name's contenders; it holds only names with waiters here, and is dropped with the
# last one.
_RECENT_RELEASES = 256


class _Parked:
    """Something a task waits on: a future kept while it waits (see :meth:`_park`).

    It may be woken from another thread (coordinators on several event loops sharing a
    ``memory://NAME`` table): the future is then resolved in its own loop, and a waker
    that comes between the waiter's look and its park is seen by the park.
    """

    __slots__ = ("_fut",)

    def __init__(self) -> None:
        self._fut: asyncio.Future[bool] | None = None

    def _ready(self) -> bool:
        """True when a wait would return at once (for :meth:`_park`'s second look)."""
        raise NotImplementedError

    async def _park(self, clock: Clock, until: float | None) -> bool:
        """Wait on a new future kept in ``_fut``: True when resolved by a wake-up or a
        message, False when ``until`` passes on ``clock``."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._fut = fut
        if self._ready():
            # Woken from another thread between the caller's look and ``_fut`` being set:
            # that waker saw no future to resolve (a table shared by several loops).
            _resolve(fut, True)
        timer = None if until is None else clock.call_at(until, lambda: _resolve(fut, False))
        try:
            return await fut
        finally:
            self._fut = None
            if timer is not None:
                timer.cancel()


class WakeSlot(_Parked):
    """One waiter's place in a :class:`WakeHub`."""

    __slots__ = ("_hub", "key", "tag", "woken")

    def __init__(self, hub: WakeHub, key: Hashable) -> None:
        super().__init__()
        self._hub = hub
        self.key = key
        self.woken = False
        # Who waits: the claim's value, which a targeted wake-up names.
        self.tag: str | None = None

    def _ready(self) -> bool:
        return self.woken

    def wake(self) -> None:
        """Mark the slot woken; its waiter, if parked, returns at once."""
        self.woken = True
        if self._fut is not None:
            _resolve(self._fut, True)

    async def wait(self, clock: Clock, until: float | None) -> bool:
        """Sleep until woken or until ``until`` on ``clock``; True if woken.

        A wake-up that arrived while the owner was busy is kept and returned at once.
        """
        if self.woken:
            self.woken = False
            return True
        if until is not None and until <= clock.now():
            return False
        woke = await self._park(clock, until)
        # A wake-up that raced the timer is still recorded in ``woken``: consume it either way.
        woke = woke or self.woken
        self.woken = False
        return woke

    def __repr__(self) -> str:
        return f"<WakeSlot {self.key!r} woken={self.woken}>"


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    """Resolve ``fut`` in its own event loop: at once from that loop's thread, else by a
    thread-safe call (which also wakes that loop's selector)."""
    loop = fut.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        if not fut.done():
            fut.set_result(value)
        return
    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_resolve, fut, value)


class WakeHub:
    """Slots grouped by key (a lock name or a pub/sub channel), oldest first.

    ``quorum`` is for Redlock, where one release is announced by every node it reached:
    :meth:`announce` wakes a waiter when the same release has been announced by that
    many nodes, that is, when a majority is free for it.
    """

    __slots__ = ("_heard", "_slots", "quorum")

    def __init__(self, quorum: int = 1) -> None:
        # dict-as-ordered-set: O(1) removal, iteration in arrival order.
        self._slots: dict[Hashable, dict[WakeSlot, None]] = {}
        self.quorum = quorum
        # Per key, how many nodes announced each recent release (oldest first).
        self._heard: dict[Hashable, dict[Hashable, int]] = {}

    def register(self, key: Hashable) -> WakeSlot:
        slot = WakeSlot(self, key)
        self._slots.setdefault(key, {})[slot] = None
        return slot

    def unregister(self, slot: WakeSlot) -> None:
        """Remove ``slot``; a wake-up it did not use goes to the next waiter."""
        slots = self._slots.get(slot.key)
        if slots is None or slot not in slots:
            return
        del slots[slot]
        if not slots:
            del self._slots[slot.key]
            self._heard.pop(slot.key, None)
        elif slot.woken:
            slot.woken = False
            self.notify_one(slot.key)

    def notify_one(self, key: Hashable) -> None:
        """Wake the oldest slot of ``key`` that is not already woken."""
        for slot in self._slots.get(key, ()):
            if not slot.woken:
                slot.wake()
                return

    def notify_tag(self, key: Hashable, tag: str) -> None:
        """Wake the slot of ``key`` tagged ``tag``, if it is here (else nothing)."""
        for slot in self._slots.get(key, ()):
            if slot.tag == tag:
                if not slot.woken:
                    slot.wake()
                return

    def announce(self, key: Hashable, release: Hashable, target: str | None = None) -> None:
        """A node says ``release`` freed ``key``: wake one waiter once a quorum said so.

        With ``target`` (one node's queue chose that waiter), wake only that slot.
        """
        if self.quorum == 1:
            if target is None:
                self.notify_one(key)
            else:
                self.notify_tag(key, target)
            return
        if key not in self._slots:
            return  # nobody waits: nothing to count
        heard = self._heard.setdefault(key, {})
        count = heard.get(release, 0) + 1
        heard[release] = count
        if len(heard) > _RECENT_RELEASES:
            del heard[next(iter(heard))]
        if count == self.quorum:
            self.notify_one(key)

    def notify_all(self, key: Hashable | None = None) -> None:
        """Wake every slot of ``key``, or every slot of every key (after a lost connection)."""
        groups = self._slots.values() if key is None else (self._slots.get(key, {}),)
        for slots in list(groups):
            for slot in list(slots):
                slot.wake()

    def waiting(self, key: Hashable | None = None) -> int:
        """Number of registered slots for ``key`` (all keys if None)."""
        if key is None:
            return sum(len(s) for s in self._slots.values())
        return len(self._slots.get(key, ()))

    def keys(self) -> list[Hashable]:
        """Keys with at least one slot."""
        return list(self._slots)


class Mailbox(_Parked):
    """Messages of a topic for one listener, in arrival order (elections' observers).

    An empty message means "something may have been missed, look again" (sent after a
    lost connection).
    """

    __slots__ = ("_messages",)

    def __init__(self) -> None:
        super().__init__()
        self._messages: deque[str] = deque()

    def _ready(self) -> bool:
        return bool(self._messages)

    def put(self, message: str) -> None:
        self._messages.append(message)
        if self._fut is not None:
            _resolve(self._fut, True)

    async def get(self, clock: Clock, until: float | None) -> str | None:
        """The next message, or None if ``until`` (on ``clock``) passes first."""
        if not self._messages:
            if until is not None and until <= clock.now():
                return None
            await self._park(clock, until)
            if not self._messages:
                return None
        return self._messages.popleft()
