"""Deadlines for tests whose failure would otherwise be a hang.

A test that exists to catch a lease loss (the body must be cancelled) or a late renewal
waits for something the library must do. When the library does not do it, a bare
``await`` waits forever, and the test fails only at the suite's timeout, saying nothing.
These helpers give such a wait a deadline of its own and fail at once, naming what did
not happen.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import pytest

__all__ = ("DEADLINE", "ends")

T = TypeVar("T")

#: Seconds of wall time a wait that should end at once (a manual clock's, or a few
#: round trips on a local server) may take on a loaded machine.
DEADLINE = 5.0


async def ends(task: asyncio.Task[T], what: str, within: float = DEADLINE) -> T:
    """Wait for ``task`` and return its result (or raise its exception).

    Fails the test with ``what`` (what did not happen) if the task has not ended within
    ``within`` seconds; the task is then cancelled. The task itself is never cancelled
    by the deadline while it is waited for (a body that swallows cancels would keep the
    wait going), and a ``TimeoutError`` the task raises is its own.
    """
    deadline = asyncio.timeout(within)
    try:
        async with deadline:
            return await asyncio.shield(task)
    except TimeoutError:
        if not deadline.expired():
            raise
    task.cancel()
    pytest.fail(f"{what} (the task had not ended {within:g} s later)", pytrace=False)
