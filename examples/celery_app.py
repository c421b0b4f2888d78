"""Celery with asynclock: a report job that runs once at a time per day, on any number of
workers, and writes with its fence.

    pip install 'asynclock[celery]'
    # one worker or several (on several machines: a day's report still runs once at a time)
    celery -A examples.celery_app worker --loglevel=INFO
    # send one day's job five times at once: one run, four skipped (None)
    python -m examples.celery_app 2026-12-04

The lock is taken when a task runs: the sends that reach a worker while the day's run
holds it are skipped. A single-slot worker (``--concurrency=1``, ``--pool=solo``) takes
them one after the other instead, and each runs.

``ASYNCLOCK_URL`` (default ``redis://127.0.0.1:6379/0``) is the broker, the result backend
and the lock server here; they may be three servers. While a run works, its lease is
renewed; if its worker dies (``kill -9``), the next send of that day's job runs within
``lock_ttl`` seconds. The run passes its fence to the report store, which refuses a write
older than the last one it took: a run whose lease was lost (its worker froze past the
TTL while another run took over) cannot overwrite the newer report.
"""

from __future__ import annotations

import os
import sys
import time

import redis
from celery import Celery  # type: ignore[import-untyped,unused-ignore]

from asynclock.integrations.celery import SingletonTask

URL = os.environ.get("ASYNCLOCK_URL", "redis://127.0.0.1:6379/0")

app = Celery("reports", broker=URL, backend=URL)
app.conf.asynclock_url = URL  # the lock server
app.conf.broker_connection_retry_on_startup = True

# The report store: a write is refused when a greater fence has written already.
_store = redis.Redis.from_url(URL)
_fenced_set = _store.register_script(
    """
    local last = tonumber(redis.call('GET', KEYS[2]) or '0')
    if tonumber(ARGV[2]) < last then return 0 end
    redis.call('SET', KEYS[2], ARGV[2])
    redis.call('SET', KEYS[1], ARGV[1])
    return 1
    """
)


def save_report(day: str, text: str, *, fence: int) -> bool:
    """Store ``day``'s report, unless a newer run (a greater fence) stored one."""
    return bool(_fenced_set(keys=[f"reports:{day}", f"reports:{day}:fence"], args=[text, fence]))


@app.task(  # type: ignore[untyped-decorator]  # Celery has no type hints
    name="reports.build",
    base=SingletonTask,
    bind=True,
    lock_name="report:{day}",  # one run at a time per day
    lock_ttl=30,  # renewed every 10 s while the run works
    on_held="skip",  # a send that finds the day's run under way returns None
)
def build_report(self: SingletonTask, day: str) -> dict[str, object]:
    """Build ``day``'s report in steps, then store it under this run's fence."""
    for _ in range(3):
        time.sleep(1.0)  # a step of the real work
        self.lease.check()  # LockLost if the lease was lost: stop before writing
    saved = save_report(day, f"report for {day}", fence=self.lease.fence)
    return {"day": day, "fence": self.lease.fence, "saved": saved}


def main() -> None:
    """Send one day's job five times at once and print what each send returned."""
    day = sys.argv[1] if len(sys.argv) > 1 else "2026-12-04"
    sent = [build_report.delay(day) for _ in range(5)]
    for result in sent:
        print(result.get(timeout=60))  # one run's dict; None for each send it skipped


if __name__ == "__main__":
    main()
