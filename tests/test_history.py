"""The fenced history resource and its checker, on the shared Valkey server."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import pytest
from pytest_asynclock.history import (
    Ack,
    Entry,
    FencedLog,
    FenceRejected,
    Grant,
    Kind,
    check,
    check_grants,
    dump_acks,
    load_acks,
)
from pytest_asynclock.proxy import FaultProxy
from redis.asyncio import Redis

import asynclock
from asynclock import LockLost

from ._deadline import ends


@pytest.fixture
async def client(asynclock_redis_url: str) -> AsyncIterator[Redis]:
    """A client of the shared Valkey server for the fenced resource."""
    redis_client = Redis.from_url(asynclock_redis_url)
    yield redis_client
    await redis_client.aclose()


@pytest.fixture
async def log(client: Redis, namespace: str) -> AsyncIterator[FencedLog]:
    """A fenced log under keys unique to the test, deleted afterwards."""
    fenced = FencedLog(client, f"{namespace}:history")
    yield fenced
    await fenced.clear()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def raw_section(log: FencedLog, fence: int, holder: str, *ops: str) -> None:
    """A whole section through append() alone: start, ops, end."""
    await log.append(fence, holder, "", "start")
    for op in ops:
        await log.append(fence, holder, op, "op")
    await log.append(fence, holder, "", "end")


class TestFencedLog:
    async def test_append_accepts_equal_and_larger_fences(self, log: FencedLog) -> None:
        """Fences equal to or above the largest accepted are accepted; smaller ones are
        rejected, logged in server order and counted as stale."""
        first = await log.append(5, "a", "x")
        same = await log.append(5, "a", "y")
        bigger = await log.append(9, "b", "z")
        stale = await log.append(7, "a", "late")
        assert [first.accepted, same.accepted, bigger.accepted, stale.accepted] == [
            True,
            True,
            True,
            False,
        ]
        assert [ack.seq for ack in log.acknowledged] == [1, 2, 3, 4]
        entries = await log.read()
        assert [(e.seq, e.fence, e.op, e.accepted) for e in entries] == [
            (1, 5, "x", True),
            (2, 5, "y", True),
            (3, 9, "z", True),
            (4, 7, "late", False),
        ]
        assert all(e.server_time > 0 and e.time > 0 for e in entries)
        assert await log.counters() == {"fence": 9, "seq": 4, "accepted": 3, "stale": 1}

    async def test_large_fences_keep_every_digit(self, log: FencedLog) -> None:
        """A microsecond-clock fence (16 digits) is stored and compared exactly."""
        fence = 1_764_464_000_123_457
        assert (await log.append(fence, "a")).accepted
        assert not (await log.append(fence - 1, "b")).accepted
        assert (await log.read())[0].fence == fence
        assert (await log.counters())["fence"] == fence

    async def test_acks_round_trip_through_json(self, log: FencedLog) -> None:
        """acks_json()/load_acks() carry a process's acknowledgements unchanged."""
        async with log.section(3, "a") as section:
            await section.op("x")
        assert load_acks(log.acks_json()) == log.acknowledged
        assert load_acks(dump_acks([])) == []


