"""The contract every backend keeps, run against each one (real Valkey, memory)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

import asynclock
from asynclock import Backoff, LockNotOwned, LockTimeout
from asynclock._validate import MAX_NAME_BYTES

from .conftest import MakeCoord, eventually, interrupted_aclose


class TestMutualExclusion:
    async def test_read_sleep_write_under_one_lock(self, make_coord: MakeCoord) -> None:
        """50 tasks on 3 coordinators doing read-sleep-write: 500 increments, none lost."""
        coords = [make_coord() for _ in range(3)]
        shared = {"value": 0, "inside": 0, "most_inside": 0}

        async def worker(i: int) -> None:
            coord = coords[i % 3]
            for _ in range(10):
                async with coord.lock("counter", ttl=10):
                    shared["inside"] += 1
                    shared["most_inside"] = max(shared["most_inside"], shared["inside"])
                    value = shared["value"]
                    await asyncio.sleep(0.001)  # everyone else runs between read and write
                    shared["value"] = value + 1
                    shared["inside"] -= 1

        await asyncio.gather(*(worker(i) for i in range(50)))
        assert shared["value"] == 500
        assert shared["most_inside"] == 1

    async def test_second_acquire_waits_for_release(self, make_coord: MakeCoord) -> None:
        """A second coordinator cannot take a held lock until the holder releases it."""
        a, b = make_coord(), make_coord()
        lease = await a.lock("x", ttl=10).acquire()
        with pytest.raises(LockTimeout):
            await b.lock("x", ttl=10, timeout=0).acquire()
        await lease.release()
        second = await b.lock("x", ttl=10, timeout=0).acquire()
        await second.release()


class TestFences:
    async def test_fences_strictly_increase_across_holders(self, make_coord: MakeCoord) -> None:
        """Every new holder, on any coordinator, gets a larger fence."""
        coords = [make_coord() for _ in range(3)]
        fences = []
        for i in range(30):
            async with coords[i % 3].lock("fenced", ttl=5) as lease:
                fences.append(lease.fence)
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)

    async def test_fence_increases_after_expiry_takeover(self, make_coord: MakeCoord) -> None:
        """A holder whose lease expired is followed by one with a larger fence."""
        a, b = make_coord(), make_coord()
        first = await a.lock("exp", ttl=0.2, renew=False).acquire()
        second = await b.lock("exp", ttl=5, timeout=3).acquire()
        assert second.fence > first.fence
        assert first.lost
        info = await b.inspect("exp")
        assert info is not None
        assert info.fence == second.fence
        await second.release()

    async def test_concurrent_fences_are_unique(self, make_coord: MakeCoord) -> None:
        """Contending tasks each get a distinct fence, increasing in the order they held."""
        coord = make_coord()
        order: list[int] = []

        async def take() -> None:
            async with coord.lock("many", ttl=5) as lease:
                order.append(lease.fence)

        await asyncio.gather(*(take() for _ in range(20)))
        assert order == sorted(order)
        assert len(set(order)) == 20


class TestTimeouts:
    async def test_timeout_zero_tries_once(self, make_coord: MakeCoord) -> None:
        """timeout=0 fails at once with LockTimeout, which is also a TimeoutError."""
        a, b = make_coord(), make_coord()
        async with a.lock("t0", ttl=5):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await b.lock("t0", timeout=0).acquire()
            assert time.monotonic() - started < 1.0

    async def test_timeout_bounds_the_wait(self, make_coord: MakeCoord) -> None:
        """timeout=0.3 gives up after about 0.3 s, not before, not much later."""
        a, b = make_coord(), make_coord()
        async with a.lock("tw", ttl=5):
            started = time.monotonic()
            with pytest.raises(LockTimeout):
                await b.lock("tw", timeout=0.3).acquire()
            waited = time.monotonic() - started
        assert 0.29 <= waited < 1.5

    async def test_a_tiny_timeout_is_as_patient_as_zero(self, make_coord: MakeCoord) -> None:
        """A positive timeout, however small, makes the first attempt and waits for its
        answer: a free lock is granted with timeout=1e-5 as it is with timeout=0."""
        coord = make_coord()
        for timeout in (1e-5, 1e-4, 1e-3) * 4:
            async with coord.lock("tiny", ttl=5, timeout=timeout) as lease:
                assert lease.held
        other = make_coord()
        async with other.lock("tiny", ttl=5):
            with pytest.raises(LockTimeout, match="not acquired within"):
                await coord.lock("tiny", ttl=5, timeout=1e-5).acquire()

    async def test_none_waits_until_released(self, make_coord: MakeCoord) -> None:
        """timeout=None waits as long as it takes."""
        a, b = make_coord(), make_coord()
        lease = await a.lock("tn", ttl=5).acquire()
        waiter = asyncio.create_task(b.lock("tn", ttl=5).acquire())
        await asyncio.sleep(0.3)
        assert not waiter.done()
        await lease.release()
        second = await asyncio.wait_for(waiter, 5)
        assert second.fence > lease.fence
        await second.release()


class TestHandOff:
    async def test_wake_up_not_backoff(self, make_coord: MakeCoord) -> None:
        """With a backoff of seconds, a waiter acquires within milliseconds of the release
        (bounded at 1 s for a loaded machine: its backoff would take 5 s)."""
        a, b = make_coord(), make_coord()
        slow = Backoff(initial=5.0, maximum=10.0, jitter=False)
        lease = await a.lock("handoff", ttl=30).acquire()
        acquired_at: list[float] = []

        async def wait() -> None:
            got = await b.lock("handoff", ttl=30, retry=slow).acquire()
            acquired_at.append(time.monotonic())
            await got.release()

        waiter = asyncio.create_task(wait())
        await asyncio.sleep(0.2)  # the waiter has tried, failed and gone to sleep
        released_at = time.monotonic()
        await lease.release()
        await asyncio.wait_for(waiter, 5)
        assert acquired_at[0] - released_at < 1.0

    async def test_waiter_follows_expiry(self, make_coord: MakeCoord) -> None:
        """A holder that vanishes without releasing is followed when its TTL runs out."""
        a, b = make_coord(), make_coord()
        gone = await a.lock("vanish", ttl=0.3, renew=False).acquire()
        started = time.monotonic()
        got = await b.lock("vanish", ttl=5, timeout=5, retry=Backoff(5.0, 10.0)).acquire()
        assert time.monotonic() - started < 1.0
        assert got.fence > gone.fence
        await got.release()


class TestOwnership:
    async def test_stale_release_and_extend_raise_not_owned(self, make_coord: MakeCoord) -> None:
        """An expired holder cannot release or extend the new holder's lock."""
        a, b = make_coord(), make_coord()
        stale = await a.lock("own", ttl=0.2, renew=False).acquire()
        fresh = await b.lock("own", ttl=30, timeout=3).acquire()
        with pytest.raises(LockNotOwned):
            await stale.extend()
        with pytest.raises(LockNotOwned):
            await stale.release()
        info = await b.inspect("own")
        assert info is not None
        assert info.fence == fresh.fence
        assert info.owner == b.identity
        assert info.expires_in > 25
        await fresh.release()

    async def test_stale_release_spares_a_newer_lease_of_the_same_coordinator(
        self, coord: asynclock.Coordinator
    ) -> None:
        """Release compares this acquisition's token, not the coordinator's identity."""
        stale = await coord.lock("same", ttl=0.2, renew=False).acquire()
        fresh = await coord.lock("same", ttl=30, timeout=3).acquire()
        with pytest.raises(LockNotOwned):
            await stale.release()
        assert fresh.held
        info = await coord.inspect("same")
        assert info is not None
        assert info.fence == fresh.fence
        await fresh.release()

    async def test_one_lock_object_shared_by_tasks(self, coord: asynclock.Coordinator) -> None:
        """One Lock used by many tasks: each gets its own lease, one at a time."""
        lock = coord.lock("shared-object", ttl=10)
        inside: list[int] = []
        fences: list[int] = []

        async def use() -> None:
            async with lock as lease:
                inside.append(1)
                assert len(inside) == 1
                fences.append(lease.fence)
                await asyncio.sleep(0.001)
                inside.pop()

        await asyncio.gather(*(use() for _ in range(10)))
        assert len(set(fences)) == 10
        assert not await coord.is_locked("shared-object")

    async def test_double_release_raises_not_owned(self, coord: asynclock.Coordinator) -> None:
        """A released lease cannot be released or extended again."""
        lease = await coord.lock("twice").acquire()
        await lease.release()
        with pytest.raises(LockNotOwned):
            await lease.release()
        with pytest.raises(LockNotOwned):
            await lease.extend()

    async def test_extend_resets_validity(self, coord: asynclock.Coordinator) -> None:
        """extend(ttl) gives the lease that many seconds from now, here and on the server."""
        lease = await coord.lock("ext", ttl=2, renew=False).acquire()
        await lease.extend(20)
        assert lease.ttl == 20
        assert 19 < lease.expires_in <= 20
        info = await coord.inspect("ext")
        assert info is not None
        assert 19 < info.expires_in <= 20
        await lease.release()

    async def test_tokens_are_random_per_acquisition(self, coord: asynclock.Coordinator) -> None:
        """Each acquisition writes its own 128-bit token."""
        tokens = set()
        for _ in range(5):
            async with coord.lock("tok") as lease:
                assert len(lease.token) == 32
                tokens.add(lease.token)
        assert len(tokens) == 5


