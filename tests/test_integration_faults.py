"""The web integrations and decorators when the lock server fails around a request.

A server that stops answering is 503, not "locked by another request" (423 is only
contention); a release that fails after the handler finished leaves the handler's
outcome standing; a lease lost while a ``scope="request"`` body streams cuts the stream.
Real Valkey behind a fault proxy, real FastAPI (in process and behind uvicorn) and
aiohttp.

No ``from __future__ import annotations``: FastAPI reads the handlers' annotations at
run time.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pytest_asynclock.proxy import FaultProxy

import asynclock
from asynclock import Coordinator, Lease
from asynclock.integrations import aiohttp as aiohttp_locks
from asynclock.integrations.fastapi import FastAPILocks

from .conftest import eventually, redis_backend
from .test_integrations import Serve, aiohttp_serving, serve, uvicorn_client

pytestmark = pytest.mark.timeout(90)

__all__ = ("serve",)  # the fixture, shared with test_integrations

# Short enough that a request blocked on a blackholed server fails fast, long enough
# for a loaded machine.
SOCKET_TIMEOUT = 1.0


@pytest.fixture
async def proxy(asynclock_redis_url: str) -> AsyncIterator[FaultProxy]:
    async with FaultProxy.from_url(asynclock_redis_url) as proxy:
        yield proxy


@pytest.fixture
def via_proxy(proxy: FaultProxy, asynclock_redis_url: str) -> str:
    return proxy.url_for(asynclock_redis_url)


@pytest.fixture
async def other(asynclock_redis_url: str, namespace: str) -> AsyncIterator[Coordinator]:
    async with asynclock.connect(asynclock_redis_url, prefix=namespace) as coord:
        yield coord


def fastapi_app(locks: FastAPILocks, proxy: FaultProxy, *, timeout: float) -> FastAPI:
    """``/work/{mode}``: ``ok`` answers 200; ``cut-ok`` / ``cut-404`` cut the lock server
    off before answering 200 / raising 404 (the release then fails)."""
    app = FastAPI(lifespan=locks.lifespan)

    @app.post("/work/{mode}")
    async def work(
        mode: str, lease: Annotated[Lease, locks.lock("work", ttl=1, timeout=timeout)]
    ) -> dict[str, int]:
        if mode.startswith("cut"):
            proxy.blackhole()
        if mode.endswith("404"):
            raise HTTPException(404, "no such thing")
        return {"fence": lease.fence}

    return app


def aiohttp_app(url: str, namespace: str, proxy: FaultProxy, *, timeout: float) -> web.Application:
    app = web.Application()
    aiohttp_locks.setup(app, url, prefix=namespace, socket_timeout=SOCKET_TIMEOUT)

    @aiohttp_locks.locked("work", ttl=1, timeout=timeout)
    async def work(request: web.Request) -> web.Response:
        mode = request.match_info["mode"]
        if mode.startswith("cut"):
            proxy.blackhole()
        if mode.endswith("404"):
            raise web.HTTPNotFound(text="no such thing")
        return web.json_response({"fence": request[aiohttp_locks.LEASE].fence})

    app.router.add_post("/work/{mode}", work)
    return app


class TestUnansweredIsNotLocked:
    async def test_fastapi(
        self, serve: Serve, via_proxy: str, proxy: FaultProxy, namespace: str
    ) -> None:
        """The server stops answering: the request waits its timeout and gets 503 with
        Retry-After: 1, not 423 "locked by another request"."""
        locks = FastAPILocks(via_proxy, prefix=namespace, socket_timeout=5.0)
        async with serve(fastapi_app(locks, proxy, timeout=0.5)) as client:
            assert (await client.post("/work/ok")).status_code == 200
            proxy.blackhole()
            response = await client.post("/work/ok")
            proxy.heal()
        assert response.status_code == 503, response.text
        assert response.headers.get("Retry-After") == "1"

    async def test_aiohttp(self, via_proxy: str, proxy: FaultProxy, namespace: str) -> None:
        app = aiohttp_app(via_proxy, namespace, proxy, timeout=0.5)
        async with aiohttp_serving(app) as client:
            assert (await client.post("/work/ok")).status == 200
            proxy.blackhole()
            response = await client.post("/work/ok")
            proxy.heal()
        assert response.status == 503
        assert response.headers.get("Retry-After") == "1"

    async def test_contention_is_still_423(
        self, serve: Serve, via_proxy: str, proxy: FaultProxy, namespace: str, other: Coordinator
    ) -> None:
        locks = FastAPILocks(via_proxy, prefix=namespace)
        async with (
            serve(fastapi_app(locks, proxy, timeout=0.2)) as client,
            other.lock("work", ttl=5),
        ):
            response = await client.post("/work/ok")
        assert response.status_code == 423


class TestFailedReleaseAfterTheHandler:
    @pytest.mark.parametrize(("mode", "status"), [("cut-ok", 200), ("cut-404", 404)])
    async def test_fastapi(
        self,
        *,
        serve: Serve,
        via_proxy: str,
        proxy: FaultProxy,
        namespace: str,
        mode: str,
        status: int,
    ) -> None:
        """The handler finished (answered, or raised its own 404), then the release
        cannot be confirmed: the client gets the handler's answer, not a 500."""
        locks = FastAPILocks(via_proxy, prefix=namespace, socket_timeout=SOCKET_TIMEOUT)
        async with serve(fastapi_app(locks, proxy, timeout=5)) as client:
            response = await client.post(f"/work/{mode}")
            proxy.heal()
            assert response.status_code == status, response.text
            assert locks.coordinator.stats().release_failures == 1

    @pytest.mark.parametrize(("mode", "status"), [("cut-ok", 200), ("cut-404", 404)])
    async def test_aiohttp(
        self, via_proxy: str, proxy: FaultProxy, namespace: str, mode: str, status: int
    ) -> None:
        app = aiohttp_app(via_proxy, namespace, proxy, timeout=5)
        async with aiohttp_serving(app) as client:
            response = await client.post(f"/work/{mode}")
            proxy.heal()
            assert response.status == status
            assert app[aiohttp_locks.COORDINATOR].stats().release_failures == 1

    @pytest.mark.parametrize("decorator", ["locked", "singleton"])
    async def test_decorators(
        self, via_proxy: str, proxy: FaultProxy, namespace: str, decorator: str
    ) -> None:
        """The decorated call's result is returned and its own exception raised."""
        async with asynclock.connect(
            via_proxy, prefix=namespace, socket_timeout=SOCKET_TIMEOUT
        ) as coord:
            wrap = (
                coord.locked("job:{n}", ttl=1)
                if decorator == "locked"
                else coord.singleton("job:{n}", ttl=1)
            )

            @wrap
            async def job(n: int) -> int:
                proxy.blackhole()
                if n < 0:
                    raise ValueError("negative")
                return n * 2

            try:
                assert await job(21) == 42
            finally:
                proxy.heal()
            try:
                with pytest.raises(ValueError, match="negative"):
                    await job(-1)
            finally:
                proxy.heal()
            assert coord.stats().release_failures == 2


