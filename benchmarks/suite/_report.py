"""From runs to a report: medians over runs, targets, the table, the JSON and the chart.

Targets are shown as PASS or MISS next to the numbers they concern; they are never
asserted. With several runs, a row's numbers are the medians over the runs and its ratio
(and p99 ratio, where a section has one) is shown as median (min-max).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from asynclock import __version__

from ._measure import STRICT_HOLD
from ._suite import Plan

__all__ = ("Target", "build_report", "draw_chart", "print_report", "write_json")

Row = dict[str, Any]
CHART_HINT = "pip install 'asynclock[bench]'"


def _median_rows(runs: list[dict[str, Any]]) -> list[Row]:
    """One row per id: medians over the runs, and the ratio's min/median/max."""
    order: list[str] = []
    seen: dict[str, list[Row]] = {}
    for run in runs:
        for row in run["rows"]:
            if row["id"] not in seen:
                order.append(row["id"])
                seen[row["id"]] = []
            seen[row["id"]].append(row)
    rows: list[Row] = []
    for row_id in order:
        group = seen[row_id]
        merged: Row = {}
        for key, value in group[0].items():
            values = [r[key] for r in group if _is_number(r.get(key))]
            if _is_number(value) and values:
                median = statistics.median(values)
                merged[key] = round(median, 4) if isinstance(median, float) else median
            else:
                merged[key] = value
        for key in ("ratio", "p99_ratio"):
            if key == "ratio" or key in group[0]:
                ratios = [r[key] for r in group if _is_number(r.get(key))]
                merged[f"{key}_min"] = min(ratios) if ratios else None
                merged[f"{key}_max"] = max(ratios) if ratios else None
        merged["runs"] = len(group)
        rows.append(merged)
    return rows


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class Target:
    """One performance target, the row it concerns, and how it went (PASS, MISS, n/a)."""

    id: str
    text: str
    short: str
    row: str | None
    status: str
    measured: str


def _targets(rows: dict[str, Row], plan: Plan) -> list[Target]:
    s = plan.settings
    targets: list[Target] = []

    def add(
        id_: str,
        text: str,
        short: str,
        row_id: str,
        check: Callable[[Row], tuple[bool, str] | None],
    ) -> None:
        row = rows.get(row_id)
        outcome = check(row) if row is not None else None
        if outcome is None:
            targets.append(Target(id_, text, short, row_id, "n/a", "not measured"))
        else:
            ok, measured = outcome
            targets.append(Target(id_, text, short, row_id, "PASS" if ok else "MISS", measured))

    def ratio_at_most(limit: float) -> Callable[[Row], tuple[bool, str] | None]:
        def check(row: Row) -> tuple[bool, str] | None:
            ratio = row.get("ratio")
            return None if ratio is None else (ratio <= limit, f"{ratio:.2f}x")

        return check

    add(
        "redis_uncontended",
        "Redis uncontended acquire + release <= 1.1x SET NX PX + DEL",
        "<=1.1x",
        "uncontended/redis/asynclock",
        ratio_at_most(1.1),
    )
    add(
        "redis_p99",
        "Redis uncontended p99 < 1 ms",
        "p99<1ms",
        "uncontended/redis/asynclock",
        lambda r: (r["p99_us"] < 1000, f"{r['p99_us']:.0f} us"),
    )
    for w in s.waiters:
        add(
            f"handoff_median_{w}",
            f"Strict hand-off median <= 3x PING ({w} waiters)",
            "<=3x PING",
            f"strict/redis/{w}/asynclock",
            ratio_at_most(3.0),
        )

        def ahead(row: Row, w: int = w) -> tuple[bool, str] | None:
            peers = [
                r
                for r in rows.values()
                if r["section"] == "strict" and r.get("waiters") == w and r["kind"] == "peer"
            ]
            if not peers:
                return None
            best = max(peers, key=lambda r: r.get("handoffs_per_s", 0))
            ours, theirs = row.get("handoffs_per_s", 0), best.get("handoffs_per_s", 0)
            return ours > theirs, f"{ours:,.0f}/s vs {theirs:,.0f}/s ({best['label']})"

        add(
            f"handoff_throughput_{w}",
            f"Strict hand-offs per second ahead of every peer ({w} waiters)",
            "ahead of peers",
            f"strict/redis/{w}/asynclock",
            ahead,
        )
    add(
        "redlock_ratio",
        "Redlock <= 1.5x single-node asynclock",
        "<=1.5x",
        "uncontended/redlock/asynclock",
        ratio_at_most(1.5),
    )

    def redlock_ahead(row: Row) -> tuple[bool, str] | None:
        peers = [
            rows[k]
            for k in rows
            if k.startswith("uncontended/redlock/") and rows[k]["kind"] == "peer"
        ]
        if not peers:
            return None
        slowest_gap = min(p["median_us"] / row["median_us"] for p in peers)
        names = ", ".join(f"{p['label']} {p['median_us']:,.0f} us" for p in peers)
        return slowest_gap > 1, f"{row['median_us']:,.0f} us vs {names}"

    add(
        "redlock_vs_peers",
        "Redlock ahead of aioredlock and pottery",
        "ahead of peers",
        "uncontended/redlock/asynclock",
        redlock_ahead,
    )
    limit_ms = s.node_timeout * 1000 + 5
    add(
        "frozen_p99",
        f"One node frozen: acquire p99 <= node_timeout + 5 ms ({limit_ms:g} ms)",
        f"p99<={limit_ms:g}ms",
        "frozen/redlock/1/acquire",
        lambda r: (r["p99_us"] <= limit_ms * 1000, f"{r['p99_us'] / 1000:.1f} ms"),
    )
    add(
        "postgres",
        "PostgreSQL <= 1.3x its floor",
        "<=1.3x",
        "uncontended/postgres/asynclock",
        ratio_at_most(1.3),
    )
    _sync_targets(rows, s.sync_waiters, add, ratio_at_most(1.3))
    add(
        "lease_cpu",
        "Held leases: renewal CPU < 2 % of a core",
        "CPU<2%",
        "leases/redis",
        lambda r: (r["cpu_percent"] < 2, f"{r['cpu_percent']:.2f} %"),
    )
    add(
        "lease_memory",
        "Held leases: memory < 2 KiB per lease",
        "<2KiB",
        "leases/redis",
        lambda r: (r["bytes_per_lease"] < 2048, f"{r['bytes_per_lease']:,} B"),
    )
    return targets


