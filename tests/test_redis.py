"""The Redis backend on real Valkey processes: faults, scripts, pub/sub, scale."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pytest_asynclock import ValkeyFactory, ValkeyServer
from pytest_asynclock.proxy import FaultProxy
from redis.asyncio import Redis

import asynclock
from asynclock import BackendError, Backoff, LockLost, LockTimeout
from asynclock.backends import Claim, Kind, RedisBackend
from asynclock.backends.redis import LINGER
from asynclock.backends.redis.pipe import Pipe

from .conftest import eventually, interrupted_aclose, redis_backend


@pytest.fixture
async def raw(asynclock_redis_url: str) -> AsyncIterator[Redis]:
    """A plain client on the shared server, to look behind the library's back."""
    client = Redis.from_url(asynclock_redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def private(asynclock_valkey_factory: ValkeyFactory) -> ValkeyServer:
    """A Valkey process of this test's own, free to freeze, kill and restart."""
    return asynclock_valkey_factory(1)[0]


def sockets_to(port: int) -> int:
    """TCP sockets this process has open to ``port`` on loopback (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    count = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].split(":")[1], 16)
            if remote_port == port and fields[9] in inodes:
                count += 1
    return count


async def namespace_keys(raw: Redis, namespace: str) -> list[bytes]:
    return [key async for key in raw.scan_iter(match=f"{namespace}:*")]


class TestLossBehindTheHoldersBack:
    @pytest.mark.parametrize("how", ["deleted", "overwritten"])
    async def test_tampered_key_cancels_within_a_renewal_period(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str, how: str
    ) -> None:
        """A lock key deleted or overwritten by someone else: the body is cancelled within
        ttl/3 plus a round trip, and ``async with`` raises LockLost."""
        ttl = 0.9
        tampered_at = 0.0
        with pytest.raises(LockLost) as caught:
            async with redis_coord.lock("victim", ttl=ttl):
                key = f"{namespace}:{{victim}}"
                if how == "deleted":
                    await raw.delete(key)
                else:
                    await raw.set(key, "someone-else", px=30_000)
                tampered_at = time.monotonic()
                await asyncio.sleep(30)
        elapsed = time.monotonic() - tampered_at
        assert elapsed < ttl / 3 + 0.1
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)
        if how == "overwritten":
            # Nobody's lease but ours was touched: the other value is still there.
            assert await raw.get(f"{namespace}:{{victim}}") == b"someone-else"


class TestFrozenServer:
    async def test_sigstop_cancels_before_the_server_ttl(self, private: ValkeyServer) -> None:
        """With the server frozen, the body is cancelled before the server-side TTL could
        have run out; after SIGCONT our stale renewals touch no one else's lock."""
        ttl = 1.5
        async with (
            asynclock.connect(private.url, prefix="frz", socket_timeout=30) as holder,
            asynclock.connect(private.url, prefix="frz") as other,
        ):
            cancelled_after = math.inf
            acquired_at = time.monotonic()
            with pytest.raises(LockLost):
                async with holder.lock("frozen", ttl=ttl) as lease:
                    acquired_at = time.monotonic()
                    private.freeze()
                    try:
                        await asyncio.sleep(30)
                    finally:
                        cancelled_after = time.monotonic() - acquired_at
            assert lease.lost
            assert cancelled_after < ttl  # the server would hold it for the full ttl
            await asyncio.sleep(ttl)  # past the server-side TTL, still frozen
            private.resume()
            newcomer = await other.lock("frozen", ttl=10, renew=False, timeout=5).acquire()
            assert newcomer.fence > lease.fence
            await asyncio.sleep(1.0)  # time for any stale renewal or clean-up to land
            info = await other.inspect("frozen")
            assert info is not None
            assert info.fence == newcomer.fence  # still the newcomer's lock
            assert info.expires_in < 9.1  # not extended by anyone since it was taken
            await newcomer.release()

    async def test_cancelled_release_is_finished_in_the_background(
        self, private: ValkeyServer
    ) -> None:
        """A release cancelled before the server confirmed keeps the lease held (its token
        is not forgotten) and is completed once the server answers again."""
        async with (
            asynclock.connect(private.url, prefix="rel", socket_timeout=30) as coord,
            asynclock.connect(private.url, prefix="rel") as observer,
        ):
            lease = await coord.lock("r", ttl=10).acquire()
            private.freeze()
            releasing = asyncio.create_task(lease.release())
            await asyncio.sleep(0.2)
            releasing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await releasing
            assert lease.held  # not confirmed: ownership not cleared
            private.resume()
            assert await eventually(lambda: not lease.held)
            assert not lease.lost
            assert not await observer.is_locked("r")

    async def test_a_failed_release_does_not_replace_a_cancel(self, private: ValkeyServer) -> None:
        """A task cancelled in its lock's body ends cancelled when the release fails too:
        BackendError must not replace the CancelledError (a retry loop would run on)."""
        async with asynclock.connect(private.url, prefix="cx") as coord:
            entered = asyncio.Event()

            async def worker() -> None:
                async with coord.lock("c", ttl=10):
                    entered.set()
                    await asyncio.sleep(3600)

            task = asyncio.create_task(worker())
            await entered.wait()
            private.kill()
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=10)
            assert done, "the cancelled worker did not end"
            assert task.cancelled(), f"ended with {task.exception()!r} instead of cancelled"
            private.restart()

    async def test_a_request_on_a_new_connection_still_times_out(
        self, asynclock_redis_url: str
    ) -> None:
        """A connection dies with a request in flight, which is sent again on a new
        connection into a black hole: it must end by the socket timeout (the old timer
        watched only the dead connection, and the request hung for good)."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            url = proxy.url_for(asynclock_redis_url)
            async with asynclock.connect(url, prefix="tmo", socket_timeout=0.5) as coord:
                assert not await coord.is_locked("x")  # connected
                proxy.blackhole()
                first = asyncio.create_task(coord.is_locked("x"))
                await asyncio.sleep(0.05)
                proxy.reset()  # dies with the request in flight: it goes out once more
                started = time.monotonic()
                with pytest.raises(BackendError, match=r"within 0\.5s"):
                    await asyncio.wait_for(first, 5.0)
                assert time.monotonic() - started < 1.0  # by the socket timeout, not never
                proxy.heal()

    async def test_a_request_sent_again_keeps_its_first_deadline(
        self, asynclock_redis_url: str
    ) -> None:
        """A request on an idle connection that the server had dropped is sent once more
        on a new one; it still ends by the socket timeout counted from the first send."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            url = proxy.url_for(asynclock_redis_url)
            async with asynclock.connect(url, prefix="again", socket_timeout=1.0) as coord:
                assert not await coord.is_locked("x")  # connected, then idle
                proxy.blackhole()
                proxy.schedule([(0.9, "reset")])  # dropped before any reply: sent again
                started = time.monotonic()
                with pytest.raises(BackendError, match=r"within 1s"):
                    await asyncio.wait_for(coord.is_locked("x"), 5.0)
                assert time.monotonic() - started < 1.5  # it took 1.9 s: a second timeout
                proxy.heal()

    async def test_an_unconfirmed_release_leaves_no_validity(
        self, asynclock_redis_url: str
    ) -> None:
        """A release whose reply does not come in time may have run: the lease keeps its
        token ("release pending", held) but no validity, and cannot be extended, while
        another coordinator may already hold the name."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            url = proxy.url_for(asynclock_redis_url)
            async with (
                asynclock.connect(url, prefix="unconf") as coord,
                asynclock.connect(asynclock_redis_url, prefix="unconf") as other,
            ):
                lease = await coord.lock("r", ttl=30).acquire()
                proxy.set_latency(0.5)
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await lease.release()
                assert lease.held  # its token is kept: the release goes on
                assert lease.expires_in == 0.0
                with pytest.raises(asynclock.LockNotOwned, match="release pending"):
                    await lease.extend()
                taken = await other.lock("r", ttl=30, timeout=3).acquire()  # once it lands
                assert lease.expires_in == 0.0
                proxy.heal()
                assert await eventually(lambda: not lease.held)
                await taken.release()

    async def test_aclose_gives_back_a_grant_still_on_its_way(
        self, asynclock_redis_url: str
    ) -> None:
        """aclose() while an acquire's request is on its way: the grant that comes back
        is released before aclose() returns, not left to its TTL."""
        async with (
            FaultProxy.from_url(asynclock_redis_url) as proxy,
            asynclock.connect(asynclock_redis_url, prefix="inflight") as observer,
        ):
            coord = asynclock.connect(proxy.url_for(asynclock_redis_url), prefix="inflight")
            async with coord.lock("k", ttl=30):  # scripts loaded, connection up
                pass
            proxy.set_latency(0.2)
            acquiring = asyncio.create_task(coord.lock("k", ttl=30).acquire())
            await asyncio.sleep(0.05)
            await coord.aclose()
            with pytest.raises(asynclock.CoordinatorClosed):
                await acquiring
            await asyncio.sleep(0.5)  # past the time the request takes to land
            assert not await observer.is_locked("k"), "the grant was left to its 30 s TTL"
            proxy.heal()

    @pytest.mark.parametrize("how", ["timed out", "cancelled"])
    async def test_an_abandoned_connect_closes_its_socket(
        self, asynclock_redis_url: str, how: str
    ) -> None:
        """A connect whose handshake (SELECT) gets no answer, given up by its timeout or
        by a cancel (as Redlock cancels slow nodes), leaves no socket open behind it. (A
        cancelled caller leaves the connect to the callers that share it, and it ends by
        its own timeout.)"""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            proxy.blackhole()
            url = proxy.url_for(asynclock_redis_url).rsplit("/", 1)[0] + "/1"
            async with asynclock.connect(url, socket_connect_timeout=0.2) as coord:
                for _ in range(4):
                    if how == "timed out":
                        with pytest.raises(BackendError, match="timed out connecting"):
                            await coord.is_locked("x")
                    else:  # (or the shared connect's own timeout came first)
                        with pytest.raises((TimeoutError, BackendError)):
                            await asyncio.wait_for(coord.is_locked("x"), 0.05)
                assert proxy.stats.connections >= (4 if how == "timed out" else 1)
                # (an aborted transport closes its socket on the next loop iteration)
                assert await eventually(lambda: sockets_to(proxy.port) == 0, within=1.0), (
                    f"{sockets_to(proxy.port)} abandoned connections still open"
                )
            proxy.heal()

    async def test_frozen_server_times_out_a_bounded_acquire(self, private: ValkeyServer) -> None:
        """A frozen server with timeout=0.5: LockTimeout after about 0.5 s, no hang."""
        async with asynclock.connect(private.url) as coord:
            assert not await coord.is_locked("x")  # connections are open before the freeze
            private.freeze()
            started = time.monotonic()
            with pytest.raises(LockTimeout):
                await coord.lock("x", timeout=0.5).acquire()
            assert time.monotonic() - started < 1.5
            private.resume()

    async def test_unreachable_server_is_backend_error_at_once(self) -> None:
        """Nothing listening: BackendError at once even with timeout=None."""
        async with asynclock.connect("redis://127.0.0.1:1/0") as coord:
            started = time.monotonic()
            with pytest.raises(BackendError) as caught:
                await coord.lock("x").acquire()
            assert time.monotonic() - started < 2.0
            assert caught.value.__cause__ is not None


class TestCloseLeavesNoConnection:
    @pytest.mark.parametrize("steps", [0, 1, 2, 3, 5, 8])
    async def test_an_interrupted_aclose_closes_every_connection(
        self, asynclock_redis_url: str, namespace: str, steps: int
    ) -> None:
        """aclose() cancelled part-way, with a lease held and a waiter subscribed: the
        close goes on to its end, and a second aclose() returns only when no connection
        to the server is left (it returned at once, leaving the pipelined and pub/sub
        connections open)."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            coord = asynclock.connect(proxy.url_for(asynclock_redis_url), prefix=namespace)
            lease = await coord.lock("held", ttl=30).acquire()
            waiting = asyncio.create_task(coord.lock("held", ttl=30).acquire())
            assert await eventually(lambda: len(coord._engine.waiting) == 1)
            assert proxy.stats.active >= 2
            await interrupted_aclose(coord, steps)
            await coord.aclose()
            # (the proxy sees a socket close a loop iteration or two later)
            assert await eventually(lambda: proxy.stats.active == 0)
            assert not lease.held
            with pytest.raises(asynclock.CoordinatorClosed):
                await waiting

    @pytest.mark.parametrize("kind", ["acquire", "waiter"])
    async def test_aclose_keeps_to_one_bound_and_leaves_no_task(
        self,
        asynclock_redis_url: str,
        namespace: str,
        monkeypatch: pytest.MonkeyPatch,
        kind: str,
    ) -> None:
        """A held lease and an acquire (or a waiter) on their way over a link that stopped
        answering, with a socket timeout longer than the close's bound: aclose() ends
        within one bound (acquires on their way and give-backs shared it; it took two),
        and no background task outlives it (the acquire, failing after the close, started
        its give-back in a task set that was closed already)."""
        bound = 1.0
        monkeypatch.setattr(asynclock._engine, "_CLOSE_TIMEOUT", bound)
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            coord = asynclock.connect(
                proxy.url_for(asynclock_redis_url), prefix=namespace, socket_timeout=1.3
            )
            held = await coord.lock("held", ttl=30).acquire()
            if kind == "waiter":
                other = asyncio.ensure_future(coord.lock("held", ttl=30).acquire())
                assert await eventually(lambda: len(coord._engine.waiting) == 1)
                proxy.blackhole()
            else:
                proxy.blackhole()
                other = asyncio.ensure_future(coord.lock("other", ttl=30).acquire())
                await asyncio.sleep(0.1)  # its request is on its way
            loop = asyncio.get_running_loop()
            began = loop.time()
            await coord.aclose()
            took = loop.time() - began
            left = [
                t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("asynclock")
            ]
            await asyncio.gather(other, return_exceptions=True)
            proxy.heal()
        assert left == []
        assert held.lost  # the close ended it
        # One bound (a waiter's leave in the background ends by the socket timeout, 1.3 s);
        # an acquire on its way and the give-backs each took a whole bound before.
        assert took < 1.8 * bound, f"aclose() took {took:.2f}s with a bound of {bound}s"

    async def test_aclose_in_a_leases_own_body_closes_every_connection(
        self, asynclock_redis_url: str, namespace: str
    ) -> None:
        """aclose() called inside a lock's own body: the block ends without LockLost and
        no connection is left (the close cancelled its own caller half-way)."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            coord = asynclock.connect(proxy.url_for(asynclock_redis_url), prefix=namespace)
            async with coord.lock("own", ttl=30):
                await coord.aclose()
            assert await eventually(lambda: proxy.stats.active == 0)
            async with asynclock.connect(asynclock_redis_url, prefix=namespace) as other:
                assert await other.inspect("own") is None


class TestScripts:
    async def test_script_flush_mid_run(
        self, redis_coord: asynclock.Coordinator, raw: Redis
    ) -> None:
        """SCRIPT FLUSH while locks are taken, renewed and released: everything goes on."""
        held = await redis_coord.lock("renewed", ttl=0.6).acquire()
        done = 0
        for i in range(200):
            if i % 20 == 0:
                await raw.script_flush()
            async with redis_coord.lock(f"flush:{i % 7}", ttl=5):
                done += 1
        await raw.script_flush()
        await asyncio.sleep(0.5)  # a renewal after the flush reloads the script
        assert done == 200
        assert held.held
        info = await redis_coord.inspect("renewed")
        assert info is not None
        assert info.fence == held.fence
        await held.release()

    async def test_a_retried_acquire_returns_the_same_grant(
        self, redis_coord: asynclock.Coordinator
    ) -> None:
        """The acquire script is idempotent: the same claim sent twice (a retry after a lost
        reply) gets the same fence instead of waiting for itself."""
        backend = redis_backend(redis_coord)
        claim = Claim("retried", "a" * 32, "me")
        first = await backend.try_acquire(claim, 10.0)
        second = await backend.try_acquire(claim, 10.0)
        assert first.fence is not None
        assert second.fence == first.fence
        other = await backend.try_acquire(Claim("retried", "b" * 32, "you"), 10.0)
        assert other.fence is None
        assert other.retry_after is not None
        assert 9 < other.retry_after <= 10
        assert await backend.release(claim)

    @pytest.mark.parametrize("fair", [False, True])
    async def test_a_retried_acquire_after_its_fence_counter_was_evicted(
        self, redis_coord: asynclock.Coordinator, fair: bool
    ) -> None:
        """A retry finding its grant but no fence counter (evicted under maxmemory) gets a
        new, larger fence instead of 0, which read as "refused": the caller then waited
        for itself until its own TTL ran out."""
        backend = redis_backend(redis_coord)
        claim = Claim("evicted", "c" * 32, "me", Kind.FAIR if fair else Kind.EXCLUSIVE)
        first = await backend.try_acquire(claim, 10.0)
        assert first.fence is not None
        await backend.client.delete(backend.keys("evicted").fence)
        second = await backend.try_acquire(claim, 10.0)
        assert second.fence is not None
        assert second.fence > first.fence
        assert await backend.release(claim)

    async def test_scripts_load_on_redis_py_connections(
        self, asynclock_redis_url: str, raw: Redis
    ) -> None:
        """On redis-py's own connections (what TLS, Sentinel and client_name use) a
        script the server does not know is loaded and the call retried: first use, after
        SCRIPT FLUSH, waiting and waking included."""
        await raw.script_flush()
        async with (
            asynclock.connect(asynclock_redis_url, client_name="rp") as a,
            asynclock.connect(asynclock_redis_url, client_name="rp") as b,
        ):
            assert type(redis_backend(a)._link).__name__ == "_Link"
            lease = await a.lock("on-redis-py", ttl=5).acquire()
            waiter = asyncio.create_task(b.lock("on-redis-py", ttl=5, timeout=5).acquire())
            await asyncio.sleep(0.1)
            await raw.script_flush()
            await lease.release()
            second = await waiter
            assert second.fence > lease.fence
            await second.release()

    async def test_fences_survive_a_restart_empty(self, private: ValkeyServer) -> None:
        """After the server restarts with no data, fences still grow (server clock, µs)."""
        async with asynclock.connect(private.url) as coord:
            async with coord.lock("f") as before:
                pass
            private.restart()
            await asyncio.sleep(0.05)  # the loop sees the old connections close
            async with coord.lock("f") as after:
                pass
            assert after.fence > before.fence


class TestPubSub:
    async def test_one_pubsub_connection_per_coordinator(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """40 waiters on 4 names share one pub/sub connection and leave no subscription
        once the last one's channel has lingered (LINGER seconds) unused."""
        holders = [await redis_coord.lock(f"ps:{i}", ttl=10).acquire() for i in range(4)]

        async def wait_and_release(i: int) -> None:
            async with redis_coord.lock(f"ps:{i % 4}", ttl=10):
                await asyncio.sleep(0)

        waiters = [asyncio.create_task(wait_and_release(i)) for i in range(40)]
        await asyncio.sleep(0.3)
        clients = await raw.client_list()
        pubsub_conns = [c for c in clients if "P" in c["flags"]]
        assert len(pubsub_conns) == 1
        channels = sorted(redis_backend(redis_coord).subscribed())
        backend = redis_backend(redis_coord)
        assert channels == sorted(backend.inbox(f"ps:{i}") for i in range(4))
        for lease in holders:
            await lease.release()
        await asyncio.wait_for(asyncio.gather(*waiters), 10)
        assert await eventually(lambda: backend.subscribed() == [], within=LINGER + 2)
        numsub = await raw.pubsub_numsub(*(backend.inbox(f"ps:{i}") for i in range(4)))
        assert all(count == 0 for _, count in numsub)

    async def test_a_wait_that_begins_as_its_lingering_channel_is_dropped(
        self, redis_coord: asynclock.Coordinator, raw: Redis
    ) -> None:
        """A lingering channel whose time runs out in the same moment a new wait subscribes
        to it stays subscribed for that wait (the drop must not clobber it)."""
        backend = redis_backend(redis_coord)
        subscriber = backend._subscriber
        channel = backend.inbox("race")
        await subscriber.subscribe(channel)
        await subscriber.unsubscribe(channel, confirm=False)  # lingers
        timer = subscriber._lingering[channel]  # type: ignore[union-attr]
        timer.cancel()
        subscriber._drop(channel)  # type: ignore[union-attr]  # its time is up, as ...
        await subscriber.subscribe(channel)  # ... a new wait begins
        await asyncio.sleep(0.1)  # the drop's task has run
        assert channel in subscriber.channels()
        assert (await raw.pubsub_numsub(channel))[0][1] == 1
        await subscriber.unsubscribe(channel, confirm=True)

    async def test_a_hot_lock_keeps_its_subscription(
        self, redis_coord: asynclock.Coordinator, raw: Redis
    ) -> None:
        """A worker that waits for the same lock again soon after its last grant finds the
        channel still subscribed: no SUBSCRIBE on the way, no wake-up lost."""
        backend = redis_backend(redis_coord)

        async def subscribes() -> int:
            stats = await raw.info("commandstats")
            return int(stats.get("cmdstat_subscribe", {}).get("calls", 0))

        holder = await redis_coord.lock("hot", ttl=10).acquire()
        waiter = asyncio.create_task(redis_coord.lock("hot", ttl=10).acquire())
        assert await eventually(lambda: backend.waiting() == 1)
        before = await subscribes()
        for _ in range(5):
            await holder.release()
            holder = await asyncio.wait_for(waiter, 2)
            assert backend.subscribed() == [backend.inbox("hot")]  # lingering
            waiter = asyncio.create_task(redis_coord.lock("hot", ttl=10).acquire())
            assert await eventually(lambda: backend.waiting() == 1)
        assert await subscribes() == before
        await holder.release()
        await (await asyncio.wait_for(waiter, 2)).release()

    async def test_cancelled_waiter_unsubscribes(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """A cancelled waiter leaves no subscription and no task behind: once its leave
        (which goes on in the background, not holding the cancel back) is done, the
        server has dropped the subscription and the pub/sub reader has ended."""
        holder = await redis_coord.lock("cw", ttl=10).acquire()
        tasks_before = asyncio.all_tasks()
        waiter = asyncio.create_task(redis_coord.lock("cw", ttl=10).acquire())
        await asyncio.sleep(0.2)
        channel = redis_backend(redis_coord).inbox("cw")
        assert (await raw.pubsub_numsub(channel))[0][1] == 1
        assert len(asyncio.all_tasks()) == len(tasks_before) + 2  # the waiter, the reader
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert redis_backend(redis_coord).waiting() == 0
        assert await eventually(lambda: asyncio.all_tasks() == tasks_before)
        assert (await raw.pubsub_numsub(channel))[0][1] == 0
        await holder.release()

    async def test_waiters_recover_from_a_killed_pubsub_connection(
        self, redis_coord: asynclock.Coordinator, raw: Redis
    ) -> None:
        """If the pub/sub connection is killed, waiters still get the lock promptly."""
        holder = await redis_coord.lock("pk", ttl=10).acquire()
        slow = Backoff(initial=5.0, maximum=10.0)
        waiter = asyncio.create_task(redis_coord.lock("pk", ttl=10, retry=slow).acquire())
        await asyncio.sleep(0.2)
        assert await raw.client_kill_filter(_type="pubsub") >= 1
        await asyncio.sleep(0.5)  # reconnected and subscribed again
        released_at = time.monotonic()
        await holder.release()
        lease = await asyncio.wait_for(waiter, 5)
        assert time.monotonic() - released_at < 0.5
        await lease.release()


class TestManyLeases:
    @pytest.mark.timeout(90)
    async def test_ten_thousand_leases_one_scheduler(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """10,000 leases held by one coordinator are renewed by one scheduler (a timer and
        a few short batch tasks, not a task per lease) and all stay held for two renewal
        periods. (A TTL of 6 s: releasing 10,000 at once on a loaded machine took long
        enough to spend a 3 s lease's last second.)"""
        ttl = 6.0
        semaphore = asyncio.Semaphore(64)

        async def take(i: int) -> asynclock.Lease:
            async with semaphore:
                return await redis_coord.lock(f"many:{i}", ttl=ttl).acquire()

        leases = await asyncio.gather(*(take(i) for i in range(10_000)))
        watchdog = redis_coord._engine.watchdog
        renewals_before = watchdog.renewals
        most_tasks = 0
        deadline = time.monotonic() + 2 * ttl / 3 + 0.5
        while time.monotonic() < deadline:
            most_tasks = max(most_tasks, len(asyncio.all_tasks()))
            await asyncio.sleep(0.05)
        assert all(lease.held for lease in leases)
        renewed = watchdog.renewals - renewals_before
        assert renewed >= 2 * 10_000
        # Renewals due together went out together: dozens per request (hundreds on an idle
        # machine; under load the grants, and so the due times, spread), not one each.
        assert renewed / max(1, watchdog.batches) > 20
        assert most_tasks < 10  # the test itself, the pub/sub reader, a renewal batch or two
        keys = await namespace_keys(raw, namespace)
        lock_keys = [k for k in keys if not k.endswith(b":fence")]
        assert len(lock_keys) == 10_000
        # Server-side TTLs were refreshed: all well above the 1.5 s two periods would leave.
        async with raw.pipeline(transaction=False) as pipe:
            for key in lock_keys[:500]:
                pipe.pttl(key)
            ttls = await pipe.execute()
        assert min(ttls) > 2500
        await asyncio.gather(*(lease.release() for lease in leases))
        assert redis_coord.held == []


class TestBadInputWritesNothing:
    async def test_rejected_calls_write_nothing(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """Every rejected argument raises before any command reaches the server."""
        calls_before = await raw.info("commandstats")
        bad: list[dict[str, object]] = [
            {"ttl": 0},
            {"ttl": -1},
            {"ttl": math.nan},
            {"ttl": math.inf},
            {"timeout": -1},
            {"retry": "fast"},
        ]
        for options in bad:
            with pytest.raises((ValueError, TypeError)):
                redis_coord.lock("bad", **options)  # type: ignore[arg-type]
        for name in ("", 1, None, "x" * 5000):
            with pytest.raises((ValueError, TypeError)):
                redis_coord.lock(name)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="fair"):
            redis_coord.lock("bad", shared=True, fair=True)
        with pytest.raises(ValueError, match="limit"):
            redis_coord.semaphore("bad", 0)
        assert await namespace_keys(raw, namespace) == []
        calls_after = await raw.info("commandstats")
        assert calls_after.get("cmdstat_evalsha") == calls_before.get("cmdstat_evalsha")

    def test_unknown_scheme_is_value_error(self) -> None:
        """An unknown URL scheme is a ValueError naming the accepted ones."""
        for url in ("http://localhost", "redis+foo://x", "localhost:6379", "mysql://x"):
            with pytest.raises(ValueError, match="accepted"):
                asynclock.connect(url)
        with pytest.raises(TypeError):
            asynclock.connect(6379)  # type: ignore[arg-type]

    def test_unix_url_without_a_path_is_value_error(self) -> None:
        """unix://host (no socket path) is a ValueError at connect(), password unshown
        (the fuzzer found a KeyError here)."""
        for url in ("unix://127.0.0.1", "unix://", "unix://:s3cret@localhost"):
            with pytest.raises(ValueError, match="no socket path") as raised:
                asynclock.connect(url)
            assert "s3cret" not in str(raised.value)

    def test_unknown_option_is_type_error(self, asynclock_redis_url: str) -> None:
        """A misspelt option fails at connect(), not at the first lock."""
        with pytest.raises(TypeError):
            asynclock.connect(asynclock_redis_url, socket_timout=1)


class TestClientsAndSecrets:
    async def test_passed_in_client_is_not_closed(self, asynclock_redis_url: str) -> None:
        """Coordinator(RedisBackend(client)).aclose() leaves the application's client open."""
        client = Redis.from_url(asynclock_redis_url)
        coord = asynclock.Coordinator(RedisBackend(client, prefix="own"))
        async with coord, coord.lock("mine"):
            pass
        assert await client.ping()
        await client.aclose()

    async def test_password_never_shown(self, asynclock_redis_url: str) -> None:
        """A password in the URL appears in no repr and no error message."""
        url = asynclock_redis_url.replace("redis://", "redis://someone:hunter2secret@")
        async with asynclock.connect(url) as coord:
            assert "hunter2secret" not in repr(coord)
            assert "hunter2secret" not in repr(coord.backend)
            with pytest.raises(BackendError) as caught:
                await coord.lock("x").acquire()
            assert "hunter2secret" not in str(caught.value)
            assert "hunter2secret" not in repr(caught.value.__cause__)

    async def test_unix_socket(
        self, asynclock_valkey_factory: ValkeyFactory, tmp_path: Path
    ) -> None:
        """unix:// URLs reach a server on a Unix socket."""
        path = tmp_path / "valkey.sock"
        server = asynclock_valkey_factory(1, extra_args=("--unixsocket", str(path)))[0]
        assert server.running
        async with asynclock.connect(f"unix://{path}") as coord:
            async with coord.lock("sock") as lease:
                info = await coord.inspect("sock")
                assert info is not None
                assert info.fence == lease.fence
            assert "unix://" in repr(coord)


class TestPipelinedConnection:
    """The one pipelined connection per node that carries asynclock's commands."""

    async def test_killed_connection_fails_only_what_was_in_flight(
        self, redis_coord: asynclock.Coordinator, raw: Redis
    ) -> None:
        """CLIENT KILL of every other connection: a held lease is kept (the next extend
        reconnects), and new acquires and the release work without the caller retrying."""
        lease = await redis_coord.lock("killed", ttl=30).acquire()
        assert await raw.client_kill_filter(_type="normal", skipme=True) >= 1
        await lease.extend(30)  # would raise BackendError if the dead connection stuck
        second = await redis_coord.lock("killed-2").acquire()
        assert second.fence > 0
        await second.release()
        await lease.release()
        assert await redis_coord.inspect("killed") is None

    async def test_many_requests_in_flight_each_get_their_own_answer(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """Hundreds of acquires pipelined on one connection: replies are matched to
        requests in order, so every lease's fence is the one stored under its own key."""
        locks = [redis_coord.lock(f"many-{i}") for i in range(300)]
        leases = await asyncio.gather(*(lock.acquire() for lock in locks))
        for i, lease in enumerate(leases):
            info = await redis_coord.inspect(f"many-{i}")
            assert info is not None
            assert info.fence == lease.fence
            assert info.owner == redis_coord.identity
        await asyncio.gather(*(lease.release() for lease in leases))
        after = await asyncio.gather(*(redis_coord.inspect(f"many-{i}") for i in range(300)))
        assert after == [None] * 300

    async def test_callers_share_one_reconnect(
        self, asynclock_redis_url: str, namespace: str
    ) -> None:
        """Callers that need the connection while it is being made wait for that connect
        and share its outcome: against a link that lets no byte through (the handshake's
        SELECT is never answered), six concurrent calls all fail within one connect
        timeout, on one connection attempt; each used to start its own connect after the
        one before it timed out (the sixth waited six timeouts)."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            url = proxy.url_for(asynclock_redis_url).rsplit("/", 1)[0] + "/2"
            coord = asynclock.connect(
                url, prefix=namespace, socket_connect_timeout=0.3, socket_timeout=0.3
            )
            try:
                await coord.inspect("warm-up")
                proxy.blackhole()
                proxy.reset()  # the live connection is gone; a new one waits
                link = redis_backend(coord)._link
                assert isinstance(link, Pipe)
                assert await eventually(lambda: link.ready() is None)  # it noticed
                before = proxy.stats.connections
                loop = asyncio.get_running_loop()
                began = loop.time()

                async def call() -> float:
                    with pytest.raises(BackendError):
                        await coord.inspect("x")
                    return loop.time() - began

                took = await asyncio.gather(*(call() for _ in range(6)))
                assert proxy.stats.connections - before == 1
                assert max(took) < 1.2, f"calls ended after {[f'{t:.2f}' for t in took]} s"
            finally:
                proxy.heal()
                await coord.aclose()

    async def test_a_connection_lost_before_its_callers_resume(
        self, asynclock_redis_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Callers of a shared connect resume a loop turn after it made the connection:
        one lost in between (the server closed it at once) fails nothing that was never
        sent, and their requests go out on a new one; they waited forever for replies on
        the dead one."""
        backend = RedisBackend.from_url(asynclock_redis_url)
        link = backend._link
        assert isinstance(link, Pipe)
        connect = link._connect
        made = 0

        async def lost_at_once() -> Any:
            nonlocal made
            proto = await connect()
            made += 1
            if made == 1:
                proto.abort(ConnectionError("closed by the server"))
                await asyncio.sleep(0)  # its connection_lost has run
            return proto

        monkeypatch.setattr(link, "_connect", lost_at_once)
        try:
            calls = [asyncio.ensure_future(link.execute("PING")) for _ in range(3)]
            async with asyncio.timeout(10):
                assert await asyncio.gather(*calls) == [b"PONG"] * 3
            assert made == 2
        finally:
            await backend.aclose()

    async def test_username_password_and_database_from_the_url(self, private: ValkeyServer) -> None:
        """AUTH and SELECT on connect: a lock taken through redis://user:pw@host/3 lives in
        database 3, and a wrong password is a BackendError at the first command."""
        admin = Redis.from_url(private.url)
        try:
            await admin.acl_setuser(
                "worker", enabled=True, passwords=["+s3cret"], keys="*", channels="*",
                commands=["+@all"],
            )  # fmt: skip
            base = f"redis://worker:s3cret@{private.host}:{private.port}"
            coord = asynclock.connect(f"{base}/3", prefix="db3")
            async with coord, coord.lock("in-three"):
                three = Redis(host=private.host, port=private.port, db=3)
                try:
                    assert [k async for k in admin.scan_iter(match="db3:*")] == []
                    assert [k async for k in three.scan_iter(match="db3:*")] != []
                finally:
                    await three.aclose()
            wrong = f"redis://worker:wrong@{private.host}:{private.port}"
            async with asynclock.connect(wrong) as coord:
                with pytest.raises(BackendError):
                    await coord.lock("denied").acquire()
        finally:
            await admin.aclose()


WAITER = """
import asyncio, sys, asynclock
async def main():
    async with asynclock.connect(sys.argv[1], prefix=sys.argv[2]) as coord:
        await coord.lock("q", ttl=30, retry=asynclock.Backoff(initial=5, maximum=5)).acquire()
asyncio.run(main())
"""


async def script_calls(raw: Redis) -> int:
    """EVALSHA calls the server has run so far."""
    stats = await raw.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


class TestWaiterQueue:
    """Waiters queue on the server; a release wakes the oldest live one, not all."""

    # Waiters that never poll on their own: every attempt after the first is a wake-up.
    PATIENT = Backoff(initial=5, maximum=5, jitter=False)

    async def test_a_release_wakes_one_waiter_across_clients(self, private: ValkeyServer) -> None:
        """Eight clients wait; each release costs one acquire attempt, not eight, and
        the lock goes to the waiters in the order they queued."""
        raw = Redis.from_url(private.url)
        coords = [asynclock.connect(private.url, prefix="q") for _ in range(9)]
        try:
            async with coords[8].lock("warm-up"):  # load the scripts: no NOSCRIPT later
                pass
            holder = await coords[8].lock("q", ttl=30).acquire()
            waiters = []
            for i in range(8):
                lock = coords[i].lock("q", ttl=30, retry=self.PATIENT)
                before = await script_calls(raw)
                waiters.append(asyncio.create_task(lock.acquire()))
                # Parked: tried once, subscribed, tried again (and queued).
                deadline = time.monotonic() + 5
                while await script_calls(raw) - before < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                assert await raw.zcard("q:{q}:queue") == i + 1
            for i in range(8):
                before = await script_calls(raw)
                await holder.release()
                holder = await asyncio.wait_for(waiters[i], 2)
                assert await eventually(lambda: False, within=0.1) is False
                # INFO itself is no script; the release and exactly one acquire are.
                assert await script_calls(raw) - before == 2
            await holder.release()
            assert await raw.exists("q:{q}:queue", "q:{q}:due") == 0
        finally:
            for coord in coords:
                await coord.aclose()
            await raw.aclose()

    async def test_a_waiter_that_gives_up_leaves_the_queue(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """Timed out or cancelled, a waiter is out of the server's queue when it is gone."""
        holder = await redis_coord.lock("gone", ttl=30).acquire()
        queue = f"{namespace}:{{gone}}:queue"
        with pytest.raises(LockTimeout):
            await redis_coord.lock("gone", timeout=0.2).acquire()
        assert await raw.zcard(queue) == 0
        waiter = asyncio.create_task(redis_coord.lock("gone", retry=self.PATIENT).acquire())
        assert await eventually(lambda: redis_backend(redis_coord).waiting() == 1)
        assert await raw.zcard(queue) == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await raw.zcard(queue) == 0
        await holder.release()

    async def test_a_dead_waiter_does_not_hold_up_the_line(
        self, redis_coord: asynclock.Coordinator, raw: Redis, asynclock_redis_url: str,
        namespace: str,
    ) -> None:  # fmt: skip
        """A waiter process killed with SIGKILL at the head of the queue: the release
        wakes it in vain, and the next waiter still gets the lock within one backoff
        step (1 s by default), not at the end of its own long sleep."""
        holder = await redis_coord.lock("q", ttl=30).acquire()
        dead = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WAITER, asynclock_redis_url, namespace
        )
        try:
            queue = f"{namespace}:{{q}}:queue"
            assert await eventually(lambda: False, within=0.0) is False
            deadline = time.monotonic() + 20
            while await raw.zcard(queue) == 0:
                assert time.monotonic() < deadline, "the waiter process never queued"
                await asyncio.sleep(0.02)
            dead.kill()
            await dead.wait()
            waiter = asyncio.create_task(redis_coord.lock("q", ttl=30).acquire())
            assert await eventually(lambda: redis_backend(redis_coord).waiting() == 1)
            assert await raw.zcard(queue) == 2
            released_at = time.monotonic()
            await holder.release()
            lease = await asyncio.wait_for(waiter, 5)
            assert time.monotonic() - released_at < 1.5
            await lease.release()
        finally:
            with contextlib.suppress(ProcessLookupError):
                dead.kill()
            await dead.wait()

    async def test_redis_server_sees_a_queue_only_while_someone_waits(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """Uncontended locks leave no queue keys; a waiter's place lapses by itself."""
        async with redis_coord.lock("quiet"):
            pass
        assert sorted(await namespace_keys(raw, namespace)) == [
            f"{namespace}:{{quiet}}:{suffix}".encode() for suffix in ("fence", "released")
        ]
        holder = await redis_coord.lock("lapse", ttl=30).acquire()
        with pytest.raises(LockTimeout):
            await redis_coord.lock("lapse", timeout=0.1).acquire()
        due = f"{namespace}:{{lapse}}:due"
        assert await raw.exists(due) == 0  # left on timeout
        await holder.release()


class TestLossNoticedDuringARelease:
    async def test_a_release_confirmed_after_the_validity_ran_out(
        self, asynclock_redis_url: str, namespace: str
    ) -> None:
        """The block ends in time, then its release is slow both ways: it reaches the
        server before the lock's expiry there, and its reply comes after the local
        validity ran out (the lease is marked lost meanwhile). The server confirmed, so
        nothing ran unprotected: the block ends released, not with LockLost (which made
        a web integration answer 503 for a completed request)."""
        async with FaultProxy.from_url(asynclock_redis_url) as proxy:
            url = proxy.url_for(asynclock_redis_url)
            async with asynclock.connect(url, prefix=namespace) as coord:
                async with coord.lock("x", ttl=3, renew=False):
                    pass  # the server knows the release script now: one round trip
                async with coord.lock("x", ttl=3, renew=False) as lease:
                    # There at 0.6 of the validity left, answered at 1.2 of it.
                    proxy.set_latency(0.6 * lease.expires_in)
                proxy.heal()
                assert coord.stats().losses == 1  # the loss was seen before the reply
                assert not lease.lost
                assert not lease.held
                assert await coord.inspect("x") is None

    @pytest.mark.parametrize("run", range(3))
    async def test_a_body_that_outlived_its_validity_still_gets_lock_lost(
        self, asynclock_redis_url: str, namespace: str, run: int
    ) -> None:
        """The body blocks the loop past its local validity, not past the server's
        expiry (a drift of 20 % leaves room): the release is confirmed, yet the body may
        have run unprotected, so the block raises LockLost, whichever of the release's
        reply and the watchdog's timer comes first (it depended on that)."""
        async with asynclock.connect(
            asynclock_redis_url, prefix=namespace, drift_factor=0.2
        ) as coord:
            with pytest.raises(LockLost, match="validity ran out"):
                async with coord.lock("x", ttl=1) as lease:
                    time.sleep(lease.expires_in + 0.03 * (run + 1))  # noqa: ASYNC251 - blocks the loop
            assert coord.stats().losses == 1
            assert coord.stats().releases == 0
