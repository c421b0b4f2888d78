"""The blocking API's cases: ``asynclock.sync`` from threads, against redis-py's blocking
client and the blocking peers. Everything here blocks: the suite runs it in a worker
thread (``asyncio.to_thread``), so its own event loop stays idle meanwhile.

Uncontended, one thread times, in alternating rounds as the async cases:

- ``PING`` and the floor, ``SET key val NX PX 30000`` + ``DEL key`` (two round trips), on
  a ``redis.Redis`` client;
- ``with coord.lock(name, ttl=30):`` and ``lock.acquire()`` + ``lease.release()`` on an
  ``asynclock.sync`` coordinator (each: two hops into its loop thread);
- the blocking peers (redis-py ``Lock``, python-redis-lock, pottery ``Redlock``);
- where asynclock.sync's time goes, on the same coordinator: an empty hop
  (``Coordinator.call`` of a coroutine that does nothing); timed inside the loop thread,
  redis.asyncio's ``SET NX PX`` + ``DEL`` and the async core's ``async with lock:``
  cycle; and one hop around that whole cycle (what a hop costs when it waits for I/O).
  The blocking ``with`` is two hops (acquire, release) around the async cycle, and its
  wrappers.

Contended: threads loop acquire, hold 1 ms, release on one lock (strict: a releaser waits
until another thread got it), as in :func:`~._measure.contend_threads`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import asynclock.sync

from ._measure import (
    Handoffs,
    Op,
    SyncBatch,
    SyncHold,
    contend_threads,
    describe_error,
    round_bound,
    run_rounds_sync,
    timed,
    timed_sync,
)
from ._peers import (
    LEASE_SECONDS,
    SYNC_PEERS,
    PeerUnavailable,
    SyncPeer,
    build_sync_peer,
    sync_peer_label,
)

__all__ = (
    "CONTENDED_IMPLS",
    "CaseSamples",
    "contended",
    "contended_kind",
    "contended_label",
    "unavailable_key",
    "uncontended",
)

#: The contended implementations, in the order of the report.
CONTENDED_IMPLS = ("asynclock", "asynclock-shared", "raw-spin", *SYNC_PEERS)

_PX = LEASE_SECONDS * 1000


@dataclass(frozen=True)
class CaseSamples:
    """What one uncontended blocking case measured: its row's fields and its samples."""

    section: str
    label: str
    kind: str
    floor: str | None
    samples: list[int]


@dataclass(frozen=True)
class _Case:
    section: str
    label: str
    kind: str
    floor: str | None
    batch: SyncBatch


def unavailable_key(label: str) -> str:
    """The report's key for a blocking case that could not run (apart from async peers
    of the same name)."""
    return f"sync: {label}"


def contended_label(impl: str) -> str:
    """The name of a contended implementation in the report."""
    if impl == "asynclock":
        return "asynclock.sync, a coordinator per thread"
    if impl == "asynclock-shared":
        return "asynclock.sync, one coordinator for all threads"
    if impl == "raw-spin":
        return "raw SET NX PX retry loop, no sleep"
    return sync_peer_label(impl)


def contended_kind(impl: str) -> str:
    """The row kind of a contended implementation."""
    if impl.startswith("asynclock"):
        return "asynclock"
    return "reference" if impl == "raw-spin" else "peer"


def _try_peer(
    kind: str, url: str, key: str, bound: float, unavailable: dict[str, str]
) -> SyncPeer | None:
    """Build a blocking peer and try it once; None (and a reason) if it cannot run."""
    label = sync_peer_label(kind)
    try:
        peer = build_sync_peer(kind, url, key, bound=bound)
    except PeerUnavailable as exc:
        unavailable[unavailable_key(label)] = str(exc)
        return None
    try:
        peer.op()
    except Exception as exc:
        unavailable[unavailable_key(label)] = (
            f"failed its first acquire + release: {describe_error(exc)}"
        )
        peer.close()
        return None
    return peer


async def _noop() -> None:
    """The coroutine of an empty hop."""


async def _in_loop(op: Op, n: int, bound: float) -> list[int]:
    """Run in the loop thread: ``op`` timed ``n`` times there, bounded."""
    into: list[int] = []
    async with asyncio.timeout(bound):
        await timed(op, n, into)
    return into