class TestInspect:
    async def test_inspect_free_and_held(self, make_coord: MakeCoord) -> None:
        """inspect() and is_locked() report the holder, its TTL and fence."""
        a, b = make_coord(identity="worker-a"), make_coord()
        assert await b.inspect("ins") is None
        assert not await b.is_locked("ins")
        async with a.lock("ins", ttl=10) as lease:
            info = await b.inspect("ins")
            assert info is not None
            assert info.name == "ins"
            assert info.owner == "worker-a"
            assert info.fence == lease.fence
            assert 9 < info.expires_in <= 10
            assert await b.is_locked("ins")
        assert not await b.is_locked("ins")


class TestCancellation:
    async def test_cancelled_holder_releases_at_once(self, make_coord: MakeCoord) -> None:
        """Cancelling a task inside the lock frees the lock now, not at TTL."""
        a, b = make_coord(), make_coord()
        entered = asyncio.Event()

        async def hold() -> None:
            async with a.lock("cancel-holder", ttl=30):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(hold())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not await b.is_locked("cancel-holder")
        assert a.held == []

    async def test_cancelled_waiter_leaves_nothing(self, make_coord: MakeCoord) -> None:
        """A waiter cancelled while waiting holds nothing and leaves no task behind."""
        a, b = make_coord(), make_coord()
        lease = await a.lock("cancel-waiter", ttl=30).acquire()
        before = asyncio.all_tasks()
        waiter = asyncio.create_task(b.lock("cancel-waiter", ttl=30).acquire())
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # Clean-up that a cancel starts (a PostgreSQL cancel request, the release of a
        # grant that may have raced the cancel) finishes on its own, quickly.
        assert await eventually(lambda: asyncio.all_tasks() <= before), [
            t.get_coro() for t in asyncio.all_tasks() - before
        ]
        assert b.held == []
        await lease.release()
        assert not await a.is_locked("cancel-waiter")

    async def test_cancel_racing_the_grant_leaves_no_lock(self, make_coord: MakeCoord) -> None:
        """Acquires cancelled at every point of their first attempt never leave a lock held."""
        coord, observer = make_coord(), make_coord()
        for delay in (0, 0, 0.0001, 0.0003, 0.001, 0.002):
            task = asyncio.create_task(coord.lock("race", ttl=30).acquire())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                lease = await task
            except asyncio.CancelledError:
                pass
            else:
                await lease.release()
            for _ in range(300):
                if not await observer.is_locked("race"):
                    break
                await asyncio.sleep(0.01)
            holder = await observer.inspect("race")
            assert holder is None, (
                f"cancelled after {delay}s: {holder}, tasks {coord._engine.tasks}"
            )


