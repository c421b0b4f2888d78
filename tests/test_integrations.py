"""FastAPI and aiohttp integrations on a real Valkey server.

FastAPI runs both in process through httpx's ``ASGITransport`` (with the lifespan
entered by hand: the transport does not run it) and behind a real uvicorn server on a
loopback port; aiohttp runs behind its own test server. Every test has its own key
prefix on the shared server.

No ``from __future__ import annotations`` in this module: FastAPI reads the handlers'
annotations at run time, and they name variables local to the functions that build
the apps.
"""

import asyncio
import contextlib
import importlib
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Annotated

import httpx
import pytest
import uvicorn
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import StreamingResponse

import asynclock
from asynclock import Coordinator, Lease, Term
from asynclock.integrations import aiohttp as aiohttp_locks
from asynclock.integrations.fastapi import DependencyScope, FastAPILocks

from .conftest import eventually, redis_backend

Serve = Callable[[FastAPI], AbstractAsyncContextManager[httpx.AsyncClient]]
AioClient = TestClient[web.Request, web.Application]


# -- servers --------------------------------------------------------------------------


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def uvicorn_serving(app: FastAPI) -> AsyncIterator[str]:
    """Run ``app`` (lifespan included) on a free loopback port; its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, lifespan="on", ws="none", log_config=None, log_level="warning", access_log=False
        )
        server = _QuietServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with asyncio.timeout(5):
                # uvicorn.Server has a flag for this, no event to wait on.
                while not server.started and not task.done():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            if not server.started:
                await task
                raise RuntimeError("uvicorn did not start")
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await task
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """httpx straight into the app, with the app's lifespan entered around it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client


@contextlib.asynccontextmanager
async def uvicorn_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """httpx over TCP to the app behind a real uvicorn server."""
    async with (
        uvicorn_serving(app) as base_url,
        httpx.AsyncClient(base_url=base_url, trust_env=False) as client,
    ):
        yield client


@pytest.fixture(params=["asgi", "uvicorn"])
def serve(request: pytest.FixtureRequest) -> Serve:
    """Run a FastAPI app for the test and give an httpx client to it."""
    return asgi_client if request.param == "asgi" else uvicorn_client


@contextlib.asynccontextmanager
async def aiohttp_serving(app: web.Application) -> AsyncIterator[AioClient]:
    """Run an aiohttp app on its test server (startup and cleanup included)."""
    async with TestClient(TestServer(app)) as client:
        yield client


@pytest.fixture
def url(asynclock_redis_url: str) -> str:
    return asynclock_redis_url


@pytest.fixture
def dead_url() -> str:
    """A Redis URL on a loopback port where nothing listens (connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.fixture
async def other(url: str, namespace: str) -> AsyncIterator[Coordinator]:
    """A coordinator of the test's own, on the same server and prefix as the apps."""
    async with asynclock.connect(url, prefix=namespace) as coord:
        yield coord


# -- what the handlers record -----------------------------------------------------------


class Probe:
    """Counts the handlers inside a locked section, and can make them meet there."""

    def __init__(self, *, pause: float = 0.05, meet: int = 0) -> None:
        self.pause = pause
        self.meet = meet
        self.inside = 0
        self.most = 0
        self.fences: list[int] = []
        self.present: set[str] = set()
        self.met = asyncio.Event()
        self.entered = asyncio.Event()
        self.cancelled = 0

    async def visit(self, key: str, lease: Lease) -> dict[str, int]:
        self.inside += 1
        self.most = max(self.most, self.inside)
        self.fences.append(lease.fence)
        self.entered.set()
        try:
            if self.meet:
                # Each waits inside its lock until all have arrived: only possible if
                # their locks are held at the same time.
                self.present.add(key)
                if len(self.present) >= self.meet:
                    self.met.set()
                async with asyncio.timeout(3):
                    await self.met.wait()
            else:
                await asyncio.sleep(self.pause)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.inside -= 1
        return {"fence": lease.fence}


def leader_job(
    label: str, leading: set[str], resigned: list[str]
) -> Callable[[Term], Awaitable[None]]:
    """A leader-only job that runs until cancelled, recording that it led and resigned."""

    async def job(term: Term) -> None:
        leading.add(label)
        try:
            await asyncio.Event().wait()
        finally:
            leading.discard(label)
            resigned.append(label)

    return job