Check = Callable[[Row], tuple[bool, str] | None]


def _sync_targets(
    rows: dict[str, Row],
    waiters: Iterable[int],
    add: Callable[[str, str, str, str, Check], None],
    within: Check,
) -> None:
    """The blocking API's targets: within 1.3x the blocking floor, ahead of every
    blocking peer uncontended, and in hand-offs per second with threads."""
    ours = "sync/redis/asynclock"
    add(
        "sync_uncontended",
        "Sync acquire + release (with coord.lock) <= 1.3x the sync floor (SET NX PX + DEL)",
        "<=1.3x",
        ours,
        within,
    )

    def ahead(row: Row) -> tuple[bool, str] | None:
        peers = [r for r in rows.values() if r["section"] == "sync" and r["kind"] == "peer"]
        if not peers:
            return None
        best = min(peers, key=lambda r: r["median_us"])
        names = ", ".join(f"{p['label']} {p['median_us']:,.0f} us" for p in peers)
        return row["median_us"] < best["median_us"], f"{row['median_us']:,.0f} us vs {names}"

    add(
        "sync_vs_peers",
        "Sync acquire + release ahead of every sync peer (median)",
        "ahead of peers",
        ours,
        ahead,
    )
    for w in waiters:

        def ahead_contended(row: Row, w: int = w) -> tuple[bool, str] | None:
            peers = [
                r
                for r in rows.values()
                if r["section"] == "sync-strict" and r.get("waiters") == w and r["kind"] == "peer"
            ]
            if not peers:
                return None
            best = max(peers, key=lambda r: r.get("handoffs_per_s", 0))
            mine, theirs = row.get("handoffs_per_s", 0), best.get("handoffs_per_s", 0)
            return mine > theirs, f"{mine:,.0f}/s vs {theirs:,.0f}/s ({best['label']})"

        add(
            f"sync_handoff_throughput_{w}",
            f"Sync strict hand-offs per second ahead of every sync peer ({w} threads)",
            "ahead of peers",
            f"sync-strict/redis/{w}/asynclock",
            ahead_contended,
        )


