"""The cancellation primitives every other module uses.

asyncio delivers a cancel as a ``CancelledError`` at the task's next suspension, and
counts it in ``Task.cancelling()`` until someone calls ``Task.uncancel()``. Three things
go wrong around that, and each has one answer here:

- a driver swallows a cancel (Python 3.11's ``asyncio.wait_for`` returns an inner result
  that finished as the cancel landed) or replaces it with its own error:
  :class:`CancelMark` notices the count rose with no ``CancelledError`` and raises one;
- a block that took something (a registration, a subscription, a connection) is
  interrupted half-way: :func:`undo_on_interrupt` gives it back, whatever ended the block;
- a clean-up must not be stopped half-way by the caller's cancel:
  :func:`finish_shielded` waits for it, bounded, and delivers the cancel after it.

:class:`CancelMark` also tells a cancel of our own from one sent from elsewhere (the
pattern of ``asyncio.timeout``): the lease's loss delivery takes its own cancels back
with :meth:`CancelMark.take_back`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ._types import ExcType, ExcValue, Traceback

__all__ = ("CancelMark", "finish_shielded", "undo_on_interrupt")


class CancelMark:
    """A task's cancel count (``Task.cancelling()``) at one moment, to compare later.

    Used as a context manager (``with CancelMark():``), it raises the ``CancelledError``
    of a cancel that arrived during the block and did not surface: when the block ends
    normally, or with an ``Exception`` (which the ``CancelledError`` is then chained
    from). A block that ends with ``CancelledError`` or another ``BaseException`` is let
    through unchanged. Outside a task (no current task) nothing is ever raised.

    ``task``: the task to watch (default: the current one).
    """

    __slots__ = ("count", "task")

    def __init__(self, task: asyncio.Task[Any] | None = None) -> None:
        self.task = asyncio.current_task() if task is None else task
        #: ``task.cancelling()`` when the mark was made (0 without a task).
        self.count = self.task.cancelling() if self.task is not None else 0

    def rose(self) -> bool:
        """True if the task was cancelled (and not uncancelled) since the mark."""
        task = self.task
        return task is not None and task.cancelling() > self.count

    def raise_if_swallowed(self, error: BaseException | None = None) -> None:
        """Raise ``CancelledError`` (from ``error``, the error that took its place, if
        any) if the task was cancelled since the mark; else return. For a caller that
        saw no ``CancelledError``: the reply or ``error`` it got is then to be dropped,
        and what the interrupted request may have done undone, as for any cancel."""
        if self.rose():
            raise asyncio.CancelledError from error

    def take_back(self, cancels: int) -> bool:
        """``Task.uncancel()`` the ``cancels`` (>= 1) cancels this code sent to the task
        itself since the mark; True if the task is then back at the mark's count (every
        cancel since the mark was ours), False if a cancel from elsewhere remains (it must
        win). ``asyncio.timeout``'s test of whether a cancel is its own."""
        task = self.task
        assert task is not None
        assert cancels >= 1
        for _ in range(cancels - 1):
            task.uncancel()
        return task.uncancel() <= self.count

    def __enter__(self) -> CancelMark:
        return self

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        if exc is None or isinstance(exc, Exception):
            self.raise_if_swallowed(exc)

    def __repr__(self) -> str:
        return f"<CancelMark count={self.count} rose={self.rose()}>"


class _Undo:
    __slots__ = ("_args", "_undo")

    def __init__(self, undo: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._undo = undo
        self._args = args

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        if exc is not None:
            self._undo(*self._args)


def undo_on_interrupt(undo: Callable[..., object], *args: Any) -> _Undo:
    """A context manager that calls ``undo(*args)`` if its block ends with any exception
    (a cancel, a timeout, an error, ``KeyboardInterrupt``) and then lets that exception
    propagate; a block that ends normally calls nothing.

    ``undo`` is synchronous: it runs before the exception leaves, with no suspension in
    which another cancel could land. An exception ``undo`` raises takes the place of the
    block's (chained from it), as in an ``except`` clause.
    """
    return _Undo(undo, args)


async def finish_shielded(work: asyncio.Future[Any], within: float | None = None) -> None:
    """Wait for the clean-up ``work`` (a task its owner keeps a reference to: a
    :class:`~asynclock._tasks.TaskSet`, say) for at most ``within`` seconds (None: until
    it is done), without letting the caller's cancel stop it.

    A cancel of the caller during the wait does not reach ``work`` and does not end the
    wait: it is raised (``CancelledError``) once the wait is over, whatever ``work``'s
    outcome. Without a cancel, ``work``'s error is raised if it finished with one (its
    ``CancelledError`` too, if it was cancelled by its owner); if ``within`` passed
    first, this returns and ``work`` goes on in the background, owned as before.
    """
    loop = asyncio.get_running_loop()
    deadline = None if within is None else loop.time() + within
    cancelled: asyncio.CancelledError | None = None
    while not work.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            break
        try:
            # asyncio.wait never cancels what it waits for: a cancel ends only the wait.
            await asyncio.wait((work,), timeout=left)
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    if cancelled is not None:
        if work.done() and not work.cancelled():
            work.exception()  # retrieved: the cancel wins over the clean-up's error
        raise cancelled
    if work.done():
        work.result()
