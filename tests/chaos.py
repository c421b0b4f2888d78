"""Chaos runs: many lock holders in several processes, faults on a schedule, and a history
checker that proves no two holders' fenced writes interleaved and nothing was lost.

A :class:`Scenario` names a backend (``redis``, ``redlock``, ``postgres``, ``sentinel``,
``cluster``), a fault schedule and a duration. :func:`run_scenario` starts the servers
it needs (through a :class:`~pytest_asynclock.ValkeyFactory` /
:class:`~pytest_asynclock.PostgresFactory`), a separate Valkey that holds the fenced
history resource (never faulted), fault-injecting proxies where the schedule needs them,
and ``W`` worker processes (``python -m tests.chaos worker ...``) with ``T``
tasks each. Every task loops: acquire one of a few names, append ``start``, ``op`` and
``end`` entries to that name's fenced resource with ``lease.fence``, release; it counts
leases lost, bodies cancelled, timeouts and backend errors. Tasks also give up: some
acquires have a short timeout, some are cancelled at a random moment (the first attempt,
the wait, the body), and each worker closes its coordinator at moments the parent plans
outside the fault windows, while its tasks wait and hold, and goes on with a new one.
After each close, and once every worker exited, the server is looked at: a lock or a
live waiter-queue place a closed coordinator left there is *stranded* (as is, on
PostgreSQL, an advisory lock an idle pooled session holds with no lease naming it,
watched during the run). The parent applies the
faults (server ``SIGSTOP``/``SIGCONT``, kill and restart, master failover, proxy
black-hole and latency, ``pg_terminate_backend``, a worker blocking its own event loop
past the TTL), then runs the checker over the whole history and returns a
:class:`ChaosReport`.

Everything runs on loopback; every process started is stopped by its PID, on failure too.

``python -m tests.chaos run redis --duration 20`` runs one scenario by hand
and prints its report.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import importlib
import json
import math
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pytest_asynclock.history import Entry

__all__ = (
    "BACKENDS",
    "ChaosReport",
    "Fault",
    "FaultOutcome",
    "Scenario",
    "ScenarioSkipped",
    "WorkerSummary",
    "format_reports",
    "main",
    "run_scenario",
    "scenario",
    "unsupported",
)

BACKENDS = ("redis", "redlock", "postgres", "sentinel", "cluster")
"""The backends :func:`scenario` knows."""

Backend = Literal["redis", "redlock", "postgres", "sentinel", "cluster"]

FaultKind = Literal[
    "freeze",  # SIGSTOP the server(s) for `duration`, then SIGCONT
    "kill",  # SIGKILL the server(s), restart them after `duration` (empty for Valkey)
    "blackhole",  # the proxy swallows traffic both ways for `duration`
    "latency",  # the proxy delays every chunk by `latency` seconds for `duration`
    "reset",  # the proxy resets every open connection (clients reconnect)
    "stall",  # a worker blocks its own event loop for `duration` (time.sleep) while holding
    "terminate",  # PostgreSQL: pg_terminate_backend of every advisory lock holder (3 shots)
    "failover",  # Sentinel: SENTINEL FAILOVER; Cluster: CLUSTER FAILOVER on a replica
    "kill_master",  # Sentinel/Cluster: SIGKILL the master, wait for a promotion, restart it
    "isolate",  # cut one worker off the server (its proxy resets and refuses) for `duration`
]

Expect = Literal["loss", "impact"]
"""What a fault must visibly cause, checked in its window: ``loss`` = leases lost (or
stale writes rejected) > 0; ``impact`` = any of lost, timeouts, errors, stale > 0."""

_WORKER_MODULE = "tests.chaos"
_GO = b"go\n"
_READY = "ready"
_STALL_SIGNAL = signal.SIGUSR1
# A stalled worker blocks its loop for this many TTLs, in the first section it writes in
# after the signal, or idle after _STALL_IDLE seconds without one.
_STALL_TTLS = 1.5
_STALL_IDLE = 3.0
# A stall's own loss reaches its body (or its write is refused) right after the stall:
# a loss later than this after its end is not the stall's (see _stall_counts).
_STALL_SLACK = 0.5

# The share of critical sections that hold across renewals (1.5 TTL, three writes).
_LONG_SECTIONS = 0.05
# Faults that may lose a lock by design (a server restarted empty, an asynchronous
# replica promoted, a session killed): two holders may then believe at once, and only
# the fence keeps the resource safe. Overlaps in time inside their windows are counted
# apart (``tolerated``), as the documented limits, not as violations.
_LOSES_LOCKS = frozenset({"kill", "kill_master", "failover", "terminate"})
# On PostgreSQL a session's locks end with its connection (terminated, or cut off by the
# worker's proxy). The server frees them as the session ends, the holder hears of it as
# its connection ends (asyncpg's termination listener) and its body is cancelled: a gap
# of a few milliseconds, no longer up to ttl/3, in which a waiter's grant can land.
_LOSES_LOCKS_ON = {"postgres": _LOSES_LOCKS | {"isolate"}}
# Give-ups: the share of attempts made with a short timeout (1-50 ms), and the share
# cancelled at a random moment: during the first attempt, during the wait (which may land
# on the grant itself), or inside the body once granted (in a write, a pause, the release).
_GIVEUP_TIMEOUT = 0.08
_GIVEUP_CANCEL = 0.08
_GIVEUP_PHASES = ("attempt", "wait", "body")
# Each worker closes its coordinator this often (seconds, uniform) while its tasks wait
# and hold, and goes on with a new one: at moments the parent plans outside the windows
# of faults that must show an effect (a close would end the leases the fault must make
# lost), and not in the last seconds of the run.
_CLOSE_EVERY = (2.0, 6.0)
# A close begun inside a fault (latency: every request slower) took up to 2.2 s (idle
# machine, 100 ms latency): this far from the next window that must show an effect.
_CLOSE_SLOW = 3.0
# Sentinel and Cluster: how often the parent asks every data node its role (a pause
# between rounds). A replica that becomes a master when no fault asked for it (the
# cluster's own failure detector, with cluster-node-timeout 1 s, on a machine too busy to
# answer its pings in time) loses locks as a planned failover does: its window counts as
# lossy for the names it serves if it answered as a replica at most _PROMOTION_GAP
# before (the window is then short), and the report says so either way.
_ROLE_POLL = 0.25
_PROMOTION_GAP = 1.0
# A terminate fault shoots this many times (see _Faults._terminate).
_TERMINATE_SHOTS = 3
# How long after a coordinator closed its sessions may still show on the server
# (PostgreSQL ends a closed connection's backend asynchronously). On Redis nothing can
# give back anything once aclose() returned: a lock key or a live queue place of the
# closed coordinator seen then is stranded, even if its TTL ends it later.
_GIVE_BACK = 2.0
# Stale writes and fenced-off sections a run may have without it being a problem: a few
# per fault (a stalled or frozen holder is fenced off by design), plus one per 1,000
# sections.
_STALE_PER_FAULT = 3
# The redis scenario's server runs its clock this much fast (libfaketime, where it is
# installed): inside what the drift allowance absorbs (ttl * 0.01 + 2 ms: a 1 s lease is
# kept 0.992 s of true time and believed at most 0.988 s), so the run must stay clean.
WITHIN_DRIFT = 1.008
# Before each of its writes but the first, a section calls lease.extend() with this
# chance, with a random TTL between these multiples of the run's TTL. Never longer than
# the run's TTL: a stall (1.5 x TTL) must cost every lease it froze, and a lease
# extended past the stall would rightly survive it (the run would call the fault unfelt).
_EXTEND_SHARE = 0.3
_EXTEND_TTLS = (0.5, 1.0)
# An extend() that failed (outcome unknown) is tried again this many times in all.
_EXTEND_TRIES = 6
# While a lease is held its worker reads the server's expiry of it (GET + PTTL, on a
# direct connection no proxy fault cuts) at the grant, after each extend(), and this many
# times per TTL in between (so around every renewal), each read bounded by half a TTL.
_SAMPLES_PER_TTL = 8
# Renewal headroom: renewals go out every ttl/3, so outside faults a held lease's local
# validity stays above 2/3 of its TTL less a round trip; below a quarter, its renewal came
# more than a whole interval late.
_HEADROOM = 0.25
# Losses of leases and late renewals outside every fault's window a run may have: the
# machine (2 shared cores) may pause a worker's event loop for most of a TTL now and
# then; one such pause per worker costs at most one lease per name.
_ALLOWED_PAUSES_PER_WORKER = 1
# Hand-off: a release wakes the next waiter, which tries at once: one round trip for the
# release, one for the grant, plus a loop turn in each process. Without a wake-up a
# waiter retries after a backoff step (a uniform draw below 10 ms doubled per refusal, up
# to the retry's maximum of 1 s), or when the holder's lease would end. The p99 of
# release-to-next-grant outside fault windows must stay under this share of the TTL: far
# above a loaded machine's round trips, far below a backoff-paced hand-off. Redlock's
# waiters do not queue: after each wake-up they race for the nodes, and split votes back
# off by a retry step, so its bound is looser.
_HANDOFF_P99_TTLS = 0.1
_HANDOFF_P99_TTLS_REDLOCK = 0.3
# ... or this many of the run's own round trips (the p99 of the workers' expiry reads,
# on direct connections), when that is more: on a loaded machine every round trip and
# loop turn grows, and the bound grows with them (a fixed bound there is a timing test of
# the machine, not of the lock); a backoff-paced hand-off still stands out.
_HANDOFF_RTTS = 10
# At least this many hand-offs outside fault windows for a p99 to be judged.
_HANDOFF_MIN = 50


class ScenarioSkipped(RuntimeError):
    """The scenario cannot run here (the message says why): a backend asynclock does not
    accept yet, or a server that cannot be started."""


# --------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` at ``at`` seconds into the run, lasting ``duration`` seconds.

    ``targets`` picks servers (indices into the scenario's faultable servers; Redlock's
    five nodes) or, for ``stall`` and ``isolate``, the worker index. ``expect`` says
    what the fault must visibly cause (see :data:`Expect`); None asserts nothing.
    """

    at: float
    kind: FaultKind
    duration: float = 0.0
    targets: tuple[int, ...] = (0,)
    latency: float = 0.0
    expect: Expect | None = None

    def describe(self) -> str:
        """``freeze[0] 2.0s`` etc."""
        what = f"{self.kind}{list(self.targets)}"
        if self.kind == "latency":
            what += f" {self.latency * 1000:.0f}ms"
        if self.duration:
            what += f" {self.duration:g}s"
        return what


@dataclass(frozen=True)
class Scenario:
    """A backend, a fault schedule and a duration; the load is ``workers`` x ``tasks``
    tasks contending for ``names`` lock names with ``ttl`` and ``timeout``."""

    name: str
    backend: Backend
    faults: tuple[Fault, ...]
    duration: float = 60.0
    workers: int = 4
    tasks: int = 16
    names: int = 4
    ttl: float = 1.0
    timeout: float = 3.0
    hold: float = 0.01
    """Sleep between the entries a holder writes (so a section spans some time)."""
    proxy: bool = False
    """Clients reach the server(s) through a fault-injecting proxy."""
    nodes: int = 1
    """Faultable servers (5 for Redlock)."""
    patch: str | None = None
    """``module:function`` each worker calls before it starts: a deliberately broken lock
    for mutation testing (the runner must then report problems)."""
    package: str | None = None
    """A folder holding a copy of the ``asynclock`` package that the workers import
    instead of this one (a copy with a planted mutant); the checks run on this one."""
    clock_rate: float = 1.0
    """How fast the (single) Redis server's clock runs (libfaketime; 1.0: the machine's)."""