def uncontended(
    url: str,
    *,
    rounds: int,
    per_round: int,
    warmup: int,
    bound: float,
    peers: bool,
    unavailable: dict[str, str],
    tick: Callable[[], None],
) -> dict[str, CaseSamples]:
    """Time every uncontended blocking case in alternating rounds; samples by row id.

    Blocks (run it in a worker thread). A peer that cannot run, or a case that failed
    while timed (see :func:`run_rounds_sync`), goes to ``unavailable`` with the reason.
    """
    import redis

    uid = secrets.token_hex(3)
    raw = redis.Redis.from_url(url, socket_timeout=bound, socket_connect_timeout=bound)
    coord = asynclock.sync.connect(url, prefix=f"bench{uid}")
    opened: list[SyncPeer] = []
    failed: dict[str, str] = {}
    base = "sync/redis/"
    floor = base + "floor"
    with contextlib.ExitStack() as stack:
        stack.callback(raw.close)
        stack.callback(coord.close)
        cases = _floor_cases(raw, base, uid)
        cases.update(
            _asynclock_cases(
                coord, url=url, base=base, floor=floor, uid=uid, bound=bound, stack=stack
            )
        )
        if peers:

            def close_peers() -> None:
                for peer in opened:
                    peer.close()

            stack.callback(close_peers)
            for kind in SYNC_PEERS:
                peer = _try_peer(kind, url, f"bench-sync-{kind}-{uid}", bound, unavailable)
                if peer is not None:
                    opened.append(peer)
                    batch = functools.partial(timed_sync, peer.op)
                    cases[base + kind] = _Case("sync", peer.label, "peer", floor, batch)
        samples = run_rounds_sync(
            {cid: case.batch for cid, case in cases.items()},
            rounds=rounds,
            per_round=per_round,
            warmup=warmup,
            peer_bound=bound,
            failed=failed,
            tick=tick,
        )
    for cid, why in failed.items():
        unavailable[unavailable_key(cases[cid].label)] = f"failed while timed: {why}"
    return {
        cid: CaseSamples(case.section, case.label, case.kind, case.floor, samples[cid])
        for cid, case in cases.items()
        if cid in samples
    }


def _floor_cases(raw: Any, base: str, uid: str) -> dict[str, _Case]:
    """``PING`` and the floor, ``SET NX PX`` + ``DEL``, on redis-py's blocking client."""
    token = secrets.token_hex(16)
    key = f"bench:sync-floor:{uid}"

    def set_del() -> None:
        raw.set(key, token, nx=True, px=_PX)
        raw.delete(key)

    return {
        base + "ping": _Case("sync", "PING", "reference", None, _blocking(raw.ping)),
        base + "floor": _Case("sync", "floor SET NX PX + DEL", "floor", None, _blocking(set_del)),
    }


def _asynclock_cases(
    coord: asynclock.sync.Coordinator,
    *,
    url: str,
    base: str,
    floor: str,
    uid: str,
    bound: float,
    stack: contextlib.ExitStack,
) -> dict[str, _Case]:
    """asynclock.sync's ``with`` and acquire + release, and the parts of its cycle: an
    empty hop, and what its loop thread does (timed there)."""
    from redis.asyncio import Redis as AsyncRedis

    with_lock = coord.lock("bench:sync-with", ttl=LEASE_SECONDS)
    by_hand = coord.lock("bench:sync-acquire", ttl=LEASE_SECONDS)
    # What the coordinator runs on: its loop thread, and the async coordinator there.
    loop_thread = coord  # Coordinator.call(): a hop into its loop thread
    in_loop_lock = coord.aio.lock("bench:sync-in-loop", ttl=LEASE_SECONDS)
    in_loop_raw = AsyncRedis.from_url(url, socket_timeout=bound, socket_connect_timeout=bound)
    token = secrets.token_hex(16)
    key = f"bench:sync-async-floor:{uid}"

    def close_in_loop() -> None:
        with contextlib.suppress(Exception):
            loop_thread.call(in_loop_raw.aclose)

    stack.callback(close_in_loop)  # before the coordinator's close stops the loop

    def with_block() -> None:
        with with_lock:
            pass

    def acquire_release() -> None:
        by_hand.acquire().release()

    def hop() -> None:
        loop_thread.call(_noop)

    def hop_around_cycle() -> None:
        loop_thread.call(async_with)

    async def async_set_del() -> None:
        await in_loop_raw.set(key, token, nx=True, px=_PX)
        await in_loop_raw.delete(key)

    async def async_with() -> None:
        async with in_loop_lock:
            pass

    def inside_loop(op: Op) -> SyncBatch:
        def batch(n: int, into: list[int]) -> None:
            into.extend(loop_thread.call(_in_loop, op, n, round_bound(n, bound)))

        return batch

    parts = base.replace("sync/", "sync-parts/")
    return {
        base + "asynclock": _Case(
            "sync", "asynclock.sync with coord.lock()", "asynclock", floor, _blocking(with_block)
        ),
        base + "asynclock-acquire": _Case(
            "sync",
            "asynclock.sync acquire() + release()",
            "asynclock",
            floor,
            _blocking(acquire_release),
        ),
        parts + "hop": _Case(
            "sync-parts",
            "empty hop: coord.call(no-op coroutine)",
            "asynclock",
            floor,
            _blocking(hop),
        ),
        parts + "async-floor": _Case(
            "sync-parts",
            "in the loop thread: redis.asyncio SET NX PX + DEL",
            "reference",
            floor,
            inside_loop(async_set_del),
        ),
        parts + "async-lock": _Case(
            "sync-parts",
            "in the loop thread: async with lock (the async core)",
            "asynclock",
            floor,
            inside_loop(async_with),
        ),
        parts + "hop-around-lock": _Case(
            "sync-parts",
            "one hop around that async with lock",
            "asynclock",
            floor,
            _blocking(hop_around_cycle),
        ),
    }


