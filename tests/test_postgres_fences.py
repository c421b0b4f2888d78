"""PostgreSQL fences on a real server: one source per name whatever the coordinators'
schema or fence sequence, and never repeated after a crash, whatever the server's
synchronous_commit or the sequence's cache and persistence."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from pytest_asynclock import PostgresFactory, PostgresServer, find_postgres_bindir

import asynclock
from asynclock import LockTimeout
from asynclock.postgres import advisory_xact_lock, fence_ids

from .test_postgres import advisory_rows_on, backend_of


@pytest.fixture(scope="module")
def crashable() -> Iterator[PostgresServer]:
    """A private PostgreSQL server the tests of this module crash and restart (one start
    for them all), with ``synchronous_commit = off`` for its database: commits do not
    wait for their WAL to be written."""
    if find_postgres_bindir() is None:
        pytest.skip("no PostgreSQL >= 14 for private servers")
    factory = PostgresFactory()
    try:
        (server,) = factory(1, extra_args=("-c", "synchronous_commit=off"))
        yield server
    finally:
        factory.stop_all()


@pytest.fixture
async def admin(asynclock_postgres_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A superuser connection to the shared server."""
    conn = await asyncpg.connect(asynclock_postgres_dsn)
    yield conn
    await conn.close()


def wal_writer(server: PostgresServer) -> int:
    """The PID of the server's WAL writer process."""
    for pid in server.child_pids():
        with contextlib.suppress(OSError):
            if b"walwriter" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no walwriter process among {server.child_pids()}")


async def crash(server: PostgresServer) -> None:
    """Kill every process of the server (as a machine crash would) and start it again:
    crash recovery replays what of the WAL reached the OS."""
    await asyncio.to_thread(server.restart)


async def fences_of(coord: asynclock.Coordinator, name: str, n: int) -> list[int]:
    """The fences of ``n`` successive holders of ``name`` on ``coord``."""
    fences = []
    for _ in range(n):
        async with coord.lock(name, ttl=30, timeout=5) as lease:
            fences.append(lease.fence)
    return fences


def strictly_increasing(fences: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(fences))


class TestCrashes:
    @pytest.mark.parametrize("grants", [1, 200], ids=["one", "burst"])
    async def test_fences_after_a_crash_with_asynchronous_commits(
        self, crashable: PostgresServer, namespace: str, grants: int
    ) -> None:
        """synchronous_commit=off and a crash before the WAL writer wrote the fences'
        WAL: the first fence after the restart is larger than every fence before (it
        equalled the last one: the sequence went back to its last durable value)."""
        async with asynclock.connect(crashable.url, namespace=namespace) as coord:
            await fences_of(coord, "crash", 1)  # the sequence exists, the session is set up
            conn = await asyncpg.connect(crashable.url)
            await conn.execute("CHECKPOINT")  # the next nextval() logs anew
            await conn.close()
            # Stopped, the WAL writer cannot write the asynchronous commits' WAL before
            # the crash: the worst moment of a real one, made certain.
            os.kill(wal_writer(crashable), signal.SIGSTOP)
            before = await fences_of(coord, "crash", grants)
            await crash(crashable)
        async with asynclock.connect(crashable.url, namespace=namespace) as coord:
            (after,) = await fences_of(coord, "crash", 1)
        assert after > max(before)

    async def test_an_unlogged_fence_sequence_across_a_crash(
        self, crashable: PostgresServer, namespace: str
    ) -> None:
        """A fence sequence created UNLOGGED (it passes the CACHE check) restarts at 1 after
        a crash; fences still keep increasing."""
        sequence = f"unlogged_{namespace}"
        conn = await asyncpg.connect(crashable.url)
        await conn.execute(f'CREATE UNLOGGED SEQUENCE "{sequence}" CACHE 1')
        await conn.close()
        options = {"namespace": namespace, "fence_sequence": sequence}
        async with asynclock.connect(crashable.url, **options) as coord:
            before = await fences_of(coord, "unlogged", 3)
            await crash(crashable)
        async with asynclock.connect(crashable.url, **options) as coord:
            after = await fences_of(coord, "unlogged", 1)
        assert strictly_increasing(before + after)


class TestOneSourcePerName:
    async def test_coordinators_with_different_schemas_and_sequences(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """Two coordinators on one namespace, one with schema A, the other with schema B
        and another fence sequence, and transaction locks with schema B: holders take
        turns and fences strictly increase (they interleaved: 40, 1, 41, 2)."""
        schemas = [f"{namespace}_a", f"{namespace}_b"]
        for schema in schemas:
            await admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            async with (
                asynclock.connect(
                    asynclock_postgres_dsn, namespace=namespace, schema=schemas[0]
                ) as a,
                asynclock.connect(
                    asynclock_postgres_dsn,
                    namespace=namespace,
                    schema=schemas[1],
                    fence_sequence="other_fence",
                ) as b,
            ):
                await fences_of(a, "turns", 3)  # schema A's sequence ahead of B's
                fences = []
                for _ in range(3):
                    fences += await fences_of(a, "turns", 1)
                    fences += await fences_of(b, "turns", 1)
                    async with admin.transaction():
                        fences.append(
                            await advisory_xact_lock(
                                admin, "turns", fence=True, namespace=namespace, schema=schemas[1]
                            )
                        )
            assert strictly_increasing(fences), fences
        finally:
            for schema in schemas:
                await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')

    async def test_a_sequence_altered_to_cache_values_while_in_use(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """ALTER SEQUENCE ... CACHE 20 while two coordinators use it (each session then
        hands out its own range of 20): fences of their holders keep increasing (they
        went 23, then 4)."""
        sequence = f"fence_{namespace}"
        options = {"namespace": namespace, "fence_sequence": sequence}
        try:
            async with (
                asynclock.connect(asynclock_postgres_dsn, **options) as a,
                asynclock.connect(asynclock_postgres_dsn, **options) as b,
            ):
                fences = await fences_of(a, "cached", 1) + await fences_of(b, "cached", 1)
                await admin.execute(f'ALTER SEQUENCE "{sequence}" CACHE 20')
                for _ in range(3):
                    fences += await fences_of(a, "cached", 1) + await fences_of(b, "cached", 1)
            assert strictly_increasing(fences), fences
        finally:
            await admin.execute(f'DROP SEQUENCE IF EXISTS "{sequence}"')


class TestFenceStep:
    async def test_the_documented_fence_key_holds_back_the_fence_step(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """The fence key computed in SQL as the README says is the one the fence step
        takes: held elsewhere, a granted acquire waits for it within its timeout, then
        LockTimeout with nothing held."""
        async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as coord:
            key = backend_of(coord).key("held-back")
            fence_key = await admin.fetchrow(
                "SELECT ('x' || substr(h, 1, 8))::bit(32)::int4 AS a, "
                "('x' || substr(h, 9, 8))::bit(32)::int4 AS b "
                "FROM (SELECT encode(sha256(int8send($1) || 'fence'::bytea), 'hex') AS h) AS d",
                key,
            )
            assert fence_key is not None
            assert (fence_key["a"], fence_key["b"]) == fence_ids(key)
            await admin.execute("SELECT pg_advisory_lock($1::int4, $2::int4)", *fence_key)
            try:
                with pytest.raises(LockTimeout):
                    await coord.lock("held-back", ttl=30, timeout=0.3).acquire()
                assert await advisory_rows_on(admin, key) == []
            finally:
                await admin.execute("SELECT pg_advisory_unlock($1::int4, $2::int4)", *fence_key)
            async with coord.lock("held-back", ttl=30, timeout=0):
                pass
