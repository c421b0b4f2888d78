"""Redlock on 5 nodes against single-node asynclock and the asyncio Redlock peers.

    python benchmarks/redlock.py                       # starts 5 embedded Valkey nodes
    python benchmarks/redlock.py --urls redis://h1:6379/0,redis://h2:6379/0,... --json out.json

Part 1, all nodes up, uncontended acquire + release per operation, alternating rounds:
single-node asynclock (the floor here), asynclock Redlock on 5 nodes, and the peers as
they are documented to be used — pottery's ``AIORedlock`` and aioredlock's
``Aioredlock`` on the same 5 nodes (installed by the ``bench`` extra; a peer that cannot
be imported or run is reported as such).

Part 2, one node frozen (SIGSTOP; embedded nodes only): acquire latency and acquire +
release for asynclock Redlock, and whether the peers acquire at all within a 2 s bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import sys
import time
from typing import Any

from _common import Op, print_table, report, run_cases, summarize
from redis.asyncio import Redis

import asynclock
from asynclock.testing import ValkeyServer, start_valkey

FLOOR = "asynclock single node"
PEER_BOUND = 2.0  # seconds a peer gets per operation before it counts as stuck


def peers(urls: list[str]) -> tuple[dict[str, Op], dict[str, str], list[Any]]:
    """The peers that can be set up here, why the others cannot, and what to close."""
    cases: dict[str, Op] = {}
    missing: dict[str, str] = {}
    closers: list[Any] = []
    try:
        from pottery import AIORedlock

        masters = [Redis.from_url(url) for url in urls]
        closers += masters
        pottery_lock = AIORedlock(key=f"bench-pottery-{secrets.token_hex(3)}", masters=masters)

        async def pottery_op() -> None:
            await pottery_lock.acquire()
            await pottery_lock.release()

        cases["pottery AIORedlock 5 nodes"] = pottery_op
    except Exception as exc:
        missing["pottery AIORedlock"] = f"{type(exc).__name__}: {exc}"
    try:
        from urllib.parse import urlsplit

        from aioredlock import Aioredlock

        connections = [{"host": urlsplit(url).hostname, "port": urlsplit(url).port} for url in urls]
        manager = Aioredlock(connections)
        closers.append(manager)
        resource = f"bench-aioredlock-{secrets.token_hex(3)}"

        async def aioredlock_op() -> None:
            lock = await manager.lock(resource, lock_timeout=30)
            await manager.unlock(lock)

        cases["aioredlock 5 nodes"] = aioredlock_op
    except Exception as exc:
        missing["aioredlock"] = f"{type(exc).__name__}: {exc}"
    return cases, missing, closers


async def close_all(closers: list[Any]) -> None:
    for item in closers:
        close = getattr(item, "aclose", None) or getattr(item, "destroy", None)
        if close is not None:
            try:
                await close()
            except Exception as exc:
                print(f"  closing {type(item).__name__}: {exc}", file=sys.stderr)


async def bounded(op: Op) -> Op:
    async def run() -> None:
        async with asyncio.timeout(PEER_BOUND):
            await op()

    return run


async def part_all_up(urls: list[str], rounds: int, per_round: int) -> dict[str, object]:
    single = asynclock.connect(urls[0], prefix=f"b{secrets.token_hex(3)}")
    redlock = asynclock.connect(urls, prefix=f"b{secrets.token_hex(3)}")

    async def single_op() -> None:
        async with single.lock("bench"):
            pass

    async def redlock_op() -> None:
        async with redlock.lock("bench"):
            pass

    cases: dict[str, Op] = {FLOOR: single_op, "asynclock Redlock 5 nodes": redlock_op}
    peer_cases, missing, closers = peers(urls)
    failed: dict[str, str] = {}
    for name, op in peer_cases.items():
        try:
            await (await bounded(op))()
            cases[name] = op
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    try:
        summaries = await run_cases(cases, rounds=rounds, per_round=per_round, warmup=200)
    finally:
        await single.aclose()
        await redlock.aclose()
        await close_all(closers)
    result = report(summaries, FLOOR, part="all nodes up")
    result["unavailable"] = {**missing, **failed}
    return result


async def part_one_frozen(
    urls: list[str], servers: list[ValkeyServer], n: int
) -> dict[str, object]:
    redlock = asynclock.connect(urls, prefix=f"b{secrets.token_hex(3)}")
    async with redlock.lock("warm"):
        pass
    peer_cases, missing, closers = peers(urls)
    for name, op in list(peer_cases.items()):  # connect before the freeze
        try:
            await (await bounded(op))()
        except Exception as exc:
            missing[name] = f"{type(exc).__name__}: {exc}"
            del peer_cases[name]
    servers[-1].freeze()
    acquire_ns: list[int] = []
    cycle_ns: list[int] = []
    peer_outcomes: dict[str, str] = {}
    try:
        for _ in range(n):
            started = time.perf_counter_ns()
            lease = await redlock.lock("frozen").acquire()
            acquired = time.perf_counter_ns()
            await lease.release()
            acquire_ns.append(acquired - started)
            cycle_ns.append(time.perf_counter_ns() - started)
        for name, op in peer_cases.items():
            started = time.perf_counter()
            try:
                await (await bounded(op))()
                peer_outcomes[name] = f"acquired in {(time.perf_counter() - started) * 1000:.1f} ms"
            except TimeoutError:
                peer_outcomes[name] = f"did not acquire within {PEER_BOUND:g} s"
            except Exception as exc:
                peer_outcomes[name] = f"failed: {type(exc).__name__}: {exc}"
    finally:
        servers[-1].resume()
        await redlock.aclose()
        await close_all(closers)
    acquire = summarize("Redlock acquire, 1 of 5 frozen", acquire_ns)
    cycle = summarize("Redlock acquire + release, 1 of 5 frozen", cycle_ns)
    return {
        "part": "one node frozen",
        "node_timeout_ms": 50,
        "results": [vars(acquire), vars(cycle)],
        "peers": peer_outcomes,
        "unavailable": missing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", help="comma-separated Redis URLs; default: 5 embedded nodes")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--frozen-ops", type=int, default=200)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    args = parser.parse_args()
    servers: list[ValkeyServer] = []
    if args.urls:
        urls = args.urls.split(",")
    else:
        servers = [start_valkey() for _ in range(5)]
        urls = [s.url for s in servers]
        print(f"embedded Valkey nodes: {', '.join(urls)}", file=sys.stderr)
    try:
        up = asyncio.run(part_all_up(urls, args.rounds, args.per_round))
        frozen = asyncio.run(part_one_frozen(urls, servers, args.frozen_ops)) if servers else None
    finally:
        for server in servers:
            server.stop()
    print_table(up)
    for name, why in dict(up["unavailable"]).items():  # type: ignore[call-overload]
        print(f"  {name}: could not run ({why})")
    if frozen is not None:
        print("\nOne node of 5 frozen (node_timeout 50 ms):")
        for row in frozen["results"]:  # type: ignore[attr-defined]
            median, p99 = row["median_us"], row["p99_us"]
            print(f"  {row['case']:42} median {median:>9.1f} us  p99 {p99:>9.1f} us")
        for name, outcome in frozen["peers"].items():  # type: ignore[attr-defined]
            print(f"  {name}: {outcome}")
    result = {
        "python": platform.python_version(),
        "all_up": up,
        "one_frozen": frozen,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
