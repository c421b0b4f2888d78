"""A fault-injecting TCP proxy for tests: latency, black holes, refusals and resets.

Put a :class:`FaultProxy` between a client and a real server and turn faults on and off
while the client runs::

    async with FaultProxy.from_url(redis_url) as proxy:
        coord = asynclock.connect(proxy.url_for(redis_url))
        proxy.set_latency(0.05)          # every chunk, both ways, 50 ms later, in order
        proxy.blackhole()                # a partition: connections stay open, nothing passes
        proxy.heal()                     # back to plain pass-through
        proxy.reset()                    # abort live connections with a TCP RST
        proxy.refuse()                   # new connections are reset at once
        await proxy.schedule([(0.5, "blackhole"), (2.0, "heal")])   # a timeline

Faults, and what the client sees:

``set_latency(seconds, jitter=0.0)``
    Each chunk read from either side is written ``seconds`` (plus a uniform draw below
    ``jitter``) after it was read; order is kept, so a late chunk also holds back those
    behind it. A request/reply round trip grows by at least ``2 * seconds``.
``blackhole()``
    A network partition: live connections stay open but no byte gets through, either
    way; new connections are accepted and wait (the server is not even connected until
    healed). The client sees its requests time out. As with TCP over a partition that
    heals before the connection gives up, nothing is lost: what was sent meanwhile is
    delivered, in order, after :meth:`~FaultProxy.heal` (requests a client gave up on
    reach the server late). A proxy that dropped bytes from a live stream would break
    the one promise TCP makes, ordered and complete delivery, which no client (nor
    Redis's own protocol) can survive.
``refuse()``
    New connections are reset as soon as they are accepted (the client sees a connection
    reset or closed on its first use); live connections carry on.
``reset()``
    Every live connection is aborted with a TCP RST at once, on both sides; the mode
    does not change, so new connections work (unless refused or black-holed).
``heal()``
    Pass-through without latency. Connections black-holed meanwhile carry on from there.

Only loopback is served: the proxy listens on 127.0.0.1 and refuses (``ValueError``) a
target that is not a loopback address, so a test cannot turn it into a relay.

For chaos runs in other processes, ``python -m pytest_asynclock.proxy --target
HOST:PORT [--listen PORT]`` runs one proxy and takes one command per line on stdin
(``latency SECONDS [JITTER]``, ``blackhole``, ``refuse``, ``reset``, ``heal``, ``stats``,
``quit``), answering each with a line on stdout: ``ok`` (``ok {json}`` for ``stats``) or
``error MESSAGE``. Its first line is ``listening 127.0.0.1 PORT``. End of input, ``quit``,
SIGTERM and SIGINT stop it. :class:`ProxyProcess` starts and drives one from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

__all__ = ("FaultProxy", "ProxyProcess", "ProxyStats", "Step", "main")

Mode = Literal["pass", "blackhole", "refuse"]

#: One step of a schedule: ``(at_seconds, action, *args)``; ``at_seconds`` counts from the
#: start of the schedule, ``action`` is a :meth:`FaultProxy.apply` action.
Step = tuple[float, str] | tuple[float, str, float] | tuple[float, str, float, float]

ACTIONS = ("latency", "blackhole", "refuse", "reset", "heal")

_CHUNK = 65536
# Chunks held back per direction (latency) before the reader stops reading: back-pressure.
_QUEUE_CHUNKS = 1024
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def check_loopback(host: str) -> str:
    """``host`` if it names the loopback interface, else ``ValueError``."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str, got {type(host).__name__}")
    if host.lower() in _LOOPBACK_NAMES:
        return host
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(
            f"the fault proxy serves loopback only: target must be 127.0.0.0/8, ::1 or "
            f"localhost, got {host!r}"
        ) from None
    if not address.is_loopback:
        raise ValueError(f"the fault proxy serves loopback only, got {host!r}")
    return host


