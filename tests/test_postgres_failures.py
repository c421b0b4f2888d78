"""The PostgreSQL backend under partial failures, on a real server: statements that fail
after taking a lock, stalled and killed sessions, server-side timeouts of a role, DSNs
with awkward passwords, an exhausted pool, long identities."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import cast

import asyncpg
import pytest
from pytest_asynclock.proxy import FaultProxy

import asynclock
from asynclock import BackendError, Backoff, Election, LockTimeout
from asynclock.backends import PostgresBackend
from asynclock.backends.base import Attempt, Claim

from .conftest import eventually
from .test_postgres import advisory_rows_on as advisory_rows

RoleDsn = Callable[..., Awaitable[str]]


@pytest.fixture
async def admin(asynclock_postgres_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A superuser connection of the test's own."""
    conn = await asyncpg.connect(asynclock_postgres_dsn)
    yield conn
    await conn.close()


@pytest.fixture
def sequence(namespace: str) -> str:
    """A fence sequence of the test's own (a test may lock it with ALTER SEQUENCE)."""
    return f"fence_{namespace}"


@pytest.fixture
async def role_dsn(
    asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str, sequence: str
) -> AsyncIterator[RoleDsn]:
    """``await role_dsn(statement_timeout="500ms")``: the DSN of a login role made for
    the test, with those settings as its defaults (ALTER ROLE ... SET), allowed to use
    the test's fence sequence. Dropped at the end."""
    role = f"r_{namespace}"
    made = False

    async def make(**settings: str) -> str:
        nonlocal made
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        made = True
        await admin.execute(f'CREATE SEQUENCE IF NOT EXISTS "{sequence}" CACHE 1')
        await admin.execute(f'GRANT USAGE, SELECT, UPDATE ON SEQUENCE "{sequence}" TO "{role}"')
        for name, value in settings.items():
            await admin.execute(f"ALTER ROLE \"{role}\" SET {name} = '{value}'")
        return asynclock_postgres_dsn.replace("postgres@", f"{role}@", 1)

    yield make
    if made:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await admin.execute(f'DROP SEQUENCE IF EXISTS "{sequence}"')
        await admin.execute(f'DROP ROLE "{role}"')


