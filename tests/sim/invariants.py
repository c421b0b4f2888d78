"""The safety invariants (README, "Guarantees"), checked after every loop step and
every server event.

1. A held lease's local validity never exceeds the server's expiry for it (both in
   virtual time; the server's clock drifts within what ``backend.drift()`` allows).
2. Never two locally valid leases on one exclusive name (nor more than ``limit``
   permits); fences strictly increase per name; a stale release or extend never
   succeeds; a lease's fence is the one the server granted to its claim.
3. When an operation ends (returned, raised, cancelled), nothing it took is still held on
   the server once a short give-back has passed (counted from the end of the last fault
   that touched its client; grants that landed after their own release are left to their
   TTL), the coordinator holds no lease of it, and none of its claims keeps a place in a
   waiter line (a give-up leaves the queue whatever the moment: while subscribing,
   waiting, or leaving the wait).
4. A task we cancelled ends cancelled; no exception replaces the ``CancelledError``.
5. Every request ends by its deadline; an acquire with a timeout ends within the timeout
   plus a bounded clean-up (two socket timeouts), pauses aside.
6. After ``aclose()`` no task is left and the backend has nothing in flight (checked at
   the end of a run by :mod:`tests.sim.workload`).

A violation raises :class:`Violation`; the first one is kept in :attr:`Checker.violation`
so that a violation found inside a callback (where the loop would only log it) still
stops the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asynclock import Coordinator

from .server import Grant, Server

if TYPE_CHECKING:
    from .network import Net, SimBackend

__all__ = (
    "ABANDONED_ROUND",
    "KNOWN_BUGS",
    "SHORTENING_EXTEND",
    "Checker",
    "OpRecord",
    "Violation",
)

#: Found by this simulation on the engine and fixed (see tests/test_sim.py): while an
#: extend request that shortens the lease had run on the server and its reply was on its
#: way back, the lease still reported its old, longer validity. Kept as the name a
#: checker tolerance would use, should a known bug ever need parking again.
SHORTENING_EXTEND = "shortening-extend-in-flight"
#: Found by the Redlock kind of this simulation and fixed: an acquire's round whose
#: replies were lost (a partition, timeouts) may still have taken a majority; its
#: give-back went once, within the node timeout, and the next round took a fresh token,
#: so the coordinator's give-back after the acquire failed (QuorumError) released only
#: the last round's value: the earlier one held the lock until its TTL. A round's
#: give-back to nodes that did not answer is now retried until they answer or its TTL
#: has passed (RedlockBackend._give_back). Kept as the name its tolerance would use.
ABANDONED_ROUND = "redlock-abandoned-round"
#: Engine bugs known and not yet fixed, whose windows the default run does not report
#: (``--strict`` reports them).
KNOWN_BUGS: frozenset[str] = frozenset()

# Floating-point slack when comparing moments in virtual time.
_EPS = 1e-9


class Violation(Exception):
    """An invariant does not hold."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"[{invariant}] {detail}")
        self.invariant = invariant
        self.detail = detail


@dataclass
class OpRecord:
    """One workload operation: what it was, what it took, how it ended."""

    id: int
    client: int
    kind: str
    name: str
    ttl: float
    timeout: float | None
    started: float = 0.0
    ended: float | None = None
    outcome: str = ""
    cancels: int = 0  # task.cancel() calls that returned True
    claims: list[str] = field(default_factory=list)
    acquire_end: float | None = None
    outer: bool = False  # its acquire ran under an asyncio.timeout of the caller's