class TestCorrectRuns:
    async def test_locked_run_passes(
        self, asynclock_redis_url: str, client: Redis, namespace: str
    ) -> None:
        """Holders that write only inside asynclock locks leave a history with no
        violations, nothing lost and nothing stale."""
        logs = [FencedLog(client, f"{namespace}:history") for _ in range(3)]
        coords = [asynclock.connect(asynclock_redis_url, prefix=namespace) for _ in range(3)]

        async def worker(coord: asynclock.Coordinator, log: FencedLog, holder: str) -> None:
            for round_ in range(5):
                async with (
                    coord.lock("resource", ttl=5) as lease,
                    log.section(lease.fence, holder) as section,
                ):
                    for i in range(3):
                        await section.op(f"{holder}:{round_}:{i}")
                        await asyncio.sleep(0)

        try:
            await asyncio.wait_for(
                asyncio.gather(
                    *(worker(coords[c], logs[c], f"c{c}w{w}") for c in range(3) for w in range(3))
                ),
                60,
            )
            report = check(await logs[0].read(), *(log.acknowledged for log in logs))
        finally:
            await logs[0].clear()
            for coord in coords:
                await coord.aclose()
        assert report.ok, str(report)
        assert report.sections == 45
        assert report.operations == 45 * 5
        assert report.accepted == report.operations
        assert report.acknowledged == report.operations
        assert (report.stale_rejected, report.unfinished) == (0, 0)
        assert report.violations == ()
        assert report.lost == ()
        assert report.fenced_off == ()
        assert report.summary().startswith("history OK: 225 operations")

    async def test_lease_lost_to_a_blackhole_stops_before_the_next_holder(
        self, asynclock_redis_url: str, log: FencedLog, namespace: str
    ) -> None:
        """A holder cut off by a black hole is cancelled before the next holder starts:
        the history stays exclusive, with one unfinished section."""
        loop = asyncio.get_running_loop()
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            cut_off = asynclock.connect(proxy.url_for(asynclock_redis_url), prefix=namespace)
            direct = asynclock.connect(asynclock_redis_url, prefix=namespace)
            writing = asyncio.Event()

            async def first() -> None:
                async with (
                    cut_off.lock("resource", ttl=1) as lease,
                    log.section(lease.fence, "first") as section,
                ):
                    # The resource is reached directly: only the lock server is cut off.
                    for i in range(1000):
                        await section.op(f"first:{i}")
                        writing.set()
                        await asyncio.sleep(0.01)

            try:
                holder = asyncio.create_task(first())
                await asyncio.wait_for(writing.wait(), 5)
                await asyncio.sleep(0.4)
                proxy.blackhole()
                began = loop.time()
                async with (
                    direct.lock("resource", ttl=1, timeout=5) as lease,
                    log.section(lease.fence, "second") as section,
                ):
                    await section.op("second:0")
                assert loop.time() - began < 2.0
                with pytest.raises(LockLost):
                    await ends(holder, "the cut-off holder's loss did not stop its body")
            finally:
                proxy.heal()
                await cut_off.aclose()
                await direct.aclose()
        report = check(await log.read(), log.acknowledged)
        assert report.ok, str(report)
        assert report.sections == 2
        assert report.unfinished == 1
        assert report.fenced_off == ()


