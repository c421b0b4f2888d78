"""The cancellation primitives of ``asynclock._cancel``, on real asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from asynclock._cancel import CancelMark, finish_shielded, undo_on_interrupt
from asynclock._tasks import TaskSet


async def _started(task: asyncio.Task[object]) -> None:
    """Let ``task`` run up to its first suspension."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()


class TestCancelMark:
    async def test_a_swallowed_cancel_is_raised(self) -> None:
        """A cancel that a block swallowed is raised as CancelledError when it ends."""
        after: list[str] = []

        async def body() -> None:
            # Swallowed, as Python 3.11's wait_for may do.
            with CancelMark(), contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)
            after.append("ran on")

        task = asyncio.create_task(body())
        await _started(task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert after == []

    async def test_a_replaced_cancel_is_raised_from_the_error(self) -> None:
        """A cancel that a block replaced with its own error is raised, chained from it."""
        raised: list[BaseException] = []

        async def body() -> None:
            try:
                with CancelMark():
                    try:
                        await asyncio.sleep(10)
                    except asyncio.CancelledError:
                        raise ConnectionError("the driver's own error") from None
            except BaseException as exc:
                raised.append(exc)
                raise

        task = asyncio.create_task(body())
        await _started(task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert isinstance(raised[0], asyncio.CancelledError)
        assert isinstance(raised[0].__cause__, ConnectionError)

    async def test_without_a_cancel_the_block_is_left_alone(self) -> None:
        """No cancel: a block's return and its error pass through unchanged."""
        with CancelMark() as mark:
            await asyncio.sleep(0)
        assert not mark.rose()
        with pytest.raises(KeyError), CancelMark():
            raise KeyError("x")

    async def test_take_back_tells_own_cancels_from_outside_ones(self) -> None:
        """take_back() is True when every cancel since the mark was ours, else False."""
        seen: list[bool] = []

        async def body() -> None:
            task = asyncio.current_task()
            assert task is not None
            mark = CancelMark()
            task.cancel()
            task.cancel()
            seen.append(mark.take_back(2))  # both ours
            seen.append(task.cancelling() == mark.count)
            task.cancel()  # from "elsewhere"
            task.cancel()  # ours
            seen.append(mark.take_back(1))

        # Its cancels may still be pending when it returns (Python < 3.13): run apart.
        await asyncio.gather(asyncio.create_task(body()), return_exceptions=True)
        assert seen == [True, True, False]


class TestUndoOnInterrupt:
    async def test_undo_runs_on_a_cancel_and_an_error_but_not_on_success(self) -> None:
        """The undo runs when the block is cancelled or fails, never when it returns."""
        undone: list[str] = []

        async def body(how: str) -> None:
            with undo_on_interrupt(undone.append, how):
                if how == "error":
                    raise ValueError(how)
                await asyncio.sleep(0 if how == "success" else 10)

        await body("success")
        with pytest.raises(ValueError, match="error"):
            await body("error")
        task = asyncio.create_task(body("cancel"))
        await _started(task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert undone == ["error", "cancel"]


class TestFinishShielded:
    async def test_the_clean_up_finishes_despite_a_cancel_which_comes_after(self) -> None:
        """A cancelled caller waits for its clean-up to finish, then is cancelled."""
        tasks = TaskSet("test")
        release = asyncio.Event()
        order: list[str] = []

        async def clean_up() -> None:
            await release.wait()
            order.append("cleaned up")

        async def caller() -> None:
            try:
                await finish_shielded(tasks.spawn(clean_up(), name="clean-up"))
            except asyncio.CancelledError:
                order.append("cancelled")
                raise

        task = asyncio.create_task(caller())
        await _started(task)
        task.cancel()
        await asyncio.sleep(0.01)
        assert order == []  # still waiting: the cancel did not end the wait
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert order == ["cleaned up", "cancelled"]
        await tasks.close(1.0)

    async def test_the_wait_is_bounded_and_the_clean_up_goes_on(self) -> None:
        """Past ``within`` the cancel is delivered; the clean-up goes on in its owner."""
        tasks = TaskSet("test")
        release = asyncio.Event()
        work = tasks.spawn(release.wait(), name="slow clean-up")
        task = asyncio.create_task(finish_shielded(work, within=0.05))
        await _started(task)
        task.cancel()
        async with asyncio.timeout(5):  # generous: the bound is 0.05 s
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not work.done()
        # Not cancelled: it returns at the bound too, and the clean-up still goes on.
        await finish_shielded(work, within=0.01)
        assert not work.done()
        release.set()
        await tasks.close(1.0)
        assert work.done()
        assert not work.cancelled()

    async def test_the_clean_ups_error_reaches_a_caller_not_cancelled(self) -> None:
        """Without a cancel, the clean-up's own error is raised to the caller."""
        tasks = TaskSet("test")

        async def failing() -> None:
            raise OSError("clean-up failed")

        with pytest.raises(OSError, match="clean-up failed"):
            await finish_shielded(tasks.spawn(failing(), name="failing", quiet=True))
        await tasks.close(1.0)
