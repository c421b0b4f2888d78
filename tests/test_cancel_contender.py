"""Cancellation at every suspension point while a second client contends for the name.

tests/test_cancel_points.py cancels one client's operation at each of its suspension
points and checks that client alone. Here another coordinator (the contender: its own
connections, the environment's ``other``) competes for the same name in every run, so a
mistake that hurts *another* holder shows: a release that deletes whoever holds the lock,
a grant kept after its acquire was cancelled, a fence handed out twice.

How the contender plays (so that the operation's path stays that of the plain sweep):

- for an operation that waits (``...(wait)``) it holds the name first, and lets go once
  the operation sleeps waiting for it (or after :data:`HOLD_CAP`);
- for an operation on a held lease (release, extend) it is already waiting when the
  operation starts;
- otherwise, and after each time it let go, it asks again as soon as the operation was
  granted (the instrumented backend reports each grant as it is answered) or is over;
- it holds until the operation's coordinator is closed, unless the operation waits for it.

Checked at every point, besides what the plain sweep checks of the operation's task (it
ends cancelled; an interrupted ``extend()`` keeps its lease, valid no longer than the
server keeps it):

- **one holder at a time**: at each grant, on either side, the other side holds no lease
  it believes valid (one whose release is on its way does not count); the server shows
  the contender's grant as its own when it is granted and again after the operation's
  coordinator was closed (whatever that coordinator's clean-ups sent has landed by then),
  and the contender's release confirms it;
- **fences increase across both clients**: every grant either client was answered, in
  the order of the answers, carries a fence greater than the one before;
- **contender granted within the bound**: once the operation is over (its task ended and
  what it returned was released), the contender is granted within :data:`HAND_OFF`;
- **nothing left held**: after both finished, the server holds nothing of the name
  (``inspect``, a try-once on every side of it, ``pg_locks``) within :data:`GIVE_BACK`,
  and no task of the operation's coordinator outlives its ``aclose()``.

Every violation is reported as ``[property] ...`` with the point (k and its label); the
sweeps never wait longer than these bounds for a finding. tests/_cancel_mutants.py plants
the mistakes these checks exist for, and shows which point and property catch each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from pytest_asynclock import ClusterSetup, SentinelSetup

from asynclock import BackendError, Coordinator, Lease, LockNotOwned

from ._cancel_points import Probe, Stepper, TaskOwners, instrument, owner, reporting
from .conftest import MakeCoord
from .test_cancel_points import (
    FRESH,
    GIVE_BACK,
    OP_BY_NAME,
    OP_LIMIT,
    REDLOCK_NODE_TIMEOUT,
    RETRY,
    Env,
    Op,
    Point,
    Sweep,
    _drive,
    _no_tasks_left,
    _outcome,
    _Summary,
    _topology_env,
    check_extended_lease,
    lock_name,
    lock_of,
    not_free,
    parked,
    perform,
    safe_name,
    sweep,
    warm_up,
)

ONE_HOLDER = "one holder at a time"
FENCES = "fences increase across both clients"
BOUNDED = "contender granted within the bound"
NOTHING_LEFT = "nothing left held"
ENDS = "the operation ends as it must"

# How long after the operation is over the contender may wait for its grant:
#   GIVE_BACK (2 s): what the cancelled operation took goes back in the background (the
#     plain sweep's allowance; its slowest give-back is about 0.1 s);
# + RETRY.maximum (0.5 s): a waiter tries again at least this often, even when no wake-up
#     reaches it (a give-back's release wakes it at once);
# + ANSWER (0.5 s): the contender's try and its answer on a busy 2-core machine (Redlock:
#     twice its node timeout; the fence round follows the acquire round).
ANSWER = 0.5
HAND_OFF = GIVE_BACK + RETRY.maximum + ANSWER
# How much longer a contender not granted within HAND_OFF is watched, to tell a late grant
# from none in the report.
LATE_LOOK = 5.0
# How long the contender holds while the operation runs without being seen to wait for it
# (as the plain sweep's holder: a path whose wait is not recognised still goes on).
HOLD_CAP = 1.0
# The operations swept with a contender: acquire (waiting), ``async with`` (enter, body,
# exit), a held lease's release and extend, an election campaign, and where the backend
# has them a semaphore permit and a reader behind a writer.
CONTENDED = tuple(
    OP_BY_NAME[name]
    for name in (
        "lock.acquire(wait)",
        "lock.async_with",
        "lease.release",
        "lease.extend",
        "election.leadership",
        "semaphore.acquire(wait)",
        "rwlock.read.acquire(wait)",
    )
)
# On Sentinel and Cluster (a topology per test): the lock and lease operations.
TOPOLOGY_CONTENDED = tuple(
    OP_BY_NAME[name]
    for name in ("lock.acquire(wait)", "lock.async_with", "lease.release", "lease.extend")
)


def contender_kind(op: Op) -> str:
    """The kind of lock the contender takes: one that excludes the operation's."""
    if op.kind == "election":
        return "lock"  # the election's own lock, by its server name
    return {"read": "write", "write": "read"}.get(op.kind, op.kind)