def fastapi_app(
    locks: FastAPILocks, probe: Probe, *, timeout: float = 5.0, ttl: float = 5.0
) -> FastAPI:
    app = FastAPI(lifespan=locks.lifespan)

    @app.post("/items/{item_id}")
    async def work(
        item_id: str,
        lease: Annotated[Lease, locks.lock("item:{item_id}", ttl=ttl, timeout=timeout)],
    ) -> dict[str, int]:
        return await probe.visit(item_id, lease)

    return app


def aiohttp_app(
    url: str, namespace: str, probe: Probe, *, timeout: float = 5.0, ttl: float = 5.0
) -> web.Application:
    app = web.Application()
    aiohttp_locks.setup(app, url, prefix=namespace)

    @aiohttp_locks.locked("item:{item_id}", ttl=ttl, timeout=timeout)
    async def work(request: web.Request) -> web.Response:
        key = request.match_info["item_id"]
        return web.json_response(await probe.visit(key, request[aiohttp_locks.LEASE]))

    class ItemView(web.View):
        @aiohttp_locks.locked("item:{item_id}", ttl=ttl, timeout=timeout)
        async def post(self) -> web.Response:
            key = self.request.match_info["item_id"]
            return web.json_response(await probe.visit(key, self.request[aiohttp_locks.LEASE]))

    app.router.add_post("/items/{item_id}", work)
    app.router.add_view("/views/{item_id}", ItemView)
    return app


def check_retry_after(value: str | None, most: int) -> int:
    """A Retry-After header: whole seconds, at least 1, at most ``most``."""
    assert value is not None
    assert value.isdigit(), value
    assert 1 <= int(value) <= most
    return int(value)


# -- FastAPI ----------------------------------------------------------------------------


