"""Semaphores, read-write locks and fair locks on real Valkey: one node and Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator

import pytest
from pytest_asynclock import ClusterSetup, ValkeyFactory
from redis.asyncio import Redis

import asynclock
from asynclock import Backoff, Lease, LockNotOwned, LockTimeout
from asynclock.backends import Claim, Kind, RedisBackend, RedlockBackend

from .conftest import eventually, redis_backend
from .test_security import PASSWORD, REDIS_ACL_RULES, command, user_url

# What read-write locks and semaphores need beyond the README's ACL line for locks.
ACL_ADDITIONS = "+zcard"

# A waiter that is not woken tries again only after 5 s: a grant sooner came by wake-up.
SLOW_RETRY = Backoff(initial=5.0, maximum=5.0, jitter=False)

PERMIT_HOLDER = """
import asyncio, sys, asynclock
async def main():
    async with asynclock.connect(sys.argv[1], prefix=sys.argv[2]) as coord:
        async with coord.semaphore("s", 1, ttl=float(sys.argv[3])):
            print("held", flush=True)
            await asyncio.sleep(3600)
asyncio.run(main())
"""

FAIR_WAITER = """
import asyncio, sys, asynclock
async def main():
    async with asynclock.connect(sys.argv[1], prefix=sys.argv[2]) as coord:
        retry = asynclock.Backoff(initial=1, maximum=1, jitter=False)
        await coord.lock("f", ttl=30, fair=True, retry=retry).acquire()
