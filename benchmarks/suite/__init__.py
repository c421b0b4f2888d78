"""The benchmark suite behind ``asynclock bench`` and ``benchmarks/run.py``.

Private: the command line (:mod:`asynclock.cli`) is the interface. One run measures, on
the same servers and against floors taken in the same run:

- uncontended acquire + release on memory, Redis, Redlock and PostgreSQL, with the raw
  floors (``PING``, ``SET NX PX`` + ``DEL``, ``pg_try_advisory_lock`` + unlock) and the
  peers (redis-py's ``Lock``, python-redis-lock, pottery, aioredlock);
- contended hand-off with several waiters on one lock: throughput, hand-off latency and
  how often the lock went to another waiter;
- many held leases on one coordinator: renewal CPU and memory per lease;
- Redlock with one node stopped (only on nodes the suite started itself);
- the blocking API (``asynclock.sync``) from threads, against redis-py's blocking client
  (``SET NX PX`` + ``DEL``) and the blocking peers, the parts of its cycle (a hop into
  its loop thread, the async core's cycle there), and hand-off between threads.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from ._env import (
    EmbeddedUnavailable,
    Scrubber,
    Servers,
    Unreachable,
    UsageError,
    check_url,
    embedded_servers,
    probe,
    redact,
    split_urls,
)
from ._progress import Progress, make_progress
from ._report import build_report, draw_chart, print_report, write_json
from ._suite import FULL, QUICK, SECTIONS, Plan, Settings, run_suite

__all__ = (
    "FULL",
    "QUICK",
    "SECTIONS",
    "EmbeddedUnavailable",
    "Plan",
    "Progress",
    "Scrubber",
    "Servers",
    "Settings",
    "Unreachable",
    "UsageError",
    "check_url",
    "draw_chart",
    "embedded_servers",
    "make_progress",
    "print_report",
    "probe",
    "redact",
    "run",
    "split_urls",
    "write_json",
)


async def run(plan: Plan, progress: Progress) -> dict[str, Any]:
    """Check the servers answer, run the plan, and return the report (see ``write_json``).

    Raises :class:`Unreachable` when a server does not answer.
    """
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    started = time.perf_counter()
    await probe(plan.servers)
    runs = await run_suite(plan, progress)
    return build_report(plan, runs, started_at=started_at, seconds=time.perf_counter() - started)
