"""An arq worker whose job runs once at a time per day, however often it is enqueued.

    cd examples
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 arq arq_worker.WorkerSettings   # a worker, or two
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 python arq_worker.py            # enqueue 5 at once

The five jobs have the same argument: one builds the report (for three seconds, longer
than nothing but shorter than its lease, which is renewed anyway), the other four find
its lock held and are skipped (their result is None). Enqueue again once it is done and
it runs again. ``ASYNCLOCK_URL`` is both arq's queue and the lock server here; the locks
may live elsewhere (any URL ``asynclock.connect`` takes). Needs
``pip install 'asynclock[arq]'``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from arq.connections import RedisSettings, create_pool  # type: ignore[import-not-found,unused-ignore]

import asynclock
from asynclock.integrations import arq as locks

URL = os.environ.get("ASYNCLOCK_URL", "redis://127.0.0.1:6379/0")
#: How long a report takes to build.
BUILD_SECONDS = float(os.environ.get("REPORT_SECONDS", "3"))


@locks.singleton("report:{day}", ttl=30)
async def build_report(ctx: dict[str, Any], day: str) -> str:
    """Build ``day``'s report, unless another run is building it (then: None)."""
    lease: asynclock.Lease = ctx[locks.LEASE]
    await asyncio.sleep(BUILD_SECONDS)  # pass lease.fence to what the job writes
    return f"report {day} built under fence {lease.fence}"


async def startup(ctx: dict[str, Any]) -> None:
    """The worker's coordinator, in ``ctx``."""
    await locks.startup(ctx, URL)


async def shutdown(ctx: dict[str, Any]) -> None:
    """Close it (its leases released)."""
    await locks.shutdown(ctx)


class WorkerSettings:
    """``arq arq_worker.WorkerSettings``."""

    functions = (build_report,)
    on_startup = startup
    on_shutdown = shutdown
    redis_settings = RedisSettings.from_dsn(URL)


async def main() -> None:
    """Enqueue the same job five times at once and print what became of each."""
    redis = await create_pool(WorkerSettings.redis_settings)
    try:
        jobs = await asyncio.gather(
            *(redis.enqueue_job("build_report", "2026-12-04") for _ in range(5))
        )
        for job in jobs:
            if job is None:  # arq's answer to a _job_id already queued; not here
                continue
            result = await job.result(timeout=60)
            print(f"{job.job_id}: {result or 'skipped: another run was building it'}")
    finally:
        await redis.aclose()


if __name__ == "__main__":
    asyncio.run(main())
