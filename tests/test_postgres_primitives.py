"""Semaphores, read-write locks and fair locks on a real PostgreSQL: permits as advisory
keys, writer preference from the server's lock queue, arrival order, killed processes and
cancel safety."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterable

import asyncpg
import pytest

import asynclock
from asynclock import Backoff, LockTimeout
from asynclock.backends import PostgresBackend
from asynclock.postgres import advisory_key, lock_ids, permit_key, waiting_key

from .conftest import eventually

# How long each reader of a steady stream holds its read lock.
READ_HOLD = 0.1
# A waiter whose process was killed leaves the server's queue within PostgreSQL's
# client_connection_check_interval (1 s) plus this.
CHECK_SLACK = 1.0


@pytest.fixture
async def pool(asynclock_postgres_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """An application-owned pool of 8 connections."""
    pool = await asyncpg.create_pool(asynclock_postgres_dsn, min_size=0, max_size=8)
    yield pool
    await pool.close()


@pytest.fixture
async def coords(
    asynclock_postgres_dsn: str, namespace: str
) -> AsyncIterator[list[asynclock.Coordinator]]:
    """Three coordinators, each with its own pool, on one namespace."""
    made = [asynclock.connect(asynclock_postgres_dsn, namespace=namespace) for _ in range(3)]
    yield made
    for coord in made:
        await coord.aclose()


def semaphore_keys(name: str, limit: int, namespace: str) -> list[int]:
    """Every advisory key a semaphore may hold: its slots and its waiting flag."""
    return [permit_key(name, i, namespace) for i in range(limit)] + [waiting_key(name, namespace)]


async def advisory_rows(pool: asyncpg.Pool, keys: Iterable[int]) -> list[asyncpg.Record]:
    """Granted or waiting advisory locks (bigint form) on ``keys`` in this database."""
    wanted = {lock_ids(key) for key in keys}
    async with pool.acquire() as conn:
        rows: list[asyncpg.Record] = await conn.fetch(
            "SELECT pid, classid, objid, granted FROM pg_locks "
            "WHERE locktype = 'advisory' AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    return [r for r in rows if (r["classid"], r["objid"]) in wanted]


async def queued(pool: asyncpg.Pool, key: int) -> int:
    """How many sessions wait in the server's queue for ``key``."""
    return sum(not r["granted"] for r in await advisory_rows(pool, [key]))


async def wait_queued(pool: asyncpg.Pool, key: int, count: int, within: float = 5.0) -> None:
    """Wait until ``count`` sessions wait for ``key`` (fails the test otherwise)."""
    deadline = time.monotonic() + within
    while (now := await queued(pool, key)) != count:
        assert time.monotonic() < deadline, f"{now} queued on the key, expected {count}"
        await asyncio.sleep(0.01)


async def assert_clean(pool: asyncpg.Pool) -> None:
    """Every connection of the pool is idle, outside a transaction, with settings reset."""
    conns = [await pool.acquire() for _ in range(pool.get_size())]
    try:
        for conn in conns:
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SHOW idle_session_timeout") == "0"
            assert await conn.fetchval("SHOW lock_timeout") == "0"
            assert await conn.fetchval("SHOW client_connection_check_interval") == "0"
            assert await conn.fetchval("SHOW synchronous_commit") == "on"
            assert not (await conn.fetchval("SHOW application_name")).startswith("asynclock")
            assert await conn.fetch("SELECT pg_listening_channels()") == []
    finally:
        for conn in conns:
            await pool.release(conn)
    async with pool.acquire() as conn:
        stuck = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
        )
    assert stuck == 0


async def spawn(script: str, *args: str) -> asyncio.subprocess.Process:
    """A Python process running ``script`` with ``args``; its stdout is piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args, stdout=asyncio.subprocess.PIPE
    )


async def stop(process: asyncio.subprocess.Process) -> None:
    """Kill ``process`` (also if frozen) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
        os.kill(process.pid, signal.SIGCONT)
    await process.wait()


PERMIT_HOLDER = """
import asyncio, sys, asynclock
async def main():
    async with asynclock.connect(sys.argv[1], namespace=sys.argv[2]) as coord:
        async with coord.semaphore("killed", 1, ttl=float(sys.argv[3])) as lease:
            print(lease.fence, flush=True)
            await asyncio.sleep(3600)
asyncio.run(main())
"""

FAIR_WAITER = """
import asyncio, sys, asynclock
async def main():
    async with asynclock.connect(sys.argv[1], namespace=sys.argv[2]) as coord:
        async with coord.lock("line", fair=True, ttl=10, timeout=60):
            print("got it", flush=True)
asyncio.run(main())
"""


