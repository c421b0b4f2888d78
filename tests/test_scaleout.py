"""Locks on Redis behind Sentinel and on Redis Cluster, with failovers, against real
valkey-server topologies the harness builds (pytest_asynclock.topology)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest
from pytest_asynclock import ClusterSetup, SentinelSetup
from redis import Redis as SyncRedis
from redis.asyncio import Redis

import asynclock
from asynclock import BackendError, Backoff, LockTimeout
from asynclock.backends import RedisBackend

from .conftest import eventually

# A waiter that is not woken tries again only after 5 s: a grant sooner came by wake-up.
SLOW_RETRY = Backoff(initial=5.0, maximum=5.0)

FENCED_WRITE = """
local current = tonumber(redis.call('GET', KEYS[1]) or 0)
if tonumber(ARGV[1]) >= current then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


def node(server: object) -> SyncRedis:
    port = getattr(server, "port")  # noqa: B009 - ValkeyServer and ClusterNode both have it
    return SyncRedis(host="127.0.0.1", port=port, socket_timeout=2)


async def hand_off_by_wake_up(
    a: asynclock.Coordinator, b: asynclock.Coordinator, name: str
) -> float:
    """Seconds from a's release to b's grant, b waiting with a 5 s retry."""
    lease = await a.lock(name, ttl=10).acquire()
    waiter = asyncio.create_task(b.lock(name, ttl=10, timeout=8, retry=SLOW_RETRY).acquire())
    await asyncio.sleep(0.2)  # b is queued and subscribed
    released = time.monotonic()
    await lease.release()
    second = await waiter
    took = time.monotonic() - released
    assert second.fence > lease.fence
    await second.release()
    return took


class TestSentinel:
    async def test_locks_wait_and_wake_through_sentinel(
        self, asynclock_sentinel: SentinelSetup
    ) -> None:
        """redis+sentinel:// finds the master; a waiter is woken by the release."""
        async with (
            asynclock.connect(asynclock_sentinel.url) as a,
            asynclock.connect(asynclock_sentinel.url) as b,
        ):
            assert "sentinel" in a.backend.describe()
            assert await hand_off_by_wake_up(a, b, "job") < 1.0
            master = node(asynclock_sentinel.master())
            assert master.exists("asynclock:{job}:fence")

    @pytest.mark.timeout(90)
    async def test_a_held_lease_is_renewed_across_a_failover(
        self, asynclock_sentinel: SentinelSetup
    ) -> None:
        """After SENTINEL FAILOVER the watchdog renews on the new master: the lease is
        kept, others still cannot take the lock, and the next fence is larger."""
        async with (
            asynclock.connect(asynclock_sentinel.url) as a,
            asynclock.connect(asynclock_sentinel.url) as b,
        ):
            lease = await a.lock("kept", ttl=6).acquire()
            old = asynclock_sentinel.master()
            new = await asyncio.to_thread(asynclock_sentinel.failover)
            assert new.port != old.port
            await asyncio.sleep(4)  # more than one renewal period (ttl/3) on the new master
            assert lease.held, "the lease was lost in a graceful failover"
            with pytest.raises(LockTimeout):
                await b.lock("kept", ttl=6, timeout=0).acquire()
            await lease.release()
            after = await b.lock("kept", ttl=6).acquire()
            assert after.fence > lease.fence
            await after.release()

    async def test_sync_replicas_waits_until_the_replicas_have_the_key(
        self, asynclock_sentinel: SentinelSetup
    ) -> None:
        """sync_replicas=2: when acquire returns, both replicas hold the key; asking for
        more replicas than exist fails with BackendError and leaves the lock free."""
        replicas = [node(r) for r in asynclock_sentinel.replicas()]
        assert len(replicas) == 2
        async with asynclock.connect(asynclock_sentinel.url, sync_replicas=2) as coord:
            for i in range(20):
                lease = await coord.lock(f"durable-{i}", ttl=10).acquire()
                # Read at once, no waiting: WAIT already confirmed both copies.
                for replica in replicas:
                    assert replica.exists(f"asynclock:{{durable-{i}}}"), i
                await lease.release()
        async with asynclock.connect(
            asynclock_sentinel.url, sync_replicas=3, sync_timeout=0.3
        ) as coord:
            began = time.monotonic()
            with pytest.raises(BackendError, match="2 of the 3 replicas"):
                await coord.lock("too-durable", ttl=10).acquire()
            assert time.monotonic() - began < 2.0
            assert not await coord.is_locked("too-durable")

    @pytest.mark.timeout(90)
    async def test_a_failover_that_loses_the_lock_is_caught_by_the_fence(
        self, asynclock_sentinel: SentinelSetup, asynclock_redis_url: str
    ) -> None:
        """Without sync_replicas a failover can lose a granted lock (here the replicas
        never get it); a second holder then takes it on the new master with a larger
        fence, and the resource refuses the first holder's late write."""
        resource = Redis.from_url(asynclock_redis_url)
        write = resource.register_script(FENCED_WRITE)
        key = f"resource:{time.monotonic_ns()}"
        async with (
            asynclock.connect(asynclock_sentinel.url) as a,
            asynclock.connect(asynclock_sentinel.url) as b,
        ):
            first = await a.lock("payments", ttl=10).acquire()
            assert await write(keys=[key], args=[first.fence]) == 1
            # The grant never reached the replicas (as if the master died before
            # replicating it): remove it from them by hand.
            for server in asynclock_sentinel.replicas():
                replica = node(server)
                replica.config_set("replica-read-only", "no")
                replica.delete("asynclock:{payments}")
                replica.config_set("replica-read-only", "yes")
            await asyncio.to_thread(asynclock_sentinel.failover)
            second = await b.lock("payments", ttl=10, timeout=5).acquire()
            assert second.fence > first.fence
            assert await write(keys=[key], args=[second.fence]) == 1
            # The first holder does not know yet: its lease looks held, its write is refused.
            assert await write(keys=[key], args=[first.fence]) == 0
            assert int(await resource.get(key) or 0) == second.fence
            # Its next renewal finds the lock taken: the lease is lost within ttl/3 + margin.
            for _ in range(60):
                if first.lost:
                    break
                await asyncio.sleep(0.1)
            assert first.lost
            await second.release()
        await resource.aclose()


