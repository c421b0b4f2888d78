"""LISTEN/NOTIFY for the session backend: announcements and permit wake-ups.

One connection, taken out of the pool while anyone in this process listens, LISTENs on
every channel someone is subscribed to (:meth:`Listener.subscribed`); each NOTIFY goes
to the channel's sinks. Announcements go to a :class:`Mailbox` per subscriber; a
semaphore's release NOTIFYs go through one :class:`Relay` per channel, which wakes one
of the process's permit waiters (any of them can take the free permit). When the
listening connection is lost, every sink is told (an empty message: look again) and the
channels are listened to again on another connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from ..._backoff import Backoff
from ..._cancel import finish_shielded, undo_on_interrupt
from ..._errors import BackendError
from ..._tasks import TaskSet
from ..._wakeup import WakeHub, WakeSlot
from .errors import DRIVER_ERRORS, MapErrors, answered, unusable
from .sessions import SessionPool

__all__ = ("Listener", "Relay", "Sink", "topic_channel")


def topic_channel(key_prefix: bytes, topic: str) -> str:
    """The NOTIFY channel of announcements on ``topic`` under the namespace's key prefix."""
    # NOTIFY channels are identifiers: at most 63 bytes, so a digest of the topic.
    digest = hashlib.sha256(key_prefix + topic.encode()).hexdigest()
    return f"asynclock_{digest[:40]}"


class Sink(Protocol):
    """Where a channel's NOTIFY payloads go ("" when the listening connection was lost)."""

    def put(self, message: str) -> None: ...


class Relay:
    """Turns a semaphore's NOTIFYs into wake-ups of its waiters in this process."""

    __slots__ = ("hub", "key", "users")

    def __init__(self, hub: WakeHub, key: tuple[str, str]) -> None:
        self.hub = hub
        self.key = key
        self.users = 0

    def put(self, message: str) -> None:
        if message:
            self.hub.notify_one(self.key)  # one permit came free
        else:
            self.hub.notify_all(self.key)  # the LISTEN connection was lost: look again


