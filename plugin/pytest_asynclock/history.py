"""A fenced resource that records its history, and a checker for that history.

Locks exist to protect something. To test that they do, give the protected code a
resource that behaves like a careful real one (it refuses writes carrying a fence smaller
than one it has seen) and that remembers every write in its own order; then check the
record. :class:`FencedLog` is that resource, kept in a Redis/Valkey list::

    log = FencedLog(redis_client, "myapp:history")         # any key names you choose
    async with coord.lock("job", ttl=5) as lease:
        async with log.section(lease.fence, holder="worker-1") as section:
            await section.op("charge 42")                    # FenceRejected if stale
    report = check(await log.read(), log.acknowledged)
    assert report.ok, report

Every write goes through one Lua script: :meth:`FencedLog.append` ``(fence, holder, op,
kind)`` is *accepted* when ``fence`` is at least the largest fence the log has accepted
(equal fences are accepted: one holder writes many entries under one fence) and
*rejected* (counted as stale) when it is smaller. Accepted or not, the attempt is
appended to the list with a sequence number in server order, the server's time and the
client's ``time.time()``; the script answers accepted or rejected. Holders write a
``start`` entry when they enter their critical section, any number of ``op`` entries, and
an ``end`` entry before they leave (``section()`` does this; a body that raises leaves no
``end``, and its section ends at its last entry).

Each :class:`FencedLog` also keeps what its client saw acknowledged
(:attr:`FencedLog.acknowledged`, a list of :class:`Ack`). Processes can send theirs to
the checker as JSON (:func:`dump_acks` / :func:`load_acks`); :func:`check` takes the
union of any number of such lists.

:func:`check` returns a :class:`Report` and verifies:

(a) mutual exclusion in the resource's own order: a section runs from its accepted
    ``start`` to its ``end`` (accepted or not; without one, to its last entry), and no
    accepted entry of another section (another ``(fence, holder)``) lies in between.
    When the other holder's entry only *fenced off* the section (every later write of the
    section was rejected) the resource stayed safe but the lock did not exclude: a
    violation by default, only listed in :attr:`Report.fenced_off` with
    ``exclusive=False`` (use that for runs that freeze clients past their TTL, where
    only the fence can keep the resource safe). Accepted writes of two sections that
    interleave are always a violation;
(b) nothing acknowledged was lost: every entry a client saw accepted is in the log,
    accepted (and the log's sequence numbers have no holes);
(c) fences never go backwards: each accepted entry carries a fence at least as large as
    every accepted entry before it;
(d) one believer at a time: when writers say until when they believe their lease valid
    (``valid_until``), no holder starts writing (client time) before another holder's
    belief has ended (its largest ``valid_until``, or its ``end`` entry if earlier).
    This is exclusion in time, not only in the resource's order: it catches two
    holders at once even when the fence kept every write in order. The writers'
    ``time.time()`` values are compared with each other: run them on one host (or
    widen the comparison by how far their clocks may be apart);
(e) no write after a loss is accepted: an entry whose writer said its lease was already
    ``lost`` or ``expired`` when it decided to write is a violation when accepted (and
    counted in :attr:`Report.writes_after_loss` either way). With ``late_ok``, an
    ``expired`` one that is not its section's first entry is counted in
    :attr:`Report.late_writes` instead: a body its event loop resumed after a stall
    longer than the lease's validity runs until its next ``await`` before the loss is
    delivered there (the fence orders such a write before any newer holder's);
(f) nothing missing at the end: given the resource's own count of writes
    (``last_seq``), the log must reach it.

:func:`check_grants` checks the grants themselves (every acquisition, recorded by the
holders as :class:`Grant`): fences are unique per name and never smaller than a grant
made before the acquire was even requested.

To check a resource of your own instead, record its history as :class:`Entry` values
(``seq`` in the resource's order) and pass them to :func:`check` with your clients' acks.
Entries store fences as integers; Lua compares them as doubles, so keep fences below 2**53
(asynclock's are).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, Self

from redis.asyncio import Redis

__all__ = (
    "Ack",
    "Entry",
    "FenceRejected",
    "FencedLog",
    "Grant",
    "Report",
    "Section",
    "Violation",
    "check",
    "check_grants",
    "dump_acks",
    "load_acks",
)

Kind = Literal["start", "op", "end"]
KINDS: tuple[Kind, ...] = ("start", "op", "end")
STATES = ("", "held", "lost", "expired")
"""What a writer may say of its lease (see :meth:`FencedLog.append`); "" = not said."""

# KEYS[1] the log (a list of JSON entries, in server order)
# KEYS[2] the log's state (a hash: fence = largest accepted fence, seq, accepted, stale)
# ARGV[1] the fence (a decimal integer)
# ARGV[2] the entry's JSON object as the client wrote it, without the server's fields
# Returns {accepted (1 or 0), seq}. The fence is kept as the client's decimal string:
# Lua numbers print with 14 digits, too few for a µs-clock fence.
APPEND = """
local fence = tonumber(ARGV[1])
local largest = redis.call('HGET', KEYS[2], 'fence')
local accepted = 1
if largest and fence < tonumber(largest) then
  accepted = 0
