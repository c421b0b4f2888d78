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
import sys

from _common import Op, print_table, report, run_cases
from redis.asyncio import Redis

import asynclock
from asynclock.testing import start_valkey

FLOOR = "floor SET NX PX + DEL"


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
        FLOOR: floor,
        "asynclock async with": with_lock,
        "asynclock acquire/release": acquire_release,
        "PING": ping,
    }
    try:
        summaries = await run_cases(cases, rounds=rounds, per_round=per_round, warmup=warmup)
    finally:
        await coord.aclose()
        await raw.aclose()
    return report(
        summaries,
        FLOOR,
        url=url.rsplit("@", maxsplit=1)[-1],
        python=platform.python_version(),
        machine=platform.machine(),
        rounds=rounds,
        ops_per_round=per_round,
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
        result = asyncio.run(run(url, args.rounds, args.per_round, args.warmup))
    finally:
        if server is not None:
            server.stop()
    print_table(result)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
