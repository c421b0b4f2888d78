"""The owner of background tasks: references kept, failures reported, a bounded close."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from asynclock._tasks import TaskSet


async def test_a_task_is_kept_until_it_ends() -> None:
    """The event loop keeps tasks only weakly: the set's reference keeps one alive."""
    tasks = TaskSet("test")
    gate = asyncio.Event()
    done: list[bool] = []

    async def work() -> None:
        await gate.wait()
        done.append(True)

    tasks.spawn(work(), name="work")
    gc.collect()
    assert len(tasks) == 1
    gate.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert done == [True]
    assert len(tasks) == 0


async def test_a_failure_is_logged_unless_quiet(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet("test")

    async def fail(message: str) -> None:
        raise RuntimeError(message)

    with caplog.at_level(logging.DEBUG, logger="asynclock"):
        loud = tasks.spawn(fail("loud"), name="loud")
        quiet = tasks.spawn(fail("quiet"), name="quiet", quiet=True)
        await asyncio.wait({loud, quiet})
        await asyncio.sleep(0)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert [str(r.exc_info[1]) for r in failures if r.exc_info] == ["loud"]
    assert len(tasks) == 0


async def test_close_waits_then_cancels_within_its_grace() -> None:
    tasks = TaskSet("test")
    finished: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        finished.append("quick")

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            finished.append("cancelled")
            raise

    tasks.spawn(quick(), name="quick")
    stuck = tasks.spawn(forever(), name="forever")
    loop = asyncio.get_running_loop()
    start = loop.time()
    await tasks.close(0.2)
    assert 0.15 < loop.time() - start < 1.0
    assert sorted(finished) == ["cancelled", "quick"]
    assert stuck.cancelled()
    assert len(tasks) == 0