end
local seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
if accepted == 1 then
  redis.call('HSET', KEYS[2], 'fence', ARGV[1])
  redis.call('HINCRBY', KEYS[2], 'accepted', 1)
else
  redis.call('HINCRBY', KEYS[2], 'stale', 1)
end
local now = redis.call('TIME')
local ok = accepted == 1 and 'true' or 'false'
local entry = '{"seq":' .. seq .. ',"accepted":' .. ok .. ',"server_time":' .. now[1] .. '.'
  .. string.format('%06d', tonumber(now[2])) .. ',' .. string.sub(ARGV[2], 2)
redis.call('RPUSH', KEYS[1], entry)
return {accepted, seq}
"""

# Entries read per LRANGE: a long log is read in pieces, not one huge reply.
_READ_CHUNK = 10_000
# How many violations __str__ lists before "... and N more".
_SHOWN = 20
# Client times closer than this are "at once" (float noise, not an overlap).
_SAME_TIME = 1e-4


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One write attempt, as the resource recorded it.

    ``seq`` orders entries in the resource (1, 2, 3… for a :class:`FencedLog`);
    ``id`` is unique per attempt (what acks refer to); ``time`` is the client's
    ``time.time()`` when it sent the write, ``server_time`` the server's clock.
    ``state`` and ``valid_until`` are what the writer believed of its lease when it
    decided to write (see :meth:`FencedLog.append`); empty and None when not given.
    """

    seq: int
    id: str
    fence: int
    holder: str
    op: str
    kind: Kind
    accepted: bool
    time: float = 0.0
    server_time: float = 0.0
    state: str = ""
    valid_until: float | None = None
    decided: float | None = None

    @classmethod
    def from_json(cls, text: str | bytes) -> Entry:
        """An entry from the JSON the append script stored."""
        data = json.loads(text)
        return cls(
            seq=int(data["seq"]),
            id=str(data["id"]),
            fence=int(data["fence"]),
            holder=str(data["holder"]),
            op=str(data["op"]),
            kind=data["kind"],
            accepted=bool(data["accepted"]),
            time=float(data.get("time", 0.0)),
            server_time=float(data.get("server_time", 0.0)),
            state=str(data.get("state", "")),
            valid_until=None if data.get("valid") is None else float(data["valid"]),
            decided=None if data.get("decided") is None else float(data["decided"]),
        )

    @property
    def section(self) -> tuple[int, str]:
        """``(fence, holder)``: which critical section the entry belongs to."""
        return self.fence, self.holder


