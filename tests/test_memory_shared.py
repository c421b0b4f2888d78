"""``memory://NAME``: one table shared by coordinators that come and go, and by threads."""

from __future__ import annotations

import asyncio
import gc
import secrets
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import asynclock

# Waiters that heard no wake-up would sleep this long between attempts: a run that
# finishes well inside it was woken by releases, across the threads' event loops.
_NO_WAKEUP = asynclock.Backoff(initial=30.0, maximum=30.0, jitter=False)


@pytest.fixture
def url() -> str:
    return f"memory://shared-{secrets.token_hex(4)}"


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond, so unguarded table updates interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


async def test_fences_never_go_back_when_the_last_coordinator_of_a_table_goes(url: str) -> None:
    """A name's fences keep increasing after every coordinator on its table was closed and
    collected: the next job's fence is above the last one's."""

    async def job() -> int:
        async with asynclock.connect(url) as coord, coord.lock("report") as lease:
            return lease.fence

    fences = []
    for _ in range(4):
        fences.append(await job())
        gc.collect()  # the table goes with its last backend
    assert fences == sorted(set(fences)), f"fences went back: {fences}"


def test_threads_on_one_table_hold_one_at_a_time_and_wake_each_other(
    url: str, fast_switching: None
) -> None:
    """Four threads, each with its own event loop and coordinator on one ``memory://NAME``
    table, take one lock 25 times each: never two inside at once, no error, fences strictly
    increase, and every hand-off comes from a release's wake-up (waiters that missed one
    would sleep 30 s between attempts)."""
    inside = 0
    guard = threading.Lock()
    problems: list[str] = []
    fences: list[int] = []

    async def worker() -> None:
        nonlocal inside
        async with asynclock.connect(url) as coord:
            lock = coord.lock("shared", ttl=30, timeout=60, retry=_NO_WAKEUP)
            for _ in range(25):
                async with lock as lease:
                    with guard:
                        inside += 1
                        if inside > 1:
                            problems.append("two holders at once")
                        fences.append(lease.fence)
                    await asyncio.sleep(0.001)
                    with guard:
                        inside -= 1

    def run() -> None:
        try:
            asyncio.run(worker())
        except BaseException as exc:
            problems.append(repr(exc))

    threads = [threading.Thread(target=run) for _ in range(4)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    took = time.monotonic() - began
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert not problems, problems[:5]
    assert len(fences) == 100
    assert fences == sorted(set(fences)), "fences did not strictly increase"
    assert took < _NO_WAKEUP.maximum, f"{took:.1f}s: a waiter slept without a wake-up"