def _merge_texts(runs: list[dict[str, Any]], key: str) -> dict[str, str]:
    merged: dict[str, list[str]] = {}
    for run in runs:
        for name, text in run[key].items():
            merged.setdefault(name, [])
            if text not in merged[name]:
                merged[name].append(text)
    return {name: "; ".join(texts) for name, texts in merged.items()}


def build_report(
    plan: Plan, runs: list[dict[str, Any]], *, started_at: str, seconds: float
) -> dict[str, Any]:
    """The whole report as a JSON-able dict (see :func:`write_json` for its layout)."""
    rows = _median_rows(runs)
    by_id = {row["id"]: row for row in rows}
    targets = _targets(by_id, plan)
    redis_mod = importlib.import_module("redis.utils")
    background: list[str] = []
    for run in runs:
        background += run["background_errors"]
    return {
        "asynclock": __version__,
        "started_at": started_at,
        "seconds": round(seconds, 1),
        "mode": plan.mode,
        "runs": plan.runs,
        "machine": {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "system": f"{platform.system()} {platform.release()}",
            "arch": platform.machine(),
            "cpus": os.cpu_count(),
            "hiredis": bool(getattr(redis_mod, "HIREDIS_AVAILABLE", False)),
        },
        "servers": plan.servers.described(),
        "settings": dataclasses.asdict(plan.settings),
        "sections": list(plan.sections),
        "peers": plan.peers,
        "results": rows,
        "targets": [dataclasses.asdict(t) for t in targets],
        "unavailable": _merge_texts(runs, "unavailable"),
        "failed": _merge_texts(runs, "failed"),
        "frozen_peers": _merge_texts(runs, "peer_outcomes"),
        "notes": list(plan.servers.notes),
        "background_errors": len(background),
        "background_error_examples": sorted(set(background))[:5],
        "run_details": runs,
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write ``report`` as indented JSON (no NaN or infinity: missing numbers are null).

    Layout: ``asynclock`` (version), ``started_at``, ``seconds``, ``mode``, ``runs``,
    ``machine``, ``servers`` (URLs without passwords, versions), ``settings``,
    ``results`` (one row per case: ``id``, ``section``, ``server``, ``label``, ``kind``,
    ``floor``, ``ratio``, ``ratio_min``, ``ratio_max`` and the section's metrics, medians
    over runs), ``targets`` (``id``, ``text``, ``status``, ``measured``),
    ``unavailable`` (peer -> reason), ``failed``, ``frozen_peers``, ``notes``, and
    ``run_details`` (every run's own rows).
    """
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2, allow_nan=False)
        out.write("\n")


# -- the table ---------------------------------------------------------------------------


@dataclass
class Section:
    """A block of the table: title, column headers, rows of cells, lines under it."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]


def _us(value: object) -> str:
    if not _is_number(value):
        return "-"
    assert isinstance(value, int | float)
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def _count(value: object) -> str:
    if not _is_number(value):
        return "-"
    assert isinstance(value, int | float)
    return f"{value:,.0f}"


def _ratio(row: Row, key: str = "ratio") -> str:
    ratio = row.get(key)
    if ratio is None:
        return ""
    text = _x(ratio)
    if row.get("runs", 1) > 1 and row.get(f"{key}_min") is not None:
        text += f" ({_x(row[f'{key}_min'])[:-1]}-{_x(row[f'{key}_max'])[:-1]})"
    return text


def _x(ratio: float) -> str:
    if ratio < 10:
        return f"{ratio:.2f}x"
    return f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


_THREADS_NOTE = "python-redis-lock is synchronous: one thread per waiter, as its docs show."


def _share(value: object) -> str:
    if not _is_number(value):
        return "-"
    assert isinstance(value, int | float)
    return f"{100 * value:.0f} %"


def _marks(row: Row, targets: list[Target]) -> str:
    return ", ".join(
        f"{t.short} {t.status}" for t in targets if t.row == row["id"] and t.status != "n/a"
    )


def _sections(report: dict[str, Any]) -> list[Section]:
    rows: list[Row] = report["results"]
    targets = [Target(**t) for t in report["targets"]]
    settings = report["settings"]
    sections: list[Section] = []

    unc = [r for r in rows if r["section"] == "uncontended"]
    if unc:
        sections.append(
            Section(
                f"Uncontended acquire + release ({settings['rounds']} rounds x "
                f"{settings['per_round']} ops, alternating; ratio to the floor above it)",
                ["case", "median us", "p99 us", "ops/s", "x floor", "target"],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        _us(r["median_us"]),
                        _us(r["p99_us"]),
                        _count(r["ops_per_s"]),
                        _ratio(r),
                        _marks(r, targets),
                    ]
                    for r in unc
                ],
                [],
            )
        )
    strict = [r for r in rows if r["section"] == "strict"]
    if strict:
        strict.sort(key=lambda r: (r["waiters"], r["server"] == "postgres"))
        sections.append(
            Section(
                "Contended, strict hand-off: every acquisition goes to another waiter (a "
                "releaser waits until another got the lock; holders keep it "
                f"{STRICT_HOLD * 1000:g} ms; {settings['contended_seconds']:g} s per case; "
                "each waiter has its own client or coordinator, as in its own process, "
                "except 'one coordinator'; hand-off = release call to the next grant; ratio "
                "to PING, or to raw asyncpg with one queued waiter for PostgreSQL)",
                [
                    "case",
                    "waiters",
                    "hand-offs/s",
                    "hand-off med us",
                    "p99 us",
                    "x floor",
                    "target",
                ],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        str(r["waiters"]),
                        _count(r.get("handoffs_per_s")),
                        _us(r.get("handoff_median_us")),
                        _us(r.get("handoff_p99_us")),
                        _ratio(r),
                        _marks(r, targets),
                    ]
                    for r in strict
                ],
                [_THREADS_NOTE if any(r.get("threads") for r in strict) else ""],
            )
        )
    free = [r for r in rows if r["section"] == "free"]
    if free:
        free.sort(key=lambda r: r["waiters"])
        sections.append(
            Section(
                "Contended, free for all: a releaser contends again at once, no hold "
                "(to another: share of acquisitions that changed holder; hand-offs/s: those per "
                "second; hand-off latency counted when the holder changed)",
                [
                    "case",
                    "waiters",
                    "acq/s",
                    "to another",
                    "hand-offs/s",
                    "hand-off med us",
                    "p99 us",
                    "x floor",
                    "target",
                ],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        str(r["waiters"]),
                        _count(r.get("acquisitions_per_s")),
                        _share(r.get("different_holder_share")),
                        _count(r.get("handoffs_per_s")),
                        _us(r.get("handoff_median_us")),
                        _us(r.get("handoff_p99_us")),
                        _ratio(r),
                        _marks(r, targets),
                    ]
                    for r in free
                ],
                [_THREADS_NOTE if any(r.get("threads") for r in free) else ""],
            )
        )
    frozen = [r for r in rows if r["section"] == "frozen"]
    if frozen:
        sections.append(
            Section(
                f"Redlock, one node stopped with SIGSTOP (node_timeout "
                f"{settings['node_timeout'] * 1000:g} ms, {settings['frozen_ops']} ops each)",
                ["case", "median us", "p99 us", "x all up", "target"],
                [
                    [
                        r["label"],
                        _us(r["median_us"]),
                        _us(r["p99_us"]),
                        _ratio(r),
                        _marks(r, targets),
                    ]
                    for r in frozen
                ],
                [
                    f"{name}, one node frozen: {text}"
                    for name, text in report["frozen_peers"].items()
                ],
            )
        )
    leases = [r for r in rows if r["section"] == "leases"]
    if leases:
        sections.append(
            Section(
                "Held leases on one coordinator (renewal CPU over an idle baseline; "
                "memory: tracemalloc delta / leases)",
                ["case", "renewals/s", "CPU % of a core", "us/renewal", "bytes/lease", "target"],
                [
                    [
                        r["label"],
                        _count(r["renewals_per_s"]),
                        f"{r['cpu_percent']:.2f}",
                        _us(r.get("cpu_us_per_renewal")),
                        _count(r["bytes_per_lease"]),
                        _marks(r, targets),
                    ]
                    for r in leases
                ],
                [
                    f"{r['renewals']:,} renewals in a {r['window_s']:g} s window, "
                    f"{r['still_held']:,} of {r['leases']:,} still held at its end; "
                    f"acquired in {r['acquire_seconds']:g} s (under tracemalloc)"
                    for r in leases
                ],
            )
        )
    sections += _primitive_sections(rows, settings)
    sections += _sync_sections(rows, settings, targets)
    sections.append(
        Section(
            "Targets (reported, never asserted)",
            ["target", "measured", "status"],
            [[t.text, t.measured, t.status] for t in targets if t.status != "n/a"],
            [
                f"{sum(t.status == 'n/a' for t in targets)} targets concern cases not run here"
                if any(t.status == "n/a" for t in targets)
                else ""
            ],
        )
    )
    notes = [f"{name}: {why}" for name, why in report["unavailable"].items()]
    notes += [f"{phase}: failed: {why}" for phase, why in report["failed"].items()]
    notes += list(report["notes"])
    if not report["peers"]:
        notes.append("peer libraries not run")
    if report["background_errors"]:
        examples = "; ".join(report["background_error_examples"][:2])
        notes.append(
            f"{report['background_errors']} errors in background tasks (peers' leftovers "
            f"after cancelled waits or the frozen node), e.g. {examples}"
        )
    if notes:
        sections.append(Section("Not run, failed, notes", [], [], notes))
    return sections