@dataclasses.dataclass(frozen=True, slots=True)
class Ack:
    """What a client saw: its write ``id`` was answered ``accepted`` (or rejected) as
    entry ``seq``. The other fields repeat the write, to name it in reports."""

    id: str
    seq: int
    fence: int
    holder: str
    op: str
    kind: Kind
    accepted: bool
    time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :func:`dump_acks`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ack:
        """The inverse of :meth:`to_dict`."""
        return cls(
            id=str(data["id"]),
            seq=int(data["seq"]),
            fence=int(data["fence"]),
            holder=str(data["holder"]),
            op=str(data["op"]),
            kind=data["kind"],
            accepted=bool(data["accepted"]),
            time=float(data.get("time", 0.0)),
        )


def dump_acks(acks: Iterable[Ack]) -> str:
    """One JSON line of acks, for a process to hand its records to the checker."""
    return json.dumps([ack.to_dict() for ack in acks], separators=(",", ":"))


def load_acks(text: str | bytes) -> list[Ack]:
    """Acks from :func:`dump_acks` output (or :meth:`FencedLog.acks_json`)."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise TypeError(f"expected a JSON list of acks, got {type(data).__name__}")
    return [Ack.from_dict(item) for item in data]


class FenceRejected(Exception):
    """The fenced resource refused a write: its fence is smaller than one already
    accepted, so the writer is a stale holder. ``ack`` is the refused write."""

    def __init__(self, ack: Ack) -> None:
        super().__init__(
            f"{ack.kind} {ack.op!r} of {ack.holder!r} with fence {ack.fence} was rejected: "
            f"a larger fence was accepted before (entry {ack.seq})"
        )
        self.ack = ack


class FencedLog:
    """A fenced resource in a Redis/Valkey list that records every write attempt.

    ``client`` is a ``redis.asyncio.Redis`` (not closed here; any ``decode_responses``).
    ``key`` names the list; ``state_key`` (default ``key + ":state"``) the hash with the
    largest accepted fence and the counters. On Redis Cluster put both in one slot with a
    hash tag (``"{hist}"`` -> ``"{hist}:state"``). Several FencedLog objects, in one
    process or many, on the same keys are one resource; each keeps its own acks.
    """

    def __init__(self, client: Redis, key: str, *, state_key: str | None = None) -> None:
        if not isinstance(client, Redis):
            raise TypeError(f"client must be a redis.asyncio.Redis, got {type(client).__name__}")
        if not isinstance(key, str) or (state_key is not None and not isinstance(state_key, str)):
            raise TypeError("key and state_key must be str")
        if not key:
            raise ValueError("key must not be empty")
        self._client = client
        self.key = key
        self.state_key = state_key if state_key is not None else f"{key}:state"
        if self.state_key == key:
            raise ValueError("state_key must differ from key")
        self._script = client.register_script(APPEND)
        self.acknowledged: list[Ack] = []
        """Every write this object saw answered, accepted or rejected, in order."""

    async def append(
        self,
        fence: int,
        holder: str,
        op: str = "",
        kind: Kind = "op",
        *,
        state: str = "",
        valid_until: float | None = None,
        decided: float | None = None,
    ) -> Ack:
        """Write one entry; the :class:`Ack` says whether the resource accepted it.

        ``fence`` is the writer's fencing token (``lease.fence``); ``holder`` names the
        writer; ``op`` labels the operation; ``kind`` is ``"start"``, ``"op"`` or
        ``"end"``. ``state`` and ``valid_until`` record what the writer believed of its
        lease when it decided to write: ``"held"``, ``"lost"`` (``lease.lost``) or
        ``"expired"`` (``lease.expires_in`` was 0), and until when (``time.time()`` +
        ``lease.expires_in``), and when it decided (``decided``, ``time.time()``; a
        process paused between deciding and sending writes late, as only the fence can
        stop); :func:`check` holds them against the history. Raises
        ``ValueError``/``TypeError`` for bad arguments and redis-py's errors when the
        server cannot be reached (the outcome is then unknown and nothing is recorded
        as acknowledged).
        """
        if isinstance(fence, bool) or not isinstance(fence, int):
            raise TypeError(f"fence must be an int, got {type(fence).__name__}")
        if not 0 <= fence < 2**53:
            raise ValueError(f"fence must be in 0 .. 2**53 - 1, got {fence}")
        if not isinstance(holder, str) or not isinstance(op, str):
            raise TypeError("holder and op must be str")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES!r}, got {state!r}")
        write_id = secrets.token_hex(8)
        sent = time.time()
        fields: dict[str, Any] = {
            "id": write_id,
            "fence": fence,
            "holder": holder,
            "op": op,
            "kind": kind,
            "time": sent,
        }
        if state:
            fields["state"] = state
        if valid_until is not None:
            fields["valid"] = valid_until
        if decided is not None:
            fields["decided"] = decided
        body = json.dumps(fields, separators=(",", ":"))
        reply = await self._script(keys=[self.key, self.state_key], args=[str(fence), body])
        accepted, seq = int(reply[0]), int(reply[1])
        ack = Ack(write_id, seq, fence, holder, op, kind, accepted == 1, sent)
        self.acknowledged.append(ack)
        return ack

    def section(self, fence: int, holder: str, *, name: str = "") -> Section:
        """``async with log.section(fence, holder) as section:`` writes ``start`` on
        entry and ``end`` on a normal exit; ``await section.op("x")`` in between.

        Entering raises :class:`FenceRejected` if ``start`` is rejected; so do ``op()``
        and a normal exit when their write is. A body that raises writes no ``end``.
        ``name`` labels the ``start``/``end`` entries' ``op``.
        """
        return Section(self, fence, holder, name)

    async def read(self) -> list[Entry]:
        """Every entry in server order (read in chunks; appends may go on meanwhile,
        and those made after the read began may be missing)."""
        entries: list[Entry] = []
        start = 0
        while True:
            chunk = await self._client.lrange(self.key, start, start + _READ_CHUNK - 1)
            entries += (Entry.from_json(raw) for raw in chunk)
            if len(chunk) < _READ_CHUNK:
                return entries
            start += _READ_CHUNK

    async def counters(self) -> dict[str, int]:
        """The server's counters: ``fence`` (largest accepted), ``seq``, ``accepted``,
        ``stale``; absent ones are 0."""
        raw = await self._client.hgetall(self.state_key)
        found = {_text(k): int(v) for k, v in raw.items()}
        return {name: found.get(name, 0) for name in ("fence", "seq", "accepted", "stale")}

    async def clear(self) -> None:
        """Delete the log and its state (the fence starts over). Acks are kept."""
        await self._client.delete(self.key, self.state_key)

    def acks_json(self) -> str:
        """:attr:`acknowledged` as JSON, for :func:`load_acks` in another process."""
        return dump_acks(self.acknowledged)

    def __repr__(self) -> str:
        return f"<FencedLog {self.key!r} acknowledged={len(self.acknowledged)}>"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Section:
    """One holder's critical section on a :class:`FencedLog` (see
    :meth:`FencedLog.section`)."""

    def __init__(self, log: FencedLog, fence: int, holder: str, name: str = "") -> None:
        self.log = log
        self.fence = fence
        self.holder = holder
        self.name = name
        self.acks: list[Ack] = []

    async def op(self, op: str) -> Ack:
        """Write one ``op`` entry; raises :class:`FenceRejected` if it is refused."""
        return await self._write(op, "op")

    async def _write(self, op: str, kind: Kind) -> Ack:
        ack = await self.log.append(self.fence, self.holder, op, kind)
        self.acks.append(ack)
        if not ack.accepted:
            raise FenceRejected(ack)
        return ack

    async def __aenter__(self) -> Self:
        await self._write(self.name, "start")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self._write(self.name, "end")

    def __repr__(self) -> str:
        return f"<Section holder={self.holder!r} fence={self.fence} writes={len(self.acks)}>"


# -- the checker --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """One thing the history shows went wrong: ``kind`` is ``"overlap"``,
    ``"fenced-off"``, ``"fence-backwards"``, ``"outside-section"``, ``"gap"``,
    ``"duplicate-seq"`` or ``"ack-mismatch"``; ``seqs`` are the entries involved."""

    kind: str
    message: str
    seqs: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    """The checker's verdict on one history.

    ``operations`` entries in the log (every write attempt), ``accepted`` of them
    accepted, ``stale_rejected`` rejected for a smaller fence; ``sections`` critical
    sections with an accepted start, ``unfinished`` of them without an ``end`` entry;
    ``violations`` what broke (a)-(c) of the module docstring; ``lost`` acked-accepted
    writes missing from the log; ``fenced_off`` sections whose holder lost the resource to
    a newer fence mid-section (a violation too unless ``check(..., exclusive=False)``).
    """

    operations: int
    accepted: int
    stale_rejected: int
    sections: int
    unfinished: int
    acknowledged: int
    violations: tuple[Violation, ...]
    lost: tuple[Ack, ...]
    fenced_off: tuple[Violation, ...]
    writes_after_loss: int = 0
    """Entries (accepted or not) whose writer knew its lease lost or expired."""
    late_writes: int = 0
    """Accepted ``expired`` entries excused by ``late_ok`` (see (e))."""

    @property
    def ok(self) -> bool:
        """No violations and nothing lost."""
        return not self.violations and not self.lost

    def summary(self) -> str:
        """One line: the verdict and the counts."""
        verdict = "history OK" if self.ok else "history VIOLATED"
        return (
            f"{verdict}: {self.operations} operations, {self.accepted} accepted, "
            f"{self.stale_rejected} stale rejected, {self.sections} sections "
            f"({self.unfinished} unfinished, {len(self.fenced_off)} fenced off), "
            f"{self.acknowledged} acks, {len(self.violations)} violations, {len(self.lost)} lost"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        for title, items in (
            ("violations", [str(v) for v in self.violations]),
            ("lost", [_describe_ack(ack) for ack in self.lost]),
            ("fenced off", [str(v) for v in self.fenced_off if v not in self.violations]),
        ):
            if items:
                lines.append(f"{title}:")
                lines += (f"  {item}" for item in items[:_SHOWN])
                if len(items) > _SHOWN:
                    lines.append(f"  ... and {len(items) - _SHOWN} more")
        return "\n".join(lines)


def _describe_ack(ack: Ack) -> str:
    return (
        f"{ack.kind} {ack.op!r} of {ack.holder!r} fence {ack.fence} "
        f"(acked as entry {ack.seq}, id {ack.id})"
    )


def _who(entry: Entry) -> str:
    return f"{entry.holder!r} fence {entry.fence}"


@dataclasses.dataclass(slots=True)
class _Span:
    """One section: its entries in order, from the accepted start."""

    start: Entry
    entries: list[Entry]
    ended: bool = False

    @property
    def last(self) -> int:
        return self.entries[-1].seq

    def accepted_after(self, seq: int) -> Entry | None:
        for entry in self.entries:
            if entry.seq > seq and entry.accepted:
                return entry
        return None


def check(
    entries: Iterable[Entry],
    *acknowledged: Iterable[Ack],
    exclusive: bool = True,
    last_seq: int | None = None,
    ended: Iterable[tuple[int, str, float]] = (),
    late_ok: bool = False,
) -> Report:
    """Check a history (entries in any order; sorted by ``seq``) against the union of
    the clients' ``acknowledged`` lists. See the module docstring for what is checked;
    ``exclusive=False`` lets a section be fenced off without it being a violation;
    ``last_seq`` is the resource's own count of writes (:meth:`FencedLog.counters`
    ``["seq"]``), which the log must reach. ``ended``: ``(fence, holder, time)`` of
    sections whose writer stopped believing without writing an ``end`` entry (its body
    was cancelled, or its lease ended when its client closed) at client ``time``; for
    (d) such a section believes until then at the latest, as one with an ``end``.
    ``late_ok``: see (e)."""
    log = sorted(entries, key=lambda e: e.seq)
    acks: dict[str, Ack] = {}
    for group in acknowledged:
        for ack in group:
            acks.setdefault(ack.id, ack)
    violations = _fences_backwards(log) + _gaps(log, last_seq)
    violations += _believers(log, ended)
    after_loss = [entry for entry in log if entry.state in ("lost", "expired")]
    late = [
        entry
        for entry in after_loss
        if late_ok and entry.accepted and entry.state == "expired" and entry.kind != "start"
    ]
    violations += [
        Violation(
            "write-after-loss",
            f"entry {entry.seq} ({entry.kind} of {_who(entry)}) was accepted although its "
            f"writer knew its lease {entry.state} when it wrote",
            (entry.seq,),
        )
        for entry in after_loss
        if entry.accepted and entry not in late
    ]
    spans, strays = _sections(log)
    violations += strays
    overlaps, fenced_off = _overlaps(log, spans)
    violations += overlaps
    if exclusive:
        violations += fenced_off
    lost, mismatches = _lost(log, acks.values())
    violations += mismatches
    accepted = sum(entry.accepted for entry in log)
    return Report(
        operations=len(log),
        accepted=accepted,
        stale_rejected=len(log) - accepted,
        sections=len(spans),
        unfinished=sum(not span.ended for span in spans),
        acknowledged=len(acks),
        violations=tuple(violations),
        lost=tuple(lost),
        fenced_off=tuple(fenced_off),
        writes_after_loss=len(after_loss),
        late_writes=len(late),
    )


def _fences_backwards(log: Sequence[Entry]) -> list[Violation]:
    """(c): every accepted entry's fence is at least that of each accepted one before."""
    found: list[Violation] = []
    largest: Entry | None = None
    for entry in log:
        if not entry.accepted:
            continue
        if largest is not None and entry.fence < largest.fence:
            found.append(
                Violation(
                    "fence-backwards",
                    f"entry {entry.seq} ({_who(entry)}) was accepted after entry "
                    f"{largest.seq} had fence {largest.fence}",
                    (largest.seq, entry.seq),
                )
            )
        else:
            largest = entry
    return found


