"""Redlock on five real Valkey processes: frozen, killed and restarted nodes, fences across
majorities, and contention."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import AsyncIterator

import pytest
from pytest_asynclock import FaultProxy, ValkeyFactory, ValkeyServer
from redis.asyncio import Redis

import asynclock
from asynclock import LockTimeout, QuorumError
from asynclock.backends import RedlockBackend
from asynclock.backends.base import Claim

from .conftest import eventually

NODE_TIMEOUT = 0.05


@pytest.fixture
def nodes(asynclock_valkey_factory: ValkeyFactory) -> list[ValkeyServer]:
    """Five private nodes this test may freeze, kill and restart."""
    return asynclock_valkey_factory(5)


@pytest.fixture
async def coord(nodes: list[ValkeyServer]) -> AsyncIterator[asynclock.Coordinator]:
    async with asynclock.connect([n.url for n in nodes], node_timeout=NODE_TIMEOUT) as coord:
        yield coord


async def held_on(nodes: list[ValkeyServer], name: str) -> list[bool]:
    """Which nodes have a lock key for ``name`` (asked directly, node by node)."""
    found = []
    for node in nodes:
        client = Redis.from_url(node.url, socket_timeout=1)
        try:
            found.append(bool(await client.exists(f"asynclock:{{{name}}}")))
        finally:
            await client.aclose()
    return found


class FencedResource:
    """A resource that accepts a write only with a fence at least the largest seen."""

    def __init__(self) -> None:
        self.largest = 0
        self.accepted: list[tuple[int, str]] = []
        self.rejected: list[tuple[int, str]] = []

    def write(self, fence: int, who: str) -> bool:
        if fence < self.largest:
            self.rejected.append((fence, who))
            return False
        self.largest = fence
        self.accepted.append((fence, who))
        return True


class TestArguments:
    def test_needs_three_nodes(self) -> None:
        """Fewer than 3 nodes are refused; 4 are accepted (majority 3)."""
        with pytest.raises(ValueError, match="at least 3"):
            asynclock.connect(["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0"])
        with pytest.raises(ValueError, match="redis"):
            asynclock.connect(["redis://127.0.0.1:1/0", "memory://", "redis://127.0.0.1:3/0"])
        coord = asynclock.connect([f"redis://127.0.0.1:{p}/0" for p in (1, 2, 3, 4)])
        backend = coord.backend
        assert isinstance(backend, RedlockBackend)
        assert backend.quorum == 3
        assert backend.node_timeout == 0.05
        with pytest.raises(ValueError, match="node_timeout"):
            asynclock.connect([f"redis://127.0.0.1:{p}/0" for p in (1, 2, 3)], node_timeout=0)


class TestFrozenNodes:
    @pytest.mark.parametrize("frozen", [1, 2])
    async def test_a_minority_frozen_costs_at_most_a_node_timeout(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator, frozen: int
    ) -> None:
        """With 1 or 2 of 5 nodes frozen, acquires succeed without waiting for the frozen
        nodes beyond their timeout (the exact p99 is in benchmarks/redlock.py)."""
        async with coord.lock("warm"):
            pass  # connections open before the freeze
        for node in nodes[:frozen]:
            node.freeze()
        latencies = []
        for _ in range(20):
            started = time.monotonic()
            lease = await coord.lock("minority", ttl=10).acquire()
            latencies.append(time.monotonic() - started)
            await lease.release()
        # Waiting for the slowest node would take the socket timeout (5 s) per call.
        assert max(latencies) < 4 * NODE_TIMEOUT + 0.1
        assert statistics.median(latencies) < NODE_TIMEOUT + 0.02

    async def test_a_majority_frozen_fails_fast_and_holds_nothing(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator
    ) -> None:
        """With 3 of 5 nodes frozen: QuorumError (or LockTimeout within the caller's
        timeout), and nothing left held on the two live nodes."""
        async with coord.lock("warm"):
            pass
        for node in nodes[:3]:
            node.freeze()
        started = time.monotonic()
        with pytest.raises(QuorumError):
            await coord.lock("majority", ttl=10).acquire()
        assert time.monotonic() - started < 2.0
        started = time.monotonic()
        with pytest.raises((LockTimeout, QuorumError)):
            await coord.lock("majority", ttl=10, timeout=0.3).acquire()
        assert time.monotonic() - started < 1.0
        assert await eventually(lambda: True)
        assert await held_on(nodes[3:], "majority") == [False, False]

    async def test_release_reaches_a_node_that_timed_out(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator
    ) -> None:
        """A node frozen during the acquire may take the lock when it wakes: the release
        goes to it too, and no node keeps the lock."""
        async with coord.lock("warm"):
            pass
        nodes[4].freeze()
        lease = await coord.lock("straggler", ttl=30).acquire()
        nodes[4].resume()
        await asyncio.sleep(0.2)  # the frozen node runs what it had received
        await lease.release()
        await asyncio.sleep(0.2)
        assert await held_on(nodes, "straggler") == [False] * 5


class TestFences:
    async def test_fences_grow_across_different_majorities(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator
    ) -> None:
        """Successive leases granted by different majorities (different pairs frozen)
        have strictly increasing fences."""
        async with coord.lock("warm"):
            pass
        fences = []
        for pair in [(0, 1), (3, 4), (1, 3), (0, 4), (2, 3), (0, 2), (1, 4)]:
            for i in pair:
                nodes[i].freeze()
            async with coord.lock("majorities", ttl=10) as lease:
                fences.append(lease.fence)
            for i in pair:
                nodes[i].resume()
            await asyncio.sleep(NODE_TIMEOUT * 3)  # stragglers done
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)

    async def test_a_node_whose_counter_runs_ahead(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator
    ) -> None:
        """A node whose fence counter is far ahead (a clock ahead, say) lifts one lease's
        fence; the next lease, on a majority without that node, still gets a larger one,
        because the first lease wrote its fence back to its whole majority."""
        async with coord.lock("warm"):
            pass
        ahead = Redis.from_url(nodes[4].url)
        seconds, micros = await ahead.time()
        far = (seconds + 10**7) * 10**6 + micros  # 115 days ahead of the server clock
        await ahead.set("asynclock:{ahead}:fence", str(far))
        await ahead.aclose()
        nodes[0].freeze()
        nodes[1].freeze()
        async with coord.lock("ahead", ttl=10) as first:  # majority {2, 3, 4}
            pass
        nodes[0].resume()
        nodes[1].resume()
        await asyncio.sleep(NODE_TIMEOUT * 3)
        assert first.fence > far
        nodes[3].freeze()
        nodes[4].freeze()
        async with coord.lock("ahead", ttl=10) as second:  # majority {0, 1, 2}
            pass
        nodes[3].resume()
        nodes[4].resume()
        assert second.fence > first.fence


class TestRestartedNode:
    async def _hold_on_first_three(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator, ttl: float
    ) -> asynclock.Lease:
        """A lease held on nodes 0-2 only (3 and 4 frozen while it is taken)."""
        nodes[3].freeze()
        nodes[4].freeze()
        lease = await coord.lock("restart", ttl=ttl).acquire()
        nodes[3].resume()
        nodes[4].resume()
        await asyncio.sleep(NODE_TIMEOUT * 3)
        # Woken up, 3 and 4 ran the acquire they had received; drop it there, as if it
        # had never reached them.
        for node in nodes[3:]:
            client = Redis.from_url(node.url)
            await client.delete("asynclock:{restart}")
            await client.aclose()
        assert await held_on(nodes, "restart") == [True, True, True, False, False]
        return lease

    async def test_restart_after_one_ttl_never_two_holders(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator
    ) -> None:
        """A node killed and restarted empty after waiting one TTL: the first holder has
        lost its lease before anyone else can take the lock."""
        ttl = 1.5
        async with coord.lock("warm"):
            pass
        first = await self._hold_on_first_three(nodes, coord, ttl)
        nodes[0].kill()
        await asyncio.sleep(ttl)
        nodes[0].restart()
        async with asynclock.connect([n.url for n in nodes], node_timeout=NODE_TIMEOUT) as other:
            second = await other.lock("restart", ttl=ttl, timeout=10).acquire()
            assert first.lost  # before the second holder got it
            assert second.fence > first.fence
            await second.release()

    async def test_restart_at_once_is_caught_by_the_fence(
        self, nodes: list[ValkeyServer], coord: asynclock.Coordinator
    ) -> None:
        """Restarted at once, the emptied node lets a second holder in while the first
        still believes it holds (Redlock's documented failure); the fence makes the
        resource reject the stale holder's write."""
        async with coord.lock("warm"):
            pass
        first = await self._hold_on_first_three(nodes, coord, ttl=30)
        nodes[0].kill()
        nodes[0].restart()
        resource = FencedResource()
        async with asynclock.connect([n.url for n in nodes], node_timeout=NODE_TIMEOUT) as other:
            second = await other.lock("restart", ttl=30, timeout=5).acquire()
            assert first.held  # two holders at once: what the restart rule prevents
            assert second.fence > first.fence
            assert resource.write(second.fence, "second")
            assert not resource.write(first.fence, "first")  # the stale holder is refused
            assert resource.rejected == [(first.fence, "first")]
            await second.release()
        with pytest.raises(asynclock.LockNotOwned):
            await first.release()


class TestContention:
    @pytest.mark.timeout(120)
    async def test_three_coordinators_do_not_livelock(self, nodes: list[ValkeyServer]) -> None:
        """3 coordinators contending on 5 nodes: all 200 acquisitions complete, one holder
        at a time, fences increasing."""
        urls = [n.url for n in nodes]
        coords = [asynclock.connect(urls, node_timeout=NODE_TIMEOUT) for _ in range(3)]
        inside = 0
        most = 0
        fences: list[int] = []

        async def worker(coord: asynclock.Coordinator, times: int) -> None:
            nonlocal inside, most
            for _ in range(times):
                async with coord.lock("contended", ttl=10, timeout=60) as lease:
                    inside += 1
                    most = max(most, inside)
                    fences.append(lease.fence)
                    await asyncio.sleep(0)
                    inside -= 1

        try:
            started = time.monotonic()
            await asyncio.gather(
                *(worker(coords[i % 3], 20) for i in range(10))  # 10 workers x 20 = 200
            )
            elapsed = time.monotonic() - started
        finally:
            for coord in coords:
                await coord.aclose()
        assert len(fences) == 200
        assert most == 1
        assert fences == sorted(fences)
        assert elapsed < 60


class TestLateReleases:
    async def test_a_late_release_of_a_refused_round_never_deletes_a_later_grant(
        self, asynclock_redlock_urls: list[str], namespace: str
    ) -> None:
        """A refused round's give-back may reach a node long after the next round was
        granted there (sent on a connection the client gave up on): every round writes a
        value of its own, so that release finds nothing of the lease's, on any node."""
        name = "late"
        clients = [Redis.from_url(url, socket_timeout=5) for url in asynclock_redlock_urls]
        backend = RedlockBackend(clients, node_timeout=0.25, prefix=namespace)
        lock_key = f"{namespace}:{{{name}}}"
        try:
            # Another holder on a majority: the first round is refused.
            for client in clients[:3]:
                await client.set(lock_key, "f" * 32 + ":other", px=30_000)
            claim = Claim(name, secrets.token_hex(16), "me")
            assert (await backend.try_acquire(claim, 30.0)).fence is None
            refused = claim.value
            for client in clients[:3]:
                await client.delete(lock_key)
            assert (await backend.try_acquire(claim, 30.0)).fence is not None
            # The first round's give-back lands now, everywhere.
            first = backend.nodes[0]
            for node in backend.nodes:
                await node.run(first.calls.release(first.keys(name), refused))
            assert await backend.extend(claim, 30.0)
            values = {await client.get(lock_key) for client in clients}
            assert values == {claim.value.encode()}
            assert await backend.release(claim)
        finally:
            await backend.aclose()
            for client in clients:
                await client.aclose()


async def pttls(nodes: list[ValkeyServer], key: str) -> list[int]:
    """Each node's PTTL of ``key`` (asked directly, node by node)."""
    found = []
    for node in nodes:
        client = Redis.from_url(node.url, socket_timeout=2)
        try:
            found.append(int(await client.pttl(key)))
        finally:
            await client.aclose()
    return found


class TestStragglers:
    async def test_a_late_shorter_extend_on_a_minority_bounds_the_next_confirmation(
        self, asynclock_valkey_factory: ValkeyFactory, namespace: str
    ) -> None:
        """An extend(2) confirmed by A and B is still on its way to C (its connection given
        up); extend(30) is then confirmed by B and C while A is cut off, and C's old copy
        lands after it: A and C keep ~2 s, so at no moment may the lease believe itself
        valid past what a majority of nodes keeps."""
        nodes = asynclock_valkey_factory(3)
        name = "straggler"
        key = f"{namespace}:{{{name}}}"
        proxies = [FaultProxy.from_url(node.url) for node in nodes]
        for proxy in proxies:
            await proxy.start()
        a, _, c = proxies
        urls = [proxy.url_for(node.url) for proxy, node in zip(proxies, nodes, strict=True)]
        try:
            async with asynclock.connect(
                urls, prefix=namespace, node_timeout=0.2, socket_timeout=0.4
            ) as coord:
                lease = await coord.lock(name, ttl=30.0, renew=False).acquire()
                c.set_latency(1.0)  # C's copy of the next extend lands 1 s late
                await lease.extend(2.0)  # A and B confirm
                # C's connection is given up at its socket timeout (0.4 s); its request
                # still travels (TCP delivers what was sent before the close).
                assert await eventually(lambda: c.stats.client_ends > 0, within=10.0)
                c.heal()
                a.blackhole()  # A misses the next extend
                await lease.extend(30.0)  # B and C confirm (C on a new connection)
                landed = False
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while lease.expires_in > 0 and loop.time() < deadline:
                    believed = loop.time() + lease.expires_in
                    left = await pttls(nodes, key)
                    now = loop.time()
                    kept = sorted(now + ms / 1000 if ms > 0 else now for ms in left)[1]
                    assert believed <= kept, (
                        f"believed valid {believed - kept:.3f}s past what a majority of "
                        f"nodes keeps ({left} ms)"
                    )
                    landed = landed or (0 < left[2] <= 2000 and left[1] > 5000)
                    await asyncio.sleep(0.05)
                assert landed, "C's late extend(2) never landed after extend(30)"
        finally:
            for proxy in proxies:
                await proxy.stop()
