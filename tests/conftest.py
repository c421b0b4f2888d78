"""Shared fixtures: coordinators on every backend, against real servers.

``make_coord()`` builds coordinators that share one lock namespace but nothing else: on
Redis each has its own connection pool and a key prefix unique to the test, on memory each
has its own backend over one table unique to the test.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import pytest

import asynclock
from asynclock.backends import MemoryBackend, RedisBackend

BACKENDS = ("memory", "redis", "postgres", "redlock")

MakeCoord = Callable[..., asynclock.Coordinator]


@pytest.fixture
def namespace() -> str:
    """A name unique to this test, used as key prefix or memory table."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# The node timeout of the suite's Redlock coordinators (see make_coord).
REDLOCK_NODE_TIMEOUT = 0.25


@pytest.fixture
async def make_coord(
    request: pytest.FixtureRequest, backend_kind: str, namespace: str
) -> AsyncIterator[MakeCoord]:
    """A factory of coordinators on the backend under test, all closed at the end."""
    made: list[asynclock.Coordinator] = []
    url = ""
    urls: list[str] = []
    if backend_kind == "redlock":
        urls = request.getfixturevalue("asynclock_redlock_urls")
    if backend_kind == "redis":
        url = request.getfixturevalue("asynclock_redis_url")
    elif backend_kind == "postgres":
        url = request.getfixturevalue("asynclock_postgres_dsn")

    def make(**options: Any) -> asynclock.Coordinator:
        if backend_kind == "memory":
            coord = asynclock.connect(f"memory://{namespace}", **options)
        elif backend_kind == "postgres":
            coord = asynclock.connect(url, namespace=namespace, **options)
        elif backend_kind == "redlock":
            # Five nodes on two busy cores: the default 50 ms per node is tight when the
            # machine is loaded (a QuorumError that says nothing about the code).
            options.setdefault("node_timeout", REDLOCK_NODE_TIMEOUT)
            coord = asynclock.connect(urls, prefix=namespace, **options)
        else:
            coord = asynclock.connect(url, prefix=namespace, **options)
        made.append(coord)
        return coord

    yield make
    for coord in made:
        await coord.aclose()


@pytest.fixture
async def coord(make_coord: MakeCoord) -> asynclock.Coordinator:
    return make_coord()


@pytest.fixture
async def redis_coord(
    asynclock_redis_url: str, namespace: str
) -> AsyncIterator[asynclock.Coordinator]:
    """A coordinator on the shared Valkey server with a prefix unique to the test."""
    async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
        yield coord


async def eventually(predicate: Callable[[], bool], within: float = 2.0) -> bool:
    """Poll ``predicate`` until it holds or ``within`` seconds pass; its last value."""
    try:
        async with asyncio.timeout(within):
            # Polls state of the library that has no event to wait on; tests only.
            while not predicate():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    except TimeoutError:
        return predicate()
    return True


async def interrupted_aclose(coord: asynclock.Coordinator, steps: int) -> None:
    """Start ``coord.aclose()``, let the loop run ``steps`` times, cancel it, and wait
    until that call has ended (however it ended)."""
    closing = asyncio.create_task(coord.aclose())
    for _ in range(steps):
        await asyncio.sleep(0)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)


def redis_backend(coord: asynclock.Coordinator) -> RedisBackend:
    backend = coord.backend
    assert isinstance(backend, RedisBackend)
    return backend


def memory_backend(coord: asynclock.Coordinator) -> MemoryBackend:
    backend = coord.backend
    assert isinstance(backend, MemoryBackend)
    return backend


# --- tests/test_sim.py: the deterministic simulation (options and its marker) ----------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sim", "deterministic simulation (tests/test_sim.py)")
    group.addoption("--sim-seeds", default=None, help="seed range for -m sim: A:B, N or a,b,c")
    group.addoption("--sim-seed", type=int, default=None, help="replay one simulation seed")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sim: long deterministic-simulation explorations")
    # A SIGTERM (a CI job's timeout, `timeout`, `kill`) would end the run without its
    # clean-up: the servers and proxies the suite started would outlive it. Unwind as for
    # Ctrl-C instead, so fixtures end and the servers are stopped by their own PIDs.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it for good
    raise KeyboardInterrupt(f"signal {signum}")