def _sections(log: Sequence[Entry]) -> tuple[list[_Span], list[Violation]]:
    """Each entry joins the open section of its (fence, holder); accepted entries that
    belong to none are violations."""
    spans: list[_Span] = []
    found: list[Violation] = []
    current: dict[tuple[int, str], _Span] = {}
    for entry in log:
        span = current.get(entry.section)
        is_open = span is not None and not span.ended
        if entry.kind == "start" and entry.accepted:
            if span is not None and is_open:
                found.append(
                    Violation(
                        "outside-section",
                        f"entry {entry.seq}: {_who(entry)} started again inside its section "
                        f"begun at entry {span.start.seq}",
                        (span.start.seq, entry.seq),
                    )
                )
            span = current[entry.section] = _Span(entry, [entry])
            spans.append(span)
        elif span is not None and is_open:
            span.entries.append(entry)
            span.ended = entry.kind == "end"
        elif entry.accepted:
            found.append(
                Violation(
                    "outside-section",
                    f"entry {entry.seq}: accepted {entry.kind} {entry.op!r} of {_who(entry)} "
                    "outside any section (no accepted start before it)",
                    (entry.seq,),
                )
            )
    return spans, found


def _overlaps(log: Sequence[Entry], spans: list[_Span]) -> tuple[list[Violation], list[Violation]]:
    """(a): accepted entries of other sections inside a section's span, as overlaps
    (writes interleave) and fenced-off sections (the section wrote nothing accepted after)."""
    overlaps: list[Violation] = []
    fenced_off: list[Violation] = []
    seen: set[tuple[int, int]] = set()
    owner = {id(entry): span for span in spans for entry in span.entries}
    pending = sorted(spans, key=lambda s: s.start.seq, reverse=True)
    active: list[_Span] = []
    for entry in log:
        while pending and pending[-1].start.seq <= entry.seq:
            active.append(pending.pop())
        active = [span for span in active if span.last >= entry.seq]
        if not entry.accepted:
            continue
        mine = owner.get(id(entry))
        for span in active:
            if span is mine:
                continue
            other = mine.start.seq if mine is not None else -entry.seq
            pair = (min(span.start.seq, other), max(span.start.seq, other))
            if pair in seen:
                continue
            seen.add(pair)
            found = _overlap(span, entry)
            (overlaps if found.kind == "overlap" else fenced_off).append(found)
    return overlaps, fenced_off


