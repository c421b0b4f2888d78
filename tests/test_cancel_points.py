"""Cancellation at every suspension point of every public operation, on real servers.

For each operation (acquire, ``async with`` enter and exit, lease release and extend,
election leadership and ``run()``, semaphores, read-write locks, fair locks), contended
or not, on each backend, the caller is cancelled at its 1st, 2nd, ..., k-th suspension
(:class:`tests._cancel_points.Stepper`: the cancel lands on exactly the future the task
is about to wait on, independent of timing), k growing until the operation completes
without reaching a k-th suspension. After each run:

- the task ended cancelled (no BackendError, LockLost, ... in its place, and no cancel
  swallowed into a normal return);
- within a short give-back (:data:`GIVE_BACK`) nothing it took is held on the server
  (``inspect``, another coordinator's try-once on every side of the name, and for
  PostgreSQL ``pg_locks``), and ``coord.held`` is empty (an interrupted ``extend()``
  keeps exactly its lease, whose local validity must not outlast the server's);
- the same coordinator takes the same name again promptly, and ``aclose()`` leaves no
  task behind.

Each point runs on a fresh coordinator, warmed up (pool connection, scripts, pub/sub
connection) so that every run starts from the same state and the points are those of the
steady state; ``lock.acquire(cold)`` keeps the connection set-up in the count. The points
per operation and backend are printed in the terminal summary ("cancellation points").

Past defects covered explicitly: a campaign cancelled while announcing "elected" or
"resigned" (a renewed lease leaked), a Redis/Redlock waiter cancelled in its exit
(unsubscribe fan-out) after the grant (the grant kept until its TTL), and a release that
fails (server down) while a cancel is in flight (the BackendError replaced the cancel);
found by these tests: a cancel swallowed by redis-py's ``wait_for`` on Python 3.11
(Sentinel, Cluster), and a waiter cancelled before its wait that kept its queue place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import asyncpg
import pytest
from pytest_asynclock import ClusterSetup, SentinelSetup
from pytest_asynclock.proxy import FaultProxy

import asynclock
from asynclock import BackendError, Backoff, Coordinator, Lease, LockTimeout
from asynclock._lock import Lock
from asynclock.backends import Kind, PostgresBackend
from asynclock.integrations._common import hold

from ._cancel_points import Stepper, TaskOwners, instrument, owner, phase
from .conftest import MakeCoord

TTL = 30.0
ELECTION_TTL = 10.0
# No jitter, one step: a waiter parks once and is woken by the release (deterministic).
# Its maximum is also how long a queued place outlives a waiter that could not leave.
RETRY = Backoff(initial=0.5, maximum=0.5, jitter=False)
# How long what a cancelled operation took may stay held (a background give-back).
GIVE_BACK = 2.0
OP_LIMIT = 15.0
MAX_POINTS = 200
REDLOCK_NODE_TIMEOUT = 0.25  # the default 50 ms is tight for 5 nodes on 2 busy cores
FRESH = "fresh"  # the owner of the coordinator under test's tasks
SWALLOWED = "the cancel was swallowed"
# Backends whose path varies from run to run (how often the caller wakes in a Redlock
# fan-out or in redis-py's cluster/sentinel connection handling): a sweep ends only after
# this many runs in a row completed without reaching their k-th point.
VARYING_PATHS = {"redlock": 4, "sentinel": 3, "cluster": 3}


# -- operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One public operation: on which kind of lock, which call, with a holder or not."""

    name: str
    kind: str  # lock | fair | semaphore | read | write | election
    action: str  # acquire | with | hold | release | extend | leadership | run | observe
    contended: bool = False
    warm: bool = True
    retry: Backoff = RETRY

    @property
    def needs(self) -> Kind | None:
        return {
            "fair": Kind.FAIR,
            "semaphore": Kind.PERMIT,
            "read": Kind.SHARED,
            "write": Kind.SHARED,
        }.get(self.kind)


OPS = (
    Op("lock.acquire", "lock", "acquire"),
    Op("lock.acquire(cold)", "lock", "acquire", warm=False),
    Op("lock.acquire(wait)", "lock", "acquire", contended=True),
    Op("lock.async_with", "lock", "with"),
    Op("lock.async_with(wait)", "lock", "with", contended=True),
    Op("lease.release", "lock", "release"),
    Op("lease.extend", "lock", "extend"),
    Op("election.leadership", "election", "leadership"),
    Op("election.leadership(wait)", "election", "leadership", contended=True),
    Op("election.run", "election", "run"),
    Op("election.observe", "election", "observe"),
    Op("integration.lock", "lock", "hold"),  # the web integrations' lock dependency
    Op("semaphore.async_with", "semaphore", "with"),
    Op("semaphore.acquire(wait)", "semaphore", "acquire", contended=True),
    Op("rwlock.read.async_with", "read", "with"),
    Op("rwlock.write.async_with", "write", "with"),
    Op("rwlock.read.acquire(wait)", "read", "acquire", contended=True),
    Op("rwlock.write.acquire(wait)", "write", "acquire", contended=True),
    Op("fair.async_with", "fair", "with"),
    Op("fair.acquire(wait)", "fair", "acquire", contended=True),
)
OP_BY_NAME = {op.name: op for op in OPS}
# On Sentinel and Cluster (a topology per test, and redis-py's connections make each run
# slower): the lock, lease and election operations, contended once. The semaphore,
# read-write and fair variants run the same scripts as on one Redis node.
TOPOLOGY_OPS = tuple(
    op
    for op in OPS
    if op.name
    in (
        "lock.acquire",
        "lock.acquire(cold)",
        "lock.acquire(wait)",
        "lock.async_with",
        "lease.release",
        "lease.extend",
        "election.leadership",
        "election.run",
    )
)


