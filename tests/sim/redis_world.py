"""The Redis kinds of the simulation: the real Redis and Redlock backends over simulated
nodes.

``kind="redis"`` is one node, ``kind="redlock"`` three or five. Each client is the real
:class:`~asynclock.backends.RedisBackend` (or :class:`~asynclock.backends.RedlockBackend`)
built from URLs, with its pipelined connections and redis-py's pub/sub connection, so its
script calls, NOSCRIPT reloads, reconnects, Redlock's fan-out, per-node timeouts, quorum
counting and validity are the shipped code; the nodes (:mod:`tests.sim.redis_node`) run
the shipped Lua scripts; the connections between them are :mod:`tests.sim.wire`'s.

What is not the shipped environment, and why: the clients' ``time`` in
:mod:`asynclock.backends.redis.pipe` (the socket-timeout watch) and
:mod:`asynclock.backends.redlock` (the fence floor) reads virtual time, and the random
tokens (``secrets.token_hex``) come from the seed, so that a seed stays a recording.

:class:`RedisView` is the servers' record the invariant checks read (the same interface
as :class:`tests.sim.server.Server`), kept by watching each script run on a node: what
holds before and after it. With several nodes, a lease holds while a majority of nodes
hold its value (a node that crashed counts as holding what it held until that expires:
it stays down longer than any TTL, the restart rule); the server-side checks are then:
every lease a client believes in holds on a majority, its fence is stored on a majority
(fence counters), and fences strictly increase across leases.
"""

from __future__ import annotations

import contextlib
import functools
import random
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from unittest import mock

from asynclock import Coordinator
from asynclock.backends import base as backend_base
from asynclock.backends import redlock
from asynclock.backends.base import Claim, Interrupted
from asynclock.backends.redis import RedisBackend
from asynclock.backends.redis import backend as redis_backend
from asynclock.backends.redis import pipe as _resp
from asynclock.backends.redis import scripts as _scripts
from asynclock.backends.redlock import RedlockBackend

from .invariants import ABANDONED_ROUND
from .loop import DriftClock, SimClock, SimLoop, World
from .network import NetConfig
from .redis_node import RedisNode, _sha1
from .server import Grant
from .wire import Link, Wire, reply_text

if TYPE_CHECKING:
    from .invariants import Checker

__all__ = ("KINDS", "RedisView", "RedisWorld", "SimRedisBackend", "SimRedlockBackend")

#: The backend kinds of this module (``"memory"`` is the simulated table's).
KINDS = ("redis", "redlock")

_PREFIX = "asynclock"
_ACQUIRES = frozenset(("acquire", "acquire_fair", "acquire_shared", "acquire_permit"))
_RELEASES = frozenset(("release", "release_shared", "release_permit"))
_EXTENDS = frozenset(("extend", "extend_shared", "extend_permit", "extend_many"))
# Where the servers' clocks read when virtual time starts (seconds since the epoch).
_EPOCH = 1_767_000_000.0

#: (kind, holder value) -> (expiry in virtual time, fence)
Holders = dict[tuple[str, str], tuple[float, int]]


def script_names() -> dict[str, str]:
    """SHA1 -> name of every script of the imported package (a mutant's, in a mutant run)."""
    names = {}
    for value in vars(_scripts).values():
        if isinstance(value, _scripts.Script):
            names[value.sha] = value.name
            sharded = _scripts.sharded(value)
            names[sharded.sha] = value.name
    return names