_SERVER_ORDER = {"memory": 0, "redis": 1, "postgres": 2}
_CASE_ORDER = {"lock": 0, "semaphore": 1, "rwlock-read": 2, "rwlock-write": 3, "fair": 4}


def _supported(row: Row, cell: str) -> str:
    return cell if row.get("supported", True) else "not supported"


def _primitive_sections(rows: list[Row], settings: dict[str, Any]) -> list[Section]:
    """Semaphores, read-write locks and fair locks against the plain lock, same backend."""
    sections: list[Section] = []
    unc = [r for r in rows if r["section"] == "primitives"]
    if unc:
        unc.sort(
            key=lambda r: (
                _SERVER_ORDER.get(r["server"], 9),
                _CASE_ORDER.get(r["id"].rsplit("/", 1)[-1], 9),
            )
        )
        sections.append(
            Section(
                f"Primitives, uncontended acquire + release ({settings['rounds']} rounds x "
                f"{settings['per_round']} ops, alternating; ratio to the plain lock on the "
                "same backend, same run)",
                ["case", "median us", "p99 us", "ops/s", "x plain lock"],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        _supported(r, _us(r.get("median_us"))),
                        _us(r.get("p99_us")),
                        _count(r.get("ops_per_s")),
                        _ratio(r),
                    ]
                    for r in unc
                ],
                [
                    f"{r['server']} {r['label']}: {r['note']}"
                    for r in unc
                    if not r.get("supported", True) and r.get("note")
                ],
            )
        )
    con = [r for r in rows if r["section"] == "primitives-contended"]
    if con:
        con.sort(key=lambda r: (r["mode"] != "strict", _SERVER_ORDER.get(r["server"], 9)))
        sections.append(
            Section(
                "Primitives, contended: fair against plain lock, one coordinator per waiter "
                f"({settings['contended_seconds']:g} s per case; strict: a releaser waits "
                f"until another got the lock, holds {STRICT_HOLD * 1000:g} ms; free: it "
                "contends again at once; ratio: hand-offs/s over the plain lock's)",
                [
                    "case",
                    "mode",
                    "waiters",
                    "acq/s",
                    "to another",
                    "hand-offs/s",
                    "hand-off med us",
                    "p99 us",
                    "x plain",
                ],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        r["mode"],
                        str(r["waiters"]),
                        _supported(r, _count(r.get("acquisitions_per_s"))),
                        _share(r.get("different_holder_share")),
                        _count(r.get("handoffs_per_s")),
                        _us(r.get("handoff_median_us")),
                        _us(r.get("handoff_p99_us")),
                        _ratio(r),
                    ]
                    for r in con
                ],
                [],
            )
        )
    return sections