class _Done(Exception):
    """Ends ``election.run()`` from its callback (run() only ends by an exception)."""


def lock_of(
    coord: Coordinator,
    kind: str,
    name: str,
    *,
    timeout: float | None = None,
    retry: Backoff = RETRY,
) -> Lock:
    common: dict[str, Any] = {"ttl": TTL, "timeout": timeout, "retry": retry}
    if kind == "lock":
        return coord.lock(name, **common)
    if kind == "fair":
        return coord.lock(name, fair=True, **common)
    if kind == "semaphore":
        return coord.semaphore(name, 1, **common)
    rw = coord.rwlock(name, **common)
    return rw.read() if kind == "read" else rw.write()


def election_of(coord: Coordinator, name: str) -> asynclock.Election:
    return coord.election(name, ttl=ELECTION_TTL, retry=RETRY, identity="cancel-points")


def lock_name(op: Op, name: str) -> str:
    """The name the operation's lock has on the server."""
    return f"election:{name}" if op.kind == "election" else name


async def perform(coord: Coordinator, op: Op, name: str, lease: Lease | None) -> object:
    """The operation under test; each of its suspensions is a cancellation point."""
    if op.action == "acquire":
        return await lock_of(coord, op.kind, name, retry=op.retry).acquire()
    if op.action == "with":
        async with lock_of(coord, op.kind, name):
            with phase("body"):
                await asyncio.sleep(0)
        return None
    if op.action == "hold":
        async with hold(coord, name, ttl=TTL, timeout=None):
            with phase("body"):
                await asyncio.sleep(0)
        return None
    if op.action == "release":
        assert lease is not None
        await lease.release()
        return None
    if op.action == "extend":
        assert lease is not None
        await lease.extend(TTL * 2 / 3)  # a new TTL: PostgreSQL's other heartbeat
        return None
    return await perform_election(coord, op, name)


async def perform_election(coord: Coordinator, op: Op, name: str) -> object:
    """The election operations of :func:`perform`."""
    election = election_of(coord, name)
    if op.action == "leadership":
        async with election.leadership():
            with phase("body"):
                await asyncio.sleep(0)
        return None
    if op.action == "observe":
        # An async generator (typed as an iterator): closed here, not when collected.
        observer = cast(AsyncGenerator[str | None, None], election.observe())
        try:
            async for _ in observer:
                break  # the current leader (none)
        finally:
            await observer.aclose()  # stops listening: more suspensions
        return None

    async def callback(term: asynclock.Term) -> None:
        with phase("callback"):
            await asyncio.sleep(0)
        raise _Done

    try:
        await election.run(callback)
    except _Done:
        return None


# -- the environment of one backend -------------------------------------------------------


@dataclass
class Env:
    """A backend under test: fresh coordinators for the operations, one to check with."""

    label: str
    make: Callable[[], Coordinator]
    other: Coordinator
    pg: Any = None  # an asyncpg connection for pg_locks (PostgreSQL only)
    retake: float = 2.0  # how long the coordinator may take to take the name again

    def supports(self, op: Op) -> bool:
        return op.needs is None or op.needs in self.other.backend.kinds


async def holder_for(env: Env, op: Op, name: str) -> Lease:
    """What keeps a contended operation waiting (taken by the other coordinator)."""
    if op.kind == "election":
        return await env.other.lock(lock_name(op, name), ttl=TTL).acquire()
    kind = {"read": "write", "write": "read"}.get(op.kind, op.kind)
    return await lock_of(env.other, kind, name).acquire()


async def parked(env: Env, coord: Coordinator) -> bool:
    """True once the operation's task sleeps waiting for a release."""
    if any(getattr(slot, "_fut", None) is not None for slot in coord._engine.waiting):
        return True
    backend = coord.backend
    if isinstance(backend, PostgresBackend):
        hub = getattr(backend, "_hub", None)
        groups: Any = getattr(hub, "_slots", {})
        if any(getattr(s, "_fut", None) is not None for g in groups.values() for s in g):
            return True  # a semaphore waiter, woken by NOTIFY
        waiting = await env.pg.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        )
        return bool(waiting)  # in the server's own lock queue
    return False