def _check_delay(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class ProxyStats:
    """Counters of a :class:`FaultProxy` since it started.

    ``bytes_up`` went client -> server, ``bytes_down`` server -> client; ``held_*``
    are bytes a black hole held back until the heal. ``refused`` and ``resets`` count
    connections ended by :meth:`~FaultProxy.refuse` and :meth:`~FaultProxy.reset` (or an
    upstream that could not be reached). ``client_ends`` counts connections whose client
    closed or reset its side, counted when the proxy reads it (bytes it sent before are
    still delivered to the server, at their delay).
    """

    connections: int = 0
    active: int = 0
    refused: int = 0
    resets: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    held_up: int = 0
    held_down: int = 0
    client_ends: int = 0


def _abort(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN, dropping anything unsent."""
    if writer is None:
        return
    transport = writer.transport
    if transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Connection:
    """One proxied client connection and the tasks that serve it."""

    __slots__ = ("client", "task", "upstream")

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    def abort(self) -> None:
        _abort(self.client)
        _abort(self.upstream)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``target_host:target_port`` that injects faults.

    ``listen_port=0`` picks a free port (see :attr:`port`). Start it with :meth:`start`
    or ``async with``; :meth:`stop` closes the listener and aborts every connection and
    task it started. Raises ``ValueError`` for a target that is not a loopback address.
    The module docstring describes the faults.
    """

    def __init__(self, target_host: str, target_port: int, *, listen_port: int = 0) -> None:
        self._target_host = check_loopback(target_host)
        for name, value in (("target_port", target_port), ("listen_port", listen_port)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 < target_port < 65536:
            raise ValueError(f"target_port must be 1..65535, got {target_port}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"listen_port must be 0..65535, got {listen_port}")
        self._target_port = target_port
        self._listen_port = listen_port
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._schedules: set[asyncio.Task[None]] = set()
        self._mode: Mode = "pass"
        # Set whenever the mode is not "blackhole": what held-back work waits for.
        self._open: asyncio.Event | None = None
        self._latency = 0.0
        self._jitter = 0.0
        self._stats: dict[str, int] = dict.fromkeys(
            (f.name for f in dataclasses.fields(ProxyStats) if f.name != "active"), 0
        )
        self.log: list[tuple[float, str, tuple[float, ...]]] = []
        """Every fault applied: ``(time.monotonic(), action, args)``, oldest first."""

    @classmethod
    def from_url(cls, url: str, *, listen_port: int = 0) -> FaultProxy:
        """A proxy to the host and port of a ``redis://`` or ``postgresql://`` URL."""
        parts = urlsplit(url)
        if parts.hostname is None:
            raise ValueError(f"the URL names no host: {_redact(url)!r}")
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        if port is None:
            raise ValueError(f"the URL names no port: {_redact(url)!r}")
        return cls(parts.hostname, port, listen_port=listen_port)

    # -- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Listen on 127.0.0.1. Raises ``RuntimeError`` if already started."""
        if self._server is not None:
            raise RuntimeError("the proxy is already started")
        self._open = asyncio.Event()
        if self._mode != "blackhole":
            self._open.set()
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self._listen_port, reuse_address=True
        )

    async def stop(self) -> None:
        """Stop listening, abort every connection, cancel every task. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks: list[asyncio.Task[Any]] = [*self._schedules]
        for conn in list(self._connections):
            conn.abort()
            if conn.task is not None:
                tasks.append(conn.task)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._schedules.clear()
        self._connections.clear()
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- where it is -----------------------------------------------------------------

    @property
    def host(self) -> str:
        """Where the proxy listens: always ``127.0.0.1``."""
        return "127.0.0.1"

    @property
    def port(self) -> int:
        """The port the proxy listens on (known once started)."""
        if self._server is None:
            if self._listen_port:
                return self._listen_port
            raise RuntimeError("the proxy is not started: its port is not chosen yet")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def target(self) -> tuple[str, int]:
        """``(host, port)`` of the server behind the proxy."""
        return self._target_host, self._target_port

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's (user, password, path
        and query kept): ``redis://:pw@127.0.0.1:6379/0`` -> ``redis://:pw@127.0.0.1:PROXY/0``.
        """
        return _rewrite(url, self.host, self.port)

    # -- faults ----------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        """``"pass"``, ``"blackhole"`` or ``"refuse"``."""
        return self._mode

    @property
    def latency(self) -> tuple[float, float]:
        """``(seconds, jitter)`` added to each chunk."""
        return self._latency, self._jitter

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        return ProxyStats(**self._stats, active=len(self._connections))

    def set_latency(self, seconds: float, jitter: float = 0.0) -> None:
        """Delay every chunk, both ways, by ``seconds`` plus up to ``jitter``, in order."""
        self._latency = _check_delay("seconds", seconds)
        self._jitter = _check_delay("jitter", jitter)
        self._record("latency", self._latency, self._jitter)

    def blackhole(self) -> None:
        """Keep connections open and drop every byte both ways, new connections too."""
        self._set_mode("blackhole")
        self._record("blackhole")

    def refuse(self) -> None:
        """Reset new connections at once; live ones carry on."""
        self._set_mode("refuse")
        self._record("refuse")

    def reset(self) -> None:
        """Abort every live connection with a TCP RST, both sides (the mode stays)."""
        for conn in list(self._connections):
            self._stats["resets"] += 1
            conn.abort()
        self._record("reset")

    def heal(self) -> None:
        """Back to plain pass-through: no latency, no black hole, no refusals."""
        self._latency = self._jitter = 0.0
        self._set_mode("pass")
        self._record("heal")

    def apply(self, action: str, *args: float) -> None:
        """Apply a fault by name: ``apply("latency", 0.2)``, ``apply("blackhole")``.

        Actions: ``latency SECONDS [JITTER]``, ``blackhole``, ``refuse``, ``reset``,
        ``heal``. Raises ``ValueError`` for another action or the wrong arguments.
        """
        if action == "latency":
            if not 1 <= len(args) <= 2:
                raise ValueError(f"latency takes SECONDS [JITTER], got {len(args)} arguments")
            self.set_latency(*args)
            return
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
        if args:
            raise ValueError(f"{action} takes no arguments, got {len(args)}")
        getattr(self, action)()

    def schedule(self, steps: Sequence[Step]) -> asyncio.Task[None]:
        """Apply ``steps`` (``(at_seconds, action, *args)``) on a timeline, in a task.

        Times count from this call; steps run in the order of their times (ties in the
        order given). Await the returned task to wait for the last step; :meth:`stop`
        cancels it. Raises ``ValueError`` at once for a malformed step.
        """
        if self._server is None:
            raise RuntimeError("start the proxy before scheduling faults")
        timeline: list[tuple[float, str, tuple[float, ...]]] = []
        for step in steps:
            if len(step) < 2:
                raise ValueError(f"a step is (at_seconds, action, *args), got {step!r}")
            at, action, *args = step
            _check_delay("at_seconds", at)
            if action not in ACTIONS:
                raise ValueError(f"unknown action {action!r} in step {step!r}")
            timeline.append((float(at), action, tuple(args)))
        timeline.sort(key=lambda item: item[0])
        task = asyncio.create_task(self._run_schedule(timeline), name="asynclock-proxy-schedule")
        self._schedules.add(task)
        task.add_done_callback(self._schedules.discard)
        return task

    async def _run_schedule(self, timeline: list[tuple[float, str, tuple[float, ...]]]) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        for at, action, args in timeline:
            delay = began + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.apply(action, *args)

    def _set_mode(self, mode: Mode) -> None:
        self._mode = mode
        if self._open is not None:
            if mode == "blackhole":
                self._open.clear()
            else:
                self._open.set()

    def _record(self, action: str, *args: float) -> None:
        self.log.append((time.monotonic(), action, args))

    # -- serving ---------------------------------------------------------------------

    def __repr__(self) -> str:
        where = f"127.0.0.1:{self.port}" if self._server is not None else "stopped"
        return (
            f"<FaultProxy {where} -> {self._target_host}:{self._target_port} mode={self._mode}"
            f" latency={self._latency}s connections={len(self._connections)}>"
        )

    def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, not a coroutine: asyncio's streams would wrap a coroutine in a
        # task of their own, and Python 3.11 logs an error when such a task is cancelled.
        self._stats["connections"] += 1
        if self._mode == "refuse" or self._server is None:
            self._stats["refused"] += 1
            _abort(writer)
            return
        conn = _Connection(writer)
        conn.task = asyncio.create_task(self._handle(conn, reader, writer))
        self._connections.add(conn)
        conn.task.add_done_callback(lambda _: self._connections.discard(conn))

    async def _handle(
        self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            await self._relay(conn, reader, writer)
        except Exception:  # noqa: S110 - the connection is what broke; the proxy serves on
            pass
        finally:
            conn.abort()  # a no-op after a polite close

    async def _relay(
        self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        assert self._open is not None
        await self._open.wait()  # black-holed: a new client waits, its bytes unread
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self._target_host, self._target_port
            )
        except OSError:
            self._stats["resets"] += 1
            return  # the server is unreachable: the caller resets the client
        conn.upstream = up_writer
        up = asyncio.create_task(self._pipe(reader, up_writer, "up"))
        down = asyncio.create_task(self._pipe(up_reader, writer, "down"))
        try:
            done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done):
                return  # one side broke: reset both (the caller aborts)
            await asyncio.gather(up, down)
            # Both ends closed their side: close politely.
            writer.close()
            up_writer.close()
        finally:
            for t in (up, down):
                t.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str
    ) -> None:
        """Copy one direction: a feeder task stamps chunks with their due time, this task
        writes them in order. Raises what broke either side."""
        queue: asyncio.Queue[_Item] = asyncio.Queue(_QUEUE_CHUNKS)
        feeder = asyncio.create_task(self._feed(reader, queue, way))
        try:
            await self._drain(queue, writer, way)
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder

    async def _feed(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[_Item], way: str
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(_CHUNK)
                delay = self._latency
                if self._jitter:
                    delay += random.uniform(0.0, self._jitter)  # noqa: S311 - test jitter
                await queue.put((loop.time() + delay, data))
                if not data:
                    if way == "up":
                        self._stats["client_ends"] += 1
                    return  # the end of stream is queued behind the data
        except OSError as exc:  # a reset: the writer side raises it at once
            if way == "up":
                self._stats["client_ends"] += 1
            await queue.put((0.0, exc))

    async def _drain(
        self, queue: asyncio.Queue[_Item], writer: asyncio.StreamWriter, way: str
    ) -> None:
        assert self._open is not None
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            if isinstance(data, BaseException):
                raise data
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._open.is_set():
                # Black-holed: held until the heal, then delivered in order.
                self._stats[f"held_{way}"] += len(data) if data else 0
                await self._open.wait()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            self._stats[f"bytes_{way}"] += len(data)
            await writer.drain()


# A chunk and when to write it; an empty chunk is the end of stream, an error a reset.
_Item = tuple[float, bytes | OSError]


_DEFAULT_PORTS = {
    "redis": 6379,
    "rediss": 6379,
    "postgresql": 5432,
    "postgres": 5432,
}


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _rewrite(url: str, host: str, port: int) -> str:
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    if not parts.netloc or parts.hostname is None:
        raise ValueError(f"expected a URL with a host, like redis://HOST:PORT/0, got {url!r}")
    userinfo, at, _ = parts.netloc.rpartition("@")
    netloc = f"{userinfo}{at}{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


# -- a proxy in a process of its own ----------------------------------------------------


class ProxyProcess:
    """A :class:`FaultProxy` in a child process, driven over its stdin/stdout.

    ``ProxyProcess.start("127.0.0.1", 6379)`` returns once it listens. :meth:`send`
    takes a command line (``"latency 0.2"``, ``"blackhole"``, ``"stats"``…) and returns
    the answer after ``ok`` (raising ``RuntimeError`` on ``error``). :meth:`stop` (also
    on leaving ``with``) ends it: end of input, then SIGTERM, then SIGKILL, by PID.
    Blocking calls (thread-safe): from async code, they hold the loop for one local round
    trip, or run them with ``asyncio.to_thread``.
    """

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self._process = process
        self.port = port
        # One command and its answer at a time, from any thread (asyncio.to_thread).
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, target_host: str, target_port: int, *, listen_port: int = 0, timeout: float = 10.0
    ) -> ProxyProcess:
        """Start ``python -m pytest_asynclock.proxy`` and wait for its port."""
        check_loopback(target_host)
        command = [
            sys.executable,
            "-m",
            "pytest_asynclock.proxy",
            "--target",
            f"{target_host}:{target_port}",
            "--listen",
            str(listen_port),
        ]
        process = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        proxy = cls(process, 0)
        try:
            words = proxy._readline(timeout).split()
        except BaseException:
            proxy.stop()
            raise
        if len(words) != 3 or words[0] != "listening" or not words[2].isdigit():
            proxy.stop()
            raise RuntimeError(f"the proxy process said {' '.join(words)!r}, not 'listening'")
        proxy.port = int(words[2])
        return proxy

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status, ``None`` while it runs."""
        return self._process.poll()

    @property
    def host(self) -> str:
        """Where the proxy listens: always ``127.0.0.1``."""
        return "127.0.0.1"

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        return _rewrite(url, self.host, self.port)

    def send(self, command: str, *, timeout: float = 10.0) -> str:
        """Send one command line; the rest of the ``ok`` answer (``""`` for most)."""
        if "\n" in command:
            raise ValueError("one command per call, without newlines")
        stdin = self._process.stdin
        assert stdin is not None
        with self._lock:
            stdin.write(command + "\n")
            stdin.flush()
            answer = self._readline(timeout)
        status, _, rest = answer.partition(" ")
        if status != "ok":
            raise RuntimeError(f"the proxy process refused {command!r}: {answer}")
        return rest

    def stats(self) -> ProxyStats:
        """The child proxy's counters."""
        return ProxyStats(**json.loads(self.send("stats")))

    def _readline(self, timeout: float) -> str:
        stdout = self._process.stdout
        assert stdout is not None
        # A child that hangs must not hang the test: wait for a line with a deadline.
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"the proxy process said nothing within {timeout} s")
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the proxy process ended (exit status {self._process.poll()})")
        return line.rstrip("\n")

    def stop(self, timeout: float = 5.0) -> None:
        """End the process (end of input, then SIGTERM, then SIGKILL) and reap it."""
        process = self._process
        if process.poll() is None and process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<ProxyProcess pid={self.pid} 127.0.0.1:{self.port}>"


def _answer(proxy: FaultProxy, line: str) -> tuple[str, bool]:
    """The reply to one control line, and whether to go on."""
    words = line.split()
    if not words:
        return "error empty command", True
    action, args = words[0].lower(), words[1:]
    if action in ("quit", "exit"):
        return "ok", False
    if action == "stats":
        return "ok " + json.dumps(dataclasses.asdict(proxy.stats)), True
    try:
        proxy.apply(action, *(float(arg) for arg in args))
    except (TypeError, ValueError) as exc:
        return f"error {exc}", True
    return "ok", True


async def _control(proxy: FaultProxy) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    try:
        while line := (await reader.readline()).decode():
            answer, go_on = _answer(proxy, line)
            print(answer, flush=True)
            if not go_on:
                return
    finally:
        transport.close()


async def _serve_forever(target_host: str, target_port: int, listen_port: int) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    async with FaultProxy(target_host, target_port, listen_port=listen_port) as proxy:
        print(f"listening {proxy.host} {proxy.port}", flush=True)
        control = asyncio.create_task(_control(proxy))
        stop = asyncio.create_task(stopping.wait())
        try:
            await asyncio.wait({control, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (control, stop):
                task.cancel()
            await asyncio.gather(control, stop, return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pytest_asynclock.proxy --target HOST:PORT [--listen PORT]``."""
    parser = argparse.ArgumentParser(
        prog="python -m pytest_asynclock.proxy",
        description="A fault-injecting TCP proxy on 127.0.0.1, driven by commands on stdin.",
    )
    parser.add_argument("--target", required=True, help="HOST:PORT of the server (loopback)")
    parser.add_argument("--listen", type=int, default=0, help="port to listen on (0: any)")
    options = parser.parse_args(argv)
    host, _, port = options.target.rpartition(":")
    try:
        check_loopback(host)
        target_port = int(port)
    except ValueError as exc:
        parser.error(f"--target: {exc}")
    asyncio.run(_serve_forever(host, target_port, options.listen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
