"""Deliberately broken locks, for checking that the chaos runner catches them.

Two kinds. Each function here patches asynclock in a chaos worker process before it
starts (the runner's ``Scenario.patch = "tests.chaos_mutants:<name>"``). Each
:data:`PLANTED` entry is a minimal edit of the library's source in the
``tests/sim/mutants.py`` shape (``Mutant(name, description, edits)``, ``(path, fixed
code, buggy code)``), applied to a copy of the package that the workers import
(``Scenario.package``), with the property of the runner that must catch it, the backend,
the seconds and the faults that show it. A runner that reports no problem on any of them
proves nothing by reporting none on the real lock
(``tests/test_chaos.py::test_the_runner_catches_a_broken_lock``,
``test_the_checks_catch_a_planted_mutant``; ``python -m tests.chaos_mutants`` runs the
planted ones and prints which property caught each, and when).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asynclock import _engine, _lease, _lock
from asynclock.backends.base import Attempt, Backend
from asynclock.backends.redis import RedisBackend
from asynclock.backends.redis import scripts as _scripts
from tests.chaos import ChaosReport, Fault, ScenarioSkipped, run_scenario, scenario

from .sim.mutants import Mutant, apply

__all__ = ("FAULTS", "MUTANTS", "PLANTED", "SECONDS", "Planted", "main", "planted_copy", "run")


def _script(script: _scripts.Script, old: str, new: str) -> _scripts.Script:
    assert old in script.source, f"the mutant no longer applies to {script.name}"
    return _scripts.Script(f"{script.name}_mutant", script.source.replace(old, new))


def always_grants() -> None:
    """The acquire script takes the lock whoever holds it (SET without NX)."""
    _scripts.ACQUIRE = _script(
        _scripts.ACQUIRE,
        "redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])",
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])",
    )


def never_loses() -> None:
    """The watchdog never declares a lease lost (a refused renewal goes unnoticed)."""
    _lease.Lease.mark_lost = lambda self, reason: None  # type: ignore[method-assign]


def _with_fence(fence: Any) -> None:
    original = RedisBackend.try_acquire

    async def try_acquire(self: RedisBackend, claim: Any, ttl: float, **kw: Any) -> Attempt:
        attempt = await original(self, claim, ttl, **kw)
        if attempt.fence is None:
            return attempt
        return Attempt(fence(attempt.fence), attempt.retry_after, attempt.start)

    RedisBackend.try_acquire = try_acquire  # type: ignore[method-assign]


def same_fence() -> None:
    """Every grant gets the same fence."""
    _with_fence(lambda fence: 1)


def decreasing_fences() -> None:
    """Fences go down as time goes on."""
    _with_fence(lambda fence: 2**52 - fence)


def release_anyones() -> None:
    """Release deletes the lock whoever holds it (no owner check)."""
    _scripts.RELEASE = _script(
        _scripts.RELEASE,
        "if redis.call('GET', KEYS[1]) == ARGV[1] then",
        "if redis.call('DEL', KEYS[1]) >= 0 then",
    )


def long_validity() -> None:
    """Leases believe three times their TTL."""
    Backend.drift = lambda self, ttl: -2 * ttl  # type: ignore[method-assign]


def trusts_a_lost_renewal() -> None:
    """A renewal whose outcome is unknown (the connection failed) counts as confirmed,
    once per lease: a client cut off from the server alone holds on for up to a TTL
    while another is granted the lock (found by review; only an ``isolate`` fault,
    one client cut off while the others reach the server, shows it)."""
    original = _lease.Lease.unconfirmed
    trusted: set[str] = set()

    def unconfirmed(self: _lease.Lease, start: float, ttl: float) -> None:
        if self._renew and self.token not in trusted:
            trusted.add(self.token)
            self.confirmed(start, ttl)
            return
        original(self, start, ttl)

    _lease.Lease.unconfirmed = unconfirmed  # type: ignore[method-assign]


def late_grants() -> None:
    """A grant that arrives with its validity spent is handed to the body anyway."""
    _lock.Lock._left = lambda self, start: 1.0  # type: ignore[method-assign]


def aclose_keeps_leases() -> None:
    """``aclose()`` ends its leases and abandons its in-flight grants locally but gives
    nothing back on the server: the locks stay there, held by nobody, until their TTL
    (what racing closes and grants did before; only a look at the server after the
    close shows it)."""
    original = _engine.Engine.release_in_background

    def release_in_background(self: _engine.Engine[Any], *args: Any, **kwargs: Any) -> None:
        if not self.closed:
            original(self, *args, **kwargs)

    _engine.Engine.release_in_background = release_in_background  # type: ignore[method-assign]


MUTANTS: dict[str, str] = {
    name: f"tests.chaos_mutants:{name}"
    for name in (
        "always_grants",
        "never_loses",
        "same_fence",
        "decreasing_fences",
        "release_anyones",
        "long_validity",
        "late_grants",
        "trusts_a_lost_renewal",
        "aclose_keeps_leases",
    )
}
"""Every mutant, by name: what ``Scenario.patch`` takes."""

SECONDS: dict[str, float] = {
    # Caught in the first seconds, by the first fault (a freeze at 2 s) or on any grant.
    "always_grants": 9.0,
    "same_fence": 9.0,
    "decreasing_fences": 9.0,
    "release_anyones": 9.0,
    "never_loses": 9.0,
    # Each worker closes its coordinator every 2-6 s, outside the fault windows.
    "aclose_keeps_leases": 14.0,
    # Needs a stalled holder (the stall at 5.5 s): a frozen server alone is not enough.
    "long_validity": 13.0,
    # Only an isolate fault shows it: six of them (FAULTS), the last ending at 14.2 s.
    "trusts_a_lost_renewal": 16.0,
    # Only a grant whose reply comes after its validity shows it: two latency faults
    # (FAULTS), the last ending at 6.5 s.
    "late_grants": 8.0,
}
"""How long each mutant's run lasts (the short schedule, cut to the faults that end in
time): long enough for what catches it, no longer (the suite's time is counted)."""

FAULTS: dict[str, tuple[Fault, ...]] = {
    # The short schedule's one isolate (17.5 s) missed it once on a machine under a
    # 2-CPU load: it shows only if a cut-off worker is in a long section as the isolate
    # begins. Six isolates, of two pairs of workers in turn, and nothing else.
    "trusts_a_lost_renewal": tuple(
        Fault(2 + 2.2 * i, "isolate", 1.2, targets=(1, 2) if i % 2 == 0 else (0, 3))
        for i in range(6)
    ),
    # The short schedule's freeze showed it only when an acquire sent during the freeze
    # was answered within its deadline but after its validity: it missed in 1 of 2 runs.
    # A latency of 0.6 s each way makes every round trip longer than the TTL (1 s), so
    # every grant made during it arrives spent, with time left in the 3 s timeout.
    "late_grants": (
        Fault(1.5, "latency", 2.0, latency=0.6),
        Fault(4.5, "latency", 2.0, latency=0.6),
    ),
}
"""A mutant's own fault schedule, instead of the short one's, where that one shows it
too rarely."""


# --------------------------------------------------------------------------------------
# Planted mutants: minimal edits of the library's source, run by the workers from a copy


@dataclass(frozen=True)
class Planted:
    """A :class:`Mutant` for the chaos runner: ``caught_by`` is the property of the
    report (a key of :attr:`ChaosReport.first_seen`, or ``problems`` for the older
    checks) that must catch it in a ``backend`` run of ``seconds`` with ``faults``."""

    mutant: Mutant
    caught_by: str
    backend: str
    seconds: float
    faults: tuple[Fault, ...] = ()


# No fault: what shows in a quiet run (the Redis server's clock runs 0.8 % fast, inside
# the drift allowance, in every Redis run where libfaketime is installed).
_QUIET: tuple[Fault, ...] = ()

PLANTED: tuple[Planted, ...] = (
    Planted(
        Mutant(
            "validity-from-reply",
            "a lease's validity (grant and renewal) counted from the reply, not the request",
            (
                (
                    "_lock.py",
                    "            self.ttl,\n            start,\n            renew=self.renew,\n",
                    "            self.ttl,\n            coord.backend.clock.now(),\n"
                    "            renew=self.renew,\n",
                ),
                (
                    "_watchdog.py",
                    "                lease.confirmed(start, ttl)\n",
                    "                lease.confirmed(self._clock.now(), ttl)\n",
                ),
            ),
        ),
        "belief-vs-server",
        "redis",
        5.0,
        # Replies 50 ms late (each way): the grant's reply comes long after the server
        # counted the lease from.
        (Fault(1.0, "latency", 3.0, latency=0.05),),
    ),
    Planted(
        Mutant(
            "drift-dropped",
            "no drift allowance: a lease believes its whole TTL",
            (
                (
                    "backends/base.py",
                    "        return ttl * self.drift_factor + self.drift_base\n",
                    "        return 0.0\n",
                ),
            ),
        ),
        "belief-vs-server",
        "redis",
        4.0,
        _QUIET,
    ),
    Planted(
        Mutant(
            "extend-refused-believed",
            "extend() the server refused counts as extended",
            (
                (
                    "_lease.py",
                    "        if not extended:\n",
                    "        if extended is None:\n",
                ),
            ),
        ),
        "belief-vs-server",
        "redis",
        17.0,
        # The server restarted empty: extends of leases held across it are refused (an
        # extend that failed while it was down is tried again every 20-80 ms).
        tuple(Fault(1.0 + 2.0 * i, "kill", 0.3) for i in range(8)),
    ),
    Planted(
        Mutant(
            "late-renewal",
            "renewals scheduled at 0.9 x TTL instead of TTL / 3",
            (
                (
                    "_lease.py",
                    "        self._interval = ttl / 3\n",
                    "        self._interval = ttl * 0.9\n",
                ),
                (
                    "_lease.py",
                    "        self._interval = effective / 3\n",
                    "        self._interval = effective * 0.9\n",
                ),
            ),
        ),
        "renewal-headroom",
        "redis",
        10.0,
        _QUIET,
    ),
    Planted(
        Mutant(
            "release-wakes-nobody",
            "a release wakes no waiter (they find the lock free at their next backoff step)",
            (
                (
                    "backends/redis/scripts.py",
                    "  remember(KEYS[7], id, now_ms(), tonumber(ARGV[2]))\n"
                    "  hand_on(KEYS[2], id, KEYS[3], KEYS[4], KEYS[5], KEYS[6])\n",
                    "  remember(KEYS[7], id, now_ms(), tonumber(ARGV[2]))\n",
                ),
            ),
        ),
        "handoff-p99",
        "redis",
        6.0,
        _QUIET,
    ),
    Planted(
        Mutant(
            "fence-not-incremented",
            "a grant's fence is the counter as it was (not one more, not the server's time)",
            (
                (
                    "backends/redis/scripts.py",
                    "  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])\n",
                    "  local fence = 0\n",
                ),
                (
                    "backends/redis/scripts.py",
                    "    fence = last + 1\n",
                    "    fence = math.max(last, 1)\n",
                ),
            ),
        ),
        "problems",
        "redis",
        4.0,
        _QUIET,
    ),
    Planted(
        Mutant(
            "redlock-majority",
            "Redlock's majority miscounted: 2 of 5 nodes",
            (
                (
                    "backends/redlock.py",
                    "        self.quorum = len(self._nodes) // 2 + 1\n",
                    "        self.quorum = len(self._nodes) // 2\n",
                ),
            ),
        ),
        "belief-vs-server",
        "redlock",
        6.0,
        _QUIET,
    ),
)
"""The planted mutants, one per class of mistake the checks against the server and of
liveness must catch."""

_ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def planted_copy(mutant: Mutant) -> Iterator[str]:
    """A temporary folder holding a copy of ``asynclock/`` with ``mutant`` applied.

    Raises ``LookupError`` when the fixed code is no longer in the library (the mutant
    must be brought up to date)."""
    with tempfile.TemporaryDirectory(prefix=f"asynclock-chaos-{mutant.name}-") as tmp:
        package = Path(tmp) / "asynclock"
        shutil.copytree(_ROOT / "asynclock", package, ignore=shutil.ignore_patterns("__pycache__"))
        apply(mutant, package)
        yield tmp


def caught(report: ChaosReport, planted: Planted) -> str | None:
    """How ``report`` shows ``planted``: its property and when, or None if it does not."""
    if planted.caught_by == "problems":
        return f"problems: {report.problems[0]}" if report.problems else None
    at = report.first_seen.get(planted.caught_by)
    return None if at is None else f"{planted.caught_by} after {at:.2f}s"


async def run(planted: Planted, valkey_factory: Any) -> ChaosReport:
    """Run ``planted``'s scenario with the mutated copy in the workers."""
    with planted_copy(planted.mutant) as folder:
        sc = dataclasses.replace(
            scenario(planted.backend, 20.0),
            faults=planted.faults,
            duration=planted.seconds,
            package=folder,
        )
        return await run_scenario(sc, valkey_factory=valkey_factory)


def main(argv: list[str] | None = None) -> int:
    """Run every planted mutant (or those named); print what caught each; exit 1 if
    one was missed."""
    from pytest_asynclock import ValkeyFactory  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m tests.chaos_mutants")
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    args = parser.parse_args(argv)
    missed = False
    for planted in PLANTED:
        if args.names and planted.mutant.name not in args.names:
            continue
        began = time.perf_counter()
        with ValkeyFactory() as valkeys:
            try:
                report = asyncio.run(run(planted, valkeys))
            except ScenarioSkipped as exc:
                print(f"{planted.mutant.name}: skipped: {exc}", flush=True)
                continue
        took = time.perf_counter() - began
        how = caught(report, planted)
        missed = missed or how is None
        print(
            f"{planted.mutant.name}: {how or 'MISSED'} ({planted.backend}, "
            f"{planted.seconds:g}s run, {took:.0f}s in all)  [{planted.mutant.description}]",
            flush=True,
        )
        for problem in report.problems:
            print(f"  problem: {problem[:300]}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