class TestStreamCutOnLoss:
    async def test_lease_lost_while_a_request_scoped_body_streams(
        self, asynclock_redis_url: str, namespace: str, other: Coordinator
    ) -> None:
        """With scope="request" the lock covers the streamed body; lost mid-stream, the
        status (200) was sent already: the stream is cut, the client sees an incomplete
        body, and the lock is not left behind."""
        locks = FastAPILocks(asynclock_redis_url, prefix=namespace)
        app = FastAPI(lifespan=locks.lifespan)
        more = asyncio.Event()
        cut = asyncio.Event()

        @app.get("/stream", dependencies=[locks.lock("stream", ttl=0.6, scope="request")])
        async def stream() -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                yield b"first\n"
                try:
                    await more.wait()
                except asyncio.CancelledError:
                    cut.set()
                    raise
                yield b"never\n"

            return StreamingResponse(body())

        async with uvicorn_client(app) as client:
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", "/stream") as response:
                    assert response.status_code == 200
                    async for chunk in response.aiter_bytes():
                        received += chunk
                        backend = redis_backend(other)
                        await backend.client.delete(backend.keys("stream").lock)
            assert received == b"first\n"
            assert cut.is_set()
            assert await eventually(lambda: locks.coordinator.held == [], within=5)
            assert not await other.is_locked("stream")
            more.set()
            async with client.stream("GET", "/stream") as response:  # the app lives on
                assert response.status_code == 200
                assert await response.aread() == b"first\nnever\n"
