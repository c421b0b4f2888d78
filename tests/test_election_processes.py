"""Five real processes campaigning on Redis and on PostgreSQL: one leader at a time,
fast replacement after kill -9, and a frozen leader that acts as no leader once it
resumes (its writes are refused by the term fence)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TTL = 1.5


@dataclass
class Candidate:
    index: int
    process: asyncio.subprocess.Process
    events: list[tuple[str, int, int, float]] = field(default_factory=list)

    async def read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            words = raw.decode().split()
            if words[0] == "write":
                self.events.append(("write", int(words[1]), int(words[2]), float(words[3])))
            else:
                self.events.append((words[0], int(words[1]), 0, float(words[2])))

    def intervals(self) -> list[tuple[float, float, int]]:
        """(start, end, term) of each leadership as the process saw it."""
        out: list[tuple[float, float, int]] = []
        start: tuple[float, int] | None = None
        for kind, term, _, at in self.events:
            if kind == "lead":
                start = (at, term)
            elif kind == "stop" and start is not None:
                out.append((start[0], at, start[1]))
                start = None
        if start is not None:
            out.append((start[0], float("inf"), start[1]))
        return out

    def first(self, kind: str, after: float) -> tuple[str, int, int, float] | None:
        return next((e for e in self.events if e[0] == kind and e[3] > after), None)


async def leads_after(candidates: list[Candidate], after: float, within: float) -> Candidate:
    """The candidate that starts leading after ``after``, waiting up to ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for candidate in candidates:
            if candidate.first("lead", after) is not None:
                return candidate
        await asyncio.sleep(0.01)
    raise AssertionError(f"no new leader within {within}s")


def current_leader(candidates: list[Candidate]) -> Candidate:
    """The live candidate whose last leadership has not ended."""
    leading = [
        c
        for c in candidates
        if c.process.returncode is None and c.intervals() and c.intervals()[-1][1] == float("inf")
    ]
    assert len(leading) == 1, [c.index for c in leading]
    return leading[0]


async def campaign(url: str, resource_url: str) -> None:
    name = f"proc-{uuid.uuid4().hex[:8]}"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests._campaigner",
            url,
            name,
            f"candidate-{i}",
            str(TTL),
            resource_url,
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        for i in range(5)
    ]
    candidates = [Candidate(i, p) for i, p in enumerate(procs)]
    readers = [asyncio.create_task(c.read()) for c in candidates]
    try:
        began = time.monotonic()
        first = await leads_after(candidates, 0, within=20)
        await asyncio.sleep(1.5)
        steady_until = time.monotonic()

        # kill -9 of the leader: another leads within ttl + 1 s.
        killed = current_leader(candidates)
        # The time of the kill, not of its reaping: another candidate may take over
        # before process.wait() returns.
        killed_at = time.monotonic()
        killed.process.kill()
        await killed.process.wait()
        second = await leads_after(candidates, killed_at, within=TTL + 1)
        lead_event = second.first("lead", killed_at)
        assert lead_event is not None
        assert lead_event[3] - killed_at <= TTL + 1

        # SIGSTOP of the leader: another leads within ttl + 1 s; resumed, the old one's
        # callback is cancelled and whatever it still writes is refused by the fence.
        await asyncio.sleep(0.5)
        frozen = current_leader(candidates)
        frozen_at = time.monotonic()
        os.kill(frozen.process.pid, signal.SIGSTOP)
        third = await leads_after(candidates, frozen_at, within=TTL + 1)
        assert third is not frozen
        await asyncio.sleep(0.3)  # the new leader has written its term
        os.kill(frozen.process.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        for _ in range(300):
            if frozen.first("stop", frozen_at) is not None:
                break
            await asyncio.sleep(0.01)
        stop = frozen.first("stop", frozen_at)
        assert stop is not None, (
            f"the resumed leader's callback was not cancelled: {frozen.events[-5:]}, "
            f"resumed at {resumed_at}, alive: {frozen.process.returncode is None}"
        )
        assert stop[3] - resumed_at < 1.0
        # Whatever it sends once resumed is refused: the new leader has written since.
        # (A write sent just before the stop may still be accepted, answered after it.)
        late_writes = [e for e in frozen.events if e[0] == "write" and e[3] > resumed_at]
        assert all(accepted == 0 for _, _, accepted, _ in late_writes), late_writes
        await asyncio.sleep(0.3)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        for proc in procs:
            await proc.wait()
        for reader in readers:
            await reader

    # One leader at every sampled instant (the frozen one excepted while it was frozen:
    # it believed it led, and the fence is what kept it harmless).
    end = time.monotonic()
    t = began
    while t < end:
        leading = [
            c.index
            for c in candidates
            for start, stop_at, _ in c.intervals()
            if start <= t < stop_at and not (c is frozen and t >= frozen_at)
            and not (c is killed and t >= killed_at)
        ]  # fmt: skip
        assert len(leading) <= 1, (t - began, leading)
        if first.events[0][3] <= t < steady_until and t > first.first("lead", 0)[3]:  # type: ignore[index]
            assert len(leading) == 1, (t - began, leading)
        t += 0.02
    # The fenced resource only ever accepted growing terms.
    accepted = sorted(
        (at, term) for c in candidates for kind, term, ok, at in c.events if kind == "write" and ok
    )
    assert [term for _, term in accepted] == sorted(term for _, term in accepted)


class TestFiveProcesses:
    @pytest.mark.timeout(90)
    async def test_on_redis(self, asynclock_redis_url: str) -> None:
        """Five processes on Redis: one leader, kill -9 and SIGSTOP handled."""
        await campaign(asynclock_redis_url, asynclock_redis_url)

    @pytest.mark.timeout(90)
    async def test_on_postgres(self, asynclock_postgres_dsn: str, asynclock_redis_url: str) -> None:
        """Five processes on PostgreSQL: one leader, kill -9 and SIGSTOP handled."""
        await campaign(asynclock_postgres_dsn, asynclock_redis_url)
