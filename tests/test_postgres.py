"""The PostgreSQL backend on a real server: session locks with a TTL, fences, cancel
safety, transaction locks, and the name-to-key mapping."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

import asynclock
from asynclock import BackendError, LockLost, LockTimeout
from asynclock.backends import PostgresBackend
from asynclock.postgres import (
    NoTransactionError,
    advisory_key,
    advisory_xact_lock,
    ensure_fence_sequence,
    lock_ids,
)

from .conftest import eventually


@pytest.fixture
async def pool(asynclock_postgres_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """An application-owned pool of 8 connections."""
    pool = await asyncpg.create_pool(asynclock_postgres_dsn, min_size=0, max_size=8)
    yield pool
    await pool.close()


@pytest.fixture
async def coord(
    asynclock_postgres_dsn: str, namespace: str
) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as coord:
        yield coord


def backend_of(coord: asynclock.Coordinator) -> PostgresBackend:
    backend = coord.backend
    assert isinstance(backend, PostgresBackend)
    return backend


async def advisory_rows(pool: asyncpg.Pool, key: int | None = None) -> list[asyncpg.Record]:
    """Granted or waiting advisory locks (bigint form) in this database, of ``key``."""
    async with pool.acquire() as conn:
        return await advisory_rows_on(conn, key)


async def advisory_rows_on(
    conn: asyncpg.Connection, key: int | None = None
) -> list[asyncpg.Record]:
    """:func:`advisory_rows`, asked on ``conn``."""
    rows: list[asyncpg.Record] = await conn.fetch(
        "SELECT pid, classid, objid, granted FROM pg_locks "
        "WHERE locktype = 'advisory' AND objsubid = 1 "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    if key is None:
        return rows
    classid, objid = lock_ids(key)
    return [r for r in rows if (r["classid"], r["objid"]) == (classid, objid)]


HOLDER = """
import asyncio, sys, asynclock
async def main():
    async with asynclock.connect(sys.argv[1], namespace=sys.argv[2]) as coord:
        async with coord.lock("frozen", ttl=float(sys.argv[3])) as lease:
            print(lease.fence, flush=True)
            await asyncio.sleep(3600)