class Listener:
    """The LISTEN side of one backend.

    ``sessions`` lends the listening connection (and ends it when a LISTEN or UNLISTEN is
    interrupted or unanswered within ``request_timeout``); ``ready()`` is awaited before
    the first LISTEN (the backend's setup); ``hub`` carries permit wake-ups; ``errors``
    turns driver errors into ``BackendError``. UNLISTENs and re-LISTENs run in
    ``background``, so that a cancelled caller never strands the connection.
    """

    def __init__(
        self,
        sessions: SessionPool,
        hub: WakeHub,
        *,
        errors: MapErrors,
        request_timeout: float,
        background: TaskSet,
        ready: Callable[[], Awaitable[object]],
    ) -> None:
        self._sessions = sessions
        self._hub = hub
        self._errors = errors
        self._request_timeout = request_timeout
        self._background = background
        self._ready = ready
        # Sinks by channel, each with how many subscriptions it has there.
        self._listeners: dict[str, dict[Sink, int]] = {}
        # Semaphores: one relay per channel from NOTIFY to the waiters of this process.
        self._relays: dict[str, Relay] = {}
        self._listen_conn: Any = None
        self._listen_lock: asyncio.Lock | None = None
        self._relistening = False

    def drop_all(self) -> list[str]:
        """Forget every subscription (the backend closes): the channels listened to, for
        :meth:`stop_listening`."""
        channels = list(self._listeners)
        self._listeners.clear()
        return channels

    @asynccontextmanager
    async def permit_waiter(self, channel: str) -> AsyncIterator[WakeSlot]:
        """A wake-up slot woken by the semaphore's release NOTIFYs (one waiter per NOTIFY
        in this process), subscribed before it is yielded."""
        key = ("permit", channel)
        slot = self._hub.register(key)
        try:
            async with self._relayed(channel, key):
                yield slot
        finally:
            self._hub.unregister(slot)

    @asynccontextmanager
    async def _relayed(self, channel: str, key: tuple[str, str]) -> AsyncIterator[None]:
        """Permit waiters of this process share one relay per channel: a NOTIFY wakes
        one of them, not all (any of them can take the free permit)."""
        relay = self._relays.get(channel)
        if relay is None:
            relay = self._relays[channel] = Relay(self._hub, key)
        relay.users += 1
        try:
            async with self.subscribed(channel, relay):
                yield
        finally:
            relay.users -= 1
            if relay.users == 0 and self._relays.get(channel) is relay:
                del self._relays[channel]

    @asynccontextmanager
    async def subscribed(self, channel: str, sink: Sink) -> AsyncIterator[None]:
        """``sink`` receives the channel's NOTIFY payloads while inside (LISTEN done by
        the time it is entered)."""
        await self._ready()
        if self._listen_lock is None:
            self._listen_lock = asyncio.Lock()
        async with self._listen_lock:
            listeners = self._listeners.setdefault(channel, {})
            listeners[sink] = listeners.get(sink, 0) + 1
            if len(listeners) == 1 and listeners[sink] == 1:
                with undo_on_interrupt(self._unlisten_failed, channel):
                    conn = await self._listening()
                    with self._errors:
                        await self._on_listening(conn, conn.add_listener(channel, self._on_notify))
        try:
            yield
        finally:
            # Finished even if the caller is cancelled meanwhile: an UNLISTEN cut short
            # would strand the listening connection outside the pool.
            await finish_shielded(self._in_background(self._unsubscribe(channel, sink)))

    def _unlisten_failed(self, channel: str) -> None:
        """The first LISTEN on ``channel`` failed or was interrupted: forget its
        listeners, and give the listening connection back if nobody else listens."""
        del self._listeners[channel]
        if not self._listeners:
            self._in_background(self._stop_if_unused())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run ``work`` to its end whatever happens to the caller (aclose waits for it)."""
        return self._background.spawn(work, name="asynclock-pg-background")

    async def _stop_if_unused(self) -> None:
        assert self._listen_lock is not None
        async with self._listen_lock:
            if not self._listeners:
                await self.stop_listening()

    async def _unsubscribe(self, channel: str, sink: Sink) -> None:
        assert self._listen_lock is not None
        async with self._listen_lock:
            listeners = self._listeners.get(channel, {})
            if listeners.get(sink, 0) > 1:
                listeners[sink] -= 1
            else:
                listeners.pop(sink, None)
            if not listeners:
                self._listeners.pop(channel, None)
                conn = self._listen_conn
                if conn is not None and not unusable(conn):
                    with contextlib.suppress(*DRIVER_ERRORS):
                        await self._on_listening(
                            conn, conn.remove_listener(channel, self._on_notify)
                        )
                if not self._listeners:
                    await self.stop_listening()

    async def _listening(self) -> Any:
        """The connection that LISTENs, taken out of the pool while anyone listens."""
        if self._listen_conn is None or unusable(self._listen_conn):
            with self._errors:
                conn = await self._sessions.pool_acquire()
            conn.add_termination_listener(self._on_listen_lost)
            self._listen_conn = conn
        return self._listen_conn

    async def _on_listening(self, conn: Any, step: Awaitable[None]) -> None:
        """``step`` (a LISTEN or UNLISTEN on the listening connection ``conn``) within the
        request timeout. Interrupted or unanswered, the connection is closed: listeners
        then look again and listen on another one (:meth:`_on_listen_lost`)."""
        try:
            async with asyncio.timeout(self._request_timeout):
                await step
        except BaseException as exc:
            if not answered(exc, conn):
                self._sessions.terminate(conn)
            raise

    async def stop_listening(
        self, channels: Iterable[str] = (), within: float | None = None
    ) -> None:
        """Give the listening connection back to the pool, after UNLISTEN (of ``channels``
        first: asyncpg's own record of them, which it warns about on release); closed
        instead if that is interrupted or not answered within ``within`` (default: the
        request timeout)."""
        conn, self._listen_conn = self._listen_conn, None
        if conn is None:
            return
        within = self._request_timeout if within is None else within
        with contextlib.suppress(Exception):
            conn.remove_termination_listener(self._on_listen_lost)
        try:
            with undo_on_interrupt(self._sessions.terminate, conn):
                async with asyncio.timeout(within):
                    for channel in channels:
                        await conn.remove_listener(channel, self._on_notify)
                    await conn.execute("UNLISTEN *")
        except Exception:
            return  # closed instead (a cancel stays a cancel)
        await self._sessions.give_back(conn, within)

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for mailbox in self._listeners.get(channel, ()):
            mailbox.put(payload)

    def _on_listen_lost(self, conn: Any) -> None:
        """The LISTEN connection died: listeners look again, and we listen again."""
        if conn is not self._listen_conn:
            return
        self._listen_conn = None
        for mailboxes in self._listeners.values():
            for mailbox in mailboxes:
                mailbox.put("")
        # One relistening task at a time: its own failures (a LISTEN unanswered closes
        # the connection, which lands here again) are retried by its loop.
        if self._listeners and not self._sessions.closing and not self._relistening:
            self._relistening = True
            self._background.spawn(self._relisten(), name="asynclock-pg-relisten")

    async def _relisten(self) -> None:
        try:
            await self._listen_again()
        finally:
            self._relistening = False

    async def _listen_again(self) -> None:
        backoff = Backoff(initial=0.05, maximum=2.0)
        for attempt in range(1_000_000):
            if self._sessions.closing or not self._listeners:
                return
            try:
                assert self._listen_lock is not None
                async with self._listen_lock:
                    conn = await self._listening()
                    for channel in self._listeners:
                        await self._on_listening(conn, conn.add_listener(channel, self._on_notify))
            except (BackendError, *DRIVER_ERRORS):
                await asyncio.sleep(backoff.delay(attempt))
                continue
            for mailboxes in self._listeners.values():
                for mailbox in mailboxes:
                    mailbox.put("")
            return
