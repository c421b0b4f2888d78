"""Uncontended acquire + release on one Redis/Valkey node, against the raw floor.

    python benchmarks/acquire.py                 # starts an embedded Valkey (asynclock[embedded])
    python benchmarks/acquire.py --url redis://127.0.0.1:6379/0 --json out.json

The Redis part of ``asynclock bench`` (``benchmarks/run.py`` runs all of it), without
the peers. Each case is timed per operation (``perf_counter_ns`` around one acquire +
release), in alternating rounds so that a slow moment of the machine hits all of them:

- ``floor``: redis.asyncio (hiredis) ``SET key token NX PX ttl`` then ``DEL key``;
- ``asynclock async with``: ``async with coord.lock(name, ttl=30)``;
- ``asynclock acquire() + release()``: ``lease = await lock.acquire(); await lease.release()``;
- ``PING``: one round trip, for scale.

Reports median and p99 in microseconds and the ratios to the floor. Nothing here is a
pass/fail check: the numbers are printed, and written as JSON on request.
"""

from __future__ import annotations

from _common import parser, run, settings

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--url", help="a Redis/Valkey URL; default: start an embedded Valkey")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=500)
    p.add_argument("--warmup", type=int, default=500)
    args = p.parse_args()
    run(
        redis=args.url,
        settings=settings(rounds=args.rounds, per_round=args.per_round, warmup=args.warmup),
        sections=("uncontended",),
        peers=False,
        memory=False,
        kinds=("redis",),
        json_path=args.json,
        chart_path=args.chart,
    )
