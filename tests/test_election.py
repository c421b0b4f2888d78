"""Leader election on every backend: one leader, term fences, observe(), run()."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

import asynclock
from asynclock import BackendError, Backoff, LeadershipLost, Term
from asynclock.backends import (
    Backend,
    LockInfo,
    MemoryBackend,
    PostgresBackend,
    RedisBackend,
    RedlockBackend,
)
from asynclock.postgres import lock_ids
from asynclock.testing import ManualClock

from ._deadline import ends
from .conftest import MakeCoord, eventually


async def take_away(backend: Backend, name: str) -> None:
    """End the holder's lease on the server behind its back."""
    if isinstance(backend, MemoryBackend):
        backend.drop(name)
    elif isinstance(backend, RedisBackend):
        await backend.client.delete(backend.keys(name).lock)
    elif isinstance(backend, RedlockBackend):
        for node in backend.nodes:
            await node.client.delete(node.keys(name).lock)
    elif isinstance(backend, PostgresBackend):
        classid, objid = lock_ids(backend.key(name))
        async with backend.pool.acquire() as conn:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                "AND classid = $1 AND objid = $2 AND objsubid = 1",
                classid,
                objid,
            )


async def collect(observer: AsyncIterator[str | None], into: list[str | None]) -> None:
    async for leader in observer:
        into.append(leader)


async def frozen_leader(
    coord: asynclock.Coordinator, election: asynclock.Election, entered: asyncio.Event
) -> None:
    """Lead ``election`` and stop renewing (``entered`` is set then), as if the leader's
    process had frozen."""
    async with election.leadership() as term:
        term.lease._renew = False
        coord._engine.watchdog.reschedule(term.lease._held_watch(), term.lease.valid_until)
        entered.set()
        await asyncio.sleep(3600)


class TestLeadership:
    async def test_one_leader_and_increasing_terms(self, make_coord: MakeCoord) -> None:
        """Three candidates take turns: one leads at a time, terms grow, leader() knows."""
        coords = [make_coord() for _ in range(3)]
        elections = [c.election("sched", ttl=5, identity=f"node-{i}") for i, c in enumerate(coords)]
        leading: list[str] = []
        most = 0
        terms: list[int] = []

        async def campaign(election: asynclock.Election) -> None:
            nonlocal most
            for _ in range(3):
                async with election.leadership() as term:
                    leading.append(term.identity)
                    most = max(most, len(leading))
                    terms.append(term.fence)
                    assert await election.leader() == election.identity
                    await asyncio.sleep(0.01)
                    leading.remove(term.identity)

        await asyncio.gather(*(campaign(e) for e in elections))
        assert most == 1
        assert terms == sorted(terms)
        assert len(set(terms)) == 9
        assert await elections[0].leader() is None

    async def test_lost_leadership_raises_leadership_lost(self, make_coord: MakeCoord) -> None:
        """A leader whose lease is taken from it is cancelled with LeadershipLost."""
        coord = make_coord()
        election = coord.election("lost", ttl=0.6, identity="me")
        cancelled = False
        with pytest.raises(LeadershipLost):
            async with election.leadership():
                try:
                    # PostgreSQL hears of the loss at once: the cancel may land in here.
                    await take_away(coord.backend, "election:lost")
                    await asyncio.sleep(5)  # a renewal at ttl/3 notices long before
                except asyncio.CancelledError:
                    cancelled = True
                    raise
        assert cancelled, "the lost leadership did not cancel the leader's body"

    async def test_identity_and_validation(self, make_coord: MakeCoord) -> None:
        """Identity defaults to host:pid:random; bad arguments fail at the call."""
        coord = make_coord()
        assert coord.election("x").identity.count(":") == 2
        with pytest.raises(ValueError, match="ttl"):
            coord.election("x", ttl=0)
        with pytest.raises(TypeError):
            coord.election(42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="identity"):
            coord.election("x", identity="")