def _name_of(key: str) -> str | None:
    """The lock name in a key ``prefix:{name}...``."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start else None


class _Probe:
    """What the checks read of a client backend: labels of claims, releases in flight.

    Mixed into the real backends (the engine's calls all run the backend's own code;
    ``release`` only notes when it starts and ends).
    """

    sim_client = 0
    sim_clock: SimClock
    sim_wire: Wire
    labels: dict[str, str]
    releasing: dict[str, int]
    first_release: dict[str, float]

    def probe(self, client: int, clock: SimClock, wire: Wire) -> None:
        """Attach this backend to the simulation as client ``client``."""
        self.sim_client = client
        self.sim_clock = clock
        self.sim_wire = wire
        self.labels = {}
        self.releasing = {}
        self.first_release = {}

    def label_value(self, value: str) -> str:
        """A short deterministic name for a holder value."""
        label = self.labels.get(value)
        if label is None:
            label = self.labels[value] = f"c{self.sim_client}.{len(self.labels)}"
        return label

    def label(self, claim: Claim) -> str:
        """A short deterministic name for a claim's current value."""
        return self.label_value(claim.value)

    def extend_in_window(self, value: str) -> bool:
        """Not tracked for these backends (no known bug needs it)."""
        return False

    @property
    def conns(self) -> list[Link]:
        """The client's open connections (none may be left after ``aclose()``)."""
        return self.sim_wire.links_of(self.sim_client)

    @property
    def sub(self) -> Link:
        """An empty stand-in: the pub/sub connection is among :attr:`conns`."""
        link = Link(-1, self.sim_client, -1, "")
        link.open = False
        return link

    @contextlib.contextmanager
    def _releasing(self, value: str, now: float) -> Any:
        self.first_release.setdefault(value, now)
        self.releasing[value] = self.releasing.get(value, 0) + 1
        try:
            yield
        finally:
            left = self.releasing[value] - 1
            if left:
                self.releasing[value] = left
            else:
                del self.releasing[value]


class SimRedisBackend(_Probe, RedisBackend):
    """The real one-node backend, watched by the checks."""

    async def release(self, claim: Claim) -> bool:
        with self._releasing(claim.value, self.clock.now()):
            return await super().release(claim)


class SimRedlockBackend(_Probe, RedlockBackend):
    """The real Redlock backend, watched by the checks."""

    def late_landing(self, interrupted: Interrupted) -> float:
        """Its nodes' longest (what its give-back answers)."""
        return max(node.late_landing(interrupted) for node in self.nodes)

    async def release(self, claim: Claim) -> bool:
        with self._releasing(claim.value, self.clock.now()):
            return await super().release(claim)


@dataclass(slots=True)
class _ScriptRun:
    """One script run on a node: who sent it, what it names, what held around it."""

    node: RedisNode
    client: int
    op: int
    script: str
    argv: Sequence[str]
    own: Sequence[str]  # the holder values it acts for
    names: list[str]
    before: dict[str, Holders] = field(default_factory=dict)
    after: dict[str, Holders] = field(default_factory=dict)
    reply: Any = None