class TestBrokenRuns:
    async def test_same_fence_without_a_lock_is_an_overlap(self, log: FencedLog) -> None:
        """Two holders writing interleaved sections under one fence, with no lock, are
        reported as overlapping."""

        async def holder(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            async with log.section(7, name) as section:
                await section.op(f"{name}:0")
                await asyncio.sleep(0.05)
                await section.op(f"{name}:1")

        await asyncio.gather(holder("a", 0.0), holder("b", 0.02))
        report = check(await log.read(), log.acknowledged)
        assert not report.ok
        assert {v.kind for v in report.violations} == {"overlap"}
        assert report.stale_rejected == 0
        assert report.lost == ()
        assert "overlap" in str(report)
        assert str(report).startswith("history VIOLATED")

    async def test_increasing_fences_without_a_lock_are_fenced_off(self, log: FencedLog) -> None:
        """A section begun with fence 1 and cut into by fence 2 has its later writes
        rejected: a fenced-off violation by default, allowed with exclusive=False."""

        async def holder(name: str, fence: int, delay: float) -> None:
            await asyncio.sleep(delay)
            async with log.section(fence, name) as section:
                await section.op(f"{name}:0")
                await asyncio.sleep(0.05)
                await section.op(f"{name}:1")

        results = await asyncio.gather(
            holder("a", 1, 0.0), holder("b", 2, 0.02), return_exceptions=True
        )
        assert isinstance(results[0], FenceRejected)
        assert results[1] is None
        entries = await log.read()
        strict = check(entries, log.acknowledged)
        assert not strict.ok
        assert {v.kind for v in strict.violations} == {"fenced-off"}
        assert strict.stale_rejected == 1
        lenient = check(entries, log.acknowledged, exclusive=False)
        assert lenient.ok, str(lenient)
        assert len(lenient.fenced_off) == 1
        assert lenient.unfinished == 1

    async def test_stale_holder_is_rejected_and_counted(
        self, asynclock_redis_url: str, log: FencedLog, namespace: str
    ) -> None:
        """A holder whose lease expired writes with its old fence after the next holder:
        the resource rejects it, the report counts it stale and stays clean."""
        async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
            old = await coord.lock("resource", ttl=0.3, renew=False).acquire()
            async with coord.lock("resource", ttl=5, timeout=5) as lease:
                assert lease.fence > old.fence
                await raw_section(log, lease.fence, "new", "new:0")
            assert old.lost
        with pytest.raises(FenceRejected, match="rejected"):
            async with log.section(old.fence, "old") as section:
                await section.op("old:0")
        report = check(await log.read(), log.acknowledged)
        assert report.ok, str(report)
        assert report.stale_rejected == 1
        assert report.sections == 1
        assert report.acknowledged == 4

    async def test_deleted_entry_is_lost(self, log: FencedLog, client: Redis) -> None:
        """An acknowledged entry removed from the resource is reported lost (and the hole
        in the sequence numbers as a gap)."""
        await raw_section(log, 1, "a", "a:0", "a:1")
        await raw_section(log, 2, "b", "b:0")
        victim = next(ack for ack in log.acknowledged if ack.op == "a:1")
        raw = await client.lrange(log.key, 0, -1)
        stored = next(item for item in raw if json.loads(item)["id"] == victim.id)
        assert await client.lrem(log.key, 1, _text(stored)) == 1
        report = check(await log.read(), log.acknowledged)
        assert not report.ok
        assert report.lost == (victim,)
        assert [v.kind for v in report.violations] == ["gap"]
        assert "a:1" in str(report)

    async def test_lost_fence_state_lets_fences_go_backwards(
        self, log: FencedLog, client: Redis
    ) -> None:
        """If the resource forgets its largest fence (a restart without persistence), a
        smaller fence is accepted again: reported as fences going backwards."""
        await raw_section(log, 100, "a", "a:0")
        await client.hdel(log.state_key, "fence")
        await raw_section(log, 50, "b", "b:0")
        report = check(await log.read(), log.acknowledged)
        kinds = {v.kind for v in report.violations}
        assert "fence-backwards" in kinds
        assert not report.ok

    async def test_an_entry_missing_at_the_end_with_no_acks_is_a_gap(
        self, log: FencedLog, client: Redis
    ) -> None:
        """The last entry removed and no acks to miss it: the resource's own count of
        writes still shows the hole (it used to pass as a shorter, clean history)."""
        await raw_section(log, 1, "a", "a:0")
        assert await client.rpop(log.key) is not None
        last = (await log.counters())["seq"]
        report = check(await log.read(), last_seq=last)
        assert [v.kind for v in report.violations] == ["gap"]
        assert "missing at the end" in str(report)
        assert check(await log.read()).ok  # without the count, nothing to tell

    async def test_a_start_only_section_cut_in_on_is_two_holders(self, log: FencedLog) -> None:
        """A holder writes its start believing its lease valid for 5 s and writes no more;
        another holder starts 0.1 s later: in the resource's order nothing interleaves,
        but two holders believed at once."""
        now = time.time()
        await log.append(1, "a", "", "start", state="held", valid_until=now + 5)
        await log.append(2, "b", "", "start", state="held", valid_until=now + 5)
        report = check(await log.read(), log.acknowledged)
        assert [v.kind for v in report.violations] == ["overlap-in-time"]
        # The same two sections one after the other are fine.
        await log.clear()
        await log.append(3, "a", "", "start", state="held", valid_until=time.time() + 0.01)
        await asyncio.sleep(0.05)
        await log.append(4, "b", "", "start", state="held", valid_until=time.time() + 5)
        assert check(await log.read()).ok

    async def test_a_belief_shortened_by_an_extend_counts_from_then(self, log: FencedLog) -> None:
        """A holder believes 5 s at its start, then (after an extend() to a shorter TTL)
        0.01 s at its next write; another holder starting 0.05 s later is no second
        believer: the latest belief counts, not the longest."""
        now = time.time()
        await log.append(1, "a", "", "start", state="held", valid_until=now + 5)
        await log.append(1, "a", "", "op", state="held", valid_until=time.time() + 0.01)
        await asyncio.sleep(0.05)
        await log.append(2, "b", "", "start", state="held", valid_until=time.time() + 5)
        assert check(await log.read(), log.acknowledged).ok

    async def test_a_writer_paused_between_deciding_and_sending_is_not_a_believer(
        self, log: FencedLog
    ) -> None:
        """A holds a short belief, decides to write, pauses; B is granted and writes; A's
        write then arrives: the fence's case (A is rejected), not two believers, since A
        decided before B began."""
        decided = time.time()
        await asyncio.sleep(0.05)
        await log.append(2, "b", "", "start", state="held", valid_until=time.time() + 5)
        await log.append(
            1, "a", "", "start", state="held", valid_until=decided + 0.01, decided=decided
        )
        assert check(await log.read(), log.acknowledged).ok

    async def test_a_write_accepted_after_a_loss_is_a_violation(self, log: FencedLog) -> None:
        """The writer knew its lease lost (or expired) and wrote anyway: a violation when
        the resource accepted it, counted either way."""
        await log.append(1, "a", "", "start", state="held", valid_until=time.time() + 0.01)
        await asyncio.sleep(0.05)
        await log.append(1, "a", "x", "op", state="expired", valid_until=time.time())
        await log.append(2, "b", "", "start", state="held", valid_until=time.time() + 1)
        await log.append(1, "a", "y", "op", state="lost", valid_until=time.time())  # rejected
        report = check(await log.read(), log.acknowledged, exclusive=False)
        assert [v.kind for v in report.violations] == ["write-after-loss"]
        assert report.writes_after_loss == 2

    def test_grants_with_repeated_or_smaller_fences(self) -> None:
        """Fences per name are unique and grow with the order of grants."""
        ok = [Grant("n", 1, "a", 0.0, 1.0, 1.0), Grant("n", 2, "b", 1.5, 2.0, 1.0)]
        assert check_grants(ok) == []
        again = [*ok, Grant("n", 2, "c", 3.0, 3.5, 1.0)]
        assert {v.kind for v in check_grants(again)} == {"fence-reused", "fence-backwards"}
        # c was granted 1000 before b even asked; b then got 2.
        back = [*ok, Grant("n", 1_000, "c", 0.5, 0.9, 1.0)]
        assert [v.kind for v in check_grants(back)] == ["fence-backwards"]
        other_name = [*ok, Grant("m", 1, "c", 3.0, 3.5, 1.0)]
        assert check_grants(other_name) == []


class TestAcrossProcesses:
    async def test_acks_from_other_processes_are_merged(
        self, asynclock_redis_url: str, log: FencedLog, client: Redis, namespace: str
    ) -> None:
        """Acks printed as JSON by two writer processes are merged by check(): a clean
        run passes, and an entry of one process removed afterwards is reported lost."""
        script = textwrap.dedent(
            """
            import asyncio, sys
            from redis.asyncio import Redis
            import asynclock
            from pytest_asynclock.history import FencedLog

            async def main(url, key, prefix, holder):
                client = Redis.from_url(url)
                log = FencedLog(client, key)
                async with asynclock.connect(url, prefix=prefix) as coord:
                    for i in range(5):
                        async with coord.lock("resource", ttl=5) as lease:
                            async with log.section(lease.fence, holder) as section:
                                await section.op(f"{holder}:{i}")
                await client.aclose()
                print(log.acks_json())

            asyncio.run(main(*sys.argv[1:5]))
            """
        )

        async def run(holder: str) -> list[Ack]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                script,
                asynclock_redis_url,
                log.key,
                namespace,
                holder,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            assert proc.returncode == 0, err.decode()
            return load_acks(out)

        acks = await asyncio.gather(run("p1"), run("p2"))
        entries = await log.read()
        report = check(entries, *acks)
        assert report.ok, str(report)
        assert report.sections == 10
        assert report.acknowledged == 30
        victim = acks[1][4]
        remaining = [entry for entry in entries if entry.id != victim.id]
        assert check(remaining, *acks).lost == (victim,)


def test_late_ok_excuses_a_late_write_but_not_an_entry_or_a_known_loss() -> None:
    """An ``op`` decided with the lease expired (its loop resumed the body late) is a
    violation by default, budgeted with ``late_ok``; a section entered with its lease
    expired, or a write decided once the loss was known, stays a violation."""

    def entry(seq: int, kind: Kind, state: str) -> Entry:
        return Entry(seq, f"e{seq}", 10, "A", "x", kind, True, time=100.0 + seq, state=state)

    late_op = [entry(1, "start", "held"), entry(2, "op", "expired"), entry(3, "end", "expired")]
    assert [v.kind for v in check(late_op).violations] == ["write-after-loss"] * 2
    report = check(late_op, late_ok=True)
    assert report.violations == ()
    assert report.late_writes == 2
    late_entry = [entry(1, "start", "expired"), entry(2, "end", "held")]
    assert [v.kind for v in check(late_entry, late_ok=True).violations] == ["write-after-loss"]
    known = [entry(1, "start", "held"), entry(2, "op", "lost")]
    assert [v.kind for v in check(known, late_ok=True).violations] == ["write-after-loss"]
