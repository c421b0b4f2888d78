"""The fault-injecting proxy, between real clients and the shared Valkey server."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.exceptions
from pytest_asynclock.proxy import FaultProxy, ProxyProcess
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

import asynclock
from asynclock import LockLost

from ._deadline import ends

MakeClient = Callable[..., Redis]

_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


@pytest.fixture
async def proxy(asynclock_redis_url: str) -> AsyncIterator[FaultProxy]:
    """A proxy in front of the shared Valkey server, stopped after the test."""
    async with FaultProxy.from_url(asynclock_redis_url) as started:
        yield started


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """Redis clients without retries (one fault, one error), all closed at the end."""
    made: list[Redis] = []

    def make(host: str, port: int, timeout: float | None = 0.5) -> Redis:
        client = Redis(
            host=host,
            port=port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
        made.append(client)
        return client

    yield make
    for client in made:
        await client.aclose()


async def ping_times(client: Redis, count: int = 7) -> list[float]:
    """Round trips of ``count`` PINGs, in seconds."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        assert await client.ping()
        times.append(time.perf_counter() - began)
    return times


class TestArguments:
    def test_non_loopback_target_is_refused(self) -> None:
        """A target outside the loopback interface raises ValueError: no relaying."""
        # Any-address targets too: they would reach every interface.
        for host in ("10.1.2.3", "8.8.8.8", "example.com", "0.0.0.0", "::"):  # noqa: S104
            with pytest.raises(ValueError, match="loopback"):
                FaultProxy(host, 6379)
        with pytest.raises(ValueError, match="loopback"):
            FaultProxy.from_url("redis://192.168.1.10:6379/0")

    def test_loopback_targets_are_accepted(self) -> None:
        """127.0.0.0/8, ::1 and localhost are accepted targets."""
        for host in ("127.0.0.1", "127.3.2.1", "::1", "localhost"):
            assert FaultProxy(host, 6379).target == (host, 6379)

    async def test_url_for_rewrites_host_and_port(self) -> None:
        """url_for keeps scheme, credentials, path and query, and points at the proxy."""
        async with FaultProxy("127.0.0.1", 6379) as proxy:
            port = proxy.port
            assert proxy.url_for("redis://:s3cret@127.0.0.1:6379/3") == (
                f"redis://:s3cret@127.0.0.1:{port}/3"
            )
            assert proxy.url_for("postgresql://postgres@localhost:5432/db?sslmode=disable") == (
                f"postgresql://postgres@127.0.0.1:{port}/db?sslmode=disable"
            )
            with pytest.raises(ValueError, match="host"):
                proxy.url_for("unix:///tmp/redis.sock")

    async def test_bad_faults_raise(self, proxy: FaultProxy) -> None:
        """Negative latencies, unknown actions and malformed steps raise at the call."""
        with pytest.raises(ValueError, match=">= 0"):
            proxy.set_latency(-1.0)
        with pytest.raises(ValueError, match="unknown action"):
            proxy.apply("explode")
        with pytest.raises(ValueError, match="unknown action"):
            proxy.schedule([(0.1, "explode")])
        with pytest.raises(ValueError, match="no arguments"):
            proxy.apply("heal", 1.0)