async def release_when_parked(
    env: Env, coord: Coordinator, holder: Lease, task: asyncio.Task[object]
) -> None:
    # Released only once the waiter sleeps, so that every run takes the same path (a
    # release before the waiter's first attempt would skip the wait). Should the
    # library's waiting internals change, the release comes after a second anyway.
    give_up = asyncio.get_running_loop().time() + 1.0
    while not task.done() and asyncio.get_running_loop().time() < give_up:
        if await parked(env, coord):
            break
        await asyncio.sleep(0.002)
    await holder.release()


async def not_free(env: Env, op: Op, name: str) -> str | None:
    """Why ``name`` is not free on the server (None if it is). A look that got no answer
    (a Redlock node timeout on a busy machine) is a reason too: callers look again until
    their deadline, and report it if it lasts."""
    try:
        return await _not_free(env, op, name)
    except BackendError as exc:
        return f"could not look: {exc}"


async def _not_free(env: Env, op: Op, name: str) -> str | None:
    other = env.other
    server_name = lock_name(op, name)
    if op.kind != "semaphore":
        info = await other.inspect(server_name)
        if info is not None:
            return f"inspect({server_name!r}) = {info}"
    probes = {
        "semaphore": ("semaphore",),
        "read": ("write", "read"),
        "write": ("write", "read"),
        "fair": ("fair",),
    }.get(op.kind, ("lock",))
    for kind in probes:
        try:
            lease = await lock_of(other, kind, server_name, timeout=0).acquire()
        except LockTimeout:
            return f"another coordinator's try-once ({kind}) is refused"
        await lease.release()
    if env.pg is not None:
        rows = await env.pg.fetch(
            "SELECT pid, mode, granted, classid, objid FROM pg_locks WHERE locktype = 'advisory'"
        )
        if rows:
            return f"pg_locks has advisory locks: {[dict(r) for r in rows]}"
    return None


async def still_works(coord: Coordinator, op: Op, name: str, retake: float = 2.0) -> None:
    async with asyncio.timeout(3 + retake):
        if op.kind == "election":
            async with election_of(coord, name).leadership():
                pass
            return
        lease = await lock_of(coord, op.kind, name, timeout=retake).acquire()
        await lease.release()


async def warm_up(coord: Coordinator, op: Op, name: str) -> None:
    """Open what the operation would otherwise open itself: a pool connection with the
    scripts loaded, and the pub/sub connection."""
    warm = f"{name}.warm"
    kind = "lock" if op.kind == "election" else op.kind
    lease = await lock_of(coord, kind, warm).acquire()
    await lease.release()
    async with coord.backend.waiter(warm):
        pass
    if op.kind == "election":
        async with coord.backend.listen(warm):
            await coord.backend.publish(warm, "warm")


# -- one point, one sweep ------------------------------------------------------------------


@dataclass
class Point:
    k: int | None
    requested: bool
    label: str
    labels: list[str]
    problems: list[str]
    give_back: float
    hand_off: float = 0.0  # with a contender: from the operation's end to its grant


async def run_point(env: Env, op: Op, name: str, k: int | None, *, again: int = 0) -> Point:
    """Run ``op`` once on a fresh coordinator, cancelled at its k-th suspension (and with
    ``again=n`` at its (k+n)-th too), and check the invariants; ``k=None`` runs it to the
    end (the trace of its points)."""
    with TaskOwners() as owners:
        return await _run_point(env, op, name, k, owners, again=again)


async def _run_point(
    env: Env, op: Op, name: str, k: int | None, owners: TaskOwners, *, again: int = 0
) -> Point:
    problems: list[str] = []
    give_back = 0.0
    with owner(FRESH):
        coord = env.make()
    stepper: Stepper[object] | None = None
    try:
        instrument(coord.backend)
        lease: Lease | None = None
        with owner(FRESH):
            if op.warm:
                await warm_up(coord, op, name)
            if op.action in ("release", "extend"):
                lease = await lock_of(coord, op.kind, name).acquire()
        holder = await holder_for(env, op, name) if op.contended else None
        stepper = Stepper(perform(coord, op, name, lease), k, again=again)
        task = await _run_task(env, coord, stepper, holder, problems)

        # 1. The task ends cancelled (or, never cancelled, completes).
        result = _outcome(task, stepper.requested, problems)
        with owner(FRESH):
            if isinstance(result, Lease):
                await result.release()
        if op.action == "release" and not stepper.requested and lease is not None and lease.held:
            problems.append("release() returned but the lease is still held")

        # An interrupted extend() keeps its lease: held here, on the server, and believed
        # valid no longer than the server keeps it.
        if op.action == "extend":
            assert lease is not None
            problems += await check_extended_lease(env, coord, lease)
            with owner(FRESH):
                if lease.held:
                    await lease.release()

        # 2. Nothing stays held beyond the give-back, and coord.held agrees.
        give_back = await _given_back(env, op, name, coord, problems)

        # 3. The coordinator still works.
        if not problems:
            try:
                with owner(FRESH):
                    await still_works(coord, op, name, env.retake)
            except Exception as exc:
                problems.append(f"the coordinator does not take {name!r} again: {exc!r}")
    finally:
        try:
            with owner(FRESH):
                async with asyncio.timeout(10):
                    await coord.aclose()
        except TimeoutError:
            problems.append("aclose() did not finish within 10s")
    # 4. Nothing of the coordinator outlives aclose().
    await asyncio.sleep(0)
    _no_tasks_left(owners, problems)
    labels = stepper.labels if stepper is not None else []
    requested = stepper is not None and stepper.requested
    label = labels[k - 1] if k is not None and requested else "-"
    return Point(k, requested, label, list(labels), problems, give_back)