class Contender:
    """The second client: takes and lets go of the operation's name, checking each grant.

    Findings go to ``problems`` as ``[property] ...`` lines.
    """

    def __init__(
        self, env: Env, op: Op, name: str, *, coord: Coordinator, probe: Probe, problems: list[str]
    ) -> None:
        self.env = env
        self.name = lock_name(op, name)
        self.lock = lock_of(env.other, contender_kind(op), self.name)
        self.coord = coord  # the operation's coordinator
        self.probe = probe
        self.problems = problems
        self.lease: Lease | None = None
        self.believes = False  # holds a lease it has not begun to release
        self.fences: list[tuple[str, int]] = []
        self.task: asyncio.Task[object] | None = None  # the operation's task
        self.over_at: float | None = None  # loop time the operation was over
        self.granted_at = 0.0  # loop time of the contender's last grant
        self.holding = asyncio.Event()
        # Set once the contender holds after the operation is over (it held at that
        # moment, or was granted since).
        self.served = asyncio.Event()
        self._ask = asyncio.Event()  # the operation was granted or is over: ask again
        self._closed = asyncio.Event()  # the operation's coordinator is closed

    # -- what the operation's side reports ------------------------------------------------

    def fence(self, who: str, fence: int) -> None:
        """A grant answered to ``who``: its fence must exceed every earlier one."""
        if self.fences and fence <= self.fences[-1][1]:
            last, previous = self.fences[-1]
            self.problems.append(
                f"[{FENCES}] {who} was granted fence {fence} after {last} was granted "
                f"{previous} (grants so far: {self.fences})"
            )
        self.fences.append((who, fence))

    def operation_granted(self, fence: int) -> None:
        """The operation's try_acquire answered with a grant (called in its task)."""
        lease = self.lease
        if self.believes and lease is not None and lease.held and lease.expires_in > 0:
            self.problems.append(
                f"[{ONE_HOLDER}] the operation was granted fence {fence} while the contender "
                f"believes it holds {lease!r}"
            )
        self.fence("the operation", fence)
        self._ask.set()

    def ask(self) -> None:
        """Ask for the name now (it is held: wait for it)."""
        self._ask.set()

    def over(self) -> None:
        """The operation is over: its task ended and what it returned was released."""
        self.over_at = asyncio.get_running_loop().time()
        if self.holding.is_set():
            self.served.set()
        self._ask.set()

    def close(self) -> None:
        """The operation's coordinator is closed: let go and end."""
        self._closed.set()

    def _operation_believes(self) -> list[Lease]:
        return [
            lease
            for lease in self.coord.held
            if lease.name == self.name
            and lease.expires_in > 0
            and lease.token not in self.probe.releasing
        ]

    # -- the contender's own side -----------------------------------------------------------

    async def run(self) -> None:
        """Ask, hold, let go, until the operation's coordinator is closed."""
        while True:
            if self.lease is None:
                await self._ask.wait()
                await self.take()
            closed = await self._hold()
            await self.let_go()
            if closed:
                return

    async def take(self) -> None:
        """Acquire the name (waiting as long as it takes) and check the grant."""
        self._ask.clear()
        lease = await self.lock.acquire()
        self.lease = lease
        self.granted_at = asyncio.get_running_loop().time()
        believed = self._operation_believes()
        if believed:
            self.problems.append(
                f"[{ONE_HOLDER}] the contender was granted fence {lease.fence} while the "
                f"operation believes it holds {believed}"
            )
        self.fence("the contender", lease.fence)
        await self._on_server(lease, "when it was granted")
        self.believes = True
        self.holding.set()
        if self.over_at is not None:
            self.served.set()

    async def _hold(self) -> bool:
        """Hold until the operation's coordinator is closed (True), or the operation waits
        for the name (False: let go so that it can go on)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        while not self._closed.is_set():
            task = self.task
            if (
                task is not None
                and not task.done()
                and (loop.time() - began > HOLD_CAP or await parked(self.env, self.coord))
                and not task.done()  # it may have ended while we looked
            ):
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.002):
                    await self._closed.wait()
        return True

    async def let_go(self) -> None:
        """Release, checking that the server still had the contender's grant."""
        lease = self.lease
        assert lease is not None
        self.believes = False
        self.holding.clear()
        await self._on_server(lease, "before its release")
        try:
            await lease.release()
        except LockNotOwned as exc:
            self.problems.append(
                f"[{ONE_HOLDER}] the contender's release of fence {lease.fence} found the lock "
                f"no longer its own, though it never let go: {exc}"
            )
        self.lease = None

    async def _on_server(self, lease: Lease, when: str) -> None:
        """The server must show ``lease`` as the holder (exclusive leases, and any lease on
        the memory backend: the others cannot tell one reader or permit from another)."""
        for attempt in range(3):  # a look with no answer (a busy machine) is no finding
            try:
                owned = await lease.owned()
            except NotImplementedError:
                return
            except BackendError:
                if attempt == 2:
                    raise
                continue
            if not owned:
                info = await self.env.other.inspect(self.name)
                self.problems.append(
                    f"[{ONE_HOLDER}] {when}, the server does not show the contender's grant "
                    f"(fence {lease.fence}) as the holder: inspect = {info}"
                )
            return