class TestFastAPI:
    async def test_one_key_serialized(self, serve: Serve, url: str, namespace: str) -> None:
        """Six concurrent requests for one key run one at a time, all succeed, fences grow."""
        probe = Probe(pause=0.03)
        app = fastapi_app(FastAPILocks(url, prefix=namespace), probe)
        async with serve(app) as client:
            responses = await asyncio.gather(*(client.post("/items/7") for _ in range(6)))
        assert [r.status_code for r in responses] == [200] * 6
        assert probe.most == 1
        assert probe.fences == sorted(set(probe.fences))
        assert sorted(r.json()["fence"] for r in responses) == probe.fences

    async def test_different_keys_in_parallel(self, serve: Serve, url: str, namespace: str) -> None:
        """Requests for two keys hold their locks at the same time."""
        probe = Probe(meet=2)
        app = fastapi_app(FastAPILocks(url, prefix=namespace), probe)
        async with serve(app) as client:
            first, second = await asyncio.gather(client.post("/items/a"), client.post("/items/b"))
        assert (first.status_code, second.status_code) == (200, 200)
        assert probe.met.is_set()
        assert probe.most == 2

    async def test_timeout_is_423_with_retry_after(
        self, serve: Serve, url: str, namespace: str, other: Coordinator
    ) -> None:
        """A lock held elsewhere past the timeout: 423 Locked with Retry-After in seconds."""
        probe = Probe()
        app = fastapi_app(FastAPILocks(url, prefix=namespace), probe, timeout=0.1)
        async with serve(app) as client, other.lock("item:9", ttl=3):
            response = await client.post("/items/9")
        assert response.status_code == 423
        # About 2.9 s of the holder's lease were left: rounded up.
        assert check_retry_after(response.headers.get("Retry-After"), 3) >= 2
        assert "item:9" in response.json()["detail"]
        assert probe.fences == []

    async def test_lost_lease_cancels_handler_and_answers_503(
        self, serve: Serve, url: str, namespace: str, other: Coordinator
    ) -> None:
        """A lease lost mid-request cancels the handler; the client gets 503, the app lives."""
        probe = Probe(pause=30)
        app = fastapi_app(FastAPILocks(url, prefix=namespace), probe, ttl=0.3)
        async with serve(app) as client:
            request = asyncio.create_task(client.post("/items/3"))
            await probe.entered.wait()
            backend = redis_backend(other)
            await backend.client.delete(backend.keys("item:3").lock)
            async with asyncio.timeout(3):
                response = await request
            assert response.status_code == 503
            assert "lost" in response.json()["detail"]
            assert probe.cancelled == 1
            probe.pause = 0.01
            again = await client.post("/items/3")  # the server still answers
            assert again.status_code == 200

    async def test_unreachable_server_is_503_at_once(self, serve: Serve, dead_url: str) -> None:
        """Lock server down: 503 with Retry-After: 1 at once, not after the timeout."""
        probe = Probe()
        # A short ttl: aclose() waits that long for the background release of the attempt.
        app = fastapi_app(FastAPILocks(dead_url), probe, timeout=30, ttl=0.3)
        async with serve(app) as client:
            async with asyncio.timeout(5):
                response = await client.post("/items/1")
        assert response.status_code == 503
        assert response.headers.get("Retry-After") == "1"
        assert probe.fences == []

    @pytest.mark.parametrize("scope", ["function", "request"])
    async def test_scope_decides_when_the_lock_is_released(
        self, serve: Serve, url: str, namespace: str, other: Coordinator, scope: DependencyScope
    ) -> None:
        """scope="function" releases before the response is sent, "request" after it."""
        locks = FastAPILocks(url, prefix=namespace)
        app = FastAPI(lifespan=locks.lifespan)
        dependency = locks.lock("item:{item_id}", scope=scope)
        held = scope == "request"

        @app.get("/items/{item_id}", dependencies=[dependency])
        async def stream(item_id: str) -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                yield str(await other.is_locked(f"item:{item_id}")).encode()

            return StreamingResponse(body())

        async with serve(app) as client:
            response = await client.get("/items/5")
            assert response.text == str(held)
            if scope == "request":
                # Released after the response went out: the client can read it first.
                # The server has no event to wait on here: poll it, bounded.
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 2.0
                while await other.is_locked("item:5") and loop.time() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            assert not await other.is_locked("item:5")

    async def test_coordinator_made_at_startup_closed_at_shutdown(
        self, serve: Serve, url: str, namespace: str
    ) -> None:
        """From a URL: the coordinator exists from startup to shutdown, then is closed."""
        locks = FastAPILocks(url, prefix=namespace)
        app = FastAPI(lifespan=locks.lifespan)
        seen: list[Coordinator] = []

        @app.get("/coordinator")
        async def coordinator(
            coord: Annotated[Coordinator, Depends(locks.get_coordinator)],
        ) -> dict[str, bool]:
            seen.append(coord)
            return {"closed": coord.closed}

        with pytest.raises(RuntimeError, match="not running"):
            _ = locks.coordinator
        async with serve(app) as client:
            response = await client.get("/coordinator")
            assert response.json() == {"closed": False}
            assert seen == [locks.coordinator]
        assert seen[0].closed
        with pytest.raises(RuntimeError, match="not running"):
            _ = locks.coordinator

    async def test_coordinator_passed_in_is_not_closed(
        self, serve: Serve, other: Coordinator
    ) -> None:
        """A coordinator passed in is used as it is and left open at shutdown."""
        locks = FastAPILocks(other)
        probe = Probe(pause=0)
        app = fastapi_app(locks, probe)
        async with serve(app) as client:
            assert locks.coordinator is other
            assert (await client.post("/items/1")).status_code == 200
        assert not other.closed
        assert not await other.is_locked("item:1")

    async def test_leader_task_on_one_app_resigns_at_shutdown(
        self, serve: Serve, url: str, namespace: str, other: Coordinator
    ) -> None:
        """Of two apps sharing an election, one runs the job; shutting it down resigns."""
        leading: set[str] = set()
        resigned: list[str] = []
        apps: dict[str, FastAPI] = {}
        for label in ("a", "b"):
            locks = FastAPILocks(url, prefix=namespace)
            # ttl=5: a take-over within 2 s proves a resignation, not an expiry
            locks.leader_task("jobs", leader_job(label, leading, resigned), ttl=5, identity=label)
            app = FastAPI(lifespan=locks.lifespan)

            @app.get("/leading")
            async def is_leading(label: str = label) -> dict[str, bool]:
                return {"leading": label in leading}

            apps[label] = app
        async with contextlib.AsyncExitStack() as stack_a, contextlib.AsyncExitStack() as stack_b:
            client_a = await stack_a.enter_async_context(serve(apps["a"]))
            assert await eventually(lambda: leading == {"a"})
            client_b = await stack_b.enter_async_context(serve(apps["b"]))
            await asyncio.sleep(0.2)  # b campaigns meanwhile, and must not win
            assert (await client_a.get("/leading")).json() == {"leading": True}
            assert (await client_b.get("/leading")).json() == {"leading": False}
            assert await other.election("jobs").leader() == "a"
            await stack_a.aclose()
            assert resigned == ["a"]
            assert await eventually(lambda: leading == {"b"})
            await stack_b.aclose()
        assert leading == set()
        assert resigned == ["a", "b"]
        assert await other.election("jobs").leader() is None


