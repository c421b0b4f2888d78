"""Semaphores, read-write locks and fair locks: the contract on every backend that has them.

Runs against real servers (the fixtures start Valkey and PostgreSQL) and memory. A backend
that does not (yet) set ``Kind.PERMIT`` / ``Kind.SHARED`` / ``Kind.FAIR`` in ``kinds``
skips the feature's tests with a reason; it must then refuse the feature with a clear
ValueError, which Redlock always does. Killed-process tests live with each backend.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

import asynclock
from asynclock import Backoff, Lease, LockLost, LockNotOwned, LockTimeout
from asynclock.backends import Kind, MemoryBackend, PostgresBackend, RedisBackend
from asynclock.postgres import lock_ids

from ._deadline import ends
from .conftest import MakeCoord, eventually

# How long a writer may wait behind a steady stream of readers (writer preference).
WRITER_BOUND = 1.0
# How long after the holder's release the next fair waiter must have the lock.
FAIR_HANDOFF_BOUND = 0.5

FEATURES = {
    "semaphore": Kind.PERMIT,
    "rwlock": Kind.SHARED,
    "fair": Kind.FAIR,
}


# Every backend that has the primitives; Redlock, which has none, is tested apart below.
SUPPORTING = ("memory", "redis", "postgres")


@pytest.fixture(params=SUPPORTING)
def backend_kind(request: pytest.FixtureRequest) -> str:
    """The backends of this module (overrides conftest's, which includes Redlock)."""
    return str(request.param)


def need(coord: asynclock.Coordinator, feature: str) -> None:
    """``coord``'s backend supports ``feature`` (all of this module's backends must)."""
    assert FEATURES[feature] in coord.backend.kinds, (type(coord.backend).__name__, feature)


async def tasks_settle(before: set[asyncio.Task[object]]) -> bool:
    """True once every task started since ``before`` was taken has finished."""
    return await eventually(lambda: asyncio.all_tasks() <= before)


async def until_free(probe: Callable[[], Awaitable[Lease]], within: float = 3.0) -> Lease:
    """Try ``probe()`` (a timeout=0 acquire) until it succeeds or ``within`` passes."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await probe()
        except LockTimeout:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


# -- semaphores ----------------------------------------------------------------------------


async def in_line(coord: asynclock.Coordinator, name: str) -> int:
    """How many waiters the server has in the fair lock ``name``'s line now."""
    backend = coord.backend
    if isinstance(backend, MemoryBackend):
        return len(backend._table.queue(name, backend.clock.now()))
    if isinstance(backend, RedisBackend):
        return int(await backend.client.zcard(backend.keys(name).queue))
    if isinstance(backend, PostgresBackend):
        classid, objid = lock_ids(backend.key(name))
        async with backend.pool.acquire() as conn:
            count = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid = $1 AND objid = $2",
                classid,
                objid,
            )
        return int(count)
    raise NotImplementedError(type(backend).__name__)


async def until_in_line(coord: asynclock.Coordinator, name: str, count: int) -> None:
    """Wait until the server has at least ``count`` waiters in ``name``'s line."""
    async with asyncio.timeout(20):
        while await in_line(coord, name) < count:  # noqa: ASYNC110 - polls the server
            await asyncio.sleep(0.005)