class TestClose:
    async def test_aclose_inside_a_leases_own_body(self, make_coord: MakeCoord) -> None:
        """A body that closes its own coordinator is not cancelled by that close: its
        lease ends released, its block ends without LockLost, and the lock is free."""
        coord, observer = make_coord(), make_coord()
        async with coord.lock("own", ttl=30) as lease:
            await coord.aclose()
            assert not lease.held
            assert not lease.lost
        assert await observer.inspect("own") is None
        assert coord.stats().losses == 0

    @pytest.mark.parametrize("steps", [0, 1, 2, 3, 5])
    async def test_an_interrupted_aclose_is_finished(
        self, make_coord: MakeCoord, steps: int
    ) -> None:
        """An aclose() cancelled part-way goes on to its end (the lease given back, the
        backend closed), and a second aclose() waits for it rather than returning at once
        with the backend still open."""
        coord, observer = make_coord(), make_coord()
        lease = await coord.lock("closing", ttl=30).acquire()
        await interrupted_aclose(coord, steps)
        await coord.aclose()
        assert not lease.held
        assert await observer.inspect("closing") is None

    async def test_aclose_wakes_waiting_acquires(self, make_coord: MakeCoord) -> None:
        """Closing a coordinator ends its waiting acquires at once, holding nothing."""
        a, b = make_coord(), make_coord()
        lease = await a.lock("closing", ttl=30).acquire()
        waiter = asyncio.create_task(b.lock("closing", ttl=30, retry=Backoff(5.0, 10.0)).acquire())
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await b.aclose()
        with pytest.raises(asynclock.CoordinatorClosed, match="closed"):
            await waiter
        assert time.monotonic() - started < 1.0
        assert lease.held
        await lease.release()

    async def test_an_acquire_in_flight_at_close_leaves_nothing(
        self, make_coord: MakeCoord
    ) -> None:
        """aclose() while an acquire is on its way: the acquire raises CoordinatorClosed
        (or, where it had finished, its lease is ended), nothing is renewed, and the
        server frees the name by the TTL at the latest."""
        a, observer = make_coord(), make_coord()
        acquiring = asyncio.create_task(a.lock("in-flight", ttl=1.0).acquire())
        await asyncio.sleep(0)
        await a.aclose()
        try:
            lease = await acquiring
        except asynclock.CoordinatorClosed:
            pass
        else:
            assert not lease.held
        assert a.held == []
        await asyncio.sleep(1.3)  # past the TTL: a lease renewed behind our back survives
        assert not await observer.is_locked("in-flight")