class TestSemaphore:
    async def test_fifty_tasks_three_coordinators_limit_five(
        self, coords: list[asynclock.Coordinator], pool: asyncpg.Pool, namespace: str
    ) -> None:
        """50 tasks over 3 coordinators, limit 5: never more than 5 inside, 5 at once at
        some point, everyone finishes with a distinct fence, and no key is left behind."""
        rng = random.Random(8)
        state = {"inside": 0, "most": 0}
        fences: list[int] = []

        async def worker(i: int) -> None:
            async with coords[i % 3].semaphore("pool", 5, ttl=10, timeout=30) as permit:
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
                fences.append(permit.fence)
                await asyncio.sleep(rng.uniform(0.005, 0.03))
                state["inside"] -= 1

        async with asyncio.timeout(60):
            await asyncio.gather(*(worker(i) for i in range(50)))
        assert state["most"] == 5
        assert len(set(fences)) == 50
        assert await advisory_rows(pool, semaphore_keys("pool", 5, namespace)) == []

    async def test_each_holder_holds_exactly_one_slot(
        self, coords: list[asynclock.Coordinator], pool: asyncpg.Pool, namespace: str
    ) -> None:
        """A scan takes at most one slot: 5 holders hold the 5 slot keys, one each, on 5
        sessions; a sixth is refused."""
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(coords[i % 3].semaphore("slots", 5, timeout=5).acquire())
                for i in range(5)
            ]
        leases = [task.result() for task in tasks]
        rows = await advisory_rows(pool, semaphore_keys("slots", 5, namespace))
        slots = {lock_ids(permit_key("slots", i, namespace)) for i in range(5)}
        assert {(r["classid"], r["objid"]) for r in rows} == slots
        assert len({r["pid"] for r in rows}) == 5
        with pytest.raises(LockTimeout):
            await coords[0].semaphore("slots", 5, timeout=0).acquire()
        for lease in leases:
            await lease.release()

    async def test_release_wakes_a_waiter_by_notify(
        self, coords: list[asynclock.Coordinator]
    ) -> None:
        """A waiter on another coordinator gets a released permit at once (LISTEN/NOTIFY),
        not at its next recheck (30 s here)."""
        a, b, _ = coords
        held = [await a.semaphore("notify", 2, ttl=10).acquire() for _ in range(2)]
        slow = Backoff(initial=30.0, maximum=30.0)
        waiter = asyncio.create_task(b.semaphore("notify", 2, timeout=10, retry=slow).acquire())
        await asyncio.sleep(0.3)  # it scanned, found none free, and waits
        released_at = time.monotonic()
        await held[0].release()
        lease = await asyncio.wait_for(waiter, 5)
        assert time.monotonic() - released_at < 0.5
        await lease.release()
        await held[1].release()

    async def test_timed_out_waiter_leaves_nothing(
        self, coords: list[asynclock.Coordinator], pool: asyncpg.Pool, namespace: str
    ) -> None:
        """A waiter that times out drops its waiting flag and takes no slot."""
        a, b, _ = coords
        held = await a.semaphore("full", 1, ttl=10).acquire()
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            await b.semaphore("full", 1, timeout=0.3).acquire()
        assert 0.25 < time.monotonic() - started < 1.5
        rows = await advisory_rows(pool, semaphore_keys("full", 1, namespace))
        assert len(rows) == 1  # the holder's slot only
        await held.release()

    @pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
    async def test_dead_holder_frees_its_permit_within_its_ttl(
        self,
        asynclock_postgres_dsn: str,
        coords: list[asynclock.Coordinator],
        namespace: str,
        how: signal.Signals,
    ) -> None:
        """A holder process killed (its session ends with its TCP connection) or frozen
        (idle_session_timeout ends it) frees its permit within its ttl + 1 s, and the next
        holder's fence is larger."""
        ttl = 2.0
        holder = await spawn(PERMIT_HOLDER, asynclock_postgres_dsn, namespace, str(ttl))
        try:
            assert holder.stdout is not None
            fence = int(await asyncio.wait_for(holder.stdout.readline(), 20))
            os.kill(holder.pid, how)
            stopped_at = time.monotonic()
            lease = await coords[0].semaphore("killed", 1, ttl=10, timeout=ttl + 3).acquire()
            waited = time.monotonic() - stopped_at
            assert waited <= ttl + 1.0, f"took {waited:.2f}s"
            assert lease.fence > fence
            await lease.release()
        finally:
            await stop(holder)

    async def test_permits_and_the_lock_of_the_same_name_are_apart(
        self, coords: list[asynclock.Coordinator], namespace: str
    ) -> None:
        """Permit keys are not the lock's key: a held lock "x" blocks no permit of "x"."""
        a, b, _ = coords
        assert advisory_key("x", namespace) not in semaphore_keys("x", 100, namespace)
        async with a.lock("x", ttl=10), b.semaphore("x", 1, timeout=0):
            assert await b.is_locked("x")

    async def test_key_derivation_in_sql_matches_python(
        self, pool: asyncpg.Pool, namespace: str
    ) -> None:
        """The server computes slot keys as permit_key() documents them."""
        prefix = namespace.encode() + b"\x00" + "sé:1".encode() + b"\xff"
        async with pool.acquire() as conn:
            keys = await conn.fetchval(
                "SELECT array_agg(('x' || left(encode(sha256($1::bytea || "
                "convert_to(i::text, 'UTF8')), 'hex'), 16))::bit(64)::bigint ORDER BY i) "
                "FROM generate_series(0, 11) AS i",
                prefix,
            )
        assert keys == [permit_key("sé:1", i, namespace) for i in range(12)]

    @pytest.mark.timeout(180)
    async def test_a_thousand_cancelled_acquires_leave_nothing(
        self, pool: asyncpg.Pool, namespace: str
    ) -> None:
        """1,000 semaphore acquires cancelled at random points (scanning, waiting for a
        NOTIFY, at the grant, while held) leave no advisory lock and a pool whose
        connections are idle and clean."""
        rng = random.Random(20261201)
        async with (
            asynclock.Coordinator(PostgresBackend(pool, namespace=namespace)) as coord,
            asynclock.Coordinator(PostgresBackend(pool, namespace=namespace)) as other,
        ):
            outcomes = {"cancelled": 0, "acquired": 0}

            async def one(i: int) -> None:
                name = f"c:{i % 2}"
                held = []
                if rng.random() < 0.4:  # the semaphore is full: the attempt waits
                    held = [await other.semaphore(name, 2, timeout=5).acquire() for _ in "ab"]

                async def attempt() -> None:
                    async with coord.semaphore(name, 2, timeout=5):
                        await asyncio.sleep(rng.random() * 0.002)

                task = asyncio.create_task(attempt())
                await asyncio.sleep(rng.random() * 0.004)
                if held and rng.random() < 0.5:
                    await held.pop().release()  # the grant races the cancel
                task.cancel()
                try:
                    await task
                    outcomes["acquired"] += 1
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                for lease in held:
                    await lease.release()

            for start in range(0, 1000, 2):
                await asyncio.gather(one(start), one(start + 1))
            assert outcomes["cancelled"] > 500
            assert await eventually(
                lambda: not coord._engine.tasks and not other._engine.tasks, within=10
            )
            assert coord.held == []
        keys = semaphore_keys("c:0", 2, namespace) + semaphore_keys("c:1", 2, namespace)
        assert await advisory_rows(pool, keys) == []
        await assert_clean(pool)