class TestObserve:
    async def test_observe_follows_every_change_in_order(self, make_coord: MakeCoord) -> None:
        """observe() yields the current leader first, then each change in order, even
        when leaders follow each other fast."""
        watcher, candidate = make_coord(), make_coord()
        seen: list[str | None] = []
        observer = asyncio.create_task(collect(watcher.election("fast").observe(), seen))
        assert await eventually(lambda: seen == [None])
        expected = []
        for i in range(8):
            election = candidate.election("fast", ttl=5, identity=f"leader-{i}")
            async with election.leadership():
                expected.append(f"leader-{i}")
        # Every leader resigned, so a None follows each of them: wait for the last one.
        # An announcement is best effort; without it the observer looks again when the
        # term could have ended (ttl=5), so allow a few of those on a loaded machine.
        assert await eventually(lambda: len(seen) == 1 + 2 * len(expected), within=20)
        observer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await observer
        assert [s for s in seen if s is not None] == expected
        assert seen[0] is None
        # Every leader resigned, so a None follows each of them.
        assert seen == [None] + [x for name in expected for x in (name, None)]

    async def test_observe_starts_with_the_current_leader(self, make_coord: MakeCoord) -> None:
        """An observer that starts while someone leads sees that leader first."""
        leader_coord, watcher = make_coord(), make_coord()
        seen: list[str | None] = []
        async with leader_coord.election("now", identity="incumbent").leadership():
            observer = asyncio.create_task(collect(watcher.election("now").observe(), seen))
            assert await eventually(lambda: seen == ["incumbent"])
        assert await eventually(lambda: seen == ["incumbent", None])
        observer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await observer


