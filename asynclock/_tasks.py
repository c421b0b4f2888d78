"""Background tasks with an owner.

Every task asynclock starts in the background (a give-back after a cancelled acquire, a
renewal, a straggling Redlock reply, an unsubscribe, the close of a broken connection)
is started through the :class:`TaskSet` of the object that owns it: the coordinator, or
its backend. The set keeps a strong reference (the event loop keeps only a weak one, so
an unreferenced task can be collected mid-way), names the task, retrieves its outcome
(nothing is left for "Task exception was never retrieved"), and :meth:`TaskSet.close`
ends them all within a bound when the owner closes, so nothing outlives ``aclose()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ("TaskSet",)

logger = logging.getLogger("asynclock")

T = TypeVar("T")


class TaskSet:
    """The background tasks of one owner (see the module docstring).

    ``spawn(..., quiet=True)`` is for work whose failure is expected and harmless (the
    close of a connection that already broke); other failures are logged with their
    traceback, since nobody else will see them.
    """

    __slots__ = ("_closed", "_owner", "_quiet", "_tasks")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._quiet: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str, quiet: bool = False
    ) -> asyncio.Task[T]:
        """Start ``coro`` as a task named ``name`` that this set owns."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        if quiet:
            self._quiet.add(task)
        task.add_done_callback(self._finished)
        return task

    def spawn_unless_closed(
        self, coro: Coroutine[Any, Any, Any], *, name: str, quiet: bool = False
    ) -> bool:
        """:meth:`spawn` for clean-up work, unless :meth:`close` has returned: then
        ``coro`` is closed unstarted (nobody would be left to end its task: what it was
        to give back ends by its TTL) and False is returned."""
        if self._closed:
            coro.close()
            return False
        self.spawn(coro, name=name, quiet=quiet)
        return True

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        quiet = task in self._quiet
        self._quiet.discard(task)
        if task.cancelled():
            return
        error = task.exception()  # retrieved either way
        if error is not None and not quiet:
            logger.warning(
                "background task %s of %s failed", task.get_name(), self._owner, exc_info=error
            )

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, grace: float) -> None:
        """Give the tasks ``grace`` seconds to end, then cancel the rest and wait for
        them (a task that ignores its cancel is logged and left after another second).
        Clean-ups offered after that are not started (:meth:`spawn_unless_closed`)."""
        try:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=grace)
            pending = set(self._tasks)
            if not pending:
                return
            for task in pending:
                task.cancel()
            _, stuck = await asyncio.wait(pending, timeout=1.0)
            for task in stuck:
                logger.warning(
                    "background task %s of %s ignored its cancel", task.get_name(), self._owner
                )
        finally:
            self._closed = True

    def __repr__(self) -> str:
        return f"<TaskSet of {self._owner}: {len(self._tasks)} running>"