def _lost(log: Sequence[Entry], acks: Iterable[Ack]) -> tuple[list[Ack], list[Violation]]:
    """(b): acked-accepted writes missing (or not accepted) in the log; and writes the log
    accepted whose writer was told rejected."""
    by_id = {entry.id: entry for entry in log}
    lost: list[Ack] = []
    mismatches: list[Violation] = []
    for ack in acks:
        found = by_id.get(ack.id)
        if ack.accepted and (found is None or not found.accepted):
            lost.append(ack)
        elif found is not None and found.accepted != ack.accepted:
            mismatches.append(
                Violation(
                    "ack-mismatch",
                    f"entry {found.seq} is accepted in the log but its writer was told "
                    f"rejected: {_describe_ack(ack)}",
                    (found.seq,),
                )
            )
    lost.sort(key=lambda ack: ack.seq)
    return lost, mismatches


def _overlap(span: _Span, intruder: Entry) -> Violation:
    """An accepted entry of another section inside ``span``: interleaved writes, or
    the section fenced off (none of its later writes accepted)."""
    later = span.accepted_after(intruder.seq)
    where = f"entry {intruder.seq} ({intruder.kind} of {_who(intruder)})"
    section = f"the section of {_who(span.start)} (entries {span.start.seq}..{span.last})"
    if later is not None:
        return Violation(
            "overlap",
            f"{where} was accepted inside {section}, which wrote on after it (entry "
            f"{later.seq} accepted): two holders' writes interleave",
            (span.start.seq, intruder.seq, later.seq),
        )
    return Violation(
        "fenced-off",
        f"{where} was accepted inside {section}; the section's later writes were "
        "rejected: the fence kept the resource safe, the lock did not exclude",
        (span.start.seq, intruder.seq, span.last),
    )