_FULL: dict[str, tuple[Fault, ...]] = {
    "redis": (
        Fault(3, "freeze", 2.0, expect="loss"),
        Fault(9, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(14, "kill", 0.5, expect="impact"),
        Fault(21, "blackhole", 2.0, expect="loss"),
        Fault(28, "latency", 3.0, latency=0.15),
        Fault(35, "stall", 1.5, targets=(1,), expect="loss"),
        Fault(40, "kill", 0.0, expect="impact"),
        Fault(46, "freeze", 1.5, expect="loss"),
        Fault(52, "reset"),
        Fault(55, "isolate", 1.5, targets=(1, 2), expect="impact"),
    ),
    "redlock": (
        Fault(3, "freeze", 2.0, targets=(0, 1)),
        Fault(8, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(13, "kill", 0.0, targets=(2, 3)),
        Fault(19, "freeze", 2.0, targets=(1, 2, 3), expect="impact"),
        Fault(27, "stall", 1.5, targets=(1,), expect="loss"),
        Fault(33, "kill", 1.2, targets=(0, 4)),
        Fault(40, "freeze", 1.5, targets=(3, 4)),
        Fault(46, "stall", 1.5, targets=(2,), expect="loss"),
        Fault(51, "kill", 1.2, targets=(0, 1, 2), expect="impact"),
    ),
    "postgres": (
        Fault(3, "freeze", 2.0, expect="loss"),
        Fault(9, "terminate", expect="loss"),
        Fault(14, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(21, "blackhole", 2.0, expect="loss"),
        Fault(28, "latency", 3.0, latency=0.1),
        Fault(35, "terminate", expect="loss"),
        Fault(41, "stall", 1.5, targets=(1,), expect="loss"),
        Fault(48, "freeze", 1.5, expect="loss"),
        Fault(54, "isolate", 1.5, targets=(2,), expect="impact"),
    ),
    "sentinel": (
        Fault(3, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(8, "failover", expect="impact"),
        Fault(20, "kill_master", expect="impact"),
        Fault(33, "stall", 1.5, targets=(1,), expect="loss"),
        Fault(38, "failover", expect="impact"),
    ),
    "cluster": (
        Fault(5, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(8, "kill_master", targets=(0,), expect="impact"),
        Fault(20, "failover", targets=(1,)),  # graceful: may go unnoticed, as it should
        Fault(33, "stall", 1.5, targets=(1,), expect="loss"),
        Fault(38, "kill_master", targets=(2,), expect="impact"),
    ),
}

# About 20 s: one fault of each kind, spaced so that each one's window (its length plus
# TTL + 1 s) mostly stays its own.
_SHORT: dict[str, tuple[Fault, ...]] = {
    "redis": (
        Fault(2, "freeze", 2.0, expect="loss"),
        Fault(5.5, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(8.5, "kill", 0.5, expect="impact"),
        Fault(11.5, "blackhole", 2.0, expect="loss"),
        Fault(15, "latency", 2.0, latency=0.15),
        Fault(17.5, "isolate", 1.5, targets=(1, 2), expect="impact"),
        Fault(19.3, "reset"),
    ),
    "redlock": (
        Fault(2, "freeze", 2.0, targets=(0, 1)),
        Fault(5.5, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(8.5, "freeze", 2.0, targets=(1, 2, 3), expect="impact"),
        Fault(12.5, "kill", 0.0, targets=(2, 3)),
        Fault(15.5, "kill", 1.2, targets=(0, 1, 2), expect="impact"),
    ),
    "postgres": (
        Fault(2, "freeze", 2.0, expect="loss"),
        Fault(5.5, "terminate", expect="loss"),
        Fault(8, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(11, "blackhole", 2.0, expect="loss"),
        Fault(14, "latency", 1.5, latency=0.1),
        Fault(16, "terminate", expect="loss"),
        Fault(18, "isolate", 1.5, targets=(2,), expect="impact"),
    ),
    "sentinel": (
        Fault(2, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(5, "failover", expect="impact"),
        Fault(11, "kill_master", expect="impact"),
        Fault(17, "stall", 1.5, targets=(1,), expect="loss"),
    ),
    "cluster": (
        # Not before 3 s: the workers' cluster clients first learn the slot map.
        Fault(3, "kill_master", targets=(0,), expect="impact"),
        Fault(8.5, "stall", 1.5, targets=(0,), expect="loss"),
        Fault(12, "failover", targets=(1,)),  # graceful: may go unnoticed, as it should
        Fault(17, "stall", 1.5, targets=(1,), expect="loss"),
    ),
}


def scenario(backend: str, duration: float = 60.0) -> Scenario:
    """The standard chaos scenario for ``backend`` (one of :data:`BACKENDS`).

    ``duration`` 60 s (or more) runs the full schedule; shorter runs (at least 20 s) run
    the short schedule, one fault of each kind in the first 20 s.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (accepted: {', '.join(BACKENDS)})")
    if duration < 20:
        raise ValueError(f"expected duration >= 20 s, got {duration}")
    faults = _FULL[backend] if duration >= 60 else _SHORT[backend]
    from pytest_asynclock.servers import find_faketime  # noqa: PLC0415

    fast = backend == "redis" and find_faketime() is not None
    return Scenario(
        backend,
        backend,  # type: ignore[arg-type]  # checked against BACKENDS above
        faults,
        duration=duration,
        proxy=backend in ("redis", "postgres"),
        nodes=5 if backend == "redlock" else 1,
        clock_rate=WITHIN_DRIFT if fast else 1.0,
    )


# --------------------------------------------------------------------------------------
# Results


@dataclass
class WorkerSummary:
    """What one worker process counted (printed as JSON on its stdout at the end)."""

    worker: int
    attempts: int = 0
    acquired: int = 0
    completed: int = 0
    """Sections whose three entries were all accepted."""
    leases_lost: int = 0
    cancelled: int = 0
    """Bodies cancelled by a loss (``LockLost`` chained from ``CancelledError``)."""
    timeouts: int = 0
    errors: int = 0
    """``BackendError`` (``QuorumError`` included) while acquiring or releasing."""
    rejected: int = 0
    """Entries the fenced resource refused (the holder's fence was stale)."""
    history_errors: int = 0
    """Appends that failed (the history server is not faulted: must stay 0)."""
    stalls: int = 0
    writes: int = 0
    """Writes sent to the fenced resources (each must come back as an ack or an error,
    or be cut short by the body's cancellation)."""
    cut_writes: int = 0
    """Writes whose body was cancelled (a loss) before the resource answered."""
    late_entries: int = 0
    """Bodies entered with no validity left (``lease.expires_in`` 0 at the grant)."""
    late_grants: int = 0
    """Grants the coordinator gave back for arriving too late (``stats().late_grants``)."""
    grants: list[list[Any]] = field(default_factory=list)
    """Every acquisition (:meth:`history.Grant.to_list`)."""
    acks: dict[str, str] = field(default_factory=dict)
    """Per lock name, the acks the resource gave (:func:`history.dump_acks` JSON)."""
    events: list[tuple[float, str]] = field(default_factory=list)
    """(monotonic time, what) of losses, timeouts, errors, rejections and stalls."""
    giveup_timeouts: int = 0
    """Acquires with a short timeout (a give-up) that timed out."""
    giveup_cancels: dict[str, int] = field(default_factory=dict)
    """Attempts cancelled on purpose, by where the cancel was aimed (attempt, wait, body)."""
    interrupted: int = 0
    """Sections whose body a give-up cancel or the coordinator's close ended."""
    closes: int = 0
    """Times the worker closed its coordinator mid-run (and went on with a new one)."""
    closed_acquires: int = 0
    """Acquires ended by their coordinator's close (``CoordinatorClosed``)."""
    closed_losses: int = 0
    """Leases ended by their coordinator's close (``LockLost``)."""
    ends: list[list[Any]] = field(default_factory=list)
    """``[name, fence, holder, time]`` of sections that stopped without an ``end`` entry
    (a give-up cancel in the body, or the close): the holder believed until then."""
    close_checks: list[list[Any]] = field(default_factory=list)
    """Per close: ``[began, closed, identity, final, leftovers, errors]`` (monotonic
    times aclose() began and returned; what the server still had of that coordinator
    after it)."""
    extends: int = 0
    """``lease.extend()`` calls made inside sections."""
    extends_refused: int = 0
    """Of those, refused (``LockNotOwned``: the lease is lost)."""
    extend_errors: int = 0
    """Of those, failed (``BackendError``: outcome unknown, the lease stays held)."""
    samples_straddled: int = 0
    """Expiry samples not judged: an ``extend()`` of the lease ran while the server was
    read (see :class:`_Sampler`)."""
    releases: list[list[Any]] = field(default_factory=list)
    """``[name, fence, time]`` of each section whose block then released the lock without
    an error, ``time.time()`` as the body ended (the release request left then)."""
    samples: list[list[Any]] = field(default_factory=list)
    """The server's expiry of held leases, as read by :class:`_Sampler` (see there)."""


@dataclass
class FaultOutcome:
    """A fault as applied, and what was seen in its window (start to end + TTL + 1 s)."""

    fault: Fault
    started: float
    ended: float
    counts: dict[str, int]
    error: str | None = None

    def satisfied(self) -> bool:
        """Whether the fault caused what it must (always True without ``expect``)."""
        if self.error is not None:
            return False
        lost = self.counts.get("lost", 0) + self.counts.get("rejected", 0)
        if self.fault.expect == "loss":
            return lost > 0
        if self.fault.expect == "impact":
            return lost + self.counts.get("timeout", 0) + self.counts.get("error", 0) > 0
        return True


@dataclass
class ChaosReport:
    """The outcome of one scenario run.

    ``operations`` is every write attempt on the fenced resources (accepted or not),
    ``sections`` the critical sections with an accepted start, ``stale_rejected`` the
    writes refused for a stale fence, ``fenced_off`` the sections cut short that way.
    ``violations`` (two holders at once: accepted writes interleaving, or one writing
    while another still believed its lease valid; fences going back; a write accepted
    from a holder that knew its lease lost; holes in the log) and ``lost`` (acknowledged
    writes missing) must be 0. :attr:`problems` lists every failed check: also grants
    whose fences repeat or go back, bodies entered with no validity, stale writes
    (those decided after a loss included) plus fenced-off sections above
    ``stale_budget``, fewer than
    90 % of acquired sections completed, acks that do not match the writes, and faults
    that caused nothing. ``tolerated`` counts two holders believing at once inside the
    window of a fault that may lose a lock by design (a restart empty, a failover, a
    killed session): the fence is then what keeps the resource safe.
    """

    scenario: str
    duration: float
    workers: int
    tasks: int
    operations: int
    sections: int
    completed: int
    acquired: int
    leases_lost: int
    cancelled: int
    timeouts: int
    errors: int
    stale_rejected: int
    fenced_off: int
    violations: int
    lost: int
    history_errors: int
    stalls: int
    faults: list[FaultOutcome]
    details: list[str] = field(default_factory=list)
    """The checker's messages on each violation or loss (the first few per name)."""
    writes: int = 0
    """Writes the holders sent (each must come back as an ack, a history error, or be
    cut short by the body's cancellation: ``cut_writes``)."""
    cut_writes: int = 0
    acks: int = 0
    writes_after_loss: int = 0
    """Entries (accepted or not) written with the lease marked lost, or a section's first
    one with its validity spent: the body went on after it knew. Not the writes a late
    event loop resumed with the validity just spent before the watchdog's timer ran
    (the fence orders those: they count as stale, against ``stale_budget``). A body
    entered spent counts here (its first write) and in ``late_entries``."""
    after_loss_details: list[str] = field(default_factory=list)
    """The first few of those, each with whether the fence accepted it."""
    grant_violations: int = 0
    late_entries: int = 0
    late_grants: int = 0
    tolerated: int = 0
    stale_budget: int = 0
    budgeted: int = 0
    """Stale writes plus fenced-off sections outside the windows of faults that lose
    locks by design: held to ``stale_budget``."""
    interrupted: int = 0
    """Acquired sections a give-up cancel or a close of their coordinator ended."""
    giveups: int = 0
    """Acquires given up on purpose: short timeouts that ran out, and cancels."""
    closes: int = 0
    """Coordinators closed mid-run by their workers (each went on with a new one)."""
    stranded: int = 0
    """Locks and live waiter-queue places left on the server by a closed coordinator
    (checked after each aclose() and, for the whole run, once every worker exited)."""
    stranded_details: list[str] = field(default_factory=list)
    stranded_excused: int = 0
    """Leftovers of closes inside a fault's window (the server was unreachable): the TTL
    ends them, as documented."""
    excused_details: list[str] = field(default_factory=list)
    probe_errors: list[str] = field(default_factory=list)
    """Looks at the server after a close that failed (outside fault windows)."""
    promotions: list[str] = field(default_factory=list)
    """Sentinel and Cluster: replicas the run saw become masters outside the window of
    every fault that loses locks (the servers' own failure detection), and a line if the
    role watcher stopped. A promotion seen within a second of the node's last answer as
    a replica makes a window, from that answer to TTL + 1 s after its first as a master,
    in which two holders of the names it serves are ``tolerated``; the line says which
    names, or that nothing was excused."""
    clock_rate: float = 1.0
    """How fast the scenario asked the Redis server's clock to run."""
    clock_rates: list[float] = field(default_factory=list)
    """Per sampled server, how fast its clock ran against the machine's, as measured
    (its ``TIME`` read at the start and the end of the run, each bracketed by the
    reader's clock); the lower bound of the measurement, which expiries are turned into
    the machine's time with."""
    clock_errors: list[str] = field(default_factory=list)
    """Sampled servers whose clock could not be measured (then taken as true)."""
    samples: int = 0
    """Reads of the server's expiry of held leases (at grants, renewals and extends)."""
    belief_violations: int = 0
    """Samples in which a lease believed itself valid past the latest moment the server
    (Redlock: a majority of nodes) could still keep it: its expiry read with ``PTTL``,
    counted from the reply (the read ran before it) plus 1 ms (PTTL is whole ms), turned
    into the machine's time at the server's measured clock rate; or the moment of the
    reply itself when the key no longer held the lease's token. A node that did not
    answer bounds nothing. Not counted (``belief_excused``) when a fault that loses locks
    by design (a restart empty, a failover, a killed session) came between the lease's
    last confirmation known to its worker (its acquire or its last ``extend()``, from
    before the request) and the sample."""
    belief_excused: int = 0
    belief_details: list[str] = field(default_factory=list)
    late_renewals: int = 0
    """Periodic samples, outside every fault's window, of a lease with less than
    ``_HEADROOM`` of its TTL of validity left: its renewal (due every ttl/3) came more
    than a whole interval late. Held to ``loss_ceiling``."""
    late_renewal_details: list[str] = field(default_factory=list)
    losses_outside: int = 0
    """Leases lost outside every fault's window (a loss's cancel cut the body, or the
    block raised ``LockLost``; a coordinator's own close not counted)."""
    loss_details: list[str] = field(default_factory=list)
    loss_ceiling: int = 0
    """The most ``losses_outside`` (and ``late_renewals``) a run may have: one pause of
    an event loop per worker (``_ALLOWED_PAUSES_PER_WORKER``), each costing at most one
    lease per name: ``workers x names``."""
    handoffs: int = 0
    """Releases outside every fault's (and close's) window with a waiter for the name."""
    handoff_p99: float = 0.0
    """The 99th percentile of release-to-next-grant over those (seconds)."""
    handoff_bound: float = 0.0
    """The most ``handoff_p99`` may be: 0.1 x TTL (0.3 x TTL on Redlock), or ten of the
    run's own p99 round trips when that is more (judged from ``_HANDOFF_MIN`` hand-offs
    on; see ``_HANDOFF_P99_TTLS`` and ``_HANDOFF_RTTS``)."""
    extends: int = 0
    extends_refused: int = 0
    extend_errors: int = 0
    samples_straddled: int = 0
    first_seen: dict[str, float] = field(default_factory=dict)
    """Per property of these checks (``belief-vs-server``, ``renewal-headroom``,
    ``loss-ceiling``, ``handoff-p99``) that failed, the seconds after the start of the
    run its first case was seen (for ``handoff-p99``: of the first hand-off over the
    bound)."""

    @property
    def problems(self) -> list[str]:
        """Every check that failed: violations, losses, history errors, idle faults."""
        out: list[str] = []
        out.extend(self._server_problems())
        if self.violations:
            out.append(f"{self.violations} violation(s): {self.details[:5]}")
        if self.lost:
            out.append(f"{self.lost} acknowledged write(s) lost")
        if self.history_errors:
            out.append(f"{self.history_errors} append(s) to the history failed")
        if self.completed == 0:
            out.append("no critical section completed")
        if self.grant_violations:
            out.append(f"{self.grant_violations} grant(s) with a repeated or smaller fence")
        if self.late_entries:
            out.append(f"{self.late_entries} bodies entered with no validity left")
        if self.writes_after_loss:
            out.append(
                f"{self.writes_after_loss} entries written after their writer knew its "
                f"lease lost or spent (accepted or not): {self.after_loss_details}"
            )
        if self.budgeted > self.stale_budget:
            out.append(
                f"{self.budgeted} stale writes and fenced-off sections outside the windows "
                f"of faults that lose locks > the budget of {self.stale_budget}"
            )
        if self.stranded:
            out.append(
                f"{self.stranded} lock(s) or queue place(s) stranded on the server after "
                f"aclose(): {self.stranded_details[:5]}"
            )
        if self.probe_errors:
            out.append(f"could not look at the server after a close: {self.probe_errors[:3]}")
        if self.acquired and self.completed < 0.9 * (self.acquired - self.interrupted):
            out.append(
                f"only {self.completed} of {self.acquired - self.interrupted} acquired "
                "sections completed (not counting those a give-up or a close ended)"
            )
        if self.writes != self.acks + self.history_errors + self.cut_writes:
            out.append(
                f"{self.writes} writes sent but {self.acks} acks, {self.history_errors} "
                f"errors and {self.cut_writes} cut short by a cancel came back"
            )
        out.extend(
            f"fault {o.fault.describe()} at {o.fault.at:g}s "
            + (f"failed: {o.error}" if o.error else f"caused no {o.fault.expect}: {o.counts}")
            for o in self.faults
            if not o.satisfied()
        )
        return out

    def _server_problems(self) -> list[str]:
        """The failed checks against the server and of liveness (see the fields)."""
        out: list[str] = []
        if self.belief_violations:
            out.append(
                f"belief-vs-server: {self.belief_violations} time(s) a lease believed itself "
                f"valid past the server's expiry of it: {self.belief_details[:3]}"
            )
        if self.clock_errors:
            out.append(f"could not measure a server's clock: {self.clock_errors[:3]}")
        if self.late_renewals > self.loss_ceiling:
            out.append(
                f"renewal-headroom: {self.late_renewals} time(s) outside fault windows a "
                f"lease had under {_HEADROOM:g} of its TTL left > the ceiling of "
                f"{self.loss_ceiling}: {self.late_renewal_details[:3]}"
            )
        if self.losses_outside > self.loss_ceiling:
            out.append(
                f"loss-ceiling: {self.losses_outside} lease(s) lost outside fault windows > "
                f"the ceiling of {self.loss_ceiling}: {self.loss_details[:3]}"
            )
        if self.handoffs >= _HANDOFF_MIN and self.handoff_p99 > self.handoff_bound:
            out.append(
                f"handoff-p99: release-to-next-grant p99 {self.handoff_p99 * 1000:.0f} ms "
                f"over {self.handoffs} hand-offs outside fault windows > the bound of "
                f"{self.handoff_bound * 1000:.0f} ms"
            )
        return out

    def line(self) -> str:
        """One readable line, and one of the checks against the server and of liveness."""
        return (
            f"{self.scenario}: {self.duration:g}s {self.workers}x{self.tasks} tasks, "
            f"ops={self.operations} sections={self.sections} completed={self.completed} "
            f"leases-lost={self.leases_lost} cancelled={self.cancelled} "
            f"timeouts={self.timeouts} errors={self.errors} "
            f"stale-rejected={self.stale_rejected} fenced-off={self.fenced_off} "
            f"violations={self.violations} lost={self.lost} "
            f"after-loss={self.writes_after_loss} late-entries={self.late_entries} "
            f"late-grants={self.late_grants} tolerated={self.tolerated} "
            f"budget={self.budgeted}/{self.stale_budget} giveups={self.giveups} "
            f"closes={self.closes} stranded={self.stranded} "
            f"(excused {self.stranded_excused}) "
            f"faults-ok={sum(o.satisfied() for o in self.faults)}/{len(self.faults)}\n"
            f"  server clock x{self.clock_rate:g} (measured "
            f"{', '.join(f'x{r:.4f}' for r in self.clock_rates) or '-'}) "
            f"samples={self.samples} (straddling an extend, not judged: "
            f"{self.samples_straddled}) beyond-server={self.belief_violations} "
            f"(excused {self.belief_excused}) late-renewals={self.late_renewals} "
            f"lost-outside-faults={self.losses_outside}/{self.loss_ceiling} "
            f"handoff-p99={self.handoff_p99 * 1000:.1f}ms/{self.handoff_bound * 1000:.0f}ms "
            f"({self.handoffs}) extends={self.extends} (refused {self.extends_refused}, "
            f"failed {self.extend_errors})"
        )

    def table(self) -> str:
        """The line, then one row per fault with what was seen in its window."""
        rows = [self.line()]
        rows.append(
            f"  {'at':>6} {'fault':<26} {'took':>6} {'lost':>5} {'stale':>5} "
            f"{'tmo':>5} {'err':>5} ok"
        )
        for o in self.faults:
            c = o.counts
            rows.append(
                f"  {o.fault.at:>5.1f}s {o.fault.describe():<26} {o.ended - o.started:>5.1f}s "
                f"{c.get('lost', 0):>5} {c.get('rejected', 0):>5} {c.get('timeout', 0):>5} "
                f"{c.get('error', 0):>5} {'yes' if o.satisfied() else 'NO'}"
                + (f"  ({o.error})" if o.error else "")
            )
        rows.extend(f"  ! {detail}" for detail in self.details[:10])
        rows.extend(f"  ! after its loss: {detail}" for detail in self.after_loss_details)
        rows.extend(f"  ! stranded: {detail}" for detail in self.stranded_details[:10])
        rows.extend(f"  ! beyond the server: {detail}" for detail in self.belief_details[:5])
        rows.extend(f"  ! late renewal: {detail}" for detail in self.late_renewal_details[:3])
        rows.extend(f"  ! lost outside faults: {detail}" for detail in self.loss_details[:3])
        rows.extend(f"  ! probe: {detail}" for detail in self.probe_errors[:5])
        rows.extend(f"  (excused: {detail})" for detail in self.excused_details[:5])
        rows.extend(f"  (unplanned promotion: {detail})" for detail in self.promotions)
        return "\n".join(rows)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        data = dataclasses.asdict(self)
        data["problems"] = self.problems
        return data


def format_reports(reports: Sequence[ChaosReport]) -> str:
    """Several reports as one table (a header and a row each)."""
    rows = [
        f"{'scenario':<9} {'secs':>4} {'ops':>6} {'sect':>5} {'done':>5} {'lost':>5} "
        f"{'cancl':>5} {'tmo':>5} {'err':>5} {'stale':>5} {'fenced':>6} {'viol':>4} "
        f"{'lost-ops':>8} {'aftloss':>7} {'late':>4} {'toler':>5} {'giveup':>6} "
        f"{'closes':>6} {'strand':>6} {'faults':>6}"
    ]
    for r in reports:
        ok = sum(o.satisfied() for o in r.faults)
        rows.append(
            f"{r.scenario:<9} {r.duration:>4.0f} {r.operations:>6} {r.sections:>5} "
            f"{r.completed:>5} {r.leases_lost:>5} {r.cancelled:>5} {r.timeouts:>5} "
            f"{r.errors:>5} {r.stale_rejected:>5} {r.fenced_off:>6} {r.violations:>4} "
            f"{r.lost:>8} {r.writes_after_loss:>7} {r.late_entries:>4} {r.tolerated:>5} "
            f"{r.giveups:>6} {r.closes:>6} {r.stranded:>6} {f'{ok}/{len(r.faults)}':>6}"
        )
    return "\n".join(rows)


# --------------------------------------------------------------------------------------
# The fenced resources: one pytest_asynclock.history.FencedLog per lock name


def _log_key(namespace: str, name: str) -> str:
    return f"{namespace}:history:{name}"


# --------------------------------------------------------------------------------------
# The worker process


@dataclass
class _WorkerConfig:
    worker: int
    target: str | list[str]
    options: dict[str, Any]
    history: str
    namespace: str
    names: list[str]
    tasks: int
    duration: float
    ttl: float
    timeout: float
    hold: float
    backend: str = "redis"
    closes: list[float] = field(default_factory=list)
    """Seconds after the start at which to close the coordinator (see _close_plan)."""
    admin: str | list[str] | None = None
    """A way to the server that no proxy fault cuts (for looking after a close)."""
    sample: list[str] = field(default_factory=list)
    """Direct URLs of the Redis node(s) whose expiry of held leases is read (none: not
    read)."""


class _GiveUp:
    """One attempt to be cancelled on purpose, and whether the cancel was sent."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.task: asyncio.Task[None] | None = None
        self.fired = False
        self.handle: asyncio.TimerHandle | None = None

    def fire(self) -> None:
        if self.task is not None and not self.task.done():
            self.fired = True
            self.task.cancel()

    def arm(self, delay: float) -> None:
        self.handle = asyncio.get_running_loop().call_later(delay, self.fire)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


class _Probe:
    """Looks at the server directly for what a closed coordinator (``identity``), or
    anyone (None), left there: locks and live waiter-queue places of the run's names."""

    def __init__(self, backend: str, admin: Any, options: dict[str, Any], names: list[str]):
        self.backend = backend
        self.admin = admin
        self.options = options
        self.names = names
        self._coord: Any = None

    async def aclose(self) -> None:
        if self._coord is not None:
            with contextlib.suppress(Exception):
                await self._coord.aclose()

    async def leftovers(self, identity: str | None) -> tuple[list[str], list[str]]:
        """(leftovers, errors): looked at until clean or :data:`_GIVE_BACK` has passed.
        On Redis whatever was seen counts (nothing gives back after the close); on
        PostgreSQL what is still there at the end (sessions end asynchronously)."""
        deadline = time.monotonic() + _GIVE_BACK
        seen: dict[str, str] = {}
        errors: list[str] = []
        while True:
            try:
                async with asyncio.timeout(5):
                    found = await self._look(identity)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                found = None
            if found is not None:
                errors = []
                if self.backend == "postgres":
                    seen = found
                else:
                    for key, what in found.items():
                        seen.setdefault(key, what)  # as first seen
            if found == {} or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        return sorted(seen.values()), errors

    async def _look(self, identity: str | None) -> dict[str, str]:
        if self.backend == "postgres":
            return await _pg_leftovers(self.admin, self.options["namespace"], identity)
        import asynclock  # noqa: PLC0415

        if self._coord is None:
            self._coord = asynclock.connect(self.admin, **self.options)
        backend = self._coord.backend
        client = backend.client
        found: dict[str, str] = {}
        now_ms = time.time() * 1000
        for name in self.names:
            keys = backend.keys(name)
            value = await client.get(keys.lock)
            if value is not None:
                text = _text(value)
                owner = text.partition(":")[2] or text
                if identity is None or owner == identity:
                    pttl = await client.pttl(keys.lock)
                    found[keys.lock] = f"{name}: lock held by {owner!r} (pttl {pttl} ms)"
            for due_key in (keys.due, keys.reader_due, keys.permit_due):
                for member, due in (await client.hgetall(due_key)).items():
                    waiter = _text(member)
                    until = _text(due).partition(":")[0]
                    owner = waiter.partition(":")[2]
                    live = until.isdigit() and int(until) > now_ms
                    if live and (identity is None or owner == identity):
                        found[f"{due_key}/{waiter}"] = (
                            f"{name}: live waiter-queue place of {owner!r} "
                            f"({int(until) - now_ms:.0f} ms left)"
                        )
        return found


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


async def _pg_advisory(dsn: str) -> list[Any]:
    """Every advisory lock (held or waited for) of the other sessions, with the
    session's application_name and state."""
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        return list(
            await conn.fetch(
                "SELECT l.pid, l.classid, l.objid, l.granted, l.mode, "
                "coalesce(a.application_name, '') AS app, coalesce(a.state, '') AS state "
                "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.pid <> pg_backend_pid()"
            )
        )
    finally:
        await conn.close()


async def _pg_leftovers(dsn: str, namespace: str, identity: str | None) -> dict[str, str]:
    """Advisory locks (held or waited for) of sessions other than this one: the run's
    private server has no others; with ``identity``, only sessions named for it."""

    from asynclock.postgres import advisory_key, lock_ids  # noqa: PLC0415

    rows = await _pg_advisory(dsn)
    # Names are res0, res1, ...: map the ones the run may use back from their keys.
    by_ids = {lock_ids(advisory_key(f"res{i}", namespace)): f"res{i}" for i in range(64)}
    found: dict[str, str] = {}
    for row in rows:
        app = row["app"]
        if identity is not None and not app.endswith(f":{identity}"):
            continue
        name = by_ids.get((row["classid"], row["objid"]), f"key {row['classid']}/{row['objid']}")
        what = "held" if row["granted"] else "waited for"
        found[f"{row['pid']}/{row['classid']}/{row['objid']}/{row['mode']}"] = (
            f"{name}: advisory lock {what} by pid {row['pid']} "
            f"(application_name {app!r}, {row['state'] or 'no session'})"
        )
    return found


# KEYS[1] a lock key. Returns {its value (or false), its PTTL in ms}: in one script, so
# both are of one moment of the server.
_SAMPLE = "return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}"


class _Sampler:
    """Reads the server's expiry of a worker's held leases, to hold the leases' beliefs
    against it (checked by the parent, :func:`_beliefs`).

    Each sample is ``[name, fence, kind, sent, replied, belief, ttl, left, confirmed,
    doubted, nodes]``: ``kind`` ``grant``, ``renew`` (periodic, ``_SAMPLES_PER_TTL`` per
    TTL) or ``extend`` (right after an ``extend()`` returned); ``sent`` and ``replied``
    the loop's monotonic time around the reads; ``belief`` the end of the lease's local
    validity, the smaller of what it was as the reads left and as they came back (a
    renewal confirmed meanwhile may have run after the server was read); ``left``
    ``lease.expires_in`` as they left; ``confirmed`` the monotonic time the lease's last
    confirmation known here was requested (its acquire, or its last ``extend()``);
    ``doubted`` whether an ``extend()`` of it failed with its outcome unknown (the lease
    may then count on a shorter TTL than ``ttl``). ``nodes`` per node ``[sent, replied,
    status, pttl]``: status 1 the key holds this lease's token, 0 it does not (or is
    gone), -1 no answer within half a TTL.
    """

    def __init__(self, urls: Sequence[str], prefix: str, timeout: float) -> None:
        from redis.asyncio import Redis  # noqa: PLC0415

        self.clients = [
            Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
            for url in urls
        ]
        self.scripts = [client.register_script(_SAMPLE) for client in self.clients]
        self.prefix = prefix
        self.timeout = timeout
        self.samples: list[list[Any]] = []
        self.straddled = 0

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def watch(self, lease: Any, name: str, held: _Held, rng: random.Random) -> None:
        """Sample at the grant, then every ``ttl / _SAMPLES_PER_TTL`` (jittered)."""
        await self.sample(lease, name, "grant", held)
        while lease.held:
            await asyncio.sleep(lease.ttl / _SAMPLES_PER_TTL * (0.5 + rng.random()))
            await self.sample(lease, name, "renew", held)

    async def sample(self, lease: Any, name: str, kind: str, held: _Held) -> None:
        if not lease.held:
            return
        # An extend() that runs while the server is read can lower the lease's belief
        # (an outcome-unknown attempt, whose shorter TTL a node may already have) and
        # then raise it again (a later attempt confirmed): the belief at the moment a
        # node was read is then neither the one before nor the one after, and the
        # sample is not judged (the sample right after each extend() covers it).
        extends = held.extending, held.extends
        loop = asyncio.get_running_loop()
        key = f"{self.prefix}:{{{name}}}"
        sent = loop.time()
        left = lease.expires_in
        nodes = await asyncio.gather(
            *(self._read(script, key, lease.token) for script in self.scripts)
        )
        replied = loop.time()
        if extends[0] or (held.extending, held.extends) != extends:
            self.straddled += 1
            return
        belief = min(sent + left, replied + lease.expires_in)
        what = [name, lease.fence, kind, sent, replied, belief, lease.ttl, left]
        self.samples.append([*what, held.confirmed, held.doubted, nodes])

    async def _read(self, script: Any, key: str, token: str) -> list[Any]:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            async with asyncio.timeout(self.timeout):
                value, pttl = await script(keys=[key])
        except Exception:  # a fault: unknown, which bounds nothing
            return [sent, loop.time(), -1, 0]
        mine = value is not None and _text(value).partition(":")[0] == token
        return [sent, loop.time(), int(mine), int(pttl)]


@dataclass
class _Held:
    """What a worker knows of a lease it holds, for its samples."""

    confirmed: float
    """Monotonic time its last confirmation known here was requested."""
    doubted: bool = False
    """An ``extend()`` of it failed with its outcome unknown."""
    extends: int = 0
    """``extend()`` calls of it begun so far."""
    extending: bool = False
    """An ``extend()`` of it is on its way (between its first attempt and its end)."""


class _Worker:
    def __init__(self, config: _WorkerConfig) -> None:
        self.config = config
        self.summary = WorkerSummary(config.worker)
        self.stall_requests: list[float] = []
        self.stop_at = 0.0
        self.rng = random.Random()
        self.coord: Any = None
        self.generation = 0
        self.stalled = -math.inf  # monotonic time the last stall ended
        # identity of a coordinator -> time.time() when its close began (its leases
        # ended then).
        self.closed_at: dict[str, float] = {}
        self.sampler: _Sampler | None = None
        self.watchers: set[asyncio.Task[None]] = set()

    def event(self, what: str) -> None:
        self.summary.events.append((time.monotonic(), what))

    def request_stall(self, seconds: float) -> None:
        # The stall happens inside a body, between deciding a write and sending it (see
        # _section), so a lease is sure to expire meanwhile; if no task gets there within
        # three seconds, the loop is blocked anyway.
        self.stall_requests.append(seconds)
        asyncio.get_running_loop().call_later(_STALL_IDLE, self._stall_now, "idle")

    def _stall_now(self, how: str, lease: str = "") -> None:
        """Block the loop if a stall was requested; ``lease`` (``holder@fence``) is the
        one held meanwhile: its loss is the stall's (see :func:`_stall_counts`)."""
        if self.stall_requests:
            seconds = self.stall_requests.pop(0)
            self.event(f"stall-{how} {lease}".rstrip())
            self.summary.stalls += 1
            time.sleep(seconds)  # blocking the event loop is the fault
            self.stalled = time.monotonic()

    def _connect(self) -> Any:
        import asynclock  # noqa: PLC0415

        cfg = self.config
        self.generation += 1
        identity = f"chaos-w{cfg.worker}g{self.generation}-{uuid.uuid4().hex[:6]}"
        return asynclock.connect(cfg.target, identity=identity, **cfg.options)

    async def run(self) -> WorkerSummary:
        # Imported here: the parent side of this module needs neither.
        from pytest_asynclock.history import FencedLog, dump_acks  # noqa: PLC0415
        from redis.asyncio import Redis  # noqa: PLC0415

        cfg = self.config
        # One connection per task, not a pool: after a stall the task's next write goes
        # out before the task yields (a pool checkout may yield first, and the watchdog
        # would cancel the write before it reached the resource).
        clients = [
            Redis.from_url(cfg.history, single_connection_client=True) for _ in range(cfg.tasks)
        ]
        logs = [
            {name: FencedLog(client, _log_key(cfg.namespace, name)) for name in cfg.names}
            for client in clients
        ]
        probe = (
            _Probe(cfg.backend, cfg.admin, cfg.options, cfg.names)
            if cfg.admin is not None
            else None
        )
        if cfg.sample:
            self.sampler = _Sampler(cfg.sample, cfg.options.get("prefix", "asynclock"), cfg.ttl / 2)
        self.coord = self._connect()
        try:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(_STALL_SIGNAL, self.request_stall, cfg.ttl * _STALL_TTLS)
            print(_READY, flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # the parent's "go"
            self.stop_at = time.monotonic() + cfg.duration
            tasks = [asyncio.create_task(self._loop(logs[i], i)) for i in range(cfg.tasks)]
            closer = asyncio.create_task(self._closer(probe))
            # Bounded: a task stuck past the end (a hung connection) must not hang the run.
            _, pending = await asyncio.wait(
                [*tasks, closer], timeout=cfg.duration + cfg.timeout + 10
            )
            for task in pending:
                task.cancel()
            if pending:
                self.event(f"stuck {len(pending)} tasks")
                await asyncio.wait(pending, timeout=5)
        finally:
            for watcher in self.watchers:
                watcher.cancel()
            await asyncio.gather(*self.watchers, return_exceptions=True)
            await self._close(self.coord, probe, final=True)
            if probe is not None:
                await probe.aclose()
            if self.sampler is not None:
                self.summary.samples = self.sampler.samples
                self.summary.samples_straddled = self.sampler.straddled
                await self.sampler.aclose()
            for client in clients:
                await client.aclose()
        self.summary.acks = {
            name: dump_acks(ack for task_logs in logs for ack in task_logs[name].acknowledged)
            for name in cfg.names
        }
        return self.summary

    async def _closer(self, probe: _Probe | None) -> None:
        """Close the coordinator at the planned moments while the tasks wait and hold;
        they go on with a new one (made first: a task between attempts never sees none)."""
        began = self.stop_at - self.config.duration
        for at in self.config.closes:
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            now = time.monotonic()
            if self.stall_requests or now - self.stalled < 2 * self.config.ttl + 1:
                continue  # the stall's loss is what its fault must show: not a close
            old = self.coord
            self.coord = self._connect()
            self.summary.closes += 1
            await self._close(old, probe)

    async def _close(self, coord: Any, probe: _Probe | None, *, final: bool = False) -> None:
        began = time.monotonic()
        self.closed_at[coord.identity] = time.time()
        self.event("close")
        try:
            async with asyncio.timeout(10):
                await coord.aclose()
        except Exception as exc:
            self.event(f"close-error {type(exc).__name__}: {str(exc)[:120]}")
        closed = time.monotonic()
        self.summary.late_grants += coord.stats().late_grants
        if probe is None:
            return
        left, errors = await probe.leftovers(coord.identity)
        self.summary.close_checks.append([began, closed, coord.identity, final, left, errors])

    async def _loop(self, logs: dict[str, Any], index: int) -> None:
        cfg = self.config
        holder = f"w{cfg.worker}t{index}"
        seq = 0
        while time.monotonic() < self.stop_at:
            seq += 1
            self.summary.attempts += 1
            roll = self.rng.random()
            if roll < _GIVEUP_CANCEL:
                await self._cancelled(logs, holder, f"{holder}-{seq}")
            elif roll < _GIVEUP_CANCEL + _GIVEUP_TIMEOUT:
                await self._once(logs, holder, f"{holder}-{seq}", self.rng.uniform(0.001, 0.05))
            else:
                await self._once(logs, holder, f"{holder}-{seq}", cfg.timeout)

    async def _cancelled(self, logs: dict[str, Any], holder: str, op: str) -> None:
        """One attempt cancelled at a random moment of the phase picked."""
        plan = _GiveUp(self.rng.choice(_GIVEUP_PHASES))
        plan.task = child = asyncio.create_task(
            self._once(logs, holder, op, self.config.timeout, plan)
        )
        if plan.phase == "attempt":
            plan.arm(self.rng.uniform(0.0, 0.002))
        elif plan.phase == "wait":
            plan.arm(self.rng.uniform(0.002, 0.2))
        try:
            await asyncio.wait([child])
        finally:
            plan.disarm()
            if not child.done():  # this task was cancelled (the run's end)
                child.cancel()
                await asyncio.wait([child])
        if child.cancelled():
            counts = self.summary.giveup_cancels
            counts[plan.phase] = counts.get(plan.phase, 0) + 1
            self.event(f"giveup-{plan.phase}")
        elif child.exception() is not None:
            raise child.exception()  # type: ignore[misc]

    async def _once(
        self,
        logs: dict[str, Any],
        holder: str,
        op: str,
        patience: float,
        plan: _GiveUp | None = None,
    ) -> None:
        from asynclock import (  # noqa: PLC0415
            BackendError,
            CoordinatorClosed,
            LockLost,
            LockNotOwned,
            LockTimeout,
        )

        cfg = self.config
        coord = self.coord
        name = self.rng.choice(cfg.names)
        requested = time.time()
        asked = time.monotonic()
        held = ""  # holder@fence of the lease, once granted (events name it)
        try:
            async with coord.lock(name, ttl=cfg.ttl, timeout=patience) as lease:
                held = f"{holder}@{lease.fence}"
                if plan is not None and plan.phase == "body":
                    plan.arm(self.rng.uniform(0.0, 0.03))
                left = lease.expires_in
                self.summary.acquired += 1
                self.summary.grants.append(
                    [name, lease.fence, holder, requested, time.time(), left]
                )
                if left <= 0:
                    self.summary.late_entries += 1
                    self.event("late-entry")
                known = _Held(asked)
                watcher = self._watch(lease, name, known)
                try:
                    # A stall is a loss the fault must show: not in a section a give-up
                    # cancel may end first.
                    confirmed = await self._section(
                        logs[name], lease, holder, op, stall=plan is None, held=known, name=name
                    )
                    if not confirmed:
                        # It stops believing now, and the block releases the lock next:
                        # without this record its belief would run to its last
                        # valid_until, and every next holder would read as a second one.
                        self.summary.ends.append([name, lease.fence, holder, time.time()])
                except BaseException:
                    if lease.lost:  # when the loss reached the body (a stall's credit)
                        self.event(f"cut {held}")
                    self._stopped(coord, name, lease.fence, holder, plan)
                    raise
                finally:
                    if watcher is not None:
                        watcher.cancel()  # no await here: the body's end is not delayed
                ended = time.time()
            self.summary.releases.append([name, lease.fence, ended])
        except (LockLost, LockTimeout, BackendError, CoordinatorClosed, LockNotOwned) as exc:
            await self._failed(exc, coord, patience, held)

    def _watch(self, lease: Any, name: str, known: _Held) -> asyncio.Task[None] | None:
        """Sample the server's expiry of ``lease`` while it is held (see _Sampler)."""
        if self.sampler is None:
            return None
        task = asyncio.create_task(self.sampler.watch(lease, name, known, self.rng))
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)
        return task

    async def _extend(self, lease: Any, name: str, holder: str, known: _Held) -> None:
        """``lease.extend()`` with a random TTL, then a sample of the server's expiry. A
        refusal (``LockNotOwned``: the lease is lost) propagates; a failure with the
        outcome unknown (``BackendError``: during a fault) is tried again a few times
        while the lease is held, as an application would (so an extend also reaches a
        server that came back, before the watchdog's backed-off renewal does)."""
        ttl = self.config.ttl * self.rng.uniform(*_EXTEND_TTLS)
        known.extends += 1
        known.extending = True
        try:
            confirmed = await self._extend_tries(lease, ttl, holder, known)
        finally:
            known.extending = False
        if confirmed and self.sampler is not None:
            await self.sampler.sample(lease, name, "extend", known)

    async def _extend_tries(self, lease: Any, ttl: float, holder: str, known: _Held) -> bool:
        """The tries of one ``extend()``: True once one is confirmed, False if none was."""
        from asynclock import BackendError, LockNotOwned  # noqa: PLC0415

        for attempt in range(_EXTEND_TRIES):
            if attempt:
                await asyncio.sleep(self.rng.uniform(0.02, 0.08))
                if not lease.held:
                    return False
            asked = time.monotonic()
            self.summary.extends += 1
            try:
                await lease.extend(ttl)
            except BackendError as exc:
                known.doubted = True
                self.summary.extend_errors += 1
                self.event(f"extend-error {type(exc).__name__}")
                continue
            except LockNotOwned:
                self.summary.extends_refused += 1
                self.event(f"extend-refused {holder}@{lease.fence}")
                raise
            known.confirmed = asked
            return True
        return False

    async def _failed(self, exc: Exception, coord: Any, patience: float, held: str) -> None:
        from asynclock import (  # noqa: PLC0415
            CoordinatorClosed,
            LockLost,
            LockNotOwned,
            LockTimeout,
        )

        if isinstance(exc, LockLost | LockNotOwned):
            if coord.closed:
                self.summary.closed_losses += 1
                self.event("closed-lost")
                return
            self.summary.leases_lost += 1
            if isinstance(exc.__cause__, asyncio.CancelledError):
                self.summary.cancelled += 1
            self.event(f"lost {held}")
        elif isinstance(exc, LockTimeout):
            if patience < self.config.timeout:
                self.summary.giveup_timeouts += 1
                self.event("giveup-timeout")
            else:
                self.summary.timeouts += 1
                self.event("timeout")
        elif isinstance(exc, CoordinatorClosed) or coord.closed:
            self.summary.closed_acquires += 1
            self.event("closed-acquire")
        else:
            self.summary.errors += 1
            self.event(f"error {type(exc).__name__}: {str(exc)[:120]}")
            # A dead server refuses at once: do not spin on it.
            await asyncio.sleep(0.05 + self.rng.random() * 0.15)

    def _stopped(
        self, coord: Any, name: str, fence: int, holder: str, plan: _GiveUp | None
    ) -> None:
        """A body left by an exception (a loss's cancel, a give-up cancel, the
        coordinator's close): the holder writes and believes no more from now (from the
        close: its leases ended there). A give-up or a close counts apart from the
        sections that should have completed."""
        closed = self.closed_at.get(coord.identity)
        at = time.time() if closed is None else min(closed, time.time())
        self.summary.ends.append([name, fence, holder, at])
        if closed is not None or (plan is not None and plan.fired):
            self.summary.interrupted += 1

    async def _section(
        self,
        log: Any,
        lease: Any,
        holder: str,
        op: str,
        *,
        stall: bool = True,
        held: _Held | None = None,
        name: str = "",
    ) -> bool:
        """Write a section's entries; False if it stopped because the history did not
        confirm a write (no ``end`` entry follows). A refused write also stops it, but
        returns True: a refusal outside a fault means another holder wrote with a
        newer fence while this one still believed, and its belief is left to run, so
        the check flags whoever comes next rather than hide it."""
        # Most sections are short; some hold across renewals, longer than the TTL.
        cfg = self.config
        long = self.rng.random() < _LONG_SECTIONS
        kinds = ("start", "op", "op", "op", "end") if long else ("start", "op", "end")
        pause = cfg.ttl / 2 if long else cfg.hold
        # Before each later write it may extend its lease (so a long section also goes a
        # while on renewals alone, or a late renewal would never show).
        extend_at = {
            position
            for position in range(1, len(kinds))
            if held is not None and self.rng.random() < _EXTEND_SHARE
        }
        for position, kind in enumerate(kinds):
            if position:
                await asyncio.sleep(pause * (0.5 + self.rng.random()))
            if held is not None and position in extend_at:
                await self._extend(lease, name, holder, held)
            # What the holder believes as it decides to write; the write then goes out
            # without a yield, after the stall if one was requested: a paused process
            # that wakes up and writes at once, as only the fence can stop.
            left = lease.expires_in
            state = "lost" if lease.lost else "held" if left > 0 else "expired"
            decided = time.time()
            valid_until = decided + left
            if stall:
                self._stall_now("holding", f"{holder}@{lease.fence}")
            self.summary.writes += 1
            try:
                ack = await log.append(
                    lease.fence,
                    holder,
                    op,
                    kind,
                    state=state,
                    valid_until=valid_until,
                    decided=decided,
                )
            except asyncio.CancelledError:
                self.summary.cut_writes += 1
                raise
            except Exception as exc:
                self.summary.history_errors += 1
                self.event(f"history-error {type(exc).__name__}: {exc}")
                return False
            if not ack.accepted:
                self.summary.rejected += 1
                self.event(f"rejected {holder}@{lease.fence}")
                return True  # a stale holder stops writing; its lease is lost or soon
        self.summary.completed += 1
        return True


def _worker_main(args: argparse.Namespace) -> int:
    config = _WorkerConfig(
        worker=args.worker,
        target=json.loads(args.target),
        options=json.loads(args.options),
        history=args.history,
        namespace=args.namespace,
        names=args.names.split(","),
        tasks=args.tasks,
        duration=args.duration,
        ttl=args.ttl,
        timeout=args.timeout,
        hold=args.hold,
        backend=args.backend,
        admin=json.loads(args.admin) if args.admin else None,
        closes=json.loads(args.closes),
        sample=json.loads(args.sample),
    )
    if args.package:
        # A planted mutant: the copy of the package must be the one imported.
        import asynclock  # noqa: PLC0415

        where = os.path.dirname(os.path.dirname(os.path.abspath(asynclock.__file__)))
        if os.path.realpath(where) != os.path.realpath(args.package):
            print(f"the worker imported {where}, not {args.package}", file=sys.stderr)
            return 2
    if args.patch:
        # A deliberately broken lock, for mutation testing of this runner.
        module, _, function = args.patch.partition(":")
        getattr(importlib.import_module(module), function)()
    summary = asyncio.run(_Worker(config).run())
    print(json.dumps(dataclasses.asdict(summary)), flush=True)
    return 0


# --------------------------------------------------------------------------------------
# The parent: servers, proxies, workers, faults


@dataclass
class _Setup:
    target: str | list[str]
    options: dict[str, Any]
    servers: list[Any] = field(default_factory=list)
    """Faultable ServerProcess objects (Redlock's five nodes)."""
    proxies: list[Any] = field(default_factory=list)
    """ProxyProcess objects the clients connect through."""
    admin_dsn: str | None = None
    """PostgreSQL: a direct DSN (not through the proxy) for pg_terminate_backend."""
    topology: Any = None
    """A SentinelSetup or ClusterSetup."""
    names: list[str] = field(default_factory=list)
    worker_targets: list[Any] = field(default_factory=list)
    """Per worker, its own way to the server (its own proxy), when there is one."""
    admin_target: Any = None
    """A way to the server no fault of the proxies cuts, to look for what a closed
    coordinator left there (None: not looked at, Redlock)."""
    sample: list[str] = field(default_factory=list)
    """Direct URLs of the Redis nodes whose expiry of held leases workers read."""


async def unsupported(backend: str) -> str | None:
    """Why ``backend``'s scenario cannot run with this asynclock, or None if it can.

    Sentinel and Cluster need :func:`asynclock.connect` to accept ``redis+sentinel://`` /
    ``redis+cluster://`` URLs (it does no I/O to tell).
    """
    if backend not in ("sentinel", "cluster"):
        return None
    import asynclock  # noqa: PLC0415

    scheme = f"redis+{backend}"
    url = f"{scheme}://127.0.0.1:1/mymaster" if backend == "sentinel" else f"{scheme}://127.0.0.1:1"
    try:
        coord = asynclock.connect(url)
    except ValueError as exc:
        return f"asynclock.connect does not accept {scheme}:// URLs yet ({exc})"
    with contextlib.suppress(Exception):
        await coord.aclose()
    return None


async def _start_proxy(stack: contextlib.AsyncExitStack, host: str, port: int) -> Any:
    from pytest_asynclock.proxy import ProxyProcess  # noqa: PLC0415

    proxy = await asyncio.to_thread(ProxyProcess.start, host, port)
    stack.callback(proxy.stop)
    return proxy


async def _valkeys(
    sc: Scenario,
    stack: contextlib.AsyncExitStack,
    valkey_factory: Callable[[int], Sequence[Any]],
) -> list[Any]:
    """The scenario's Valkey servers: from the factory, or one on a clock of its own
    speed (``sc.clock_rate``), stopped with ``stack``."""
    if sc.clock_rate == 1.0:
        return list(await asyncio.to_thread(valkey_factory, sc.nodes))
    if sc.nodes != 1:
        raise ValueError("clock_rate is for a single Redis server")
    from pytest_asynclock import ServerUnavailable, ValkeyServer  # noqa: PLC0415

    try:
        fast = await asyncio.to_thread(ValkeyServer.start, clock_rate=sc.clock_rate)
    except ServerUnavailable as exc:
        raise ScenarioSkipped(str(exc)) from exc
    stack.callback(fast.stop)
    return [fast]


async def _setup(  # noqa: PLR0917 - private, called once
    sc: Scenario,
    stack: contextlib.AsyncExitStack,
    valkey_factory: Callable[[int], Sequence[Any]],
    postgres_factory: Callable[[int], Sequence[Any]] | None,
    topology: Any,
    namespace: str,
) -> _Setup:
    if sc.backend in ("redis", "redlock"):
        servers = await _valkeys(sc, stack, valkey_factory)
        setup = _Setup([s.url for s in servers], {"prefix": namespace}, servers)
        setup.sample = [s.url for s in servers]
        if sc.backend == "redis":
            setup.target = setup.admin_target = servers[0].url
        if sc.proxy and sc.backend == "redis":
            # One proxy per worker: the proxy faults hit them all, ``isolate`` one.
            server = servers[0]
            setup.proxies = [
                await _start_proxy(stack, server.host, server.port) for _ in range(sc.workers)
            ]
            setup.worker_targets = [p.url_for(server.url) for p in setup.proxies]
        elif sc.proxy:
            setup.proxies = [await _start_proxy(stack, s.host, s.port) for s in servers]
            setup.target = [p.url_for(s.url) for p, s in zip(setup.proxies, servers, strict=True)]
        return setup
    if sc.backend == "postgres":
        if postgres_factory is None:
            raise ScenarioSkipped("the postgres scenario needs a postgres_factory")
        (server,) = await asyncio.to_thread(postgres_factory, 1)
        setup = _Setup(server.url, {"namespace": namespace}, [server], admin_dsn=server.url)
        setup.admin_target = server.url
        if sc.proxy:
            setup.proxies = [
                await _start_proxy(stack, server.host, server.port) for _ in range(sc.workers)
            ]
            setup.worker_targets = [p.url_for(server.url) for p in setup.proxies]
        return setup
    reason = await unsupported(sc.backend)
    if reason is not None:
        raise ScenarioSkipped(reason)
    if topology is None:
        from pytest_asynclock import topology as _topology  # noqa: PLC0415

        if sc.backend == "cluster":
            topology = await asyncio.to_thread(_topology.ClusterSetup.start)
        else:
            topology = await asyncio.to_thread(_topology.SentinelSetup.start)
        stack.callback(topology.stop)
    return _Setup(topology.url, {"prefix": namespace}, topology=topology, admin_target=topology.url)


async def _spawn_worker(
    sc: Scenario, setup: _Setup, index: int, history_url: str, namespace: str
) -> asyncio.subprocess.Process:
    target = setup.worker_targets[index] if setup.worker_targets else setup.target
    argv = [
        *("-m", _WORKER_MODULE, "worker", "--worker", str(index)),
        *("--target", json.dumps(target), "--options", json.dumps(setup.options)),
        *("--history", history_url, "--namespace", namespace),
        *("--names", ",".join(setup.names), "--tasks", str(sc.tasks)),
        *("--duration", str(sc.duration), "--ttl", str(sc.ttl)),
        *("--timeout", str(sc.timeout), "--hold", str(sc.hold)),
        *(("--patch", sc.patch) if sc.patch else ()),
        *("--backend", sc.backend),
        *("--closes", json.dumps(_close_plan(sc, index))),
        *(("--admin", json.dumps(setup.admin_target)) if setup.admin_target else ()),
        *("--sample", json.dumps(setup.sample)),
        *(("--package", sc.package) if sc.package else ()),
    ]
    env = None
    if sc.package:
        # The copy first on the path; and run from its folder, which ``-m`` puts before
        # everything (the working directory's own asynclock would win otherwise).
        path = [sc.package, os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # a terminal's Ctrl-C reaches the parent, which stops us
        env=env,
        cwd=sc.package or None,
    )


def _close_plan(sc: Scenario, worker: int) -> list[float]:
    """When worker ``worker`` closes its coordinator (seconds after the start): every
    2-6 s, outside the windows of faults that must show an effect (from a second before,
    time for a close to end on a loaded machine, to TTL + 0.5 s after, 4 s more where
    clients find a new master, the stall's own wait, a terminate's later shots) and
    before the last 1.5 s. A close begun during any fault (latency, say) takes longer:
    it keeps :data:`_CLOSE_SLOW` seconds from the next window (closes of all workers
    still ending as a terminate fires left it no holder to end)."""
    rng = random.Random()

    def lead(at: float) -> float:
        slowed = any(
            f.at <= at <= f.at + f.duration + 0.5
            and (f.kind not in ("stall", "isolate") or worker % sc.workers in f.targets)
            for f in sc.faults
        )
        return _CLOSE_SLOW if slowed else 1.0

    busy = []
    for fault in sc.faults:
        if fault.expect is None:
            continue
        if fault.kind in ("stall", "isolate") and worker % sc.workers not in fault.targets:
            continue
        end = fault.at + fault.duration + sc.ttl + 0.5
        if fault.kind in ("kill", "kill_master", "failover"):
            end += 4.0
        if fault.kind == "stall":
            end += 1.0 + sc.ttl * _STALL_TTLS
        if fault.kind == "terminate":
            end += 0.25 * (_TERMINATE_SHOTS - 1)
        busy.append((fault.at, end))
    plan: list[float] = []
    at = rng.uniform(0.5, 2.0)
    while at < sc.duration - 1.5:
        clash = max((end for start, end in busy if start - lead(at) <= at <= end), default=None)
        if clash is None:
            plan.append(round(at, 3))
            at += rng.uniform(*_CLOSE_EVERY)
        else:
            at = clash + rng.uniform(0.1, 1.0)
    return plan


async def _terminate_holders(dsn: str) -> int:
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        rows = await conn.fetch(
            "SELECT pg_terminate_backend(pid) AS ok FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()
    return sum(1 for row in rows if row["ok"])


@dataclass(frozen=True)
class _Promotion:
    """A replica seen to become a master (monotonic times)."""

    port: int
    replica_at: float
    """When it was last asked and answered "replica" (the promotion came after)."""
    master_at: float
    """When it first answered "master"."""
    names: tuple[str, ...]
    """The run's lock names it then served (Cluster: by their key slot)."""

    @property
    def recent(self) -> bool:
        """Seen within ``_PROMOTION_GAP`` of its last answer as a replica: its window is
        short enough to excuse anything in it."""
        return self.master_at - self.replica_at <= _PROMOTION_GAP


class _Promotions:
    """Sentinel and Cluster: replicas that became masters during the run, as the parent
    sees them by asking every data node its role every ``_ROLE_POLL`` seconds. Started
    before the workers; :meth:`ready` waits for its first round."""

    def __init__(self, topology: Any, names: Sequence[str]) -> None:
        self.topology = topology
        self.names = list(names)
        self.slots: dict[str, int] | None = None
        """Cluster: each name's hash slot (``{name}`` is its keys' hash tag)."""
        self.rounds = 0
        self.known: dict[int, tuple[str, float]] = {}
        """Per port, its last answer: role and when it was asked."""
        self.seen: list[_Promotion] = []
        self.error: str | None = None
        """Why the watcher stopped, if it did (it then saw nothing after)."""
        self._first = asyncio.Event()

    @classmethod
    @contextlib.asynccontextmanager
    async def watching(cls, topology: Any, names: Sequence[str]) -> AsyncIterator[_Promotions]:
        """A watcher running for the block (none without a topology: it sees nothing)."""
        watcher = cls(topology, names)
        if topology is None:
            watcher._first.set()
        task = asyncio.create_task(watcher.watch() if topology is not None else asyncio.sleep(0))
        try:
            yield watcher
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def ready(self) -> None:
        """Wait until a first round is done or the watcher failed (every call in a
        round has a socket timeout: this ends)."""
        await self._first.wait()

    async def watch(self) -> None:
        try:
            await self._watch()
        except Exception as exc:  # reported with the run, never silently
            self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            self._first.set()

    async def _watch(self) -> None:
        if hasattr(self.topology, "slots_of"):
            self.slots = await asyncio.to_thread(
                lambda: {name: self.topology.keyslot(f"{{{name}}}") for name in self.names}
            )
        while True:
            answers = await asyncio.to_thread(self.topology.poll_roles)
            for port, role, asked, answered in answers:
                before = self.known.get(port)
                if role == "master" and before is not None and before[0] == "slave":
                    names = await asyncio.to_thread(self._served, port)
                    self.seen.append(_Promotion(port, before[1], answered, names))
                self.known[port] = (role, asked)
            self.rounds += 1
            self._first.set()
            await asyncio.sleep(_ROLE_POLL)

    def describe(self, unplanned: Sequence[_Promotion], t0: float) -> list[str]:
        """For the report: each unplanned promotion, and the watcher's end if it failed."""
        out = []
        for p in unplanned:
            if not p.recent:
                what = f"not seen within {_PROMOTION_GAP:g}s of its last answer: nothing excused"
            elif p.names:
                what = f"overlaps on {', '.join(p.names)} tolerated there"
            else:
                what = "it served none of the run's names"
            out.append(
                f"127.0.0.1:{p.port} was a replica at t={p.replica_at - t0:.2f}s and a "
                f"master at t={p.master_at - t0:.2f}s; {what}"
            )
        if self.error is not None:
            out.append(f"the role watcher stopped: {self.error}")
        return out

    def _served(self, port: int) -> tuple[str, ...]:
        """The names ``port`` serves now (none if it cannot tell: nothing is excused)."""
        if self.slots is None:
            return tuple(self.names)  # Sentinel: one master serves every name
        try:
            ranges = self.topology.slots_of(port)
        except Exception:  # no answer, an error reply: unknown
            return ()
        return tuple(
            name
            for name, slot in self.slots.items()
            if any(first <= slot <= last for first, last in ranges)
        )


def _lossy_windows(
    names: Sequence[str],
    planned: Sequence[tuple[float, float]],
    promotions: Sequence[_Promotion],
    ttl: float,
) -> tuple[dict[str, list[tuple[float, float]]], list[_Promotion]]:
    """Per name, the (start, end) windows in which two holders may believe at once by
    design: every planned lock-losing fault's, for every name, and each recent
    promotion's (:attr:`_Promotion.recent`; planned or not: a union is harmless) for the
    names the promoted node serves. Also the promotions seen outside every planned
    window, to report. Times as given (monotonic)."""
    windows = {name: list(planned) for name in names}
    for p in promotions:
        if p.recent:
            for name in p.names:
                windows[name].append((p.replica_at, p.master_at + ttl + 1))
    unplanned = [
        p for p in promotions if not any(start <= p.master_at <= end for start, end in planned)
    ]
    return windows, unplanned


class _Faults:
    """Applies a scenario's faults at their times, one after the other."""

    def __init__(
        self, sc: Scenario, setup: _Setup, workers: list[asyncio.subprocess.Process]
    ) -> None:
        self.sc = sc
        self.setup = setup
        self.workers = workers
        self.applied: list[tuple[Fault, float, float, str | None]] = []
        self.background: list[asyncio.Task[None]] = []

    async def run(self, t0: float) -> None:
        for fault in sorted(self.sc.faults, key=lambda f: f.at):
            delay = t0 + fault.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            started = time.monotonic()
            error: str | None = None
            try:
                await self.apply(fault)
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.applied.append((fault, started, time.monotonic(), error))
        if self.background:
            await asyncio.gather(*self.background)

    async def apply(self, fault: Fault) -> None:
        apply = getattr(self, f"_{fault.kind}", None)
        if apply is None:
            raise ValueError(f"unknown fault kind {fault.kind!r}")
        await apply(fault)

    def _targets(self, fault: Fault) -> list[Any]:
        return [self.setup.servers[i] for i in fault.targets]

    async def _freeze(self, fault: Fault) -> None:
        servers = self._targets(fault)
        try:
            for server in servers:
                await asyncio.to_thread(server.freeze)
            await asyncio.sleep(fault.duration)
        finally:
            for server in servers:
                await asyncio.to_thread(server.resume)

    async def _kill(self, fault: Fault) -> None:
        servers = self._targets(fault)
        for server in servers:
            await asyncio.to_thread(server.kill)
        await asyncio.sleep(fault.duration)
        for server in servers:
            await asyncio.to_thread(server.restart)

    async def _proxies(self, command: str) -> None:
        for proxy in self.setup.proxies:
            await asyncio.to_thread(proxy.send, command)

    async def _blackhole(self, fault: Fault) -> None:
        try:
            await self._proxies("blackhole")
            await asyncio.sleep(fault.duration)
        finally:
            await self._proxies("heal")

    async def _latency(self, fault: Fault) -> None:
        try:
            await self._proxies(f"latency {fault.latency}")
            await asyncio.sleep(fault.duration)
        finally:
            await self._proxies("heal")

    async def _reset(self, fault: Fault) -> None:
        await self._proxies("reset")

    async def _isolate(self, fault: Fault) -> None:
        """One worker cut off while the others still reach the server: split brain."""
        proxies = [self.setup.proxies[i % len(self.setup.proxies)] for i in fault.targets]
        try:
            for proxy in proxies:
                await asyncio.to_thread(proxy.send, "refuse")
                await asyncio.to_thread(proxy.send, "reset")
            await asyncio.sleep(fault.duration)
        finally:
            for proxy in proxies:
                await asyncio.to_thread(proxy.send, "heal")

    async def _stall(self, fault: Fault) -> None:
        for index in fault.targets:
            proc = self.workers[index % len(self.workers)]
            if proc.returncode is None:
                os.kill(proc.pid, _STALL_SIGNAL)
        await asyncio.sleep(1.0 + self.sc.ttl * _STALL_TTLS)

    async def _terminate(self, fault: Fault) -> None:
        """Terminate every session holding an advisory lock, in a few shots 0.25 s apart.

        One shot can land when the only holders are releasing or their coordinator is
        closing (seen on a loaded machine): their locks end with nothing lost and the
        fault goes unfelt. Later shots find the next holders, most of them in a body."""
        assert self.setup.admin_dsn is not None
        terminated = 0
        for shot in range(_TERMINATE_SHOTS):
            if shot:
                await asyncio.sleep(0.25)
            terminated += await _terminate_holders(self.setup.admin_dsn)
        if terminated == 0:
            raise RuntimeError("no session held an advisory lock to terminate")

    def _cluster_master(self, fault: Fault) -> Any:
        """The master owning the slot of lock name ``targets[0]`` (mod the names)."""
        topo = self.setup.topology
        name = self.setup.names[fault.targets[0] % len(self.setup.names)]
        return topo.node_for_slot(topo.keyslot(f"{{{name}}}"))

    async def _failover(self, fault: Fault) -> None:
        topo = self.setup.topology
        if self.sc.backend == "sentinel":
            await asyncio.to_thread(topo.failover)
            return

        def cluster_failover() -> None:
            master = self._cluster_master(fault)
            replicas = [r for r in topo.replicas(master) if r.running]
            if not replicas:
                raise RuntimeError(f"{master!r} has no running replica to fail over to")
            topo.failover(replicas[0])

        await asyncio.to_thread(cluster_failover)

    async def _kill_master(self, fault: Fault) -> None:
        topo = self.setup.topology
        if self.sc.backend == "sentinel":
            old = await asyncio.to_thread(topo.master)
            await asyncio.to_thread(topo.kill_master)
        else:

            def kill() -> Any:
                master = self._cluster_master(fault)
                index = [m.port for m in topo.masters()].index(master.port)
                topo.kill_master(index)
                return master

            old = await asyncio.to_thread(kill)
        # Back as a replica later, so that a later fault has a replica to promote.
        self.background.append(asyncio.create_task(self._restart_later(old)))

    async def _restart_later(self, server: Any) -> None:
        await asyncio.sleep(self.sc.ttl * 2)
        await asyncio.to_thread(server.restart)
        if self.setup.topology is not None:
            await asyncio.to_thread(self.setup.topology.wait_settled)


def _window_counts(
    summaries: Sequence[WorkerSummary], start: float, end: float, workers: set[int] | None = None
) -> dict[str, int]:
    counts: dict[str, int] = {}
    for summary in summaries:
        if workers is not None and summary.worker % len(summaries) not in workers:
            continue
        for at, what in summary.events:
            if start <= at <= end:
                key = what.split(" ", 1)[0]
                counts[key] = counts.get(key, 0) + 1
    return counts


def _outcomes(
    sc: Scenario,
    summaries: Sequence[WorkerSummary],
    applied: Sequence[tuple[Fault, float, float, str | None]],
) -> list[FaultOutcome]:
    """What each fault caused, in its own window: from its start to TTL + 1 s after its
    end, cut where the next fault begins; a stall's and an isolation's only in the
    workers they target. Faults the run ended before are failed outcomes."""
    ordered = sorted(applied, key=lambda item: item[1])
    outcomes = []
    for index, (fault, start, end, err) in enumerate(ordered):
        until = end + sc.ttl + 1
        if index + 1 < len(ordered):
            until = min(until, ordered[index + 1][1])
        who = set(fault.targets) if fault.kind in ("stall", "isolate") else None
        counts = _window_counts(summaries, start, until, who)
        if who is not None and fault.kind == "stall":
            counts = _stall_counts(summaries, counts, who, start, sc.ttl)
        outcomes.append(FaultOutcome(fault, start, end, counts, err))
    done = {id(o.fault) for o in outcomes}
    outcomes += [
        FaultOutcome(f, 0.0, 0.0, {}, "not applied before the run ended")
        for f in sc.faults
        if id(f) not in done
    ]
    return outcomes


def _stall_counts(
    summaries: Sequence[WorkerSummary],
    counts: dict[str, int],
    workers: set[int],
    start: float,
    ttl: float,
) -> dict[str, int]:
    """A stall's counts, with the loss of the lease it stalled should its window (cut at
    the next fault) end before that loss shows: a stall comes in the first section the
    worker writes in after the signal, late on a busy machine where the worker held
    nothing for a while. Only that lease's own loss counts (events name it
    ``holder@fence``), and only as the stall's own doing, within ``_STALL_SLACK`` of the
    stall's end: the body cut by the loss (``cut``, stamped when the loss reached it),
    the block's ``LockLost`` (``lost``, stamped once its release ended), or its write
    refused. A loss the next fault causes comes later (its lease must run out first),
    unless that fault lands within the slack of the stall's end."""
    if counts.get("lost", 0) + counts.get("rejected", 0):
        return counts
    for summary in summaries:
        if summary.worker % len(summaries) not in workers:
            continue
        for at, what in summary.events:
            kind, _, lease = what.partition(" ")
            if kind != "stall-holding" or not start <= at <= start + _STALL_IDLE:
                continue
            due = at + ttl * _STALL_TTLS + _STALL_SLACK
            for later, then in summary.events:
                kind, _, tag = then.partition(" ")
                if kind in ("cut", "lost", "rejected") and tag == lease and at <= later <= due:
                    shown = "lost" if kind == "cut" else kind
                    return {**counts, shown: counts.get(shown, 0) + 1, "late-stall": 1}
    return counts


async def _wait_ready(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if line.decode().strip() != _READY:
        raise RuntimeError(f"worker {proc.pid} did not start: {line!r}; {await _stderr(proc)}")


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    if proc.stderr is None:
        return ""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(2):
            return "stderr:\n" + (await proc.stderr.read()).decode(errors="replace")[-3000:]
    return ""


async def _collect(proc: asyncio.subprocess.Process) -> WorkerSummary:
    assert proc.stdout is not None
    assert proc.stderr is not None
    out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    code = await proc.wait()
    lines = out.decode().strip().splitlines()
    if code != 0 or not lines:
        raise RuntimeError(f"worker {proc.pid} exited with {code}; stderr:\n{err.decode()[-3000:]}")
    data: dict[str, Any] = json.loads(lines[-1])
    data["events"] = [tuple(item) for item in data["events"]]
    return WorkerSummary(**data)


@contextlib.asynccontextmanager
async def _workers(
    sc: Scenario, setup: _Setup, history_url: str, namespace: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Start the workers; on leaving, kill (by PID) and reap whichever still runs."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for index in range(sc.workers):
            procs.append(await _spawn_worker(sc, setup, index, history_url, namespace))
        yield procs
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(Exception):
                await proc.wait()


@dataclass
class _Verdict:
    violations: int = 0
    tolerated: int = 0
    lost: int = 0
    operations: int = 0
    sections: int = 0
    stale_rejected: int = 0
    fenced_off: int = 0
    writes_after_loss: int = 0
    """Entries (accepted or not) written with the lease marked lost, or a section's first
    one with its validity spent: the body went on after it knew. Not the writes a late
    event loop resumed with the validity just spent before the watchdog's timer ran
    (the fence orders those: they count as stale, against ``stale_budget``)."""
    grant_violations: int = 0
    acks: int = 0
    budgeted: int = 0
    details: list[str] = field(default_factory=list)
    budget_details: list[str] = field(default_factory=list)
    after_loss_details: list[str] = field(default_factory=list)


# How many writes after a known loss a report lists (all of them are counted).
_AFTER_LOSS_SHOWN = 5


def _budget_late_writes(verdict: _Verdict, name: str, count: int) -> None:
    """Writes decided after the lease expired, before its loss reached the body (its
    event loop resumed it late): stale, like a stalled holder's, so budgeted."""
    if not count:
        return
    verdict.budgeted += count
    if len(verdict.budget_details) < 10:
        verdict.budget_details.append(
            f"{name}: {count} write(s) decided after the lease expired, before its loss "
            "was delivered (a late event loop)"
        )


def _count_writes_after_loss(
    verdict: _Verdict, name: str, entries: Sequence[Entry], t0_wall: float
) -> None:
    """Entries whose writer knew: a write with its lease marked lost (the loss's cancel
    should have stopped the body first), or a section begun expired. Not a write its
    late event loop resumed with the validity just spent, before the watchdog's timer
    could run: the fence's to order (budgeted: as a late write if accepted, as a stale
    one if refused)."""
    knew = [
        entry
        for entry in entries
        if entry.state == "lost" or (entry.state == "expired" and entry.kind == "start")
    ]
    verdict.writes_after_loss += len(knew)
    room = max(0, _AFTER_LOSS_SHOWN - len(verdict.after_loss_details))
    verdict.after_loss_details += [
        f"{name} (at t={entry.time - t0_wall:.2f}s): entry {entry.seq} ({entry.kind} of "
        f"{entry.holder!r} fence {entry.fence}) was written with its lease {entry.state} "
        f"({'accepted' if entry.accepted else 'refused by the fence'})"
        for entry in knew[:room]
    ]


async def _check(
    history_url: str,
    namespace: str,
    names: Sequence[str],
    summaries: Sequence[WorkerSummary],
    *,
    t0_wall: float,
    lossy: Mapping[str, Sequence[tuple[float, float]]],
) -> _Verdict:
    """Check every name's history, the grants, and the acks against the writes.

    ``lossy``: per name, (start, end) wall-clock windows of faults that may lose its lock
    by design; two holders believing at once inside one is counted as tolerated, not a
    violation.
    """
    from pytest_asynclock.history import (  # noqa: PLC0415
        FencedLog,
        Grant,
        check,
        check_grants,
        load_acks,
    )
    from redis.asyncio import Redis  # noqa: PLC0415

    verdict = _Verdict()
    client: Redis = Redis.from_url(history_url)
    try:
        for name in names:
            log = FencedLog(client, _log_key(namespace, name))
            entries = await log.read()
            last_seq = (await log.counters()).get("seq", 0)
            acks = [load_acks(s.acks[name]) for s in summaries if name in s.acks]
            verdict.acks += sum(len(group) for group in acks)
            # exclusive=False: a holder frozen or stalled past its TTL is fenced off by
            # design; such sections count against the run's budget instead.
            ended = [
                (int(fence), str(holder), float(at))
                for s in summaries
                for item_name, fence, holder, at in s.ends
                if item_name == name
            ]
            # late_ok: a write its body decided after a loop stall that outlasted the
            # lease, before the loss reached it, is the fence's to order (budgeted).
            report = check(
                entries, *acks, exclusive=False, last_seq=last_seq, ended=ended, late_ok=True
            )
            by_seq = {entry.seq: entry for entry in entries}

            spans = lossy.get(name, ())

            def in_lossy(at: float, spans: Sequence[tuple[float, float]] = spans) -> bool:
                return any(start <= at <= end for start, end in spans)

            # Stale writes and fenced-off sections count against the budget, except in
            # the windows of faults that lose locks by design (there they are the fence
            # doing its job).
            verdict.budgeted += sum(
                not entry.accepted and not in_lossy(entry.time) for entry in entries
            )
            _budget_late_writes(verdict, name, report.late_writes)
            victims: set[int] = set()  # a section cut off counts once, however many
            for fenced in report.fenced_off:  # sections went in meanwhile
                times = [by_seq[q].time for q in fenced.seqs if q in by_seq]
                if any(in_lossy(at) for at in times) or fenced.seqs[0] in victims:
                    continue
                victims.add(fenced.seqs[0])
                verdict.budgeted += 1
                if len(verdict.budget_details) < 10:
                    shown = f" (at t={min(times) - t0_wall:.2f}s)" if times else ""
                    verdict.budget_details.append(f"{name}{shown}: {fenced}")
            for violation in report.violations:
                when = [by_seq[q].time for q in violation.seqs if q in by_seq]
                at = max(when) if when else None
                if violation.kind == "overlap-in-time" and at is not None and in_lossy(at):
                    verdict.tolerated += 1
                    continue
                verdict.violations += 1
                if len(verdict.details) < 20:
                    shown = f" (at t={at - t0_wall:.2f}s)" if at is not None else ""
                    verdict.details.append(f"{name}{shown}: {violation}")
            verdict.lost += len(report.lost)
            verdict.details += [f"{name}: lost {ack}" for ack in report.lost[:5]]
            verdict.operations += report.operations
            verdict.sections += report.sections
            verdict.stale_rejected += report.stale_rejected
            verdict.fenced_off += len(report.fenced_off)
            _count_writes_after_loss(verdict, name, entries, t0_wall)
    finally:
        await client.aclose()
    grants = [Grant.from_list(item) for s in summaries for item in s.grants]
    for violation in check_grants(grants):
        verdict.grant_violations += 1
        if len(verdict.details) < 30:
            verdict.details.append(f"grants: {violation}")
    return verdict


async def run_scenario(
    sc: Scenario,
    *,
    valkey_factory: Callable[[int], Sequence[Any]],
    postgres_factory: Callable[[int], Sequence[Any]] | None = None,
    topology: Any = None,
    history_url: str | None = None,
) -> ChaosReport:
    """Run ``sc`` and check its history.

    Args:
        sc: the scenario.
        valkey_factory: starts private Valkey servers (``factory(n)``); the caller stops
            them (the plugin's ``asynclock_valkey_factory`` does).
        postgres_factory: the same for PostgreSQL (``postgres`` scenarios need one).
        topology: a started :class:`~pytest_asynclock.topology.SentinelSetup` /
            ``ClusterSetup`` for those scenarios (the caller stops it); None starts one
            and stops it at the end.
        history_url: a Valkey for the fenced history resources; default one more from
            ``valkey_factory``. It must not be faulted.

    Raises:
        ScenarioSkipped: the backend cannot run here (see :func:`unsupported`).
        RuntimeError: a worker failed to start or crashed (its stderr is in the message).
    """
    namespace = f"chaos-{sc.name}-{uuid.uuid4().hex[:8]}"
    async with contextlib.AsyncExitStack() as stack:
        setup = await _setup(sc, stack, valkey_factory, postgres_factory, topology, namespace)
        setup.names = [f"res{i}" for i in range(sc.names)]
        if history_url is None:
            (history_server,) = await asyncio.to_thread(valkey_factory, 1)
            history_url = history_server.url
        # Before the workers start: the first round must know every replica.
        async with (
            _Promotions.watching(setup.topology, setup.names) as promotions,
            _workers(sc, setup, history_url, namespace) as procs,
        ):
            faults = _Faults(sc, setup, procs)
            async with asyncio.timeout(sc.duration + sc.timeout + 90):
                for proc in procs:
                    await _wait_ready(proc)
                await promotions.ready()
                clocks_first = await _server_clocks(setup.sample)
                t0 = time.monotonic()
                t0_wall = time.time()
                for proc in procs:
                    assert proc.stdin is not None
                    proc.stdin.write(_GO)
                    await proc.stdin.drain()
                fault_task = asyncio.create_task(faults.run(t0))
                orphans = _Orphans()
                watch = asyncio.create_task(
                    orphans.watch(setup.admin_dsn, namespace)
                    if sc.backend == "postgres" and setup.admin_dsn is not None
                    else asyncio.sleep(0)
                )
                try:
                    summaries = await asyncio.gather(*(_collect(p) for p in procs))
                    # Every worker exited: nobody is left to give anything back.
                    after_run = await _leftovers_after_run(sc, setup, namespace)
                    await fault_task
                    clocks_last = await _server_clocks(setup.sample)
                finally:
                    watch.cancel()
                    fault_task.cancel()
                    with contextlib.suppress(BaseException):
                        await fault_task
                    for task in faults.background:
                        task.cancel()
                    await asyncio.gather(watch, *faults.background, return_exceptions=True)
        planned = [
            (start, end + sc.ttl + 1)
            for fault, start, end, _ in faults.applied
            if fault.kind in _LOSES_LOCKS_ON.get(sc.backend, _LOSES_LOCKS)
        ]
        windows, unplanned = _lossy_windows(setup.names, planned, promotions.seen, sc.ttl)
        lossy = {  # to wall-clock time, as the history's entries are
            name: [(t0_wall + start - t0, t0_wall + end - t0) for start, end in spans]
            for name, spans in windows.items()
        }
        verdict = await _check(
            history_url, namespace, setup.names, summaries, t0_wall=t0_wall, lossy=lossy
        )
    server_checks = _server_checks(
        sc,
        summaries,
        (clocks_first, clocks_last),
        faults.applied,
        promotions.seen,
        t0=t0,
        t0_wall=t0_wall,
    )
    stranded = _stranded(sc, summaries, faults.applied, after_run, t0)
    stranded.found += orphans.found(t0)
    outcomes = _outcomes(sc, summaries, faults.applied)
    return ChaosReport(
        scenario=sc.name,
        duration=sc.duration,
        workers=sc.workers,
        tasks=sc.tasks,
        operations=verdict.operations,
        sections=verdict.sections,
        completed=sum(s.completed for s in summaries),
        acquired=sum(s.acquired for s in summaries),
        interrupted=sum(s.interrupted for s in summaries),
        leases_lost=sum(s.leases_lost for s in summaries),
        cancelled=sum(s.cancelled for s in summaries),
        timeouts=sum(s.timeouts for s in summaries),
        errors=sum(s.errors for s in summaries),
        stale_rejected=verdict.stale_rejected,
        fenced_off=verdict.fenced_off,
        violations=verdict.violations,
        lost=verdict.lost,
        history_errors=sum(s.history_errors for s in summaries),
        stalls=sum(s.stalls for s in summaries),
        faults=outcomes,
        details=verdict.details
        + (verdict.budget_details if verdict.budgeted > _stale_budget(sc, verdict) else []),
        writes=sum(s.writes for s in summaries),
        cut_writes=sum(s.cut_writes for s in summaries),
        acks=verdict.acks,
        writes_after_loss=verdict.writes_after_loss,
        after_loss_details=verdict.after_loss_details,
        grant_violations=verdict.grant_violations,
        late_entries=sum(s.late_entries for s in summaries),
        late_grants=sum(s.late_grants for s in summaries),
        tolerated=verdict.tolerated,
        stale_budget=_stale_budget(sc, verdict),
        budgeted=verdict.budgeted,
        giveups=sum(s.giveup_timeouts + sum(s.giveup_cancels.values()) for s in summaries),
        closes=sum(s.closes for s in summaries),
        stranded=len(stranded.found),
        stranded_details=stranded.found,
        stranded_excused=stranded.excused,
        excused_details=stranded.excused_details[:20],
        probe_errors=stranded.errors,
        promotions=promotions.describe(unplanned, t0),
        **server_checks,
    )


# An advisory lock held this long by an idle session that no lease names (its
# application_name is not a lease's) is held by nobody: stranded while the run goes on.
_ORPHAN_AFTER = 2.0


class _Orphans:
    """PostgreSQL, during the run: advisory locks held by idle pooled sessions that no
    lease names (a lease's session carries its holder in ``application_name``). Such a
    lock keeps the name from everyone until the pool closes the connection."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int, int], list[Any]] = {}  # -> [first, last, text]

    async def watch(self, dsn: str, namespace: str) -> None:
        from asynclock.postgres import advisory_key, lock_ids  # noqa: PLC0415

        names = {lock_ids(advisory_key(f"res{i}", namespace)): f"res{i}" for i in range(64)}
        while True:
            await asyncio.sleep(0.5)
            try:
                async with asyncio.timeout(2):  # a frozen server answers nothing
                    rows = await _pg_advisory(dsn)
            except Exception:  # noqa: S112 - a fault; look again later
                continue
            now = time.monotonic()
            for row in rows:
                if (
                    not row["granted"]
                    or row["state"] != "idle"
                    or row["app"].startswith("asynclock:")
                ):
                    continue
                key = (row["pid"], row["classid"], row["objid"])
                name = names.get((row["classid"], row["objid"]), f"key {key[1]}/{key[2]}")
                text = (
                    f"{name}: advisory lock held by idle pid {row['pid']} that no lease "
                    f"names (application_name {row['app']!r})"
                )
                self.seen.setdefault(key, [now, now, text])[1] = now

    def found(self, t0: float) -> list[str]:
        return [
            f"during the run at t={first - t0:.1f}s: {text} for {last - first:.1f}s or more"
            for first, last, text in self.seen.values()
            if last - first >= _ORPHAN_AFTER
        ]


@dataclass
class _Stranded:
    found: list[str] = field(default_factory=list)
    excused: int = 0
    excused_details: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# Faults during which a closing coordinator may be unable to give back what it held (the
# server or the way to it is down; "isolate" only for the workers cut off), and how long
# after the fault's end that lasts (clients find a new master after a failover). Stalls
# and latency leave the server reachable: a close then must give everything back.
_UNREACHABLE = {
    "freeze": 1.0,
    "kill": 1.0,
    "blackhole": 1.0,
    "reset": 1.0,
    "isolate": 1.0,
    "terminate": 1.0,
    "failover": 5.0,
    "kill_master": 5.0,
}


def _stranded(
    sc: Scenario,
    summaries: Sequence[WorkerSummary],
    applied: Sequence[tuple[Fault, float, float, str | None]],
    after_run: tuple[list[str], list[str]],
    t0: float,
) -> _Stranded:
    """What closed coordinators left on the server: after each worker's closes (outside
    the windows of faults, where the server could not be reached and the TTL ends what
    is left) and after the whole run."""
    out = _Stranded()
    for summary in summaries:
        windows = [
            (start, end + _UNREACHABLE[fault.kind])
            for fault, start, end, _ in applied
            if fault.kind in _UNREACHABLE
            and (fault.kind != "isolate" or summary.worker % len(summaries) in fault.targets)
        ]
        for began, closed, identity, final, left, errors in summary.close_checks:
            excused = any(start <= closed and began <= end for start, end in windows)
            what = "final close" if final else "close"
            if excused:
                out.excused += len(left)
                out.excused_details += [
                    f"w{summary.worker} {what} at t={began - t0:.1f}s: {item}" for item in left
                ]
                continue
            out.found += [
                f"w{summary.worker} {what} of {identity} at t={began - t0:.1f}s: {item}"
                for item in left
            ]
            out.errors += [f"w{summary.worker} {what} at t={began - t0:.1f}s: {e}" for e in errors]
    left, errors = after_run
    out.found += [f"after the run: {item}" for item in left]
    out.errors += [f"after the run: {e}" for e in errors]
    return out


async def _leftovers_after_run(
    sc: Scenario, setup: _Setup, namespace: str
) -> tuple[list[str], list[str]]:
    """(leftovers, errors) on the server once every worker exited: PostgreSQL's advisory
    locks (given :data:`_GIVE_BACK` for sessions to end), or every key of the run's
    prefix on every Redis node or master other than fence counters, with live
    waiter-queue places (lapsed ones are dead and do no harm)."""
    if sc.backend == "postgres":
        assert setup.admin_dsn is not None
        probe = _Probe("postgres", setup.admin_dsn, {"namespace": namespace}, setup.names)
        return await probe.leftovers(None)
    try:
        nodes = await asyncio.to_thread(_redis_nodes, sc, setup)
        async with asyncio.timeout(20):
            return await _scan_redis(nodes, namespace), []
    except Exception as exc:
        return [], [f"{type(exc).__name__}: {str(exc)[:200]}"]


def _redis_nodes(sc: Scenario, setup: _Setup) -> list[tuple[str, int]]:
    if sc.backend == "sentinel":
        servers = [setup.topology.master()]
    elif sc.backend == "cluster":
        servers = setup.topology.masters()
    else:
        servers = setup.servers
    return [(server.host, server.port) for server in servers]


async def _scan_redis(nodes: Sequence[tuple[str, int]], namespace: str) -> list[str]:
    from redis.asyncio import Redis  # noqa: PLC0415

    found: list[str] = []
    now_ms = time.time() * 1000
    for host, port in nodes:
        client = Redis(host=host, port=port)
        try:
            async for raw in client.scan_iter(match=f"{namespace}:*", count=1000):
                key = _text(raw)
                tail = key.rpartition("}")[2]
                if ":history:" in key or tail.endswith(":queue"):
                    continue  # a queue's places are judged by its ":due" hash
                pttl = await client.pttl(key)
                if tail.endswith((":fence", ":released")):
                    # Both expire by themselves: a fence counter after its retention,
                    # released values seconds after the last release.
                    if pttl == -1:
                        what = "fence counter" if tail.endswith(":fence") else "released values"
                        found.append(f"{key}: {what} without expiry")
                elif tail == "":
                    value = _text(await client.get(key) or b"")
                    owner = value.partition(":")[2] or value
                    found.append(f"{key}: lock held by {owner!r} (pttl {pttl} ms)")
                elif tail.endswith(":due"):
                    for member, due in (await client.hgetall(key)).items():
                        until = _text(due).partition(":")[0]
                        if until.isdigit() and int(until) > now_ms:
                            owner = _text(member).partition(":")[2]
                            found.append(
                                f"{key}: live waiter-queue place of {owner!r} "
                                f"({int(until) - now_ms:.0f} ms left)"
                            )
                else:
                    kind = _text(await client.type(key))
                    found.append(f"{key}: {kind} left (pttl {pttl} ms)")
        finally:
            await client.aclose()
    return found


# --------------------------------------------------------------------------------------
# Beliefs against the server, losses outside faults, hand-offs


async def _server_clock(url: str) -> tuple[float, float, float]:
    """``(sent, replied, server time)``: the tightest of a few ``TIME`` reads, bracketed
    by this process's monotonic clock."""
    from redis.asyncio import Redis  # noqa: PLC0415

    client = Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    best: tuple[float, float, float] | None = None
    try:
        for _ in range(5):
            sent = time.monotonic()
            seconds, micros = await client.time()
            replied = time.monotonic()
            if best is None or replied - sent < best[1] - best[0]:
                best = (sent, replied, seconds + micros / 1e6)
    finally:
        await client.aclose()
    assert best is not None
    return best


async def _server_clocks(urls: Sequence[str]) -> list[tuple[float, float, float] | str]:
    """A :func:`_server_clock` read of each server, or why there is none."""
    out: list[tuple[float, float, float] | str] = []
    for url in urls:
        try:
            out.append(await _server_clock(url))
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    return out


def _clock_rates(
    first: Sequence[tuple[float, float, float] | str],
    last: Sequence[tuple[float, float, float] | str],
) -> tuple[list[float], list[str]]:
    """Per server, the lowest rate its clock can have run at between the two reads (its
    seconds over the longest span of ours the reads allow), and what could not be
    measured (taken as 1.0)."""
    rates: list[float] = []
    errors: list[str] = []
    for index, (a, b) in enumerate(zip(first, last, strict=True)):
        if isinstance(a, str) or isinstance(b, str) or b[1] - a[0] <= 0:
            errors.append(f"server {index}: {a if isinstance(a, str) else b}")
            rates.append(1.0)
            continue
        rates.append((b[2] - a[2]) / (b[1] - a[0]))
    return rates, errors


def _kept_until(node: Sequence[Any], rate: float) -> float:
    """The latest monotonic time one node can have kept the key, from one read (see
    :attr:`ChaosReport.belief_violations`)."""
    _sent, replied, status, pttl = node
    if status < 0 or (status > 0 and pttl < 0):
        return math.inf  # no answer, or a key without expiry: nothing bounds it
    if status == 0:
        return float(replied)
    return float(replied) + (int(pttl) + 1) / 1000 / rate


Window = tuple[float, float, frozenset[int] | None]
"""(start, end, workers it disturbs: None for all), monotonic."""


def _fault_windows(
    sc: Scenario,
    applied: Sequence[tuple[Fault, float, float, str | None]],
    promotions: Sequence[_Promotion] = (),
) -> list[Window]:
    """Where faults may disturb leases: from each one's start to TTL + 1 s after its end,
    4 s more where clients find a restarted or new master; a stall's and an isolation's
    only for the workers they target; and each promotion the run saw."""
    out: list[Window] = []
    for fault, start, end, _ in applied:
        until = end + sc.ttl + 1
        if fault.kind in ("kill", "kill_master", "failover"):
            until += 4.0
        who = (
            frozenset(t % sc.workers for t in fault.targets)
            if fault.kind in ("stall", "isolate")
            else None
        )
        out.append((start, until, who))
    out += [(p.replica_at, p.master_at + sc.ttl + 5, None) for p in promotions]
    return out


def _disturbed(at: float, worker: int | None, windows: Sequence[Window]) -> bool:
    """Whether ``at`` lies in a window that disturbs ``worker`` (None: any worker)."""
    return any(
        start <= at <= end and (who is None or worker is None or worker in who)
        for start, end, who in windows
    )


@dataclass
class _Beliefs:
    samples: int = 0
    violations: int = 0
    excused: int = 0
    late: int = 0
    details: list[str] = field(default_factory=list)
    late_details: list[str] = field(default_factory=list)
    first: dict[str, float] = field(default_factory=dict)


def _server_checks(
    sc: Scenario,
    summaries: Sequence[WorkerSummary],
    clocks: tuple[
        Sequence[tuple[float, float, float] | str], Sequence[tuple[float, float, float] | str]
    ],
    applied: Sequence[tuple[Fault, float, float, str | None]],
    promotions: Sequence[_Promotion],
    *,
    t0: float,
    t0_wall: float,
) -> dict[str, Any]:
    """The report's fields of the checks against the server and of liveness: beliefs
    against the sampled expiries, renewal headroom, losses outside fault windows and the
    hand-off p99."""
    rates, clock_errors = _clock_rates(*clocks)
    disturbed = _fault_windows(sc, applied, promotions)
    losing = [
        (start, end + (4.0 if fault.kind in ("kill_master", "failover") else 0.0))
        for fault, start, end, _ in applied
        if fault.kind in _LOSES_LOCKS_ON.get(sc.backend, _LOSES_LOCKS)
    ] + [(p.replica_at, p.master_at + 4.0) for p in promotions]
    beliefs = _beliefs(sc, summaries, rates=rates, lossy=losing, windows=disturbed, t0=t0)
    losses, loss_details, first_loss = _losses_outside(sc, summaries, disturbed, t0)
    bound = _handoff_bound(sc, summaries)
    handoffs, first_slow = _handoffs(sc, summaries, disturbed, t0, t0_wall, bound=bound)
    # One pause of an event loop per worker, costing at most one lease per name.
    ceiling = _ALLOWED_PAUSES_PER_WORKER * sc.workers * sc.names
    first_seen = dict(beliefs.first)
    if losses > ceiling and first_loss is not None:
        first_seen["loss-ceiling"] = first_loss
    if beliefs.late <= ceiling:
        first_seen.pop("renewal-headroom", None)
    handoff_p99 = _p99(handoffs)
    if len(handoffs) >= _HANDOFF_MIN and handoff_p99 > bound and first_slow is not None:
        first_seen["handoff-p99"] = first_slow
    return {
        "clock_rate": sc.clock_rate,
        "clock_rates": rates,
        "clock_errors": clock_errors,
        "samples": beliefs.samples,
        "belief_violations": beliefs.violations,
        "belief_excused": beliefs.excused,
        "belief_details": beliefs.details,
        "late_renewals": beliefs.late,
        "late_renewal_details": beliefs.late_details,
        "losses_outside": losses,
        "loss_details": loss_details,
        "loss_ceiling": ceiling,
        "handoffs": len(handoffs),
        "handoff_p99": handoff_p99,
        "handoff_bound": bound,
        "extends": sum(s.extends for s in summaries),
        "samples_straddled": sum(s.samples_straddled for s in summaries),
        "extends_refused": sum(s.extends_refused for s in summaries),
        "extend_errors": sum(s.extend_errors for s in summaries),
        "first_seen": first_seen,
    }


def _beliefs(
    sc: Scenario,
    summaries: Sequence[WorkerSummary],
    *,
    rates: Sequence[float],
    lossy: Sequence[tuple[float, float]],
    windows: Sequence[Window],
    t0: float,
) -> _Beliefs:
    """Hold every sample's belief against the server's expiry (see
    :attr:`ChaosReport.belief_violations`), and count the late renewals outside fault
    windows (:attr:`ChaosReport.late_renewals`). ``lossy``: (start, end) of the faults
    that lose locks by design."""
    out = _Beliefs()
    for summary in summaries:
        worker = summary.worker % sc.workers
        for sample in summary.samples:
            name, fence, kind, sent, replied, belief, ttl, left, confirmed, doubted, nodes = sample
            out.samples += 1
            quorum = len(nodes) // 2 + 1
            kept = sorted(
                (_kept_until(node, rate) for node, rate in zip(nodes, rates, strict=True)),
                reverse=True,
            )[quorum - 1]
            if belief > kept:
                if any(start <= replied and confirmed <= end for start, end in lossy):
                    out.excused += 1
                else:
                    out.violations += 1
                    _first(out.first, "belief-vs-server", sent - t0)
                    if len(out.details) < 10:
                        held = sum(node[2] == 1 for node in nodes)
                        out.details.append(
                            f"{name} fence {fence} at t={sent - t0:.2f}s ({kind} sample): "
                            f"believed valid {(belief - kept) * 1000:.1f} ms past the latest "
                            f"the server kept it ({held} of {len(nodes)} node(s) held its "
                            f"token; ttl {ttl:g}s; {_sample_context(sample, rates, t0)})"
                        )
            if (
                kind == "renew"
                and not doubted
                and left < _HEADROOM * ttl
                and not _disturbed(sent, worker, windows)
            ):
                out.late += 1
                _first(out.first, "renewal-headroom", sent - t0)
                if len(out.late_details) < 10:
                    out.late_details.append(
                        f"w{worker} {name} fence {fence} at t={sent - t0:.2f}s: "
                        f"{left * 1000:.0f} ms of validity left of a {ttl:g}s TTL"
                    )
    return out


def _sample_context(sample: Sequence[Any], rates: Sequence[float], t0: float) -> str:
    """What a belief-vs-server finding needs to be read: the sample's bracket, the
    lease's belief and last confirmation, and each node's read (kept-until, relative)."""
    _, _, _, sent, replied, belief, _, left, confirmed, doubted, nodes = sample
    reads = ", ".join(
        f"n{i}:{'?' if status < 0 else 'mine' if status else 'not'}"
        f"@{(node_sent - t0):.3f}-{(node_replied - t0):.3f}"
        + (f" pttl={pttl}ms kept={(_kept_until(node, rate) - t0):.3f}" if status > 0 else "")
        for i, (node, rate) in enumerate(zip(nodes, rates, strict=True))
        for node_sent, node_replied, status, pttl in [node]
    )
    return (
        f"read {sent - t0:.3f}-{replied - t0:.3f}, left {left * 1000:.0f} ms as it left, "
        f"belief until {belief - t0:.3f}, confirmed at {confirmed - t0:.3f}"
        f"{', an extend in doubt' if doubted else ''}; {reads}"
    )


def _first(seen: dict[str, float], what: str, at: float) -> None:
    seen[what] = min(seen.get(what, at), at)


def _losses_outside(
    sc: Scenario, summaries: Sequence[WorkerSummary], windows: Sequence[Window], t0: float
) -> tuple[int, list[str], float | None]:
    """Leases lost outside every fault's window (its block's ``LockLost``, or a refused
    ``extend()``; not a close of the coordinator, which counts apart), the first few, and
    the first one's time after the start."""
    count = 0
    details: list[str] = []
    first: float | None = None
    for summary in summaries:
        worker = summary.worker % sc.workers
        for at, what in summary.events:
            kind, _, lease = what.partition(" ")
            if kind != "lost" or _disturbed(at, worker, windows):
                continue
            count += 1
            first = at - t0 if first is None else min(first, at - t0)
            if len(details) < 10:
                details.append(f"w{worker} {lease or '?'} at t={at - t0:.2f}s")
    return count, details, first


def _handoffs(
    sc: Scenario,
    summaries: Sequence[WorkerSummary],
    windows: Sequence[Window],
    t0: float,
    t0_wall: float,
    *,
    bound: float | None = None,
) -> tuple[list[float], float | None]:
    """Release-to-next-grant latencies (seconds) of the releases outside every fault's
    and every close's window, and before the run's last second, after which a task
    was waiting for the name (granted later, asked before); and when the first one over
    the bound happened (seconds after the start)."""
    closes: list[Window] = [
        (began, closed + 0.5, None)
        for summary in summaries
        for began, closed, *_ in summary.close_checks
    ]
    quiet = [*((start, end, None) for start, end, _ in windows), *closes]
    grants: dict[str, list[tuple[float, float]]] = {}
    for summary in summaries:
        for name, _fence, _holder, requested, granted, _left in summary.grants:
            grants.setdefault(name, []).append((float(granted), float(requested)))
    waiting: dict[str, list[float]] = {}  # per name, suffix minimum of the asks
    for name, items in grants.items():
        items.sort()
        low = math.inf
        mins = [0.0] * len(items)
        for i in range(len(items) - 1, -1, -1):
            low = min(low, items[i][1])
            mins[i] = low
        waiting[name] = mins
    latencies: list[float] = []
    first: float | None = None
    if bound is None:
        bound = _handoff_bound(sc, summaries)
    end = t0_wall + sc.duration - 1.0
    for summary in summaries:
        for name, _fence, released in summary.releases:
            if released > end or _disturbed(released - t0_wall + t0, None, quiet):
                continue
            items = grants.get(name, [])
            index = bisect.bisect_right(items, (released, math.inf))
            if index >= len(items) or waiting[name][index] >= released:
                continue  # nobody was waiting
            latency = items[index][0] - released
            latencies.append(latency)
            if latency > bound:
                at = released - t0_wall
                first = at if first is None else min(first, at)
    return latencies, first


def _handoff_bound(sc: Scenario, summaries: Sequence[WorkerSummary] = ()) -> float:
    """The most the hand-off p99 may be: a share of the TTL (``_HANDOFF_P99_TTLS``), or
    ``_HANDOFF_RTTS`` of the run's own p99 round trip, whichever is more."""
    share = _HANDOFF_P99_TTLS_REDLOCK if sc.backend == "redlock" else _HANDOFF_P99_TTLS
    trips = [
        float(node[1]) - float(node[0])
        for summary in summaries
        for sample in summary.samples
        for node in sample[-1]
        if isinstance(node, list | tuple) and len(node) >= 2
    ]
    return max(share * sc.ttl, _HANDOFF_RTTS * _p99(trips))


def _p99(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _stale_budget(sc: Scenario, verdict: _Verdict) -> int:
    return _STALE_PER_FAULT * len(sc.faults) + verdict.sections // 1000


# --------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker", help="one worker process (started by the runner)")
    worker.add_argument("--worker", type=int, required=True)
    worker.add_argument("--target", required=True, help="JSON: a URL or a list of URLs")
    worker.add_argument("--options", default="{}", help="JSON: connect() options")
    worker.add_argument("--history", required=True, help="URL of the history Valkey")
    worker.add_argument("--namespace", required=True)
    worker.add_argument("--names", required=True, help="comma-separated lock names")
    worker.add_argument("--tasks", type=int, default=16)
    worker.add_argument("--duration", type=float, default=60.0)
    worker.add_argument("--ttl", type=float, default=1.0)
    worker.add_argument("--timeout", type=float, default=3.0)
    worker.add_argument("--hold", type=float, default=0.01)
    worker.add_argument("--patch", default="", help="module:function to call first")
    worker.add_argument("--backend", default="redis", choices=BACKENDS)
    worker.add_argument("--admin", default="", help="JSON: a direct way to the server")
    worker.add_argument("--closes", default="[]", help="JSON: when to close (seconds)")
    worker.add_argument("--sample", default="[]", help="JSON: direct URLs to read expiry on")
    worker.add_argument("--package", default="", help="the folder asynclock must come from")
    run = sub.add_parser("run", help="run scenarios and print their reports")
    run.add_argument("backends", nargs="*", default=list(BACKENDS), choices=BACKENDS)
    run.add_argument("--duration", type=float, default=60.0)
    run.add_argument("--workers", type=int, default=4)
    run.add_argument("--tasks", type=int, default=16)
    run.add_argument("--json", help="also write the reports to this file")
    return parser


async def _run_cli(args: argparse.Namespace) -> tuple[list[ChaosReport], bool]:
    from pytest_asynclock import PostgresFactory, ValkeyFactory  # noqa: PLC0415

    reports: list[ChaosReport] = []
    failed = False
    for backend in args.backends:
        sc = dataclasses.replace(
            scenario(backend, args.duration), workers=args.workers, tasks=args.tasks
        )
        with ValkeyFactory() as valkeys, PostgresFactory() as postgres:
            try:
                report = await run_scenario(sc, valkey_factory=valkeys, postgres_factory=postgres)
            except ScenarioSkipped as exc:
                print(f"{backend}: skipped: {exc}", flush=True)
                continue
        print(report.table(), flush=True)
        for problem in report.problems:
            print(f"  PROBLEM: {problem}", flush=True)
        failed = failed or bool(report.problems)
        reports.append(report)
    return reports, failed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.chaos worker|run ...``; ``run`` exits 1 when a
    report has problems."""
    args = _parser().parse_args(argv)
    if args.command == "worker":
        return _worker_main(args)
    reports, failed = asyncio.run(_run_cli(args))
    if reports:
        print(format_reports(reports))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([r.as_dict() for r in reports], out, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