# -- one point --------------------------------------------------------------------------------


async def run_contended_point(env: Env, op: Op, name: str, k: int | None) -> Point:
    """Run ``op`` once on a fresh coordinator, cancelled at its k-th suspension, while the
    contender competes for the name; check the properties (module docstring)."""
    with TaskOwners() as owners:
        return await _run_contended(env, op, name, k, owners)


async def _run_contended(env: Env, op: Op, name: str, k: int | None, owners: TaskOwners) -> Point:
    problems: list[str] = []
    hand_off = 0.0
    with owner(FRESH):
        coord = env.make()
    stepper: Stepper[object] | None = None
    contender: Contender | None = None
    contending: asyncio.Task[None] | None = None
    try:
        instrument(coord.backend)
        lease: Lease | None = None
        with owner(FRESH):
            if op.warm:
                await warm_up(coord, op, name)
            if op.action in ("release", "extend"):
                lease = await lock_of(coord, op.kind, name).acquire()
        stepper = Stepper(perform(coord, op, name, lease), k)
        contender = Contender(env, op, name, coord=coord, probe=stepper.probe, problems=problems)
        stepper.probe.on_grant = contender.operation_granted
        if lease is not None:
            contender.fence("the operation", lease.fence)
        if op.contended:
            await contender.take()
        contending = asyncio.create_task(contender.run())
        if lease is not None:
            contender.ask()  # it waits for the held lease before the operation starts
            await _until_parked(env, env.other)
        with owner(FRESH):
            task: asyncio.Task[object] = asyncio.create_task(_drive(stepper))
        contender.task = task
        await asyncio.wait({task}, timeout=OP_LIMIT)
        if not task.done():
            problems.append(f"[{ENDS}] the operation did not end within {OP_LIMIT}s")
            task.cancel()
            await asyncio.wait({task})
        ends: list[str] = []
        _outcome(task, stepper.requested, ends)
        problems += [f"[{ENDS}] {p}" for p in ends]
        await _put_away(env, coord, op, lease, task, stepper=stepper, problems=problems)
        contender.over()
        hand_off = await _handed_off(
            env, op, name, contender, contending, owners=owners, problems=problems
        )
    finally:
        # Its releases count as the operation's too (the contender may be waiting).
        releases = contextlib.nullcontext() if stepper is None else reporting(stepper.probe)
        try:
            with owner(FRESH), releases:
                async with asyncio.timeout(10):
                    await coord.aclose()
        except TimeoutError:
            problems.append(f"[{NOTHING_LEFT}] aclose() did not finish within 10s")
        if contender is not None and contending is not None:
            await _end(contender, contending, problems)
    await _nothing_left(env, op, name, problems)
    await asyncio.sleep(0)
    _no_tasks_left(owners, problems)
    labels = stepper.labels if stepper is not None else []
    requested = stepper is not None and stepper.requested
    label = labels[k - 1] if k is not None and requested else "-"
    return Point(k, requested, label, list(labels), problems, 0.0, hand_off)


