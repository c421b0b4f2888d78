"""A leader-elected scheduler: start it in several terminals, one of them schedules.

    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 python examples/scheduler.py   # terminal 1
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 python examples/scheduler.py   # terminal 2, 3…

Every process campaigns for the election ``scheduler``. The leader runs a job every
second, passing its term (a fencing token) to the job; the others wait, and print who
leads as it changes. Stop the leader (Ctrl-C resigns at once; ``kill -9`` or
``kill -STOP`` of its process is noticed within the TTL) and another one takes over.
``ASYNCLOCK_URL`` may also be a PostgreSQL DSN; with ``memory://`` (the default) it
runs in one process only, as a demonstration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import asynclock

URL = os.environ.get("ASYNCLOCK_URL", "memory://")
IDENTITY = f"{socket.gethostname()}:{os.getpid()}"


async def run_jobs(term: asynclock.Term) -> None:
    """What only the leader does; cancelled the moment leadership is lost."""
    print(f"[{IDENTITY}] leading, term {term.fence}")
    tick = 0
    while True:
        tick += 1
        # A real job would pass term.fence to the systems it writes to, which refuse
        # writes with a smaller fence than they have seen.
        print(f"[{IDENTITY}] job #{tick} under term {term.fence}")
        await asyncio.sleep(1.0)


async def watch(election: asynclock.Election) -> None:
    async for leader in election.observe():
        print(f"[{IDENTITY}] leader is now {leader or 'nobody'}")


async def main(rounds: int | None = None) -> None:
    async with asynclock.connect(URL) as coord:
        election = coord.election("scheduler", ttl=5.0, identity=IDENTITY)
        watcher = asyncio.create_task(watch(election))
        campaign = asyncio.create_task(election.run(run_jobs))
        try:
            if rounds is None:
                await campaign  # forever, until Ctrl-C
            else:  # a short demonstration, as the README's test runs it
                await asyncio.sleep(rounds)
        finally:
            for task in (campaign, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            main(
                int(os.environ["SCHEDULER_SECONDS"]) if "SCHEDULER_SECONDS" in os.environ else None
            )
        )