def _sync_sections(
    rows: list[Row], settings: dict[str, Any], targets: list[Target]
) -> list[Section]:
    """The blocking API: uncontended against the blocking floor and peers, where its
    cycle's time goes, and hand-off between threads."""
    sections: list[Section] = []
    by_id = {r["id"]: r for r in rows}
    unc = [r for r in rows if r["section"] == "sync"]
    if unc:
        sections.append(
            Section(
                "Blocking API (asynclock.sync), uncontended acquire + release from a thread "
                f"({settings['rounds']} rounds x {settings['per_round']} ops, alternating; "
                "ratios of the median and of the p99 to the floor's: SET NX PX + DEL on "
                "redis-py's blocking client, measured in the same rounds)",
                ["case", "median us", "p99 us", "ops/s", "x floor", "p99 x floor", "target"],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        _us(r["median_us"]),
                        _us(r["p99_us"]),
                        _count(r["ops_per_s"]),
                        _ratio(r),
                        _ratio(r, "p99_ratio"),
                        _marks(r, targets),
                    ]
                    for r in unc
                ],
                [_sync_peers_note([r["id"].rsplit("/", 1)[-1] for r in unc])],
            )
        )
    parts = [r for r in rows if r["section"] == "sync-parts"]
    whole = by_id.get("sync/redis/asynclock")
    if parts:
        shown = [*parts, whole] if whole else parts
        sections.append(
            Section(
                "Where asynclock.sync's time goes (same rounds; each blocking call hops into "
                "the coordinator's loop thread and back: acquire one hop, release another; "
                "'in the loop thread' rows are timed there; ratios to the blocking floor)",
                ["part", "median us", "p99 us", "x floor", "p99 x floor"],
                [
                    [
                        r["label"] if r is not whole else f"whole cycle: {r['label']}",
                        _us(r["median_us"]),
                        _us(r["p99_us"]),
                        _ratio(r),
                        _ratio(r, "p99_ratio"),
                    ]
                    for r in shown
                ],
                _sync_breakdown(by_id),
            )
        )
    con = [r for r in rows if r["section"] == "sync-strict"]
    if con:
        sections.append(
            Section(
                "Blocking API, contended strict hand-off: threads on one lock, each loops "
                f"acquire, hold {STRICT_HOLD * 1000:g} ms, release, and a releaser waits until "
                f"another thread got the lock ({settings['contended_seconds']:g} s per case; "
                "each thread has its own client or coordinator, as in its own process, except "
                "'one coordinator'; hand-off = release call to the next grant; ratio: hand-off "
                "median over one blocking PING)",
                [
                    "case",
                    "threads",
                    "hand-offs/s",
                    "hand-off med us",
                    "p99 us",
                    "x PING",
                    "target",
                ],
                [
                    [
                        f"{r['server']:8} {r['label']}",
                        str(r["waiters"]),
                        _count(r.get("handoffs_per_s")),
                        _us(r.get("handoff_median_us")),
                        _us(r.get("handoff_p99_us")),
                        _ratio(r),
                        _marks(r, targets),
                    ]
                    for r in con
                ],
                _SYNC_CONTENDED_NOTES,
            )
        )
    return sections


