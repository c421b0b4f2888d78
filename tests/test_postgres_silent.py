"""The PostgreSQL backend with a server that stops answering (a private server, frozen):
every request ends within the request timeout or the caller's deadline, a cancel ends
its task as a cancel, and aclose() ends on time and leaves no server session behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator

import asyncpg
import pytest
from pytest_asynclock import PostgresFactory, PostgresServer
from pytest_asynclock.servers import find_postgres_bindir

import asynclock
from asynclock import BackendError, LockTimeout
from asynclock.backends import PostgresBackend

# The request timeout of this module's coordinators: short, so a silent server costs
# little test time.
REQUEST_TIMEOUT = 0.3


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    """A private server for this module (each test that freezes it resumes it)."""
    if find_postgres_bindir() is None:
        pytest.skip("no PostgreSQL >= 14 for private servers")
    with PostgresFactory() as factory:
        (started,) = factory()
        yield started


@contextlib.contextmanager
def frozen(server: PostgresServer) -> Iterator[None]:
    """The server stopped (SIGSTOP) inside, resumed on the way out."""
    server.freeze()
    try:
        yield
    finally:
        server.resume()


@pytest.fixture
async def admin(server: PostgresServer) -> AsyncIterator[asyncpg.Connection]:
    """A superuser connection to the private server (open while it answers)."""
    conn = await asyncpg.connect(server.url)
    yield conn
    await conn.close()


async def client_sessions(admin: asyncpg.Connection) -> int:
    """Client sessions on the server besides ``admin``'s own."""
    count = await admin.fetchval(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
    )
    return int(count)


async def none_left(admin: asyncpg.Connection, within: float = 10.0) -> bool:
    """Whether no client session but ``admin``'s is left within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            # Polls the server's session list, which has no event to wait on; tests only.
            while await client_sessions(admin):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    except TimeoutError:
        return False
    return True


async def ending(call: Awaitable[object], within: float = 4.0) -> BaseException | None:
    """How ``call`` ended (its exception, or None), failing the test if it did not end
    within ``within`` seconds."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait([task], timeout=within)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pytest.fail(f"did not end within {within:g} s")
    return None if task.cancelled() else task.exception()


def connect(server: PostgresServer, namespace: str, **options: object) -> asynclock.Coordinator:
    return asynclock.connect(
        server.url, namespace=namespace, request_timeout=REQUEST_TIMEOUT, **options
    )


class TestRequestsEnd:
    """Every statement is bounded by ``request_timeout`` (or the caller's deadline); one
    that is not answered in time closes its connection and raises BackendError."""

    async def test_inspect_and_leader_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection
    ) -> None:
        """inspect() and election.leader() end with BackendError (they waited forever)."""
        async with connect(server, namespace) as coord:
            await coord.inspect("x")  # set up: the next inspect() only sends its query
            election = coord.election("e", ttl=10)
            with frozen(server):
                error = await ending(coord.inspect("x"))
                assert isinstance(error, BackendError)
                assert "request timeout" in str(error)
                assert isinstance(await ending(election.leader()), BackendError)
            assert await coord.inspect("x") is None  # answered again once resumed
        assert await none_left(admin)

    async def test_a_try_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection
    ) -> None:
        """lock(timeout=0), what @singleton uses, ends with BackendError (it waited
        forever)."""
        async with connect(server, namespace) as coord:
            async with coord.lock("t", ttl=10):
                pass
            with frozen(server):
                error = await ending(coord.lock("t", ttl=10, timeout=0).acquire())
                assert isinstance(error, BackendError)
                assert "request timeout" in str(error)
            assert coord.held == []
            async with coord.lock("t", ttl=10, timeout=0):
                pass
        assert await none_left(admin)

    async def test_extend_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection
    ) -> None:
        """lease.extend() ends with BackendError and the lease is lost: its session was
        closed, and its lock with it (it waited forever)."""
        async with connect(server, namespace) as coord:
            lease = await coord.lock("x", ttl=60).acquire()
            with frozen(server):
                error = await ending(lease.extend())
                assert isinstance(error, BackendError)
                assert "request timeout" in str(error)
                assert lease.lost
            async with connect(server, namespace) as other, other.lock("x", ttl=10, timeout=5):
                pass
        assert await none_left(admin)