class TestFastAPIChecks:
    async def test_template_field_missing_from_route_fails_startup(
        self, url: str, namespace: str
    ) -> None:
        """A lock template naming a field the route lacks stops the app at startup."""
        locks = FastAPILocks(url, prefix=namespace)
        app = FastAPI(lifespan=locks.lifespan)

        @app.post("/orders/{order_id}", dependencies=[locks.lock("order:{id}")])
        async def order(order_id: str) -> None:
            pass

        with pytest.raises(ValueError, match=r"'/orders/\{order_id\}'.*'id'.*'order_id'"):
            async with app.router.lifespan_context(app):
                pass
        with pytest.raises(RuntimeError, match="not running"):
            _ = locks.coordinator

    async def test_crashed_leader_task_is_logged(
        self, url: str, namespace: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A leader callback that raises is logged with its traceback; shutdown is clean."""
        locks = FastAPILocks(url, prefix=namespace)
        crashed = asyncio.Event()

        async def job(term: Term) -> None:
            crashed.set()
            raise ValueError("bug in the job")

        locks.leader_task("jobs", job)
        app = FastAPI(lifespan=locks.lifespan)
        async with asgi_client(app):
            await crashed.wait()
            assert await eventually(lambda: "campaigning again" in caplog.text)
        assert "'jobs'" in caplog.text
        assert "bug in the job" in caplog.text

    async def test_template_field_missing_under_included_router_is_500(
        self, url: str, namespace: str
    ) -> None:
        """Under an included router (not checked at startup) a missing field answers 500."""
        locks = FastAPILocks(url, prefix=namespace)
        router = APIRouter()

        @router.post("/orders/{order_id}", dependencies=[locks.lock("order:{id}")])
        async def order(order_id: str) -> None:
            pass

        app = FastAPI(lifespan=locks.lifespan)
        app.include_router(router, prefix="/v1")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
        ):
            response = await client.post("/v1/orders/1")
        assert response.status_code == 500

    def test_bad_arguments_fail_at_once(self, url: str) -> None:
        """Positional template fields, a bad ttl or target raise when declared."""
        locks = FastAPILocks(url)
        with pytest.raises(ValueError, match="name the path parameters"):
            locks.lock("order:{}")
        with pytest.raises(ValueError, match="ttl"):
            locks.lock("order:{order_id}", ttl=0)
        with pytest.raises(TypeError, match="Coordinator"):
            FastAPILocks(42)  # type: ignore[arg-type]

    def test_import_without_fastapi_names_the_extra(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without FastAPI the module fails with an ImportError naming asynclock[fastapi]."""
        monkeypatch.setitem(sys.modules, "fastapi", None)
        monkeypatch.delitem(sys.modules, "asynclock.integrations.fastapi")
        with pytest.raises(ImportError, match=r"asynclock\[fastapi\]"):
            importlib.import_module("asynclock.integrations.fastapi")


# -- aiohttp ----------------------------------------------------------------------------


class TestAiohttp:
    @pytest.mark.parametrize("path", ["/items/7", "/views/7"])
    async def test_one_key_serialized(self, url: str, namespace: str, path: str) -> None:
        """Six concurrent requests for one key (function or View handler) run one at a time."""
        probe = Probe(pause=0.03)
        async with aiohttp_serving(aiohttp_app(url, namespace, probe)) as client:
            responses = await asyncio.gather(*(client.post(path) for _ in range(6)))
            bodies = [await r.json() for r in responses]
        assert [r.status for r in responses] == [200] * 6
        assert probe.most == 1
        assert probe.fences == sorted(set(probe.fences))
        assert sorted(body["fence"] for body in bodies) == probe.fences

    async def test_different_keys_in_parallel(self, url: str, namespace: str) -> None:
        """Requests for two keys hold their locks at the same time."""
        probe = Probe(meet=2)
        async with aiohttp_serving(aiohttp_app(url, namespace, probe)) as client:
            first, second = await asyncio.gather(client.post("/items/a"), client.post("/views/b"))
        assert (first.status, second.status) == (200, 200)
        assert probe.met.is_set()
        assert probe.most == 2

    @pytest.mark.parametrize("path", ["/items/9", "/views/9"])
    async def test_timeout_is_423_with_retry_after(
        self, url: str, namespace: str, other: Coordinator, path: str
    ) -> None:
        """A lock held elsewhere past the timeout: 423 Locked with Retry-After in seconds."""
        probe = Probe()
        app = aiohttp_app(url, namespace, probe, timeout=0.1)
        async with aiohttp_serving(app) as client, other.lock("item:9", ttl=3):
            response = await client.post(path)
            text = await response.text()
        assert response.status == 423
        assert response.reason == "Locked"
        assert check_retry_after(response.headers.get("Retry-After"), 3) >= 2
        assert "item:9" in text
        assert probe.fences == []

    async def test_lost_lease_cancels_handler_and_answers_503(
        self, url: str, namespace: str, other: Coordinator
    ) -> None:
        """A lease lost mid-request cancels the handler; the client gets 503, the app lives."""
        probe = Probe(pause=30)
        async with aiohttp_serving(aiohttp_app(url, namespace, probe, ttl=0.3)) as client:
            request = asyncio.create_task(client.post("/items/3"))
            await probe.entered.wait()
            backend = redis_backend(other)
            await backend.client.delete(backend.keys("item:3").lock)
            async with asyncio.timeout(3):
                response = await request
            assert response.status == 503
            assert "lost" in await response.text()
            assert probe.cancelled == 1
            probe.pause = 0.01
            again = await client.post("/items/3")
            assert again.status == 200

    async def test_unreachable_server_is_503_at_once(self, dead_url: str, namespace: str) -> None:
        """Lock server down: 503 with Retry-After: 1 at once, not after the timeout."""
        probe = Probe()
        # A short ttl: aclose() waits that long for the background release of the attempt.
        app = aiohttp_app(dead_url, namespace, probe, timeout=30, ttl=0.3)
        async with aiohttp_serving(app) as client:
            async with asyncio.timeout(5):
                response = await client.post("/items/1")
        assert response.status == 503
        assert response.headers.get("Retry-After") == "1"
        assert probe.fences == []

    async def test_coordinator_made_at_startup_closed_at_cleanup(
        self, url: str, namespace: str
    ) -> None:
        """From a URL: app[COORDINATOR] appears at startup and is closed at cleanup."""
        probe = Probe(pause=0)
        app = aiohttp_app(url, namespace, probe)
        assert aiohttp_locks.COORDINATOR not in app
        async with aiohttp_serving(app) as client:
            coord = app[aiohttp_locks.COORDINATOR]
            assert not coord.closed
            assert (await client.post("/items/1")).status == 200
        assert coord.closed

    async def test_coordinator_passed_in_is_not_closed(self, other: Coordinator) -> None:
        """A coordinator passed in is used as it is and left open at cleanup."""
        app = web.Application()
        aiohttp_locks.setup(app, other)
        probe = Probe(pause=0)

        @aiohttp_locks.locked("item:{item_id}")
        async def work(request: web.Request) -> web.Response:
            return web.json_response(await probe.visit("x", request[aiohttp_locks.LEASE]))

        app.router.add_post("/items/{item_id}", work)
        async with aiohttp_serving(app) as client:
            assert app[aiohttp_locks.COORDINATOR] is other
            assert (await client.post("/items/1")).status == 200
        assert not other.closed
        assert not await other.is_locked("item:1")

    async def test_leader_task_on_one_app_resigns_at_cleanup(
        self, url: str, namespace: str, other: Coordinator
    ) -> None:
        """Of two apps sharing an election, one runs the job; cleaning it up resigns."""
        leading: set[str] = set()
        resigned: list[str] = []
        apps: dict[str, web.Application] = {}
        for label in ("a", "b"):
            app = web.Application()
            aiohttp_locks.setup(app, url, prefix=namespace)
            aiohttp_locks.leader_task(
                app, "jobs", leader_job(label, leading, resigned), ttl=5, identity=label
            )

            async def is_leading(request: web.Request, label: str = label) -> web.Response:
                return web.json_response({"leading": label in leading})

            app.router.add_get("/leading", is_leading)
            apps[label] = app
        async with contextlib.AsyncExitStack() as stack_a, contextlib.AsyncExitStack() as stack_b:
            client_a = await stack_a.enter_async_context(aiohttp_serving(apps["a"]))
            assert await eventually(lambda: leading == {"a"})
            client_b = await stack_b.enter_async_context(aiohttp_serving(apps["b"]))
            await asyncio.sleep(0.2)
            assert await (await client_a.get("/leading")).json() == {"leading": True}
            assert await (await client_b.get("/leading")).json() == {"leading": False}
            assert await other.election("jobs").leader() == "a"
            await stack_a.aclose()
            assert resigned == ["a"]
            assert await eventually(lambda: leading == {"b"})
            await stack_b.aclose()
        assert leading == set()
        assert resigned == ["a", "b"]
        assert await other.election("jobs").leader() is None


class TestAiohttpChecks:
    async def test_template_field_missing_from_route_fails_startup(
        self, url: str, namespace: str
    ) -> None:
        """A lock template naming a field the resource lacks stops the app at startup."""
        app = web.Application()
        aiohttp_locks.setup(app, url, prefix=namespace)

        @aiohttp_locks.locked("order:{id}")
        async def order(request: web.Request) -> web.Response:
            return web.Response()

        app.router.add_post("/orders/{order_id}", order)
        server = TestServer(app)
        try:
            with pytest.raises(ValueError, match=r"'/orders/\{order_id\}'.*'id'.*'order_id'"):
                await server.start_server()
        finally:
            await server.close()

    def test_bad_arguments_fail_at_once(self, url: str) -> None:
        """A sync handler, positional fields, leader tasks before setup raise at once."""

        def sync_handler(request: web.Request) -> web.Response:
            return web.Response()

        with pytest.raises(TypeError, match="async def"):
            aiohttp_locks.locked("order:{order_id}")(sync_handler)  # type: ignore[type-var]
        with pytest.raises(ValueError, match="name the path parameters"):
            aiohttp_locks.locked("order:{0}")
        app = web.Application()
        with pytest.raises(RuntimeError, match="setup"):
            aiohttp_locks.leader_task(app, "jobs", leader_job("a", set(), []))
        aiohttp_locks.setup(app, url)
        with pytest.raises(RuntimeError, match="already"):
            aiohttp_locks.setup(app, url)

    def test_import_without_aiohttp_names_the_extra(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without aiohttp the module fails with an ImportError naming asynclock[aiohttp]."""
        monkeypatch.setitem(sys.modules, "aiohttp", None)
        monkeypatch.delitem(sys.modules, "asynclock.integrations.aiohttp")
        with pytest.raises(ImportError, match=r"asynclock\[aiohttp\]"):
            importlib.import_module("asynclock.integrations.aiohttp")


# -- Retry-After ------------------------------------------------------------------------


class TestRetryAfter:
    async def test_fastapi_hint_is_the_routes_typical_hold_not_the_ttl(
        self, url: str, namespace: str
    ) -> None:
        """FastAPI: a 423's Retry-After is how long the route's requests held the lock
        (0.3 s: 1), not the holder's remaining TTL (about 8 s)."""
        locks = FastAPILocks(url, prefix=namespace)
        app = FastAPI(lifespan=locks.lifespan)
        entered = asyncio.Event()

        @app.post("/items/{item_id}")
        async def work(
            item_id: str,
            hold: float,
            lease: Annotated[Lease, locks.lock("item:{item_id}", ttl=8, timeout=0.1)],
        ) -> None:
            entered.set()
            await asyncio.sleep(hold)

        async with asgi_client(app) as client:
            assert (await client.post("/items/x", params={"hold": 0.3})).status_code == 200
            entered.clear()
            holder = asyncio.create_task(client.post("/items/x", params={"hold": 0.5}))
            await entered.wait()
            refused = await client.post("/items/x", params={"hold": 0})
            assert (await holder).status_code == 200
        assert refused.status_code == 423
        assert refused.headers["Retry-After"] == "1"

    async def test_aiohttp_hint_is_the_routes_typical_hold_not_the_ttl(
        self, url: str, namespace: str
    ) -> None:
        """aiohttp: a 423's Retry-After is the route's typical hold, not the holder's TTL."""
        app = web.Application()
        aiohttp_locks.setup(app, url, prefix=namespace)
        entered = asyncio.Event()

        @aiohttp_locks.locked("item:{item_id}", ttl=8, timeout=0.1)
        async def work(request: web.Request) -> web.Response:
            entered.set()
            await asyncio.sleep(float(request.query["hold"]))
            return web.json_response({})

        app.router.add_post("/items/{item_id}", work)
        async with aiohttp_serving(app) as client:
            assert (await client.post("/items/x", params={"hold": "0.3"})).status == 200
            entered.clear()
            holder = asyncio.create_task(client.post("/items/x", params={"hold": "0.5"}))
            await entered.wait()
            refused = await client.post("/items/x", params={"hold": "0"})
            assert (await holder).status == 200
        assert refused.status == 423
        assert refused.headers["Retry-After"] == "1"
