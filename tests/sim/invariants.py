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
8. Liveness, on virtual time, each bound derived from the seed's configuration:
   ``8-no-loss``, no renewed lease is lost when no fault touched its client within its
   TTL (:meth:`Checker.loss`); ``8-hand-off``, a release that frees a name reaches a
   waiter within a few one-way delays when no fault is active (:meth:`Checker.released`);
   ``8-body-stopped``, a body cancelled on loss takes no step after its loss
   (:meth:`Checker.body_step`). A fault is what the network's ``fault_log`` records
   (resets, socket timeouts, late landings, delay spikes), a partition of the client, or
   a pause of the client process (:meth:`Checker.touched`).

A violation raises :class:`Violation`; the first one is kept in :attr:`Checker.violation`
so that a violation found inside a callback (where the loop would only log it) still
stops the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asynclock import Coordinator
from asynclock.backends import Interrupted, Kind

from .server import Grant, Server

if TYPE_CHECKING:
    from .network import Net, SimBackend

__all__ = (
    "ABANDONED_ROUND",
    "HAND_OFF_DELAYS",
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
#: The hand-off bound of invariant 8, in mean one-way delays (see Checker.released).
HAND_OFF_DELAYS = 40


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
    renew: bool = True  # its lease is renewed by the watchdog
    stops_on_loss: bool = False  # its body is cancelled when its lease is lost
    longest_ttl: float = 0.0  # the longest TTL its lease asks for (acquire or extend)
    steps: list[float] = field(default_factory=list)  # its body's steps (virtual time)


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
        ops: Sequence[OpRecord],
        pauses: Sequence[tuple[float, float]],
        partitions: Sequence[tuple[float, float, int]],
        latency: float,
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
        #: Invariants not checked (to show which one catches a mutant, and that only it).
        self.ignore: frozenset[str] = frozenset()
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
        server.on_release = self._on_release
        # -- liveness (invariant 8)
        self.ops = ops  # by id
        self.pauses = pauses
        self.partitions = partitions
        #: A release's wake-up reaching a waiter: see :meth:`released`.
        self.hand_off = HAND_OFF_DELAYS * latency
        #: Claim value -> when its lease was marked lost (virtual time).
        self.losses: dict[str, float] = {}
        self._by_fence: dict[tuple[str, int], Grant] = {}
        self._grants_of: dict[str, int] = {}  # name -> grants so far
        self._wakes: list[tuple[float, float, float, Grant, int, list[OpRecord]]] = []
        for client, coord in coords.items():
            self._hook_losses(client, coord)

    def fail(self, invariant: str, detail: str) -> None:
        """Record the first violation and raise it (nothing if ``invariant`` is ignored)."""
        self.note(invariant, detail)
        if self.violation is not None:
            raise self.violation

    def note(self, invariant: str, detail: str) -> None:
        """Record a violation (the first one stays) without raising it."""
        if invariant in self.ignore:
            return
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
        self._by_fence[grant.name, grant.fence] = grant
        self._grants_of[grant.name] = self._grants_of.get(grant.name, 0) + 1

    def _on_stale(self, op: str, value: str) -> None:
        grant = self.server.grants.get(value)
        label = grant.label if grant else "?"
        self.fail("2-stale", f"a stale {op} of {label} succeeded on the server")

    def _orphan(self, grant: Grant) -> None:
        """A grant that landed after its own give-back found nothing: the coordinator
        looks again for ``ttl + late_landing()`` after that give-back began, at intervals up to
        a second; a grant landing well within that window must be given back."""
        backend = self.backends[grant.client]
        began = backend.first_release.get(grant.value)
        if began is None:
            return
        late = backend.late_landing(Interrupted.FAILED)
        look_until = backend.sim_clock.real(began) + grant.ttl + late
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
        if self._wakes and self._wakes[0][0] <= now:
            self._check_wakes(now)
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
                    (claim.kind is Kind.SHARED, backend.label(claim))
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

    # -- liveness (invariant 8) --------------------------------------------------------

    def touched(self, client: int | None, start: float, end: float) -> bool:
        """True if a fault touched ``client`` (None: any client) within ``[start, end]``:
        a reset of one of its connections (a socket timeout's included), a request of its
        landing late after a reset, a delay spike on one of its messages (from sending to
        arrival), a partition cutting it off, or a pause of the client process."""
        for s, e in self.pauses:
            if s <= end and e >= start:
                return True
        for s, e, who in self.partitions:
            if s <= end and e >= start and (client is None or who in (-1, client)):
                return True
        for who, s, e in self.net.fault_log:
            if s <= end and e >= start and (client is None or who in (-1, client)):
                return True
        return False

    def _hook_losses(self, client: int, coord: Coordinator) -> None:
        """Hear of each lease loss as the coordinator counts it (the moment it is marked)."""
        recorder = coord._engine.recorder
        counted = recorder.lost

        def lost(name: str, fence: int, reason: str) -> None:
            counted(name, fence, reason)
            self.loss(client, name, fence, reason)

        recorder.lost = lost  # type: ignore[method-assign]

    def loss(self, client: int, name: str, fence: int, reason: str) -> None:
        """Invariant 8, no loss undisturbed: a lease the watchdog renews is lost only if a
        fault touched its client within its TTL before the loss.

        Bound: without a fault, a renewal sent every ``ttl/3`` is answered within a few
        one-way delays, far within the ``ttl - drift`` of validity it has to arrive in;
        a renewal that a fault made fail is retried until its validity ends, at most one
        TTL after the fault. So the window looked at is the longest TTL the lease asked
        for (its acquire's, or an ``extend()``'s). Not checked: a lease that is not
        renewed (it ends at its TTL by design), one whose owner asked for its release (a
        renewal landing after the release is refused; an interrupted release retried in
        the background finds it gone), one of a closed coordinator (closing loses what
        is held)."""
        now = self.net.world.now
        grant = self._by_fence.get((name, fence))
        if grant is None:
            return
        self.losses.setdefault(grant.value, now)
        if not 0 <= grant.op < len(self.ops):
            return
        op = self.ops[grant.op]
        backend = self.backends[client]
        if not op.renew or self.coords[client].closed or grant.value in backend.first_release:
            return
        since = now - op.longest_ttl
        if self.touched(client, since, now):
            return
        self.note(
            "8-no-loss",
            f"lease {grant.label} on {name!r} (op {op.id}, ttl {op.longest_ttl:g}, renewed) "
            f"lost at {now:.6f} ({reason}), though no fault touched c{client} since "
            f"{since:.6f}",
        )

    def body_step(self, op: OpRecord, value: str) -> None:
        """A body protected by claim ``value`` takes a step now. Invariant 8, body
        stopped: a body cancelled on loss takes no step at a later moment than its loss.

        Bound: the loss cancels the body in the loop turn that marks it (and again each
        turn until it leaves its block); whatever the body awaits (a sleep, an extend
        request on its way) resumes with that cancel. No virtual time passes in between,
        pauses included (a paused client runs nothing, the body neither), so the
        delivery bound is zero: a step at the loss's own moment may come first, in the
        same turn, never one after it."""
        now = self.net.world.now
        op.steps.append(now)
        lost = self.losses.get(value)
        if lost is None or not op.stops_on_loss or now <= lost + _EPS:
            return
        grant = self.server.grants.get(value)
        label = grant.label if grant is not None else "?"
        self.note(
            "8-body-stopped",
            f"op {op.id} ({op.kind} {op.name!r}) body took a step at {now:.6f}, after its "
            f"lease {label} was lost at {lost:.6f}; it is cancelled on loss",
        )

    def _on_release(self, value: str, at: float) -> None:
        grant = self.server.grants.get(value)
        if grant is not None:
            self.released(grant, at)

    def released(self, grant: Grant, at: float) -> None:
        """Invariant 8, hand-off: a release at ``at`` that left ``grant``'s name free
        reaches a waiter within ``hand_off`` when no fault is active.

        Waiters are the operations in their acquire whose request for the name the server
        had already seen (refused). No fault may have touched any client since the
        earliest of them started, nor since an operation that gave up but still has a
        place in the name's line started: a fault in a wait can leave its waiter deaf (a
        subscription dies with its connection; it falls back on its timers, by design),
        or leave a place whose leave request failed, and a fair lock's release wakes the
        first in line alone. A closed coordinator's places lapse on their own: no check
        while it has one. Bound: the release's wake-up reaches a waiter in one
        message, its next attempt reaches the server in one more; a waiter caught
        between a refused attempt and its sleep (the wake-up is kept on its slot), or
        still subscribing, needs one or two more; messages on a connection keep order. So
        two to four one-way delays, each exponential with the seed's mean ``latency``
        (spikes are faults): ``HAND_OFF_DELAYS`` of them (40) make the chance that four
        add up to more about 1e-13 per hand-off. A waiter's backoff timer (10 ms to a
        second) is no part of it."""
        name = grant.name
        if not self._free(name, grant.kind):
            return
        server = self.server
        waiters = []
        since = at
        for op in self.ops:
            asked = [value for n, value in server.attempted.get(op.id, ()) if n == name]
            if not asked:
                continue
            waiting = op.acquire_end is None and op.ended is None
            if not waiting and all(server.queued(name, value) is None for value in asked):
                continue
            if self.coords[op.client].closed:
                return
            since = min(since, op.started)
            if waiting:
                waiters.append(op)
        if waiters:
            due = at + self.hand_off
            self._wakes.append((due, at, since, grant, self._grants_of.get(name, 0), waiters))
            self._wakes.sort(key=lambda item: item[0])

    def _free(self, name: str, kind: str) -> bool:
        """True if ``name`` (of ``kind``) has room for a new holder now (read only: the
        table is left as the server left it)."""
        table = self.server.table
        now = self.server.clock.now()
        if kind == "permit":
            permits = table.permits.get(name, {})
            live = sum(1 for h in permits.values() if h.expires_at > now)
            return live < self.limits.get(name, 1)
        return all(h.expires_at <= now for h in table.holders.get(name, {}).values())

    def _check_wakes(self, now: float) -> None:
        while self._wakes and self._wakes[0][0] <= now:
            due, at, since, grant, grants, waiters = self._wakes.pop(0)
            name = grant.name
            if self._grants_of.get(name, 0) != grants or not self._free(name, grant.kind):
                continue  # granted since (to a waiter or another), or taken
            stuck = [
                op
                for op in waiters
                if op.acquire_end is None and op.ended is None and not self.coords[op.client].closed
            ]
            if not stuck or self.touched(None, since, due):
                continue
            who = ", ".join(f"op {op.id} (c{op.client} {op.kind})" for op in stuck)
            self.fail(
                "8-hand-off",
                f"{grant.label} released {name!r} at {at:.6f}; no fault since {since:.6f}, yet at "
                f"{now:.6f} ({self.hand_off:.6f} later) nobody was granted it while {who} "
                "waited",
            )
