"""Uncontended acquire + release on one Redis/Valkey node, against the raw floor.

    python benchmarks/acquire.py                 # starts an embedded Valkey (asynclock[embedded])
    python benchmarks/acquire.py --url redis://127.0.0.1:6379/0 --json out.json

Each case is timed per operation (``perf_counter_ns`` around one acquire + release). The
cases run in alternating rounds so that a slow moment of the machine hits all of them:

- ``floor``: redis.asyncio (hiredis) ``SET key token NX PX ttl`` then ``DEL key``;
- ``asynclock``: ``async with coord.lock(name, ttl=30)``;
- ``asynclock acquire/release``: ``lease = await lock.acquire(); await lease.release()``;
- ``ping``: one ``PING`` round trip, for scale.

Reports median and p99 in microseconds and the ratios of asynclock to the floor.
Nothing here is a pass/fail check: the numbers are printed, and written as JSON on request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from redis.asyncio import Redis

import asynclock
from asynclock.testing import start_valkey

Op = Callable[[], Awaitable[object]]


@dataclass
class Summary:
    case: str
    ops: int
    median_us: float
    p99_us: float
    mean_us: float
    ops_per_s: float


def summarize(case: str, samples_ns: list[int]) -> Summary:
    ordered = sorted(samples_ns)
    n = len(ordered)
    median = statistics.median(ordered) / 1000
    p99 = ordered[min(n - 1, round(0.99 * (n - 1)))] / 1000
    mean = statistics.fmean(ordered) / 1000
    return Summary(case, n, round(median, 1), round(p99, 1), round(mean, 1), round(1e6 / mean))


async def timed(op: Op, n: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        started = clock()
        await op()
        into.append(clock() - started)


async def run(url: str, rounds: int, per_round: int, warmup: int) -> dict[str, object]:
    raw = Redis.from_url(url)
    coord = asynclock.connect(url, prefix=f"bench{secrets.token_hex(3)}")
    name = "bench:uncontended"
    lock = coord.lock(name, ttl=30)
    token = secrets.token_hex(16)

    async def floor() -> None:
        await raw.set("bench:floor", token, nx=True, px=30_000)
        await raw.delete("bench:floor")

    async def with_lock() -> None:
        async with coord.lock(name, ttl=30):
            pass

    async def acquire_release() -> None:
        lease = await lock.acquire()
        await lease.release()

    async def ping() -> None:
        await raw.ping()

    cases: dict[str, Op] = {
        "floor SET NX PX + DEL": floor,
        "asynclock async with": with_lock,
        "asynclock acquire/release": acquire_release,
        "PING": ping,
    }
    samples: dict[str, list[int]] = {case: [] for case in cases}
    try:
        for op in cases.values():  # connections open, scripts loaded, caches warm
            await timed(op, warmup, [])
        for i in range(rounds):
            order = list(cases.items())
            if i % 2:
                order.reverse()
            for case, op in order:
                await timed(op, per_round, samples[case])
            print(f"\r  round {i + 1}/{rounds}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        await coord.aclose()
        await raw.aclose()

    summaries = {case: summarize(case, s) for case, s in samples.items()}
    floor_s = summaries["floor SET NX PX + DEL"]
    ratios = {
        case: {
            "median_ratio": round(s.median_us / floor_s.median_us, 3),
            "p99_ratio": round(s.p99_us / floor_s.p99_us, 3),
        }
        for case, s in summaries.items()
    }
    return {
        "url": url.rsplit("@", maxsplit=1)[-1],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rounds": rounds,
        "ops_per_round": per_round,
        "results": [asdict(s) for s in summaries.values()],
        "ratios_to_floor": ratios,
    }


def print_table(report: dict[str, object]) -> None:
    results = report["results"]
    ratios = report["ratios_to_floor"]
    assert isinstance(results, list)
    assert isinstance(ratios, dict)
    header = (
        f"{'case':28} {'ops':>7} {'median us':>10} {'p99 us':>9} {'ops/s':>8} "
        f"{'x floor':>7} {'p99 x':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in results:
        r = ratios[row["case"]]
        print(
            f"{row['case']:28} {row['ops']:>7} {row['median_us']:>10.1f} {row['p99_us']:>9.1f} "
            f"{row['ops_per_s']:>8} {r['median_ratio']:>7.3f} {r['p99_ratio']:>6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a Redis/Valkey URL; default: start an embedded Valkey")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    args = parser.parse_args()

    server = None
    url = args.url
    if url is None:
        server = start_valkey()
        url = server.url
        print(f"embedded Valkey on {url} (pid {server.pid})", file=sys.stderr)
    try:
        report = asyncio.run(run(url, args.rounds, args.per_round, args.warmup))
    finally:
        if server is not None:
            server.stop()
    print_table(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
