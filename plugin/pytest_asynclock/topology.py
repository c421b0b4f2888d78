"""Redis Sentinel and Redis Cluster topologies of private ``valkey-server`` processes.

:class:`SentinelSetup` is one master, its replicas and three sentinels (``valkey-server
--sentinel``) watching it; :class:`ClusterSetup` is a Redis Cluster of three masters, each
with its replicas. Both are built from the binary :func:`find_valkey_binary` finds, on
loopback only, and wait until the topology is fully formed before they return. Their fault
helpers (``failover``, ``kill_master``) return once the topology has settled again, so a
test can go on at once; every wait has a timeout and fails with the state it saw and the
tails of the logs.

Every process is a :class:`ValkeyServer` (or subclass) of :mod:`._servers`: addressed by
its PID, registered for interpreter exit, and stopped by :meth:`SentinelSetup.stop` /
:meth:`ClusterSetup.stop` (frozen ones too). Like :mod:`._servers`, this module blocks and
needs only the standard library: it speaks RESP over plain sockets.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Self, TypeAlias, TypeVar

from .servers import (
    _HOST,
    _REDIS_HELP,
    ServerStartError,
    ServerUnavailable,
    ValkeyServer,
    _free_port,
    _register,
    find_valkey_binary,
)

__all__ = (
    "CLUSTER_SLOTS",
    "ClusterNode",
    "ClusterSetup",
    "SentinelServer",
    "SentinelSetup",
    "TopologyTimeout",
    "start_cluster",
    "start_sentinel",
)

CLUSTER_SLOTS = 16384
"""Hash slots of a Redis Cluster."""

_CALL_TIMEOUT = 1.0  # per command; a frozen node costs this much in a probe
_POLL_INTERVAL = 0.05
_LOG_LINES = 12
_PROBE_KEY = "asynclock:topology:probe"  # only ever DELeted: a write that changes nothing

# Every node answers within milliseconds; a sync after a failover takes longer.
_NODE_ARGS = ("--repl-diskless-sync-delay", "0")


class TopologyTimeout(TimeoutError):
    """A topology did not reach the state waited for in time.

    The message says what was awaited, the last state seen, and the log tails of the
    processes involved.
    """


# --------------------------------------------------------------------------------------
# A minimal RESP2 client: one connection per command, so nothing is left open


_Reply: TypeAlias = str | int | list["_Reply"] | None


class _ReplyError(Exception):
    """The server answered with an error reply (``-ERR ...``)."""


def _encode(args: Sequence[str | int]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _read_reply(stream: BinaryIO) -> _Reply:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed in the middle of a reply")
    kind, body = line[:1], line[1:-2].decode(errors="replace")
    if kind == b"+":
        return body
    if kind == b"-":
        raise _ReplyError(body)
    if kind == b":":
        return int(body)
    if kind in (b"$", b"*"):
        size = int(body)
        if size < 0:
            return None
        if kind == b"*":
            return [_read_reply(stream) for _ in range(size)]
        data = stream.read(size + 2)
        if len(data) != size + 2:
            raise ConnectionError("connection closed in the middle of a reply")
        return data[:-2].decode(errors="replace")
    raise ConnectionError(f"not a RESP2 reply: {line[:80]!r}")


def _call(port: int, *args: str | int, timeout: float = _CALL_TIMEOUT) -> _Reply:
    """Send one command to ``127.0.0.1:port`` and return its reply.

    Raises:
        OSError: no connection or no reply in ``timeout`` seconds (``TimeoutError``).
        _ReplyError: an error reply.
    """
    with (
        socket.create_connection((_HOST, port), timeout=timeout) as sock,
        sock.makefile("rb") as stream,
    ):
        sock.sendall(_encode(args))
        return _read_reply(stream)


def _text(reply: _Reply) -> str:
    if not isinstance(reply, str):
        raise _ReplyError(f"expected a string reply, got {reply!r}")
    return reply


def _items(reply: _Reply) -> list[_Reply]:
    if not isinstance(reply, list):
        raise _ReplyError(f"expected an array reply, got {reply!r}")
    return reply


def _pairs(reply: _Reply) -> dict[str, str]:
    """A flat ``[field, value, ...]`` array (SENTINEL MASTER) as a dict of strings."""
    items = _items(reply)
    return {str(items[i]): str(items[i + 1]) for i in range(0, len(items) - 1, 2)}


def _info(port: int, section: str, *, timeout: float = _CALL_TIMEOUT) -> dict[str, str]:
    """``INFO section`` (or ``CLUSTER INFO`` for ``section="cluster-info"``) as a dict."""
    args = ("CLUSTER", "INFO") if section == "cluster-info" else ("INFO", section)
    fields: dict[str, str] = {}
    for line in _text(_call(port, *args, timeout=timeout)).splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            fields[name] = value.strip()
    return fields


def _quiet(predicate: Callable[[], bool]) -> Callable[[], bool]:
    """``predicate`` with connection failures and error replies counted as False."""

    def probe() -> bool:
        try:
            return predicate()
        except (OSError, _ReplyError, ValueError, KeyError):
            return False

    return probe


# --------------------------------------------------------------------------------------
# Node processes


class SentinelServer(ValkeyServer):
    """A ``valkey-server --sentinel`` process with its own ``sentinel.conf``.

    The sentinel rewrites its configuration as it learns the topology, so a
    :meth:`restart` comes back knowing what it knew (as a real sentinel does).
    """

    _binary_name = "valkey-server --sentinel"
    _log_name = "sentinel.log"

    def __init__(self, binary: str, port: int | None, config: str) -> None:
        super().__init__(binary, port, ())
        self.config_path = self.tmpdir / "sentinel.conf"
        """The sentinel's configuration file (it rewrites it)."""
        self.config_path.write_text(config)

    def _command(self) -> list[str]:
        return [
            self.binary,
            str(self.config_path),  # must come first
            "--sentinel",
            "--port",
            str(self.port),
            "--bind",
            _HOST,
            "--dir",
            str(self.tmpdir),
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
        ]

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` (a sentinel has no databases)."""
        return f"redis://{self.host}:{self.port}"


class ClusterNode(ValkeyServer):
    """A ``valkey-server`` with ``--cluster-enabled yes``.

    Its cluster bus listens on :attr:`bus_port`, a free port of its own (not ``port +
    10000``, which may be taken or out of range), kept across :meth:`restart`. The node's
    ``nodes-PORT.conf`` stays in its directory too, so a restarted node rejoins the
    cluster under its old identity (as a replica, if its slots were taken over).
    """

    def __init__(self, binary: str, port: int | None, extra_args: Sequence[str]) -> None:
        super().__init__(binary, port, extra_args)
        self.bus_port = 0
        """The cluster bus port (0 until started)."""

    def _command(self) -> list[str]:
        # A new bus port with each new client port (a clash retries both); none on restart.
        if self._auto_port or not self.bus_port:
            self.bus_port = _free_port()
            while self.bus_port == self.port:
                self.bus_port = _free_port()
        return [
            *super()._command(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"nodes-{self.port}.conf",
            "--cluster-port",
            str(self.bus_port),
        ]


N = TypeVar("N", bound=ValkeyServer)


def _launch(node: N) -> N:
    """Register and start a node built by a caller; stop it if it does not come up."""
    _register(node)
    try:
        node._launch()
    except BaseException:
        node.stop()
        raise
    return node


def _binary_or_raise(binary: str | None) -> str:
    found = binary or find_valkey_binary()
    if found is None:
        raise ServerUnavailable(f"no valkey-server or redis-server found: {_REDIS_HELP}")
    return found


def _live(nodes: Sequence[N]) -> list[N]:
    """The nodes that run and are not frozen: the ones that can answer."""
    return [node for node in nodes if node.running and not node.frozen]


class _Topology:
    """What both setups share: their processes, parallel start and stop, timed waits."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        """The server binary every process runs."""
        self.startup_time: float | None = None
        """Seconds :meth:`start` took, from the first process to a fully formed topology."""
        self._all: list[ValkeyServer] = []
        self._all_lock = threading.Lock()
        self._closed = False

    @property
    def processes(self) -> list[ValkeyServer]:
        """Every process of the topology, in the order started."""
        with self._all_lock:
            return list(self._all)

    def roles(self, timeout: float = 0.3) -> dict[int, str]:
        """``{port: role}`` (``"master"`` or ``"slave"``) of each running, unfrozen data
        node that answers ``INFO replication`` within ``timeout``; the others (and the
        sentinels) are left out."""
        return {port: role for port, role, _, _ in self.poll_roles(timeout)}

    def poll_roles(self, timeout: float = 0.3) -> list[tuple[int, str, float, float]]:
        """:meth:`roles` with times: ``(port, role, asked, answered)`` per node that
        answered, ``asked`` and ``answered`` from ``time.monotonic()`` around its own
        ``INFO`` (the role held at some moment between the two)."""
        answers = []
        for node in _live(self.processes):
            if isinstance(node, SentinelServer):
                continue
            asked = time.monotonic()
            with contextlib.suppress(OSError, _ReplyError):
                role = _info(node.port, "replication", timeout=timeout).get("role")
                if role:
                    answers.append((node.port, role, asked, time.monotonic()))
        return answers

    def _start_all(self, nodes: Sequence[N]) -> list[N]:
        """Start ``nodes`` in parallel; each is kept for :meth:`stop` as soon as it exists."""
        with self._all_lock:
            if self._closed:
                raise RuntimeError(f"{self!r} was stopped")
            self._all.extend(nodes)
        with ThreadPoolExecutor(max_workers=min(len(nodes), 8)) as pool:
            futures = [pool.submit(_launch, node) for node in nodes]
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        return list(nodes)

    def stop(self) -> None:
        """Stop every process of the topology (by PID, frozen ones too); idempotent.

        Sentinels go first, so they do not react to the data nodes going away.
        """
        with self._all_lock:
            self._closed = True
            nodes, self._all = self._all, []
        errors: list[BaseException] = []
        for group in (
            [node for node in nodes if isinstance(node, SentinelServer)],
            [node for node in nodes if not isinstance(node, SentinelServer)],
        ):
            if not group:
                continue
            with ThreadPoolExecutor(max_workers=min(len(group), 8)) as pool:
                futures = [pool.submit(node.stop) for node in group]
            errors.extend(error for f in futures if (error := f.exception()) is not None)
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
        self.stop()

    def _log_tails(self, nodes: Sequence[ValkeyServer] | None = None) -> str:
        chosen = self.processes if nodes is None else nodes
        return "\n".join(
            f"--- {node!r} log tail ({node.log_path}):\n{node.log_tail(_LOG_LINES)}"
            for node in chosen
        )

    def _describe(self) -> str:
        """A few lines on the topology's state, for timeout messages."""
        return ""

    def _wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        """Poll ``predicate`` (errors count as False) until true, or raise TopologyTimeout."""
        probe = _quiet(predicate)
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() >= deadline:
                state = self._describe()
                raise TopologyTimeout(
                    f"{type(self).__name__}: {what} did not happen within {timeout:.1f} s"
                    + (f"\nlast state seen:\n{state}" if state else "")
                    + f"\n{self._log_tails()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _formed(self, started: float, timeout: float, wait: Callable[[float], None]) -> None:
        """Run the start-up ``wait``; on any failure stop everything and re-raise."""
        try:
            wait(timeout)
        except BaseException as exc:
            self.stop()
            if isinstance(exc, TopologyTimeout):
                raise ServerStartError(str(exc)) from exc
            raise
        self.startup_time = time.monotonic() - started


# --------------------------------------------------------------------------------------
# Sentinel


class SentinelSetup(_Topology):
    """A master, its replicas and sentinels watching it: Redis behind Sentinel.

    Start one with :meth:`start`. The data nodes are :class:`ValkeyServer` processes in
    :attr:`servers` (the first one is the master at start; replicas are started with
    ``--replicaof``), the sentinels are :class:`SentinelServer` processes in
    :attr:`sentinel_servers`. Who is master is always asked from the sentinels
    (:meth:`master`), so it stays right after failovers.

    The sentinels run with test timings: ``down-after-milliseconds`` 1000 and
    ``failover-timeout`` 3000 by default, and (``SENTINEL DEBUG``) ``info-period`` 1000 ms
    and ``publish-period`` 500 ms instead of 10 s and 2 s, so they find each other within
    a second and a failover settles within a few.

    A data node restarted with :meth:`ValkeyServer.restart` comes back with its original
    arguments (a replica of the first master, or a master); the sentinels then reconfigure
    it as a replica of the current master, as they would in production.
    """

    def __init__(self, binary: str, service: str, quorum: int) -> None:
        super().__init__(binary)
        self.service = service
        """The monitored service (``sentinel monitor`` master name)."""
        self.quorum = quorum
        """Sentinels that must agree the master is down before a failover."""
        self.servers: list[ValkeyServer] = []
        """The data nodes, master at start first."""
        self.sentinel_servers: list[SentinelServer] = []
        """The sentinel processes."""

    @classmethod
    def start(
        cls,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        service: str = "asynclock",
        quorum: int | None = None,
        down_after: float = 1.0,
        failover_timeout: float = 3.0,
        timeout: float = 30.0,
        binary: str | None = None,
    ) -> SentinelSetup:
        """Start the master, ``replicas`` replicas and ``sentinels`` sentinels, and wait
        until the replicas are in sync and every sentinel knows the master, every replica
        and every other sentinel.

        Args:
            replicas: replicas of the master (>= 1 so a failover has somewhere to go).
            sentinels: sentinel processes.
            service: the master name the sentinels monitor.
            quorum: sentinels that must agree the master is down; default a majority.
            down_after: seconds without a valid reply before a sentinel deems a node down.
            failover_timeout: the sentinels' ``failover-timeout`` in seconds.
            timeout: seconds to wait for the topology to form.
            binary: the server binary; default :func:`find_valkey_binary`.

        Raises:
            ValueError: a count out of range.
            ServerUnavailable: no binary was found.
            ServerStartError: a process did not come up, or the topology did not form in
                time (the message has the state seen and the log tails). Nothing is left
                running.
        """
        if replicas < 0 or sentinels < 1:
            raise ValueError(
                f"expected replicas >= 0 and sentinels >= 1, got {replicas} and {sentinels}"
            )
        quorum = quorum if quorum is not None else sentinels // 2 + 1
        if not 1 <= quorum <= sentinels:
            raise ValueError(f"expected 1 <= quorum <= sentinels ({sentinels}), got {quorum}")
        if not service or any(ch.isspace() for ch in service):
            raise ValueError(f"expected a service name without spaces, got {service!r}")
        setup = cls(_binary_or_raise(binary), service, quorum)
        started = time.monotonic()
        try:
            setup._start_processes(replicas, sentinels, down_after, failover_timeout)
        except BaseException:
            setup.stop()
            raise
        setup._formed(started, timeout, setup._wait_formed)
        return setup

    def _start_processes(
        self, replicas: int, sentinels: int, down_after: float, failover_timeout: float
    ) -> None:
        master = self._start_all([ValkeyServer(self.binary, None, _NODE_ARGS)])[0]
        self.servers.append(master)
        replica_args = (*_NODE_ARGS, "--replicaof", _HOST, str(master.port))
        if replicas:
            nodes = [ValkeyServer(self.binary, None, replica_args) for _ in range(replicas)]
            self.servers.extend(self._start_all(nodes))
        config = "\n".join(
            (
                f"sentinel monitor {self.service} {_HOST} {master.port} {self.quorum}",
                f"sentinel down-after-milliseconds {self.service} {round(down_after * 1000)}",
                f"sentinel failover-timeout {self.service} {round(failover_timeout * 1000)}",
                f"sentinel parallel-syncs {self.service} {max(replicas, 1)}",
                "",
            )
        )
        nodes_s = [SentinelServer(self.binary, None, config) for _ in range(sentinels)]
        self.sentinel_servers.extend(self._start_all(nodes_s))
        for sentinel in self.sentinel_servers:
            for name, millis in (("info-period", 1000), ("publish-period", 500)):
                # Test timings; redis-server before 7 has no SENTINEL DEBUG: keep defaults.
                with contextlib.suppress(_ReplyError):
                    _call(sentinel.port, "SENTINEL", "DEBUG", name, millis)

    # -- what the sentinels say

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        """``[(host, port)]`` of the sentinels, for ``redis.asyncio.sentinel.Sentinel``."""
        return [(node.host, node.port) for node in self.sentinel_servers]

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/SERVICE``."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def _master_port(self, sentinel: SentinelServer) -> int:
        addr = _items(_call(sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service))
        return int(_text(addr[1]))

    def _server(self, port: int) -> ValkeyServer:
        for node in self.servers:
            if node.port == port:
                return node
        raise RuntimeError(f"the sentinels name 127.0.0.1:{port}, which is not in {self!r}")

    def master(self) -> ValkeyServer:
        """The current master, as the first sentinel that answers names it.

        Raises:
            RuntimeError: no sentinel answered, or it named a node that is not ours.
        """
        errors: list[str] = []
        for sentinel in _live(self.sentinel_servers):
            try:
                return self._server(self._master_port(sentinel))
            except (OSError, _ReplyError, ValueError, IndexError) as exc:
                errors.append(f"{sentinel!r}: {exc!r}")
        raise RuntimeError(f"no sentinel of {self!r} named the master: {errors}")

    def replicas(self) -> list[ValkeyServer]:
        """The running data nodes other than :meth:`master`."""
        master = self.master()
        return [node for node in self.servers if node is not master and node.running]

    # -- waiting

    def _agreed_master(self, old_port: int | None = None) -> ValkeyServer | None:
        """The master when the topology is settled, else None.

        Settled: every live sentinel names the same master (not ``old_port``) and has no
        failover in progress; the master accepts writes; every other live data node
        replicates from it with its link up.
        """
        ports = set()
        for sentinel in _live(self.sentinel_servers):
            ports.add(self._master_port(sentinel))
            flags = _pairs(_call(sentinel.port, "SENTINEL", "MASTER", self.service))["flags"]
            if flags.split(",") != ["master"]:  # s_down, o_down, failover_in_progress...
                return None
        if len(ports) != 1 or old_port in ports:
            return None
        master = self._server(ports.pop())
        if master.frozen or not master.running:
            return None
        if not isinstance(_call(master.port, "DEL", _PROBE_KEY), int):  # -READONLY on a replica
            return None
        for node in _live(self.servers):
            if node is master:
                continue
            info = _info(node.port, "replication")
            if (info.get("role"), info.get("master_port"), info.get("master_link_status")) != (
                "slave",
                str(master.port),
                "up",
            ):
                return None
        return master

    def _wait_formed(self, timeout: float) -> None:
        master = self.servers[0]
        want_sentinels = len(self.sentinel_servers) - 1
        want_replicas = len(self.servers) - 1

        def formed() -> bool:
            if self._agreed_master() is not master:
                return False
            if _info(master.port, "replication").get("connected_slaves") != str(want_replicas):
                return False
            for sentinel in self.sentinel_servers:
                state = _pairs(_call(sentinel.port, "SENTINEL", "MASTER", self.service))
                known_replicas = state.get("num-slaves", state.get("num-replicas"))
                if (state["num-other-sentinels"], known_replicas) != (
                    str(want_sentinels),
                    str(want_replicas),
                ):
                    return False
                for replica in _items(_call(sentinel.port, "SENTINEL", "REPLICAS", self.service)):
                    fields = _pairs(replica)
                    if fields["flags"] != "slave" or fields["master-link-status"] != "ok":
                        return False
            return True

        self._wait(
            "replicas in sync and sentinels knowing the master, the replicas and each other",
            formed,
            timeout,
        )

    def wait_settled(self, timeout: float = 30.0) -> ValkeyServer:
        """Wait until the sentinels agree on a master that accepts writes and every live
        replica is linked to it; return that master.

        Raises:
            TopologyTimeout: not within ``timeout`` seconds.
        """
        found: list[ValkeyServer] = []

        def settled() -> bool:
            master = self._agreed_master()
            if master is not None:
                found.append(master)
            return master is not None

        self._wait("settling on one master", settled, timeout)
        return found[-1]

    def _wait_new_master(self, old: ValkeyServer, timeout: float, what: str) -> ValkeyServer:
        found: list[ValkeyServer] = []

        def promoted() -> bool:
            master = self._agreed_master(old_port=old.port)
            if master is not None:
                found.append(master)
            return master is not None

        self._wait(what, promoted, timeout)
        return found[-1]

    # -- faults

    def failover(self, timeout: float = 30.0, *, coordinated: bool = False) -> ValkeyServer:
        """``SENTINEL FAILOVER`` and wait until a replica is the new master.

        Returns once every sentinel names the new master, it accepts writes, and every
        live data node, the old master included, replicates from it (the sentinels demote
        the old master a couple of seconds after the promotion; until then it still
        accepts writes, which the failover loses, as in production).

        Args:
            timeout: seconds to wait for all of that.
            coordinated: ``SENTINEL FAILOVER ... COORDINATED`` (Valkey >= 9): the old master
                pauses writes, hands over once a replica caught up, and turns replica at
                once, so no acknowledged write is lost.

        Returns:
            The new master.

        Raises:
            TopologyTimeout: the failover did not complete in time.
        """
        old = self.master()
        command = ["SENTINEL", "FAILOVER", self.service]
        if coordinated:
            command.append("COORDINATED")
        errors: list[str] = []

        def started() -> bool:
            # -NOGOODSLAVE until a sentinel has fresh INFO from a replica; -INPROG while
            # an earlier failover finishes.
            for sentinel in _live(self.sentinel_servers):
                try:
                    _call(sentinel.port, *command)
                except (OSError, _ReplyError) as exc:
                    errors.append(f"{sentinel!r}: {exc}")
                    continue
                return True
            return False

        deadline = time.monotonic() + timeout
        try:
            self._wait(f"{' '.join(command)} accepted", started, timeout)
        except TopologyTimeout as exc:
            raise TopologyTimeout(f"{exc}\nlast refusals: {errors[-3:]}") from None
        return self._wait_new_master(
            old, max(deadline - time.monotonic(), 0.0), f"failover away from {old!r}"
        )

    def kill_master(self, timeout: float = 30.0) -> ValkeyServer:
        """``SIGKILL`` the master and wait until the sentinels promoted a replica.

        The killed node stays in :attr:`servers` (not running); :meth:`ValkeyServer.restart`
        brings it back, and the sentinels then make it a replica.

        Returns:
            The new master (it accepts writes, every live replica is linked to it).

        Raises:
            TopologyTimeout: no promotion within ``timeout`` seconds.
        """
        old = self.master()
        old.kill()
        return self._wait_new_master(old, timeout, f"promotion of a replica after killing {old!r}")

    def _describe(self) -> str:
        lines = []
        for sentinel in self.sentinel_servers:
            try:
                state = _pairs(_call(sentinel.port, "SENTINEL", "MASTER", self.service))
                lines.append(
                    f"sentinel :{sentinel.port}: master :{state.get('port')} "
                    f"flags={state.get('flags')} replicas={state.get('num-slaves')} "
                    f"other sentinels={state.get('num-other-sentinels')}"
                )
            except (OSError, _ReplyError) as exc:
                lines.append(f"sentinel :{sentinel.port}: {exc!r}")
        for node in self.servers:
            try:
                info = _info(node.port, "replication")
                lines.append(
                    f"node :{node.port}: role={info.get('role')} "
                    f"master_port={info.get('master_port')} "
                    f"link={info.get('master_link_status')} "
                    f"connected_slaves={info.get('connected_slaves')}"
                )
            except (OSError, _ReplyError) as exc:
                lines.append(f"node :{node.port}: {exc!r}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        ports = ",".join(str(node.port) for node in self.servers)
        return (
            f"<SentinelSetup {self.service} nodes :{ports} "
            f"sentinels :{','.join(str(port) for _, port in self.sentinels)}>"
        )


# --------------------------------------------------------------------------------------
# Cluster


@dataclass(frozen=True)
class _NodeView:
    """One line of ``CLUSTER NODES``."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def healthy(self) -> bool:
        return not self.flags & {"fail", "fail?", "handshake", "noaddr"}


def _parse_slots(fields: Sequence[str]) -> tuple[tuple[int, int], ...]:
    ranges = []
    for item in fields:
        if item.startswith("["):  # [slot->-node] importing / migrating
            continue
        first, _, last = item.partition("-")
        ranges.append((int(first), int(last or first)))
    return tuple(ranges)


def _cluster_nodes(port: int) -> list[_NodeView]:
    views = []
    for line in _text(_call(port, "CLUSTER", "NODES")).splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split(",")[0].split("@")[0]
        views.append(
            _NodeView(
                node_id=fields[0],
                port=int(address.rpartition(":")[2] or 0),
                flags=frozenset(fields[2].split(",")),
                master_id=None if fields[3] == "-" else fields[3],
                slots=_parse_slots(fields[8:]),
            )
        )
    return views


@dataclass(frozen=True)
class _ClusterView:
    """What one node believes: slot ranges per master port, master port per replica port."""

    owners: tuple[tuple[int, int, int], ...]  # (first, last, master port), sorted
    replica_of: tuple[tuple[int, int], ...]  # (replica port, master port), sorted
    healthy: frozenset[int]  # ports of nodes without fail/handshake flags

    @classmethod
    def of(cls, nodes: Sequence[_NodeView]) -> _ClusterView:
        by_id = {node.node_id: node for node in nodes}
        owners = sorted(
            (first, last, node.port)
            for node in nodes
            if "master" in node.flags
            for first, last in node.slots
        )
        replica_of = sorted(
            (node.port, by_id[node.master_id].port)
            for node in nodes
            if "slave" in node.flags and node.healthy and node.master_id in by_id
        )
        healthy = frozenset(node.port for node in nodes if node.healthy)
        return cls(tuple(owners), tuple(replica_of), healthy)

    def owner(self, slot: int) -> int | None:
        for first, last, port in self.owners:
            if first <= slot <= last:
                return port
        return None

    def master_ports(self) -> list[int]:
        """Ports of masters owning slots, by their first slot."""
        return list(dict.fromkeys(port for _, _, port in self.owners))


def _slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The slot ranges ``redis-cli --cluster create`` gives ``masters`` masters."""
    per_master = CLUSTER_SLOTS / masters
    ranges = []
    first = 0
    for i in range(masters):
        last = CLUSTER_SLOTS - 1 if i == masters - 1 else round((i + 1) * per_master - 1)
        ranges.append((first, last))
        first = last + 1
    return ranges


class ClusterSetup(_Topology):
    """A Redis Cluster: ``masters`` masters (3 by default), each with ``replicas`` replicas.

    Start one with :meth:`start`. Slots are split as ``redis-cli --cluster create`` does
    (0-5460, 5461-10922, 10923-16383 for three masters). Nodes run with
    ``--cluster-node-timeout 1000`` (a dead master is replaced within about 2-3 s) and
    ``--cluster-replica-validity-factor 0`` (a replica always may take over).

    Who is master is always asked from the nodes (:meth:`masters`, :meth:`node_for_slot`),
    so it stays right after failovers. :attr:`nodes` lists every node in start order:
    masters first (in slot order), then replicas (those of the first master first).
    """

    def __init__(self, binary: str, node_timeout: float) -> None:
        super().__init__(binary)
        self.node_timeout = node_timeout
        """The ``cluster-node-timeout`` in seconds."""
        self.nodes: list[ClusterNode] = []
        """Every node, in start order."""
        self.ids: dict[int, str] = {}
        """Node id by port."""

    @classmethod
    def start(
        cls,
        masters: int = 3,
        replicas: int = 1,
        *,
        node_timeout: float = 1.0,
        timeout: float = 30.0,
        binary: str | None = None,
    ) -> ClusterSetup:
        """Start the nodes, assign slots, join them, attach replicas, and wait until every
        node reports ``cluster_state:ok`` and sees all slots, every master and every
        replica the same way.

        Args:
            masters: master nodes (>= 1; 3 is the smallest cluster that survives losing one).
            replicas: replicas per master (0 or more).
            node_timeout: ``cluster-node-timeout`` in seconds.
            timeout: seconds to wait for the cluster to form.
            binary: the server binary; default :func:`find_valkey_binary`.

        Raises:
            ValueError: a count out of range.
            ServerUnavailable: no binary was found.
            ServerStartError: a node did not come up, or the cluster did not form in time
                (the message has the state seen and the log tails). Nothing is left running.
        """
        if masters < 1 or replicas < 0:
            raise ValueError(
                f"expected masters >= 1 and replicas >= 0, got {masters} and {replicas}"
            )
        setup = cls(_binary_or_raise(binary), node_timeout)
        started = time.monotonic()
        try:
            setup._start_processes(masters, replicas)
            plan = setup._create(masters, replicas)
        except BaseException:
            setup.stop()
            raise
        setup._formed(started, timeout, lambda left: setup._wait_formed(plan, left))
        return setup

    def _start_processes(self, masters: int, replicas: int) -> None:
        args = (
            *_NODE_ARGS,
            "--cluster-node-timeout",
            str(round(self.node_timeout * 1000)),
            "--cluster-replica-validity-factor",
            "0",
            "--cluster-allow-replica-migration",
            "no",
        )
        count = masters * (1 + replicas)
        self.nodes.extend(
            self._start_all([ClusterNode(self.binary, None, args) for _ in range(count)])
        )

    def _create(self, masters: int, replicas: int) -> _ClusterView:
        """Give slots, meet, replicate; return the view every node must come to share."""
        for node in self.nodes:
            self.ids[node.port] = _text(_call(node.port, "CLUSTER", "MYID"))
        primaries, followers = self.nodes[:masters], self.nodes[masters:]
        owners = []
        for epoch, node in enumerate(self.nodes, start=1):
            # Distinct epochs up front spare the nodes resolving collisions between them.
            _call(node.port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for node, (first, last) in zip(primaries, _slot_ranges(masters), strict=True):
            try:
                _call(node.port, "CLUSTER", "ADDSLOTSRANGE", first, last)
            except _ReplyError:  # Redis < 7 has no ADDSLOTSRANGE
                _call(node.port, "CLUSTER", "ADDSLOTS", *range(first, last + 1))
            owners.append((first, last, node.port))
        for node in self.nodes[1:]:
            _call(self.nodes[0].port, "CLUSTER", "MEET", _HOST, node.port, node.bus_port)
        replica_of = sorted(
            (node.port, primaries[i // replicas].port) for i, node in enumerate(followers)
        )
        return _ClusterView(
            tuple(owners), tuple(replica_of), frozenset(node.port for node in self.nodes)
        )

    def _replicate(self, plan: _ClusterView) -> bool:
        """Send ``CLUSTER REPLICATE`` to each replica not yet attached (once it knows its
        master); True when every one of them is."""
        done = True
        for replica_port, master_port in plan.replica_of:
            info = _info(replica_port, "replication")
            if info.get("role") == "slave" and info.get("master_port") == str(master_port):
                continue
            done = False
            with contextlib.suppress(_ReplyError):  # "Unknown node" until the meet spread
                _call(replica_port, "CLUSTER", "REPLICATE", self.ids[master_port])
        return done

    def _wait_formed(self, plan: _ClusterView, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._wait("replicas attached (CLUSTER REPLICATE)", lambda: self._replicate(plan), timeout)
        self._wait(
            "every node agreeing on the planned slots and replicas with cluster_state:ok",
            lambda: self._agreed_view() == plan,
            max(deadline - time.monotonic(), 0.0),
        )

    # -- what the nodes say

    def _node(self, port: int) -> ClusterNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise RuntimeError(f"a node names 127.0.0.1:{port}, which is not in {self!r}")

    def _agreed_view(self) -> _ClusterView | None:
        """The view every live node shares when the cluster is settled, else None.

        Settled: every live node says ``cluster_state:ok`` with all slots ok, sees every
        live node healthy, and all share one view; every live replica's link is up.
        """
        views = set()
        live = _live(self.nodes)
        for node in live:
            info = _info(node.port, "cluster-info")
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(
                CLUSTER_SLOTS
            ):
                return None
            views.add(_ClusterView.of(_cluster_nodes(node.port)))
        if len(views) != 1:
            return None
        view = views.pop()
        if not {node.port for node in live} <= view.healthy:
            return None
        replicas = {port for port, _ in view.replica_of}
        for node in live:
            if node.port in replicas:
                if _info(node.port, "replication").get("master_link_status") != "up":
                    return None
            elif node.port not in view.master_ports():
                return None  # neither replica nor owner yet (a restarted node rejoining)
        return view

    def _view(self) -> _ClusterView:
        """The view of the first live node that answers (no agreement required)."""
        errors = []
        for node in _live(self.nodes):
            try:
                return _ClusterView.of(_cluster_nodes(node.port))
            except (OSError, _ReplyError) as exc:
                errors.append(f"{node!r}: {exc!r}")
        raise RuntimeError(f"no node of {self!r} answered CLUSTER NODES: {errors}")

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:PORT`` of the first running node (a master at start)."""
        running = [node for node in self.nodes if node.running] or self.nodes
        return f"redis+cluster://{running[0].host}:{running[0].port}"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``[(host, port)]`` of every running node, for a cluster client's startup nodes."""
        return [(node.host, node.port) for node in self.nodes if node.running]

    def masters(self) -> list[ClusterNode]:
        """The nodes that own slots, by their first slot (asked from a live node)."""
        return [self._node(port) for port in self._view().master_ports()]

    def replicas(self, of: ClusterNode | None = None) -> list[ClusterNode]:
        """Healthy replicas (of master ``of``, or of any master), by their master's slots."""
        view = self._view()
        order = {port: i for i, port in enumerate(view.master_ports())}
        chosen = [
            (order.get(master, len(order)), replica)
            for replica, master in view.replica_of
            if of is None or master == of.port
        ]
        return [self._node(port) for _, port in sorted(chosen)]

    def node_for_slot(self, slot: int) -> ClusterNode:
        """The master that owns hash slot ``slot`` (0-16383)."""
        if not 0 <= slot < CLUSTER_SLOTS:
            raise ValueError(f"expected a slot in 0..{CLUSTER_SLOTS - 1}, got {slot}")
        port = self._view().owner(slot)
        if port is None:
            raise RuntimeError(f"no master of {self!r} owns slot {slot}")
        return self._node(port)

    def slots_of(self, port: int) -> list[tuple[int, int]]:
        """The slot ranges ``(first, last)`` node ``port`` serves, in its own view."""
        view = _ClusterView.of(_cluster_nodes(port))
        return [(first, last) for first, last, owner in view.owners if owner == port]

    def keyslot(self, key: str) -> int:
        """The hash slot of ``key`` (``CLUSTER KEYSLOT`` on a live node)."""
        for node in _live(self.nodes):
            with contextlib.suppress(OSError):
                reply = _call(node.port, "CLUSTER", "KEYSLOT", key)
                if isinstance(reply, int):
                    return reply
        raise RuntimeError(f"no node of {self!r} answered CLUSTER KEYSLOT")

    # -- waiting and faults

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok``, sees all slots and every
        live node, all agree, and every live replica's link is up.

        Raises:
            TopologyTimeout: not within ``timeout`` seconds.
        """
        self._wait("the cluster settling", lambda: self._agreed_view() is not None, timeout)

    def _wait_owner(
        self, slots: Sequence[int], candidates: set[int], old: ClusterNode, timeout: float
    ) -> ClusterNode:
        found: list[int] = []

        def taken_over() -> bool:
            view = self._agreed_view()
            if view is None:
                return False
            owners = {view.owner(slot) for slot in slots}
            port = owners.pop() if len(owners) == 1 else None
            if port is None or port not in candidates:
                return False
            if old.running and not old.frozen and (old.port, port) not in view.replica_of:
                return False  # the old master has not yet turned replica of the new one
            found.append(port)
            return True

        self._wait(f"a replica taking over the slots of {old!r}", taken_over, timeout)
        return self._node(found[-1])

    def kill_master(self, index: int = 0, timeout: float = 30.0) -> ClusterNode:
        """``SIGKILL`` ``masters()[index]`` and wait until one of its replicas took over
        its slots and the cluster is ok again on every live node.

        Returns:
            The promoted replica.

        Raises:
            RuntimeError: the master has no running replica (the cluster would stay down).
            TopologyTimeout: no takeover within ``timeout`` seconds.
        """
        view = self._view()
        old = self._node(view.master_ports()[index])
        candidates = {node.port for node in self.replicas(old) if node.running}
        if not candidates:
            raise RuntimeError(f"{old!r} has no running replica to take over its slots")
        slots = [first for first, _, port in view.owners if port == old.port]
        old.kill()
        return self._wait_owner(slots, candidates, old, timeout)

    def failover(
        self, replica: ClusterNode | None = None, timeout: float = 30.0, *, mode: str | None = None
    ) -> ClusterNode:
        """``CLUSTER FAILOVER [FORCE|TAKEOVER]`` on ``replica`` and wait until it owns its
        master's slots, the old master (if running) is its replica, and the cluster is
        ok on every live node.

        ``replica`` defaults to the first replica of the first master (by slots), so
        calling ``failover()`` again swaps the two back.

        Returns:
            ``replica``, now a master.

        Raises:
            ValueError: ``replica`` is not a replica (or there is none), or ``mode`` is not
                FORCE or TAKEOVER.
            TopologyTimeout: the failover did not complete in time.
        """
        if mode is not None and mode.upper() not in ("FORCE", "TAKEOVER"):
            raise ValueError(f"expected mode None, 'FORCE' or 'TAKEOVER', got {mode!r}")
        if replica is None:
            candidates = self.replicas()
            if not candidates:
                raise ValueError(f"{self!r} has no healthy replica to fail over to")
            replica = candidates[0]
        view = self._view()
        master_port = dict(view.replica_of).get(replica.port)
        if master_port is None:
            raise ValueError(f"{replica!r} is not a replica in {self!r}")
        old = self._node(master_port)
        slots = [first for first, _, port in view.owners if port == old.port]
        _call(replica.port, "CLUSTER", "FAILOVER", *([mode.upper()] if mode else []))
        return self._wait_owner(slots, {replica.port}, old, timeout)

    def _describe(self) -> str:
        lines = []
        for node in self.nodes:
            if not node.running or node.frozen:
                lines.append(f"node :{node.port}: {'frozen' if node.frozen else 'not running'}")
                continue
            try:
                info = _info(node.port, "cluster-info")
                view = _ClusterView.of(_cluster_nodes(node.port))
                lines.append(
                    f"node :{node.port}: state={info.get('cluster_state')} "
                    f"slots_ok={info.get('cluster_slots_ok')} "
                    f"known={info.get('cluster_known_nodes')} owners={list(view.owners)} "
                    f"replicas={list(view.replica_of)} healthy={sorted(view.healthy)}"
                )
            except (OSError, _ReplyError) as exc:
                lines.append(f"node :{node.port}: {exc!r}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<ClusterSetup nodes :{','.join(str(node.port) for node in self.nodes)}>"


# --------------------------------------------------------------------------------------
# Shortcuts, in the style of start_valkey


def start_sentinel(
    *,
    replicas: int = 2,
    sentinels: int = 3,
    service: str = "asynclock",
    timeout: float = 30.0,
    binary: str | None = None,
) -> SentinelSetup:
    """Start Redis behind Sentinel; see :meth:`SentinelSetup.start`."""
    return SentinelSetup.start(
        replicas=replicas, sentinels=sentinels, service=service, timeout=timeout, binary=binary
    )


def start_cluster(
    masters: int = 3, replicas: int = 1, *, timeout: float = 30.0, binary: str | None = None
) -> ClusterSetup:
    """Start a Redis Cluster; see :meth:`ClusterSetup.start`."""
    return ClusterSetup.start(masters, replicas, timeout=timeout, binary=binary)