def _believers(
    log: Sequence[Entry], stopped: Iterable[tuple[int, str, float]] = ()
) -> list[Violation]:
    """(d): sections (by fence and holder, accepted or not) whose writers believed their
    leases valid at the same time. A section believes from its first write until the
    ``valid_until`` of its latest write (or its ``end`` entry, if earlier: an ``extend()``
    may have shortened it); the next section's first
    write must be decided after that (``decided``, else the send time: a writer paused
    between deciding and sending is the fence's to stop, not a second believer). Writes
    whose writer knew its lease lost or expired do not extend a belief. ``stopped``: when
    sections without an ``end`` entry stopped (see :func:`check`)."""
    begin: dict[tuple[int, str], Entry] = {}
    until: dict[tuple[int, str], float] = {}
    latest_at: dict[tuple[int, str], float] = {}  # when each section last said
    ended: dict[tuple[int, str], float] = {}

    def when(entry: Entry) -> float:
        return entry.time if entry.decided is None else entry.decided

    for entry in log:
        key = entry.section
        first = begin.get(key)
        if first is None or when(entry) < when(first):
            begin[key] = entry
        if entry.valid_until is not None and entry.state not in ("lost", "expired"):
            # A writer that knew its lease gone believes nothing (see (e) for its write).
            # Its latest belief counts, not its longest: an extend() to a shorter TTL
            # ends the lease sooner on the server, and its holder believes that from the
            # moment the request leaves (a holder frozen after it must not be taken to
            # believe its earlier, longer validity).
            latest = latest_at.get(key)
            if latest is None or when(entry) >= latest:
                latest_at[key] = when(entry)
                until[key] = entry.valid_until
        if entry.kind == "end":
            ended[key] = min(ended.get(key, entry.time), entry.time)
    for fence, holder, at in stopped:
        key = (fence, holder)
        ended[key] = min(ended.get(key, at), at)
    found: list[Violation] = []
    believer: tuple[tuple[int, str], float] | None = None  # the latest belief so far
    for key in sorted(until, key=lambda k: when(begin[k])):
        first = begin[key]
        if believer is not None and when(first) < believer[1] - _SAME_TIME:
            other, end = believer
            found.append(
                Violation(
                    "overlap-in-time",
                    f"{_who(first)} wrote (entry {first.seq}, decided at {when(first):.6f}) while "
                    f"'{other[1]}' fence {other[0]} still believed its lease valid until "
                    f"{end:.6f}: two holders at once",
                    (begin[other].seq, first.seq),
                )
            )
        end = min(until[key], ended.get(key, until[key]))
        if believer is None or end > believer[1]:
            believer = (key, end)
    return found