def owners_of(cluster: ClusterSetup, names: list[str]) -> set[int]:
    return {cluster.node_for_slot(cluster.keyslot(f"asynclock:{{{n}}}")).port for n in names}


class TestCluster:
    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_names_over_every_master(self, asynclock_cluster: ClusterSetup) -> None:
        """300 names spread over all three masters: exclusive, released, fences grow."""
        names = [f"item:{i}" for i in range(300)]
        assert len(owners_of(asynclock_cluster, names)) == 3
        async with (
            asynclock.connect(asynclock_cluster.url) as a,
            asynclock.connect(asynclock_cluster.url) as b,
        ):
            assert isinstance(a.backend, RedisBackend)
            first = await asyncio.gather(*(a.lock(n, ttl=10).acquire() for n in names))
            for name in names[:30]:
                with pytest.raises(LockTimeout):
                    await b.lock(name, ttl=10, timeout=0).acquire()
            await asyncio.gather(*(lease.release() for lease in first))
            second = await asyncio.gather(*(b.lock(n, ttl=10).acquire() for n in names))
            assert all(s.fence > f.fence for f, s in zip(first, second, strict=True))
            await asyncio.gather(*(lease.release() for lease in second))

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_waiters_are_woken_by_sharded_pubsub(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """A waiter subscribes (SSUBSCRIBE) on the node owning the lock's slot and is
        woken there by the release script's SPUBLISH, for names on every master."""
        names = ["a", "b", "c", "d", "e", "f"]
        assert len(owners_of(asynclock_cluster, names)) == 3
        async with (
            asynclock.connect(asynclock_cluster.url) as a,
            asynclock.connect(asynclock_cluster.url) as b,
        ):
            for name in names:
                lease = await a.lock(name, ttl=10).acquire()
                waiter = asyncio.create_task(
                    b.lock(name, ttl=10, timeout=8, retry=SLOW_RETRY).acquire()
                )
                await asyncio.sleep(0.2)
                backend = b.backend
                assert isinstance(backend, RedisBackend)
                owner = node(asynclock_cluster.node_for_slot(asynclock_cluster.keyslot(name)))
                inbox = backend.inbox(name)
                subscribers = owner.execute_command("PUBSUB", "SHARDNUMSUB", inbox)  # type: ignore[no-untyped-call]
                assert subscribers[1] == 1
                released = time.monotonic()
                await lease.release()
                second = await waiter
                assert time.monotonic() - released < 1.0, name
                await second.release()

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_renewals_and_elections_on_a_cluster(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """The watchdog renews leases spread over every slot group (one script per slot);
        an observer hears a new leader through sharded pub/sub."""
        async with (
            asynclock.connect(asynclock_cluster.url) as a,
            asynclock.connect(asynclock_cluster.url) as b,
        ):
            leases = [await a.lock(f"lease:{i}", ttl=1).acquire() for i in range(60)]
            await asyncio.sleep(2.5)  # more than two ttls: renewed, or lost
            assert not any(lease.lost for lease in leases)
            for lease in leases:
                await lease.release()

            seen: list[str | None] = []

            async def watch() -> None:
                async for leader in b.election("boss", ttl=5, identity="w").observe():
                    seen.append(leader)
                    if leader == "me":
                        return

            watcher = asyncio.create_task(watch())
            assert await eventually(lambda: seen == [None], within=30)  # its first look
            async with a.election("boss", ttl=5, identity="me").leadership():
                await asyncio.wait_for(watcher, 10.0)  # by message: observe() polls at ttl
            assert seen == [None, "me"]

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_a_name_that_would_leave_its_slot_is_refused(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """A name starting with '}' (an empty hash tag: CROSSSLOT) is a ValueError at the
        call; '}' elsewhere in a name, and in an election's name, works."""
        async with asynclock.connect(asynclock_cluster.url) as coord:
            with pytest.raises(ValueError, match="start with '}'"):
                coord.lock("}x")
            with pytest.raises(ValueError, match="start with '}'"):
                coord.semaphore("}x", 2)
            with pytest.raises(ValueError, match="start with '}'"):
                await coord.inspect("}x")
            async with coord.lock("a}b", ttl=5, timeout=1) as lease:
                assert await coord.is_locked("a}b")
                await lease.extend(6)
            async with coord.election("}boss", ttl=5, identity="me").leadership():
                assert await coord.election("}boss", ttl=5).leader() == "me"

    @pytest.mark.timeout(120)
    async def test_a_master_killed_mid_run(self, asynclock_cluster: ClusterSetup) -> None:
        """Three coordinators lock names on every master while one master is killed:
        after its replica takes over every name can be locked again, and each name's
        fences grow in the order the grants were made."""
        names = [f"job:{i}" for i in range(12)]
        assert len(owners_of(asynclock_cluster, names)) == 3
        coords = [asynclock.connect(asynclock_cluster.url) for _ in range(3)]
        grants: dict[str, list[tuple[float, int]]] = defaultdict(list)
        errors: list[BaseException] = []
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            coord = coords[i % 3]
            name = names[i % len(names)]
            while not stop.is_set():
                try:
                    async with coord.lock(name, ttl=2, timeout=3) as lease:
                        grants[name].append((time.monotonic(), lease.fence))
                        await asyncio.sleep(0.01)
                except (BackendError, LockTimeout, asynclock.LockLost) as exc:
                    errors.append(exc)
                    await asyncio.sleep(0.05)

        try:
            tasks = [asyncio.create_task(worker(i)) for i in range(36)]
            # Well under way on every master before the kill (how long that takes depends
            # on the machine's load, not on the lock).
            assert await eventually(lambda: all(len(grants[n]) >= 10 for n in names), within=60), {
                n: len(grants[n]) for n in names
            }
            killed_at = time.monotonic()
            await asyncio.to_thread(asynclock_cluster.kill_master, 0)
            # Every name locked again after the kill (its replica took over), within a
            # deadline generous for a loaded machine; then a little more traffic.
            await eventually(
                lambda: all(g[0] > killed_at for n in names for g in grants[n][-1:]), within=60
            )
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
            after = {n: [g for g in grants[n] if g[0] > killed_at] for n in names}
            assert all(after[n] for n in names), {n: len(after[n]) for n in names}
            for name in names:
                fences = [fence for _, fence in sorted(grants[name])]
                assert fences == sorted(fences), name
                assert len(set(fences)) == len(fences), name
            # Every name can still be locked at once once the run is over.
            for name in names:
                lease = await coords[0].lock(name, ttl=2, timeout=5).acquire()
                await lease.release()
        finally:
            await asyncio.gather(*(c.aclose() for c in coords))


class TestUrls:
    def test_sentinel_and_cluster_urls_are_checked(self) -> None:
        """Bad Sentinel and Cluster URLs fail at connect() with a clear ValueError."""
        with pytest.raises(ValueError, match="names no service"):
            asynclock.connect("redis+sentinel://127.0.0.1:26379")
        with pytest.raises(ValueError, match="bad port"):
            asynclock.connect("redis+sentinel://127.0.0.1:x/svc")
        with pytest.raises(ValueError, match="out of range"):
            asynclock.connect("redis+cluster://127.0.0.1:70000")
        with pytest.raises(ValueError, match="no query string"):
            asynclock.connect("redis+cluster://127.0.0.1:7000?x=1")
        with pytest.raises(ValueError, match="not supported on Redis Cluster"):
            asynclock.connect("redis+cluster://127.0.0.1:7000", sync_replicas=1)
        with pytest.raises(ValueError, match="Redlock nodes must be"):
            asynclock.connect(["redis+cluster://127.0.0.1:7000"] * 3)
        with pytest.raises(ValueError, match="sync_replicas must be >= 0"):
            asynclock.connect("redis://127.0.0.1:6379/0", sync_replicas=-1)