class TestReadWriteLock:
    async def test_readers_overlap_writers_exclude(
        self, coords: list[asynclock.Coordinator]
    ) -> None:
        """Readers on two coordinators hold at once; a writer is refused while they do,
        and while a writer holds, readers and writers are refused."""
        a, b, c = coords
        r1 = await a.rwlock("rw", ttl=10).read().acquire()
        r2 = await b.rwlock("rw", ttl=10, timeout=0).read().acquire()
        with pytest.raises(LockTimeout):
            await c.rwlock("rw", timeout=0.2).write().acquire()
        await r1.release()
        await r2.release()
        writer = await c.rwlock("rw", ttl=10, timeout=0).write().acquire()
        with pytest.raises(LockTimeout):
            await a.rwlock("rw", timeout=0.2).read().acquire()
        with pytest.raises(LockTimeout):
            await b.rwlock("rw", timeout=0).write().acquire()
        await writer.release()

    async def test_queued_writer_refuses_new_readers_even_on_try(
        self, coords: list[asynclock.Coordinator], pool: asyncpg.Pool, namespace: str
    ) -> None:
        """While a writer waits in the server's queue behind a reader, a new reader is
        refused even by pg_try_advisory_lock_shared (our try-first path cannot barge), and
        a new waiting reader queues behind the writer."""
        a, b, c = coords
        key = advisory_key("pref", namespace)
        reader = await a.rwlock("pref", ttl=10).read().acquire()
        writer = asyncio.create_task(b.rwlock("pref", ttl=10, timeout=10).write().acquire())
        await wait_queued(pool, key, 1)
        with pytest.raises(LockTimeout):
            await c.rwlock("pref", timeout=0).read().acquire()
        late = asyncio.create_task(c.rwlock("pref", ttl=10, timeout=10).read().acquire())
        await wait_queued(pool, key, 2)
        await reader.release()
        w = await asyncio.wait_for(writer, 5)
        assert not late.done()
        await asyncio.sleep(0.1)
        assert not late.done()  # still behind the writer, who holds
        await w.release()
        r = await asyncio.wait_for(late, 5)
        assert r.fence > w.fence
        await r.release()

    async def test_writer_gets_in_despite_a_stream_of_readers(
        self, coords: list[asynclock.Coordinator], pool: asyncpg.Pool, namespace: str
    ) -> None:
        """A reader arrives every 10 ms and holds READ_HOLD (0.1 s), so ~10 overlap at all
        times: a writer still gets in while the stream flows (without writer preference it
        would wait until its timeout: the stream stops only once it is granted), it holds
        alone, and no reader that asked after the writer was seen queued on the server
        was let in before it. (Judged by the server's queue, not by a round-trip time: on
        a loaded machine the writer's first request can take longer than a reader's hold.)"""
        key = advisory_key("stream", namespace)
        stop = asyncio.Event()
        grants: list[tuple[float, float]] = []  # (asked, granted) per reader
        readers: set[asyncio.Task[None]] = set()

        async def read(i: int) -> None:
            asked = time.monotonic()
            async with coords[i % 2].rwlock("stream", ttl=10, timeout=10).read():
                grants.append((asked, time.monotonic()))
                await asyncio.sleep(READ_HOLD)

        async def stream() -> None:
            i = 0
            while not stop.is_set():
                task = asyncio.create_task(read(i))
                readers.add(task)
                task.add_done_callback(readers.discard)
                i += 1
                await asyncio.sleep(0.01)

        feeder = asyncio.create_task(stream())
        queued_at = None
        try:
            assert await eventually(lambda: len(grants) > 5, within=30)  # readers overlap
            acquiring = asyncio.create_task(
                coords[2].rwlock("stream", ttl=10, timeout=10).write().acquire()
            )
            while not acquiring.done() and queued_at is None:
                if await queued(pool, key) > 0:  # the writer (readers queue only behind it)
                    queued_at = time.monotonic()
                await asyncio.sleep(0.005)
            writer = await acquiring
            granted = time.monotonic()
            await asyncio.sleep(0.05)
            releasing = time.monotonic()
            await writer.release()
            await asyncio.sleep(0.2)  # readers carry on after it
        finally:
            stop.set()
            await feeder
            async with asyncio.timeout(30):
                await asyncio.gather(*readers)
        assert [g for g in grants if granted < g[1] < releasing] == []  # the writer was alone
        if queued_at is not None:  # (granted before any reader made it wait: nothing to see)
            barged = [g for g in grants if g[0] > queued_at and g[1] < granted]
            assert barged == []
        assert any(g[1] > granted for g in grants)