async def _until_parked(env: Env, coord: Coordinator) -> None:
    """Until ``coord`` sleeps waiting for a release (at most a second)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 1.0
    while loop.time() < give_up:
        if await parked(env, coord):
            return
        await asyncio.sleep(0.002)


async def _put_away(
    env: Env,
    coord: Coordinator,
    op: Op,
    lease: Lease | None,
    task: asyncio.Task[object],
    *,
    stepper: Stepper[object],
    problems: list[str],
) -> None:
    """Release what the operation returned or kept; the operation is over after this.
    (These releases count as the operation's: the contender may be granted while their
    answers are on their way.)"""
    result = None if task.cancelled() or task.exception() is not None else task.result()
    with owner(FRESH), reporting(stepper.probe):
        if isinstance(result, Lease):
            await result.release()
    held = lease is not None and lease.held
    if op.action == "release" and not stepper.requested and held:
        problems.append(f"[{ENDS}] release() returned but the lease is still held")
    if op.action == "extend":
        assert lease is not None
        problems += [f"[{ENDS}] {p}" for p in await check_extended_lease(env, coord, lease)]
        with owner(FRESH), reporting(stepper.probe):
            if lease.held:
                await lease.release()


async def _handed_off(
    env: Env,
    op: Op,
    name: str,
    contender: Contender,
    contending: asyncio.Task[None],
    *,
    owners: TaskOwners,
    problems: list[str],
) -> float:
    """Seconds from the operation's end to the contender's grant (0 if it held already)."""
    await _granted(contender, contending, HAND_OFF)
    if contending.done():
        error = None if contending.cancelled() else contending.exception()
        problems.append(f"[{BOUNDED}] the contender ended early: {error!r}")
        return 0.0
    assert contender.over_at is not None
    if not contender.served.is_set():
        # Say what holds it, what of the operation's coordinator still runs, and whether
        # the grant is only late (a slow give-back) or does not come (a leak).
        reason = await not_free(env, op, name)
        running = sorted(task.get_name() for task in owners.alive(FRESH))
        await _granted(contender, contending, LATE_LOOK)
        late = asyncio.get_running_loop().time() - contender.over_at
        came = (
            f"granted {late:.2f}s after it"
            if contender.served.is_set()
            else f"still not granted {late:.2f}s after it"
        )
        problems.append(
            f"[{BOUNDED}] the contender was not granted within {HAND_OFF:g}s of the "
            f"operation's end ({came}); then {reason}; the operation's coordinator ran "
            f"{running}"
        )
        return HAND_OFF
    return max(0.0, contender.granted_at - contender.over_at)


async def _granted(contender: Contender, contending: asyncio.Task[None], within: float) -> None:
    """Until the contender was served after the operation's end (or ended), at most
    ``within`` seconds."""
    served = asyncio.ensure_future(contender.served.wait())
    try:
        await asyncio.wait(
            {contending, served}, timeout=within, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        served.cancel()


async def _end(contender: Contender, contending: asyncio.Task[None], problems: list[str]) -> None:
    """Let the contender release and end; one still waiting for a grant (a finding already)
    is cancelled at once."""
    contender.close()
    if not contender.holding.is_set():
        contending.cancel()
    done, _ = await asyncio.wait({contending}, timeout=5.0)
    if not done:
        contending.cancel()
        await asyncio.wait({contending})
    if contending.cancelled():
        lease = contender.lease  # granted as it was cancelled: not a finding of its own
        if lease is not None and lease.held:
            with contextlib.suppress(LockNotOwned, BackendError):
                await lease.release()
    elif contending.exception() is not None:
        problems.append(f"[{ONE_HOLDER}] the contender failed: {contending.exception()!r}")


async def _nothing_left(env: Env, op: Op, name: str, problems: list[str]) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + GIVE_BACK
    while True:
        held = env.other.held
        reason = f"the contender still holds {held}" if held else await not_free(env, op, name)
        if reason is None:
            return
        if loop.time() > give_up:
            problems.append(f"[{NOTHING_LEFT}] not free {GIVE_BACK}s after both ended: {reason}")
            return
        await asyncio.sleep(0.01)


# -- the summary and fixtures ---------------------------------------------------------------

SUMMARY = _Summary("cancellation points with a contender (per operation and backend)")


@pytest.fixture(scope="module", autouse=True)
def _register_summary(pytestconfig: pytest.Config) -> None:
    if not pytestconfig.pluginmanager.has_plugin("asynclock-cancel-contender"):
        pytestconfig.pluginmanager.register(SUMMARY, "asynclock-cancel-contender")


def _report(
    env: Env, op: Op, result: Sweep, record_property: Callable[[str, object], None]
) -> None:
    SUMMARY.add(env.label, op.name, result)
    record_property("cancel_points", result.points)
    record_property("hand_off", round(result.max_hand_off, 3))


@pytest.fixture
async def contender_env(
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


def _findings(result: Sweep) -> list[str]:
    return result.failures + result.swallowed


# -- the sweeps -------------------------------------------------------------------------------


@pytest.mark.explore
@pytest.mark.parametrize("op", CONTENDED, ids=[op.name for op in CONTENDED])
async def test_cancelled_with_a_contender_at_every_point(
    contender_env: Env, op: Op, record_property: Callable[[str, object], None]
) -> None:
    """Cancelled at each point while another client contends: one holder at a time,
    fences increasing across both, the contender granted within HAND_OFF, nothing left."""
    env = contender_env
    if not env.supports(op):
        pytest.skip(f"{op.kind} is not supported by the {env.label} backend")
    result = await sweep(env, op, safe_name(op.name), run_contended_point, first_only=True)
    _report(env, op, result, record_property)
    assert not _findings(result), "\n".join(_findings(result))
    if env.label != "memory" or op.action not in ("release", "extend"):
        assert result.points > 0, f"{op.name} never suspended on {env.label}"


async def _topology_sweeps(
    label: str, url: str, namespace: str, record_property: Callable[[str, object], None]
) -> None:
    findings: list[str] = []
    async with _topology_env(label, url, namespace) as env:
        for op in TOPOLOGY_CONTENDED:
            result = await sweep(env, op, safe_name(op.name), run_contended_point, first_only=True)
            _report(env, op, result, record_property)
            findings += _findings(result)
            assert result.points > 0, f"{op.name} never suspended on {label}"
    assert not findings, "\n".join(findings)


@pytest.mark.explore
@pytest.mark.slow
async def test_sentinel_with_a_contender_at_every_point(
    asynclock_sentinel: SentinelSetup,
    namespace: str,
    record_property: Callable[[str, object], None],
) -> None:
    """Redis behind Sentinel, the lock and lease operations, with a contender."""
    await _topology_sweeps("sentinel", asynclock_sentinel.url, namespace, record_property)


@pytest.mark.explore
@pytest.mark.slow
@pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
async def test_cluster_with_a_contender_at_every_point(
    asynclock_cluster: ClusterSetup,
    namespace: str,
    record_property: Callable[[str, object], None],
) -> None:
    """Redis Cluster, the lock and lease operations, with a contender."""
    await _topology_sweeps("cluster", asynclock_cluster.url, namespace, record_property)
