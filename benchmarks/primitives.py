"""Semaphores, read-write locks and fair locks against the plain lock, per backend.

    python benchmarks/primitives.py              # memory + embedded Valkey and PostgreSQL
    python benchmarks/primitives.py --url redis://127.0.0.1:6379/0 --pg postgresql://...

The ``primitives`` part of ``asynclock bench`` (``benchmarks/run.py`` runs all of it).
On memory, Redis and PostgreSQL, each on its own coordinator:

- uncontended ``async with`` acquire + release of a semaphore permit (limit 5), an
  rwlock ``read()``, an rwlock ``write()`` and a ``fair=True`` lock, timed per operation
  in alternating rounds with the plain lock (the floor): median, p99 and the ratio to the
  plain lock measured in the same run;
- contended: 8 waiters (one coordinator each) on one lock, fair against plain, in strict
  mode (every acquisition a hand-off) and free mode (a releaser contends again at once):
  hand-offs per second, hand-off latency, and the fair lock's hand-offs/s over the
  plain lock's.

A backend that does not support a primitive gets a row saying so. Numbers are reported,
never asserted.
"""

from __future__ import annotations

from _common import parser, run, settings

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--url", help="a Redis/Valkey URL; default: start an embedded Valkey")
    p.add_argument("--pg", help="a PostgreSQL DSN; default: start an embedded server")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=300)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--seconds", type=float, default=2.0, help="per contended case")
    args = p.parse_args()
    run(
        redis=args.url,
        postgres=args.pg,
        settings=settings(
            rounds=args.rounds,
            per_round=args.per_round,
            warmup=args.warmup,
            contended_seconds=args.seconds,
        ),
        sections=("primitives",),
        peers=False,
        kinds=("redis", "postgres"),
        json_path=args.json,
        chart_path=args.chart,
    )