async def eventually_clean(admin: asyncpg.Connection, within: float = 5.0) -> bool:
    """Whether no advisory lock is left in the database within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            # Polls the server's lock table, which has no event to wait on; tests only.
            while await advisory_rows(admin):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    except TimeoutError:
        return False
    return True


async def wait_for_rows(admin: asyncpg.Connection, count: int, key: int | None = None) -> None:
    """Until ``count`` advisory locks (of ``key``) are granted or waited for."""
    async with asyncio.timeout(10):
        while len(await advisory_rows(admin, key)) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def backend_of(coord: asynclock.Coordinator) -> PostgresBackend:
    backend = coord.backend
    assert isinstance(backend, PostgresBackend)
    return backend


@contextlib.asynccontextmanager
async def sequence_locked(admin: asyncpg.Connection, sequence: str) -> AsyncIterator[None]:
    """A migration's ALTER SEQUENCE on the fence sequence, in an open transaction: every
    nextval() waits (under lock_timeout, if any) until it ends."""
    async with admin.transaction():
        await admin.execute(f'ALTER SEQUENCE "{sequence}" CACHE 1')
        yield


class TestFailedStatementsOnLockConnections:
    """A statement that took an advisory lock and then failed (the fence's nextval()
    under lock_timeout) leaves the lock with the session: it must be dropped, or the
    session ended, before the connection is used again or kept."""

    async def test_a_waiter_granted_while_the_fence_sequence_is_locked(
        self,
        asynclock_postgres_dsn: str,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
    ) -> None:
        """The waiter is granted in the queue, its nextval() runs out of the wait's
        lock_timeout behind a migration's ALTER SEQUENCE: LockTimeout, and nothing held
        (the lock stayed on an idle pooled connection forever)."""
        async with (
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as coord,
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as other,
        ):
            key = backend_of(coord).key("migrating")
            holder = await other.lock("migrating", ttl=30).acquire()
            waiter = asyncio.create_task(coord.lock("migrating", ttl=30, timeout=2).acquire())
            await wait_for_rows(admin, 2, key)
            async with sequence_locked(admin, sequence):
                await holder.release()
                with pytest.raises(LockTimeout):
                    await waiter
            assert await advisory_rows(admin, key) == []
            async with other.lock("migrating", ttl=30, timeout=0):
                pass

    @pytest.mark.parametrize("kind", ["lock", "shared", "semaphore"])
    async def test_a_try_under_a_session_lock_timeout(
        self,
        asynclock_postgres_dsn: str,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
        kind: str,
    ) -> None:
        """A session (or role) lock_timeout bounds the try's nextval(): the try took the
        lock (or a permit), the fence timed out; nothing may stay held."""
        await admin.execute(f'CREATE SEQUENCE IF NOT EXISTS "{sequence}" CACHE 1')
        try:
            async with asynclock.connect(
                asynclock_postgres_dsn,
                namespace=namespace,
                fence_sequence=sequence,
                server_settings={"lock_timeout": "200"},
            ) as coord:
                if kind == "semaphore":
                    lock = coord.semaphore("tried", 2, ttl=30, timeout=0)
                else:
                    lock = coord.lock("tried", ttl=30, timeout=0, shared=kind == "shared")
                async with sequence_locked(admin, sequence):
                    with pytest.raises(LockTimeout):
                        await lock.acquire()
                assert await advisory_rows(admin) == []
                async with lock:  # the connection it used is clean and usable
                    pass
                assert await advisory_rows(admin) == []
        finally:
            await admin.execute(f'DROP SEQUENCE IF EXISTS "{sequence}"')

    async def test_a_permit_waiter_whose_fence_times_out(
        self,
        asynclock_postgres_dsn: str,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
    ) -> None:
        """A permit waiter's scans hold the waiting flag, and nextval() after a slot was
        taken waits behind a migration: whatever the scans took is dropped when the wait
        ends (a guard for the waiting flag's bookkeeping when a scan fails)."""
        backoff = asynclock.Backoff(initial=0.05, maximum=0.3)
        async with (
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as coord,
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as other,
        ):
            holder = await other.semaphore("few", 1, ttl=30).acquire()
            waiter = asyncio.create_task(
                coord.semaphore("few", 1, ttl=30, timeout=1.5, retry=backoff).acquire()
            )
            await wait_for_rows(admin, 2)  # the waiter holds the waiting flag
            async with sequence_locked(admin, sequence):
                await holder.release()
                with pytest.raises(LockTimeout):
                    await waiter
            # A scan cut short by the deadline is given back in the background.
            assert await eventually_clean(admin)
            async with other.semaphore("few", 1, ttl=30, timeout=0):
                pass


class TestStalledAndKilledSessions:
    async def test_one_stalled_session_does_not_lose_the_others(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """Leases renewed in one batch: the server process of one is stopped (SIGSTOP),
        its heartbeat hangs. The other's heartbeat answers and must count: it stays
        held (the whole batch read as unknown, and both were lost)."""
        ttl = 3.0
        async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as coord:
            a, b = await asyncio.gather(
                coord.lock("a", ttl=ttl).acquire(), coord.lock("b", ttl=ttl).acquire()
            )
            pid = b._claim.handle.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                assert await eventually(lambda: b.lost, within=4 * ttl)
                assert a.held
                renewals = coord._engine.watchdog.renewals
                assert await eventually(
                    lambda: coord._engine.watchdog.renewals > renewals, within=ttl
                )
                assert a.held
            finally:
                os.kill(pid, signal.SIGCONT)
            await a.release()

    @pytest.mark.parametrize("kind", ["lock", "semaphore"])
    async def test_a_session_killed_between_the_grant_and_the_lease(
        self,
        asynclock_postgres_dsn: str,
        admin: asyncpg.Connection,
        namespace: str,
        kind: str,
    ) -> None:
        """The server ends the granted session before the acquire made its lease (no
        lease to tell yet): the acquire raises BackendError instead of handing over a
        lease on a dead session (believed held until its first renewal, ttl/3 later,
        while another client can take the name)."""
        async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as coord:
            backend = backend_of(coord)
            original = backend.try_acquire

            async def killed_after_the_grant(
                claim: Claim, ttl: float, *, wait: float | None = 0.0
            ) -> Attempt:
                attempt = await original(claim, ttl, wait=wait)
                if attempt.fence is not None:
                    await admin.execute("SELECT pg_terminate_backend($1)", claim.handle.pid)
                    assert await eventually(lambda: claim.ended, within=5)
                return attempt

            backend.try_acquire = killed_after_the_grant  # type: ignore[method-assign]
            lock = coord.lock("k", ttl=30) if kind == "lock" else coord.semaphore("k", 2, ttl=30)
            with pytest.raises(BackendError, match="ended the session"):
                await lock.acquire()
            assert coord.held == []
            backend.try_acquire = original  # type: ignore[method-assign]
            async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as other:
                lease = await other.lock("k", ttl=30, timeout=0).acquire()
                await lease.release()
            # The name works again for the same coordinator.
            async with lock:
                pass


class TestRoleTimeouts:
    @pytest.mark.parametrize(
        ("setting", "wait"),
        [("statement_timeout", None), ("statement_timeout", 5.0), ("transaction_timeout", 5.0)],
    )
    async def test_a_role_timeout_does_not_end_a_wait(  # noqa: PLR0917
        self,
        asynclock_postgres_dsn: str,
        role_dsn: RoleDsn,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
        setting: str,
        wait: float | None,
    ) -> None:
        """ALTER ROLE ... SET statement_timeout (or transaction_timeout, PostgreSQL >= 17):
        a wait in the queue longer than that is not ended by it (statement_timeout ended
        it with BackendError, transaction_timeout ended the session); the wait's own
        timeout rules."""
        if setting == "transaction_timeout" and admin.get_server_version().major < 17:
            pytest.skip("transaction_timeout is PostgreSQL 17+")
        dsn = await role_dsn(**{setting: "300ms"})
        async with (
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as holder_coord,
            asynclock.connect(dsn, namespace=namespace, fence_sequence=sequence) as coord,
        ):
            key = backend_of(coord).key("long-wait")
            holder = await holder_coord.lock("long-wait", ttl=30).acquire()
            waiter = asyncio.create_task(coord.lock("long-wait", ttl=30, timeout=wait).acquire())
            await wait_for_rows(admin, 2, key)
            # Longer than the role's timeout (a lower bound: load only adds).
            await asyncio.sleep(1.0)
            assert not waiter.done()
            await holder.release()
            lease = await asyncio.wait_for(waiter, 10)
            await lease.release()

    async def test_a_role_timeout_does_not_end_a_wait_on_a_kept_connection(
        self,
        asynclock_postgres_dsn: str,
        role_dsn: RoleDsn,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
    ) -> None:
        """A role's statement_timeout and a wait on a connection kept from an earlier
        lease, whose try no longer lifts it again: the wait still outlasts it."""
        dsn = await role_dsn(statement_timeout="300ms")
        async with (
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as holder_coord,
            asynclock.connect(dsn, namespace=namespace, fence_sequence=sequence) as coord,
        ):
            key = backend_of(coord).key("kept-wait")
            async with coord.lock("kept-wait", ttl=30):
                pass  # a waiting acquire's try lifted the timeouts on this connection
            holder = await holder_coord.lock("kept-wait", ttl=30).acquire()
            waiter = asyncio.create_task(coord.lock("kept-wait", ttl=30).acquire())
            await wait_for_rows(admin, 2, key)
            await asyncio.sleep(0.8)  # longer than the role's timeout
            assert not waiter.done()
            await holder.release()
            lease = await asyncio.wait_for(waiter, 10)
            await lease.release()

    async def test_a_pool_command_timeout_does_not_end_a_wait(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """An application's pool with command_timeout (asyncpg's default bound of every
        call): a wait in the queue longer than that is not ended by it (it was, with
        BackendError); the wait's own timeout rules."""
        pool = await asyncpg.create_pool(
            asynclock_postgres_dsn, min_size=1, max_size=4, command_timeout=0.2
        )
        try:
            async with (
                asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as holder_coord,
                asynclock.Coordinator(PostgresBackend(pool, namespace=namespace)) as coord,
            ):
                key = backend_of(coord).key("long-wait")
                holder = await holder_coord.lock("long-wait", ttl=30).acquire()
                waiter = asyncio.create_task(coord.lock("long-wait", ttl=30).acquire())
                await wait_for_rows(admin, 2, key)
                # Longer than the pool's command_timeout (a lower bound: load only adds).
                await asyncio.sleep(0.6)
                assert not waiter.done()
                await holder.release()
                lease = await asyncio.wait_for(waiter, 10)
                await lease.release()
        finally:
            await pool.close()

    async def test_a_role_idle_session_timeout_does_not_end_a_permit_wait(
        self,
        asynclock_postgres_dsn: str,
        role_dsn: RoleDsn,
        namespace: str,
        sequence: str,
    ) -> None:
        """ALTER ROLE ... SET idle_session_timeout: a semaphore waiter's session, idle
        between its scans for longer than that, is not ended by it (it was: BackendError);
        the permit is granted when it comes free."""
        dsn = await role_dsn(idle_session_timeout="300ms")
        async with (
            asynclock.connect(
                asynclock_postgres_dsn, namespace=namespace, fence_sequence=sequence
            ) as holder_coord,
            asynclock.connect(dsn, namespace=namespace, fence_sequence=sequence) as coord,
        ):
            holder = await holder_coord.semaphore("few", 1, ttl=30).acquire()
            waiting = coord.semaphore("few", 1, ttl=30, timeout=10, retry=Backoff(maximum=5.0))
            waiter = asyncio.create_task(waiting.acquire())
            # Longer than the role's idle_session_timeout (a lower bound: load only adds).
            await asyncio.sleep(0.8)
            assert not waiter.done()
            await holder.release()
            permit = await asyncio.wait_for(waiter, 10)
            await permit.release()


class TestDsns:
    @pytest.mark.parametrize("password", ["s3cr#tPW", "s3/cr?tPW", "p@ss#w/rd"])
    async def test_passwords_with_url_characters(
        self,
        asynclock_postgres_dsn: str,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
        password: str,
    ) -> None:
        """A password with unescaped ``#``, ``/``, ``?`` or ``@`` works (it raised a
        ValueError that quoted part of the password), and no repr or error shows it."""
        role = f"p_{namespace}"
        await admin.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'")
        await admin.execute(f'CREATE SEQUENCE "{sequence}" CACHE 1')
        await admin.execute(f'GRANT USAGE, SELECT, UPDATE ON SEQUENCE "{sequence}" TO "{role}"')
        try:
            host = asynclock_postgres_dsn.split("@", 1)[1]
            dsn = f"postgresql://{role}:{password}@{host}"
            async with asynclock.connect(
                dsn, namespace=namespace, fence_sequence=sequence
            ) as coord:
                for text in (repr(coord), coord.backend.describe()):
                    assert password not in text
                    assert not any(part in text for part in password.split("#") if part)
                async with coord.lock("pw", ttl=5):
                    pass
        finally:
            await admin.execute(f'DROP SEQUENCE "{sequence}"')
            await admin.execute(f'DROP ROLE "{role}"')

    async def test_a_multi_host_dsn_is_accepted(self) -> None:
        """asyncpg's multi-host form (``@h1:5432,h2:5433/db``) is accepted (it was
        refused by a port parser) and described without credentials."""
        coord = asynclock.connect("postgresql://app:pw@h1:5432,h2:5433/db")
        assert coord.backend.describe().startswith("PostgresBackend h1:5432,h2:5433/db")
        assert "pw" not in repr(coord)
        await coord.aclose()

    @pytest.mark.parametrize(
        "dsn",
        ["postgresql://app:s3cr3t@h:notaport/db", "postgresql://app:s3cr3t@h:1,h:2x/db"],
    )
    async def test_an_unreadable_dsn_is_refused_without_its_password(self, dsn: str) -> None:
        with pytest.raises(ValueError, match="not a PostgreSQL DSN") as raised:
            asynclock.connect(dsn)
        assert "s3cr3t" not in str(raised.value)
        assert raised.value.__cause__ is None

    @pytest.mark.parametrize(
        "dsn",
        [
            "postgresql://app:2024/Secret@127.0.0.1/app",
            "postgresql://app:/Secret@127.0.0.1/app",
            "postgresql://app:1,h2:2/Secret@127.0.0.1/app",
            "postgresql://app:4242?Secret@127.0.0.1/app",
        ],
    )
    async def test_a_password_the_grammar_reads_as_a_host_and_port(self, dsn: str) -> None:
        """A password whose first part looks like a port (``app:2024/Secret@…``): URL
        grammar makes ``app:2024`` the host list and the rest a path, so the description
        showed the password. It is read up to the last ``@`` instead: the host is
        127.0.0.1, and nothing of the password shows."""
        coord = asynclock.connect(dsn)
        try:
            text = f"{coord!r} {coord.backend.describe()}"
            assert "127.0.0.1/app" in text
            for part in ("Secret", "2024", "4242", "h2:2"):
                assert part not in text
        finally:
            await coord.aclose()

    async def test_pool_of_the_application_with_an_odd_dsn(self) -> None:
        """A pool of the application's: described from its DSN, never with a password."""
        pool = asyncpg.create_pool("postgresql://app:pa@ss@h1:5432,h2/db", min_size=0)
        backend = PostgresBackend(pool)
        assert "pa@ss" not in backend.describe()
        assert "ss@" not in backend.describe()


class TestExhaustedPool:
    async def test_inspect_and_publish_with_every_connection_pinned(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """max_connections=1 and one lease held: inspect(), is_locked() and publish()
        end with BackendError within pool_timeout (they waited forever)."""
        async with asynclock.connect(
            asynclock_postgres_dsn, namespace=namespace, max_connections=1, pool_timeout=0.5
        ) as coord:
            async with coord.lock("only", ttl=30):
                async with asyncio.timeout(10):
                    with pytest.raises(BackendError, match="no free connection"):
                        await coord.inspect("only")
                    with pytest.raises(BackendError, match="no free connection"):
                        await coord.is_locked("other")
                    with pytest.raises(BackendError, match="no free connection"):
                        await coord.backend.publish("topic", "message")
            # A connection kept for the next lease serves them without a pool checkout.
            async with asyncio.timeout(10):
                assert await coord.inspect("only") is None
                assert not await coord.is_locked("only")
                await coord.backend.publish("topic", "message")
            async with coord.lock("only", ttl=30, timeout=5):
                pass


LONG = "worker-" + "x" * 80 + ":12345:abcdef"
NON_ASCII = "wörker-✓:1:ab"
LONG_HOST = "payments-api-deployment-7d9f8b6c5-x2k4j.payments.svc.cluster.local"


class TestIdentities:
    """application_name keeps 63 bytes of printable ASCII: identities that do not fit
    are stored where they survive, and reported whole."""

    @pytest.mark.parametrize("identity", [LONG, NON_ASCII, "#not-a-digest", "short:1:ab"])
    async def test_inspect_reports_the_identity_whole(
        self, asynclock_postgres_dsn: str, namespace: str, identity: str
    ) -> None:
        async with (
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace, identity=identity) as a,
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as b,
            a.lock("who", ttl=20) as lease,
        ):
            info = await b.inspect("who")
            assert info is not None
            assert (info.owner, info.fence) == (identity, lease.fence)
            assert 10 < info.expires_in <= 20
            await lease.extend(2000)  # a longer TTL leaves less room for the identity
            info = await b.inspect("who")
            assert info is not None
            assert info.owner == identity
            assert info.expires_in > 1000

    async def test_inspect_finds_an_identity_stored_under_another_schema(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """The holder's coordinator uses another ``schema`` (its identity table is
        there): inspect() and leader() still name it whole (they showed its digest, and
        observe() reported a change of leader that did not happen)."""
        schema = f"s_{namespace}"
        identity = f"{LONG}-{namespace}"  # stored by no other test
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        options = {"namespace": namespace}
        try:
            async with (
                asynclock.connect(
                    asynclock_postgres_dsn, schema=schema, identity=identity, **options
                ) as a,
                asynclock.connect(asynclock_postgres_dsn, **options) as b,
            ):
                async with a.lock("who", ttl=20):
                    info = await b.inspect("who")
                    assert info is not None
                    assert info.owner == identity
                async with a.election("chief", ttl=20, identity=identity).leadership():
                    assert await b.election("chief", ttl=20).leader() == identity
        finally:
            await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')

    async def test_the_default_identity_on_a_long_host_name(
        self, asynclock_postgres_dsn: str, namespace: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """host:pid:random on a host with a long name (a Kubernetes pod's)."""
        monkeypatch.setattr("asynclock._election.socket.gethostname", lambda: LONG_HOST)
        async with (
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as a,
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as b,
        ):
            assert a.identity.startswith(LONG_HOST + ":")
            async with a.semaphore("pod", 2, ttl=20):
                pass
            async with a.lock("pod", ttl=20):
                info = await b.inspect("pod")
                assert info is not None
                assert info.owner == a.identity

    async def test_leader_and_observe_name_a_long_identity_once(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """leader() returns the identity as given; observe() reports the leader once
        (it reported it again under its cut name when it looked again)."""
        ttl = 1.0
        async with (
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as a,
            asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as b,
        ):
            candidate = a.election("chief", ttl=ttl, identity=NON_ASCII + LONG)
            watcher = b.election("chief", ttl=ttl)
            seen: list[str | None] = []
            first = asyncio.Event()

            async def observe() -> None:
                async for leader in watcher.observe():
                    seen.append(leader)
                    first.set()

            task = asyncio.create_task(observe())
            try:
                await asyncio.wait_for(first.wait(), 10)
                async with candidate.leadership():
                    assert await watcher.leader() == NON_ASCII + LONG
                    assert await eventually(lambda: len(seen) >= 2, within=5)
                    # Observers look again when the term could have ended (every ttl):
                    # those looks must find the same name.
                    await asyncio.sleep(3 * ttl)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert seen[:2] == [None, NON_ASCII + LONG]
            assert set(seen) <= {None, NON_ASCII + LONG}
            assert seen.count(NON_ASCII + LONG) == 1


async def first_observed(election: Election) -> str | None:
    """The first leader ``election.observe()`` yields (the observer then stops)."""
    observing = cast("AsyncGenerator[str | None, None]", election.observe())
    async with contextlib.aclosing(observing):
        return await asyncio.wait_for(anext(observing), 10)


class TestElectionHolders:
    """Only candidates lead: the election's lock held by a session that is not a
    candidate, or not yet named as one, is never reported as a leader."""

    async def test_a_foreign_holder_of_the_key_is_no_leader(
        self, asynclock_postgres_dsn: str, namespace: str
    ) -> None:
        """A session of the application holds the election's key: leader() is None and
        observe() starts with None; inspect() still shows that session (leader() named
        it)."""
        conn = await asyncpg.connect(
            asynclock_postgres_dsn, server_settings={"application_name": "a-migration"}
        )
        try:
            async with asynclock.connect(asynclock_postgres_dsn, namespace=namespace) as coord:
                election = coord.election("chief", ttl=5)
                key = backend_of(coord).key("election:chief")
                await conn.execute("SELECT pg_advisory_lock($1)", key)
                info = await coord.inspect("election:chief")
                assert info is not None
                assert (info.owner, info.fence, info.expires_in) == ("a-migration", 0, math.inf)
                assert await election.leader() is None
                assert await first_observed(election) is None
        finally:
            await conn.close()

    async def test_a_candidate_granted_before_its_fence_is_named(
        self,
        asynclock_postgres_dsn: str,
        admin: asyncpg.Connection,
        namespace: str,
        sequence: str,
    ) -> None:
        """A candidate granted the lock whose fence step is held back (a migration's ALTER
        SEQUENCE): leader(), observe() and inspect() name the candidate, not ``pid N``,
        and it leads once the step ends."""
        options = {"namespace": namespace, "fence_sequence": sequence}
        await admin.execute(f'CREATE SEQUENCE IF NOT EXISTS "{sequence}" CACHE 1')
        try:
            async with (
                asynclock.connect(asynclock_postgres_dsn, **options) as a,
                asynclock.connect(asynclock_postgres_dsn, **options) as b,
            ):
                key = backend_of(a).key("election:chief")
                candidate = a.election("chief", ttl=30, identity="api-7")
                watcher = b.election("chief", ttl=30)
                leading = asyncio.Event()

                async def lead() -> None:
                    async with candidate.leadership():
                        leading.set()
                        await asyncio.sleep(3600)

                async with sequence_locked(admin, sequence):
                    task = asyncio.create_task(lead())
                    await wait_for_rows(admin, 1, key)  # granted: the fence step waits
                    assert [row["granted"] for row in await advisory_rows(admin, key)] == [True]
                    assert not leading.is_set()
                    info = await b.inspect("election:chief")
                    assert info is not None
                    assert (info.owner, info.fence) == ("api-7", 0)
                    assert await watcher.leader() == "api-7"
                    assert await first_observed(watcher) == "api-7"
                await asyncio.wait_for(leading.wait(), 10)
                info = await b.inspect("election:chief")
                assert info is not None
                assert info.owner == "api-7"
                assert info.fence > 0
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            await admin.execute(f'DROP SEQUENCE IF EXISTS "{sequence}"')


class TestSilentServerAtRelease:
    async def test_a_release_the_server_never_answers_ends(
        self, asynclock_postgres_dsn: str, admin: asyncpg.Connection, namespace: str
    ) -> None:
        """The server goes silent as the block ends: the release gives up after its
        bound with BackendError (counted), ending its session, and the lock is given back
        once the server is heard again. It waited forever."""
        loop = asyncio.get_running_loop()
        async with FaultProxy.from_url(asynclock_postgres_dsn) as proxy:
            url = proxy.url_for(asynclock_postgres_dsn)
            async with asynclock.connect(url, namespace=namespace, request_timeout=1) as coord:
                with pytest.raises(BackendError, match="release not answered"):
                    async with asyncio.timeout(30), coord.lock("x", ttl=60):
                        proxy.blackhole()
                        silent = loop.time()
                assert loop.time() - silent < 15
                assert coord.stats().release_failures == 1
                proxy.heal()
            assert await eventually_clean(admin, within=10)