def _blocking(op: Callable[[], object]) -> SyncBatch:
    return functools.partial(timed_sync, op)


def contended(
    url: str,
    impl: str,
    *,
    waiters: int,
    warmup: float,
    seconds: float,
    bound: float,
    unavailable: dict[str, str],
) -> Handoffs | None:
    """``waiters`` threads on one lock, strict hand-off, with ``impl`` (one of
    :data:`CONTENDED_IMPLS`); None (and a reason in ``unavailable``) if it cannot run.

    Each thread has its own client or coordinator, as in its own process, except
    ``asynclock-shared``: one coordinator for all (threads of one process).
    """
    import redis

    uid = secrets.token_hex(3)
    key = f"bench-sync-contended-{uid}"
    coords: list[asynclock.sync.Coordinator] = []
    clients: list[Any] = []
    peer: SyncPeer | None = None
    nudge: Callable[[], None] = _nothing
    try:
        if impl in ("asynclock", "asynclock-shared"):
            prefix = f"bench{uid}"
            if impl == "asynclock-shared":
                coords.append(asynclock.sync.connect(url, prefix=prefix))

            def asynclock_worker(_i: int) -> SyncHold:
                if impl == "asynclock-shared":
                    own = coords[0]
                else:
                    own = asynclock.sync.connect(url, prefix=prefix)
                    coords.append(own)
                return functools.partial(own.lock, key, ttl=LEASE_SECONDS)

            make_worker: Callable[[int], SyncHold] = asynclock_worker
        elif impl == "raw-spin":

            def spin_worker(_i: int) -> SyncHold:
                own = redis.Redis.from_url(url, socket_timeout=bound, socket_connect_timeout=bound)
                clients.append(own)
                return functools.partial(_spin, own, key, secrets.token_hex(16))

            make_worker = spin_worker
        else:
            peer = _try_peer(impl, url, key, bound, unavailable)
            if peer is None:
                return None
            make_worker, nudge = peer.hold, peer.nudge
        return contend_threads(
            make_worker,
            waiters=waiters,
            warmup=warmup,
            seconds=seconds,
            bound=bound,
            strict=True,
            nudge=nudge,
        )
    finally:
        # Threads still waiting (counted in ``cancelled_at_end``) end with an error here.
        for coord in coords:
            with contextlib.suppress(Exception):
                coord.close()
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()
        if peer is not None:
            peer.close()


def _nothing() -> None:
    """Threads blocked in asynclock.sync or polling need no nudge to see the stop."""


@contextlib.contextmanager
def _spin(client: Any, key: str, token: str) -> Iterator[None]:
    """The floor's commands as a lock: ``SET NX PX`` again at once until it succeeds,
    ``DEL`` to release."""
    while not client.set(key, token, nx=True, px=_PX):
        pass
    try:
        yield
    finally:
        client.delete(key)