class Checker:
    """Checks the invariants against the clients' leases and the server's table."""

    def __init__(
        self,
        *,
        server: Server,
        net: Net,
        coords: dict[int, Coordinator],
        backends: dict[int, SimBackend],
        give_back: float,
        fault_end: Callable[[int], float],
        record: Callable[[str, str], None],
    ) -> None:
        self.server = server
        self.net = net
        self.coords = coords
        self.backends = backends
        self.give_back = give_back
        self.fault_end = fault_end
        self.record = record
        #: The longest TTL the workloads ask for: how far a closed client's leftover may
        #: still be waiting for its TTL.
        self.max_ttl = 5.0
        self.violation: Violation | None = None
        #: Known engine bugs whose window is not reported (see KNOWN_BUGS).
        self.tolerate: frozenset[str] = frozenset()
        self.limits: dict[str, int] = {}
        self._fence_seen: dict[str, int] = {}  # claim value -> fence checked
        self._pending: list[tuple[float, OpRecord]] = []
        #: How soon after a give-up its places in waiter lines must be gone: a round
        #: trip or two, well before a dead place would lapse on its own.
        self.leave = give_back
        self._lines: list[tuple[float, OpRecord]] = []
        self._late: list[tuple[float, Grant]] = []
        self.checks = 0
        server.on_grant = self._on_grant
        server.on_stale = self._on_stale

    def fail(self, invariant: str, detail: str) -> None:
        """Record the first violation and raise it."""
        self.note(invariant, detail)
        assert self.violation is not None
        raise self.violation

    def note(self, invariant: str, detail: str) -> None:
        """Record a violation (the first one stays) without raising it."""
        if self.violation is None:
            self.violation = Violation(invariant, detail)
            self.record("VIOLATION", str(self.violation))

    # -- server events -------------------------------------------------------------

    def _on_grant(self, grant: Grant) -> None:
        key = (grant.kind, grant.name)
        top = self.server.top_fence.get(key, 0)
        self.record(
            "grant",
            f"{grant.kind} {grant.name} fence {grant.fence} to {grant.label} (op {grant.op})"
            + (" ORPHAN (landed after its release)" if grant.orphan else ""),
        )
        if grant.orphan:
            self._orphan(grant)
        if grant.fence <= top:
            self.fail("2-fence", f"{grant.kind} {grant.name}: fence {grant.fence} after {top}")
        self.server.top_fence[key] = grant.fence

    def _on_stale(self, op: str, value: str) -> None:
        grant = self.server.grants.get(value)
        label = grant.label if grant else "?"
        self.fail("2-stale", f"a stale {op} of {label} succeeded on the server")

    def _orphan(self, grant: Grant) -> None:
        """A grant that landed after its own give-back found nothing: the coordinator
        looks again for ``ttl + straggle()`` after that give-back began, at intervals up to
        a second; a grant landing well within that window must be given back."""
        backend = self.backends[grant.client]
        began = backend.first_release.get(grant.value)
        if began is None:
            return
        look_until = backend.sim_clock.real(began) + grant.ttl + backend.straggle()
        if grant.at + 1.5 < look_until:
            due = max(grant.at, self.fault_end(grant.client)) + self.give_back
            self._late.append((due, grant))

    # -- every step ------------------------------------------------------------------

    def step(self) -> None:
        """Check invariants 1 and 2 now, and the give-back of operations that are due."""
        if self.violation is not None:
            raise self.violation
        self.checks += 1
        now = self.net.world.now
        self._exclusive(self._leases(now))
        if self._late:
            self._check_late(now)
        if self._lines:
            due = [(t, op) for t, op in self._lines if t <= now]
            if due:
                self._lines = [(t, op) for t, op in self._lines if t > now]
                for _, op in sorted(due, key=lambda item: (item[0], item[1].id)):
                    self._left_the_line(op, now)
        while self._pending and self._pending[0][0] <= now:
            self._pending.sort(key=lambda item: (item[0], item[1].id))
            _, op = self._pending.pop(0)
            self._give_back(op, now)

    def _leases(self, now: float) -> dict[tuple[str, str], list[tuple[bool, str]]]:
        """Invariant 1 for every locally valid lease; those leases per (kind, name)."""
        server = self.server
        valid: dict[tuple[str, str], list[tuple[bool, str]]] = {}
        for client, coord in self.coords.items():
            backend = self.backends[client]
            clock = backend.clock
            cnow = clock.now()
            for lease in coord.held:
                claim = lease._claim
                value = claim.value
                if value not in self._fence_seen:
                    grant = server.grants.get(value)
                    if grant is None or grant.fence != lease.fence:
                        self.fail(
                            "2-fence",
                            f"lease {backend.label(claim)} has fence {lease.fence}, server "
                            f"granted {None if grant is None else grant.fence}",
                        )
                    self._fence_seen[value] = lease.fence
                if not lease.held or lease._valid_until <= cnow or value in backend.releasing:
                    continue
                if SHORTENING_EXTEND in self.tolerate and backend.extend_in_window(value):
                    continue
                local_end = lease._valid_until - (cnow - now)  # in virtual time
                expiry = server.expiry(claim)
                if expiry is None or local_end > expiry + _EPS:
                    shown = "nothing" if expiry is None else f"{expiry:.6f}"
                    self.fail(
                        "1-validity",
                        f"lease {backend.label(claim)} on {claim.name!r} (ttl {lease.ttl:g}) "
                        f"believes it is valid until {local_end:.6f}, the server keeps "
                        f"{shown} (now {now:.6f})",
                    )
                kind = "permit" if claim.limit else "lock"
                valid.setdefault((kind, claim.name), []).append(
                    (claim.shared, backend.label(claim))
                )
        return valid

    def _exclusive(self, valid: dict[tuple[str, str], list[tuple[bool, str]]]) -> None:
        """Invariant 2: at most one valid exclusive lease (or ``limit`` permits)."""
        for (kind, name), holders in valid.items():
            if len(holders) < 2:
                continue
            if kind == "permit":
                limit = self.limits.get(name, 1)
                if len(holders) > limit:
                    self.fail("2-exclusive", f"{len(holders)} valid permits of {name!r} > {limit}")
            elif not all(shared for shared, _ in holders):
                who = ", ".join(label for _, label in holders)
                self.fail("2-exclusive", f"{name!r} locally valid for several holders: {who}")

    # -- operations ---------------------------------------------------------------------

    def op_ended(self, op: OpRecord) -> None:
        """Schedule the give-back check of an operation that just ended."""
        due = max(op.ended or 0.0, self.fault_end(op.client)) + self.give_back
        self._pending.append((due, op))
        self._lines.append((max(op.ended or 0.0, self.fault_end(op.client)) + self.leave, op))
        self._pending.sort(key=lambda item: (item[0], item[1].id))

    def _give_back(self, op: OpRecord, now: float) -> None:
        fault = self.fault_end(op.client)
        left = [v for v in op.claims if self._still_held(v, now)]
        lease_left = [
            lease
            for lease in self.coords[op.client].held
            if lease._claim.value in op.claims and lease.held
        ]
        if not left and not lease_left:
            return
        if fault + self.give_back > now:
            # A fault since the operation ended: give the clean-up its time again.
            self._pending.append((fault + self.give_back, op))
            return
        if self.coords[op.client].closed and not lease_left:
            # A closing coordinator tries its releases once and leaves the rest to the
            # TTL, counted from the last request that reached the server (a renewal sent
            # before the close may land after it).
            expiry = max(
                (exp for name, held, exp in self.server.held_values() if held in left),
                default=now,
            )
            if now < expiry <= now + self.max_ttl + _EPS:
                self._pending.append((expiry + _EPS, op))
                return
        backend = self.backends[op.client]
        labels = [self.server.grants[v].label for v in left] + [
            backend.label(lease._claim) for lease in lease_left
        ]
        self.fail(
            "3-give-back",
            f"op {op.id} ({op.kind} {op.name!r}, client c{op.client}) ended at "
            f"{op.ended:.6f} ({op.outcome}) but {', '.join(labels)} still held at {now:.6f} "
            f"(server: {len(left)}, coord.held: {len(lease_left)})",
        )

    def _left_the_line(self, op: OpRecord, now: float) -> None:
        """Invariant 3 for waiter lines: an ended operation keeps no place in one."""
        places = [
            (name, until)
            for name, value in sorted(self.server.attempted.get(op.id, ()))
            if (until := self.server.queued(name, value)) is not None
        ]
        if not places:
            return
        if self.fault_end(op.client) >= op.started:
            # A fault during or since the operation: a request to leave may have failed
            # (it is not sent again), and the place lapses on its own.
            return
        if self.coords[op.client].closed:
            return  # closing stops leaving; the place lapses on its own
        name, until = places[0]
        self.fail(
            "3-queue",
            f"op {op.id} ({op.kind} {op.name!r}, client c{op.client}) ended at "
            f"{op.ended:.6f} ({op.outcome}) but still has a place in the line of "
            f"{name!r} at {now:.6f} (lapsing at {until:.6f})",
        )

    def _check_late(self, now: float) -> None:
        due_now = [(due, g) for due, g in self._late if due <= now]
        if not due_now:
            return
        self._late = [(due, g) for due, g in self._late if due > now]
        for _, grant in due_now:
            if self.coords[grant.client].closed:
                continue  # a closing coordinator stops looking: the TTL ends it
            if not self._still_held(grant.value, now, orphans=True):
                continue
            if any(
                lease._claim.value == grant.value and lease.fence == grant.fence
                for lease in self.coords[grant.client].held
            ):
                # Not an orphan: a grant that came too late was given back inline (the
                # release above) and the same acquire was granted again, legitimately.
                continue
            fault = self.fault_end(grant.client)
            if fault + self.give_back > now:
                self._late.append((fault + self.give_back, grant))
                continue
            self.fail(
                "3-late-grant",
                f"{grant.label} ({grant.kind} {grant.name!r}, op {grant.op}) landed at "
                f"{grant.at:.6f} after its give-back had found nothing, and is still held "
                f"at {now:.6f}",
            )

    def _still_held(self, value: str, now: float, *, orphans: bool = False) -> bool:
        grant = self.server.grants.get(value)
        if grant is None or (grant.orphan and not orphans):
            return False
        for name, held, expiry in self.server.held_values():
            if held == value and name == grant.name:
                return expiry > now
        return False