def _gaps(log: Sequence[Entry], last_seq: int | None = None) -> list[Violation]:
    """Holes in the sequence numbers (entries removed from the log), repeated ones (the
    resource's counter was reset while its log stayed), and, given the resource's own
    count, entries missing at the end."""
    found: list[Violation] = []
    expected = 1
    for entry in log:
        if entry.seq > expected:
            first, last = expected, entry.seq - 1
            found.append(
                Violation(
                    "gap",
                    f"{_span(first, last)} missing from the log: removed after the write",
                    tuple(range(first, last + 1))[:_SHOWN],
                )
            )
        elif entry.seq < expected:
            found.append(
                Violation(
                    "duplicate-seq",
                    f"entry {entry.seq} appears more than once: the resource's state was reset",
                    (entry.seq,),
                )
            )
        expected = max(expected, entry.seq + 1)
    if last_seq is not None and last_seq >= expected:
        found.append(
            Violation(
                "gap",
                f"{_span(expected, last_seq)} missing at the end of the log (the resource "
                f"counted {last_seq} writes)",
                tuple(range(expected, last_seq + 1))[:_SHOWN],
            )
        )
    return found


def _span(first: int, last: int) -> str:
    return f"entry {first}" if first == last else f"entries {first}..{last}"


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """One acquisition, as its holder saw it: ``fence`` for ``name``, requested at
    ``requested`` and granted at ``granted`` (both ``time.time()``), and the lease's
    ``expires_in`` when the holder got it."""

    name: str
    fence: int
    holder: str
    requested: float
    granted: float
    expires_in: float

    def to_list(self) -> list[Any]:
        """A JSON-ready list (the inverse of :meth:`from_list`)."""
        return [self.name, self.fence, self.holder, self.requested, self.granted, self.expires_in]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> Grant:
        name, fence, holder, requested, granted, expires_in = data
        return cls(
            str(name), int(fence), str(holder), float(requested), float(granted), float(expires_in)
        )