class TestSemaphore:
    async def test_never_more_than_limit_inside(self, make_coord: MakeCoord) -> None:
        """50 tasks on 3 coordinators, limit 5: at most 5 inside at once, 5 reached, all done."""
        coords = [make_coord() for _ in range(3)]
        need(coords[0], "semaphore")
        state = {"inside": 0, "most": 0, "done": 0}

        async def worker(i: int) -> None:
            sem = coords[i % 3].semaphore("pool", 5, ttl=10)
            for _ in range(2):
                async with sem:
                    state["inside"] += 1
                    state["most"] = max(state["most"], state["inside"])
                    await asyncio.sleep(0.01)
                    state["inside"] -= 1
                    state["done"] += 1

        async with asyncio.timeout(60):
            await asyncio.gather(*(worker(i) for i in range(50)))
        assert state["done"] == 100
        assert state["most"] == 5
        assert all(c.held == [] for c in coords)

    async def test_permits_have_increasing_fences(self, make_coord: MakeCoord) -> None:
        """Each permit gets its own fence, larger than every earlier permit's, on any
        coordinator, while others are still held."""
        coords = [make_coord() for _ in range(3)]
        need(coords[0], "semaphore")
        fences: list[int] = []
        held: list[Lease] = []
        for i in range(12):
            lease = await coords[i % 3].semaphore("fenced", 3, ttl=10, timeout=5).acquire()
            fences.append(lease.fence)
            held.append(lease)
            if len(held) == 3:  # full: free one, the next grant must still go up
                await held.pop(0).release()
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)
        for lease in held:
            await lease.release()

    async def test_permit_taken_away_is_lost(self, make_coord: MakeCoord) -> None:
        """A permit deleted on the server behind its holder's back: the next renewal is
        refused, the body is cancelled and ``async with`` raises LockLost."""
        a, b = make_coord(), make_coord()
        need(a, "semaphore")
        entered = asyncio.Event()
        leases: list[Lease] = []
        log: list[str] = []

        async def hold() -> None:
            async with a.semaphore("taken", 2, ttl=0.9) as lease:
                leases.append(lease)
                entered.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    log.append("body cancelled")
                    raise

        task = asyncio.create_task(hold())
        await entered.wait()
        (lease,) = leases
        # What an operator's DEL (or the server losing it) does: the holder is not told.
        assert await a.backend.release(lease._claim)
        started = time.monotonic()
        with pytest.raises(LockLost):
            await ends(task, "the permit deleted on the server did not stop its body")
        assert time.monotonic() - started < 1.0  # the renewal at ttl/3 noticed
        assert log == ["body cancelled"]
        assert lease.lost
        assert a.held == []
        # Both permits are free again.
        other = [await b.semaphore("taken", 2, timeout=0).acquire() for _ in range(2)]
        for permit in other:
            await permit.release()

    async def test_expired_permit_taken_over_is_lost(self, make_coord: MakeCoord) -> None:
        """A holder that cannot renew loses its permit at the end of its TTL, its body is
        cancelled, and a waiter gets the permit with a larger fence."""
        a, b = make_coord(), make_coord()
        need(a, "semaphore")
        entered = asyncio.Event()
        fences: list[int] = []

        async def hold() -> None:
            async with a.semaphore("expiring", 1, ttl=0.3, renew=False) as lease:
                fences.append(lease.fence)
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(hold())
        await entered.wait()
        waiter = await b.semaphore("expiring", 1, ttl=10, timeout=3).acquire()
        with pytest.raises(LockLost):
            await ends(task, "the end of an unrenewed permit did not stop its body", 3)
        assert waiter.fence > fences[0]
        await waiter.release()

    async def test_timeout_zero_when_full(self, make_coord: MakeCoord) -> None:
        """With every permit taken, timeout=0 raises LockTimeout at once; one free permit
        is then taken at once."""
        a, b = make_coord(), make_coord()
        need(a, "semaphore")
        held = [await a.semaphore("full", 2, ttl=10).acquire() for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            await b.semaphore("full", 2, ttl=10, timeout=0).acquire()
        assert time.monotonic() - started < 1.0
        await held.pop().release()
        again = await b.semaphore("full", 2, ttl=10, timeout=0).acquire()
        await again.release()
        await held.pop().release()

    async def test_stale_release_raises_not_owned(self, make_coord: MakeCoord) -> None:
        """A permit whose TTL ran out cannot release or extend the permit its successor
        got: LockNotOwned, and the successor keeps it (the semaphore stays full)."""
        a, b, c = make_coord(), make_coord(), make_coord()
        need(a, "semaphore")
        stale = await a.semaphore("stale", 1, ttl=0.2, renew=False).acquire()
        fresh = await b.semaphore("stale", 1, ttl=30, timeout=3).acquire()
        assert fresh.fence > stale.fence
        with pytest.raises(LockNotOwned):
            await stale.release()
        with pytest.raises(LockNotOwned):
            await stale.extend()
        assert fresh.held
        with pytest.raises(LockTimeout):
            await c.semaphore("stale", 1, timeout=0).acquire()
        await fresh.release()
        with pytest.raises(LockNotOwned):
            await fresh.release()  # and a released permit cannot be released twice

    async def test_cancelled_waiter_holds_nothing(self, make_coord: MakeCoord) -> None:
        """A waiting acquire cancelled (while waiting, or racing its grant) leaves no permit
        held and no task behind."""
        a, b, c = make_coord(), make_coord(), make_coord()
        need(a, "semaphore")
        lease = await a.semaphore("cancel", 1, ttl=30).acquire()
        before = asyncio.all_tasks()
        waiter = asyncio.create_task(b.semaphore("cancel", 1, ttl=30).acquire())
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await tasks_settle(before)
        assert b.held == []
        await lease.release()
        for delay in (0, 0.0001, 0.0005, 0.002):  # cancels that may race the grant
            task = asyncio.create_task(b.semaphore("cancel", 1, ttl=30).acquire())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                granted = await task
            except asyncio.CancelledError:
                pass
            else:
                await granted.release()
            # The one permit comes free again (a racing grant is released in the background).
            probe = await until_free(lambda: c.semaphore("cancel", 1, ttl=30, timeout=0).acquire())
            await probe.release()
        assert b.held == []

    @pytest.mark.parametrize(
        ("limit", "error"),
        [
            (0, ValueError),
            (-1, ValueError),
            (10_001, ValueError),
            (2**64, ValueError),
            (True, TypeError),
            (1.5, TypeError),
            (5.0, TypeError),
            ("5", TypeError),
            (None, TypeError),
        ],
        ids=[
            "zero",
            "negative",
            "above-max",
            "huge",
            "bool",
            "float",
            "whole-float",
            "str",
            "none",
        ],
    )
    async def test_bad_limit_rejected(
        self, make_coord: MakeCoord, limit: object, error: type[Exception]
    ) -> None:
        """A limit that is not an int from 1 to 10,000 is rejected before any I/O, on every
        backend (Redlock included), and nothing is held or written."""
        coord, other = make_coord(), make_coord()
        before = asyncio.all_tasks()
        with pytest.raises(error, match="limit"):
            coord.semaphore("bad", limit)  # type: ignore[arg-type]
        assert asyncio.all_tasks() <= before
        assert coord.held == []
        if Kind.PERMIT in other.backend.kinds:
            # The semaphore is untouched: its only permit is free.
            lease = await other.semaphore("bad", 1, timeout=0).acquire()
            await lease.release()

    async def test_semaphore_apart_from_lock_of_same_name(self, make_coord: MakeCoord) -> None:
        """A semaphore and a lock with the same name do not block each other."""
        a, b = make_coord(), make_coord()
        need(a, "semaphore")
        async with a.lock("same-name", ttl=10):
            permit = await b.semaphore("same-name", 1, ttl=10, timeout=0).acquire()
            assert await b.inspect("same-name") is not None
            await permit.release()


# -- read-write locks ----------------------------------------------------------------------


class TestReadWriteLock:
    async def test_readers_overlap(self, make_coord: MakeCoord) -> None:
        """Two readers on different coordinators are inside at the same time."""
        a, b = make_coord(), make_coord()
        need(a, "rwlock")
        first = await a.rwlock("rw", ttl=10).read().acquire()
        second = await b.rwlock("rw", ttl=10, timeout=1).read().acquire()
        assert first.held
        assert second.held
        assert first.fence != second.fence
        await first.release()
        await second.release()

    async def test_writer_excludes_readers_and_writers(self, make_coord: MakeCoord) -> None:
        """While a writer holds, no reader or other writer gets in; while a reader holds,
        no writer does."""
        a, b = make_coord(), make_coord()
        need(a, "rwlock")
        quick = Backoff(initial=0.01, maximum=0.05)  # a refused writer's place lapses fast
        writer = await a.rwlock("ex", ttl=10).write().acquire()
        with pytest.raises(LockTimeout):
            await b.rwlock("ex", timeout=0, retry=quick).read().acquire()
        with pytest.raises(LockTimeout):
            await b.rwlock("ex", timeout=0.2, retry=quick).write().acquire()
        await writer.release()
        # The refused writer gave up; its place lapses within its backoff maximum + 1 s.
        reader = await b.rwlock("ex", ttl=10, timeout=3).read().acquire()
        with pytest.raises(LockTimeout):
            await a.rwlock("ex", timeout=0.2, retry=quick).write().acquire()
        await reader.release()

    async def test_writer_that_gave_up_lets_readers_in(self, make_coord: MakeCoord) -> None:
        """A writer refused with timeout=0 keeps new readers out at most until its place
        lapses (its backoff maximum + 1 s), not for good."""
        a, b, c = make_coord(), make_coord(), make_coord()
        need(a, "rwlock")
        retry = Backoff(initial=0.01, maximum=0.1)
        reader = await a.rwlock("gave-up", ttl=10).read().acquire()
        with pytest.raises(LockTimeout):
            await b.rwlock("gave-up", ttl=10, timeout=0, retry=retry).write().acquire()
        started = time.monotonic()
        second = await c.rwlock("gave-up", ttl=10, timeout=5).read().acquire()
        assert time.monotonic() - started < retry.maximum + 1.0 + 0.5
        await second.release()
        await reader.release()

    async def test_mixed_workers_keep_the_invariant(self, make_coord: MakeCoord) -> None:
        """Readers and writers on 3 coordinators: a writer is always alone, readers share,
        and everyone finishes."""
        coords = [make_coord() for _ in range(3)]
        need(coords[0], "rwlock")
        state = {"readers": 0, "writers": 0, "most_readers": 0, "bad": 0, "done": 0}

        async def worker(i: int) -> None:
            rw = coords[i % 3].rwlock("mixed", ttl=10)
            writing = i % 4 == 0
            for _ in range(3):
                async with rw.write() if writing else rw.read():
                    key = "writers" if writing else "readers"
                    state[key] += 1
                    if state["writers"] > 1 or (state["writers"] and state["readers"]):
                        state["bad"] += 1
                    state["most_readers"] = max(state["most_readers"], state["readers"])
                    await asyncio.sleep(0.005)
                    state[key] -= 1
                    state["done"] += 1

        async with asyncio.timeout(60):
            await asyncio.gather(*(worker(i) for i in range(16)))
        assert state["bad"] == 0
        assert state["done"] == 48
        assert state["most_readers"] >= 2

    async def test_writer_not_starved_by_readers(self, make_coord: MakeCoord) -> None:
        """8 readers looping with 20 ms holds on 2 coordinators: a writer still gets in
        within WRITER_BOUND (1 s), and the readers carry on after it."""
        coords = [make_coord() for _ in range(3)]
        need(coords[0], "rwlock")
        stop = asyncio.Event()
        reads = {"n": 0, "inside": 0, "most": 0}

        async def reader(i: int) -> None:
            rw = coords[i % 2].rwlock("stream", ttl=10)
            while not stop.is_set():
                async with rw.read():
                    reads["inside"] += 1
                    reads["most"] = max(reads["most"], reads["inside"])
                    await asyncio.sleep(0.02)
                    reads["inside"] -= 1
                    reads["n"] += 1

        readers = [asyncio.create_task(reader(i)) for i in range(8)]
        try:
            await asyncio.sleep(0.3)  # the stream is flowing, readers overlapping
            assert reads["most"] >= 2
            started = time.monotonic()
            writer = await coords[2].rwlock("stream", ttl=10, timeout=5).write().acquire()
            waited = time.monotonic() - started
            assert reads["inside"] == 0
            await writer.release()
            before = reads["n"]
            assert await eventually(lambda: reads["n"] > before)  # readers resume
        finally:
            stop.set()
            async with asyncio.timeout(10):
                await asyncio.gather(*readers)
        assert waited < WRITER_BOUND, f"writer waited {waited:.3f}s"

    async def test_fences_grow_across_readers_and_writers(self, make_coord: MakeCoord) -> None:
        """Every read or write lease, on any coordinator, has a larger fence than the ones
        granted before it; overlapping readers get distinct fences."""
        a, b = make_coord(), make_coord()
        need(a, "rwlock")
        fences: list[int] = []
        for i in range(3):
            coord = (a, b)[i % 2]
            r1 = await coord.rwlock("fences", ttl=10).read().acquire()
            r2 = await (b, a)[i % 2].rwlock("fences", ttl=10, timeout=2).read().acquire()
            fences += [r1.fence, r2.fence]
            await r1.release()
            await r2.release()
            w = await coord.rwlock("fences", ttl=10, timeout=3).write().acquire()
            fences.append(w.fence)
            await w.release()
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)

    async def test_reader_lease_lost_when_taken_away(self, make_coord: MakeCoord) -> None:
        """A read lease deleted on the server is lost like a lock's: LockLost, body cancelled."""
        a = make_coord()
        need(a, "rwlock")
        entered = asyncio.Event()
        leases: list[Lease] = []

        async def hold() -> None:
            async with a.rwlock("rw-lost", ttl=0.9).read() as lease:
                leases.append(lease)
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(hold())
        await entered.wait()
        assert await a.backend.release(leases[0]._claim)
        with pytest.raises(LockLost):
            await ends(task, "the read lease deleted on the server did not stop its body", 3)