class TestBadInput:
    @pytest.mark.parametrize("ttl", [0, -1, -0.5, math.nan, math.inf, -math.inf, 0.0001])
    async def test_bad_ttl_is_value_error(self, coord: asynclock.Coordinator, ttl: float) -> None:
        """ttl must be finite and positive (at least 1 ms)."""
        with pytest.raises(ValueError, match="ttl"):
            coord.lock("x", ttl=ttl)

    @pytest.mark.parametrize("ttl", [0.001, 0.002, 0.0021, 0.003])
    async def test_ttl_within_the_drift_allowance_is_value_error(
        self, coord: asynclock.Coordinator, ttl: float
    ) -> None:
        """A lease of 1-3 ms keeps less than 1 ms of local validity after the default
        drift allowance (2 ms + 1 %): every grant would be given back and a waiting
        acquire retried forever, thousands of times a second."""
        with pytest.raises(ValueError, match="local validity"):
            coord.lock("x", ttl=ttl)
        with pytest.raises(ValueError, match="local validity"):
            coord.election("x", ttl=ttl)
        coord.lock("x", ttl=0.0031)  # 1.03 ms of validity: allowed
        async with coord.lock("y", ttl=30) as lease:
            with pytest.raises(ValueError, match="local validity"):
                await lease.extend(ttl)

    @pytest.mark.parametrize("ttl", ["10", None, True, [1]])
    async def test_ttl_of_wrong_type_is_type_error(
        self, coord: asynclock.Coordinator, ttl: object
    ) -> None:
        """A ttl that is not a number is a TypeError."""
        with pytest.raises(TypeError, match="ttl"):
            coord.lock("x", ttl=ttl)  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad", [-1, math.nan, math.inf])
    async def test_bad_timeout(self, coord: asynclock.Coordinator, bad: float) -> None:
        """timeout must be None or a finite number >= 0."""
        with pytest.raises(ValueError, match="timeout"):
            coord.lock("x", timeout=bad)

    async def test_bad_names(self, coord: asynclock.Coordinator) -> None:
        """Names must be non-empty str of at most MAX_NAME_BYTES UTF-8 bytes."""
        with pytest.raises(ValueError, match="empty"):
            coord.lock("")
        with pytest.raises(TypeError, match="str"):
            coord.lock(b"bytes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="str"):
            coord.lock(42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bytes"):
            coord.lock("x" * (MAX_NAME_BYTES + 1))
        with pytest.raises(ValueError, match="bytes"):
            coord.lock("é" * (MAX_NAME_BYTES // 2 + 1))  # 2 bytes each in UTF-8
        with pytest.raises(ValueError, match="UTF-8"):
            coord.lock("\ud800")
        with pytest.raises(TypeError, match="str"):
            await coord.inspect(None)  # type: ignore[arg-type]
        coord.lock("x" * MAX_NAME_BYTES)  # the limit itself is fine

    async def test_bad_options(self, coord: asynclock.Coordinator) -> None:
        """Flags must be bools and retry a Backoff."""
        with pytest.raises(TypeError, match="renew"):
            coord.lock("x", renew="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="retry"):
            coord.lock("x", retry=0.1)  # type: ignore[arg-type]

    async def test_long_unicode_name_round_trips(self, coord: asynclock.Coordinator) -> None:
        """A name at the byte limit, with multi-byte characters and braces, works."""
        name = "{ключ}:" + "界" * ((MAX_NAME_BYTES - 20) // 3)
        async with coord.lock(name) as lease:
            info = await coord.inspect(name)
            assert info is not None
            assert info.fence == lease.fence
