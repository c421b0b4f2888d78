"""Elections under the faults they exist for, against a real Valkey behind a proxy.

A shutdown that cancels ``run()`` while the server does not answer, a cancel scope that
keeps cancelling (anyio, as Starlette uses it), callbacks that raise, and observers
across a server restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import anyio
import pytest
from pytest_asynclock.proxy import FaultProxy

import asynclock
from asynclock import Term

from .conftest import eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def proxy(asynclock_redis_url: str) -> AsyncIterator[FaultProxy]:
    async with FaultProxy.from_url(asynclock_redis_url) as proxy:
        yield proxy


@pytest.fixture
async def coord(
    proxy: FaultProxy, asynclock_redis_url: str
) -> AsyncIterator[asynclock.Coordinator]:
    coord = asynclock.connect(proxy.url_for(asynclock_redis_url), socket_timeout=1.0)
    async with coord:
        yield coord


@pytest.fixture
async def direct(asynclock_redis_url: str) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.connect(asynclock_redis_url) as coord:
        yield coord


def name() -> str:
    return f"el-{uuid.uuid4().hex[:8]}"


class TestShutdown:
    @pytest.mark.parametrize("fault", ["refuse", "blackhole"])
    async def test_cancelling_run_with_the_server_down_stops_it(
        self,
        coord: asynclock.Coordinator,
        proxy: FaultProxy,
        fault: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The server stops answering, then the app shuts down: run() ends cancelled and
        never campaigns again (the release fails; that must not replace the cancel)."""
        election = coord.election(name(), ttl=3, identity="me")
        leading = asyncio.Event()

        async def lead(term: Term) -> None:
            leading.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(election.run(lead))
        await asyncio.wait_for(leading.wait(), 10)
        proxy.apply(fault)
        task.cancel()
        with caplog.at_level(logging.WARNING, logger="asynclock"):
            done, _ = await asyncio.wait([task], timeout=10)
        assert done, "run() still running 10 s after it was cancelled"
        assert task.cancelled()
        assert "campaigning again" not in caplog.text

    async def test_cancel_scope_ends_leadership(
        self, coord: asynclock.Coordinator, direct: asynclock.Coordinator
    ) -> None:
        """An anyio task group cancelled (as Starlette's lifespan does) while run() leads:
        leadership is given back at once, not held and renewed with no callback."""
        election = coord.election(name(), ttl=20, identity="me")
        for _ in range(5):
            leading = asyncio.Event()

            async def lead(term: Term, leading: asyncio.Event = leading) -> None:
                leading.set()
                await anyio.sleep_forever()

            async with anyio.create_task_group() as group:
                group.start_soon(election.run, lead)
                await leading.wait()
                group.cancel_scope.cancel()
            # Given back within a short give-back, long before the TTL would end it.
            assert await eventually(lambda: coord.held == [], within=3)
            assert await direct.inspect("election:" + election.name) is None


class TestCallbacksThatRaise:
    @pytest.mark.parametrize("error", [asynclock.BackendError, asynclock.LockLost])
    async def test_a_raising_callback_backs_off(
        self, error: type[Exception], caplog: pytest.LogCaptureFixture
    ) -> None:
        """A callback that raises a backend error or a loss at once is restarted with a
        growing backoff, not in a tight loop: on memory
        the loop keeps turning (other tasks run) and the restarts are few."""
        calls = 0

        async def fail(term: Term) -> None:
            nonlocal calls
            calls += 1
            raise error("boom")

        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        async with asynclock.connect("memory://") as coord:
            election = coord.election(
                name(),
                ttl=5,
                identity="me",
                retry=asynclock.Backoff(initial=0.05, maximum=5, jitter=False),
            )
            ticker = asyncio.create_task(tick())
            with caplog.at_level(logging.WARNING, logger="asynclock"):
                runner = asyncio.create_task(election.run(fail))
                await asyncio.sleep(1.0)
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
            ticker.cancel()
        assert ticks >= 20, "the event loop froze"
        # 0.05 + 0.1 + 0.2 + 0.4 = 0.75 s: at most 5 calls in the first second
        assert 2 <= calls <= 6, calls

    async def test_a_callback_raising_a_bug_ends_run_and_resigns(self) -> None:
        """Anything else is a bug: run() resigns and raises it instead of retrying."""
        calls = 0

        async def fail(term: Term) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("bug")

        async with asynclock.connect("memory://") as coord:
            election = coord.election(name(), ttl=5, identity="me")
            with pytest.raises(RuntimeError, match="bug"):
                await election.run(fail)
            assert calls == 1
            assert await election.leader() is None


class TestObserve:
    async def test_observe_survives_a_server_outage(
        self, coord: asynclock.Coordinator, direct: asynclock.Coordinator, proxy: FaultProxy
    ) -> None:
        """The observer's connection goes down while the leader changes: when it comes
        back, observe() resumes from the new leader instead of ending."""
        watched = coord.election(name(), ttl=30, identity="observer")
        first = direct.election(watched.name, ttl=30, identity="first")
        second = direct.election(watched.name, ttl=30, identity="second")
        seen: list[str | None] = []
        observer = asyncio.create_task(collect(watched.observe(), seen))
        try:
            assert await eventually(lambda: seen == [None], within=10)
            async with first.leadership():
                assert await eventually(lambda: seen[-1:] == ["first"], within=10)
                proxy.reset()
                proxy.refuse()
                await asyncio.sleep(1.5)  # the observer's look-again fails meanwhile
            async with second.leadership():
                await asyncio.sleep(0.5)
                proxy.heal()
                assert await eventually(lambda: seen[-1:] == ["second"], within=15), seen
                assert not observer.done(), observer
        finally:
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer


async def collect(observer: AsyncIterator[str | None], into: list[str | None]) -> None:
    async for leader in observer:
        into.append(leader)
