"""Simulated TCP between the real Redis clients and simulated Redis nodes.

The simulation loop's ``create_connection`` (:meth:`tests.sim.loop.SimLoop.create_connection`)
lands here: asynclock's pipelined connections (:mod:`asynclock.backends.redis.pipe`) and
redis-py's own (the pub/sub connection) get a :class:`SimTransport` whose writes carry
RESP bytes to a node and whose replies come back as RESP bytes to the client's protocol,
each message with the seed's delay, in order per connection (like TCP). A connection's
host names its client and node (``c1.n2``), so that every message is attributed.

Faults, drawn from the seed: delay spikes; partitions of a client or of a node, which hold
messages both ways until they heal; resets of one connection, which the client sees as
``ConnectionResetError`` and the node as a closed connection (commands in flight ran
before the reset, are dropped, or land late after it, at random, as they do when the
client gives a connection up: a socket timeout); and node crashes (every connection
reset, commands in flight lost, connects refused while it is down).

:class:`Wire` also plays the server's side of pub/sub (subscriptions belong to a
connection) and hands every command to an ``execute`` hook (the record of the checks).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any

import hiredis

from .loop import SimLoop, World
from .network import CURRENT_OP, NetConfig
from .redis_node import Error, RedisNode, Status, encode

__all__ = ("Link", "SimTransport", "Wire")

#: (node, client, workload operation, command) -> reply: the node runs the command.
Execute = Callable[[RedisNode, int, int, list[str]], Any]


class SimTransport(asyncio.Transport):
    """The client's end of a simulated connection (an ``asyncio.Transport``)."""

    def __init__(self, wire: Wire, link: Link, loop: SimLoop) -> None:
        super().__init__()
        self._wire = wire
        self._link = link
        self._loop = loop
        self._protocol: asyncio.BaseProtocol | None = None
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return (self._link.host, 6379)
        return default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wire.closed_by_client(self._link)
        if self._protocol is not None:
            self._loop.call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_reading(self) -> bool:
        return not self._closing

    def pause_reading(self) -> None:
        """Nothing to pause: replies are handed over as they arrive."""

    def resume_reading(self) -> None:
        """Nothing to resume."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closing:
            self._wire.send(self._link, bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """The simulated socket never fills up."""

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (0, 0)

    def receive(self, data: bytes) -> None:
        """Bytes from the node arrive."""
        if not self._closing and self._protocol is not None:
            assert isinstance(self._protocol, asyncio.Protocol)
            self._protocol.data_received(data)

    def lost(self, exc: Exception) -> None:
        """The connection was reset under the client."""
        if self._closing:
            return
        self._closing = True
        if self._protocol is not None:
            self._protocol.connection_lost(exc)


class _Chunk:
    """Commands written at once, on their way to the node."""

    __slots__ = ("commands", "fate", "op")

    def __init__(self, commands: list[list[str]], op: int) -> None:
        self.commands = commands
        self.op = op
        self.fate = ""  # after a reset: "late" (runs when it lands), "done" or "drop"


class Link:
    """One connection between a client and a node, both ends."""

    __slots__ = (
        "client",
        "host",
        "id",
        "in_flight",
        "last_down",
        "last_up",
        "node",
        "open",
        "outstanding",
        "parser",
        "subscribed",
        "transport",
    )

    def __init__(self, n: int, client: int, node: int, host: str) -> None:
        self.id = n
        self.client = client
        self.node = node
        self.host = host
        self.open = True
        self.last_up = 0.0
        self.last_down = 0.0
        self.in_flight: dict[int, _Chunk] = {}
        self.outstanding = 0  # writes whose replies the client has not received
        self.parser = hiredis.Reader()
        self.subscribed: dict[str, None] = {}  # channels, in subscription order
        self.transport: SimTransport | None = None

    @property
    def pending(self) -> bool:
        """True while the connection is open (after ``aclose()`` none may be)."""
        return self.open


class Wire:
    """The network between the clients and the nodes, with the seed's faults."""

    def __init__(
        self,
        *,
        world: World,
        loop: SimLoop,
        nodes: list[RedisNode],
        rng: random.Random,
        config: NetConfig,
        node_partitions: list[tuple[float, float, int]],
        record: Callable[[str, str], None],
        classify: Callable[[list[str]], str],
    ) -> None:
        self.world = world
        self.loop = loop
        self.nodes = nodes
        self.rng = rng
        self.cfg = config
        self.node_partitions = node_partitions
        self.record = record
        self.classify = classify
        self.execute: Execute = lambda node, _c, _o, args: node.execute(args)
        #: Told of every command a client writes, (client, operation, command), whether
        #: it ever lands or not.
        self.observe: Callable[[int, int, list[str]], None] = lambda _c, _o, _a: None
        self.links: dict[int, Link] = {}  # open connections
        self._ids = itertools.count()
        self._chunks = itertools.count()
        #: Per client, the end of the last fault that touched it (reset, crash).
        self.last_fault: dict[int, float] = {}
        #: What the liveness checks read (as the memory kind's network keeps it): each
        #: fault as (client, start, end); client -1 for one that touches every client (a
        #: node's partition or crash).
        self.fault_log: list[tuple[int, float, float]] = [
            (-1, start, end) for start, end, _ in node_partitions
        ]
        self._spiked = False
        self.requests_done = 0
        #: Kept for the workload's end checks: the clients enforce their own deadlines.
        self.late_by = 0.0
        #: Called after each command left (the workload's cancels at suspension points).
        self.on_send: Callable[[str], None] | None = None
        for node in nodes:
            node.publish = self._publisher(node.index)
        world.connector = self

    # -- timing ------------------------------------------------------------------------

    def delay(self) -> float:
        """One message's one-way delay."""
        cfg = self.cfg
        d = self.rng.expovariate(1.0 / cfg.latency) if cfg.latency > 0 else 0.0
        if cfg.spike_p and self.rng.random() < cfg.spike_p:
            d += self.rng.uniform(0.0, cfg.spike)
            self._spiked = True
        return d

    def _transit(self, client: int, node: int, sent: float) -> float:
        """When a message sent at ``sent`` arrives, partitions holding it until healed."""
        self._spiked = False
        arrive = sent + self.delay()
        for start, end, who in self.cfg.partitions:
            if who in (-1, client) and start <= arrive and end > sent:
                arrive = max(arrive, end + self.delay())
        for start, end, where in self.node_partitions:
            if where == node and start <= arrive and end > sent:
                arrive = max(arrive, end + self.delay())
        if self._spiked:
            self.fault_log.append((client, sent, arrive))
        return arrive

    # -- connections -------------------------------------------------------------------

    async def connect(
        self, factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        """A connection from client ``cK`` to node ``nI`` (``host`` is ``cK.nI``)."""
        client_part, _, node_part = host.partition(".")
        client, node = int(client_part[1:]), int(node_part[1:])
        target = self.nodes[node]
        answer: asyncio.Future[int | None] = self.loop.create_future()

        def syn() -> None:
            incarnation = target.restarts if target.up else None

            def ack() -> None:
                if not answer.done():
                    answer.set_result(incarnation)

            self.world.deliver(self._transit(client, node, self.world.now), ack)

        self.world.schedule(self._transit(client, node, self.world.now), syn)
        incarnation = await answer
        if incarnation is None:
            raise ConnectionRefusedError(f"connection to {host}:{port} refused (node down)")
        link = Link(next(self._ids), client, node, host)
        link.last_up = link.last_down = self.world.now
        transport = link.transport = SimTransport(self, link, self.loop)
        protocol = factory()
        transport.set_protocol(protocol)
        self.links[link.id] = link
        protocol.connection_made(transport)
        if not target.up or target.restarts != incarnation:
            self.reset(link, "the node restarted while connecting", lost=True)
        return transport, protocol

    def links_of(self, client: int) -> list[Link]:
        """The client's open connections."""
        return [link for link in self.links.values() if link.client == client]

    def closed_by_client(self, link: Link) -> None:
        """The client closed its end: the node forgets the connection (commands already
        on their way still run when they land; their replies go nowhere). Closed with a
        request unanswered (a socket timeout), it is a fault of the client, as a reset is."""
        if link.open:
            if link.outstanding:
                self.record("abort", f"c{link.client} gives up a connection to n{link.node}")
                faults = self.last_fault
                faults[link.client] = max(faults.get(link.client, -1.0), self.world.now)
            link.open = False
            link.subscribed.clear()
            self.links.pop(link.id, None)
            self._settle(link, lost=False)

    # -- requests ------------------------------------------------------------------------

    def send(self, link: Link, data: bytes) -> None:
        """A write of the client: its commands travel to the node."""
        link.parser.feed(data)
        commands: list[list[str]] = []
        while (command := link.parser.gets()) is not False:
            commands.append([part.decode() for part in command])
        if not commands or not link.open:
            return
        chunk = _Chunk(commands, CURRENT_OP.get())
        link.outstanding += 1
        n = next(self._chunks)
        link.in_flight[n] = chunk
        arrive = max(self._transit(link.client, link.node, self.world.now), link.last_up)
        link.last_up = arrive
        self.world.schedule(arrive, lambda: self._arrive(link, n, chunk))
        for command in commands:
            self.observe(link.client, chunk.op, command)
        if self.on_send is not None:
            for command in commands:
                self.on_send(self.classify(command))

    def _arrive(self, link: Link, n: int, chunk: _Chunk) -> None:
        link.in_flight.pop(n, None)
        if chunk.fate in ("drop", "done"):
            return
        node = self.nodes[link.node]
        if not node.up:
            return
        if chunk.fate == "late":
            self.record("late", f"{chunk.commands[0][0]} of c{link.client} lands after a reset")
            self.fault_log.append((link.client, self.world.now, self.world.now))
            self.last_fault[link.client] = max(
                self.last_fault.get(link.client, -1.0), self.world.now
            )
        out = [self._run(link, chunk, command) for command in chunk.commands]
        if not link.open or chunk.fate:
            return
        self._down(link, b"".join(out), replies=len(chunk.commands))

    def _run(self, link: Link, chunk: _Chunk, command: list[str]) -> bytes:
        name = command[0].upper()
        if name in ("SUBSCRIBE", "UNSUBSCRIBE"):
            return self._pubsub(link, name, command[1:])
        if name == "PING" and link.subscribed:
            return encode(["pong", ""])
        reply = self.execute(self.nodes[link.node], link.client, chunk.op, command)
        return encode(reply)

    def _down(self, link: Link, data: bytes, replies: int = 0) -> None:
        back = max(self._transit(link.client, link.node, self.world.now), link.last_down)
        link.last_down = back

        def deliver() -> None:
            if link.open and link.transport is not None:
                if replies:
                    self.requests_done += replies
                    link.outstanding -= 1
                if data:
                    link.transport.receive(data)

        self.world.deliver(back, deliver)

    # -- pub/sub -------------------------------------------------------------------------

    def _pubsub(self, link: Link, name: str, channels: list[str]) -> bytes:
        out = []
        if name == "SUBSCRIBE":
            for channel in channels:
                if link.open:
                    link.subscribed[channel] = None
                out.append(encode(["subscribe", channel, len(link.subscribed)]))
            return b"".join(out)
        named: list[str | None] = [*(channels or link.subscribed)] or [None]
        for name_ in named:
            if name_ is not None:
                link.subscribed.pop(name_, None)
            out.append(encode(["unsubscribe", name_, len(link.subscribed)]))
        return b"".join(out)

    def _publisher(self, node: int) -> Callable[[str, str], int]:
        def publish(channel: str, message: str) -> int:
            told = 0
            for link in list(self.links.values()):
                if link.node == node and channel in link.subscribed:
                    self._down(link, encode(["message", channel, message]))
                    told += 1
            return told

        return publish

    def subscriptions(self) -> dict[str, list[int]]:
        """Channel -> clients subscribed to it, on any node (open connections only)."""
        out: dict[str, list[int]] = {}
        for link in self.links.values():
            for channel in link.subscribed:
                out.setdefault(channel, []).append(link.client)
        return out

    # -- faults --------------------------------------------------------------------------

    def reset(self, link: Link, why: str, *, lost: bool = False) -> None:
        """Reset ``link``: the client sees the connection reset; commands in flight ran
        just before, land late, or are dropped (all dropped when ``lost``)."""
        if not link.open:
            return
        link.open = False
        link.subscribed.clear()
        self.links.pop(link.id, None)
        now = self.world.now
        self.last_fault[link.client] = max(self.last_fault.get(link.client, -1.0), now)
        self.fault_log.append((link.client, now, now))
        self._settle(link, lost=lost)
        self.record("reset", f"c{link.client} conn to n{link.node} ({why})")
        transport = link.transport
        if transport is not None:
            error = ConnectionResetError(f"connection reset ({why})")
            self.world.deliver(now, lambda: transport.lost(error))

    def _settle(self, link: Link, *, lost: bool) -> None:
        """What becomes of commands on their way when their connection ends: they ran
        just before, land late, or are dropped (all dropped when ``lost``)."""
        for chunk in list(link.in_flight.values()):
            r = self.rng.random()
            if lost:
                chunk.fate = "drop"
            elif r < self.cfg.apply_on_reset:
                chunk.fate = "done"  # it ran just before the connection broke
                node = self.nodes[link.node]
                if node.up:
                    for command in chunk.commands:
                        self._run(link, chunk, command)
            elif r < self.cfg.apply_on_reset + self.cfg.late_p:
                chunk.fate = "late"
            else:
                chunk.fate = "drop"

    def reset_random(self) -> None:
        """A fault event: reset one open connection of one client."""
        links = sorted(self.links.values(), key=lambda link: link.id)
        if links:
            link = links[self.rng.randrange(len(links))]
            self.reset(link, "fault")

    def crash(self, node: int, down_for: float) -> None:
        """Node ``node`` dies now and comes back empty ``down_for`` seconds later."""
        target = self.nodes[node]
        if not target.up:
            return
        target.crash()
        self.fault_log.append((-1, self.world.now, self.world.now + down_for))
        self.record("crash", f"n{node} down for {down_for:.3f}s (no persistence)")
        for link in [link for link in self.links.values() if link.node == node]:
            self.reset(link, "node crashed", lost=True)

        def restart() -> None:
            target.restart()
            self.record("restart", f"n{node} back, empty, run_id {target.run_id[:8]}")

        self.world.schedule(self.world.now + down_for, restart)


def reply_text(reply: Any) -> str:
    """A reply, short, for the trace."""
    if isinstance(reply, Status):
        return reply.text
    if isinstance(reply, Error):
        return f"ERR({reply.text.split(' ', 1)[0]})"
    if isinstance(reply, list):
        return "[" + ",".join(reply_text(item) for item in reply) + "]"
    return repr(reply)