class RedisView:
    """The nodes' record for the invariant checks (the interface of ``Server``)."""

    def __init__(self, world: World, nodes: list[RedisNode], record: Callable[[str, str], None]):
        self.world = world
        self.nodes = nodes
        self.record = record
        self.quorum = len(nodes) // 2 + 1
        self.scripts = script_names()
        self.grants: dict[str, Grant] = {}
        self.released: dict[str, float] = {}
        self.attempted: dict[int, set[tuple[str, str]]] = {}
        self.top_fence: dict[tuple[str, str], int] = {}
        self.on_grant: Callable[[Grant], None] = lambda _g: None
        self.on_stale: Callable[[str, str], None] = lambda _op, _v: None
        #: Fails the run (the checker's ``fail``), for the checks made here.
        self.fail: Callable[[str, str], None] = lambda _i, _d: None
        self.label: Callable[[int, str], str] = lambda client, _v: f"c{client}.?"
        self.names: dict[str, None] = {}  # lock names seen, in order
        # Per node incarnation, values whose release ran while they held (a release run
        # again answers 1: not stale).
        self._released_ok: dict[tuple[int, str], set[str]] = {}
        # What a crashed node held, until it is back: (kind, name, value) -> expiry.
        self._ghosts: dict[int, dict[tuple[str, str, str], float]] = {}
        self._ghost_fences: dict[int, dict[str, int]] = {}
        self._sighted: set[str] = set()
        self.wire: Wire | None = None
        self.checker: Checker | None = None
        # The values each workload operation's acquires sent, in order (Redlock rounds).
        self._rounds: dict[int, list[str]] = {}
        self._round_of: dict[str, int] = {}
        # (node, name) -> ((node's version, its ms), holders): the checks read every step.
        self._cache: dict[tuple[int, str], tuple[tuple[int, int], Holders]] = {}

    # -- what a node holds ------------------------------------------------------------

    def _holders(self, node: RedisNode, name: str) -> Holders:
        """Unexpired holders of ``name`` on ``node`` (locks, readers, permits)."""
        stamp = (node.version, node.mstime())
        cached = self._cache.get((node.index, name))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        out = self._read_holders(node, name)
        self._cache[(node.index, name)] = (stamp, out)
        return out

    def _read_holders(self, node: RedisNode, name: str) -> Holders:
        out: Holders = {}
        base = f"{_PREFIX}:{{{name}}}"
        value = node.peek_str(base)
        now = node.mstime()
        if value is not None:
            lock_end = node.expired_at(base)
            if value == _scripts.READERS:
                grants = node.peek_hash(base + ":readers:grants")
                for reader, score in node.peek_zset(base + ":readers").items():
                    if score > now:
                        end = node.real_ms(score)
                        if lock_end is not None:
                            end = min(end, lock_end)
                        out[("lock", reader)] = (end, int(grants.get(reader) or 0))
            else:
                fence = int(node.peek_str(base + ":fence") or 0)
                out[("lock", value)] = (lock_end if lock_end is not None else 1e300, fence)
        grants = node.peek_hash(base + ":permits:grants")
        for holder, score in node.peek_zset(base + ":permits").items():
            if score > now:
                out[("permit", holder)] = (node.real_ms(score), int(grants.get(holder) or 0))
        return out

    def _holding(self, kind: str, name: str, value: str) -> list[float]:
        """Expiries (virtual time) of ``value`` on every node that holds it, a crashed
        node's until its hold would have ended."""
        now = self.world.now
        out = []
        for node in self.nodes:
            if node.up:
                held = self._holders(node, name).get((kind, value))
                if held is not None:
                    out.append(held[0])
            else:
                ghost = self._ghosts.get(node.index, {}).get((kind, name, value))
                if ghost is not None and ghost > now:
                    out.append(ghost)
        return out

    def _counters(self, name: str) -> list[int]:
        """The fence counter of ``name`` on every node (a crashed one's as it was)."""
        out = []
        for node in self.nodes:
            if node.up:
                out.append(int(node.peek_str(f"{_PREFIX}:{{{name}}}:fence") or 0))
            else:
                out.append(self._ghost_fences.get(node.index, {}).get(name, 0))
        return out

    # -- the interface the checks read ---------------------------------------------------

    def expiry(self, claim: Claim) -> float | None:
        """When ``claim`` stops holding (a majority of nodes), None if it does not."""
        kind = "permit" if claim.limit else "lock"
        ends = sorted(self._holding(kind, claim.name, claim.value), reverse=True)
        return ends[self.quorum - 1] if len(ends) >= self.quorum else None

    def held_values(self) -> list[tuple[str, str, float]]:
        """Every unexpired holder, on a majority of the live nodes: (name, value, when
        that majority ends). A minority a release did not reach (a node that failed or
        answered after the fan-out decided) is left to its TTL: Redlock decides at the
        first majority by design."""
        ends: dict[tuple[str, str], list[float]] = {}
        for node in self.nodes:
            if not node.up:
                continue
            for name in self.names:
                for (_, value), (end, _) in self._holders(node, name).items():
                    ends.setdefault((name, value), []).append(end)
        q = self.quorum
        return [
            (name, value, sorted(found, reverse=True)[q - 1])
            for (name, value), found in ends.items()
            if len(found) >= q and not self._abandoned(value)
        ]

    def _abandoned(self, value: str) -> bool:
        """A Redlock round's value that a later round of the same acquire replaced,
        left to its TTL while :data:`~tests.sim.invariants.ABANDONED_ROUND` is tolerated."""
        if self.checker is None or ABANDONED_ROUND not in self.checker.tolerate:
            return False
        rounds = self._rounds.get(self._round_of.get(value, -1), [])
        return bool(rounds) and rounds[-1] != value

    def queued(self, name: str, value: str) -> float | None:
        """When ``value``'s live place in a waiter queue of ``name`` lapses (one node)."""
        if len(self.nodes) != 1 or not self.nodes[0].up:
            return None
        node = self.nodes[0]
        base = f"{_PREFIX}:{{{name}}}"
        now = node.mstime()
        until = None
        for queue in ("", ":readers", ":permits"):
            if value not in node.peek_zset(f"{base}{queue}:queue"):
                continue
            text = node.peek_hash(f"{base}{queue}:due").get(value, "")
            ms = int(text.split(":", 1)[0]) if text[:1].isdigit() else 0
            if ms > now:
                end = node.real_ms(ms)
                until = end if until is None else max(until, end)
        return until

    @property
    def subs(self) -> dict[str, list[int]]:
        """Subscriptions of open connections (none may outlive ``aclose()``)."""
        return {} if self.wire is None else self.wire.subscriptions()

    @property
    def topics(self) -> dict[str, list[int]]:
        """Topics are channels too, counted in :attr:`subs`."""
        return {}

    # -- watching the nodes ---------------------------------------------------------------

    def observe(self, client: int, op: int, args: list[str]) -> None:
        """A client wrote a command: note the values an operation's acquires and releases
        name, in order (a Redlock acquire's rounds), whether they land or not."""
        if op < 0 or len(args) < 3 or args[0].upper() != "EVALSHA":
            return
        script = self.scripts.get(args[1].lower(), "")
        if script not in _ACQUIRES and script not in _RELEASES:
            return
        try:
            value = args[3 + int(args[2])]
        except (IndexError, ValueError):
            return
        if value not in self._round_of:
            self._round_of[value] = op
            self._rounds.setdefault(op, []).append(value)

    def execute(self, node: RedisNode, client: int, op: int, args: list[str]) -> Any:
        """Run a command on ``node`` for ``client``, noting what a script changed."""
        command = args[0].upper()
        if command not in ("EVALSHA", "EVAL") or len(args) < 3:
            reply = node.execute(args)
            if command in ("SCRIPT", "INFO"):
                self.record("server", f"n{node.index} {command} c{client} -> {reply_text(reply)}")
            return reply
        sha = args[1].lower() if command == "EVALSHA" else _sha1(args[1])
        script = self.scripts.get(sha, sha[:8])
        try:
            numkeys = int(args[2])
        except ValueError:
            return node.execute(args)
        keys, argv = args[3 : 3 + numkeys], args[3 + numkeys :]
        names = list(dict.fromkeys(n for key in keys if (n := _name_of(key)) is not None))
        for name in names:
            self.names.setdefault(name, None)
        own = argv[0::3] if script == "extend_many" else argv[:1]
        run = _ScriptRun(node, client, op, script, argv, own, names)
        run.before = {name: self._holders(node, name) for name in names}
        reply = run.reply = node.execute(args)
        run.after = {name: self._holders(node, name) for name in names}
        shown = " ".join(self.label(client, value) for value in own)
        self.record("server", f"n{node.index} {script} {shown} -> {reply_text(reply)}")
        if script in _ACQUIRES and own:
            for name in names:
                self.attempted.setdefault(op, set()).add((name, own[0]))
        if script in _RELEASES and own:
            self.released.setdefault(own[0], self.world.now)
        self._check_stale(run)
        for name in names:
            for (kind, value), (_, fence) in run.after[name].items():
                if (kind, value) not in run.before[name]:
                    self._held(run, kind, name, value, fence)
        return reply

    def _check_stale(self, run: _ScriptRun) -> None:
        """A release or extend succeeds only for a holder, and never ends another's hold."""
        held_before = {value for holders in run.before.values() for _, value in holders}
        for name in run.names:
            for kind, value in run.before[name]:
                if (kind, value) not in run.after[name] and value not in run.own:
                    by = " ".join(self.label(run.client, v) for v in run.own) or "?"
                    self.on_stale(f"{run.script} (sent by {by}) ending the hold", value)
        if run.script not in _RELEASES and run.script not in _EXTENDS:
            return
        node = run.node
        done = self._released_ok.setdefault((node.index, node.run_id), set())
        replies = run.reply if isinstance(run.reply, list) else [run.reply]
        for value, answer in zip(run.own, replies, strict=False):
            if answer != 1:
                continue
            if value in held_before:
                if run.script in _RELEASES:
                    done.add(value)
            elif not (run.script in _RELEASES and value in done):
                self.on_stale(run.script, value)

    def _held(self, run: _ScriptRun, kind: str, name: str, value: str, fence: int) -> None:
        """``value`` now holds ``name`` on a node: a grant once a majority holds it."""
        if len(self._holding(kind, name, value)) != self.quorum:
            return
        try:
            ttl = int(run.argv[1]) / 1000
        except (IndexError, ValueError):
            ttl = 0.0
        grant = Grant(
            value,
            name,
            kind,
            fence,
            self.world.now,
            run.client,
            run.op,
            self.label(run.client, value),
            ttl,
            orphan=value in self.released,
        )
        self.grants[value] = grant
        if self.quorum == 1:
            self.on_grant(grant)
        else:
            # Redlock: the lease's fence is the one its client settles on (the largest
            # its majority answered, written back): checked when the lease shows.
            grant.fence = max(self._counters(name))

    def node_down(self, index: int) -> None:
        """Node ``index`` crashes now: keep what it held (see the module's docstring)."""
        node = self.nodes[index]
        ghosts: dict[tuple[str, str, str], float] = {}
        fences: dict[str, int] = {}
        for name in self.names:
            for (kind, value), (end, _) in self._holders(node, name).items():
                ghosts[(kind, name, value)] = end
            fences[name] = int(node.peek_str(f"{_PREFIX}:{{{name}}}:fence") or 0)
        self._ghosts[index] = ghosts
        self._ghost_fences[index] = fences

    def sync(self, coords: dict[int, Coordinator]) -> None:
        """Redlock: check each lease when it first shows (before the invariant checks)."""
        if self.quorum == 1:
            return
        for client, coord in coords.items():
            for lease in coord.held:
                value = lease._claim.value
                if value in self._sighted:
                    continue
                self._sighted.add(value)
                self._sight(client, lease.name, value, lease.fence, lease.held)

    def _sight(self, client: int, name: str, value: str, fence: int, held: bool) -> None:
        label = self.label(client, value)
        grant = self.grants.get(value)
        if grant is None:
            if held:
                holding = len(self._holding("lock", name, value))
                self.fail(
                    "1-validity",
                    f"lease {label} on {name!r} was granted, but only {holding} of "
                    f"{len(self.nodes)} nodes hold it (a majority is {self.quorum})",
                )
            return
        stored = sum(counter >= fence for counter in self._counters(name))
        if stored < self.quorum and held:
            self.fail(
                "2-fence",
                f"lease {label} on {name!r} has fence {fence}, stored on {stored} of "
                f"{len(self.nodes)} nodes (a majority is {self.quorum})",
            )
        grant.fence = fence
        self.on_grant(grant)