# -- fair locks ----------------------------------------------------------------------------


class TestFair:
    async def test_waiters_acquire_in_arrival_order(self, make_coord: MakeCoord) -> None:
        """20 waiters on 3 coordinators, each started once the one before is in line
        (seen on the server) while the lock is held, get it in the order they arrived;
        each comes straight back after its turn and goes to the back of the line (a
        plain lock on memory/Redis lets it barge in again)."""
        coords = [make_coord() for _ in range(3)]
        need(coords[0], "fair")
        holder = await coords[0].lock("line", ttl=30, fair=True).acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            lock = coords[i % 3].lock("line", ttl=30, fair=True)
            async with lock:
                order.append(i)
                # Arrival is when a request reaches the server, and on a busy machine the
                # one released just before may not be back yet: hold the lock until
                # every other waiter is in line again.
                await until_in_line(coords[0], "line", 19)
            async with lock:
                order.append(i)

        tasks = []
        for i in range(20):
            tasks.append(asyncio.create_task(waiter(i)))
            await until_in_line(coords[0], "line", i + 1)
        await holder.release()
        async with asyncio.timeout(60):
            await asyncio.gather(*tasks)
        assert order == list(range(20)) * 2

    async def test_newcomer_does_not_barge(self, make_coord: MakeCoord) -> None:
        """Right after a release, while the first in line is being woken, a newcomer's
        timeout=0 try is refused: the lock goes to the waiter."""
        a, b, c = make_coord(), make_coord(), make_coord()
        need(a, "fair")
        holder = await a.lock("barge", ttl=30, fair=True).acquire()
        waiter = asyncio.create_task(b.lock("barge", ttl=30, fair=True).acquire())
        await asyncio.sleep(0.05)
        await holder.release()
        with pytest.raises(LockTimeout):
            await c.lock("barge", ttl=30, fair=True, timeout=0).acquire()
        lease = await asyncio.wait_for(waiter, 5)
        assert lease.fence > holder.fence
        await lease.release()

    async def test_cancelled_waiter_does_not_block_the_next(self, make_coord: MakeCoord) -> None:
        """A fair waiter cancelled in the line leaves it: the one behind gets the lock at
        the release, not when the cancelled waiter's place would have lapsed."""
        a, b, c = make_coord(), make_coord(), make_coord()
        need(a, "fair")
        slow = Backoff(initial=2.0, maximum=5.0)  # a lapsed place would take 6 s
        holder = await a.lock("cut", ttl=30, fair=True).acquire()
        first = asyncio.create_task(b.lock("cut", ttl=30, fair=True, retry=slow).acquire())
        await asyncio.sleep(0.05)
        second = asyncio.create_task(c.lock("cut", ttl=30, fair=True, retry=slow).acquire())
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        released = time.monotonic()
        await holder.release()
        lease = await asyncio.wait_for(second, 5)
        assert time.monotonic() - released < FAIR_HANDOFF_BOUND
        assert lease.fence > holder.fence
        assert b.held == []
        await lease.release()

    async def test_timed_out_waiter_does_not_block_the_next(self, make_coord: MakeCoord) -> None:
        """A fair waiter that timed out leaves the line like a cancelled one."""
        a, b, c = make_coord(), make_coord(), make_coord()
        need(a, "fair")
        slow = Backoff(initial=2.0, maximum=5.0)
        holder = await a.lock("tmo", ttl=30, fair=True).acquire()
        first = asyncio.create_task(
            b.lock("tmo", ttl=30, fair=True, retry=slow, timeout=0.2).acquire()
        )
        await asyncio.sleep(0.05)
        second = asyncio.create_task(c.lock("tmo", ttl=30, fair=True, retry=slow).acquire())
        with pytest.raises(LockTimeout):
            await first
        released = time.monotonic()
        await holder.release()
        lease = await asyncio.wait_for(second, 5)
        assert time.monotonic() - released < FAIR_HANDOFF_BOUND
        await lease.release()

    async def test_a_try_once_takes_no_place_in_line(self, make_coord: MakeCoord) -> None:
        """A fair timeout=0 attempt that finds the lock held never waits, so it does not
        join the line: once the lock is free, the next try gets it at once."""
        a, b = make_coord(), make_coord()
        need(a, "fair")
        holder = await a.lock("once", ttl=30, fair=True).acquire()
        with pytest.raises(LockTimeout):
            await b.lock("once", ttl=30, fair=True, timeout=0).acquire()
        await holder.release()
        lease = await b.lock("once", ttl=30, fair=True, timeout=0).acquire()
        await lease.release()

    async def test_fair_false_is_a_plain_lock(self, make_coord: MakeCoord) -> None:
        """fair=False is the default lock on every backend (Redlock included): accepted,
        exclusive with a default lock of the same name, one fence sequence."""
        a, b = make_coord(), make_coord()
        lock = a.lock("plain", ttl=10, fair=False)
        assert lock.fair is False
        first = await lock.acquire()
        with pytest.raises(LockTimeout):
            await b.lock("plain", ttl=10, timeout=0).acquire()
        await first.release()
        second = await b.lock("plain", ttl=10, timeout=0).acquire()
        with pytest.raises(LockTimeout):
            await a.lock("plain", ttl=10, timeout=0, fair=False).acquire()
        assert second.fence > first.fence
        await second.release()

    async def test_fair_lock_excludes_like_a_lock(self, make_coord: MakeCoord) -> None:
        """50 tasks on 3 coordinators doing read-sleep-write under a fair lock: no
        increment lost, one inside at a time."""
        coords = [make_coord() for _ in range(3)]
        need(coords[0], "fair")
        shared = {"value": 0, "inside": 0, "most": 0}

        async def worker(i: int) -> None:
            for _ in range(4):
                async with coords[i % 3].lock("fair-counter", ttl=10, fair=True):
                    shared["inside"] += 1
                    shared["most"] = max(shared["most"], shared["inside"])
                    value = shared["value"]
                    await asyncio.sleep(0.001)
                    shared["value"] = value + 1
                    shared["inside"] -= 1

        async with asyncio.timeout(60):
            await asyncio.gather(*(worker(i) for i in range(50)))
        assert shared["value"] == 200
        assert shared["most"] == 1