_SYNC_PEER_USES = {
    "redis-py": "redis-py's redis.lock.Lock (client.lock(name, timeout=30, sleep=0.001))",
    "python-redis-lock": "python-redis-lock (redis_lock.Lock(client, name, expire=30))",
    "pottery": (
        "pottery Redlock(key=, masters={client}, auto_release_time=30), which runs each "
        "acquire and release in a thread pool"
    ),
}


def _sync_peers_note(cases: list[str]) -> str:
    """How each blocking peer that ran was used."""
    uses = [use for case, use in _SYNC_PEER_USES.items() if case in cases]
    return f"Peers on redis-py's blocking client: {'; '.join(uses)}." if uses else ""


_SYNC_CONTENDED_NOTES = [
    "Waiting: asynclock.sync waiters are woken when the lock is released (its waiter queue); "
    "python-redis-lock waiters block in BLPOP on the signal its release pushes; redis-py's "
    "Lock polls, here sleeping 1 ms between tries (its default is 0.1 s); pottery's Redlock "
    "polls, sleeping a random 0-0.2 s (a class constant with no documented setting: left as "
    "shipped).",
    "Floor: one PING round trip on the blocking client (sync/redis/ping). A hand-off needs at "
    "least two (the release, then the next holder's grant), so about 2x is the floor of a lock "
    "that tells its waiters. The raw loop sends the floor's SET NX PX again at once, no sleep, "
    "and DEL to release: what busy polling gets, at the cost of every waiter spinning on the "
    "server.",
]