asyncio.run(main())
"""


class TestSessionLocks:
    async def test_shared_and_exclusive(self, coord: asynclock.Coordinator) -> None:
        """Shared leases overlap; an exclusive one excludes readers and writers."""
        r1 = await coord.lock("rw", shared=True, timeout=0).acquire()
        r2 = await coord.lock("rw", shared=True, timeout=0).acquire()
        with pytest.raises(LockTimeout):
            await coord.lock("rw", timeout=0).acquire()
        with pytest.raises(LockTimeout):
            await coord.lock("rw", timeout=0.2).acquire()
        await r1.release()
        await r2.release()
        writer = await coord.lock("rw", timeout=0).acquire()
        with pytest.raises(LockTimeout):
            await coord.lock("rw", shared=True, timeout=0.2).acquire()
        await writer.release()
        assert r2.fence > r1.fence
        assert writer.fence > r2.fence

    async def test_waiter_queues_in_the_server(
        self, coord: asynclock.Coordinator, pool: asyncpg.Pool
    ) -> None:
        """A waiter waits in PostgreSQL's own lock queue, not by polling, and gets the lock
        as soon as it is released."""
        holder = await coord.lock("queue", ttl=30).acquire()
        waiter = asyncio.create_task(coord.lock("queue", ttl=30, timeout=10).acquire())
        key = backend_of(coord).key("queue")
        assert await eventually(lambda: False, within=0.3) is False  # let it queue
        rows = await advisory_rows(pool, key)
        assert sorted(r["granted"] for r in rows) == [False, True]
        released_at = time.monotonic()
        await holder.release()
        lease = await asyncio.wait_for(waiter, 5)
        assert time.monotonic() - released_at < 0.05
        await lease.release()

    async def test_frozen_holder_loses_its_lock_server_side(
        self, asynclock_postgres_dsn: str, coord: asynclock.Coordinator, namespace: str
    ) -> None:
        """A holder process frozen with SIGSTOP loses its lock on the server within
        ttl + 1 s (idle_session_timeout), and another process takes it."""
        ttl = 2.0
        holder = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLDER, asynclock_postgres_dsn, namespace, str(ttl),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert holder.stdout is not None
            fence = int(await asyncio.wait_for(holder.stdout.readline(), 20))
            os.kill(holder.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            lease = await coord.lock("frozen", ttl=10, timeout=ttl + 3).acquire()
            assert time.monotonic() - frozen_at <= ttl + 1.0
            assert lease.fence > fence
            await lease.release()
        finally:
            with contextlib.suppress(ProcessLookupError):
                holder.kill()
                os.kill(holder.pid, signal.SIGCONT)
            await holder.wait()

    async def test_terminated_session_cancels_the_body(
        self, coord: asynclock.Coordinator, pool: asyncpg.Pool
    ) -> None:
        """pg_terminate_backend of the holder's session: the lease is lost and the body
        cancelled with LockLost as soon as the driver sees the connection end, not at the
        next renewal (ttl/3 = 10 s here; another client could take the lock meanwhile)."""
        ttl = 30.0
        killed_at = 0.0
        with pytest.raises(LockLost, match="ended the session"):
            async with coord.lock("victim", ttl=ttl) as lease:
                (row,) = await advisory_rows(pool, backend_of(coord).key("victim"))
                killed_at = time.monotonic()
                async with pool.acquire() as conn:
                    assert await conn.fetchval("SELECT pg_terminate_backend($1)", row["pid"])
                await asyncio.sleep(ttl)
        assert lease.lost
        assert time.monotonic() - killed_at < 5.0
        assert await advisory_rows(pool) == []

    async def test_a_kept_connection_watches_the_lease_that_uses_it_now(
        self, coord: asynclock.Coordinator, pool: asyncpg.Pool
    ) -> None:
        """A connection kept between leases: ending its session under the next lease on
        it loses that lease at once, and the released one before it hears nothing."""
        key = backend_of(coord).key("reused")
        first = await coord.lock("reused", ttl=30).acquire()
        (row,) = await advisory_rows(pool, key)
        await first.release()
        second = await coord.lock("reused", ttl=30).acquire()
        (again,) = await advisory_rows(pool, key)
        assert again["pid"] == row["pid"]  # the same, kept, connection
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", row["pid"])
        assert await eventually(lambda: second.lost, within=5.0)
        assert not first.lost

    async def test_a_server_restart_loses_the_lease_at_once(
        self, asynclock_postgres_factory: Any, namespace: str
    ) -> None:
        """A restart of the server ends every session: each lease is lost when its
        connection ends, not a renewal period later."""
        (server,) = asynclock_postgres_factory(1)
        async with asynclock.connect(server.url, namespace=namespace) as coord:
            lease = await coord.lock("restarted", ttl=30).acquire()
            stopped_at = time.monotonic()
            server.kill()
            assert await eventually(lambda: lease.lost, within=5.0)
            assert time.monotonic() - stopped_at < 5.0

    async def test_fences_increase_across_coordinator_restarts(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """Fences keep growing when coordinators (and their pools) come and go."""
        fences = []
        for _ in range(3):
            async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as coord:
                for _ in range(3):
                    async with coord.lock("restart") as lease:
                        fences.append(lease.fence)
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)

    async def test_exhausted_pool_times_out(self, pool: asyncpg.Pool, namespace: str) -> None:
        """With every pool connection pinned, an acquire waits up to its timeout for a
        connection, then LockTimeout; timeout=0 fails at once."""
        async with asynclock.Coordinator(PostgresBackend(pool, namespace=namespace)) as coord:
            leases = [await coord.lock(f"pin:{i}").acquire() for i in range(8)]
            started = time.monotonic()
            with pytest.raises(LockTimeout):
                await coord.lock("one-more", timeout=0.3).acquire()
            assert 0.25 < time.monotonic() - started < 1.5
            with pytest.raises(LockTimeout):
                await coord.lock("one-more", timeout=0).acquire()
            for lease in leases:
                await lease.release()
            async with coord.lock("one-more", timeout=1):
                pass

    async def test_application_pool_stays_open_and_clean(
        self, pool: asyncpg.Pool, namespace: str
    ) -> None:
        """Coordinator(PostgresBackend(pool)): the pool outlives the coordinator and gets
        its connections back with no lock, no transaction and settings as they were."""
        coord = asynclock.Coordinator(PostgresBackend(pool, namespace=namespace))
        async with coord, coord.lock("clean", ttl=7):
            pass
        assert await advisory_rows(pool) == []
        async with pool.acquire() as conn:
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SHOW idle_session_timeout") == "0"
            assert not (await conn.fetchval("SHOW application_name")).startswith("asynclock")

    async def test_inspect_names_holder_fence_and_ttl(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """inspect() reads holder, fence and remaining TTL from the server."""
        async with (
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace, identity="w-1") as a,
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as b,
        ):
            assert await b.inspect("seen") is None
            async with a.lock("seen", ttl=20) as lease:
                info = await b.inspect("seen")
                assert info is not None
                assert (info.owner, info.fence) == ("w-1", lease.fence)
                assert 15 < info.expires_in <= 20
                await lease.extend(40)
                info = await b.inspect("seen")
                assert info is not None
                assert 35 < info.expires_in <= 40

    async def test_role_without_create_gets_the_sql(
        self, asynclock_postgres_dsn: str, pool: asyncpg.Pool, namespace: str
    ) -> None:
        """A role that may not create the fence sequence gets an error that prints the SQL
        to run by hand."""
        role = f"limited_{namespace}"
        async with pool.acquire() as conn:
            await conn.execute(f'CREATE ROLE "{role}" LOGIN')
            await conn.execute(f'CREATE SCHEMA "{namespace}"')
        try:
            dsn = asynclock_postgres_dsn.replace("postgres@", f"{role}@", 1)
            async with asynclock.connect(dsn, schema=namespace) as coord:
                with pytest.raises(BackendError, match="CREATE SEQUENCE IF NOT EXISTS"):
                    await coord.lock("x").acquire()
        finally:
            async with pool.acquire() as conn:
                await conn.execute(f'DROP SCHEMA "{namespace}" CASCADE')
                await conn.execute(f'DROP ROLE "{role}"')

    async def test_many_coordinators_create_the_fence_sequence_at_once(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """``CREATE SEQUENCE IF NOT EXISTS`` is not atomic: coordinators that start
        together race to create it, and every one of them must still go on."""
        conns = [await asyncpg.connect(asynclock_postgres_dsn) for _ in range(8)]
        try:
            for round_ in range(60):
                sequence = f"fence_{namespace}_{round_}"
                await asyncio.gather(
                    *(ensure_fence_sequence(conn, "public", sequence) for conn in conns)
                )
                assert await conns[0].fetchval("SELECT nextval($1)", sequence) == 1
                await conns[0].execute(f'DROP SEQUENCE "{sequence}"')
        finally:
            await asyncio.gather(*(conn.close() for conn in conns))

    @pytest.mark.parametrize("options", ["CACHE 20", "INCREMENT -1", "CYCLE"])
    async def test_a_fence_sequence_that_would_go_backwards_is_refused(
        self, asynclock_postgres_dsn: str, namespace: str, options: str
    ) -> None:
        """A fence sequence created elsewhere with ``CACHE > 1`` hands each session its
        own range (one session's 2 after another's 21); refused with the fix to run."""
        sequence = f"fence_{namespace}_{options.split(maxsplit=1)[0].lower()}"
        conn = await asyncpg.connect(asynclock_postgres_dsn)
        try:
            await conn.execute(f'CREATE SEQUENCE "{sequence}" {options}')
            with pytest.raises(BackendError, match=r"ALTER SEQUENCE .* CACHE 1 INCREMENT 1"):
                await ensure_fence_sequence(conn, "public", sequence)
            await conn.execute(f'ALTER SEQUENCE "{sequence}" CACHE 1 INCREMENT 1 NO CYCLE')
            await ensure_fence_sequence(conn, "public", sequence)
        finally:
            await conn.execute(f'DROP SEQUENCE IF EXISTS "{sequence}"')
            await conn.close()

    async def test_a_released_connection_reaches_an_acquire_queued_for_the_pool(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """With the pool exhausted, an acquire queues in ``pool.acquire()``; connections
        released meanwhile must reach it, not wait in the backend's own reserve (it
        waited until its timeout while the lock was free and connections idle)."""
        async with asynclock.connect(
            asynclock_postgres_dsn, namespace=namespace, max_connections=8
        ) as coord:
            held = [await coord.lock(f"busy{i}", ttl=30).acquire() for i in range(8)]
            waiter = asyncio.create_task(coord.lock("free", ttl=30, timeout=5).acquire())
            await asyncio.sleep(0.3)
            assert not waiter.done()
            for lease in held[:2]:
                await lease.release()
            loop = asyncio.get_running_loop()
            start = loop.time()
            lease = await waiter
            assert loop.time() - start < 2.0
            await lease.release()
            for lease in held[2:]:
                await lease.release()

    async def test_a_connection_kept_idle_goes_back_when_the_pool_fills_later(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """A connection kept for the next lease while the pool had room goes back to the
        pool within about a second: an acquire queued in the pool after it filled up
        (``inspect()``, the application sharing the pool) does not wait for a lease's
        release (it waited forever)."""
        async with asynclock.connect(
            asynclock_postgres_dsn, namespace=namespace, max_connections=4
        ) as coord:
            backend = coord.backend
            assert isinstance(backend, PostgresBackend)
            leases = [await coord.lock(n, ttl=30).acquire() for n in "abc"]
            await leases[0].release()  # the pool has room: kept for the next lease
            app_conn = await backend.pool.acquire()  # the pool's fourth and last
            try:
                async with asyncio.timeout(3):
                    assert await coord.inspect("b") is not None
            finally:
                await backend.pool.release(app_conn)
            for lease in leases[1:]:
                await lease.release()


class TestCancelSafety:
    @pytest.mark.timeout(180)
    async def test_a_thousand_cancelled_acquires_leave_nothing(
        self, pool: asyncpg.Pool, namespace: str
    ) -> None:
        """1,000 acquires cancelled at random points (queued, at the grant, while held)
        leave no advisory lock and a pool whose connections are idle and clean."""
        rng = random.Random(20261129)
        async with (
            asynclock.Coordinator(PostgresBackend(pool, namespace=namespace)) as coord,
            asynclock.Coordinator(PostgresBackend(pool, namespace=namespace)) as other,
        ):
            outcomes = {"cancelled": 0, "acquired": 0}

            async def one(i: int) -> None:
                name = f"c:{i % 4}"
                held = None
                if rng.random() < 0.3:  # someone holds it: the attempt queues
                    held = await other.lock(name, timeout=5).acquire()

                async def attempt() -> None:
                    async with coord.lock(name, timeout=5):
                        await asyncio.sleep(rng.random() * 0.002)

                task = asyncio.create_task(attempt())
                await asyncio.sleep(rng.random() * 0.003)
                if held is not None and rng.random() < 0.5:
                    await held.release()  # the grant races the cancel
                    held = None
                task.cancel()
                try:
                    await task
                    outcomes["acquired"] += 1
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                if held is not None:
                    await held.release()

            for start in range(0, 1000, 4):
                await asyncio.gather(*(one(i) for i in range(start, start + 4)))
            assert outcomes["cancelled"] > 500
            assert await eventually(
                lambda: not coord._engine.tasks and not other._engine.tasks, within=10
            )
            assert coord.held == []
        assert await advisory_rows(pool) == []
        conns = [await pool.acquire() for _ in range(pool.get_size())]
        try:
            for conn in conns:
                assert not conn.is_in_transaction()
                assert await conn.fetchval("SHOW idle_session_timeout") == "0"
                assert await conn.fetchval("SHOW lock_timeout") == "0"
                assert not (await conn.fetchval("SHOW application_name")).startswith("asynclock")
        finally:
            for conn in conns:
                await pool.release(conn)
        async with pool.acquire() as conn:
            stuck = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
            )
        assert stuck == 0


class TestTransactionLocks:
    async def test_needs_an_open_transaction(self, pool: asyncpg.Pool) -> None:
        """Outside a transaction: a clear error, nothing taken."""
        async with pool.acquire() as conn:
            with pytest.raises(NoTransactionError, match="transaction"):
                await advisory_xact_lock(conn, "x")
        assert await advisory_rows(pool) == []

    async def test_released_at_commit_and_rollback(
        self, pool: asyncpg.Pool, coord: asynclock.Coordinator, namespace: str
    ) -> None:
        """The transaction lock conflicts with the session lock of the same name and ends
        with the transaction, committed or rolled back."""
        for outcome in ("commit", "rollback"):
            async with pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                await advisory_xact_lock(conn, "tx", namespace=namespace)
                with pytest.raises(LockTimeout):
                    await coord.lock("tx", timeout=0).acquire()
                await (tx.commit() if outcome == "commit" else tx.rollback())
            async with coord.lock("tx", timeout=0):
                pass

    async def test_timeout_keeps_the_transaction_usable(
        self, pool: asyncpg.Pool, coord: asynclock.Coordinator, namespace: str
    ) -> None:
        """A timed-out transaction lock raises LockTimeout and the caller's transaction
        goes on, with its lock_timeout untouched."""
        async with coord.lock("busy"), pool.acquire() as conn, conn.transaction():
            await conn.execute("SET LOCAL lock_timeout = '7s'")
            with pytest.raises(LockTimeout):
                await advisory_xact_lock(conn, "busy", timeout=0.2, namespace=namespace)
            with pytest.raises(LockTimeout):
                await advisory_xact_lock(conn, "busy", timeout=0, namespace=namespace)
            assert await conn.fetchval("SELECT 1") == 1
            assert await conn.fetchval("SHOW lock_timeout") == "7s"

    async def test_server_lock_timeout_with_no_timeout_is_a_lock_timeout(
        self, pool: asyncpg.Pool, coord: asynclock.Coordinator, namespace: str
    ) -> None:
        """timeout=None under the session's own lock_timeout: LockTimeout, not a TypeError."""
        async with coord.lock("slow"), pool.acquire() as conn:
            async with conn.transaction():
                await conn.execute("SET LOCAL lock_timeout = '100ms'")
                with pytest.raises(LockTimeout, match=r"'slow'.*lock_timeout"):
                    await advisory_xact_lock(conn, "slow", namespace=namespace)
            assert await conn.fetchval("SELECT 1") == 1  # the connection is usable again

    async def test_fences_and_shared(
        self, pool: asyncpg.Pool, coord: asynclock.Coordinator, namespace: str
    ) -> None:
        """fence=True returns fences that keep growing, also across session locks; shared
        transaction locks overlap."""
        fences = []
        for _ in range(3):
            async with pool.acquire() as conn, conn.transaction():
                fences.append(await advisory_xact_lock(conn, "f", fence=True, namespace=namespace))
            async with coord.lock("f") as lease:
                fences.append(lease.fence)
        assert fences == sorted(fences)
        assert len(set(fences)) == 6
        async with pool.acquire() as a, pool.acquire() as b, a.transaction(), b.transaction():
            await advisory_xact_lock(a, "s", shared=True, timeout=0, namespace=namespace)
            await advisory_xact_lock(b, "s", shared=True, timeout=0, namespace=namespace)
            with pytest.raises(LockTimeout):
                await coord.lock("s", timeout=0).acquire()

    async def test_a_fence_does_not_hold_back_readers_until_commit(
        self, pool: asyncpg.Pool, coord: asynclock.Coordinator, namespace: str
    ) -> None:
        """fence=True gives the name's fence key back before it returns: while the
        caller's transaction stays open, a reader's fence step does not wait for it."""
        # Set up first: a fence sequence created inside the open transaction below would
        # hold back the coordinator's own set-up until that transaction ends.
        assert not await coord.is_locked("read")
        async with pool.acquire() as conn, conn.transaction():
            fence = await advisory_xact_lock(
                conn, "read", shared=True, fence=True, timeout=0, namespace=namespace
            )
            async with coord.lock("read", shared=True, timeout=0) as lease:
                assert lease.fence > fence
            assert await conn.fetchval("SHOW lock_timeout") == "0"


class TestKeys:
    def test_documented_example(self) -> None:
        """The README's worked example: SHA-256 of namespace, NUL, name; first 8 bytes."""
        assert advisory_key("invoice:42") == -3222681048253742227
        assert lock_ids(advisory_key("invoice:42")) == (3544628393, 1047774061)
        assert advisory_key("invoice:42", "other") != advisory_key("invoice:42")

    async def test_two_int_locks_of_the_application_do_not_conflict(
        self, coord: asynclock.Coordinator, pool: asyncpg.Pool
    ) -> None:
        """The application's pg_advisory_lock(int, int) locks never block ours."""
        key = backend_of(coord).key("app")
        classid, objid = lock_ids(key)
        async with pool.acquire() as conn:
            # The same two 32-bit halves, in the two-int form the application might use.
            await conn.execute(
                "SELECT pg_advisory_lock($1::bigint::int4, $2::bigint::int4)",
                classid - (1 << 32) if classid >= 1 << 31 else classid,
                objid - (1 << 32) if objid >= 1 << 31 else objid,
            )
            try:
                async with coord.lock("app", timeout=0):
                    pass
            finally:
                await conn.execute("SELECT pg_advisory_unlock_all()")