class TestFair:
    async def test_twenty_waiters_get_the_lock_in_arrival_order(
        self, coords: list[asynclock.Coordinator], pool: asyncpg.Pool, namespace: str
    ) -> None:
        """20 waiters on 3 coordinators, queued one after another behind a holder, get the
        fair lock in that order, with growing fences."""
        key = advisory_key("order", namespace)
        holder = await coords[0].lock("order", fair=True, ttl=10).acquire()
        order: list[tuple[int, int]] = []

        async def wait_turn(i: int) -> None:
            lock = coords[i % 3].lock("order", fair=True, ttl=10, timeout=30)
            async with lock as lease:
                order.append((i, lease.fence))

        tasks = []
        for i in range(20):
            tasks.append(asyncio.create_task(wait_turn(i)))
            await wait_queued(pool, key, i + 1)
        await holder.release()
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)
        assert [i for i, _ in order] == list(range(20))
        fences = [fence for _, fence in order]
        assert fences == sorted(fences)

    async def test_killed_waiter_leaves_the_line(
        self,
        asynclock_postgres_dsn: str,
        coords: list[asynclock.Coordinator],
        pool: asyncpg.Pool,
        namespace: str,
    ) -> None:
        """A waiter process killed while queued leaves the server's queue within the
        client-connection check interval (1 s) + CHECK_SLACK; on release the next in line
        gets the lock at once."""
        key = advisory_key("line", namespace)
        holder = await coords[0].lock("line", fair=True, ttl=10).acquire()
        first = await spawn(FAIR_WAITER, asynclock_postgres_dsn, namespace)
        try:
            await wait_queued(pool, key, 1, within=20)
            second = asyncio.create_task(coords[1].lock("line", fair=True, timeout=30).acquire())
            await wait_queued(pool, key, 2)
            first.kill()
            await first.wait()
            killed_at = time.monotonic()
            await wait_queued(pool, key, 1, within=1.0 + CHECK_SLACK)
            assert time.monotonic() - killed_at < 1.0 + CHECK_SLACK
            released_at = time.monotonic()
            await holder.release()
            lease = await asyncio.wait_for(second, 5)
            assert time.monotonic() - released_at < 0.5
            await lease.release()
        finally:
            await stop(first)