def _sync_breakdown(by_id: dict[str, Row]) -> list[str]:
    """The cycle as hops + the async core's cycle + the rest, from measured medians."""
    ids = ("sync/redis/floor", "sync/redis/asynclock", "sync-parts/redis/hop")
    floor, whole, hop = (by_id.get(i) for i in ids)
    in_loop = by_id.get("sync-parts/redis/async-lock")
    if not (floor and whole and hop and in_loop):
        return []
    f, w, h, a = (r["median_us"] for r in (floor, whole, hop, in_loop))
    notes = [
        f"Medians: with coord.lock() {w:,.0f} us = 2 empty hops ({2 * h:,.0f} us) + the "
        f"async core's cycle in the loop thread ({a:,.0f} us) + {w - 2 * h - a:,.0f} us "
        "not in either."
    ]
    around = by_id.get("sync-parts/redis/hop-around-lock")
    if around:
        o = around["median_us"]
        notes.append(
            f"One hop around the async cycle takes {o:,.0f} us: a hop that waits for the "
            f"loop thread's I/O costs {o - a:,.0f} us, an empty one {h:,.0f} us; the second "
            f"hop and the blocking wrappers (Lock, Lease, with) make the other "
            f"{w - o:,.0f} us."
        )
    notes.append(
        f"The 1.3x target allows {1.3 * f:,.0f} us; the async core's cycle alone takes "
        f"{a:,.0f} us ({a / f:.2f}x the blocking floor)."
    )
    async_floor = by_id.get("sync-parts/redis/async-floor")
    if async_floor:
        af = async_floor["median_us"]
        notes.append(
            f"redis.asyncio's own SET NX PX + DEL in that loop takes {af:,.0f} us "
            f"({af / f:.2f}x): two round trips through an event loop cost more than two "
            "blocking ones from a thread."
        )
    return notes


def _header(report: dict[str, Any]) -> str:
    m = report["machine"]
    servers = report["servers"]
    where = "embedded" if servers["embedded"] else "given"
    versions = ", ".join(dict.fromkeys(servers["versions"].values())) or "no server"
    minutes, secs = divmod(round(report["seconds"]), 60)
    took = f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    runs = f"{report['runs']} run{'s' if report['runs'] > 1 else ''}"
    return (
        f"asynclock {report['asynclock']} bench: {report['mode']}, {runs}, {took}; "
        f"Python {m['python']} on {m['system']} {m['arch']}, {m['cpus']} CPUs, "
        f"hiredis {'on' if m['hiredis'] else 'off'}; {where} servers: {versions}"
    )


def _plain(sections: Iterable[Section], header: str, out: TextIO) -> None:
    print(header, file=out)
    for section in sections:
        print(file=out)
        print(section.title, file=out)
        if section.headers:
            table = [section.headers, *section.rows]
            widths = [max(len(row[i]) for row in table) for i in range(len(section.headers))]
            for n, row in enumerate(table):
                cells = []
                for i, cell in enumerate(row):
                    left = i == 0 or section.headers[i] in ("target", "measured", "status")
                    cells.append(cell.ljust(widths[i]) if left else cell.rjust(widths[i]))
                print("  " + "  ".join(cells).rstrip(), file=out)
                if n == 0:
                    print("  " + "  ".join("-" * w for w in widths), file=out)
        for note in section.notes:
            if note:
                print(f"  {note}", file=out)


def _rich(sections: Iterable[Section], header: str, out: TextIO) -> bool:
    try:
        console_mod = importlib.import_module("rich.console")
        table_mod = importlib.import_module("rich.table")
    except ImportError:
        return False
    console = console_mod.Console(file=out)
    console.print(header, markup=False, highlight=False)
    for section in sections:
        if not section.headers:
            console.print(f"\n[bold]{section.title}[/bold]")
            for note in section.notes:
                console.print(f"  {note}", markup=False, highlight=False)
            continue
        table = table_mod.Table(title=section.title, title_justify="left", expand=False)
        for i, head in enumerate(section.headers):
            left = i == 0 or head in ("target", "measured", "status")
            table.add_column(head, justify="left" if left else "right", overflow="fold")
        for row in section.rows:
            table.add_row(*(_colour(cell) for cell in row))
        console.print()
        console.print(table)
        for note in section.notes:
            if note:
                console.print(f"  {note}", markup=False, highlight=False)
    return True


def _colour(cell: str) -> str:
    cell = cell.replace("[", r"\[")
    return cell.replace("PASS", "[green]PASS[/green]").replace("MISS", "[red]MISS[/red]")