async def _run_task(
    env: Env,
    coord: Coordinator,
    stepper: Stepper[object],
    holder: Lease | None,
    problems: list[str],
) -> asyncio.Task[object]:
    """Run the operation in a task of its own (and, if contended, let the holder go once
    it waits); the finished task."""
    with owner(FRESH):
        task: asyncio.Task[object] = asyncio.create_task(_drive(stepper))
    releaser = None
    if holder is not None:
        releaser = asyncio.create_task(release_when_parked(env, coord, holder, task))
    await asyncio.wait({task}, timeout=OP_LIMIT)
    if not task.done():
        problems.append(f"the operation did not end within {OP_LIMIT}s")
        task.cancel()
        await asyncio.wait({task})
    if releaser is not None:
        await releaser
    return task


def _no_tasks_left(owners: TaskOwners, problems: list[str]) -> None:
    left = owners.alive(FRESH)
    if left:
        problems.append(f"tasks left after aclose(): {left}")
        for task in left:
            task.cancel()


async def _given_back(
    env: Env, op: Op, name: str, coord: Coordinator, problems: list[str]
) -> float:
    """Seconds until nothing of the operation is held (a problem past GIVE_BACK)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        held = coord.held
        reason = f"coord.held = {held}" if held else await not_free(env, op, name)
        give_back = loop.time() - started
        if reason is None:
            return give_back
        if give_back > GIVE_BACK:
            problems.append(f"not given back within {GIVE_BACK}s: {reason}")
            return give_back
        await asyncio.sleep(0.01)


def _outcome(task: asyncio.Task[object], requested: bool, problems: list[str]) -> object:
    """What the operation returned; a problem unless it ended as it must."""
    if task.cancelled():
        if not requested:
            problems.append("cancelled although no cancel was sent")
        return None
    error = task.exception()
    if error is not None:
        problems.append(f"raised {error!r} instead of CancelledError")
        return None
    result = task.result()
    if requested:
        problems.append(f"{SWALLOWED}: returned {result!r}")
    return result


async def _drive(stepper: Stepper[object]) -> object:
    return await stepper


async def check_extended_lease(env: Env, coord: Coordinator, lease: Lease) -> list[str]:
    if not lease.held:
        return [f"the lease is not held after an interrupted extend(): {lease!r}"]
    if coord.held != [lease]:
        return [f"coord.held = {coord.held}, expected [{lease!r}]"]
    for attempt in range(3):  # a look with no answer (a busy machine) is no finding
        before = time.monotonic()
        local = lease.expires_in
        try:
            info = await env.other.inspect(lease.name)
        except BackendError:
            if attempt == 2:
                raise
            continue
        break
    elapsed = time.monotonic() - before
    if info is None or info.fence != lease.fence:
        return [f"the server shows {info} for the held lease {lease!r}"]
    if (
        not isinstance(coord.backend, PostgresBackend)
        and math.isfinite(info.expires_in)
        and local > info.expires_in + elapsed + 0.002
    ):
        return [f"local validity {local:.3f}s outlasts the server's {info.expires_in:.3f}s"]
    return []


@dataclass
class Sweep:
    points: int = 0
    labels: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # Points where the only violation was a swallowed cancel (redis-py under Python
    # 3.11's asyncio.wait_for: see test_a_cancel_during_a_redis_py_send_is_not_lost).
    swallowed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    slow_give_backs: list[str] = field(default_factory=list)  # "k (label): seconds"
    max_give_back: float = 0.0
    max_hand_off: float = 0.0
    trace: list[str] = field(default_factory=list)


#: Runs one point: ``run(env, op, name, k)`` (:func:`run_point`, or with a contender).
PointRunner = Callable[[Env, Op, str, int | None], Awaitable[Point]]


async def sweep(
    env: Env, op: Op, name: str, run: PointRunner | None = None, *, first_only: bool = False
) -> Sweep:
    """Cancel at k = 1, 2, ... until the operation completes without a k-th point.

    Where the path is not the same from run to run (Redlock: how many times the caller
    wakes inside a fan-out depends on how the nodes' replies arrive), k goes on until
    that many runs in a row completed, so that a longer path is not cut short. ``run``
    runs one point (default: :func:`run_point`); ``first_only`` ends the sweep at the
    first point with a violation (what it left behind would be met by every later one).
    """
    result = Sweep()
    began = time.monotonic()
    try:
        return await _sweep(env, op, name, result, run or run_point, first_only=first_only)
    finally:
        result.seconds = time.monotonic() - began


async def _sweep(
    env: Env, op: Op, name: str, result: Sweep, run: PointRunner, *, first_only: bool
) -> Sweep:
    settle = VARYING_PATHS.get(env.label, 1)
    completed = 0
    for k in range(1, MAX_POINTS + 1):
        point = await run(env, op, name, k)
        result.max_give_back = max(result.max_give_back, point.give_back)
        result.max_hand_off = max(result.max_hand_off, point.hand_off)
        if point.give_back > 0.1:
            result.slow_give_backs.append(f"k={k} ({point.label}) {point.give_back:.2f}s")
        if point.problems:
            line = f"{op.name} k={k} ({point.label}): {'; '.join(point.problems)}"
            if all(p.startswith(SWALLOWED) for p in point.problems):
                result.swallowed.append(line)
            else:
                result.failures.append(line)
                if first_only:
                    return result
        if point.requested:
            completed = 0
            result.points = k
            result.labels.append(point.label)
            continue
        completed += 1
        if len(point.labels) > len(result.trace):
            result.trace = point.labels
        if completed >= settle:
            return result
    result.failures.append(f"{op.name}: still suspending after {MAX_POINTS} points")
    return result


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")


# -- the summary -----------------------------------------------------------------------------


class _Summary:
    """Collects points per operation and backend; printed at the end of the run."""

    def __init__(self, title: str = "cancellation points (per operation and backend)") -> None:
        self.title = title
        self.rows: dict[tuple[str, str], Sweep] = {}

    def add(self, backend: str, op: str, result: Sweep) -> None:
        self.rows[(backend, op)] = result

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.rows:
            return
        backends = sorted({b for b, _ in self.rows}, key=_backend_order)
        ops = [op.name for op in OPS if any(o == op.name for _, o in self.rows)]
        write = terminalreporter.write_line
        terminalreporter.section(self.title)
        width = max(len(o) for o in ops)
        write(f"{'operation':<{width}}  " + "".join(f"{b:>10}" for b in backends))
        total = 0
        for o in ops:
            cells = []
            for b in backends:
                row = self.rows.get((b, o))
                if row is None:
                    cells.append(f"{'-':>10}")
                else:
                    total += row.points
                    mark = "!" if row.failures else "~" if row.swallowed else ""
                    cells.append(f"{str(row.points) + mark:>10}")
            write(f"{o:<{width}}  " + "".join(cells))
        failing = sum(1 for r in self.rows.values() if r.failures)
        swallowing = sum(1 for r in self.rows.values() if r.swallowed and not r.failures)
        slowest = max(r.max_give_back for r in self.rows.values())
        write(
            f"{total} points in {len(self.rows)} sweeps; {failing} sweeps with violations "
            f"(marked !), {swallowing} with only swallowed cancels (~); "
            f"slowest give-back {slowest:.3f}s" + self._hand_offs()
        )
        for (b, o), row in sorted(self.rows.items(), key=lambda i: _backend_order(i[0][0])):
            slow = ", ".join(row.slow_give_backs)
            back = f" [slow give-back: {slow}]" if slow else ""
            lost = f" [cancel swallowed at {len(row.swallowed)}]" if row.swallowed else ""
            write(
                f"  {b}/{o} ({row.seconds:.1f}s): {', '.join(row.labels) or '(no suspension)'}"
                f"{back}{lost}"
            )

    def _hand_offs(self) -> str:
        slowest = max(r.max_hand_off for r in self.rows.values())
        return f"; slowest hand-off to the contender {slowest:.3f}s" if slowest else ""


def _backend_order(name: str) -> int:
    order = ("memory", "redis", "redlock", "postgres", "sentinel", "cluster")
    return order.index(name) if name in order else len(order)


SUMMARY = _Summary()


@pytest.fixture(scope="module", autouse=True)
def _register_summary(pytestconfig: pytest.Config) -> None:
    if not pytestconfig.pluginmanager.has_plugin("asynclock-cancel-points"):
        pytestconfig.pluginmanager.register(SUMMARY, "asynclock-cancel-points")


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
async def env(
    request: pytest.FixtureRequest, backend_kind: str, make_coord: MakeCoord
) -> AsyncIterator[Env]:
    options: dict[str, Any] = {}
    if backend_kind == "redlock":
        options["node_timeout"] = REDLOCK_NODE_TIMEOUT
    pg = None
    if backend_kind == "postgres":
        pg = await asyncpg.connect(request.getfixturevalue("asynclock_postgres_dsn"))
    try:
        yield Env(backend_kind, lambda: make_coord(**options), make_coord(**options), pg)
    finally:
        if pg is not None:
            await pg.close()


def _report(
    env: Env, op: Op, result: Sweep, record_property: Callable[[str, object], None]
) -> None:
    SUMMARY.add(env.label, op.name, result)
    record_property("cancel_points", result.points)
    record_property("cancel_point_labels", ",".join(result.labels))


# -- every operation at every point ----------------------------------------------------------


@pytest.mark.explore
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
async def test_cancelled_at_every_point_leaves_nothing(
    env: Env, op: Op, record_property: Callable[[str, object], None]
) -> None:
    if not env.supports(op):
        pytest.skip(f"{op.kind} is not supported by the {env.label} backend")
    result = await sweep(env, op, safe_name(op.name))
    _report(env, op, result, record_property)
    assert not result.failures + result.swallowed, "\n".join(result.failures + result.swallowed)
    if env.label != "memory" or op.action not in ("acquire", "release", "extend", "observe"):
        assert result.points > 0, f"{op.name} never suspended on {env.label}"


@pytest.mark.explore
@pytest.mark.slow
async def test_sentinel_every_point(
    asynclock_sentinel: SentinelSetup,
    namespace: str,
    record_property: Callable[[str, object], None],
) -> None:
    """Redis behind Sentinel (one topology for the whole test, so the operations that
    need no Sentinel-specific path are left out: see TOPOLOGY_OPS)."""
    await _topology_sweeps("sentinel", asynclock_sentinel.url, namespace, record_property)


@pytest.mark.explore
@pytest.mark.slow
@pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
async def test_cluster_every_point(
    asynclock_cluster: ClusterSetup,
    namespace: str,
    record_property: Callable[[str, object], None],
) -> None:
    await _topology_sweeps("cluster", asynclock_cluster.url, namespace, record_property)


@contextlib.asynccontextmanager
async def _topology_env(label: str, url: str, namespace: str) -> AsyncIterator[Env]:
    made: list[Coordinator] = []

    def make() -> Coordinator:
        coord = asynclock.connect(url, prefix=namespace)
        made.append(coord)
        return coord

    try:
        yield Env(label, make, make())
    finally:
        for coord in made:
            await coord.aclose()


async def _topology_sweeps(
    label: str, url: str, namespace: str, record_property: Callable[[str, object], None]
) -> None:
    """Every invariant is asserted here, a swallowed cancel too (marked ``~`` in the
    summary)."""
    failures: list[str] = []
    async with _topology_env(label, url, namespace) as env:
        for op in TOPOLOGY_OPS:
            result = await sweep(env, op, safe_name(op.name))
            _report(env, op, result, record_property)
            failures += result.failures + result.swallowed
            assert result.points > 0, f"{op.name} never suspended on {label}"
    assert not failures, "\n".join(failures)


async def test_sentinel_a_cancel_while_sending_is_not_lost(
    asynclock_sentinel: SentinelSetup, namespace: str
) -> None:
    """acquire() on Sentinel, cancelled at its first suspension (the script's send), ends
    cancelled, not with a Lease. (redis-py sends under asyncio.wait_for, which on Python
    3.11 returns the send's result when the cancel lands as it finishes: the cancel was
    lost and the cancelled task got a Lease.)"""
    async with _topology_env("sentinel", asynclock_sentinel.url, namespace) as env:
        point = await run_point(env, OP_BY_NAME["lock.acquire"], "swallow", 1)
    assert point.requested
    assert not point.problems, point.problems


@pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
async def test_cluster_a_cancel_while_sending_is_not_lost(
    asynclock_cluster: ClusterSetup, namespace: str
) -> None:
    """lease.release() on Cluster, cancelled at its first suspension (the script's send),
    ends cancelled (the same redis-py/3.11 swallowed cancel as on Sentinel)."""
    async with _topology_env("cluster", asynclock_cluster.url, namespace) as env:
        point = await run_point(env, OP_BY_NAME["lease.release"], "swallow", 1)
    assert point.requested
    assert not point.problems, point.problems


# -- past defects ----------------------------------------------------------------------------


async def _cancel_where(env: Env, op: Op, name: str, wanted: set[str]) -> set[str]:
    """Sweep ``op`` (every point checked) and return which ``wanted`` labels were among
    the points cancelled at. Where paths vary from run to run (Redlock, more so on a
    loaded machine), a point may be missed: the sweep is run again, up to eight times in
    all (it stops as soon as every wanted point was hit)."""
    hit: set[str] = set()
    for _ in range(8):
        result = await sweep(env, op, name)
        assert not result.failures, "\n".join(result.failures)
        hit |= wanted & set(result.labels)
        if hit == wanted:
            break
    return hit


@pytest.mark.parametrize("backend_kind", ["redis", "redlock", "postgres"])
async def test_campaign_cancelled_while_announcing_leaks_no_lease(env: Env) -> None:
    """Cancelled while "elected" or "resigned" is on its way to the server: the term's
    lease is given back at once (it once stayed held and renewed, with no caller)."""
    announcing = {"publish:elected+granted", "publish:resigned+granted"}
    for op_name in ("election.leadership", "election.leadership(wait)", "election.run"):
        op = OP_BY_NAME[op_name]
        hit = await _cancel_where(env, op, "boss", announcing)
        assert hit == announcing, f"{op_name}: cancelled only in {hit}"


@pytest.mark.parametrize("backend_kind", ["redlock"])
async def test_waiter_cancelled_in_its_exit_after_the_grant_gives_it_back(env: Env) -> None:
    """A Redlock waiter granted, then cancelled while it leaves its wait (the unsubscribe
    fan-out on its way): no Lease reaches the caller, so the grant goes back at once.

    (A single Redis node's waiter does not suspend in its exit after a grant: its
    unsubscribe is not waited for. The sweeps above would show one if it came back.)
    """
    for op_name in ("lock.acquire(wait)", "lock.async_with(wait)", "election.leadership(wait)"):
        op = OP_BY_NAME[op_name]
        wanted = "waiter.exit+granted"
        hit = await _cancel_where(env, op, safe_name(op_name), {wanted})
        assert hit == {wanted}, f"{op_name}: never cancelled in the waiter's exit after a grant"


@contextlib.asynccontextmanager
async def _proxied(
    backend_kind: str, request: pytest.FixtureRequest, namespace: str
) -> AsyncIterator[tuple[Coordinator, list[FaultProxy]]]:
    """A coordinator that reaches its server(s) through fault proxies (for Redlock, a
    majority of the nodes)."""
    async with contextlib.AsyncExitStack() as stack:
        if backend_kind == "redlock":
            urls: list[str] = request.getfixturevalue("asynclock_redlock_urls")
            proxies = [await stack.enter_async_context(FaultProxy.from_url(u)) for u in urls[:3]]
            targets = [p.url_for(u) for p, u in zip(proxies, urls, strict=False)] + urls[3:]
            coord = asynclock.connect(targets, prefix=namespace, node_timeout=REDLOCK_NODE_TIMEOUT)
        elif backend_kind == "redis":
            url = request.getfixturevalue("asynclock_redis_url")
            proxies = [await stack.enter_async_context(FaultProxy.from_url(url))]
            coord = asynclock.connect(proxies[0].url_for(url), prefix=namespace)
        else:
            dsn = request.getfixturevalue("asynclock_postgres_dsn")
            proxies = [await stack.enter_async_context(FaultProxy.from_url(dsn))]
            coord = asynclock.connect(proxies[0].url_for(dsn), namespace=namespace)
        try:
            yield coord, proxies
        finally:
            for proxy in proxies:
                proxy.heal()
            await coord.aclose()


@pytest.mark.parametrize("backend_kind", ["redis", "redlock", "postgres"])
async def test_a_failed_release_does_not_replace_the_cancel(
    backend_kind: str,
    request: pytest.FixtureRequest,
    namespace: str,
    env: Env,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The body is cancelled while the server is down: the release on the way out fails,
    and the task still ends cancelled (not with BackendError/QuorumError); once the server
    is back the lock is given back (in the background, or by the session's end)."""
    caplog.set_level(logging.WARNING, logger="asynclock")
    async with _proxied(backend_kind, request, namespace) as (coord, proxies):
        entered = asyncio.Event()

        async def body() -> None:
            async with coord.lock("down", ttl=3.0):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(body())
        async with asyncio.timeout(10):
            await entered.wait()
        for proxy in proxies:
            proxy.refuse()
            proxy.reset()
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        assert task.done(), "the exit hung on the dead server"
        if not task.cancelled():
            raise AssertionError(f"the task ended with {task.exception()!r}, not cancelled")
        if backend_kind != "postgres":
            # The path under test was taken: the release failed under the cancel. (On
            # PostgreSQL the reset ends the session, and its lock with it: no error.)
            assert "failed while its task was being cancelled" in caplog.text
        for proxy in proxies:
            proxy.heal()
        op = Op("down", "lock", "with")
        deadline = time.monotonic() + 3.0 + GIVE_BACK
        reason = None
        while time.monotonic() < deadline:
            reason = f"coord.held = {coord.held}" if coord.held else None
            reason = reason or await not_free(env, op, "down")
            if reason is None:
                break
            await asyncio.sleep(0.02)
        assert reason is None, reason
        async with coord.lock("down", ttl=3.0, timeout=2):
            pass


# A waiter cancelled before its wait began: in its first attempt (which, for a fair lock or
# a writer that will wait, already put it in the line) or while subscribing. Leaving the
# wait takes a cancelled claim out of the line, but at these two points there is no wait
# to leave yet; the place used to stay until it lapsed (the backoff's maximum plus a
# second), the free lock refusing everyone else's try-once meanwhile (readers too, behind
# a writer's mark). The backoff here is long (5 s) so that a lapse cannot pass the test.
_LONG_BACKOFF = Backoff(initial=0.5, maximum=5.0, jitter=False)


@pytest.mark.parametrize(
    ("op", "k", "where"),
    [
        (Op("fair.acquire(wait)", "fair", "acquire", True, retry=_LONG_BACKOFF), 1, "try_acquire"),
        (
            Op("rwlock.write.acquire(wait)", "write", "acquire", True, retry=_LONG_BACKOFF),
            2,
            "waiter.enter",
        ),
    ],
    ids=["fair-first-attempt", "writer-subscribing"],
)
@pytest.mark.parametrize("backend_kind", ["redis"])
async def test_a_waiter_cancelled_before_waiting_leaves_the_line_at_once(
    env: Env, op: Op, k: int, where: str
) -> None:
    point = await run_point(env, op, safe_name(op.name), k)
    assert point.requested
    assert point.label == where
    assert not point.problems, point.problems


# What an acquire whose fence times out may report besides a cancel: the attempt itself
# ends with LockTimeout when it is not cancelled, and the coordinator cannot take the name
# again while the fence sequence stays locked.
_FENCE_TIMED_OUT = re.compile(
    r"raised LockTimeout\(|the coordinator does not take '[^']*' again: LockTimeout\("
)


# Not semaphores: a permit waiter with no timeout scans again and again while the fence
# fails, never ending (test_postgres_failures.py covers a permit's try and wait).
@pytest.mark.parametrize("kind", ["lock", "read"])
@pytest.mark.parametrize("backend_kind", ["postgres"])
async def test_postgres_cancelled_around_a_fence_that_times_out(
    request: pytest.FixtureRequest,
    make_coord: MakeCoord,
    namespace: str,
    kind: str,
    record_property: Callable[[str, object], None],
) -> None:
    """A statement on a lock connection that fails after it took the lock: a session
    lock_timeout bounds the fence's nextval(), held up by a migration's ALTER SEQUENCE,
    so every try takes the lock (or a permit) and then fails. Cancelled at each point
    (the failing statement, the clean-up statement that drops what it took, the give-
    back) and run to its LockTimeout: nothing stays held on the server, the task ends
    cancelled."""
    dsn = request.getfixturevalue("asynclock_postgres_dsn")
    sequence = f"fence_{namespace}"
    admin = await asyncpg.connect(dsn)
    pg = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE SEQUENCE "{sequence}" CACHE 1')
        env = Env(
            "postgres",
            lambda: make_coord(fence_sequence=sequence, server_settings={"lock_timeout": "50"}),
            make_coord(),  # the default sequence: its probes are not held up
            pg,
            retake=0.1,  # it cannot while the sequence is locked: no need to wait long
        )
        op = Op(f"{kind}.acquire(fence-times-out)", kind, "acquire", warm=False)
        result = Sweep()
        ended = False
        async with admin.transaction():
            await admin.execute(f'ALTER SEQUENCE "{sequence}" CACHE 1')
            for k in range(1, MAX_POINTS + 1):
                point = await run_point(env, op, safe_name(op.name), k)
                problems = [p for p in point.problems if not _FENCE_TIMED_OUT.match(p)]
                if problems:
                    result.failures.append(f"k={k} ({point.label}): {'; '.join(problems)}")
                if not point.requested:
                    ended = any(p.startswith("raised LockTimeout(") for p in point.problems)
                    break
                result.points = k
                result.labels.append(point.label)
        record_property("cancel_points", result.points)  # (not in the summary's table)
        assert not result.failures, "\n".join(result.failures)
        assert ended, "the acquire did not end with LockTimeout: the fence did not time out"
        assert result.points > 0
    finally:
        await admin.execute(f'DROP SEQUENCE IF EXISTS "{sequence}"')
        await admin.close()
        await pg.close()


# A waiter cancelled in its wait, then once more at the next suspension: in its exit,
# which leaves the line and the waiter's channel (a timeout firing while a LockTimeout
# leaves the wait does the same). The second cancel stopped both requests before they
# were sent: the place stayed until it lapsed, the channel subscribed for good.
@pytest.mark.parametrize("backend_kind", ["redis"])
async def test_a_waiter_cancelled_again_while_leaving_the_wait_leaves_the_line(
    env: Env,
) -> None:
    op = Op("fair.acquire(wait)", "fair", "acquire", True, retry=_LONG_BACKOFF)
    name = safe_name(op.name)
    trace = await run_point(env, op, name, None)
    k = trace.labels.index("core")  # 1-based: the suspension after the in-wait attempt
    assert trace.labels[k - 2 : k + 1] == ["waiter.enter", "try_acquire", "core"], trace.labels
    point = await run_point(env, op, name, k + 1, again=1)
    assert point.requested
    assert point.labels[k + 1] == "waiter.exit", point.labels  # the second cancel's point
    assert not point.problems, point.problems