class TestRun:
    async def test_run_leads_then_resigns_when_cancelled(self, make_coord: MakeCoord) -> None:
        """run() calls the callback while leading; cancelling run() resigns."""
        coord, watcher = make_coord(), make_coord()
        election = coord.election("runner", ttl=5, identity="runner")
        terms: list[Term] = []
        leading = asyncio.Event()

        async def callback(term: Term) -> None:
            terms.append(term)
            leading.set()
            await asyncio.sleep(3600)

        task = asyncio.create_task(election.run(callback))
        await asyncio.wait_for(leading.wait(), 5)
        assert await watcher.election("runner").leader() == "runner"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await watcher.election("runner").leader() is None
        assert terms[0].name == "runner"

    async def test_run_campaigns_again_after_the_callback_returns(
        self, make_coord: MakeCoord
    ) -> None:
        """A callback that returns resigns; run() campaigns again and leads again."""
        coord = make_coord()
        election = coord.election("again", ttl=5, identity="again")
        terms: list[int] = []

        async def callback(term: Term) -> None:
            terms.append(term.fence)

        task = asyncio.create_task(election.run(callback))
        assert await eventually(lambda: len(terms) >= 3, within=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert terms == sorted(terms)

    async def test_two_runners_one_leads(self, make_coord: MakeCoord) -> None:
        """Two campaigners: exactly one callback runs; when it stops, the other takes over."""
        a, b = make_coord(), make_coord()
        running: list[str] = []

        def campaign(coord: asynclock.Coordinator, who: str) -> asyncio.Task[None]:
            async def callback(term: Term) -> None:
                running.append(who)
                try:
                    await asyncio.sleep(3600)
                finally:
                    running.remove(who)

            return asyncio.create_task(coord.election("pair", ttl=5, identity=who).run(callback))

        first = campaign(a, "a")
        second = campaign(b, "b")
        assert await eventually(lambda: len(running) == 1)
        await asyncio.sleep(0.3)
        assert len(running) == 1
        leader_task, other = (first, "b") if running == ["a"] else (second, "a")
        leader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader_task
        assert await eventually(lambda: running == [other], within=5)
        for task in (first, second):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class TestOnAManualClock:
    async def test_crashed_leader_is_noticed_after_its_ttl(self) -> None:
        """A leader that stops renewing (frozen, crashed) announces nothing; an observer
        notices once its TTL could have run out."""
        clock = ManualClock()
        backend = MemoryBackend(clock=clock)
        async with asynclock.Coordinator(backend) as coord:
            election = coord.election("crash", ttl=10, identity="old")

            entered = asyncio.Event()
            leader = asyncio.create_task(frozen_leader(coord, election, entered))
            await entered.wait()
            seen: list[str | None] = []
            observer = asyncio.create_task(collect(coord.election("crash").observe(), seen))
            await clock.settle()
            assert seen == ["old"]
            backend.drop("election:crash")  # the server forgets it, no announcement
            await clock.advance(11)
            assert seen == ["old", None]
            with pytest.raises(LeadershipLost):
                await ends(leader, "the end of the leader's validity did not stop its body")
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer

    async def test_an_observer_retries_on_the_coordinators_clock(self) -> None:
        """An observer that cannot reach the backend looks again after the election's
        backoff on the coordinator's clock: a minute of ManualClock, not of real time."""
        clock = ManualClock()
        failures = 0

        class Failing(MemoryBackend):
            async def inspect(self, name: str) -> LockInfo | None:
                nonlocal failures
                if failures:
                    failures -= 1
                    raise BackendError("unreachable (planted)")
                return await super().inspect(name)

        backend = Failing(clock=clock)
        async with asynclock.Coordinator(backend) as coord:
            minute = Backoff(initial=60, maximum=60, jitter=False)
            seen: list[str | None] = []
            observer = asyncio.create_task(
                collect(coord.election("far", ttl=10, retry=minute).observe(), seen)
            )
            await clock.settle()
            assert seen == [None]
            failures = 1
            await clock.advance(10.1)  # its look after a ttl fails: it waits a minute
            async with coord.election("far", ttl=100, identity="new").leadership():
                await clock.advance(30)
                assert seen == [None]  # still waiting out the minute
                await clock.advance(31)
                assert seen == [None, "new"]
                observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer


class TestObserversFollowTheLeader:
    async def test_a_crashed_leader_is_noticed_within_its_own_ttl(self) -> None:
        """An observer whose election ttl (10 s) is longer than the leader's (2 s) notices
        the crashed leader once the leader's lease could have ended, not its own ttl."""
        clock = ManualClock()
        backend = MemoryBackend(clock=clock)
        async with asynclock.Coordinator(backend) as coord:
            election = coord.election("short", ttl=2, identity="leader")

            seen: list[str | None] = []
            observer = asyncio.create_task(collect(coord.election("short", ttl=10).observe(), seen))
            await clock.settle()
            entered = asyncio.Event()
            leader = asyncio.create_task(frozen_leader(coord, election, entered))
            await entered.wait()
            await clock.settle()
            assert seen == [None, "leader"]
            backend.drop("election:short")  # the server forgets it, no announcement
            await clock.advance(3)
            assert seen == [None, "leader", None]
            with pytest.raises(LeadershipLost):
                await ends(leader, "the end of the leader's validity did not stop its body")
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer

    async def test_a_resignation_of_someone_else_does_not_hide_the_leader(
        self, make_coord: MakeCoord
    ) -> None:
        """A resignation that names another candidate (a late one, from an earlier term)
        leaves the current leader in place for observers."""
        coord = make_coord()
        seen: list[str | None] = []
        async with coord.election("gap", ttl=10, identity="b").leadership() as term:
            observer = asyncio.create_task(collect(coord.election("gap").observe(), seen))
            assert await eventually(lambda: seen == ["b"])
            await coord.backend.publish("election:gap", f"resigned {term.fence} a")
            await asyncio.sleep(0.3)
            assert seen == ["b"]
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer

    async def test_observers_end_when_their_coordinator_closes(self, make_coord: MakeCoord) -> None:
        """An observer waiting for news ends with CoordinatorClosed when its coordinator
        closes, not when its next look is due (the election's ttl, a minute here)."""
        coord = make_coord()
        seen: list[str | None] = []
        observer = asyncio.create_task(collect(coord.election("quiet", ttl=60).observe(), seen))
        assert await eventually(lambda: seen == [None])
        await coord.aclose()
        async with asyncio.timeout(10):
            with pytest.raises(asynclock.CoordinatorClosed):
                await observer