class TestFaults:
    async def test_latency_is_added_to_round_trips(
        self, proxy: FaultProxy, make_client: MakeClient
    ) -> None:
        """set_latency(0.05) adds at least 2 x 50 ms to a PING round trip, and heal()
        takes it away."""
        client = make_client(proxy.host, proxy.port, timeout=5.0)
        base = statistics.median(await ping_times(client))
        proxy.set_latency(0.05)
        slow = await ping_times(client)
        assert min(slow) >= 0.099, slow
        assert statistics.median(slow) < base + 0.1 + 0.5, slow
        proxy.heal()
        assert statistics.median(await ping_times(client)) < 0.09
        assert proxy.stats.bytes_up > 0
        assert proxy.stats.bytes_down > 0

    async def test_jitter_keeps_order(self, proxy: FaultProxy, namespace: str) -> None:
        """With jitter, chunks still arrive in order: 50 INCRs sent one by one are
        answered 1..50."""
        key = f"{namespace}:counter".encode()
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        try:
            proxy.set_latency(0.001, jitter=0.02)
            for _ in range(50):
                writer.write(b"INCR " + key + b"\r\n")  # each its own chunk, own delay
                await asyncio.sleep(0.002)
            replies = [await asyncio.wait_for(reader.readline(), 5) for _ in range(50)]
            writer.write(b"DEL " + key + b"\r\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b":1\r\n"
        finally:
            writer.close()
        assert replies == [b":%d\r\n" % i for i in range(1, 51)]

    async def test_blackhole_times_out_and_heal_restores(
        self, proxy: FaultProxy, make_client: MakeClient
    ) -> None:
        """A black hole makes commands on live and new connections time out; after heal()
        the same client works again."""
        client = make_client(proxy.host, proxy.port, timeout=0.3)
        assert await client.ping()
        proxy.blackhole()
        assert proxy.mode == "blackhole"
        with pytest.raises(redis.exceptions.TimeoutError):
            await client.ping()
        fresh = make_client(proxy.host, proxy.port, timeout=0.3)
        with pytest.raises(_REDIS_ERRORS):
            await fresh.ping()
        assert proxy.stats.held_up > 0
        proxy.heal()
        assert await client.ping()
        assert await fresh.ping()

    async def test_reset_fails_a_live_connection(
        self, proxy: FaultProxy, make_client: MakeClient, namespace: str
    ) -> None:
        """reset() aborts a live connection with an RST: a command in flight fails with a
        connection error; new connections work."""
        client = make_client(proxy.host, proxy.port, timeout=None)
        assert await client.ping()
        blocked = asyncio.ensure_future(client.blpop([f"{namespace}:never"], timeout=10))
        await asyncio.sleep(0.2)  # the BLPOP is waiting in the server
        assert not blocked.done()
        proxy.reset()
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(blocked, 5)
        assert proxy.stats.resets >= 1
        assert await client.ping()  # a new connection goes through

    async def test_reset_is_an_rst(self, proxy: FaultProxy) -> None:
        """The client side of a reset connection reads ECONNRESET, not an orderly close."""
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        try:
            writer.write(b"PING\r\n")
            assert await reader.readline() == b"+PONG\r\n"
            proxy.reset()
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()

    async def test_refuse_closes_new_connections(
        self, proxy: FaultProxy, make_client: MakeClient
    ) -> None:
        """refuse() resets new connections at once; live ones carry on; heal() ends it."""
        live = make_client(proxy.host, proxy.port)
        assert await live.ping()
        proxy.refuse()
        began = time.perf_counter()
        with pytest.raises(redis.exceptions.ConnectionError):
            await make_client(proxy.host, proxy.port, timeout=5.0).ping()
        assert time.perf_counter() - began < 2.0  # refused, not timed out
        assert await live.ping()
        assert proxy.stats.refused >= 1
        proxy.heal()
        assert await make_client(proxy.host, proxy.port).ping()

    async def test_schedule_applies_steps_in_order(self, proxy: FaultProxy) -> None:
        """schedule() applies its steps at their times, in time order, then ends."""
        began = time.monotonic()
        steps = [(0.0, "latency", 0.01), (0.3, "heal"), (0.1, "refuse"), (0.2, "blackhole")]
        await asyncio.wait_for(proxy.schedule(steps), 5)  # type: ignore[arg-type]
        assert [action for _, action, _ in proxy.log] == ["latency", "refuse", "blackhole", "heal"]
        offsets = [at - began for at, _, _ in proxy.log]
        assert offsets == sorted(offsets)
        for offset, expected in zip(offsets, (0.0, 0.1, 0.2, 0.3), strict=True):
            assert offset >= expected - 0.005
        assert proxy.log[0][2] == (0.01, 0.0)
        assert proxy.mode == "pass"
        assert proxy.latency == (0.0, 0.0)

    async def test_stop_ends_connections_and_tasks(self, asynclock_redis_url: str) -> None:
        """stop() closes every proxied connection and cancels every task it started,
        pending schedules included."""
        before = asyncio.all_tasks()
        proxy = FaultProxy.from_url(asynclock_redis_url)
        await proxy.start()
        streams = [await asyncio.open_connection(proxy.host, proxy.port) for _ in range(3)]
        for reader, writer in streams:
            writer.write(b"PING\r\n")
            assert await reader.readline() == b"+PONG\r\n"
        pending = proxy.schedule([(60.0, "blackhole")])
        assert proxy.stats.active == 3
        await proxy.stop()
        assert pending.cancelled()
        assert proxy.stats.active == 0
        for reader, writer in streams:
            with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(reader.readexactly(1), 5)
            writer.close()
        await asyncio.sleep(0)
        assert not asyncio.all_tasks() - before


class TestProcess:
    async def test_control_channel_drives_a_proxy_process(
        self, asynclock_redis_url: str, make_client: MakeClient
    ) -> None:
        """python -m pytest_asynclock.proxy obeys latency/blackhole/heal/stats on stdin,
        answers errors, and exits when stopped."""
        proxy = FaultProxy.from_url(asynclock_redis_url)  # only to parse the target
        host, port = proxy.target
        with ProxyProcess.start(host, port) as child:
            client = make_client(child.host, child.port, timeout=0.5)
            assert await client.ping()
            assert child.send("latency 0.05") == ""
            assert min(await ping_times(client, 3)) >= 0.099
            assert child.send("blackhole") == ""
            with pytest.raises(redis.exceptions.TimeoutError):
                await client.ping()
            assert child.send("heal") == ""
            assert await client.ping()
            stats = child.stats()
            assert stats.connections >= 2
            assert stats.held_up > 0
            with pytest.raises(RuntimeError, match="unknown action"):
                child.send("explode")
        assert child.returncode == 0


class TestLockThroughProxy:
    async def test_blackhole_loses_the_lease_within_its_ttl(
        self, proxy: FaultProxy, asynclock_redis_url: str, namespace: str
    ) -> None:
        """A holder whose server falls into a black hole has its body cancelled and gets
        LockLost within the TTL; the server then lets the lock expire for the next."""
        loop = asyncio.get_running_loop()
        entered = asyncio.Event()
        cancelled_at: list[float] = []
        coord = asynclock.connect(proxy.url_for(asynclock_redis_url), prefix=namespace)
        other = asynclock.connect(asynclock_redis_url, prefix=namespace)
        try:

            async def hold() -> int:
                async with coord.lock("job", ttl=1) as lease:
                    entered.set()
                    try:
                        await asyncio.sleep(30)
                    except asyncio.CancelledError:
                        cancelled_at.append(loop.time())
                        raise
                    return lease.fence

            holder = asyncio.create_task(hold())
            await asyncio.wait_for(entered.wait(), 5)
            await asyncio.sleep(0.5)  # renewals have gone through the proxy
            blackholed_at = loop.time()
            proxy.blackhole()
            with pytest.raises(LockLost, match="validity"):
                await ends(holder, "the end of validity behind a black hole did not stop the body")
            assert cancelled_at
            assert cancelled_at[0] - blackholed_at <= 1.0
            # The holder could not release: the server's TTL frees the lock.
            async with other.lock("job", ttl=1, timeout=2) as lease:
                assert lease.fence > 0
        finally:
            proxy.heal()
            await coord.aclose()
            await other.aclose()
