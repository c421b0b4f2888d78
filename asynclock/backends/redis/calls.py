"""Script calls: which script, which keys and which arguments each operation sends.

A call is ``(script, number of keys, arguments)`` (:data:`Call`), built here without
I/O. It is the same for every node, which is what lets Redlock pack one command and send
it to all of them. The scripts themselves are in :mod:`.scripts`; they are looked up
there at each call, so that a test may replace one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..._kind import FAIR, PERMIT, SHARED
from ..base import Claim
from . import scripts
from .keys import Keys

__all__ = ("EXTEND_CHUNK", "QUEUE_MARGIN_MS", "RELEASED_MARGIN_MS", "Call", "Calls")


Call = tuple[scripts.Script, int, tuple[Any, ...]]

# A waiter keeps its place in the queue for its longest sleep between attempts (it renews
# the place with each attempt) plus this margin; one that died drops out after that, and
# until then a release may wake it in vain (the others then wake by their own timers).
QUEUE_MARGIN_MS = 1000

# A release is remembered on the server (so that the same release sent again answers
# "released", not "not held") for the socket timeout, within which a request sent again
# on a new connection lands, plus this margin, which covers the background give-back
# after a cancelled or failed release (its first try goes out at once, bounded by 2 s).
RELEASED_MARGIN_MS = 5000

# The watchdog's batch goes out in chunks: one script call must not block the server long.
EXTEND_CHUNK = 512


class Calls:
    """The calls of one backend.

    ``inbox`` is the backend's id, which queued waiters are woken by (see
    :class:`~.keys.KeySchema`); ``retention_ms`` how long a fence counter outlives its
    lock's last use at least; ``released_ms`` how long the server remembers a release.
    """

    __slots__ = ("_inbox", "_released_ms", "_retention_ms")

    def __init__(self, *, inbox: str, retention_ms: int, released_ms: int) -> None:
        self._inbox = inbox
        self._retention_ms = retention_ms
        self._released_ms = released_ms

    def retention_ms(self, ttl: float) -> int:
        """ms the fence counter outlives the lock's last use: never less than 2 ttl."""
        return max(self._retention_ms, math.ceil(ttl * 2000))

    def released_ms(self) -> int:
        """How long the server remembers a release (ms), so that the same release sent
        again answers "released"."""
        return self._released_ms

    def _stay(self, queue: float | None) -> int:
        return 0 if queue is None else math.ceil(queue * 1000) + QUEUE_MARGIN_MS

    # -- locks (also Redlock's) ------------------------------------------------------

    def acquire(
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
        (the caller waits for a wake-up on its inbox and tries again within that time).
        """
        ttl_ms = math.ceil(ttl * 1000)
        retention = self.retention_ms(ttl)
        if queue is not None:
            stay = math.ceil(queue * 1000) + QUEUE_MARGIN_MS
            args: tuple[Any, ...] = (
                keys.lock, keys.fence, keys.released, keys.queue, keys.due,
                value, ttl_ms, retention, floor or 0, stay, self._inbox,
            )  # fmt: skip
            return scripts.ACQUIRE, 5, args
        args = (keys.lock, keys.fence, keys.released, value, ttl_ms, retention)
        if floor is not None:
            args += (floor,)
        return scripts.ACQUIRE, 3, args

    def raise_fence(self, keys: Keys, value: str, fence: int, ttl: float) -> Call:
        """Redlock's second step: lift the fence counter to ``fence`` if still holding."""
        return (
            scripts.RAISE_FENCE,
            2,
            (keys.lock, keys.fence, value, fence, self.retention_ms(ttl)),
        )

    def extend(self, keys: Keys, value: str, ttl: float) -> Call:
        """Extend the lock to ``ttl`` if ``value`` holds it: 1, else 0."""
        args = (keys.lock, keys.fence, value, math.ceil(ttl * 1000), self.retention_ms(ttl))
        return scripts.EXTEND, 2, args

    def extend_many(self, items: Sequence[tuple[Keys, str, float]]) -> Call:
        """EXTEND for every ``(keys, value, ttl)`` of ``items`` (at most
        :data:`EXTEND_CHUNK`, in one slot on Cluster): 1 or 0 for each."""
        keys: list[str] = []
        args: list[Any] = []
        for lock_keys, value, ttl in items:
            keys += (lock_keys.lock, lock_keys.fence)
            args += (value, math.ceil(ttl * 1000), self.retention_ms(ttl))
        return scripts.EXTEND_MANY, len(keys), (*keys, *args)

    def release(self, keys: Keys, value: str) -> Call:
        """Delete the lock if ``value`` holds it: 1, also when sent again; else 0."""
        args = (
            keys.lock, keys.channel, keys.queue, keys.due, keys.reader_queue, keys.reader_due,
            keys.released, value, self._released_ms,
        )  # fmt: skip
        return scripts.RELEASE, 7, args

    def dequeue(self, keys: Keys, value: str) -> Call:
        """Leave whichever waiter queue of the name the waiter is in (it gave up),
        passing on a wake-up."""
        args = (
            keys.lock, keys.channel, keys.queue, keys.due, keys.reader_queue, keys.reader_due,
            keys.permit_queue, keys.permit_due, value,
        )  # fmt: skip
        return scripts.DEQUEUE, 8, args

    def inspect(self, keys: Keys) -> Call:
        """``[holder value, ms left, fence counter]`` or nil when free; while readers
        hold, the reader whose lease ends last and its fence."""
        return scripts.INSPECT, 4, (keys.lock, keys.fence, keys.readers, keys.reader_grants)

    # -- fair locks, readers and semaphore permits (single-node; Redlock has none) ------

    def fair(self, keys: Keys, value: str, ttl: float, *, queue: float | None) -> Call:
        """ACQUIRE in arrival order: refused while an earlier live waiter is queued."""
        args = (
            keys.lock, keys.fence, keys.queue, keys.due, keys.released,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl), self._stay(queue), self._inbox,
        )  # fmt: skip
        return scripts.ACQUIRE_FAIR, 5, args

    def shared(self, keys: Keys, value: str, ttl: float, *, queue: float | None) -> Call:
        """A reader's acquire: granted while no writer holds or waits."""
        args = (
            keys.lock, keys.fence, keys.readers, keys.reader_grants,
            keys.queue, keys.due, keys.reader_queue, keys.reader_due, keys.released,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl), self._stay(queue), self._inbox,
        )  # fmt: skip
        return scripts.ACQUIRE_SHARED, 9, args

    def extend_shared(self, keys: Keys, value: str, ttl: float) -> Call:
        """Extend a reader's lease: 1, else 0."""
        args = (
            keys.lock, keys.fence, keys.readers, keys.reader_grants,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl),
        )  # fmt: skip
        return scripts.EXTEND_SHARED, 4, args

    def release_shared(self, keys: Keys, value: str) -> Call:
        """Give back a reader's lease: 1, also when sent again; else 0."""
        args = (
            keys.lock, keys.channel, keys.queue, keys.due, keys.reader_queue, keys.reader_due,
            keys.readers, keys.reader_grants, keys.released, value, self._released_ms,
        )  # fmt: skip
        return scripts.RELEASE_SHARED, 9, args

    def permit(
        self, keys: Keys, value: str, ttl: float, limit: int, *, queue: float | None
    ) -> Call:
        """A semaphore permit: granted while fewer than ``limit`` unexpired ones are held."""
        args = (
            keys.permits, keys.permit_fence, keys.permit_grants,
            keys.permit_queue, keys.permit_due, keys.channel, keys.permit_released,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl), limit, self._stay(queue),
            self._inbox,
        )  # fmt: skip
        return scripts.ACQUIRE_PERMIT, 7, args

    def extend_permit(self, keys: Keys, value: str, ttl: float) -> Call:
        """Extend a permit: 1, else 0."""
        args = (
            keys.permits, keys.permit_fence, keys.permit_grants,
            value, math.ceil(ttl * 1000), self.retention_ms(ttl),
        )  # fmt: skip
        return scripts.EXTEND_PERMIT, 3, args

    def release_permit(self, keys: Keys, value: str) -> Call:
        """Give back a permit: 1, also when sent again; else 0."""
        args = (
            keys.permits, keys.channel, keys.permit_queue, keys.permit_due,
            keys.permit_grants, keys.permit_released, value, self._released_ms,
        )  # fmt: skip
        return scripts.RELEASE_PERMIT, 6, args

    # -- by the kind of claim --------------------------------------------------------

    def acquire_claim(self, keys: Keys, claim: Claim, ttl: float, queue: float | None) -> Call:
        """The acquire of ``claim``'s kind (permit, reader, fair or plain lock)."""
        value = claim.value
        kind = claim.kind
        if kind is PERMIT:
            return self.permit(keys, value, ttl, claim.limit, queue=queue)
        if kind is SHARED:
            return self.shared(keys, value, ttl, queue=queue)
        if kind is FAIR:
            return self.fair(keys, value, ttl, queue=queue)
        return self.acquire(keys, value, ttl, queue=queue)

    def extend_claim(self, keys: Keys, claim: Claim, ttl: float) -> Call:
        """The extend of ``claim``'s kind."""
        if claim.kind is PERMIT:
            return self.extend_permit(keys, claim.value, ttl)
        if claim.kind is SHARED:
            return self.extend_shared(keys, claim.value, ttl)
        return self.extend(keys, claim.value, ttl)

    def release_claim(self, keys: Keys, claim: Claim) -> Call:
        """The release of ``claim``'s kind."""
        if claim.kind is PERMIT:
            return self.release_permit(keys, claim.value)
        if claim.kind is SHARED:
            return self.release_shared(keys, claim.value)
        return self.release(keys, claim.value)
