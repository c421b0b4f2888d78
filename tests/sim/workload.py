"""Random workloads per seed, and :func:`run_seed`, which runs one seed to a verdict.

A seed decides everything: the network (latency, spikes, socket timeout, pool size,
resets, partitions, late landings), client pauses, the server's clock drift, the number
of coordinators and workers, and each worker's operations: locks held with ``async with``
(fair or not, with or without a timeout, ``extend()`` with random TTLs while the watchdog
renews), ``acquire()``/``release()``, semaphore permits, read-write locks, and election
terms. Operations are cancelled at random moments, some of them right after one of their
own requests left (so cancels land on suspension points), some twice in a row (the second
cancel landing while the first one's clean-up is on its way), some acquires run under a
short ``asyncio.timeout`` of the caller's (giving up between the first attempt and the
wait, while subscribing or waiting), and a coordinator may be closed while its operations
run, also right after an acquire request of one of them left (``aclose()`` racing a
grant). Protected sections record their steps on virtual time (their start, the end of
each wait, each extend), for the liveness check of bodies stopped on loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

from asynclock import Backoff, Coordinator, Lease
from asynclock._errors import LockError

from .invariants import KNOWN_BUGS, Checker, OpRecord, Violation
from .loop import Deadlock, DriftClock, SimClock, SimLoop, World
from .network import CURRENT_OP, Net, NetConfig, SimBackend
from .redis_world import RedisWorld
from .server import Server

__all__ = ("Result", "run_seed")

_TTLS = (0.3, 1.0, 2.0, 5.0)
# Cancel an operation after the n-th request of this kind that its own task sent.
_CANCEL_AFTER = ("any", "any", "acquire", "sub", "unsub", "publish", "release", "extend")
_NAMES = ("L0", "L1")
_SEM_LIMIT = 2
# An operation with a timeout ends within the timeout plus this many socket timeouts.
_TIMEOUT_CLEANUPS = 2


@dataclass
class Result:
    """The verdict on one seed."""

    seed: int
    ok: bool
    invariant: str = ""
    detail: str = ""
    trace: list[str] = field(default_factory=list)
    digest: str = ""
    virtual: float = 0.0
    steps: int = 0
    requests: int = 0
    ops: int = 0
    strict: bool = False
    kind: str = "memory"

    def report(self) -> str:
        """The failure report: seed, invariant, the last events, the replay command."""
        lines = [
            f"seed {self.seed}: invariant {self.invariant} violated",
            f"  {self.detail}",
            f"  after {self.virtual:.3f}s virtual, {self.steps} loop steps, "
            f"{self.requests} requests, {self.ops} operations",
            "  last events:",
            *(f"    {line}" for line in self.trace),
            f"  replay: {replay_command(self.seed, strict=self.strict, kind=self.kind)}",
        ]
        return "\n".join(lines)


def replay_command(seed: int, *, strict: bool = False, kind: str = "memory") -> str:
    """The one-line command (from the repository root) that replays ``seed`` with its
    full trace (``strict``: known engine bugs reported too; ``kind``: the backend)."""
    flag = " --strict" if strict else ""
    flag += f" --kind {kind}" if kind != "memory" else ""
    return f"PYTHONPATH=. python -m tests.sim.runner --seed {seed} --trace{flag}"


class _Recorder:
    """The trace: the last events for a report, and a digest of all of them."""

    def __init__(self, world: World, keep: int, full: bool) -> None:
        self.world = world
        self.last: deque[tuple[float, str, str]] = deque(maxlen=keep)
        self.full: list[str] | None = [] if full else None
        self.hash = hashlib.blake2b(digest_size=16)

    def __call__(self, kind: str, text: str) -> None:
        entry = (self.world.now, kind, text)
        self.last.append(entry)
        line = f"{entry[0]:.6f} {kind} {text}"
        self.hash.update(line.encode())
        if self.full is not None:
            self.full.append(line)

    def lines(self) -> list[str]:
        return [f"{t:10.6f} {kind:<9} {text}" for t, kind, text in self.last]


class _Sim:
    """One seed's world, clients and workload."""

    def __init__(self, seed: int, *, keep: int, full_trace: bool, kind: str = "memory") -> None:
        self.seed = seed
        rng = self.rng = random.Random(seed)
        # The give-up knobs draw from their own stream: the rest of a seed's plan stays.
        self.giveups = random.Random(seed * 104729 + 3)
        self.world = World()
        self.loop = SimLoop(self.world)
        self.record = _Recorder(self.world, keep, full_trace)
        # -- the seed's environment
        rate = rng.choice((0.0, rng.uniform(-0.0095, 0.0095)))
        self.server = Server(DriftClock(self.world, rate, rng.uniform(0, 1000)))
        latency = rng.choice((0.0002, 0.001, 0.003, 0.01))
        cfg = NetConfig(
            latency=latency,
            spike_p=rng.choice((0.0, 0.01, 0.05)),
            spike=rng.choice((0.05, 0.3)),
            socket_timeout=rng.choice((0.1, 0.3, 1.0)),
            pool=rng.choice((1, 2, 3)),
            apply_on_reset=rng.random(),
            sub_fail_raises=rng.random() < 0.5,
        )
        cfg.late_p = rng.choice((0.0, (1 - cfg.apply_on_reset) * rng.random()))
        self.horizon = rng.uniform(4.0, 14.0)  # when the workload's starts spread out to
        resets = rng.choice((0.0, 0.0, 0.3, 1.5))
        for _ in range(rng.choice((0, 0, 1, 2, 3))):
            start = rng.uniform(0.0, self.horizon)
            cfg.partitions.append((start, start + rng.uniform(0.02, 2.5), rng.choice((-1, 0, 1))))
        self.pauses: list[tuple[float, float]] = []
        for _ in range(rng.choice((0, 0, 1, 2))):
            start, length = rng.uniform(0.0, self.horizon), rng.uniform(0.01, 3.0)
            self.world.pause(start, length)
            self.pauses.append((start, start + length))
        self.cfg = cfg
        #: How much longer than the memory table's an acquire may take to give up (Redlock
        #: retries failed rounds, each step bounded by its node timeout).
        self.slack = 0.0
        # Undone when the run ends (the Redis kinds patch the clients' clock and tokens).
        self.patches = contextlib.ExitStack()
        self.redis: RedisWorld | None = None
        if kind == "memory":
            self.net = Net(
                world=self.world,
                loop=self.loop,
                server=self.server,
                rng=rng,
                config=cfg,
                record=self.record,
            )
        else:
            # The real Redis backends over simulated nodes (tests/sim/redis_world.py),
            # read by the checks through the same interface as the memory table's.
            self.redis = RedisWorld(
                kind,
                rng=rng,
                world=self.world,
                loop=self.loop,
                cfg=cfg,
                record=self.record,
                horizon=self.horizon,
                max_ttl=max(_TTLS),
                seed=seed,
                patches=self.patches,
            )
            self.slack = self.redis.slack()
            self.server = cast(Server, self.redis.view)
            self.net = cast(Net, self.redis.wire)
        t = 0.0
        while resets:
            t += rng.expovariate(resets)
            if t > self.horizon * 1.5:
                break
            self.world.schedule(t, self.net.reset_random)
        # -- clients
        self.coords: dict[int, Coordinator] = {}
        self.backends: dict[int, SimBackend] = {}
        for client in range(rng.choice((1, 2, 2, 3))):
            clock = SimClock(self.loop, rng.uniform(-100.0, 100.0))
            if self.redis is None:
                backend = SimBackend(self.net, client, clock)
            else:
                backend = cast(SimBackend, self.redis.backend(client, clock))
            self.backends[client] = backend
            self.coords[client] = Coordinator(backend, identity=f"c{client}", telemetry=False)
        self.give_back = 1.2 + 2 * cfg.socket_timeout + 2 * cfg.spike + 20 * latency
        self.ops: list[OpRecord] = []
        self.checker = Checker(
            server=self.server,
            net=self.net,
            coords=self.coords,
            backends=self.backends,
            give_back=self.give_back,
            fault_end=self.fault_end,
            record=self.record,
            ops=self.ops,
            pauses=self.pauses,
            partitions=cfg.partitions,
            latency=cfg.latency,
        )
        self.checker.max_ttl = max(_TTLS)
        self.checker.leave = cfg.socket_timeout + 2 * cfg.spike + 20 * latency + 0.05
        self.checker.limits["S"] = _SEM_LIMIT
        if self.redis is not None:
            self.redis.attach(self.checker)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.cancel_at_request: dict[int, tuple[str, int]] = {}
        self.close_at: dict[int, float] = {}  # op id -> lag of aclose() after its acquire
        self.closers: list[asyncio.Future[None]] = []
        self.specs: dict[int, dict[str, Any]] = {}
        self.requests_of: dict[int, int] = {}
        self.max_ttl = max(_TTLS)
        self.main_task: asyncio.Task[None] | None = None

    # -- faults ------------------------------------------------------------------------

    def fault_end(self, client: int) -> float:
        """The end of the last fault (reset, partition, pause) that touched ``client``."""
        now = self.world.now
        end = self.net.last_fault.get(client, -1.0)
        for start, stop, who in self.cfg.partitions:
            if who in (-1, client) and start <= now:
                end = max(end, stop)
        for start, stop in self.pauses:
            if start <= now:
                end = max(end, stop)
        return end

    def paused_within(self, start: float, end: float) -> bool:
        """True if a client pause overlaps ``[start, end]``."""
        return any(s <= end and e >= start for s, e in self.pauses)

    def check_step(self) -> None:
        """After every loop step and world event: the invariant checks (a Redis kind's
        servers first look at the leases that just showed)."""
        if self.redis is not None:
            self.redis.view.sync(self.coords)
        self.checker.step()

    # -- the workload ---------------------------------------------------------------------

    def plan(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """Per worker: its client and its operations."""
        rng = self.rng
        workers = []
        for client in self.coords:
            for _ in range(rng.choice((1, 2, 2, 3))):
                ops = []
                for _ in range(rng.choice((1, 2, 3, 4))):
                    kind = rng.choice(("lock", "lock", "lock", "manual", "sem", "rw", "elect"))
                    ttl = rng.choice(_TTLS)
                    hold = rng.uniform(0.0, 2.0 * ttl) if rng.random() < 0.7 else 0.0
                    ops.append(
                        {
                            "kind": kind,
                            "name": rng.choice(_NAMES),
                            "ttl": ttl,
                            "timeout": rng.choice((None, None, 0.0, 0.2, 1.0, 3.0)),
                            "fair": rng.random() < 0.3,
                            "renew": rng.random() < 0.85,
                            "cancel_on_lost": rng.random() < 0.8,
                            "write": rng.random() < 0.5,
                            "retry": rng.choice((0.05, 0.2, 1.0)),
                            "think": rng.uniform(0.0, 1.0),
                            "hold": hold,
                            "extends": [
                                rng.choice((None, *_TTLS))
                                for _ in range(rng.choice((0, 0, 1, 2, 3)))
                            ],
                            "cancel": rng.random(),
                            "cancel_time": rng.uniform(0.0, 2.0 * hold + 0.3),
                            "cancel_req": rng.choice((1, 1, 1, 2, 2, 3, 5)),
                            "cancel_after": rng.choice(_CANCEL_AFTER),
                            **self.give_up_plan(),
                        }
                    )
                workers.append((client, ops))
        if self.redis is not None:
            self.redis.adapt(workers)
        return workers

    def give_up_plan(self) -> dict[str, Any]:
        """An operation's give-ups beyond a plain cancel: a second cancel (``again``: that
        long after the first), an ``asyncio.timeout`` around its acquire (``outer``),
        closing its coordinator right after its first acquire request left (``close``)."""
        draw = self.giveups
        lag = 6 * self.cfg.latency
        return {
            # 0: the next loop step, as the first cancel's clean-up starts
            "again": draw.choice((0.0, draw.uniform(0.0, lag))) if draw.random() < 0.3 else None,
            "outer": draw.uniform(0.0, 2 * lag + 0.05) if draw.random() < 0.15 else None,
            "close": draw.uniform(0.0, lag) if draw.random() < 0.02 else None,
        }

    async def main(self) -> None:
        """Run the workload, let everything settle, check the end state, close all."""
        self.main_task = asyncio.current_task()
        rng = self.rng
        workers = self.plan()
        runners = []
        for n, (client, ops) in enumerate(workers):
            delay = rng.uniform(0.0, self.horizon * 0.5)
            runners.append(asyncio.create_task(self.worker(n, client, ops, delay)))
        closing = None
        if rng.random() < 0.15:
            closing = asyncio.create_task(
                self.close_later(rng.choice(sorted(self.coords)), rng.uniform(0, self.horizon))
            )
        await asyncio.gather(*runners)
        if closing is not None:
            await closing
        for closer in self.closers:
            await closer
        # Quiet: every fault over, every TTL run out, every give-back done.
        quiet = max([self.fault_end(c) for c in self.coords] + [self.world.now])
        await asyncio.sleep(quiet - self.world.now + self.max_ttl + self.give_back + 0.1)
        self.record("settled", "checking the end state")
        self.check_quiet()
        for coord in self.coords.values():
            await coord.aclose()
        self.check_closed()

    async def close_later(self, client: int, when: float) -> None:
        """Close a coordinator while its operations may be running."""
        await asyncio.sleep(when)
        self.record("aclose", f"c{client} closes mid-run")
        await self.coords[client].aclose()
        self.record("aclose", f"c{client} closed")

    async def worker(self, n: int, client: int, ops: list[dict[str, Any]], delay: float) -> None:
        """Run ``ops`` one after the other, each as a task of its own."""
        await asyncio.sleep(delay)
        for spec in ops:
            await asyncio.sleep(spec["think"])
            op = OpRecord(
                len(self.ops),
                client,
                spec["kind"],
                spec["name"],
                spec["ttl"],
                spec["timeout"],
            )
            op.renew = spec["renew"] or op.kind == "elect"  # an election always renews
            # acquire() leases are tied to no task; an election's term always is.
            op.stops_on_loss = op.kind == "elect" or (
                op.kind != "manual" and spec["cancel_on_lost"]
            )
            op.longest_ttl = max([spec["ttl"]] + [t for t in spec["extends"] if t is not None])
            self.ops.append(op)
            self.specs[op.id] = spec
            if spec["close"] is not None:
                self.close_at[op.id] = spec["close"]
            task = asyncio.create_task(self.run_op(op, spec), name=f"op{op.id}")
            self.tasks[op.id] = task
            roll = spec["cancel"]
            if roll < 0.2:
                self.loop.call_at(
                    self.world.now + spec["cancel_time"], self.cancel, op, spec["again"]
                )
            elif roll < 0.45:
                self.cancel_at_request[op.id] = (spec["cancel_after"], spec["cancel_req"])
            await asyncio.wait([task])
            self.op_done(op, task)

    def cancel(self, op: OpRecord, again: float | None = None) -> None:
        """Cancel an operation's task (from outside it); ``again``: once more that long
        after (while the first cancel's clean-up is on its way)."""
        task = self.tasks[op.id]
        if task.cancel():
            op.cancels += 1
            self.record("cancel", f"op {op.id}")
            if again is not None:
                self.loop.call_at(self.world.now + again, self.cancel, op)

    def on_request(self, op_id: int, kind: str) -> None:
        """A request of operation ``op_id``'s own task left: maybe cancel it soon after
        (within a few one-way delays: while it, or what follows it, is on its way)."""
        if op_id < 0 or (op_id not in self.cancel_at_request and op_id not in self.close_at):
            return
        task = self.tasks.get(op_id)
        if task is None or asyncio.current_task() is not task:
            return
        self.close_at_request(op_id, kind)
        if op_id not in self.cancel_at_request:
            return
        after, nth = self.cancel_at_request[op_id]
        if after not in ("any", kind):
            return
        count = self.requests_of[op_id] = self.requests_of.get(op_id, 0) + 1
        if count == nth:
            del self.cancel_at_request[op_id]
            lag = self.rng.uniform(0.0, 4.0 * latency_of(self.cfg))
            again = self.specs[op_id]["again"]
            self.loop.call_at(self.world.now + lag, self.cancel, self.ops[op_id], again)

    def close_at_request(self, op_id: int, kind: str) -> None:
        """Close the operation's coordinator soon after its first acquire request left:
        ``aclose()`` racing the grant."""
        if kind != "acquire" or op_id not in self.close_at:
            return
        lag = self.close_at.pop(op_id)
        client = self.ops[op_id].client
        if not self.coords[client].closed:
            self.loop.call_at(
                self.world.now + lag,
                lambda: self.closers.append(asyncio.ensure_future(self.close_now(client))),
            )

    async def close_now(self, client: int) -> None:
        self.record("aclose", f"c{client} closes as a grant may land")
        await self.coords[client].aclose()
        self.record("aclose", f"c{client} closed")

    async def run_op(self, op: OpRecord, spec: dict[str, Any]) -> None:
        """One operation, as the user would write it."""
        CURRENT_OP.set(op.id)
        op.started = self.world.now
        coord = self.coords[op.client]
        retry = Backoff(initial=0.01, maximum=spec["retry"])
        common: dict[str, Any] = {
            "ttl": spec["ttl"],
            "timeout": spec["timeout"],
            "renew": spec["renew"],
            "cancel_on_lost": spec["cancel_on_lost"],
            "retry": retry,
        }
        self.record("op", f"{op.id} c{op.client} {op.kind} {op.name} {spec_text(spec)}")
        kind = op.kind
        if kind == "elect":
            op.timeout = None
            election = coord.election(
                "E", ttl=spec["ttl"], identity=f"c{op.client}o{op.id}", retry=retry
            )
            async with election.leadership() as term:
                op.acquire_end = self.world.now
                await self.body(op, spec, term.lease)
            return
        if kind == "sem":
            lock = coord.semaphore("S", _SEM_LIMIT, **common)
        elif kind == "rw":
            rw = coord.rwlock(op.name, **common)
            lock = rw.write() if spec["write"] else rw.read()
        else:
            lock = coord.lock(op.name, fair=spec["fair"], **common)
        outer: contextlib.AbstractAsyncContextManager[Any] = contextlib.nullcontext()
        if spec["outer"] is not None:
            op.outer = True
            outer = asyncio.timeout(spec["outer"])
        if kind == "manual":
            try:
                async with outer:
                    lease = await lock.acquire()
            finally:
                op.acquire_end = self.world.now
            self.check_open(op, coord, lease)
            try:
                await self.body(op, spec, lease)
            finally:
                try:
                    await lease.release()
                except LockError as exc:
                    self.record("release", f"op {op.id}: {type(exc).__name__}")
            return
        try:
            async with outer, lock as lease:
                if isinstance(outer, asyncio.Timeout):
                    outer.reschedule(None)  # it bounds the acquire, not the body
                op.acquire_end = self.world.now
                self.check_open(op, coord, lease)
                await self.body(op, spec, lease)
        finally:
            if op.acquire_end is None:
                op.acquire_end = self.world.now

    def check_open(self, op: OpRecord, coord: Coordinator, lease: Lease) -> None:
        """No lease comes back held from a coordinator that was closed (it would never
        be renewed or released): the acquire must give the grant back and raise."""
        if coord.closed and lease.held:
            self.checker.fail(
                "6-aclose",
                f"op {op.id} got a held lease ({self.backends[op.client].label(lease._claim)}) "
                "from a closed coordinator",
            )

    async def body(self, op: OpRecord, spec: dict[str, Any], lease: Lease) -> None:
        """Hold the lease for a while, extending it now and then; each step of the
        protected section (its start, the end of each wait, each extend) is recorded."""
        value = lease._claim.value
        step = self.checker.body_step
        step(op, value)
        extends = spec["extends"]
        pieces = len(extends) + 1
        for i in range(pieces):
            await asyncio.sleep(spec["hold"] / pieces)
            step(op, value)
            if i < len(extends):
                ttl = extends[i]
                self.record("extend", f"op {op.id} ttl {ttl}")
                await lease.extend(ttl)
                step(op, value)

    def op_done(self, op: OpRecord, task: asyncio.Task[None]) -> None:
        """An operation ended: check how, and schedule its give-back check."""
        op.ended = self.world.now
        claims = [g.value for g in self.server.grants.values() if g.op == op.id]
        op.claims = claims
        if task.cancelled():
            op.outcome = "cancelled"
        else:
            exc = task.exception()
            op.outcome = "ok" if exc is None else type(exc).__name__
            outer = op.outer and isinstance(exc, TimeoutError)  # the caller's own timeout
            if exc is not None and not isinstance(exc, LockError) and not outer:
                self.checker.fail(
                    "4-exception",
                    f"op {op.id} ({op.kind}) raised {exc!r}",
                )
        self.record("end", f"op {op.id} {op.outcome}")
        if op.cancels and op.outcome != "cancelled":
            self.checker.fail(
                "4-cancel",
                f"op {op.id} ({op.kind} {op.name!r}) was cancelled but ended with {op.outcome}",
            )
        if op.timeout is not None and op.acquire_end is not None:
            took = op.acquire_end - op.started
            bound = op.timeout + _TIMEOUT_CLEANUPS * self.cfg.socket_timeout + self.slack + 1e-6
            if took > bound and not self.paused_within(op.started, op.acquire_end):
                self.checker.fail(
                    "5-deadline",
                    f"op {op.id} acquire with timeout {op.timeout:g} took {took:.6f}s "
                    f"(bound {bound:.6f})",
                )
        self.checker.op_ended(op)

    # -- the end ----------------------------------------------------------------------

    def check_quiet(self) -> None:
        """Everything ended long ago: the server is empty, no coordinator holds a lease."""
        left = self.server.held_values()
        if left:
            labels = [self.server.grants[v].label for _, v, _ in left]
            self.checker.fail("3-give-back", f"still held on the server at the end: {labels}")
        for client, coord in self.coords.items():
            if coord.held:
                labels = [self.backends[client].label(lease._claim) for lease in coord.held]
                self.checker.fail("3-held", f"c{client}.held not empty at the end: {labels}")

    def check_closed(self) -> None:
        """After aclose(): no task but this one, nothing in flight, nothing subscribed."""
        others = [t for t in asyncio.all_tasks() if t is not self.main_task and not t.done()]
        if others:
            names = sorted(t.get_name() for t in others)
            self.checker.fail("6-aclose", f"tasks outlive aclose(): {names}")
        for client, coord in self.coords.items():
            if coord._engine.tasks:
                self.checker.fail(
                    "6-aclose", f"c{client} still owns {len(coord._engine.tasks)} tasks"
                )
            backend = self.backends[client]
            if any(conn.pending for conn in [*backend.conns, backend.sub]):
                self.checker.fail("6-aclose", f"c{client} has requests in flight after aclose")
        if self.server.subs or self.server.topics:
            self.checker.fail("6-aclose", "subscriptions outlive aclose()")
        if self.net.late_by > 1e-9:
            self.checker.fail("5-deadline", f"a request ended {self.net.late_by:.6f}s late")


def latency_of(cfg: NetConfig) -> float:
    """The seed's mean one-way delay."""
    return cfg.latency


def spec_text(spec: dict[str, Any]) -> str:
    """An operation's parameters, short."""
    return (
        f"ttl={spec['ttl']:g} timeout={spec['timeout']} hold={spec['hold']:.3f} "
        f"extends={spec['extends']} fair={spec['fair']} renew={spec['renew']}"
    )


#: Liveness checks not run on the Redis kinds yet (see run_seed).
_REDIS_UNCALIBRATED = frozenset({"8-no-loss"})


def run_seed(
    seed: int,
    *,
    keep: int = 50,
    full_trace: bool = False,
    tolerate: frozenset[str] = KNOWN_BUGS,
    kind: str = "memory",
    ignore: frozenset[str] = frozenset(),
) -> Result:
    """Run one seed to its verdict. Deterministic: the same seed gives the same trace.

    ``tolerate``: known engine bugs whose windows are not reported (default: all known,
    so that exploration finds new ones; pass ``frozenset()`` to see them). ``kind``: the
    backend, ``"memory"`` (the simulated table), ``"redis"`` or ``"redlock"`` (the real
    Redis backends over simulated nodes, :mod:`tests.sim.redis_world`). ``ignore``:
    invariants not checked (by name, e.g. ``"8-hand-off"``).
    """
    saved = random.getstate()
    quiet = logging.getLogger("asynclock")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    random.seed(seed * 7919 + 17)  # the engine's backoff jitter draws from ``random``
    gc_was = gc.isenabled()
    gc.disable()
    sim = _Sim(seed, keep=keep, full_trace=full_trace, kind=kind)
    loop = sim.loop
    sim.checker.tolerate = tolerate
    # The Redis kinds' 8-no-loss is not calibrated yet: their wire's plain latency tail
    # and Redlock's per-node timeouts are not in its fault log, and seeds beyond the
    # default range (redis 650, redlock 318) report losses no logged fault explains.
    # Off there until each is read; the memory kind checks it.
    sim.checker.ignore = ignore | (_REDIS_UNCALIBRATED if kind != "memory" else frozenset())
    loop.after_step = sim.check_step
    sim.world.after_event = sim.check_step
    sim.net.on_send = lambda kind: sim.on_request(CURRENT_OP.get(), kind)
    errors: list[str] = []

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, Violation):
            return
        errors.append(f"{context.get('message')}: {exc!r}")

    loop.set_exception_handler(handler)
    result = Result(seed, ok=True, strict=not tolerate, kind=kind)
    try:
        asyncio.set_event_loop(loop)
        try:
            main = loop.create_task(sim.main())
            deadline = sim.horizon * 3 + 120.0
            loop.call_at(deadline, _stop_hung, main, sim)
            loop.run_until_complete(main)
            if errors:
                sim.checker.fail("callback", errors[0])
        except Violation:
            pass
        except Deadlock as exc:
            sim.checker.note("5-hang", f"deadlock: {exc}")
        except asyncio.CancelledError:
            sim.checker.note("5-hang", f"the workload did not finish by {deadline:g}s")
        except Exception as exc:
            sim.checker.note("crash", f"{exc!r}")
        violation = sim.checker.violation
        if violation is not None:
            result.ok = False
            result.invariant = violation.invariant
            result.detail = violation.detail
        result.trace = sim.record.lines() if full_trace is False else list(sim.record.full or [])
        result.digest = sim.record.hash.hexdigest()
        result.virtual = sim.world.now
        result.steps = loop.steps
        result.requests = sim.net.requests_done
        result.ops = len(sim.ops)
        _shutdown(loop, list(sim.coords.values()))
    finally:
        sim.patches.close()
        asyncio.set_event_loop(None)
        random.setstate(saved)
        quiet.setLevel(level)
        if gc_was:
            gc.enable()
    return result


def _stop_hung(main: asyncio.Task[None], sim: _Sim) -> None:
    sim.record("hang", "the workload's time is up")
    main.cancel()


def _shutdown(loop: SimLoop, coords: list[Coordinator]) -> None:
    """Close the coordinators a failed run left open (and their connections), cancel
    whatever else is left, let it unwind, close the loop."""
    loop.after_step = None
    loop.world.after_event = None
    try:
        closing = [loop.create_task(coord.aclose()) for coord in coords if not coord.closed]
        if closing:
            loop.run_until_complete(asyncio.wait(closing, timeout=60.0))
        # Cancelled tasks may start others (a give-back): a few rounds until none is left.
        for _ in range(5):
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if not pending:
                break
            loop.run_until_complete(asyncio.wait(pending, timeout=600.0))
    except Exception:  # noqa: S110 - a broken run's leftovers are not the verdict
        pass
    finally:
        loop.close()
