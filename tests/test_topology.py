"""Redis Sentinel and Redis Cluster topologies built from valkey-server, with real clients."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio
import redis.exceptions
from pytest_asynclock import (
    ClusterSetup,
    SentinelSetup,
    ServerStartError,
    ValkeyServer,
)
from pytest_asynclock import servers as _servers
from redis.asyncio.cluster import ClusterNode as ClientNode
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

import asynclock
from tests.chaos import _Promotions

T = TypeVar("T")

# What a client may see while a topology changes under it.
_TRANSIENT = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MovedError,
    redis.exceptions.ResponseError,
)


def _gone(pid: int) -> bool:
    """Whether no live process has this PID (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            data = stat_file.read()
    except FileNotFoundError:
        return True
    return data[data.rindex(b")") + 2 :].split()[0] == b"Z"


def _sync(server: ValkeyServer, timeout: float = 2.0) -> redis.Redis:
    return redis.Redis(
        host=server.host,
        port=server.port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


def _role(server: ValkeyServer) -> tuple[str, int | None]:
    """(role, master port) from INFO replication."""
    with _sync(server) as client:
        info: dict[str, Any] = client.info("replication")
    port = info.get("master_port")
    return str(info["role"]), int(port) if port is not None else None


async def _until_ok(call: Callable[[], Awaitable[T]], within: float = 20.0) -> T:
    """Retry ``call`` through the errors of a changing topology until it succeeds."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except _TRANSIENT:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def _sentinel_clients(
    setup: SentinelSetup,
) -> AsyncIterator[tuple[redis.asyncio.Redis, redis.asyncio.Redis]]:
    """redis-py's ``master_for`` and ``slave_for`` clients of the setup's service."""
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
        setup.sentinels, socket_timeout=1.0, socket_connect_timeout=1.0
    )
    master = sentinel.master_for(setup.service)
    replica = sentinel.slave_for(setup.service)
    try:
        yield master, replica
    finally:
        await master.aclose()
        await replica.aclose()
        for client in sentinel.sentinels:  # the master_for client does not close these
            await client.aclose()


def _cluster_client(setup: ClusterSetup) -> RedisCluster:
    return RedisCluster(
        startup_nodes=[ClientNode(host, port) for host, port in setup.startup_nodes],
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
    )


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Fail if the test leaves a registered server or a child process behind."""
    registered = set(_servers._LIVE)
    children = {ref.pid for ref in _servers._descendants(os.getpid())}
    yield
    assert set(_servers._LIVE) <= registered
    now = {ref.pid for ref in _servers._descendants(os.getpid())}
    assert now <= children, f"left running: {sorted(now - children)}"


class TestSentinel:
    def test_comes_up_formed(self, asynclock_sentinel: SentinelSetup) -> None:
        """One master, two replicas in sync, three sentinels that know them and each other."""
        setup = asynclock_sentinel
        ports = [port for _, port in setup.sentinels]
        assert len(ports) == 3
        assert setup.url == (
            f"redis+sentinel://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]},"
            f"127.0.0.1:{ports[2]}/{setup.service}"
        )
        master = setup.master()
        assert master is setup.servers[0]
        assert setup.replicas() == setup.servers[1:]
        assert _role(master) == ("master", None)
        for replica in setup.replicas():
            assert _role(replica) == ("slave", master.port)
        for sentinel in setup.sentinel_servers:
            with _sync(sentinel) as client:
                assert len(client.execute_command("SENTINEL", "SENTINELS", setup.service)) == 2
                assert len(client.execute_command("SENTINEL", "REPLICAS", setup.service)) == 2
        assert setup.startup_time is not None
        assert len({node.pid for node in setup.processes}) == 6

    async def test_master_for_sets_and_gets(self, asynclock_sentinel: SentinelSetup) -> None:
        """redis-py's Sentinel client finds the master, writes, and reads from a replica."""
        async with _sentinel_clients(asynclock_sentinel) as (master, replica):
            assert await master.set("k", "v")
            assert await master.get("k") == b"v"
            assert await master.wait(2, 2000) == 2
            assert await replica.get("k") == b"v"

    async def test_failover_promotes_a_replica_and_the_client_follows(
        self, asynclock_sentinel: SentinelSetup
    ) -> None:
        """failover() makes a replica master (the old master its replica); the client's
        next writes go to the new master."""
        setup = asynclock_sentinel
        async with _sentinel_clients(setup) as (client, _):
            await client.set("k", "before")
            assert await client.wait(2, 2000) == 2
            old = setup.master()
            new = await asyncio.to_thread(setup.failover)
            assert new is not old
            assert new in setup.servers[1:]
            assert setup.master() is new
            assert _role(new) == ("master", None)
            assert _role(old) == ("slave", new.port)
            await _until_ok(lambda: client.set("k", "after"))
            assert await client.get("k") == b"after"
            with _sync(new) as direct:
                assert direct.get("k") == "after"

    async def test_coordinated_failover(self, asynclock_sentinel: SentinelSetup) -> None:
        """failover(coordinated=True) hands over without losing a write (Valkey >= 9)."""
        setup = asynclock_sentinel
        async with _sentinel_clients(setup) as (client, _):
            await client.set("k", "before")
            old = setup.master()
            new = await asyncio.to_thread(setup.failover, coordinated=True)
            assert new is not old
            assert _role(old) == ("slave", new.port)
            assert await _until_ok(lambda: client.get("k")) == b"before"
            await client.set("k", "after")
            with _sync(new) as direct:
                assert direct.get("k") == "after"

    async def test_kill_master_promotes_a_replica_and_the_client_recovers(
        self, asynclock_sentinel: SentinelSetup
    ) -> None:
        """kill_master() kills the master; a replica takes over; the client follows."""
        setup = asynclock_sentinel
        async with _sentinel_clients(setup) as (client, _):
            await client.set("k", "before")
            assert await client.wait(2, 2000) == 2
            old = setup.master()
            pid = old.pid
            assert pid is not None
            new = await asyncio.to_thread(setup.kill_master)
            assert _gone(pid)
            assert not old.running
            assert new is not old
            assert setup.master() is new
            assert setup.replicas() == [n for n in setup.servers if n not in (old, new)]
            assert await _until_ok(lambda: client.get("k")) == b"before"
            await client.set("k", "after")

    async def test_asynclock_locks_through_the_url(self, asynclock_sentinel: SentinelSetup) -> None:
        """asynclock.connect() takes the setup's redis+sentinel:// URL."""
        async with (
            asynclock.connect(asynclock_sentinel.url) as coord,
            coord.lock("topology:sentinel", ttl=5.0) as lease,
        ):
            assert await coord.is_locked("topology:sentinel")
            assert lease.fence > 0

    def test_stop_leaves_no_process(self, asynclock_sentinel: SentinelSetup) -> None:
        """stop() stops every process by PID, a frozen one too; it is idempotent."""
        setup = asynclock_sentinel
        setup.replicas()[0].freeze()
        setup.sentinel_servers[0].freeze()
        pids = [node.pid for node in setup.processes]
        dirs = [node.tmpdir for node in setup.processes]
        setup.stop()
        assert all(pid is not None and _gone(pid) for pid in pids)
        assert not any(path.exists() for path in dirs)
        setup.stop()

    @pytest.mark.usefixtures("no_leftovers")
    def test_a_start_that_times_out_leaves_nothing_running(self) -> None:
        """A topology that does not form in time raises with logs and stops everything."""
        with pytest.raises(ServerStartError, match=r"(?s)did not happen within.*log tail"):
            SentinelSetup.start(replicas=1, sentinels=1, timeout=0.0)


class TestCluster:
    def test_comes_up_with_every_slot_covered(self, asynclock_cluster: ClusterSetup) -> None:
        """Three masters own 0-5460, 5461-10922, 10923-16383; one replica each; every node
        agrees."""
        setup = asynclock_cluster
        masters = setup.masters()
        assert masters == setup.nodes[:3]
        assert setup.url == f"redis+cluster://127.0.0.1:{masters[0].port}"
        assert setup.startup_nodes == [(node.host, node.port) for node in setup.nodes]
        assert [setup.node_for_slot(slot) for slot in (0, 5460, 5461, 10922, 10923, 16383)] == [
            masters[0],
            masters[0],
            masters[1],
            masters[1],
            masters[2],
            masters[2],
        ]
        for master in masters:
            (replica,) = setup.replicas(master)
            assert _role(replica) == ("slave", master.port)
        assert len(setup.replicas()) == 3
        for node in setup.nodes:
            with _sync(node) as client:
                info = client.cluster("INFO")
                assert info["cluster_state"] == "ok"
                assert int(info["cluster_slots_ok"]) == 16384
                slots = client.execute_command("CLUSTER", "SLOTS")
                assert sum(int(row[1]) - int(row[0]) + 1 for row in slots) == 16384
        assert setup.startup_time is not None

    async def test_client_writes_keys_on_every_master(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """RedisCluster spreads keys over the three masters; each key is on its slot's master."""
        setup = asynclock_cluster
        client = _cluster_client(setup)
        try:
            keys = [f"key:{i}" for i in range(60)]
            for key in keys:
                assert await client.set(key, key)
            owners = {key: setup.node_for_slot(setup.keyslot(key)) for key in keys}
            assert set(owners.values()) == set(setup.masters())
            for key, owner in owners.items():
                assert await client.get(key) == key.encode()
                with _sync(owner) as direct:
                    assert direct.get(key) == key
            assert setup.keyslot("k") == client.keyslot("k")
        finally:
            await client.aclose()

    async def test_hash_tags_share_a_slot(self, asynclock_cluster: ClusterSetup) -> None:
        """Keys with one hash tag land in one slot: multi-key commands and scripts work."""
        setup = asynclock_cluster
        tagged = ["{user:1}:a", "{user:1}:b", "{user:1}"]
        assert len({setup.keyslot(key) for key in tagged}) == 1
        assert setup.keyslot("{user:1}:a") != setup.keyslot("{user:2}:a")
        client = _cluster_client(setup)
        try:
            await client.execute_command("MSET", "{user:1}:a", "1", "{user:1}:b", "2")
            script = "return redis.call('GET', KEYS[1]) .. redis.call('GET', KEYS[2])"
            assert await client.eval(script, 2, "{user:1}:a", "{user:1}:b") == b"12"
            with (
                _sync(setup.node_for_slot(setup.keyslot("{user:1}"))) as direct,
                pytest.raises(redis.exceptions.ResponseError, match="same slot"),
            ):
                direct.execute_command("MSET", "{user:1}:a", "1", "{user:2}:b", "2")
        finally:
            await client.aclose()

    async def test_kill_master_promotes_its_replica_and_the_client_recovers(
        self, asynclock_cluster: ClusterSetup
    ) -> None:
        """kill_master() kills a master; its replica takes its slots; the client follows."""
        setup = asynclock_cluster
        client = _cluster_client(setup)
        try:
            keys = [f"key:{i}" for i in range(30)]
            for key in keys:
                await client.set(key, "before")
            for master in setup.masters():
                with _sync(master) as direct:
                    assert direct.execute_command("WAIT", 1, 2000) == 1
            old = setup.masters()[0]
            (replica,) = setup.replicas(old)
            new = await asyncio.to_thread(setup.kill_master, 0)
            assert new is replica
            assert not old.running
            assert setup.node_for_slot(0) is new
            assert setup.masters() == [new, *setup.nodes[1:3]]
            assert _role(new) == ("master", None)
            for key in keys:
                assert await _until_ok(functools.partial(client.get, key)) == b"before"
                await _until_ok(functools.partial(client.set, key, "after"))
            moved = [key for key in keys if setup.keyslot(key) <= 5460]
            assert moved
            with _sync(new) as direct:
                assert [direct.get(key) for key in moved] == ["after"] * len(moved)
        finally:
            await client.aclose()

    async def test_manual_failover(self, asynclock_cluster: ClusterSetup) -> None:
        """failover(replica) promotes it; the old master becomes its replica. The chaos
        runner's role watcher (what tells it of promotions no fault asked for) sees it."""
        setup = asynclock_cluster
        old = setup.masters()[1]
        (replica,) = setup.replicas(old)
        roles = await asyncio.to_thread(setup.roles, 2.0)
        assert roles[replica.port] == "slave"
        assert roles[old.port] == "master"
        names = [f"n{i}" for i in range(40)]
        async with _Promotions.watching(setup, names) as promotions:
            while promotions.known.get(replica.port, ("",))[0] != "slave":
                assert promotions.error is None  # it has seen the replica as one
                await asyncio.sleep(0.05)
            new = await asyncio.to_thread(setup.failover, replica)
            for _ in range(100):  # its next round sees it (a 10 s bound)
                if promotions.seen:
                    break
                await asyncio.sleep(0.1)
        assert promotions.error is None
        (seen,) = promotions.seen  # the old master, now a replica, is no promotion
        assert seen.port == replica.port
        assert seen.replica_at < seen.master_at
        assert seen.recent
        # The names whose slot the new master serves, and only those.
        served = [
            name for name in names if setup.node_for_slot(setup.keyslot(f"{{{name}}}")) is new
        ]
        assert served
        assert seen.names == tuple(served)
        assert new is replica
        assert setup.node_for_slot(5461) is new
        assert setup.replicas(new) == [old]
        assert _role(old) == ("slave", new.port)
        (expected,) = setup.replicas(setup.masters()[0])
        assert await asyncio.to_thread(setup.failover) is expected  # default: first master's
        assert setup.node_for_slot(0) is expected

    async def test_sharded_pubsub(self, asynclock_cluster: ClusterSetup) -> None:
        """SSUBSCRIBE through ClusterPubSub receives what SPUBLISH sends."""
        client = _cluster_client(asynclock_cluster)
        await client.initialize()  # ClusterPubSub needs the slot map; it does not fetch it
        pubsub = client.pubsub()
        try:
            await pubsub.ssubscribe("{t}:chan")
            first = await _next_message(pubsub)
            assert first["type"] == "ssubscribe"
            assert await client.spublish("{t}:chan", "hello") == 1
            message = await _next_message(pubsub)
            assert (message["type"], message["channel"], message["data"]) == (
                "smessage",
                b"{t}:chan",
                b"hello",
            )
        finally:
            await pubsub.aclose()
            await client.aclose()

    async def test_spublish_from_a_lua_script(self, asynclock_cluster: ClusterSetup) -> None:
        """A script with key {t}:x may SPUBLISH to {t}:chan (same slot); the subscriber gets it.

        A channel in another slot is refused inside the script."""
        setup = asynclock_cluster
        assert setup.keyslot("{t}:x") == setup.keyslot("{t}:chan")
        client = _cluster_client(setup)
        await client.initialize()
        pubsub = client.pubsub()
        try:
            await pubsub.ssubscribe("{t}:chan")
            assert (await _next_message(pubsub))["type"] == "ssubscribe"
            script = (
                "redis.call('SET', KEYS[1], ARGV[1]) "
                "return redis.call('SPUBLISH', '{t}:chan', ARGV[1])"
            )
            assert await client.eval(script, 1, "{t}:x", "m") == 1
            message = await _next_message(pubsub)
            assert (message["type"], message["data"]) == ("smessage", b"m")
            assert await client.get("{t}:x") == b"m"
            other = "return redis.call('SPUBLISH', '{elsewhere}:chan', 'm')"
            assert setup.keyslot("{elsewhere}:chan") != setup.keyslot("{t}:x")
            with pytest.raises(redis.exceptions.ResponseError):
                await client.eval(other, 1, "{t}:x")
        finally:
            await pubsub.aclose()
            await client.aclose()

    async def test_asynclock_locks_through_the_url(self, asynclock_cluster: ClusterSetup) -> None:
        """asynclock.connect() takes the setup's redis+cluster:// URL."""
        async with (
            asynclock.connect(asynclock_cluster.url) as coord,
            coord.lock("topology:cluster", ttl=5.0) as lease,
        ):
            assert await coord.is_locked("topology:cluster")
            assert lease.fence > 0

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    def test_without_replicas(self, asynclock_cluster: ClusterSetup) -> None:
        """replicas=0: three masters, no replicas; kill_master refuses."""
        setup = asynclock_cluster
        assert setup.masters() == setup.nodes
        assert setup.replicas() == []
        with pytest.raises(RuntimeError, match="no running replica"):
            setup.kill_master(0)
        assert all(node.running for node in setup.nodes)

    def test_stop_leaves_no_process(self, asynclock_cluster: ClusterSetup) -> None:
        """stop() stops every node by PID, a frozen one too; it is idempotent."""
        setup = asynclock_cluster
        setup.nodes[0].freeze()
        pids = [node.pid for node in setup.processes]
        setup.stop()
        assert all(pid is not None and _gone(pid) for pid in pids)
        setup.stop()

    @pytest.mark.usefixtures("no_leftovers")
    def test_a_start_that_times_out_leaves_nothing_running(self) -> None:
        """A cluster that does not form in time raises with logs and stops every node."""
        with pytest.raises(ServerStartError, match=r"(?s)did not happen within.*log tail"):
            ClusterSetup.start(masters=1, replicas=1, timeout=0.0)


async def _next_message(pubsub: Any, within: float = 5.0) -> dict[str, Any]:
    """The next sharded pub/sub message (subscribe confirmations included)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        message = await pubsub.get_sharded_message(timeout=0.2)
        if message is not None:
            result: dict[str, Any] = message
            return result
    raise AssertionError(f"no sharded message within {within} s")
