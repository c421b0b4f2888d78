"""How the suite measures: per-operation timing in alternating rounds, and hand-off runs.

Every sample is one ``time.perf_counter_ns()`` difference around one operation. The
uncontended cases of one server run in alternating rounds (forward, then backward), so
that a slow moment of the machine hits every case and its floor alike. Nothing here is a
pass/fail check: numbers are reported, never asserted.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field

__all__ = (
    "STRICT_HOLD",
    "Handoffs",
    "Op",
    "Summary",
    "SyncBatch",
    "contend_async",
    "contend_threads",
    "describe_error",
    "run_rounds",
    "run_rounds_sync",
    "summarize",
    "timed",
    "timed_sync",
)

Op = Callable[[], Awaitable[object]]
"""One operation to time: an acquire + release, a round trip."""

SyncBatch = Callable[[int, list[int]], None]
"""The blocking cases' unit: ``batch(n, into)`` runs an operation ``n`` times and appends
each duration (ns) to ``into`` (:func:`timed_sync` for a blocking call; a case timed
inside an event loop thread appends what the loop measured)."""

STRICT_HOLD = 0.001
"""Seconds a holder keeps the lock in strict mode (longer than a round trip)."""

# A round of n operations may take this long per operation (on top of the peer bound)
# before the case counts as stuck: generous for a slow peer, finite for a frozen one.
_ROUND_ALLOWANCE_PER_OP = 0.02


@dataclass(frozen=True)
class Summary:
    """Median, p99, mean and throughput of a list of per-operation samples."""

    ops: int
    median_us: float
    p99_us: float
    mean_us: float
    ops_per_s: float


def summarize(samples_ns: list[int]) -> Summary:
    """The :class:`Summary` of ``samples_ns`` (nanoseconds); p99 is the nearest rank."""
    if not samples_ns:
        raise ValueError("no samples to summarize")
    ordered = sorted(samples_ns)
    n = len(ordered)
    median = statistics.median(ordered) / 1000
    p99 = ordered[min(n - 1, round(0.99 * (n - 1)))] / 1000
    mean = statistics.fmean(ordered) / 1000
    return Summary(n, round(median, 1), round(p99, 1), round(mean, 1), round(1e6 / mean, 1))


def describe_error(exc: BaseException) -> str:
    """``Type: message`` on one line, for reports."""
    text = " ".join(str(exc).split())
    if isinstance(exc, TimeoutError) and not text:
        return "TimeoutError: did not finish within its bound"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def timed(op: Op, n: int, into: list[int]) -> None:
    """Run ``op`` ``n`` times, appending each duration (ns) to ``into``."""
    clock = time.perf_counter_ns
    for _ in range(n):
        started = clock()
        await op()
        into.append(clock() - started)


def timed_sync(op: Callable[[], object], n: int, into: list[int]) -> None:
    """The blocking version of :func:`timed`."""
    clock = time.perf_counter_ns
    for _ in range(n):
        started = clock()
        op()
        into.append(clock() - started)


def round_bound(n: int, peer_bound: float) -> float:
    """How long a round of ``n`` operations may take before its case counts as stuck."""
    return peer_bound + n * _ROUND_ALLOWANCE_PER_OP


async def run_rounds(
    cases: dict[str, Op],
    *,
    rounds: int,
    per_round: int,
    warmup: int,
    peer_bound: float,
    failed: dict[str, str],
    tick: Callable[[], None],
) -> dict[str, list[int]]:
    """Warm every case up, then run them in alternating rounds; samples (ns) by case.

    A case that raises or overruns its round's bound is dropped from later rounds and
    recorded in ``failed`` with the reason; the others go on. ``tick()`` is called once
    after the warm-up and once per round.
    """
    live = dict(cases)
    samples: dict[str, list[int]] = {case: [] for case in cases}
    for case, op in list(live.items()):  # connections open, scripts loaded, caches warm
        try:
            async with asyncio.timeout(round_bound(warmup, peer_bound)):
                await timed(op, warmup, [])
        except Exception as exc:
            failed[case] = describe_error(exc)
            del live[case]
    tick()
    for i in range(rounds):
        order = list(live.items())
        if i % 2:
            order.reverse()
        for case, op in order:
            try:
                async with asyncio.timeout(round_bound(per_round, peer_bound)):
                    await timed(op, per_round, samples[case])
            except Exception as exc:
                failed[case] = describe_error(exc)
                del live[case]
        tick()
    return {case: samples[case] for case in live if samples[case]}


def run_rounds_sync(
    cases: dict[str, SyncBatch],
    *,
    rounds: int,
    per_round: int,
    warmup: int,
    peer_bound: float,
    failed: dict[str, str],
    tick: Callable[[], None],
) -> dict[str, list[int]]:
    """The blocking version of :func:`run_rounds`, for a worker thread.

    A blocking call cannot be interrupted, so the bound is checked after each batch: the
    cases' clients have socket timeouts and their locks a ``timeout``, so a stuck server
    ends a case with an error, and a case merely slower than its bound is dropped after
    that batch.
    """
    live = dict(cases)
    samples: dict[str, list[int]] = {case: [] for case in cases}

    def attempt(case: str, batch: SyncBatch, n: int, into: list[int]) -> None:
        started = time.monotonic()
        try:
            batch(n, into)
        except Exception as exc:
            failed[case] = describe_error(exc)
            del live[case]
            return
        took = time.monotonic() - started
        if took > round_bound(n, peer_bound):
            failed[case] = (
                f"{n} operations took {took:.1f} s (bound {round_bound(n, peer_bound):.1f} s)"
            )
            del live[case]

    for case, batch in list(live.items()):  # connections open, scripts loaded, caches warm
        attempt(case, batch, warmup, [])
    tick()
    for i in range(rounds):
        order = list(live.items())
        if i % 2:
            order.reverse()
        for case, batch in order:
            attempt(case, batch, per_round, samples[case])
        tick()
    return {case: samples[case] for case in live if samples[case]}


@dataclass
class Handoffs:
    """What a contended run saw: every grant, who got it, and how long after a release.

    Updated only by the task (or thread) that holds the lock under test, so the lock's
    own mutual exclusion keeps it consistent.

    In *strict* mode every acquisition is a hand-off to another waiter: a worker that
    released waits (locally, after its release call returned) until another worker got
    the lock before it contends again, and each holder keeps the lock for
    :data:`STRICT_HOLD` seconds, so that the returning worker's first try finds the
    lock taken and the next grant is up to the lock's own way of waking waiters (a
    wake-up, BLPOP, a server queue or polling), not to a try that happens to follow the
    release. The hold is not part of the hand-off latency (release call to next grant).
    """

    strict: bool = False
    holder: int = -1
    released_ns: int = 0
    grants: int = 0
    recording: bool = False
    stop: bool = False
    acquisitions: int = 0
    switches: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cancelled: int = 0
    gates: list[asyncio.Future[None]] = field(default_factory=list)
    turn: threading.Condition = field(default_factory=threading.Condition)

    def granted(self, worker: int) -> None:
        """Record a grant to ``worker``: a hand-off when the previous holder differs."""
        now = time.perf_counter_ns()
        if self.recording:
            self.acquisitions += 1
            if self.holder not in (-1, worker):
                self.switches += 1
                self.latencies_ns.append(now - self.released_ns)
        self.holder = worker
        self.grants += 1

    def releasing(self) -> None:
        """Record the moment the holder calls release (the end of its critical section)."""
        self.released_ns = time.perf_counter_ns()

    def open_gates(self) -> None:
        """Let every waiting releaser contend again (async workers)."""
        gates, self.gates = self.gates, []
        for gate in gates:
            if not gate.done():
                gate.set_result(None)

    async def next_turn(self, seen: int) -> None:
        """Strict mode: wait until someone got the lock after grant number ``seen``."""
        if self.strict and self.grants == seen and not self.stop:
            gate = asyncio.get_running_loop().create_future()
            self.gates.append(gate)
            await gate

    def next_turn_sync(self, seen: int) -> None:
        """The thread version of :meth:`next_turn`."""
        if self.strict:
            with self.turn:
                while self.grants == seen and not self.stop:
                    self.turn.wait(0.05)

    def result(self) -> dict[str, float | int]:
        """Throughput, fairness and hand-off latency as report metrics."""
        out: dict[str, float | int] = {
            "acquisitions": self.acquisitions,
            "seconds": round(self.seconds, 3),
            "acquisitions_per_s": round(self.acquisitions / self.seconds, 1),
            "handoffs_per_s": round(self.switches / self.seconds, 1),
            "different_holder_share": (
                round(self.switches / self.acquisitions, 4) if self.acquisitions else 0.0
            ),
        }
        if self.latencies_ns:
            summary = summarize(self.latencies_ns)
            out.update(
                handoffs=summary.ops,
                handoff_median_us=summary.median_us,
                handoff_p99_us=summary.p99_us,
            )
        else:
            out["handoffs"] = 0
        if self.cancelled:
            out["cancelled_at_end"] = self.cancelled
        if self.errors:
            out["errors"] = len(self.errors)
        return out


AsyncHold = Callable[[], AbstractAsyncContextManager[object]]
SyncHold = Callable[[], AbstractContextManager[object]]


async def contend_async(
    make_worker: Callable[[int], AsyncHold],
    *,
    waiters: int,
    warmup: float,
    seconds: float,
    bound: float,
    strict: bool,
) -> Handoffs:
    """``waiters`` tasks loop ``async with hold(): pass`` on one lock for ``seconds``.

    ``make_worker(i)`` gives worker ``i`` its way to hold the lock (a fresh context
    manager per acquisition). Grants are recorded only after ``warmup`` seconds. At the
    end the workers get ``bound`` seconds to finish their current wait, then are
    cancelled (a polling peer may never get its turn).
    """
    state = Handoffs(strict=strict)

    async def worker(i: int) -> None:
        hold = make_worker(i)
        try:
            while not state.stop:
                async with hold():
                    state.granted(i)
                    seen = state.grants
                    if strict:
                        state.open_gates()
                        await asyncio.sleep(STRICT_HOLD)
                    state.releasing()
                await state.next_turn(seen)
        except Exception as exc:
            state.errors.append(describe_error(exc))

    tasks = [asyncio.create_task(worker(i), name=f"bench-waiter-{i}") for i in range(waiters)]
    try:
        await asyncio.sleep(warmup)
        state.recording = True
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        state.recording = False
        state.seconds = time.perf_counter() - started
        state.stop = True
        state.open_gates()
        _, pending = await asyncio.wait(tasks, timeout=bound)
        state.cancelled = len(pending)
    finally:
        state.stop = True
        state.open_gates()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=bound)
    return state


def contend_threads(
    make_worker: Callable[[int], SyncHold],
    *,
    waiters: int,
    warmup: float,
    seconds: float,
    bound: float,
    strict: bool,
    nudge: Callable[[], None],
) -> Handoffs:
    """The thread version of :func:`contend_async`, for a synchronous lock library.

    ``nudge()`` is called while stopping, to wake threads blocked in the library's own
    wait; threads still alive after ``bound`` seconds are counted in ``cancelled`` (they
    are daemon threads, and closing their client ends them).
    """
    state = Handoffs(strict=strict)
    guard = threading.Lock()  # only for errors: two threads may fail at once

    def worker(i: int) -> None:
        hold = make_worker(i)
        try:
            while not state.stop:
                with hold():
                    with state.turn:
                        state.granted(i)
                        seen = state.grants
                        state.turn.notify_all()
                    if strict:
                        time.sleep(STRICT_HOLD)
                    state.releasing()
                state.next_turn_sync(seen)
        except Exception as exc:
            with guard:
                state.errors.append(describe_error(exc))

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"bench-waiter-{i}", daemon=True)
        for i in range(waiters)
    ]
    for thread in threads:
        thread.start()
    time.sleep(warmup)
    state.recording = True
    started = time.perf_counter()
    time.sleep(seconds)
    state.recording = False
    state.seconds = time.perf_counter() - started
    state.stop = True
    deadline = time.monotonic() + bound
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        try:
            nudge()
        except Exception as exc:  # the server went away: the threads will fail too
            state.errors.append(describe_error(exc))
            break
        time.sleep(0.02)
    state.cancelled = sum(t.is_alive() for t in threads)
    return state