def print_report(report: dict[str, Any], out: TextIO | None = None, *, plain: bool = False) -> None:
    """Print the table: rich when installed and ``out`` is a terminal, plain text otherwise."""
    out = out or sys.stdout
    sections = _sections(report)
    header = _header(report)
    if plain or not out.isatty() or not _rich(sections, header, out):
        _plain(sections, header, out)


# -- the chart ---------------------------------------------------------------------------


def draw_chart(report: dict[str, Any], path: str | Path) -> str | None:
    """Draw the report as a PNG at ``path``; the reason if matplotlib is missing, else None."""
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        pyplot = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return f"matplotlib is not installed ({CHART_HINT}): no chart drawn"
    rows: list[Row] = report["results"]
    colours = {
        "floor": "#9e9e9e",
        "reference": "#cfcfcf",
        "asynclock": "#1f77b4",
        "peer": "#ff7f0e",
    }
    panels: list[tuple[str, list[Row], str, str | None]] = [
        (
            "Uncontended acquire + release: median (bar) and p99 (tick), us",
            [r for r in rows if r["section"] in ("uncontended", "frozen")],
            "median_us",
            "p99_us",
        ),
        (
            "Strict hand-off: release call to the next grant, median (bar) and p99 (tick), us",
            [
                r
                for r in rows
                if r["section"] in ("strict", "sync-strict") and r.get("handoff_median_us")
            ],
            "handoff_median_us",
            "handoff_p99_us",
        ),
        (
            "Free for all: hand-offs to another waiter per second (share of acquisitions in "
            "brackets)",
            [r for r in rows if r["section"] == "free" and r.get("handoffs_per_s")],
            "handoffs_per_s",
            None,
        ),
        (
            "Blocking API from a thread (asynclock.sync, blocking floor and peers), and the "
            "parts of asynclock.sync's cycle: median (bar) and p99 (tick), us",
            [r for r in rows if r["section"] in ("sync", "sync-parts")],
            "median_us",
            "p99_us",
        ),
    ]
    panels = [p for p in panels if p[1]]
    if not panels:
        return "nothing to chart"
    heights = [max(2.0, 0.28 * len(p[1]) + 1.0) for p in panels]
    figure, axes = pyplot.subplots(
        len(panels), 1, figsize=(11, sum(heights)), gridspec_kw={"height_ratios": heights}
    )
    if len(panels) == 1:
        axes = [axes]
    for ax, (title, panel_rows, key, tick_key) in zip(axes, panels, strict=True):
        labels = []
        for r in panel_rows:
            w = r.get("waiters")
            waiters = f", {w} waiter{'s' if w != 1 else ''}" if w else ""
            share = r.get("different_holder_share") if r["section"] == "free" else None
            fair = f" ({100 * share:.0f} % to another)" if share is not None else ""
            blocking = "sync " if r["section"].startswith("sync") else ""
            labels.append(f"{blocking}{r['server']}: {r['label']}{waiters}{fair}")
        values = [max(float(r[key]), 1e-3) for r in panel_rows]
        positions = list(range(len(panel_rows)))
        ax.barh(positions, values, color=[colours.get(r["kind"], "#888") for r in panel_rows])
        if tick_key:
            ticks = [r.get(tick_key) for r in panel_rows]
            ax.scatter(
                [t for t in ticks if t],
                [p for p, t in zip(positions, ticks, strict=True) if t],
                marker="|",
                s=120,
                color="black",
                zorder=3,
            )
        for p, v in zip(positions, values, strict=True):
            ax.text(v, p, f" {v:,.0f}" if v >= 10 else f" {v:.1f}", va="center", fontsize=7)
        ax.set_yticks(positions, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(axis="x", which="major", alpha=0.3)
    patches = importlib.import_module("matplotlib.patches")
    axes[0].legend(
        handles=[
            patches.Patch(color=colours[kind], label=kind)
            for kind in ("floor", "reference", "asynclock", "peer")
        ],
        loc="lower right",
        fontsize=7,
    )
    figure.suptitle(_header(report), fontsize=7)
    figure.tight_layout(rect=(0, 0, 1, 0.985))
    figure.savefig(path, dpi=110, bbox_inches="tight")
    pyplot.close(figure)
    return None
