"""Redis wake-ups: who a release (or an expiry) wakes, against real Valkey nodes.

Waiters here sleep on a long backoff without jitter, so that only a wake-up can get them
the lock within the bounds the tests use.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
from pytest_asynclock import ClusterSetup, SentinelSetup
from redis.asyncio import Redis

import asynclock
from asynclock import BackendError, Backoff, Lease, LockTimeout
from asynclock._wakeup import WakeHub
from asynclock.backends import Claim, RedisBackend
from asynclock.backends.base import Attempt
from asynclock.backends.redis import Keys

from .conftest import eventually, redis_backend

# A backoff step no test waits for: a waiter that gets the lock sooner was woken.
SLEEPY = Backoff(initial=30.0, maximum=30.0, jitter=False)
# How long a test waits for something a wake-up does at once: far below SLEEPY's step.
WOKEN_WITHIN = 15.0


def _count_attempts(backend: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The loop time of each ``try_acquire`` of ``backend`` from now on."""
    attempts: list[float] = []
    real = backend.try_acquire
    loop = asyncio.get_running_loop()

    async def counting(claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        attempts.append(loop.time())
        return await real(claim, ttl, wait=wait)

    monkeypatch.setattr(backend, "try_acquire", counting)
    return attempts


async def _until_lapsed(backend: RedisBackend, keys: Keys, values: list[str]) -> None:
    """Wait until the queue places of ``values`` lapsed by the server's clock."""
    client: Any = backend.client

    async def lapsed() -> bool:
        seconds, micros = await client.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        dues = await client.hmget(keys.due, values)
        return all(due is not None and int(due.split(b":")[0]) < now for due in dues)

    async with asyncio.timeout(10):
        # The server's clock has no event to wait on.
        while not await lapsed():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def handed_over(
    holder: Lease, *, cancelled: asyncio.Task[Lease], woken: asyncio.Task[Lease]
) -> None:
    """One waiter gives up, the holder releases: the other waiter is granted by that
    release's wake-up (within WOKEN_WITHIN, far below its backoff)."""
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await holder.release()
    async with asyncio.timeout(WOKEN_WITHIN):
        lease = await woken
    await lease.release()


class TestDeadPlaces:
    @pytest.mark.parametrize("fair", [False, True])
    async def test_a_release_wakes_the_live_waiter_behind_40_dead_places(
        self,
        asynclock_redis_url: str,
        namespace: str,
        monkeypatch: pytest.MonkeyPatch,
        fair: bool,
    ) -> None:
        """40 places of a process that died while waiting lead the queue, a live waiter
        is behind them: once the 40 lapsed, a release wakes the live waiter. (The release
        dropped at most 16 lapsed places and then woke nobody: the waiter got the lock
        from its backoff timer only.)"""
        async with (
            asynclock.connect(asynclock_redis_url, prefix=namespace) as coord,
            asynclock.connect(asynclock_redis_url, prefix=namespace) as killed,
        ):
            backend = redis_backend(coord)
            holder = await coord.lock("n", ttl=60, fair=fair).acquire()
            # The killed process: its waiters queued (the place kept 1 s, the margin of a
            # backoff of 0) and never left; its connection is gone.
            dead = redis_backend(killed)
            keys = dead.keys("n")
            values = [f"dead{i}:killed" for i in range(40)]
            for value in values:
                call = (dead.calls.fair if fair else dead.calls.acquire)(keys, value, 60, queue=0.0)
                assert int(await dead.run(call)) <= 0
            await killed.aclose()
            attempts = _count_attempts(backend, monkeypatch)
            waiter = asyncio.create_task(coord.lock("n", ttl=60, fair=fair, retry=SLEEPY).acquire())
            # Its first attempt queued it, its second (once subscribed) sent it to sleep.
            assert await eventually(lambda: len(attempts) == 2 and backend.waiting("n") == 1, 10)
            await _until_lapsed(backend, keys, values)
            await holder.release()
            async with asyncio.timeout(WOKEN_WITHIN):
                lease = await waiter
            await lease.release()


class TestSilentExpiry:
    @pytest.mark.parametrize("fair", [False, True])
    async def test_the_first_waiter_alone_comes_back_when_a_dead_holder_expires(
        self,
        asynclock_redis_url: str,
        namespace: str,
        monkeypatch: pytest.MonkeyPatch,
        fair: bool,
    ) -> None:
        """A holder that dies publishes nothing; its lease just ends. Of 50 waiters only
        the first tries then (each other one wakes when the one before it releases),
        not all 50 within a millisecond of the expiry."""
        async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
            backend = redis_backend(coord)
            keys = backend.keys("n")
            # The dead holder: granted, never renewed nor released.
            # Long enough for 100 attempts on a loaded machine before it expires.
            assert await backend.acquire_keys(keys, "holder:dead", 8.0) > 0
            attempts = _count_attempts(backend, monkeypatch)
            inside = asyncio.Event()
            leave = asyncio.Event()
            done: list[int] = []

            async def waiter(i: int) -> None:
                async with coord.lock("n", ttl=30, fair=fair, retry=SLEEPY):
                    inside.set()
                    await leave.wait()
                    done.append(i)

            tasks = [asyncio.create_task(waiter(i)) for i in range(50)]
            try:
                # Every waiter tried twice (queued, then subscribed) and sleeps.
                assert await eventually(lambda: len(attempts) >= 100, 10)
                assert await backend.client.pttl(keys.lock) > 0, "too slow: expired already"
                asleep = len(attempts)
                async with asyncio.timeout(WOKEN_WITHIN):
                    await inside.wait()
                first = attempts[asleep]
                # Let the 50 ms after the first attempt past the expiry pass, then count.
                await asyncio.sleep(max(first + 0.05 - asyncio.get_running_loop().time(), 0))
                window = [t for t in attempts[asleep:] if t <= first + 0.05]
                assert len(window) == 1, f"{len(window)} attempts in the 50 ms after expiry"
                leave.set()
                # Each release wakes the next waiter: all 50 through long before a backoff.
                async with asyncio.timeout(WOKEN_WITHIN):
                    await asyncio.gather(*tasks)
                assert sorted(done) == list(range(50))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def test_when_the_first_waiter_leaves_the_next_one_retries_at_the_expiry(
        self, asynclock_redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Only the first waiter retries when a silent holder's lease ends; if it gives up
        first, the one behind it is told (woken once) and retries at the expiry instead
        of sleeping its whole backoff."""
        async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
            backend = redis_backend(coord)
            assert await backend.acquire_keys(backend.keys("n"), "holder:dead", 3.0) > 0
            attempts = _count_attempts(backend, monkeypatch)
            first = asyncio.create_task(coord.lock("n", ttl=30, retry=SLEEPY).acquire())
            assert await eventually(lambda: len(attempts) == 2, 10)
            second = asyncio.create_task(coord.lock("n", ttl=30, retry=SLEEPY).acquire())
            assert await eventually(lambda: len(attempts) == 4, 10)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            async with asyncio.timeout(WOKEN_WITHIN):
                lease = await second
            await lease.release()


class TestClusterFailover:
    async def test_waiters_across_a_failover_are_woken_by_the_release(
        self, asynclock_cluster: ClusterSetup, namespace: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``CLUSTER FAILOVER`` moves the name's slot to the replica; the old master drops
        the waiters' shard channel (``sunsubscribe``). The channel is subscribed again on
        the new master, so the holder's release there wakes the waiter; a second waiter
        that gives up meanwhile leaves the first one's subscription in place. (The
        subscriber ignored the ``sunsubscribe``: the waiter got the lock from its backoff
        timer only.)"""
        setup = asynclock_cluster
        slot = setup.keyslot(f"{namespace}:{{n}}")
        old = setup.node_for_slot(slot)
        (replica,) = setup.replicas(old)
        async with (
            asynclock.connect(setup.url, prefix=namespace) as a,
            asynclock.connect(setup.url, prefix=namespace) as b,
        ):
            holder = await a.lock("n", ttl=60).acquire()
            backend = redis_backend(b)
            attempts = _count_attempts(backend, monkeypatch)
            first = asyncio.create_task(b.lock("n", ttl=60, retry=SLEEPY).acquire())
            assert await eventually(lambda: len(attempts) == 2, 10)
            second = asyncio.create_task(b.lock("n", ttl=60, retry=SLEEPY).acquire())
            assert await eventually(lambda: len(attempts) == 4 and backend.waiting("n") == 2, 10)
            assert await asyncio.to_thread(setup.failover, replica) is replica
            assert setup.node_for_slot(slot) is replica
            # Subscribed again on the new master: both waiters were woken to look again.
            assert await eventually(lambda: len(attempts) >= 6, WOKEN_WITHIN)
            await handed_over(holder, cancelled=second, woken=first)


class TestRedlockCounting:
    async def test_partial_releases_do_not_evict_the_release_being_counted(self) -> None:
        """Quorum 2: the holder's release is heard from one node, then 40 contenders that
        failed give back their single node each, then the holder's release from a second
        node: that completes its quorum and wakes the waiter. (Only 16 releases were
        remembered per name: the holder's was forgotten and its wake-up lost.)"""
        hub = WakeHub(quorum=2)
        first, second = hub.register("lock"), hub.register("lock")
        hub.announce("lock", "holder")
        for i in range(40):
            hub.announce("lock", f"contender{i}")
        assert [first.woken, second.woken] == [False, False]
        hub.announce("lock", "holder")
        assert [first.woken, second.woken] == [True, False]
        hub.announce("lock", "holder")  # a third node: the same release, no second wake-up
        assert [first.woken, second.woken] == [True, False]


class TestSyncReplicas:
    async def test_a_resent_acquire_waits_until_the_replicas_have_the_key(
        self, asynclock_sentinel: SentinelSetup
    ) -> None:
        """An acquire sent again after its reply was lost finds the lock its own
        ("already ours") on a new connection, which wrote nothing yet: ``WAIT`` there
        counted every replica at once, even ones that never got the key. The re-sent
        acquire now writes (renews the key), so ``WAIT`` counts only replicas that have
        it: here none (they are stopped), and the acquire fails and gives the lock back."""
        setup = asynclock_sentinel
        master = setup.master()
        claim = Claim("resent", secrets.token_hex(16), "test")
        async with asynclock.connect(setup.url, sync_replicas=2, sync_timeout=0.5) as coord:
            backend = redis_backend(coord)
            keys = backend.keys("resent")
            direct = Redis(host="127.0.0.1", port=master.port)
            replicas = setup.replicas()
            for replica in replicas:
                replica.freeze()
            try:
                # The first request: it reached the master, its reply was lost.
                script, numkeys, args = backend.calls.acquire(keys, claim.value, 10)
                assert int(await direct.eval(script.source, numkeys, *args)) > 0
                with pytest.raises(BackendError, match="0 of the 2 replicas"):
                    await backend.try_acquire(claim, 10)
                assert await direct.get(keys.lock) is None  # given back
            finally:
                for replica in replicas:
                    replica.resume()
                await direct.aclose()

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_a_waiter_without_a_subscription_leaves_the_next_ones_in_place(
        self,
        asynclock_cluster: ClusterSetup,
        namespace: str,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The slot's node does not answer while waiter A subscribes (twice): A waits on
        without wake-ups. B subscribes once the node is back; A gives up; the release
        still wakes B. (A's leaving dropped the node's subscription under B.)"""
        setup = asynclock_cluster
        node = setup.node_for_slot(setup.keyslot(f"{namespace}:{{n}}"))
        options = {"prefix": namespace, "socket_timeout": 1.0}
        async with (
            asynclock.connect(setup.url, **options) as a,
            asynclock.connect(setup.url, **options) as b,
        ):
            holder = await a.lock("n", ttl=60).acquire()
            backend = redis_backend(b)
            attempts: list[str] = []  # the claim of each attempt
            real = backend.try_acquire

            async def stalling(claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
                attempts.append(claim.value)
                if len(attempts) == 2:
                    await asyncio.to_thread(node.resume)  # A subscribed (or gave up on it)
                attempt = await real(claim, ttl, wait=wait)
                if len(attempts) == 1:
                    await asyncio.to_thread(node.freeze)  # while A subscribes
                return attempt

            def tried(n: int) -> bool:
                # The second waiter tried n times (its second once it had subscribed).
                return len([v for v in attempts if v != attempts[0]]) >= n

            monkeypatch.setattr(backend, "try_acquire", stalling)
            with caplog.at_level("WARNING", logger="asynclock.redis"):
                first = asyncio.create_task(b.lock("n", ttl=60, retry=SLEEPY).acquire())
                assert await eventually(lambda: len(attempts) >= 2, WOKEN_WITHIN)
            assert "without wake-ups" in caplog.text
            second = asyncio.create_task(b.lock("n", ttl=60, retry=SLEEPY).acquire())
            assert await eventually(lambda: tried(2), WOKEN_WITHIN)
            await handed_over(holder, cancelled=first, woken=second)

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_a_waiter_that_gives_up_hears_its_sunsubscribe_confirmed(
        self, asynclock_cluster: ClusterSetup, namespace: str
    ) -> None:
        """A waiter that gives up has its ``SUNSUBSCRIBE`` confirmed and recognised: the
        channel is dropped, and ``LockTimeout`` comes at the timeout, not a socket timeout
        (5 s) later."""
        async with (
            asynclock.connect(asynclock_cluster.url, prefix=namespace) as a,
            asynclock.connect(asynclock_cluster.url, prefix=namespace) as b,
        ):
            holder = await a.lock("n", ttl=60).acquire()
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(LockTimeout):
                await b.lock("n", ttl=60, timeout=0.3, retry=SLEEPY).acquire()
            assert loop.time() - began < 4.0
            # (The unsubscribe goes on in the background, not holding LockTimeout back.)
            assert await eventually(lambda: redis_backend(b).subscribed() == [])
            await holder.release()


class TestResentAcquire:
    @pytest.mark.parametrize("fair", [False, True])
    async def test_a_stale_copy_never_shortens_an_extended_lease(
        self, redis_coord: asynclock.Coordinator, fair: bool
    ) -> None:
        """A copy of the acquire that granted a lease lands after its owner extended it
        (redis-py's Cluster client sends a timed-out command again): "already ours"
        renews the key, but must not cut it back to the acquire's ttl while the owner
        counts on the extension (another client took the lock 5 s in, with ~52 s of
        local validity left)."""
        coord = redis_coord
        backend = redis_backend(coord)
        lease = await coord.lock("resent", ttl=5, fair=fair).acquire()
        await lease.extend(60)
        again = await backend.try_acquire(lease._claim, 5.0, wait=0)  # the stale copy
        assert again.fence == lease.fence
        pttl = await backend.client.pttl(backend.keys("resent").lock)
        assert pttl > 55_000, f"the server keeps the lock {pttl} ms; the owner counts on 60 s"
        assert lease.expires_in > 55
        await lease.release()