class _Ticks:
    """Virtual time for ``time.monotonic()``, moving on by a nanosecond per read when
    virtual time stands still, as a real clock does: a timer that fires a rounding error
    before the deadline it was armed for, and checks that deadline, must find it passed
    (else it re-arms itself at the same virtual moment, for ever)."""

    __slots__ = ("_last", "_world")

    def __init__(self, world: World) -> None:
        self._world = world
        self._last = -1.0

    def monotonic(self) -> float:
        self._last = max(self._world.now, self._last + 1e-9)
        return self._last


class RedisWorld:
    """The nodes, the wire, the view and the clients of one seed of a Redis kind."""

    def __init__(
        self,
        kind: str,
        *,
        rng: random.Random,
        world: World,
        loop: SimLoop,
        cfg: NetConfig,
        record: Callable[[str, str], None],
        horizon: float,
        max_ttl: float,
        seed: int,
        patches: contextlib.ExitStack,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown simulated backend kind {kind!r}")
        self.kind = kind
        self.rng = rng
        self.world = world
        self.cfg = cfg
        self._patch(patches, seed)
        count = 1 if kind == "redis" else rng.choice((3, 3, 5))
        self.node_timeout = rng.choice((0.05, 0.05, 0.1))
        run_ids = random.Random(seed * 7 + 1)
        nodes = []
        for index in range(count):
            rate = rng.choice((0.0, rng.uniform(-0.0095, 0.0095)))
            clock = DriftClock(world, rate, _EPOCH + rng.uniform(-5.0, 5.0))
            nodes.append(RedisNode(index, clock, lambda: f"{run_ids.getrandbits(160):040x}"))
        self.nodes = nodes
        node_partitions = []
        for _ in range(rng.choice((0, 0, 1, 2))):
            start = rng.uniform(0.0, horizon)
            node_partitions.append((start, start + rng.uniform(0.05, 3.0), rng.randrange(count)))
        self.view = RedisView(world, nodes, record)
        self.wire = Wire(
            world=world,
            loop=loop,
            nodes=nodes,
            rng=rng,
            config=cfg,
            node_partitions=node_partitions,
            record=record,
            classify=self._classify,
        )
        self.view.wire = self.wire
        self.wire.execute = self.view.execute
        self.wire.observe = self.view.observe
        self.clients: list[int] = []
        for start, end, node in node_partitions:
            record("plan", f"n{node} partitioned {start:.3f}..{end:.3f}")
            # A fault of every client while it lasts (as a partition of the client is).
            world.schedule(start, functools.partial(self._touch_all, end))
        if count > 1:
            # Restarts without persistence, each node kept out longer than any TTL (the
            # restart rule) with its clock's drift.
            for _ in range(rng.choice((0, 0, 1, 2))):
                at, index = rng.uniform(0.0, horizon), rng.randrange(count)
                down = max_ttl * 1.02 + rng.uniform(0.05, 1.0)
                world.schedule(at, functools.partial(self._crash, index, down))
        self.backends: dict[int, SimRedisBackend | SimRedlockBackend] = {}

    def _patch(self, patches: contextlib.ExitStack, seed: int) -> None:
        """Virtual time for the clients' own clock reads, tokens from the seed."""
        world = self.world
        tokens = random.Random(seed * 104723 + 11)
        ticks = _Ticks(world)
        clock = types.SimpleNamespace(
            monotonic=ticks.monotonic,
            perf_counter=ticks.monotonic,
            time=lambda: _EPOCH + world.now,
            time_ns=lambda: int((_EPOCH + world.now) * 1e9),
        )
        entropy = types.SimpleNamespace(
            token_hex=lambda n=32: f"{tokens.getrandbits(n * 8):0{2 * n}x}"
        )
        patches.enter_context(mock.patch.object(_resp, "time", clock))
        patches.enter_context(mock.patch.object(redlock, "time", clock))
        for module in (backend_base, redis_backend):
            patches.enter_context(mock.patch.object(module, "secrets", entropy))
        from asynclock import _lock  # noqa: PLC0415 - the engine module whose tokens these are

        patches.enter_context(mock.patch.object(_lock, "secrets", entropy))

    def slack(self) -> float:
        """How much longer an acquire may take to give up than one request and its
        clean-up: Redlock's check of the nodes, then rounds of acquire, fence write-back
        and give-back (each a fan-out bounded by the node timeout, and once more for a
        node that must load the script first) with a pause between rounds."""
        if self.kind != "redlock":
            return 0.0
        return (1 + redlock._QUORUM_ROUNDS * 7) * self.node_timeout

    def _touch_all(self, until: float) -> None:
        faults = self.wire.last_fault
        for client in self.clients:
            faults[client] = max(faults.get(client, -1.0), until)

    def _crash(self, index: int, down: float) -> None:
        self.view.node_down(index)
        self.wire.crash(index, down)
        self._touch_all(self.world.now + down)

    def _classify(self, command: list[str]) -> str:
        """A command as the workload's cancel points name requests."""
        name = command[0].upper()
        if name in ("EVALSHA", "EVAL") and len(command) > 1:
            sha = command[1].lower() if name == "EVALSHA" else _sha1(command[1])
            script = self.view.scripts.get(sha, "")
            for family, kind in ((_ACQUIRES, "acquire"), (_RELEASES, "release")):
                if script in family:
                    return kind
            return "extend" if script in _EXTENDS else script
        return {"SUBSCRIBE": "sub", "UNSUBSCRIBE": "unsub", "PUBLISH": "publish"}.get(
            name, name.lower()
        )

    def backend(self, client: int, clock: SimClock) -> SimRedisBackend | SimRedlockBackend:
        """The real backend of client ``client``, connected to the nodes by URL."""
        options: dict[str, Any] = {
            "clock": clock,
            "socket_timeout": self.cfg.socket_timeout,
            "socket_connect_timeout": self.cfg.socket_timeout,
        }
        urls = [f"redis://c{client}.n{node.index}:6379/0" for node in self.nodes]
        backend: RedisBackend | RedlockBackend
        if self.kind == "redis":
            backend = SimRedisBackend.from_url(urls[0], **options)
        else:
            backend = SimRedlockBackend.from_urls(urls, node_timeout=self.node_timeout, **options)
        assert isinstance(backend, SimRedisBackend | SimRedlockBackend)
        backend.probe(client, clock, self.wire)
        self.backends[client] = backend
        self.clients.append(client)
        self.view.label = lambda c, value: self.backends[c].label_value(value)
        return backend

    def attach(self, checker: Checker) -> None:
        """Let the view fail the run with the checker's verdicts."""
        self.view.fail = checker.fail
        self.view.checker = checker

    def adapt(self, workers: list[tuple[int, list[dict[str, Any]]]]) -> None:
        """Redlock has plain locks and elections only: other kinds become plain locks."""
        if self.kind != "redlock":
            return
        for _, ops in workers:
            for spec in ops:
                if spec["kind"] in ("sem", "rw"):
                    spec["kind"] = "lock"
                spec["fair"] = False
