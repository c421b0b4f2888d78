"""The loop thread: one asyncio event loop in a daemon thread, and blocking calls into it.

Every blocking call of a :class:`asynclock.sync.Coordinator` runs a coroutine of the async
core on this loop and waits for it, so renewals, wake-ups and clean-ups run there while
the calling threads do their work.

Why not ``anyio.from_thread.BlockingPortal``: its ``call()`` runs each coroutine in a
task group under a cancel scope, and costs 176 µs per empty call on a 2-core machine,
against 39 to 46 µs for a task and a ``threading.Lock`` here (``asynclock bench --only
sync``): a lock and its release are two calls. What the portal gives beyond that
(other async backends, its own lifecycle) the coordinator does not use.

Interrupts: a ``KeyboardInterrupt`` (or any exception raised into the waiting thread)
while it waits either cancels the call (``CANCEL``: an acquire; the async core then
gives back whatever the server granted) and waits for it to end, or leaves it running
to its end (``FINISH``: a release), or waits for its end before raising (``WAIT``: a
close, which is bounded) — a release or a close is never abandoned half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._errors import CoordinatorClosed

__all__ = ("Interrupt", "LoopThread")

logger = logging.getLogger("asynclock")

T = TypeVar("T")

# How long a close waits for the loop thread to finish its own clean-up.
_JOIN_TIMEOUT = 10.0


class Interrupt(enum.Enum):
    """What an interrupt of the waiting thread does to the call it waits for."""

    CANCEL = "cancel"  # cancel it, wait for the cancellation to end, then raise
    FINISH = "finish"  # let it run to its end in the loop, raise at once
    WAIT = "wait"  # wait for its end (it is bounded), then raise: a close


# Python 3.12+ can run a task's first step at once, in the callback that creates it (no
# loop iteration in between): 45 -> 29 µs per hop on a 2-core machine.
_EAGER: dict[str, Any] = {"eager_start": True} if sys.version_info >= (3, 12) else {}


class _Call:
    """One call waiting in another thread: its task, its outcome, and a lock released
    when the outcome is known."""

    __slots__ = (
        "args",
        "coro",
        "done",
        "error",
        "failed",
        "function",
        "released",
        "task",
        "value",
    )

    def __init__(
        self, function: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...]
    ) -> None:
        self.function = function
        self.args = args
        self.coro: Coroutine[Any, Any, Any] | None = None  # made, not yet started
        self.done = threading.Lock()
        self.done.acquire()
        self.released = False
        self.task: asyncio.Task[None] | None = None
        self.value: Any = None
        self.failed: BaseException | None = None  # what the call raised
        self.error: BaseException | None = None  # the call could not be started

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the loop: start the call."""
        if self.released or self.task is not None:
            return
        try:
            coro = self.coro = self.function(*self.args)
            task = asyncio.Task(self.run(coro), loop=loop, **_EAGER)
        except BaseException as exc:  # the loop is closing: the caller hears of it
            self.error = exc
            self.finished()
            return
        self.task = task
        # A task cancelled before its first step never runs run()'s finally.
        task.add_done_callback(self.finished)

    async def run(self, coro: Coroutine[Any, Any, Any]) -> None:
        """The call, which wakes its caller itself: one loop iteration sooner than a
        done-callback would."""
        self.coro = None  # started: it is awaited here
        try:
            self.value = await coro
        except BaseException as exc:  # handed to the caller's thread
            self.failed = exc
        finally:
            self.finished()

    def finished(self, _: object = None) -> None:
        if self.coro is not None:  # cancelled before its first step: it never ran
            self.coro.close()
            self.coro = None
        if not self.released:
            self.released = True
            self.done.release()

    def interrupted(self, loop: asyncio.AbstractEventLoop, interrupt: Interrupt) -> None:
        """In the loop, after an interrupt of the caller. Queued after :meth:`begin`, so
        that has run by now if the caller queued it at all: a call to cancel is cancelled
        (or, never begun, ended here: nothing waits for it), and one that must finish is
        begun now if the interrupt came before it was queued."""
        if interrupt is Interrupt.CANCEL:
            if self.task is None:
                self.finished()
            else:
                self.task.cancel("asynclock.sync: the calling thread was interrupted")
        else:
            self.begin(loop)

    def wait_uninterrupted(self) -> None:
        """Wait for the end; interrupts meanwhile are kept for after (the first wins).

        By the ``released`` flag, not the lock: an interrupt raised right after an
        ``acquire()`` that succeeded (the signal handler runs when it returns) leaves the
        lock taken with nobody knowing, and a second ``acquire()`` would wait forever.
        """
        pending: BaseException | None = None
        while not self.released:
            try:
                self.done.acquire(timeout=0.05)
            except BaseException as exc:
                pending = pending or exc
        if pending is not None:
            raise pending