class TestCancelStaysCancel:
    """A call cancelled while the server is silent ends cancelled, at once: its
    connection is closed, not handed back to the pool (which waits for the server)."""

    @pytest.mark.parametrize("call", ["inspect", "publish"])
    async def test_a_cancelled_call_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection, call: str
    ) -> None:
        """inspect() and publish() (an election's announcement) on a pool connection,
        cancelled: CancelledError at once (it was BackendError, pool_timeout later)."""
        async with asynclock.connect(server.url, namespace=namespace, pool_timeout=1) as coord:
            await coord.inspect("warm")  # set up; no lease: no connection kept, pool only
            backend = coord.backend
            with frozen(server):
                work = coord.inspect("x") if call == "inspect" else backend.publish("t", "m")
                task = asyncio.ensure_future(work)
                await asyncio.sleep(0.2)
                assert not task.done()
                task.cancel()
                assert await ending(task, within=2) is None
                assert task.cancelled()
        assert await none_left(admin)

    async def test_a_deadline_during_set_up_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection
    ) -> None:
        """A coordinator on the application's pool, first used while the server is
        frozen: lock(timeout=0.2) ends with LockTimeout by its deadline (it ended with
        BackendError after the deadline and a pool_timeout)."""
        pool = await asyncpg.create_pool(server.url, min_size=2, max_size=4)
        try:
            backend = PostgresBackend(pool, namespace=namespace, pool_timeout=1)
            async with asynclock.Coordinator(backend) as coord:
                loop = asyncio.get_running_loop()
                with frozen(server):
                    began = loop.time()
                    error = await ending(coord.lock("x", ttl=10, timeout=0.2).acquire())
                    assert isinstance(error, LockTimeout)
                    # The deadline, and the slack a server-side wait has to report its own
                    # (0.5 s), with room for a loaded machine.
                    assert loop.time() - began < 2.5
                async with coord.lock("x", ttl=10, timeout=5):
                    pass
        finally:
            await pool.close()
        assert await none_left(admin)


class TestCloseEnds:
    """aclose() ends within its bound on a silent server, and closes what it had."""

    async def test_with_a_kept_connection_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection
    ) -> None:
        """A connection kept for the next lease (not reset yet): aclose() ends within
        the request timeout or so (it never ended)."""
        coord = connect(server, namespace)
        async with coord.lock("a", ttl=10):
            pass
        with frozen(server):
            assert await ending(coord.aclose()) is None
        assert await none_left(admin)

    async def test_with_an_observer_listening_on_a_frozen_server(
        self, server: PostgresServer, namespace: str, admin: asyncpg.Connection
    ) -> None:
        """An election observed (a LISTEN connection): aclose() ends within the request
        timeout or so (it never ended)."""
        coord = connect(server, namespace)
        seen = asyncio.Event()

        async def observe() -> None:
            async for _ in coord.election("e", ttl=30).observe():
                seen.set()

        observer = asyncio.create_task(observe())
        try:
            await asyncio.wait_for(seen.wait(), 10)
            with frozen(server):
                assert await ending(coord.aclose()) is None
        finally:
            observer.cancel()
            await asyncio.gather(observer, return_exceptions=True)
        assert await none_left(admin)


class TestCloseEndsWaiters:
    async def test_no_waiting_session_outlives_aclose(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """A coordinator whose acquire waits in the server's queue is closed: its server
        session is gone when aclose() returns (it stayed until the server's next client
        check, up to a second later)."""
        identity = f"waiter-{namespace}"
        sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1"
        waiting = f"{sessions} AND wait_event_type = 'Lock'"
        pattern = f"asynclock:%:{identity}"
        admin = await asyncpg.connect(asynclock_postgres_dsn)
        try:
            async with (
                asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as holder,
                holder.lock("x", ttl=30),
            ):
                waiter = asynclock.connect(
                    asynclock_postgres_dsn, namespace=namespace, identity=identity
                )
                task = asyncio.create_task(waiter.lock("x", ttl=30).acquire())
                async with asyncio.timeout(10):
                    while not await admin.fetchval(waiting, pattern):  # noqa: ASYNC110
                        await asyncio.sleep(0.02)
                await waiter.aclose()
                assert await admin.fetchval(sessions, pattern) == 0
                await asyncio.gather(task, return_exceptions=True)
        finally:
            await admin.close()