def check_grants(grants: Iterable[Grant]) -> list[Violation]:
    """Fences per name are unique, and never smaller than (or equal to) that of a grant
    its holder had already seen before the next acquire was requested."""
    found: list[Violation] = []
    by_name: dict[str, list[Grant]] = {}
    for grant in grants:
        by_name.setdefault(grant.name, []).append(grant)
    for name, seen in by_name.items():
        fences: dict[int, Grant] = {}
        for grant in seen:
            twin = fences.get(grant.fence)
            if twin is not None:
                found.append(
                    Violation(
                        "fence-reused",
                        f"{name!r}: fence {grant.fence} granted to {twin.holder!r} and "
                        f"to {grant.holder!r}",
                    )
                )
            fences[grant.fence] = grant
        ordered = sorted(seen, key=lambda g: g.granted)
        best: Grant | None = None  # the largest fence granted so far (by grant time)
        for grant in sorted(seen, key=lambda g: g.requested):
            while ordered and ordered[0].granted < grant.requested:
                done = ordered.pop(0)
                if best is None or done.fence > best.fence:
                    best = done
            if best is not None and grant.fence <= best.fence and grant is not best:
                found.append(
                    Violation(
                        "fence-backwards",
                        f"{name!r}: {grant.holder!r} was granted fence {grant.fence}, "
                        f"requested after {best.holder!r} had been granted {best.fence}",
                    )
                )
    return found