class LoopThread:
    """An event loop in a daemon thread, started on first use, stopped by :meth:`stop`.

    After ``fork()`` (in the child) the loop and its thread are gone: :meth:`forked`
    forgets them, and the next call starts fresh ones.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._mutex = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._stopped = False
        self._starting: tuple[asyncio.AbstractEventLoop, threading.Thread, threading.Event] | None
        self._starting = None
        self._running: set[asyncio.Task[Any]] = set()  # calls left to finish (FINISH)
        _threads.add(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The running loop, or None before the first call (and after a fork)."""
        return self._loop

    def in_loop_thread(self) -> bool:
        """True when called from the loop's own thread (a blocking call would hang)."""
        return self._ident == threading.get_ident()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._mutex:
            if self._stopped:
                raise CoordinatorClosed("this Coordinator is closed")
            if self._loop is not None:
                return self._loop
            # Kept from the first try on: an interrupt may land in thread.start() after
            # the thread began, and the next call must adopt that thread, not start a
            # second loop (that stop() would never hear of).
            if self._starting is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()
                thread = threading.Thread(
                    target=self._run, args=(loop, started), name=self._name, daemon=True
                )
                self._starting = (loop, thread, started)
            loop, thread, started = self._starting
            if not started.wait(0 if thread.ident is None else 5.0):
                thread.start()
                started.wait()
            self._thread = thread
            self._loop = loop
            self._starting = None
            return loop

    def _run(self, loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        self._ident = threading.get_ident()
        loop.call_soon(started.set)
        try:
            loop.run_forever()
            # Stopped by stop(): what is still running ends cancelled (every waiting
            # caller hears CoordinatorClosed), then the loop's own clean-ups.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    def call(
        self,
        function: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        interrupt: Interrupt = Interrupt.CANCEL,
    ) -> T:
        """Run ``function(*args)`` in the loop and wait for its result (or exception).

        A result that an interrupt keeps from the caller (a grant) is the caller's to
        give back: a call that grants something hands it over in the loop, before it
        returns (see ``asynclock.sync._lock``), where no interrupt can take it away.
        """
        loop = self._loop or self._start()
        if self._ident == threading.get_ident():
            raise RuntimeError(
                "a blocking asynclock.sync call was made from the coordinator's own event "
                "loop thread (a callback running there): it would wait for itself"
            )
        call = _Call(function, args)
        try:
            # (Inside the try: an interrupt may land in the middle of the queueing, with
            # begin() queued or not; interrupted() sorts it out in the loop.)
            loop.call_soon_threadsafe(call.begin, loop)
            call.done.acquire()
        except RuntimeError as exc:
            if loop.is_closed():  # the loop was closed meanwhile
                raise CoordinatorClosed("this Coordinator is closed") from exc
            raise
        except BaseException:
            self._interrupted(loop, call, interrupt)
            raise
        if call.error is not None:
            raise CoordinatorClosed("this Coordinator is closed") from call.error
        failed = call.failed
        if failed is None:
            if call.task is not None and call.task.cancelled():
                raise CoordinatorClosed("this Coordinator was closed while the call ran")
            result: T = call.value
            return result
        if isinstance(failed, asyncio.CancelledError):  # by the close: nobody else cancels
            raise CoordinatorClosed("this Coordinator was closed while the call ran") from None
        raise failed

    def _interrupted(
        self,
        loop: asyncio.AbstractEventLoop,
        call: _Call,
        interrupt: Interrupt,
    ) -> None:
        """The waiting thread was interrupted: cancel the call and wait for its end, or
        leave it to finish in the loop."""
        try:
            loop.call_soon_threadsafe(call.interrupted, loop, interrupt)
        except RuntimeError:  # closed: the close ended the call
            return
        if interrupt is Interrupt.FINISH:
            loop.call_soon_threadsafe(self._keep, call)
        else:
            call.wait_uninterrupted()

    def _keep(self, call: _Call) -> None:
        task: asyncio.Task[Any] | None = call.task
        if task is not None and not task.done():
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def spawn(self, function: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Run ``function()`` in the loop in the background (errors are logged)."""

        def start() -> None:
            task = asyncio.get_running_loop().create_task(function())
            self._running.add(task)
            task.add_done_callback(_log_failure)
            task.add_done_callback(self._running.discard)

        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: the close ended it
                loop.call_soon_threadsafe(start)

    def stop(self) -> None:
        """Stop the loop (after the caller closed what ran on it) and join its thread."""
        with self._mutex:
            self._stopped = True
            loop, thread = self._loop, self._thread
            if loop is None and self._starting is not None:
                loop, thread, _ = self._starting  # a start that was interrupted
        if loop is None or thread is None or thread.ident is None:
            if loop is not None and not loop.is_running() and not loop.is_closed():
                loop.close()  # never started
            return
        if thread is threading.current_thread():
            raise RuntimeError("the coordinator cannot be closed from its own loop thread")
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # already closed
            return
        thread.join(_JOIN_TIMEOUT)
        if thread.is_alive():
            logger.warning("the asynclock loop thread %r did not stop in time", self._name)

    def forked(self) -> None:
        """In a forked child: the parent's loop thread does not exist here. Forget it
        (untouched: its sockets are the parent's) and start afresh on the next call."""
        _abandoned.append((self._loop, self._thread))
        self._mutex = threading.Lock()
        self._loop = None
        self._thread = None
        self._starting = None
        self._ident = None
        self._running = set()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.warning("asynclock.sync: a background clean-up failed: %s", error)


# Loop threads of this process, and what a fork left of the parent's: kept referenced
# (never closed, collected or touched in the child: closing them there would close the
# parent's connections' shared sockets, or send on them).
_threads: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_abandoned: list[object] = []


def _after_fork_in_child() -> None:
    for loop_thread in list(_threads):
        loop_thread.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
