"""Bridge: what every blocking object of one coordinator shares — its loop thread, the
async :class:`~asynclock.Coordinator` that runs there, and how to make a fresh one after
``fork()``."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._coordinator import Coordinator as AsyncCoordinator
from .._errors import CoordinatorClosed
from ._portal import Interrupt, LoopThread

__all__ = ("Bridge", "Interrupt")

T = TypeVar("T")

logger = logging.getLogger("asynclock")


class Bridge:
    """The loop thread and the async coordinator of one blocking coordinator.

    ``generation`` counts the forks this process came through: objects made before a
    fork (leases above all: their lock is the parent's) are refused in the child.
    """

    def __init__(
        self, core: AsyncCoordinator, rebuild: Callable[[], AsyncCoordinator] | None
    ) -> None:
        self._core: AsyncCoordinator | None = core
        self._rebuild = rebuild
        self._mutex = threading.Lock()
        self.generation = 0
        self.pid = os.getpid()
        self.closed = False
        self._close_ended = threading.Event()
        self._closer_started = False  # (read and set in the loop thread only)
        self.identity = core.identity  # as first made (a repr must not reconnect)
        self.thread = LoopThread(f"asynclock-loop {core.identity}")
        _bridges.add(self)

    def core(self) -> AsyncCoordinator:
        """The async coordinator of this process (made afresh after a fork)."""
        core = self._core
        if core is not None:
            return core
        with self._mutex:
            if self._core is None:
                if self.closed:
                    raise CoordinatorClosed("this Coordinator is closed")
                if self._rebuild is None:
                    raise RuntimeError(
                        f"this asynclock.sync.Coordinator was made from a backend object in "
                        f"process {self.pid}, and is used after fork() in process "
                        f"{os.getpid()}: the backend's connections belong to the parent, "
                        "and a backend object cannot be rebuilt. Make the coordinator in the "
                        "child, or use asynclock.sync.connect(url), which reconnects in a "
                        "child by itself"
                    )
                self._core = self._rebuild()
                self.pid = os.getpid()
            return self._core

    def call(
        self,
        function: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        interrupt: Interrupt = Interrupt.CANCEL,
    ) -> T:
        """Run ``function(*args)`` on the loop thread and wait for it."""
        if self.closed:
            raise CoordinatorClosed("this Coordinator is closed")
        return self.thread.call(function, *args, interrupt=interrupt)

    def check_generation(self, generation: int, what: str) -> None:
        """RuntimeError for an object made before this process was forked."""
        if generation != self.generation:
            raise RuntimeError(
                f"{what} was made before this process was forked: it belongs to the parent "
                "process; make it again in the child"
            )

    def close(self, own: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Close the async coordinator (in the loop; after ``own()``, which ends the
        caller's own leases), then stop the loop thread. A second call waits for the
        first one's close to end.

        The close runs in a thread of its own and this one waits for it: Python runs
        signal handlers in the main thread only, so an interrupt (Ctrl-C) can stop the
        waiting, never the close half-way. The waiting goes on until the close has
        ended (it is bounded), then the interrupt is raised.
        """
        if self.thread.in_loop_thread():
            raise RuntimeError(
                "the coordinator cannot be closed from its own loop thread (a callback "
                "running there): the close would wait for itself"
            )
        pending: BaseException | None = None
        while not self._close_ended.is_set():
            try:
                self._request_close(own)
                self._close_ended.wait(0.05)
            except BaseException as exc:  # raised once the close has ended
                pending = pending or exc
        if pending is not None:
            raise pending

    def _request_close(self, own: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        """Start the close, or do nothing if it has started: every step may be taken again
        after an interrupt (the caller retries until the close has ended), and the steps
        that must happen once happen in the loop thread, where no interrupt lands."""
        self.closed = True
        loop = self.thread.loop
        if loop is None:  # never used: nothing runs, nothing to close
            self.thread.stop()
            self._close_ended.set()
            return
        if loop.is_closed():
            self._close_ended.set()
            return
        try:
            loop.call_soon_threadsafe(self._start_closer, own)
        except RuntimeError:  # closed meanwhile: the close has ended
            self._close_ended.set()

    def _start_closer(self, own: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        """In the loop thread, once: the thread that closes (it waits on this loop)."""
        if self._closer_started:
            return
        self._closer_started = True
        threading.Thread(
            target=self._close, args=(self._core, own), name="asynclock-close", daemon=True
        ).start()

    def _close(
        self,
        core: AsyncCoordinator | None,
        own: Callable[[], Coroutine[Any, Any, None]] | None,
    ) -> None:
        try:
            if core is not None and self.thread.loop is not None:
                if own is not None:
                    self.thread.call(own, interrupt=Interrupt.WAIT)
                self.thread.call(core.aclose, interrupt=Interrupt.WAIT)
        except Exception:
            logger.exception("asynclock.sync: closing the coordinator failed")
        finally:
            try:
                self.thread.stop()
            finally:
                self._close_ended.set()

    def forked(self) -> None:
        """In a forked child: the parent's coordinator stays untouched (its sockets are
        the parent's); the next use makes a fresh one."""
        _abandoned.append(self._core)
        self._core = None
        self._mutex = threading.Lock()
        self._close_ended = threading.Event()
        self._closer_started = False
        self.generation += 1


_bridges: weakref.WeakSet[Bridge] = weakref.WeakSet()
_abandoned: list[object] = []  # never closed, collected or used in the child


def _after_fork_in_child() -> None:
    for bridge in list(_bridges):
        bridge.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
