"""The cases, in the order one run goes through them, and the run itself.

One run: uncontended acquire + release per server in alternating rounds with its floors
(memory, Redis, Redlock, PostgreSQL), contended hand-off per implementation, waiter
count and mode (``strict``: every acquisition goes to another waiter; ``free``: the
releaser contends again at once), held leases (renewal CPU and memory), and last,
because it leaves peers' clients in a sorry state, Redlock with one node frozen.
``primitives`` measures semaphores, read-write locks and fair locks against the plain
lock on the same backend, uncontended and with waiters. ``sync`` measures the blocking
API (``asynclock.sync``) from threads against redis-py's blocking client and the blocking
peers, with a breakdown of where its time goes, and (full runs) hand-off between threads.

Every row a run produces is a dict with ``id``, ``section`` (``uncontended``,
``strict``, ``free``, ``leases``, ``frozen``, ``primitives``, ``primitives-contended``,
``sync``, ``sync-parts``, ``sync-strict``), ``server``, ``label``, ``kind``
(``floor``, ``reference``, ``asynclock`` or ``peer``), ``floor`` (the id of the row it is
compared to, measured in the same run) and its metrics; ``ratio`` is the row's headline
latency over its floor's (and, in the ``sync`` sections, ``p99_ratio`` its p99 over the
floor's p99).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from asynclock import Coordinator, Lease, connect
from asynclock.backends import Kind

from ._env import Servers
from ._measure import (
    Handoffs,
    Op,
    contend_async,
    contend_threads,
    describe_error,
    run_rounds,
    summarize,
)
from ._peers import (
    PEER_LOGGERS,
    SYNC_PEERS,
    Peer,
    PeerUnavailable,
    build_peer,
    peer_label,
)
from ._progress import Progress
from ._sync import CONTENDED_IMPLS as SYNC_CONTENDED_IMPLS
from ._sync import contended as sync_contended
from ._sync import contended_kind as sync_contended_kind
from ._sync import contended_label as sync_contended_label
from ._sync import unavailable_key as sync_unavailable_key
from ._sync import uncontended as sync_uncontended

__all__ = ("FULL", "QUICK", "SECTIONS", "Plan", "Settings", "run_suite")

SECTIONS = ("uncontended", "contended", "leases", "frozen", "primitives", "sync")
#: Waiters on one lock in the contended primitives cases (fair against plain).
PRIMITIVE_WAITERS = 8
#: The uncontended primitives cases: id suffix, label, the claim kind they need.
PRIMITIVE_CASES = (
    ("semaphore", "semaphore permit, limit 5", Kind.PERMIT),
    ("rwlock-read", "rwlock read()", Kind.SHARED),
    ("rwlock-write", "rwlock write()", Kind.SHARED),
    ("fair", "lock fair=True", Kind.FAIR),
)
_PRIMITIVE_SERVERS = {"memory": "memory", "redis": "Redis", "postgres": "PostgreSQL"}
#: Sections whose rows also get ``p99_ratio``: their p99 over their floor's.
_P99_RATIO_SECTIONS = frozenset({"sync", "sync-parts"})
Row = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    """How much of each case to run (``FULL`` and ``QUICK`` are the two presets)."""

    rounds: int = 20
    per_round: int = 500
    warmup: int = 300
    waiters: tuple[int, ...] = (8, 64)
    contended_seconds: float = 2.0
    contended_warmup: float = 0.3
    pg_handoffs: int = 300
    frozen_ops: int = 200
    leases: int = 10_000
    lease_ttl: float = 30.0
    lease_periods: float = 2.0
    peer_bound: float = 2.0
    node_timeout: float = 0.05
    #: Threads on one lock in the blocking API's contended cases (none: not run).
    sync_waiters: tuple[int, ...] = (8,)


FULL = Settings()
QUICK = Settings(
    rounds=3,
    per_round=100,
    warmup=50,
    waiters=(8,),
    contended_seconds=0.3,
    contended_warmup=0.1,
    pg_handoffs=30,
    frozen_ops=30,
    leases=1_000,
    lease_ttl=3.0,
    peer_bound=1.0,
    sync_waiters=(),
)


@dataclass
class Plan:
    """What to run where: servers, settings, sections, peers or not, how many runs."""

    servers: Servers
    settings: Settings = FULL
    sections: tuple[str, ...] = SECTIONS
    peers: bool = True
    memory: bool = True
    runs: int = 1
    mode: str = "full"


@dataclass
class RunRecord:
    """What one run of the suite produced."""

    rows: list[Row] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    peer_outcomes: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    background_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "seconds": round(self.seconds, 1),
            "rows": self.rows,
            "unavailable": self.unavailable,
            "failed": self.failed,
            "peer_outcomes": self.peer_outcomes,
            "background_errors": self.background_errors,
        }


Tick = Callable[[], None]


@dataclass
class Phase:
    """A step of a run: its label, its units of progress, and what it does."""

    label: str
    units: int
    run: Callable[[RunRecord, Tick], Awaitable[None]]


def _uid() -> str:
    return secrets.token_hex(3)


def _row(
    id_: str,
    *,
    section: str,
    server: str,
    label: str,
    kind: str,
    floor: str | None,
    **metrics: Any,
) -> Row:
    return {
        "id": id_,
        "section": section,
        "server": server,
        "label": label,
        "kind": kind,
        "floor": floor,
        **metrics,
    }


class Suite:
    """One plan's phases; :meth:`run` goes through them once and returns the record."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.s = plan.settings
        self.servers = plan.servers

    # -- planning ----------------------------------------------------------------------

    def phases(self) -> list[Phase]:
        """Every phase this plan runs, in order."""
        s, srv, wanted = self.s, self.servers, set(self.plan.sections)
        phases: list[Phase] = []
        rounds = 1 + s.rounds
        if "uncontended" in wanted:
            if self.plan.memory:
                phases.append(Phase("uncontended: memory", rounds, self._memory))
            if srv.redis:
                phases.append(Phase("uncontended: Redis", rounds, self._redis))
            if srv.redlock:
                phases.append(Phase("uncontended: Redlock", rounds, self._redlock))
            if srv.postgres:
                phases.append(Phase("uncontended: PostgreSQL", rounds, self._postgres))
        if "contended" in wanted:
            if srv.redis and "uncontended" not in wanted:
                phases.append(Phase("floor: PING", rounds, self._ping))
            if srv.postgres:
                phases.append(
                    Phase("contended: PostgreSQL, one queued waiter", 2, self._postgres_queued)
                )
            phases += self._contended_phases()
        if "leases" in wanted and srv.redis:
            phases.append(Phase(f"{s.leases:,} held leases", 3, self._leases))
        if "frozen" in wanted and srv.redlock and srv.freezable:
            phases.append(Phase("Redlock, one node frozen", 1, self._frozen))
        if "primitives" in wanted:
            phases += self._primitive_phases()
        if "sync" in wanted and srv.redis:
            phases += self._sync_phases()
        return phases

    def _sync_phases(self) -> list[Phase]:
        phases = [Phase("sync: Redis, blocking API", 1 + self.s.rounds, self._sync)]
        for waiters in self.s.sync_waiters:
            for impl in SYNC_CONTENDED_IMPLS:
                if impl in SYNC_PEERS and not self.plan.peers:
                    continue
                phases.append(
                    Phase(
                        f"sync contended (strict): {sync_contended_label(impl)}, {waiters} threads",
                        1,
                        self._sync_contended(impl, waiters),
                    )
                )
        return phases

    def _primitive_phases(self) -> list[Phase]:
        servers = [
            server
            for server, present in (
                ("memory", self.plan.memory),
                ("redis", bool(self.servers.redis)),
                ("postgres", bool(self.servers.postgres)),
            )
            if present
        ]
        phases = [
            Phase(
                f"primitives: {_PRIMITIVE_SERVERS[server]}",
                1 + self.s.rounds,
                self._primitives(server),
            )
            for server in servers
        ]
        for mode in ("strict", "free"):
            for server in servers:
                for fair in (False, True):
                    phases.append(
                        Phase(
                            f"primitives ({mode}): {_PRIMITIVE_SERVERS[server]} "
                            f"{'fair' if fair else 'plain'} lock, {PRIMITIVE_WAITERS} waiters",
                            1,
                            self._primitive_contended(server, fair, mode),
                        )
                    )
        return phases

    def _contended_phases(self) -> list[Phase]:
        srv = self.servers
        impls: list[tuple[str, str, list[str]]] = []  # (server, implementation, urls)
        if srv.redis:
            impls.append(("redis", "asynclock", [srv.redis]))
            impls.append(("redis", "asynclock-shared", [srv.redis]))
        if srv.redlock:
            impls.append(("redlock", "asynclock", srv.redlock))
        if srv.postgres:
            impls.append(("postgres", "asynclock", [srv.postgres]))
        if self.plan.peers and srv.redis:
            impls += [
                ("redis", kind, [srv.redis])
                for kind in ("redis-py", "redis-py-1ms", "python-redis-lock", "pottery")
            ]
        if self.plan.peers and srv.redlock:
            impls.append(("redlock", "pottery", srv.redlock))
        if self.plan.peers and srv.redis:
            impls.append(("redis", "aioredlock", [srv.redis]))
        if self.plan.peers and srv.redlock:
            impls.append(("redlock", "aioredlock", srv.redlock))
        phases = []
        for mode in ("strict", "free"):
            for waiters in self.s.waiters:
                for server, impl, urls in impls:
                    label = self._impl_label(server, impl, urls)
                    phases.append(
                        Phase(
                            f"contended ({mode}): {label}, {waiters} waiters",
                            1,
                            self._contended(server, impl, urls, waiters, mode),
                        )
                    )
        return phases

    @staticmethod
    def _impl_label(server: str, impl: str, urls: list[str]) -> str:
        if impl == "asynclock-shared":
            return "asynclock Redis, one coordinator"
        if impl != "asynclock":
            return peer_label(impl, len(urls))
        return {
            "redis": "asynclock Redis",
            "redlock": f"asynclock Redlock {len(urls)} nodes",
            "postgres": "asynclock PostgreSQL",
        }[server]

    # -- running -----------------------------------------------------------------------

    async def run(self, progress: Progress, prefix: str = "") -> RunRecord:
        """Go through every phase once; a phase that fails is recorded and skipped."""
        record = RunRecord()
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()

        def on_background_error(_loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
            # Peers leave tasks behind when a wait is cancelled or a node is frozen; their
            # complaints go to the report, not over the progress bar.
            exc = ctx.get("exception")
            text = describe_error(exc) if exc is not None else str(ctx.get("message"))
            if len(record.background_errors) < 20:
                record.background_errors.append(text)

        loop.set_exception_handler(on_background_error)
        try:
            for phase in self.phases():
                progress.phase(prefix + phase.label)
                done = 0

                def tick() -> None:
                    nonlocal done
                    if done < phase.units:  # noqa: B023 - the loop waits for each phase
                        done += 1
                        progress.advance()

                try:
                    await phase.run(record, tick)
                except Exception as exc:
                    record.failed[phase.label] = describe_error(exc)
                    progress.note(f"{phase.label}: failed: {describe_error(exc)}")
                progress.advance(phase.units - done)
        finally:
            loop.set_exception_handler(previous)
        _ratios(record.rows)
        record.seconds = time.perf_counter() - started
        return record

    async def _peer(self, record: RunRecord, kind: str, urls: list[str], key: str) -> Peer | None:
        """Build a peer and try it once (bounded); None (and a reason) if it cannot run."""
        label = peer_label(kind, len(urls))
        try:
            peer = build_peer(kind, urls, key, bound=self.s.peer_bound)
        except PeerUnavailable as exc:
            record.unavailable[label] = str(exc)
            return None
        try:
            async with asyncio.timeout(self.s.peer_bound):
                await peer.op()
        except Exception as exc:
            record.unavailable[label] = f"failed its first acquire + release: {describe_error(exc)}"
            await self._close(peer)
            return None
        return peer

    async def _close(self, peer: Peer | Coordinator) -> None:
        closer = peer.close if isinstance(peer, Peer) else peer.aclose
        try:
            async with asyncio.timeout(self.s.peer_bound * 2):
                await closer()
        except TimeoutError:
            pass

    async def _uncontended(
        self,
        record: RunRecord,
        tick: Tick,
        server: str,
        cases: dict[str, tuple[str, str, str | None, Op]],
        *,
        section: str = "uncontended",
    ) -> None:
        """Alternating rounds over ``cases`` (id -> label, kind, floor id, op); rows out."""
        failed: dict[str, str] = {}
        samples = await run_rounds(
            {cid: case[3] for cid, case in cases.items()},
            rounds=self.s.rounds,
            per_round=self.s.per_round,
            warmup=self.s.warmup,
            peer_bound=self.s.peer_bound,
            failed=failed,
            tick=tick,
        )
        for cid, (label, kind, floor, _) in cases.items():
            if cid in failed:
                record.unavailable[label] = f"failed while timed: {failed[cid]}"
                continue
            if cid not in samples:
                continue
            summary = summarize(samples[cid])
            record.rows.append(
                _row(
                    cid,
                    section=section,
                    server=server,
                    label=label,
                    kind=kind,
                    floor=floor,
                    value_key="median_us",
                    ops=summary.ops,
                    median_us=summary.median_us,
                    p99_us=summary.p99_us,
                    mean_us=summary.mean_us,
                    ops_per_s=summary.ops_per_s,
                )
            )

    async def _memory(self, record: RunRecord, tick: Tick) -> None:
        mutex = asyncio.Lock()
        coord = connect(f"memory://bench-{_uid()}")

        async def floor() -> None:
            async with mutex:
                pass

        async def with_lock() -> None:
            async with coord.lock("bench", ttl=30):
                pass

        base = "uncontended/memory/"
        try:
            await self._uncontended(
                record,
                tick,
                "memory",
                {
                    base + "floor": ("floor asyncio.Lock", "floor", None, floor),
                    base + "asynclock": (
                        "asynclock memory://",
                        "asynclock",
                        base + "floor",
                        with_lock,
                    ),
                },
            )
        finally:
            await coord.aclose()

    async def _redis(self, record: RunRecord, tick: Tick) -> None:
        from redis.asyncio import Redis

        url = self.servers.redis
        assert url is not None
        raw = Redis.from_url(url)
        coord = connect(url, prefix=f"bench{_uid()}")
        lock = coord.lock("bench:acquire", ttl=30)
        token = secrets.token_hex(16)
        floor_key = f"bench:floor:{_uid()}"

        async def ping() -> None:
            await raw.ping()

        async def set_del() -> None:
            await raw.set(floor_key, token, nx=True, px=30_000)
            await raw.delete(floor_key)

        async def with_lock() -> None:
            async with coord.lock("bench:with", ttl=30):
                pass

        async def acquire_release() -> None:
            lease = await lock.acquire()
            await lease.release()

        base = "uncontended/redis/"
        floor = base + "floor"
        cases: dict[str, tuple[str, str, str | None, Op]] = {
            base + "ping": ("PING", "reference", None, ping),
            floor: ("floor SET NX PX + DEL", "floor", None, set_del),
            base + "asynclock": ("asynclock async with", "asynclock", floor, with_lock),
            base + "asynclock-acquire": (
                "asynclock acquire() + release()",
                "asynclock",
                floor,
                acquire_release,
            ),
        }
        peers: list[Peer] = []
        try:
            if self.plan.peers:
                for kind in (
                    "redis-py",
                    "redis-py-1ms",
                    "python-redis-lock",
                    "pottery",
                    "aioredlock",
                ):
                    peer = await self._peer(record, kind, [url], f"bench-{kind}-{_uid()}")
                    if peer is not None:
                        peers.append(peer)
                        cases[f"{base}{kind}"] = (peer.label, "peer", floor, peer.op)
            await self._uncontended(record, tick, "redis", cases)
        finally:
            for peer in peers:
                await self._close(peer)
            await coord.aclose()
            await raw.aclose()

    async def _redlock(self, record: RunRecord, tick: Tick) -> None:
        urls = self.servers.redlock
        n = len(urls)
        single = connect(urls[0], prefix=f"bench{_uid()}")
        redlock = connect(urls, prefix=f"bench{_uid()}", node_timeout=self.s.node_timeout)

        async def single_op() -> None:
            async with single.lock("bench", ttl=30):
                pass

        async def redlock_op() -> None:
            async with redlock.lock("bench", ttl=30):
                pass

        base = "uncontended/redlock/"
        floor = base + "floor"
        cases: dict[str, tuple[str, str, str | None, Op]] = {
            floor: ("floor asynclock single node", "floor", None, single_op),
            base + "asynclock": (f"asynclock Redlock {n} nodes", "asynclock", floor, redlock_op),
        }
        peers: list[Peer] = []
        try:
            if self.plan.peers:
                for kind in ("pottery", "aioredlock"):
                    peer = await self._peer(record, kind, urls, f"bench-{kind}-{_uid()}")
                    if peer is not None:
                        peers.append(peer)
                        cases[f"{base}{kind}"] = (peer.label, "peer", floor, peer.op)
            await self._uncontended(record, tick, "redlock", cases)
        finally:
            for peer in peers:
                await self._close(peer)
            await single.aclose()
            await redlock.aclose()

    async def _postgres(self, record: RunRecord, tick: Tick) -> None:
        import asyncpg

        dsn = self.servers.postgres
        assert dsn is not None
        raw = await asyncpg.connect(dsn)
        coord = connect(dsn, namespace=f"bench{_uid()}")
        key = secrets.randbits(62)

        async def floor_op() -> None:
            await raw.fetchval("SELECT pg_try_advisory_lock($1)", key)
            await raw.fetchval("SELECT pg_advisory_unlock($1)", key)

        async def with_lock() -> None:
            async with coord.lock("bench:uncontended", ttl=30):
                pass

        base = "uncontended/postgres/"
        try:
            await self._uncontended(
                record,
                tick,
                "postgres",
                {
                    base + "floor": (
                        "floor pg_try_advisory_lock + unlock",
                        "floor",
                        None,
                        floor_op,
                    ),
                    base + "asynclock": (
                        "asynclock async with",
                        "asynclock",
                        base + "floor",
                        with_lock,
                    ),
                },
            )
        finally:
            await coord.aclose()
            await raw.close()

    async def _postgres_queued(self, record: RunRecord, tick: Tick) -> None:
        """Hand-off with one waiter queued in the server's lock queue, raw asyncpg first."""
        import asyncpg

        dsn = self.servers.postgres
        assert dsn is not None
        raw = await asyncpg.connect(dsn)
        raw2 = await asyncpg.connect(dsn)
        coord = connect(dsn, namespace=f"bench{_uid()}")
        key = secrets.randbits(62)
        try:

            async def raw_hold() -> None:
                await raw.fetchval("SELECT pg_advisory_lock($1)", key)

            async def raw_wait() -> int:
                await raw2.fetchval("SELECT pg_advisory_lock($1)", key)
                granted = time.perf_counter_ns()
                await raw2.fetchval("SELECT pg_advisory_unlock($1)", key)
                return granted

            async def raw_release() -> None:
                await raw.fetchval("SELECT pg_advisory_unlock($1)", key)

            held: list[Lease] = []

            async def lock_hold() -> None:
                held.append(await coord.lock("bench:handoff", ttl=30).acquire())

            async def lock_wait() -> int:
                lease = await coord.lock("bench:handoff", ttl=30).acquire()
                granted = time.perf_counter_ns()
                await lease.release()
                return granted

            async def lock_release() -> None:
                await held.pop().release()

            raw_id = "strict/postgres/1/raw"
            for cid, label, kind, floor, hold, wait, release in (
                (raw_id, "floor raw asyncpg", "floor", None, raw_hold, raw_wait, raw_release),
                (
                    "strict/postgres/1/asynclock",
                    "asynclock PostgreSQL",
                    "asynclock",
                    raw_id,
                    lock_hold,
                    lock_wait,
                    lock_release,
                ),
            ):
                async with asyncio.timeout(self.s.peer_bound + self.s.pg_handoffs * 0.1):
                    await _queued_handoffs(max(5, self.s.pg_handoffs // 10), hold, wait, release)
                    samples = await _queued_handoffs(self.s.pg_handoffs, hold, wait, release)
                summary = summarize(samples)
                record.rows.append(
                    _row(
                        cid,
                        section="strict",
                        server="postgres",
                        label=label,
                        kind=kind,
                        floor=floor,
                        value_key="handoff_median_us",
                        waiters=1,
                        handoffs=summary.ops,
                        handoff_median_us=summary.median_us,
                        handoff_p99_us=summary.p99_us,
                    )
                )
                tick()
        finally:
            await coord.aclose()
            await raw.close()
            await raw2.close()

    async def _ping(self, record: RunRecord, tick: Tick) -> None:
        """The PING floor alone, for contended cases run without the uncontended ones."""
        from redis.asyncio import Redis

        assert self.servers.redis is not None
        raw = Redis.from_url(self.servers.redis)
        try:
            await self._uncontended(
                record,
                tick,
                "redis",
                {"uncontended/redis/ping": ("PING", "reference", None, raw.ping)},
            )
        finally:
            await raw.aclose()

    def _contended(
        self, server: str, impl: str, urls: list[str], waiters: int, mode: str
    ) -> Callable[[RunRecord, Tick], Awaitable[None]]:
        """A contended case: ``waiters`` tasks (threads for a sync peer) on one lock.

        ``mode`` ``strict``: a worker that released waits until another one got the lock
        (every acquisition is a hand-off); ``free``: it contends again at once, and the
        share of acquisitions that went to another worker measures fairness.
        """
        strict = mode == "strict"

        async def run(record: RunRecord, tick: Tick) -> None:
            s = self.s
            key = f"bench-contended-{_uid()}"
            floor = "strict/postgres/1/raw" if server == "postgres" else "uncontended/redis/ping"
            label = self._impl_label(server, impl, urls)
            bound = 1.0  # for the waiters to finish their last wait, then they are cancelled
            coords: list[Coordinator] = []
            peer: Peer | None = None
            try:
                if impl.startswith("asynclock"):
                    target: str | list[str] = urls if server == "redlock" else urls[0]
                    shared = impl == "asynclock-shared"
                    options: dict[str, Any] = {"max_connections": waiters + 8 if shared else 8}
                    if server == "postgres":
                        options["namespace"] = f"bench{_uid()}"
                    else:
                        options["prefix"] = f"bench{_uid()}"
                    if server == "redlock":
                        options["node_timeout"] = s.node_timeout

                    def asynclock_worker(_i: int) -> Callable[[], Any]:
                        # One coordinator per waiter, as each waiter's own process has;
                        # or, "shared", one for all (tasks of one process).
                        if not (shared and coords):
                            coords.append(connect(target, **options))
                        own = coords[-1]
                        return lambda: own.lock(key, ttl=30)

                    state: Handoffs = await contend_async(
                        asynclock_worker,
                        waiters=waiters,
                        warmup=s.contended_warmup,
                        seconds=s.contended_seconds,
                        bound=bound,
                        strict=strict,
                    )
                    kind = "asynclock"
                else:
                    peer = await self._peer(record, impl, urls, key)
                    if peer is None:
                        return
                    kind = "peer"
                    if peer.hold_sync is not None and peer.nudge is not None:
                        state = await asyncio.to_thread(
                            contend_threads,
                            peer.hold_sync,
                            waiters=waiters,
                            warmup=s.contended_warmup,
                            seconds=s.contended_seconds,
                            bound=bound,
                            strict=strict,
                            nudge=peer.nudge,
                        )
                    else:
                        assert peer.hold is not None
                        state = await contend_async(
                            peer.hold,
                            waiters=waiters,
                            warmup=s.contended_warmup,
                            seconds=s.contended_seconds,
                            bound=bound,
                            strict=strict,
                        )
            finally:
                for coord in coords:
                    await self._close(coord)
                if peer is not None:
                    await self._close(peer)
            if state.errors and not state.acquisitions:
                record.unavailable[f"{label}, {waiters} waiters ({mode})"] = state.errors[0]
                return
            record.rows.append(
                _row(
                    f"{mode}/{server}/{waiters}/{impl}",
                    section=mode,
                    server=server,
                    label=label,
                    kind=kind,
                    floor=floor,
                    value_key="handoff_median_us",
                    waiters=waiters,
                    threads=peer is not None and peer.hold_sync is not None,
                    **state.result(),
                )
            )
            tick()

        return run

    async def _sync(self, record: RunRecord, tick: Tick) -> None:
        """The blocking API from a thread: floors, asynclock.sync, the blocking peers and
        the parts of asynclock.sync's cycle, in alternating rounds (see ``_sync``)."""
        url = self.servers.redis
        assert url is not None
        s = self.s
        loop = asyncio.get_running_loop()

        def tick_from_thread() -> None:
            loop.call_soon_threadsafe(tick)

        cases = await asyncio.to_thread(
            sync_uncontended,
            url,
            rounds=s.rounds,
            per_round=s.per_round,
            warmup=s.warmup,
            bound=s.peer_bound,
            peers=self.plan.peers,
            unavailable=record.unavailable,
            tick=tick_from_thread,
        )
        for cid, case in cases.items():
            summary = summarize(case.samples)
            record.rows.append(
                _row(
                    cid,
                    section=case.section,
                    server="redis",
                    label=case.label,
                    kind=case.kind,
                    floor=case.floor,
                    value_key="median_us",
                    ops=summary.ops,
                    median_us=summary.median_us,
                    p99_us=summary.p99_us,
                    mean_us=summary.mean_us,
                    ops_per_s=summary.ops_per_s,
                )
            )

    def _sync_contended(
        self, impl: str, waiters: int
    ) -> Callable[[RunRecord, Tick], Awaitable[None]]:
        """``waiters`` threads on one lock with ``impl``, strict hand-off; the ratio is
        the hand-off median over one blocking ``PING`` (``sync/redis/ping``)."""

        async def run(record: RunRecord, tick: Tick) -> None:
            s = self.s
            url = self.servers.redis
            assert url is not None
            label = sync_contended_label(impl)
            state = await asyncio.to_thread(
                sync_contended,
                url,
                impl,
                waiters=waiters,
                warmup=s.contended_warmup,
                seconds=s.contended_seconds,
                bound=1.0,
                unavailable=record.unavailable,
            )
            if state is None:
                return
            if state.errors and not state.acquisitions:
                record.unavailable[sync_unavailable_key(f"{label}, {waiters} threads")] = (
                    state.errors[0]
                )
                return
            record.rows.append(
                _row(
                    f"sync-strict/redis/{waiters}/{impl}",
                    section="sync-strict",
                    server="redis",
                    label=label,
                    kind=sync_contended_kind(impl),
                    floor="sync/redis/ping",
                    value_key="handoff_median_us",
                    waiters=waiters,
                    threads=True,
                    **state.result(),
                )
            )
            tick()

        return run

    def _primitive_target(self, server: str) -> tuple[str, dict[str, Any]]:
        """A fresh lock namespace on ``server``: the URL and ``connect()`` options."""
        if server == "memory":
            return f"memory://bench-{_uid()}", {}
        if server == "redis":
            assert self.servers.redis is not None
            return self.servers.redis, {"prefix": f"bench{_uid()}"}
        assert self.servers.postgres is not None
        return self.servers.postgres, {"namespace": f"bench{_uid()}"}

    def _primitives(self, server: str) -> Callable[[RunRecord, Tick], Awaitable[None]]:
        """Uncontended acquire + release of each primitive and of the plain lock (the
        floor) on one coordinator of ``server``, in alternating rounds. A primitive the
        backend does not support gets a row saying so."""

        async def run(record: RunRecord, tick: Tick) -> None:
            target, options = self._primitive_target(server)
            coord = connect(target, **options)
            backend = coord.backend
            plain = coord.lock("bench:plain", ttl=30)
            makers: dict[str, Callable[[], Any]] = {
                "semaphore": lambda: coord.semaphore("bench:semaphore", 5, ttl=30),
                "rwlock-read": lambda: coord.rwlock("bench:rw-read", ttl=30).read(),
                "rwlock-write": lambda: coord.rwlock("bench:rw-write", ttl=30).write(),
                "fair": lambda: coord.lock("bench:fair", ttl=30, fair=True),
            }

            def op_of(lock: Any) -> Op:
                async def op() -> None:
                    async with lock:
                        pass

                return op

            base = f"primitives/{server}/"
            floor = base + "lock"
            cases: dict[str, tuple[str, str, str | None, Op]] = {
                floor: ("plain lock (floor)", "floor", None, op_of(plain)),
            }
            unsupported: list[Row] = []
            for key, label, kind in PRIMITIVE_CASES:
                if kind in backend.kinds:
                    cases[base + key] = (label, "asynclock", floor, op_of(makers[key]()))
                else:
                    unsupported.append(
                        _row(
                            base + key,
                            section="primitives",
                            server=server,
                            label=label,
                            kind="asynclock",
                            floor=floor,
                            value_key=None,
                            supported=False,
                            note=f"{type(backend).__name__} has no {kind.value} claims",
                        )
                    )
            try:
                await self._uncontended(record, tick, server, cases, section="primitives")
            finally:
                await coord.aclose()
            record.rows += unsupported

        return run

    def _primitive_contended(
        self, server: str, fair: bool, mode: str
    ) -> Callable[[RunRecord, Tick], Awaitable[None]]:
        """:data:`PRIMITIVE_WAITERS` tasks on one lock, each with its own coordinator (as
        in its own process), ``fair`` or plain; ``mode`` as in :meth:`_contended`. The
        fair row's ratio is its hand-offs per second over the plain lock's."""

        async def run(record: RunRecord, tick: Tick) -> None:
            s = self.s
            waiters = PRIMITIVE_WAITERS
            impl = "fair" if fair else "plain"
            row_id = f"primitives-{mode}/{server}/{waiters}/{impl}"
            floor = None if not fair else f"primitives-{mode}/{server}/{waiters}/plain"
            label = "lock fair=True" if fair else "plain lock"
            target, options = self._primitive_target(server)
            if server != "memory":
                options["max_connections"] = 8
            coords: list[Coordinator] = []
            key = f"bench-primitives-{_uid()}"
            try:
                probe = connect(target, **options)
                coords.append(probe)
                if fair and Kind.FAIR not in probe.backend.kinds:
                    record.rows.append(
                        _row(
                            row_id,
                            section="primitives-contended",
                            server=server,
                            label=label,
                            kind="asynclock",
                            floor=floor,
                            value_key=None,
                            mode=mode,
                            waiters=waiters,
                            supported=False,
                            note=f"not supported by {type(probe.backend).__name__}",
                        )
                    )
                    tick()
                    return

                def worker(i: int) -> Callable[[], Any]:
                    own = probe if i == 0 else connect(target, **options)
                    if i:
                        coords.append(own)
                    if server != "memory":
                        return lambda: own.lock(key, ttl=30, fair=fair)

                    @asynccontextmanager
                    async def hold() -> AsyncIterator[None]:
                        async with own.lock(key, ttl=30, fair=fair):
                            yield
                        # Memory never suspends on a free lock: without this a releaser
                        # that contends again at once would never let the loop run.
                        await asyncio.sleep(0)

                    return hold

                state = await contend_async(
                    worker,
                    waiters=waiters,
                    warmup=s.contended_warmup,
                    seconds=s.contended_seconds,
                    bound=1.0,
                    strict=mode == "strict",
                )
            finally:
                for coord in coords:
                    await self._close(coord)
            if state.errors and not state.acquisitions:
                record.unavailable[f"{server} {label}, {waiters} waiters ({mode})"] = state.errors[
                    0
                ]
                return
            record.rows.append(
                _row(
                    row_id,
                    section="primitives-contended",
                    server=server,
                    label=label,
                    kind="asynclock",
                    floor=floor,
                    value_key="handoffs_per_s",
                    mode=mode,
                    waiters=waiters,
                    supported=True,
                    **state.result(),
                )
            )
            tick()

        return run

    async def _leases(self, record: RunRecord, tick: Tick) -> None:
        """Hold many leases on one coordinator: renewal CPU beyond an idle baseline, and
        Python memory per held lease (tracemalloc)."""
        s = self.s
        url = self.servers.redis
        assert url is not None
        n, ttl = s.leases, s.lease_ttl
        period = ttl / 3
        window = s.lease_periods * period + min(1.0, period / 10)
        batch = 256
        coord = connect(url, prefix=f"bench{_uid()}", max_connections=64)
        leases: list[Lease] = []
        try:
            # Warm: a full batch, so the pool has all its connections before we count.
            warm = await asyncio.gather(
                *(coord.lock(f"warm:{i}", ttl=ttl).acquire() for i in range(batch))
            )
            await asyncio.gather(*(lease.release() for lease in warm))
            del warm
            gc.collect()
            idle_cpu = await _cpu_over(window)
            tick()

            tracemalloc.start()
            try:
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                started = time.perf_counter()
                for first in range(0, n, batch):
                    names = range(first, min(n, first + batch))
                    leases += await asyncio.gather(
                        *(coord.lock(f"held:{i}", ttl=ttl).acquire() for i in names)
                    )
                acquire_seconds = time.perf_counter() - started
                gc.collect()
                after = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            tick()

            renewals_before = coord.stats().renewals
            busy_cpu = await _cpu_over(window)
            renewals = coord.stats().renewals - renewals_before
            held = sum(lease.held for lease in leases)
            tick()
        finally:
            for first in range(0, len(leases), batch):
                await asyncio.gather(
                    *(lease.release() for lease in leases[first : first + batch] if lease.held),
                    return_exceptions=True,
                )
            await coord.aclose()
        renewal_cpu = max(0.0, busy_cpu - idle_cpu)
        record.rows.append(
            _row(
                "leases/redis",
                section="leases",
                server="redis",
                label=f"{n:,} held leases, ttl {ttl:g} s",
                kind="asynclock",
                floor=None,
                value_key=None,
                leases=n,
                ttl_s=ttl,
                still_held=held,
                acquire_seconds=round(acquire_seconds, 2),
                window_s=round(window, 2),
                renewals=renewals,
                renewals_per_s=round(renewals / window, 1),
                cpu_percent=round(100 * renewal_cpu / window, 3),
                idle_cpu_percent=round(100 * idle_cpu / window, 3),
                cpu_us_per_renewal=round(1e6 * renewal_cpu / renewals, 1) if renewals else None,
                bytes_per_lease=round((after - before) / n),
                memory_method="tracemalloc",
            )
        )

    async def _frozen(self, record: RunRecord, tick: Tick) -> None:
        """Redlock with all nodes up, then with the last one stopped (SIGSTOP)."""
        s = self.s
        urls = self.servers.redlock
        frozen_node = self.servers.freezable[-1]
        n = len(urls)
        coord = connect(urls, prefix=f"bench{_uid()}", node_timeout=s.node_timeout)
        peers: list[Peer] = []
        try:
            async with coord.lock("warm", ttl=30):
                pass
            if self.plan.peers:
                for kind in ("pottery", "aioredlock"):
                    peer = await self._peer(record, kind, urls, f"bench-frozen-{kind}-{_uid()}")
                    if peer is not None:
                        peers.append(peer)
            for frozen in (0, 1):
                if frozen:
                    frozen_node.freeze()
                acquire_ns: list[int] = []
                cycle_ns: list[int] = []
                budget = s.peer_bound + s.frozen_ops * (4 * s.node_timeout + 0.01)
                async with asyncio.timeout(budget):
                    for _ in range(s.frozen_ops):
                        started = time.perf_counter_ns()
                        lease = await coord.lock("frozen", ttl=30).acquire()
                        acquired = time.perf_counter_ns()
                        await lease.release()
                        acquire_ns.append(acquired - started)
                        cycle_ns.append(time.perf_counter_ns() - started)
                for what, samples, label in (
                    ("acquire", acquire_ns, "acquire"),
                    ("cycle", cycle_ns, "acquire + release"),
                ):
                    summary = summarize(samples)
                    record.rows.append(
                        _row(
                            f"frozen/redlock/{frozen}/{what}",
                            section="frozen",
                            server="redlock",
                            label=f"asynclock Redlock {label}, {frozen} of {n} frozen",
                            kind="asynclock",
                            floor=f"frozen/redlock/0/{what}" if frozen else None,
                            value_key="median_us",
                            frozen=frozen,
                            node_timeout_ms=s.node_timeout * 1000,
                            ops=summary.ops,
                            median_us=summary.median_us,
                            p99_us=summary.p99_us,
                            mean_us=summary.mean_us,
                        )
                    )
            for peer in peers:
                started_s = time.perf_counter()
                try:
                    async with asyncio.timeout(s.peer_bound):
                        await peer.op()
                    took = (time.perf_counter() - started_s) * 1000
                    record.peer_outcomes[peer.label] = f"acquired and released in {took:.1f} ms"
                except TimeoutError:
                    record.peer_outcomes[peer.label] = f"did not acquire within {s.peer_bound:g} s"
                except Exception as exc:
                    record.peer_outcomes[peer.label] = f"failed: {describe_error(exc)}"
        finally:
            frozen_node.resume()
            for peer in peers:
                await self._close(peer)
            await self._close(coord)
        tick()


async def _queued_handoffs(
    n: int,
    hold: Callable[[], Awaitable[None]],
    wait: Callable[[], Coroutine[Any, Any, int]],
    release: Callable[[], Awaitable[None]],
) -> list[int]:
    """Release with a waiter queued in the server; ns from the release call to the grant."""
    samples: list[int] = []
    for _ in range(n):
        await hold()
        waiter = asyncio.create_task(wait())
        await asyncio.sleep(0.002)  # the waiter is queued in the server by now
        released = time.perf_counter_ns()
        await release()
        samples.append(await waiter - released)
    return samples


async def _cpu_over(seconds: float) -> float:
    """Process CPU seconds (all threads) spent while this task sleeps ``seconds``."""
    started = time.process_time()
    await asyncio.sleep(seconds)
    return time.process_time() - started


def _ratios(rows: list[Row]) -> None:
    """Set each row's ``ratio``: its headline latency over its floor's, same run."""
    by_id = {row["id"]: row for row in rows}
    for row in rows:
        floor = by_id.get(row["floor"]) if row["floor"] else None
        value = row.get(row["value_key"]) if row["value_key"] else None
        base = floor.get(floor["value_key"]) if floor and floor["value_key"] else None
        row["ratio"] = round(value / base, 3) if value and base else None
        if row["section"] in _P99_RATIO_SECTIONS:
            p99 = row.get("p99_us")
            base_p99 = floor.get("p99_us") if floor else None
            row["p99_ratio"] = round(p99 / base_p99, 3) if p99 and base_p99 else None


async def run_suite(plan: Plan, progress: Progress) -> list[dict[str, Any]]:
    """Run the plan ``plan.runs`` times; each run's record as a JSON-able dict."""
    suite = Suite(plan)
    loggers = [logging.getLogger(name) for name in PEER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    progress.begin(sum(p.units for p in suite.phases()) * plan.runs)
    records: list[dict[str, Any]] = []
    try:
        for i in range(plan.runs):
            prefix = f"run {i + 1}/{plan.runs}: " if plan.runs > 1 else ""
            record = await suite.run(progress, prefix)
            records.append(record.as_dict())
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        progress.end()
    return records
