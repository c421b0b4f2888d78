"""Deliberately broken locks, for checking that the chaos runner catches them.

Each function patches asynclock in a chaos worker process before it starts (the runner's
``Scenario.patch = "tests.chaos_mutants:<name>"``). A runner that reports no problem on
any of them proves nothing by reporting none on the real lock
(``tests/test_chaos.py::test_the_runner_catches_a_broken_lock``).
"""

from __future__ import annotations

from typing import Any

from asynclock import _coordinator, _lock
from asynclock.backends import _scripts
from asynclock.backends.base import Attempt, Backend
from asynclock.backends.redis import RedisBackend
from asynclock.testing.chaos import Fault

__all__ = ("FAULTS", "MUTANTS", "SECONDS")


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
    _lock.Lease._lose = lambda self, reason: None  # type: ignore[method-assign]


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
    original = _lock.Lease._assume
    trusted: set[str] = set()

    def _assume(self: _lock.Lease, start: float, ttl: float) -> None:
        if self._renew and self.token not in trusted:
            trusted.add(self.token)
            self._confirmed(start, ttl)
            return
        original(self, start, ttl)

    _lock.Lease._assume = _assume  # type: ignore[method-assign]


def late_grants() -> None:
    """A grant that arrives with its validity spent is handed to the body anyway."""
    _lock.Lock._left = lambda self, start: 1.0  # type: ignore[method-assign]


def aclose_keeps_leases() -> None:
    """``aclose()`` ends its leases and abandons its in-flight grants locally but gives
    nothing back on the server: the locks stay there, held by nobody, until their TTL
    (what racing closes and grants did before; only a look at the server after the
    close shows it)."""
    original = _coordinator.Coordinator._discard

    def _discard(self: _coordinator.Coordinator, *args: Any, **kwargs: Any) -> None:
        if not self.closed:
            original(self, *args, **kwargs)

    _coordinator.Coordinator._discard = _discard  # type: ignore[method-assign]


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
