"""PostgreSQL: acquire + release against the raw advisory-lock floor, and hand-off.

    python benchmarks/postgres.py                  # starts an embedded PostgreSQL
    python benchmarks/postgres.py --dsn postgresql://user@host/db --json out.json

Cases, timed per operation in alternating rounds:

- ``floor``: one asyncpg connection, ``pg_try_advisory_lock`` then ``pg_advisory_unlock``;
- ``asynclock``: ``async with coord.lock(name)`` on a ``postgresql://`` coordinator
  (a pooled connection pinned for the lease, fence, TTL settings, release and reset);
- ``hand-off``: a holder releases while a waiter is queued in the server; the time from
  the release call to the waiter's grant, for asynclock and for raw asyncpg connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import sys
import time

import asyncpg
from _common import Op, print_table, report, run_cases, summarize

import asynclock
from asynclock.testing import start_postgres

FLOOR = "floor pg_try_advisory_lock + unlock"


async def handoffs(n: int, hold: Op, wait_then_release: Op, release: Op) -> list[int]:
    """Release with a waiter queued in the server; ns from the release to the grant."""
    samples: list[int] = []
    for _ in range(n):
        await hold()
        waiter = asyncio.create_task(wait_then_release())
        await asyncio.sleep(0.002)  # the waiter is queued in the server by now
        released = time.perf_counter_ns()
        await release()
        granted = await waiter
        assert isinstance(granted, int)
        samples.append(granted - released)
    return samples


async def run(
    dsn: str, rounds: int, per_round: int, warmup: int, n_handoff: int
) -> dict[str, object]:
    raw = await asyncpg.connect(dsn)
    raw2 = await asyncpg.connect(dsn)
    coord = asynclock.connect(dsn, namespace=f"bench{secrets.token_hex(3)}")
    key = 0x5EED

    async def floor() -> None:
        await raw.fetchval("SELECT pg_try_advisory_lock($1)", key)
        await raw.fetchval("SELECT pg_advisory_unlock($1)", key)

    async def with_lock() -> None:
        async with coord.lock("bench:uncontended"):
            pass

    cases: dict[str, Op] = {FLOOR: floor, "asynclock async with": with_lock}
    try:
        summaries = await run_cases(cases, rounds=rounds, per_round=per_round, warmup=warmup)

        # Hand-off, raw: connection 1 holds, connection 2 waits in the queue.
        async def raw_hold() -> None:
            await raw.fetchval("SELECT pg_advisory_lock($1)", key)

        async def raw_wait() -> int:
            await raw2.fetchval("SELECT pg_advisory_lock($1)", key)
            granted = time.perf_counter_ns()
            await raw2.fetchval("SELECT pg_advisory_unlock($1)", key)
            return granted

        async def raw_release() -> None:
            await raw.fetchval("SELECT pg_advisory_unlock($1)", key)

        held: list[asynclock.Lease] = []

        async def lock_hold() -> None:
            held.append(await coord.lock("bench:handoff").acquire())

        async def lock_wait() -> int:
            lease = await coord.lock("bench:handoff").acquire()
            granted = time.perf_counter_ns()
            await lease.release()
            return granted

        async def lock_release() -> None:
            await held.pop().release()

        for label, hold, wait, release in (
            ("hand-off raw asyncpg", raw_hold, raw_wait, raw_release),
            ("hand-off asynclock", lock_hold, lock_wait, lock_release),
        ):
            await handoffs(20, hold, wait, release)  # warm
            summaries[label] = summarize(label, await handoffs(n_handoff, hold, wait, release))
    finally:
        await coord.aclose()
        await raw.close()
        await raw2.close()
    return report(
        summaries,
        FLOOR,
        server=dsn.rsplit("@", maxsplit=1)[-1],
        python=platform.python_version(),
        rounds=rounds,
        ops_per_round=per_round,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="a PostgreSQL DSN; default: start an embedded server")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--handoffs", type=int, default=300)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    args = parser.parse_args()
    server = None
    dsn = args.dsn
    if dsn is None:
        server = start_postgres()
        dsn = server.url
        print(f"embedded PostgreSQL on {dsn} (pid {server.pid})", file=sys.stderr)
    try:
        result = asyncio.run(run(dsn, args.rounds, args.per_round, args.warmup, args.handoffs))
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