asyncio.run(main())
"""


@pytest.fixture
async def raw(asynclock_redis_url: str) -> AsyncIterator[Redis]:
    """A plain client on the shared server, to look behind the library's back."""
    client = Redis.from_url(asynclock_redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def coords(
    asynclock_redis_url: str, namespace: str
) -> AsyncIterator[list[asynclock.Coordinator]]:
    """Three coordinators (three clients) on one namespace of the shared server."""
    made = [asynclock.connect(asynclock_redis_url, prefix=namespace) for _ in range(3)]
    yield made
    for coord in made:
        await coord.aclose()


async def until_queued(raw: Redis, key: str, count: int, within: float = 10.0) -> None:
    """Wait until the server's queue ``key`` has ``count`` entries."""
    deadline = time.monotonic() + within
    while await raw.zcard(key) < count:
        assert time.monotonic() < deadline, f"{key} never reached {count} waiters"
        await asyncio.sleep(0.01)


async def leftovers(raw: Redis, namespace: str) -> set[str]:
    """The namespace's keys other than fence counters (which outlive their locks) and
    released values (remembered for a few seconds after a release)."""
    keys = {key.decode() async for key in raw.scan_iter(match=f"{namespace}:*")}
    return {key for key in keys if not key.endswith((":fence", ":released"))}


@contextlib.asynccontextmanager
async def subprocess(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A Python child process, killed (SIGKILL) at the end if still alive."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", *args, stdout=asyncio.subprocess.PIPE
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


class TestSemaphore:
    async def test_fifty_tasks_over_three_coordinators_never_exceed_the_limit(
        self, coords: list[asynclock.Coordinator], raw: Redis, namespace: str
    ) -> None:
        """50 tasks on 3 clients share 5 permits: never more than 5 inside, all finish,
        and nothing but the fence counter is left on the server."""
        inside = 0
        most = 0
        fences: list[int] = []

        async def work(i: int) -> None:
            nonlocal inside, most
            async with coords[i % 3].semaphore("pool", 5, ttl=10) as permit:
                inside += 1
                most = max(most, inside)
                fences.append(permit.fence)
                await asyncio.sleep(0.02)
                inside -= 1

        await asyncio.wait_for(asyncio.gather(*(work(i) for i in range(50))), 30)
        assert most == 5
        assert len(fences) == len(set(fences)) == 50
        assert await leftovers(raw, namespace) == set()

    async def test_a_release_wakes_a_waiter(
        self, coords: list[asynclock.Coordinator], raw: Redis, namespace: str
    ) -> None:
        """A permit given back wakes the waiter on another client at once (no polling)."""
        held = await coords[0].semaphore("s", 1, ttl=10).acquire()
        waiter = asyncio.create_task(
            coords[1].semaphore("s", 1, ttl=10, retry=SLOW_RETRY, timeout=8).acquire()
        )
        await until_queued(raw, f"{namespace}:{{s}}:permits:queue", 1)
        released = time.monotonic()
        await held.release()
        second = await waiter
        assert time.monotonic() - released < 1.0
        assert second.fence > held.fence
        await second.release()

    async def test_a_killed_holder_frees_its_permit_within_its_ttl(
        self, redis_coord: asynclock.Coordinator, asynclock_redis_url: str, namespace: str
    ) -> None:
        """A process holding the only permit is killed (SIGKILL): a waiter gets the
        permit once the dead holder's TTL (1.5 s) has run out, not later."""
        ttl = 1.5
        async with subprocess(PERMIT_HOLDER, asynclock_redis_url, namespace, str(ttl)) as proc:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            assert line.strip() == b"held"
            with pytest.raises(LockTimeout):
                await redis_coord.semaphore("s", 1, timeout=0).acquire()
            proc.kill()
            killed = time.monotonic()
            permit = await redis_coord.semaphore("s", 1, ttl=10, timeout=5).acquire()
            assert time.monotonic() - killed < ttl + 0.3
            await permit.release()

    async def test_extend_and_release_only_by_a_live_holder(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """A held permit is renewed by the watchdog; an expired one is neither extended
        (never revived) nor released; a refused attempt says when the first expires."""
        async with redis_coord.semaphore("s", 2, ttl=0.6) as renewed:
            await asyncio.sleep(1.0)  # past its first ttl
            assert not renewed.lost
        permit = await redis_coord.semaphore("s", 1, ttl=0.3, renew=False).acquire()
        backend = redis_backend(redis_coord)
        other = Claim("s", "f" * 32, "other", Kind.PERMIT, limit=1)
        refused = await backend.try_acquire(other, 10)
        assert refused.fence is None
        assert refused.retry_after is not None
        assert 0 < refused.retry_after <= 0.3
        await asyncio.sleep(0.4)
        with pytest.raises(LockNotOwned):
            await permit.extend()
        with pytest.raises(LockNotOwned):
            await permit.release()
        assert await raw.exists(f"{namespace}:{{s}}:permits") == 0

    async def test_a_retried_acquire_returns_the_same_grant(
        self, redis_coord: asynclock.Coordinator
    ) -> None:
        """The same holder asking again (a reply lost) keeps its permit and its fence."""
        backend = redis_backend(redis_coord)
        claim = Claim("s", "a" * 32, "me", Kind.PERMIT, limit=2)
        first = await backend.try_acquire(claim, 10)
        again = await backend.try_acquire(claim, 10)
        assert first.fence is not None
        assert again.fence == first.fence
        other = Claim("s", "b" * 32, "me", Kind.PERMIT, limit=2)
        assert (await backend.try_acquire(other, 10)).fence is not None
        assert await backend.release(claim)
        assert await backend.release(other)
        assert await backend.release(claim)  # the same release again (a reply lost)

    async def test_semaphores_live_apart_from_locks(
        self, redis_coord: asynclock.Coordinator
    ) -> None:
        """A lock and a semaphore of the same name do not block each other, and the
        semaphore has fences of its own, strictly increasing."""
        async with redis_coord.lock("x", timeout=0):
            async with redis_coord.semaphore("x", 1, timeout=0) as first:
                pass
            async with redis_coord.semaphore("x", 1, timeout=0) as second:
                assert second.fence > first.fence


class TestReadWrite:
    async def test_readers_overlap_and_a_writer_excludes_them(
        self, coords: list[asynclock.Coordinator], raw: Redis, namespace: str
    ) -> None:
        """Readers on several clients hold at once; a writer (rw.write() or a plain lock
        of the name) is refused while they hold, and readers while a writer holds."""
        rws = [coord.rwlock("doc", ttl=10) for coord in coords]
        readers = [await rws[i % 3].read().acquire() for i in range(6)]
        with pytest.raises(LockTimeout):
            await coords[0].rwlock("doc", timeout=0).write().acquire()
        with pytest.raises(LockTimeout):
            await coords[1].lock("doc", timeout=0).acquire()
        assert len({lease.fence for lease in readers}) == 6
        info = await coords[2].inspect("doc")
        assert info is not None
        assert info.fence in {lease.fence for lease in readers}
        await asyncio.gather(*(lease.release() for lease in readers))
        assert await leftovers(raw, namespace) == set()
        writer = await rws[1].write().acquire()
        assert writer.fence > max(lease.fence for lease in readers)
        with pytest.raises(LockTimeout):
            await coords[2].rwlock("doc", timeout=0).read().acquire()
        await writer.release()

    async def test_a_released_writer_wakes_every_waiting_reader(
        self, coords: list[asynclock.Coordinator]
    ) -> None:
        """Readers waiting on three clients all get in together when the writer leaves,
        by wake-up (their own retry is 5 s away)."""
        writer = await coords[0].rwlock("doc", ttl=10).write().acquire()
        inside = 0
        most = 0
        gate = asyncio.Event()

        async def read(coord: asynclock.Coordinator) -> None:
            nonlocal inside, most
            async with coord.rwlock("doc", ttl=10, timeout=8, retry=SLOW_RETRY).read():
                inside += 1
                most = max(most, inside)
                await gate.wait()
                inside -= 1

        tasks = [asyncio.create_task(read(coords[i % 3])) for i in range(9)]
        await asyncio.sleep(0.3)  # all refused and queued
        released = time.monotonic()
        await writer.release()
        assert await eventually(lambda: most == 9, within=1.0)
        assert time.monotonic() - released < 1.0
        gate.set()
        await asyncio.gather(*tasks)

    async def test_a_waiting_writer_gets_in_despite_a_stream_of_readers(
        self, coords: list[asynclock.Coordinator]
    ) -> None:
        """Readers keep coming (a new one every 20 ms, each holding 200 ms): a writer
        that asks is refused at first, then new readers wait behind it, and it gets in
        within one reader's hold plus 0.5 s."""
        hold = 0.2
        stop = asyncio.Event()
        writing = False
        overlaps = 0

        async def read(coord: asynclock.Coordinator) -> None:
            nonlocal overlaps
            async with coord.rwlock("hot", ttl=10).read():
                overlaps += writing
                await asyncio.sleep(hold)
                overlaps += writing

        async def stream() -> None:
            tasks: set[asyncio.Task[None]] = set()
            i = 0
            while not stop.is_set():
                task = asyncio.create_task(read(coords[i % 2]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks)

        readers = asyncio.create_task(stream())
        await asyncio.sleep(0.5)  # readers hold continuously by now
        asked = time.monotonic()
        async with coords[2].rwlock("hot", ttl=10, timeout=5).write():
            waited = time.monotonic() - asked
            writing = True
            await asyncio.sleep(0.1)
            writing = False
        stop.set()
        await readers
        assert waited < hold + 0.5
        assert overlaps == 0

    async def test_a_writer_that_gives_up_lets_the_readers_in(
        self, coords: list[asynclock.Coordinator]
    ) -> None:
        """A writer that times out while readers hold stops keeping new readers out:
        a reader queued behind it is woken and gets in at once."""
        reader = await coords[0].rwlock("doc", ttl=10).read().acquire()
        writer = asyncio.create_task(coords[1].rwlock("doc", ttl=10, timeout=0.5).write().acquire())
        await asyncio.sleep(0.2)
        late = asyncio.create_task(
            coords[2].rwlock("doc", ttl=10, timeout=8, retry=SLOW_RETRY).read().acquire()
        )
        await asyncio.sleep(0.1)
        assert not late.done()  # behind the writer
        with pytest.raises(LockTimeout):
            await writer
        second = await asyncio.wait_for(late, 1.0)
        await asyncio.gather(reader.release(), second.release())

    async def test_a_reader_lease_is_renewed_and_never_revived(
        self, redis_coord: asynclock.Coordinator, raw: Redis, namespace: str
    ) -> None:
        """The watchdog renews readers (the lock key lives as long as the last one);
        an expired reader is neither extended nor released."""
        rw = redis_coord.rwlock("doc", ttl=0.6)
        async with rw.read() as renewed:
            await asyncio.sleep(1.0)  # past its first ttl
            assert not renewed.lost
            assert 0 < await raw.pttl(f"{namespace}:{{doc}}") <= 600
        stale = await redis_coord.rwlock("doc", ttl=0.3, renew=False).read().acquire()
        await asyncio.sleep(0.4)
        with pytest.raises(LockNotOwned):
            await stale.extend()
        with pytest.raises(LockNotOwned):
            await stale.release()
        assert await redis_coord.inspect("doc") is None


class TestFair:
    async def test_twenty_waiters_get_the_lock_in_arrival_order(
        self, coords: list[asynclock.Coordinator], raw: Redis, namespace: str
    ) -> None:
        """20 waiters on 3 clients, queued one after the other, get the lock in that
        order, though each also retries on its own timer."""
        holder = await coords[0].lock("f", ttl=10, fair=True).acquire()
        order: list[int] = []

        async def wait(i: int) -> None:
            lock = coords[i % 3].lock("f", ttl=10, fair=True, timeout=20)
            async with lock:
                order.append(i)
                await asyncio.sleep(0.01)

        tasks = []
        for i in range(20):
            tasks.append(asyncio.create_task(wait(i)))
            await until_queued(raw, f"{namespace}:{{f}}:queue", i + 1)
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert order == list(range(20))

    async def test_nobody_barges_past_the_queue(self, redis_coord: asynclock.Coordinator) -> None:
        """A free fair lock is refused to a newcomer while an earlier waiter is queued,
        and granted to that waiter."""
        backend = redis_backend(redis_coord)
        holder = Claim("f", "a" * 32, "me", Kind.FAIR)
        first = Claim("f", "b" * 32, "me", Kind.FAIR)
        newcomer = Claim("f", "c" * 32, "me", Kind.FAIR)
        assert (await backend.try_acquire(holder, 10)).fence is not None
        assert (await backend.try_acquire(first, 10, wait=None)).fence is None  # queued
        assert await backend.release(holder)
        refused = await backend.try_acquire(newcomer, 10)
        assert refused.fence is None
        assert refused.retry_after is not None
        assert refused.retry_after <= first.recheck + 1
        assert (await backend.try_acquire(first, 10, wait=None)).fence is not None
        assert await backend.release(first)
        assert (await backend.try_acquire(newcomer, 10)).fence is not None
        assert await backend.release(newcomer)

    async def test_a_dead_waiter_is_skipped_when_its_place_lapses(
        self, redis_coord: asynclock.Coordinator, raw: Redis, asynclock_redis_url: str,
        namespace: str,
    ) -> None:  # fmt: skip
        """The first in line is killed (SIGKILL): the next waiter gets the lock once the
        dead one's place lapsed (its 1 s backoff maximum plus 1 s), not later."""
        holder = await redis_coord.lock("f", ttl=30, fair=True).acquire()
        queue = f"{namespace}:{{f}}:queue"
        async with subprocess(FAIR_WAITER, asynclock_redis_url, namespace) as proc:
            await until_queued(raw, queue, 1, within=20)
            waiter = asyncio.create_task(redis_coord.lock("f", ttl=30, fair=True).acquire())
            await until_queued(raw, queue, 2)
            proc.kill()
            killed = time.monotonic()
            await holder.release()
            lease = await asyncio.wait_for(waiter, 5)
            assert time.monotonic() - killed < 2.0 + 0.5
            await lease.release()

    async def test_a_waiter_that_gives_up_passes_its_turn_on(
        self, coords: list[asynclock.Coordinator], raw: Redis, namespace: str
    ) -> None:
        """The first in line is cancelled: it leaves the queue and the next one is
        woken at once when the lock is free."""
        holder = await coords[0].lock("f", ttl=10, fair=True).acquire()
        queue = f"{namespace}:{{f}}:queue"
        first = asyncio.create_task(coords[1].lock("f", fair=True, retry=SLOW_RETRY).acquire())
        await until_queued(raw, queue, 1)
        second = asyncio.create_task(coords[2].lock("f", fair=True, retry=SLOW_RETRY).acquire())
        await until_queued(raw, queue, 2)
        await holder.release()
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            lease = await first
            await lease.release()  # it won the race with the cancel: hand on
        lease = await asyncio.wait_for(second, 1.0)
        await lease.release()
        assert await raw.exists(queue) == 0


class TestAcl:
    async def test_primitives_under_the_least_privilege_acl(
        self, asynclock_valkey_factory: ValkeyFactory
    ) -> None:
        """Fair locks need nothing beyond the locks' ACL line; semaphores and read-write
        locks add ZCARD. Waiting, waking, giving up: nothing is denied."""
        valkey = asynclock_valkey_factory(1)[0]
        admin = Redis(host=valkey.host, port=valkey.port)
        rules = REDIS_ACL_RULES.format(password=PASSWORD, prefix="asynclock")
        try:
            await command(admin, "ACL", "SETUSER", "locks", *rules.split())
            await command(admin, "ACL", "SETUSER", "all", *f"{rules} {ACL_ADDITIONS}".split())
            await command(admin, "ACL", "LOG", "RESET")
            async with (
                asynclock.connect(user_url(valkey, "locks")) as a,
                asynclock.connect(user_url(valkey, "locks")) as b,
            ):
                holder = await a.lock("f", fair=True).acquire()
                waiter = asyncio.create_task(b.lock("f", fair=True, timeout=5).acquire())
                with pytest.raises(LockTimeout):
                    await b.lock("f", fair=True, timeout=0.2).acquire()
                await holder.release()
                await (await waiter).release()
            async with (
                asynclock.connect(user_url(valkey, "all")) as a,
                asynclock.connect(user_url(valkey, "all")) as b,
            ):
                permit = await a.semaphore("s", 1).acquire()
                with pytest.raises(LockTimeout):
                    await b.semaphore("s", 1, timeout=0.2).acquire()
                waiter = asyncio.create_task(b.semaphore("s", 1, timeout=5).acquire())
                await asyncio.sleep(0.1)
                await permit.extend()
                await permit.release()
                await (await waiter).release()
                reader = await a.rwlock("rw").read().acquire()
                assert await b.inspect("rw") is not None
                writer = asyncio.create_task(b.rwlock("rw", timeout=5).write().acquire())
                await asyncio.sleep(0.1)  # the writer is refused and queued
                with pytest.raises(LockTimeout):
                    await b.rwlock("rw", timeout=0.2).read().acquire()
                await reader.extend()
                await reader.release()
                lease = await writer
                late = asyncio.create_task(a.rwlock("rw", timeout=5).read().acquire())
                await asyncio.sleep(0.1)
                await lease.release()
                await (await late).release()
            assert await command(admin, "ACL", "LOG") == []
        finally:
            await admin.aclose()


class TestClusterAndRedlock:
    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    # redis-py's cluster client can drop a node object (a slot-map refresh on a loaded
    # machine) with a connection it made in acquire_connection() and never closed: that
    # connection warns when collected, outside anything asynclock holds or closes.
    @pytest.mark.filterwarnings(
        "ignore:unclosed Connection <redis.asyncio.connection.Connection:ResourceWarning"
    )
    async def test_contention_on_a_healthy_cluster_loses_nothing(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """Two coordinators, 36 tasks over 12 names, each taking its name 4 times: no
        release reports a loss and no two sections of a name overlap. (redis-py's cluster
        client used to close every connection after each fifth MOVED reply and send the
        commands in flight again; a release sent again found its lock gone: 16-30
        spurious ``LockLost`` per run.)"""
        lost: list[str] = []
        inside: dict[str, int] = {}
        fences: dict[str, list[int]] = {}
        async with (
            asynclock.connect(asynclock_cluster.url) as a,
            asynclock.connect(asynclock_cluster.url) as b,
        ):

            async def worker(i: int) -> None:
                coord, name = (a, b)[i % 2], f"busy{i % 12}"
                for _ in range(4):
                    try:
                        async with coord.lock(name, ttl=10, timeout=20) as lease:
                            inside[name] = inside.get(name, 0) + 1
                            try:
                                assert inside[name] == 1, f"two holders of {name}"
                                fences.setdefault(name, []).append(lease.fence)
                                await asyncio.sleep(0.005)
                            finally:
                                inside[name] -= 1
                    except asynclock.LockLost as exc:
                        lost.append(str(exc))

            await asyncio.gather(*(worker(i) for i in range(36)))
        assert lost == []
        for name, seen in fences.items():
            assert len(seen) == 12, name
            assert seen == sorted(set(seen)), name

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_each_primitive_on_names_over_every_master(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """Semaphores, read-write locks and fair locks work on names of all three
        masters, woken by sharded pub/sub."""
        names = ["a", "b", "c", "d", "e", "f"]
        slots = {asynclock_cluster.keyslot(f"asynclock:{{{n}}}") for n in names}
        assert len({asynclock_cluster.node_for_slot(s).port for s in slots}) == 3
        async with (
            asynclock.connect(asynclock_cluster.url) as a,
            asynclock.connect(asynclock_cluster.url) as b,
        ):
            for name in names:
                inside = 0
                most = 0

                async def permit(coord: asynclock.Coordinator, name: str = name) -> None:
                    nonlocal inside, most
                    async with coord.semaphore(name, 2, ttl=10, timeout=8, retry=SLOW_RETRY):
                        inside += 1
                        most = max(most, inside)
                        await asyncio.sleep(0.05)
                        inside -= 1

                await asyncio.gather(*(permit((a, b)[i % 2]) for i in range(8)))
                assert most == 2, name

                readers = [await c.rwlock(name, ttl=10).read().acquire() for c in (a, b)]
                with pytest.raises(LockTimeout):
                    await a.rwlock(name, timeout=0).write().acquire()
                writer = asyncio.create_task(
                    b.rwlock(name, ttl=10, timeout=8, retry=SLOW_RETRY).write().acquire()
                )
                await asyncio.sleep(0.1)
                released = time.monotonic()
                await asyncio.gather(*(lease.release() for lease in readers))
                lease = await writer
                assert time.monotonic() - released < 1.0, name
                await lease.release()

                holder = await a.lock(name, ttl=10, fair=True).acquire()
                order: list[int] = []
                tasks: list[asyncio.Task[None]] = []

                async def fair(i: int, name: str = name, order: list[int] = order) -> None:
                    lock = (a, b)[i % 2].lock(name, ttl=10, fair=True, retry=SLOW_RETRY)
                    async with lock:
                        order.append(i)

                for i in range(4):
                    tasks.append(asyncio.create_task(fair(i)))
                    await asyncio.sleep(0.1)  # queued in this order
                await holder.release()
                await asyncio.wait_for(asyncio.gather(*tasks), 5)
                assert order == [0, 1, 2, 3], name

    async def test_redlock_offers_none_of_them(self, asynclock_redlock_urls: list[str]) -> None:
        """Redlock composes RedisBackend nodes but supports none of the three; asking
        for one is a ValueError, and its plain locks still work."""
        async with asynclock.connect(asynclock_redlock_urls) as coord:
            backend = coord.backend
            assert isinstance(backend, RedlockBackend)
            assert Kind.SHARED not in backend.kinds
            assert Kind.PERMIT not in backend.kinds
            assert Kind.FAIR not in backend.kinds
            assert Kind.SHARED in RedisBackend.kinds
            assert Kind.PERMIT in RedisBackend.kinds
            with pytest.raises(ValueError, match="semaphore"):
                coord.semaphore("s", 2)
            with pytest.raises(ValueError, match="read-write"):
                coord.rwlock("rw")
            with pytest.raises(ValueError, match="fair"):
                coord.lock("f", fair=True)
            lease: Lease
            async with coord.lock("plain", ttl=5) as lease:
                assert lease.fence > 0
