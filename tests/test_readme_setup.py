"""What the README says about shared leases on Redis holds."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import asynclock

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


async def test_redis_grants_shared_leases_as_the_readme_says(asynclock_redis_url: str) -> None:
    """Redis grants two overlapping shared leases, and the README does not say it refuses."""
    assert not re.search(r"Redis rejects\s+`shared=True`", README)
    async with (
        asynclock.connect(asynclock_redis_url) as coord,
        coord.lock("readme:shared", shared=True),
    ):
        # Another task's (the same task taking it again would be a re-entry).
        second = await asyncio.create_task(
            coord.lock("readme:shared", shared=True, timeout=0).acquire()
        )
        assert second.fence > 0
        await second.release()
