"""PostgreSQL: acquire + release against the raw advisory-lock floor, and hand-off.

    python benchmarks/postgres.py                  # starts an embedded PostgreSQL
    python benchmarks/postgres.py --dsn postgresql://user@host/db --json out.json

The PostgreSQL part of ``asynclock bench`` (``benchmarks/run.py`` runs all of it).
Cases, timed per operation in alternating rounds:

- ``floor``: one asyncpg connection, ``pg_try_advisory_lock`` then ``pg_advisory_unlock``;
- ``asynclock async with``: ``async with coord.lock(name)`` on a ``postgresql://``
  coordinator (a pooled connection pinned for the lease, fence, TTL settings, release);
- hand-off with one waiter queued in the server: the time from the holder's release call
  to the waiter's grant, for raw asyncpg connections (the floor) and for asynclock.
"""

from __future__ import annotations

from _common import parser, run, settings

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--dsn", help="a PostgreSQL DSN; default: start an embedded server")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=300)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--handoffs", type=int, default=300)
    args = p.parse_args()
    run(
        postgres=args.dsn,
        settings=settings(
            rounds=args.rounds,
            per_round=args.per_round,
            warmup=args.warmup,
            pg_handoffs=args.handoffs,
            waiters=(),
        ),
        sections=("uncontended", "contended"),
        peers=False,
        memory=False,
        kinds=("postgres",),
        json_path=args.json,
        chart_path=args.chart,
    )