# -- what a backend without them does ------------------------------------------------------


class TestUnsupported:
    async def test_redlock_refuses_every_primitive(self, asynclock_redlock_urls: list[str]) -> None:
        """Redlock has no semaphores, read-write locks or fair locks: a ValueError for
        each, naming the backend and where they are supported; nothing is held."""
        async with asynclock.connect(asynclock_redlock_urls) as coord:
            attempts: dict[str, Callable[[], object]] = {
                "semaphore": lambda: coord.semaphore("r", 3),
                "rwlock": lambda: coord.rwlock("r"),
                "fair": lambda: coord.lock("r", fair=True),
                "shared": lambda: coord.lock("r", shared=True),
            }
            for feature, attempt in attempts.items():
                with pytest.raises(ValueError, match="RedlockBackend") as caught:
                    attempt()
                assert "PostgreSQL" in str(caught.value), feature  # where it is supported
            assert coord.held == []

    def test_every_other_backend_has_them_all(self, make_coord: MakeCoord) -> None:
        """memory, Redis and PostgreSQL declare every primitive."""
        backend = make_coord().backend
        assert all(kind in backend.kinds for kind in FEATURES.values())

    async def test_fair_and_shared_together_rejected(self, make_coord: MakeCoord) -> None:
        """fair=True is for exclusive locks: with shared=True it is a ValueError."""
        coord = make_coord()
        with pytest.raises(ValueError, match="shared=True"):
            coord.lock("fs", fair=True, shared=True)
