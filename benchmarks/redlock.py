"""Redlock on 5 nodes against single-node asynclock and the asyncio Redlock peers.

    python benchmarks/redlock.py                       # starts 5 embedded Valkey nodes
    python benchmarks/redlock.py --urls redis://h1:6379/0,redis://h2:6379/0,... --json out.json

The Redlock part of ``asynclock bench`` (``benchmarks/run.py`` runs all of it).

Part 1, all nodes up, uncontended acquire + release per operation, alternating rounds:
single-node asynclock (the floor here), asynclock Redlock on 5 nodes, and the peers as
they are documented to be used — pottery's ``AIORedlock`` and aioredlock's
``Aioredlock`` on the same 5 nodes (installed by the ``bench`` extra; a peer that cannot
be imported or run is reported as such).

Part 2, one node frozen (SIGSTOP; embedded nodes only): acquire latency and acquire +
release for asynclock Redlock, and whether the peers acquire at all within a 2 s bound.
"""

from __future__ import annotations

from _common import parser, run, settings

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--urls", help="comma-separated Redis URLs; default: 5 embedded nodes")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=200)
    p.add_argument("--frozen-ops", type=int, default=200)
    args = p.parse_args()
    run(
        redlock=args.urls.split(",") if args.urls else (),
        settings=settings(rounds=args.rounds, per_round=args.per_round, frozen_ops=args.frozen_ops),
        sections=("uncontended", "frozen"),
        memory=False,
        kinds=("redlock",),
        json_path=args.json,
        chart_path=args.chart,
    )
